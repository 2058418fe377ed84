"""The benchmark model of bench_vs_llamacpp.py and its conversions: the Mixtral-shaped
random checkpoint (fp16 safetensors), its Colibri conversion (cached, keyed on the
converter's code and settings), the F16 GGUF written with `gguf` and the Q4_0 GGUF from
`llama_model_quantize`; and each format's per-tensor inventory (roles, bits per weight,
bytes read per token). Also the DeepSeek-V3-shaped random checkpoint of bench_pipeline.py
(build_hf_deepseek; its Colibri conversion is build_colibri's too)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT

HERE = Path(__file__).resolve().parent
WORK = OUT / "vs_llamacpp"

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=1e6)
ENGINES = ("colibri", "llama.cpp", "transformers")
SPEC_VERSION = 1          # bump to rebuild the cached models


def log(*a):
    print(*a, file=sys.stderr, flush=True)



def build_hf(path: Path) -> Path:
    spec = {**SHAPE, "version": SPEC_VERSION}
    marker = path / "bench_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    import transformers as tr
    t0 = time.time()
    log(f"building the random Mixtral model in {path} ...")
    torch.manual_seed(0)
    cfg = tr.MixtralConfig(**SHAPE, tie_word_embeddings=False, sliding_window=None,
                           bos_token_id=1, eos_token_id=None)   # no EOS: always --tokens tokens
    with torch.no_grad():
        model = tr.MixtralForCausalLM(cfg).eval()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:                      # q/k/v/o, router, experts, lm_head
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
        model.half().save_pretrained(path, safe_serialization=True)
    del model
    marker.write_text(json.dumps(spec))
    log(f"  built in {time.time() - t0:.0f} s")
    return path


# The DeepSeek-V3-shaped benchmark model of issue 14 (bench_pipeline.py): the same hidden
# size, heads, vocabulary and depth as SHAPE, the first layer dense, MLA attention, 64 small
# routed experts top-8 with group-limited sigmoid routing, one shared expert.
DEEPSEEK_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                      first_k_dense_replace=1, n_routed_experts=64, moe_intermediate_size=256,
                      num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=384,
                      kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
                      v_head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      rope_theta=10000.0)
DEEPSEEK_WORK = OUT / "vs_deepseek"


def build_hf_deepseek(path: Path) -> Path:
    """A random DeepseekV3ForCausalLM of DEEPSEEK_SHAPE saved as fp16 safetensors (cached;
    initialised as build_hf does, plus e_score_correction_bias ~ N(0, 0.1) so that the
    bias-corrected group choice is exercised)."""
    spec = {**DEEPSEEK_SHAPE, "family": "deepseek_v3", "version": SPEC_VERSION}
    marker = path / "bench_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    import transformers as tr
    t0 = time.time()
    log(f"building the random DeepSeek-V3-shaped model in {path} ...")
    torch.manual_seed(0)
    cfg = tr.DeepseekV3Config(**DEEPSEEK_SHAPE, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_id=None)
    with torch.no_grad():
        model = tr.DeepseekV3ForCausalLM(cfg).eval()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        model.half().save_pretrained(path, safe_serialization=True)
    del model
    marker.write_text(json.dumps(spec))
    log(f"  built in {time.time() - t0:.0f} s")
    return path


CONVERT_KW = dict(bits=4)


def _convert_key(hf: Path) -> dict:
    """What the cached Colibri conversion depends on: the model, the convert() arguments
    and the converter's code (so a changed default or rounding rule reconverts)."""
    import hashlib
    import colibri_core
    pkg = Path(colibri_core.__file__).parent
    code = hashlib.sha256(b"".join((pkg / f).read_bytes() for f in
                                   ("format/quant.py", "convert/__init__.py", "convert/awq.py")))
    return {"spec": json.loads((hf / "bench_spec.json").read_text()), "convert": CONVERT_KW,
            "code": code.hexdigest()}


def build_colibri(hf: Path, path: Path) -> Path:
    marker = path.with_name(path.name + ".key.json")
    key = _convert_key(hf)
    if (path / "config.json").exists() and marker.exists() and json.loads(marker.read_text()) == key:
        return path
    from colibri_core.convert import convert
    t0 = time.time()
    log(f"converting to Colibri q4 in {path} ...")
    convert(hf, path, overwrite=True, **CONVERT_KW)
    marker.write_text(json.dumps(key))
    log(f"  converted in {time.time() - t0:.0f} s")
    return path


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF rotates halves (NeoX order); llama.cpp's LLAMA arch rotates adjacent pairs:
    # the same row permutation as convert_hf_to_gguf.py's LlamaModel.permute.
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def build_gguf_f16(hf: Path, path: Path) -> Path:
    if path.exists() and path.stat().st_mtime >= (hf / "bench_spec.json").stat().st_mtime:
        return path
    import gguf
    from safetensors import safe_open
    t0 = time.time()
    log(f"writing the F16 GGUF {path} ...")
    c = json.loads((hf / "config.json").read_text())
    H, L, E = c["hidden_size"], c["num_hidden_layers"], c["num_local_experts"]
    nh, nkv, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 1e6))
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("colibri-bench-mixtral")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_rope_dimension_count(H // nh)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(float(theta))
    w.add_expert_count(E)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # A SentencePiece-style vocabulary of placeholder pieces (the benchmark feeds ids).
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"\u2581t{i}" for i in range(V - len(toks))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
        [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (V - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    f = safe_open(str(hf / "model.safetensors"), "np")

    def t(name):
        return f.get_tensor(name)

    def f32(a):
        return np.ascontiguousarray(a, np.float32)

    w.add_tensor("token_embd.weight", t("model.embed_tokens.weight"))
    for i in range(L):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32(t(p + "input_layernorm.weight")))
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute_qk(t(p + "self_attn.q_proj.weight"), nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute_qk(t(p + "self_attn.k_proj.weight"), nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(p + "self_attn.v_proj.weight"))
        w.add_tensor(f"blk.{i}.attn_output.weight", t(p + "self_attn.o_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", f32(t(p + "post_attention_layernorm.weight")))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", f32(t(p + "block_sparse_moe.gate.weight")))
        for ours, theirs in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            w.add_tensor(f"blk.{i}.ffn_{ours}_exps.weight",
                         np.stack([t(p + f"block_sparse_moe.experts.{e}.{theirs}.weight")
                                   for e in range(E)]))
    w.add_tensor("output_norm.weight", f32(t("model.norm.weight")))
    w.add_tensor("output.weight", t("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    log(f"  written in {time.time() - t0:.0f} s")
    return path


def build_gguf_q4(f16: Path, path: Path, threads: int) -> Path:
    if path.exists() and path.stat().st_mtime >= f16.stat().st_mtime:
        return path
    import ctypes
    import llama_cpp
    t0 = time.time()
    log(f"quantizing to Q4_0: {path} ...")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    tmp = path.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    os.replace(tmp, path)
    log(f"  quantized in {time.time() - t0:.0f} s")
    return path


# ----------------------------------------------------------------------------- inventories

ROLES = ("embed", "attn_q", "attn_k", "attn_v", "attn_o", "norms", "router",
         "expert_gate", "expert_up", "expert_down", "lm_head")


def _role_colibri(file: str, name: str) -> str:
    if file.startswith("expert_"):
        return {"w1": "expert_gate", "w3": "expert_up", "w2": "expert_down"}[name]
    if file == "routing.bin":
        return "router"
    if name == "embed" or name == "lm_head":
        return name
    if name.endswith("norm"):
        return "norms"
    tail = name.rsplit(".", 1)[-1]
    return {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_o"}.get(tail, "other:" + tail)


def _role_gguf(name: str) -> str:
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    tail = base.rsplit(".", 1)[-1]
    return {"token_embd": "embed", "output": "lm_head", "attn_q": "attn_q", "attn_k": "attn_k",
            "attn_v": "attn_v", "attn_output": "attn_o", "ffn_gate_inp": "router",
            "ffn_gate_exps": "expert_gate", "ffn_up_exps": "expert_up",
            "ffn_down_exps": "expert_down", "attn_norm": "norms", "ffn_norm": "norms",
            "output_norm": "norms"}.get(tail, "other:" + tail)


def _summarize(rows, vocab: int, k: int, n_exp: int) -> dict:
    """rows: (role, dtype, numel, nbytes) -> per role {dtype, bits/weight, bytes, per token}."""
    roles: dict = {}
    for role, dt, n, b in rows:
        r = roles.setdefault(role, {"dtypes": {}, "numel": 0, "bytes": 0})
        r["dtypes"][dt] = r["dtypes"].get(dt, 0) + n
        r["numel"] += n
        r["bytes"] += b
    per_tok = 0
    for role, r in roles.items():
        r["bits_per_weight"] = 8 * r["bytes"] / r["numel"]
        r["dtype"] = "+".join(sorted(r["dtypes"], key=lambda d: -r["dtypes"][d]))
        del r["dtypes"]
        if role == "embed":
            r["bytes_per_token"] = r["bytes"] / vocab         # one row looked up
        elif role.startswith("expert_"):
            r["bytes_per_token"] = r["bytes"] * k / n_exp     # k of E experts per layer
        else:
            r["bytes_per_token"] = r["bytes"]
        per_tok += r["bytes_per_token"]
    return {"roles": roles, "bytes_per_token": per_tok,
            "total_bytes": sum(r["bytes"] for r in roles.values())}


def colibri_inventory(path: Path) -> dict:
    from colibri_core.format.modelfile import ContainerFile
    cfg = json.loads((path / "config.json").read_text())
    rows = []
    for fn in sorted(cfg["files"]):
        if not fn.endswith(".bin"):
            continue
        cf = ContainerFile(path / fn)
        for s in cf.sections.values():
            if s.name.endswith("act_scale"):
                rows.append(("act_scales", "f32", int(np.prod(s.shape)), sum(n for _, n in s.parts.values())))
                continue
            rows.append((_role_colibri(fn, s.name), s.dtype, int(np.prod(s.shape)),
                         sum(n for _, n in s.parts.values())))
        cf.close()
    inv = _summarize(rows, cfg["vocab_size"], cfg["top_k"], cfg["num_experts"])
    inv["quantization"] = cfg.get("quantization")
    return inv


def gguf_inventory(path: Path) -> dict:
    import gguf
    r = gguf.GGUFReader(str(path))
    rows = [(_role_gguf(t.name), t.tensor_type.name, int(t.n_elements), int(t.n_bytes))
            for t in r.tensors]
    f = r.fields

    def val(key):
        fl = f[key]
        return int(fl.parts[fl.data[0]][0])
    return _summarize(rows, val("llama.vocab_size") if "llama.vocab_size" in f else 32000,
                      val("llama.expert_used_count"), val("llama.expert_count"))


# ----------------------------------------------------------------------------- measuring
