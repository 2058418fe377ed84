"""A Qwen2-MoE Hugging Face checkpoint as an F32 GGUF for llama.cpp's `qwen2moe` graph,
for fidelity comparisons on the trained models (precision_sensitivity.py).

llama.cpp's qwen2moe builds every layer as MoE (routed experts of one width, softmax
weights not renormalized, plus a shared expert behind a sigmoid gate); our trained models
have a dense first layer. That layer is written as an MoE layer that computes exactly the
dense FFN (the tensors: tests/qwen2moe_helpers.py, checked by tests/test_qwen2moe_gguf.py):

- every routed expert is the dense FFN itself, its down projection scaled by E / k, and
  the router is zero: softmax gives each expert 1/E, any k of them sum to 1/E * k * E/k = 1
  (E / k is a power of two for both models, so the scaling is exact in F32, and Q4_0's
  per-block scale absorbs it exactly);
- the shared expert's weights are zero (its gate vector a tiny constant: llama.cpp's
  sigmoid is silu(x) / x, which a zero vector would make 0 / 0).

The routed experts' width is the larger of the dense and the MoE widths; narrower experts
are padded with zero rows (gate, up) and zero columns (down). A zero row gives silu(0) * 0
= 0 and the padded columns are whole 32-value blocks of zeros (both widths are multiples
of 32), so the padding adds nothing to any sum and Q4_0 quantizes every real block as it
would unpadded. The result is llama.cpp running *this* model, at the cost of larger
tensors; it is for fidelity only, never for timing.

No tokenizer: the GGUF says `tokenizer.ggml.model = none` with the vocabulary's size, and
the caller feeds token ids.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.qwen2moe_helpers import qwen2moe_tensors


def write_qwen2moe_gguf(hf: Path, path: Path) -> dict:
    """Write `path` (F32 GGUF, arch qwen2moe) from the checkpoint in `hf`; returns a summary
    (which layers were dense, the widths used)."""
    import gguf
    hp, summary, tensors = qwen2moe_tensors(hf)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen2moe")
    w.add_name(hf.name)
    for key, value in hp.items():
        getattr(w, f"add_{key}")(value)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("none")
    for name, a in tensors:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return summary


def quantize(src: Path, dst: Path, ftype_name: str, threads: int = 2) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize through llama-cpp-python), with its
    default choice of types per tensor for `ftype_name` (e.g. "MOSTLY_Q4_0")."""
    import ctypes
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype_name}")
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype_name}) returned {rc}")
    os.replace(tmp, dst)
    return dst


def tensor_types(path: Path) -> dict:
    """{tensor name: ggml type name} of a GGUF file (the types llama.cpp's quantizer
    chose per tensor)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in r.tensors}


def llamacpp_logits(path: Path, seqs: list, threads: int = 2) -> np.ndarray:
    """Next-token logits at every position of every sequence, [N positions, V] float64,
    from llama.cpp (llama-cpp-python, logits for all positions, one sequence at a time)."""
    import llama_cpp
    n_ctx = max(len(s) for s in seqs)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(n_ctx, 32), n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=True,
                          use_mmap=True, verbose=False)
    out = []
    for s in seqs:
        llm.reset()
        llm.eval(list(s))
        out.append(np.array(llm.scores[:len(s)], np.float64))
    llm.close()
    return np.concatenate(out)
