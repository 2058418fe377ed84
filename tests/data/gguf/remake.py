"""Remake the committed GGUF test files with llama.cpp's own tools (issue 33).

    python tests/data/gguf/remake.py [--llama-cpp DIR] [--bin DIR] [--only NAME,...]

Not run by CI (CI has no llama.cpp): the files it writes are committed beside it.

For every case below:
1. a tiny random Hugging Face model is built with tests/hf_helpers.py (seeded) and saved
   with a byte-level tokenizer.json (tests/hf_helpers.write_tokenizer);
2. llama.cpp's `convert_hf_to_gguf.py` (from the llama.cpp tree given, with its own
   gguf-py) writes the F32 / F16 / BF16 / Q8_0 GGUF; `llama-quantize` makes Q4_0, Q4_1,
   Q4_K_M, ... from the F32 file (`--allow-requantize` is not needed: F32 in);
   the tensor types of every file are asserted after quantizing (a type llama-quantize
   fell back from would make the test prove nothing about that type);
3. transformers' float32 logits over every position of the prompts are recorded
   (`<case>.npz`: `ids_<i>`, `hf_<i>`), and llama.cpp's logits for each GGUF file
   (`<file>__<i>` in the same npz), computed with libllama itself: the low-level ctypes
   bindings of llama-cpp-python's source (`llama_cpp/llama_cpp.py`, loaded without the
   package's high-level modules) over the libllama.so built from the same llama.cpp tree;
   one llama_decode of the whole prompt with logits requested at every position.

ggml-vocab-llama-spm.gguf(.inp/.out) are copied from llama.cpp's models/ folder: its
tokenizer tests' vocabulary-only GGUF of the Llama / Mistral sentencepiece vocabulary and
the token ids llama.cpp expects for each input.

The only changes made to llama.cpp's converter concern the tokenizer metadata (the weights,
names, permutations and model metadata are llama.cpp's): the tiny models' byte-level BPE
tokenizer has no known pre-tokenizer hash, so `get_vocab_base_pre` answers "gpt-2"; there
is no sentencepiece tokenizer.model, so that attempt says FileNotFoundError (llama's
fallback to the BPE vocab); GLM-4.5's and ERNIE-4.5's set_vocab (which need their own
special tokens / a sentencepiece model) are the plain GPT-2 BPE one. Phi-3.5-MoE's model
folder says `PhiMoEForCausalLM` (the published name, the one llama.cpp registers) and
`GPT2Tokenizer` (llama.cpp's Phi-3 vocab reads sentencepiece unless told so). Llama 4 is
converted as `Llama4ForCausalLM` (the text model; llama.cpp's converter registers it).

Widths: the "small" cases (hidden 32, 2 layers) carry the float, Q8_0, Q4_0 and Q4_1
files; the "kq" cases use widths that are multiples of 256 so that every matrix gets the
K-quant type asked for.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _helpers():
    """tests/hf_helpers.py and hf_helpers_more.py (which import each other by name)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import hf_helpers
    import hf_helpers_more
    return hf_helpers, hf_helpers_more
DEFAULT_SRC = ROOT / "build/llamacpp/src/llama_cpp_python-0.3.36"
DEFAULT_BIN = ROOT / "build/llamacpp/build/bin"

SMALL = dict(vocab_size=288, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
# per family: overrides of hf_helpers.make_hf_model / hf_helpers_more.make_more_model
SMALL_FAMILY = {
    "mixtral": dict(intermediate_size=32, num_local_experts=4),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, num_experts=4, mlp_only_layers=[]),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16),
    # llama.cpp's OLMoE has no GQA (its k norm spans n_embd)
    "olmoe": dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=2,
                  num_key_value_heads=2),
    "deepseek_v2": dict(num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                        n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                        v_head_dim=32),
    "deepseek_v3": dict(num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        scoring_func="sigmoid", topk_method="noaux_tc",   # as published configs
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32),
    "granitemoe": dict(intermediate_size=32, num_local_experts=4),
    "granitemoeshared": dict(intermediate_size=32, num_local_experts=4,
                             shared_intermediate_size=32),
    "glm4_moe": dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=32),
    # llama.cpp writes the shared FFN width as intermediate_size // num_key_value_heads
    "ernie4_5_moe": dict(intermediate_size=32, moe_intermediate_size=32, moe_num_experts=4,
                         moe_k=2, moe_layer_start_index=1, moe_layer_end_index=1),
}
KQ = dict(vocab_size=288, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2)
KQ_FAMILY = {
    "mixtral": dict(intermediate_size=256, num_local_experts=4),
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=256, num_experts=4,
                      head_dim=64),
}

# case -> (family, widths, overrides, {file suffix: how it is made})
F_FLOAT = {"F32": ("convert", "f32"), "F16": ("convert", "f16"), "BF16": ("convert", "bf16"),
           "Q8_0": ("convert", "q8_0")}
CASES = {
    **{f"{fam}": (fam, SMALL, SMALL_FAMILY[fam], {"F32": F_FLOAT["F32"], "Q8_0": F_FLOAT["Q8_0"]})
       for fam in SMALL_FAMILY if fam != "qwen3_moe"},
    # Qwen3-MoE's F32 file is a split GGUF (convert_hf_to_gguf.py --split-max-tensors 10):
    # qwen3_moe-F32-0000K-of-0000N.gguf
    "qwen3_moe": ("qwen3_moe", SMALL, SMALL_FAMILY["qwen3_moe"],
                  {"F32": ("split", "f32"), "Q8_0": F_FLOAT["Q8_0"]}),
    # the same model as "mixtral" (its F32 / Q8_0 files and logits), in the other types
    "mixtral_types": ("mixtral", SMALL, dict(SMALL_FAMILY["mixtral"]),
                      {"F16": F_FLOAT["F16"], "BF16": F_FLOAT["BF16"], "Q4_0": ("quantize", "Q4_0"),
                       "Q4_1": ("quantize", "Q4_1"), "MXFP4_MOE": ("quantize", "MXFP4_MOE")}),
    # Q5_K (+ Q6_K), and Q6_K: one layer, two experts, widths 256
    "mixtral_kq5": ("mixtral", dict(KQ, num_hidden_layers=1),
                    dict(KQ_FAMILY["mixtral"], num_local_experts=2, num_experts_per_tok=1),
                    {"Q5_K_M": ("quantize", "Q5_K_M"), "Q6_K": ("quantize", "Q6_K")}),
    # tied embeddings: no output.weight in the file (llama.cpp's lm_head is token_embd);
    # F32 and Q8_0 at the small widths, Q4_K_M at widths 256 (one layer, two experts)
    "qwen3_moe_tied": ("qwen3_moe", SMALL, dict(SMALL_FAMILY["qwen3_moe"], tie_word_embeddings=True),
                       {"F32": F_FLOAT["F32"], "Q8_0": F_FLOAT["Q8_0"]}),
    "qwen3_moe_kq_tied": ("qwen3_moe", dict(KQ, num_hidden_layers=1),
                          dict(KQ_FAMILY["qwen3_moe"], num_experts=2, tie_word_embeddings=True),
                          {"Q4_K_M": ("quantize", "Q4_K_M")}),
    # DeepSeek-V2 with YaRN (rope.scaling.* and yarn_log_multiplier) and group-limited routing
    "deepseek_v2_yarn": ("deepseek_v2", SMALL, dict(
        SMALL_FAMILY["deepseek_v2"], topk_method="group_limited_greedy", n_group=2, topk_group=1,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                      "beta_slow": 1}), {"Q8_0": F_FLOAT["Q8_0"]}),
    # gpt-oss (issue 32): sinks, a sliding window of 4 on the even layer, YaRN, biases, the
    # router's bias, the SwiGLU clamp reached; F32 and llama-quantize's MXFP4_MOE (MXFP4
    # experts: kept byte for byte by the converter)
    "gpt_oss": ("gpt_oss", SMALL, dict(intermediate_size=32, num_local_experts=4,
                                       num_experts_per_tok=2, head_dim=16, sliding_window=4),
                {"F32": F_FLOAT["F32"], "MXFP4_MOE": ("quantize", "MXFP4_MOE")}),
    # Phi-3.5-MoE: LayerNorms with biases, q/k/v/o and lm_head biases, LongRoPE (equal
    # mscales, the value llama.cpp writes as rope.scaling.attn_factor), a window of 8
    "phimoe": ("phimoe", SMALL, dict(intermediate_size=32, num_local_experts=4, head_dim=16),
               {"F32": F_FLOAT["F32"], "Q8_0": F_FLOAT["Q8_0"]}),
    # Llama 4 (text): dense and MoE layers interleaved, the shared expert, the fourth layer
    # NoPE, q/k norms; chunk 8192, floor_scale 8192 and attn_scale 0.1 are what llama.cpp's
    # graph fixes (the file does not say)
    "llama4": ("llama4", dict(SMALL, num_hidden_layers=4), dict(
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=16,
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False), {"F32": F_FLOAT["F32"], "Q8_0": F_FLOAT["Q8_0"]}),
    # Llama 4 with llama3 rope scaling (Scout's kind): llama.cpp writes only rope_freqs.weight;
    # theta 10000 over head_dim 16 puts two of the 8 frequencies in the blend band. F32 only
    # (the file's size; fewer than 4 layers abort in libllama)
    "llama4_rope": ("llama4", dict(SMALL, num_hidden_layers=4), dict(
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=16, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0,
                          high_freq_factor=8.0, original_max_position_embeddings=4096),
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False), {"F32": F_FLOAT["F32"]}),
    # a dense Llama (architecture llama without experts): refused
    "llama_dense": ("llama", SMALL, dict(intermediate_size=64), {"Q8_0": ("convert", "q8_0")}),
    **{f"{fam}_kq": (fam, KQ, KQ_FAMILY[fam],
                     {"F32": ("convert-temp", "f32"), "Q4_K_M": ("quantize", "Q4_K_M")})
       for fam in KQ_FAMILY},
}
# the GGML types each file must hold for its 2-D weights (after llama-quantize)
EXPECTED_TYPES = {"F32": {"F32"}, "F16": {"F16"}, "BF16": {"BF16"}, "Q8_0": {"Q8_0"},
                  "Q4_0": {"Q4_0", "Q6_K", "Q8_0"}, "Q4_1": {"Q4_1", "Q6_K", "Q8_0"},
                  "Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}, "MXFP4_MOE": {"MXFP4", "Q8_0", "F16", "BF16", "F32"}}
MUST_HAVE = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
             "MXFP4_MOE": "MXFP4"}
PROMPTS = ([1, 17, 200, 45, 3, 99, 150, 7, 250, 31, 64, 128], [5, 260, 11],
           [int(x) for x in np.random.default_rng(33).integers(0, 288, 32)])
# llama.cpp's logits of quantized files are kept as float16 (their errors are ~1e-2);
# transformers' and the float files' as float32
FLOAT_KINDS = ("F32", "F16", "BF16")


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
          ("o", "n"), ("Ġ", "s"), ("r", "e"), ("a", "t"), ("Ġ", "w"), ("e", "n"), ("Ġ", "o"),
          ("n", "d"), ("Ġa", "nd"), ("o", "r")]


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer.json: the 256 byte tokens and 16 merges (llama.cpp
    needs merges), 272 tokens of the models' 288; with a tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
         "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                          "{% endfor %}"}))


def make_model(fam: str, widths: dict, over: dict, seed: int = 0):
    hf_helpers, hf_helpers_more = _helpers()
    kw = dict(widths, **over)
    if fam == "llama":
        _, tr = hf_helpers._imports()
        return hf_helpers.random_model(tr.LlamaConfig(**dict(kw, num_hidden_layers=1)),
                                       tr.LlamaForCausalLM, seed)
    if fam == "gpt_oss":
        return make_gpt_oss(kw, seed)
    if fam == "phimoe":
        return make_phimoe(kw, seed)
    if fam == "llama4":
        _, tr = hf_helpers._imports()
        return hf_helpers.random_model(tr.Llama4TextConfig(**kw), tr.Llama4ForCausalLM, seed)
    if fam in hf_helpers_more.MORE_FAMILIES:
        return hf_helpers_more.make_more_model(fam, seed, **kw)
    return hf_helpers.make_hf_model(fam, seed, **kw)


def make_gpt_oss(kw: dict, seed: int):
    """A tiny random gpt-oss as tests/test_convert_gptoss.py builds one: YaRN (factor 4 over
    16 positions), sinks, router bias, gate/up pre-activations past the clamp."""
    hf_helpers, _ = _helpers()
    torch, tr = hf_helpers._imports()
    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    cfg = tr.GptOssConfig(**dict(kw, max_position_embeddings=64, rope_parameters=rope))
    model = hf_helpers.random_model(cfg, tr.GptOssForCausalLM, seed)
    with torch.no_grad():
        for lyr in model.model.layers:
            lyr.self_attn.sinks.normal_(0.0, 1.0)
            lyr.mlp.experts.gate_up_proj.mul_(4.0)
            lyr.mlp.router.bias.normal_(0.0, 0.5)
    return model


def make_phimoe(kw: dict, seed: int):
    """A tiny random Phi-3.5-MoE (LongRoPE over 16 -> 64 positions)."""
    import math
    hf_helpers, _ = _helpers()
    torch, tr = hf_helpers._imports()
    D, orig, longest = kw.pop("head_dim"), 16, 64
    rng = np.random.default_rng(seed + 7)
    mscale = math.sqrt(1 + math.log(longest / orig) / math.log(orig))   # what llama.cpp writes
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_mscale": mscale,
            "long_mscale": mscale, "original_max_position_embeddings": orig,
            "short_factor": [float(v) for v in 1.0 + rng.random(D // 2) * 3],
            "long_factor": [float(v) for v in 4.0 + rng.random(D // 2) * 8]}
    cfg = tr.PhimoeConfig(**dict(kw, max_position_embeddings=longest, attention_bias=True,
                                 lm_head_bias=True, sliding_window=8, router_jitter_noise=0.01,
                                 num_experts_per_tok=2, rope_parameters=rope))
    return hf_helpers.random_model(cfg, tr.PhimoeForCausalLM, seed)


def run_convert(src: Path, hf_dir: Path, outtype: str, out: Path, extra=()) -> None:
    code = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        f"sys.path.insert(1, {str(src / 'gguf-py')!r})\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'\n"
        "def _no_spm(self, *a, **k):\n"
        "    raise FileNotFoundError('no tokenizer.model')\n"
        "b.TextModel._set_vocab_sentencepiece = _no_spm\n"
        "import conversion.glm as g, conversion.ernie as e\n"
        "g.Glm4MoeModel.set_vocab = b.TextModel._set_vocab_gpt2\n"
        "e.Ernie4_5Model.set_vocab = b.TextModel._set_vocab_gpt2\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outtype', {outtype!r}, "
        f"'--outfile', {str(out)!r}] + {list(extra)!r}\n"
        f"runpy.run_path({str(src / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"convert_hf_to_gguf failed for {hf_dir}:\n{r.stderr[-3000:]}")


def run_quantize(bindir: Path, src: Path, out: Path, kind: str) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bindir))
    r = subprocess.run([str(bindir / "llama-quantize"), str(src), str(out), kind],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"llama-quantize {kind} failed:\n{r.stderr[-3000:]}")


def tensor_types(path: Path) -> dict:
    import gguf
    rd = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in rd.tensors}


def check_types(path: Path, kind: str) -> None:
    types_ = tensor_types(path)
    mats = {n: t for n, t in types_.items() if not n.endswith((".bias", "_norm.weight", "norm.weight"))
            and "ffn_gate_inp" not in n and "exp_probs_b" not in n and "shexp_gate" not in n
            and not n.startswith(("rope_factors", "rope_freqs"))}
    bad = {n: t for n, t in mats.items() if t not in EXPECTED_TYPES[kind]}
    if bad:
        raise SystemExit(f"{path.name}: unexpected tensor types {bad}")
    if kind in MUST_HAVE and MUST_HAVE[kind] not in mats.values():
        raise SystemExit(f"{path.name}: no {MUST_HAVE[kind]} tensor at all")


class LlamaLib:
    """libllama through llama-cpp-python's ctypes bindings (its source, not installed)."""

    def __init__(self, src: Path, bindir: Path):
        os.environ["LLAMA_CPP_LIB_PATH"] = str(bindir)
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(src / "llama_cpp")]
        sys.modules.setdefault("llama_cpp", pkg)
        self.ll = importlib.import_module("llama_cpp.llama_cpp")
        self.ll.llama_backend_init()
        cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
        self._cb = cb
        if not os.environ.get("REMAKE_LOG"):
            self.ll.llama_log_set(cb, ctypes.c_void_p(0))

    def logits(self, path: Path, ids: list[int]) -> np.ndarray:
        ll = self.ll
        mp = ll.llama_model_default_params()
        model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise SystemExit(f"libllama could not load {path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 64, 64, 2, 2
        ctx = ll.llama_init_from_model(model, cp)
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        batch = ll.llama_batch_init(len(ids), 0, 1)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        batch.n_tokens = len(ids)
        if ll.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed on {path}")
        out = np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), (n_vocab,)).copy()
                        for i in range(len(ids))])
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(model)
        return out


def make_case(name: str, src: Path, bindir: Path, lib: LlamaLib, work: Path) -> None:
    hf_helpers, _ = _helpers()
    fam, widths, over, files = CASES[name]
    model = make_model(fam, widths, over)
    hf_dir = work / name
    hf_helpers.save(model, hf_dir)
    write_tokenizer(hf_dir)
    if fam == "phimoe":     # the published name (llama.cpp's); its Phi-3 vocab reads GPT-2 BPE
        for fname, key, value in (("config.json", "architectures", ["PhiMoEForCausalLM"]),
                                  ("tokenizer_config.json", "tokenizer_class", "GPT2Tokenizer")):
            cfg = json.loads((hf_dir / fname).read_text())
            cfg[key] = value
            (hf_dir / fname).write_text(json.dumps(cfg, indent=1))
    rec = {}
    for i, ids in enumerate(PROMPTS):
        rec[f"ids_{i}"] = np.array(ids, np.int32)
        rec[f"hf_{i}"] = hf_helpers.hf_logits(model, ids).astype(np.float32)
    f32 = work / f"{name}-F32-temp.gguf"            # what llama-quantize starts from
    run_convert(src, hf_dir, "f32", f32)
    for kind, (how, arg) in files.items():
        out = (work if how == "convert-temp" else HERE) / f"{name}-{kind}.gguf"
        if how == "split":
            run_convert(src, hf_dir, arg, out, ["--split-max-tensors", "10"])
            parts = sorted(HERE.glob(f"{name}-{kind}-*-of-*.gguf"))
            if len(parts) < 2:
                raise SystemExit(f"{name}: expected a split GGUF, got {parts}")
            for p in parts:
                check_types(p, kind)
            out = parts[0]
            print(f"{name}: {len(parts)} files", flush=True)
        elif how.startswith("convert"):
            run_convert(src, hf_dir, arg, out)
        else:
            run_quantize(bindir, f32, out, arg)
        if how != "split":
            check_types(out, kind)
        if fam == "llama":
            continue                               # only the refusal is tested
        for i, ids in enumerate(PROMPTS):
            rec[f"{kind}__{i}"] = lib.logits(out, ids).astype(
                np.float32 if kind in FLOAT_KINDS else np.float16)
        if fam == "llama":
            continue
        err = max(hf_helpers.rel_err(rec[f"{kind}__{i}"], rec[f"hf_{i}"]) for i in range(len(PROMPTS)))
        print(f"{name}-{kind}: {out.stat().st_size / 1024:.0f} KiB, llama.cpp vs transformers "
              f"max rel logit error {err:.2e}", flush=True)
    np.savez_compressed(HERE / f"{name}.npz", **rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_SRC,
                    help="llama-cpp-python source tree (vendor/llama.cpp inside)")
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN, help="llama.cpp build/bin")
    ap.add_argument("--only", default="", help="comma-separated case names")
    a = ap.parse_args(argv)
    only = [c for c in a.only.split(",") if c] or list(CASES)
    lib = LlamaLib(a.llama_cpp, a.bin)
    src = a.llama_cpp / "vendor/llama.cpp"
    # llama.cpp's own tokenizer test vectors for Mixtral's (Llama's) sentencepiece vocabulary
    for ext in ("", ".inp", ".out"):
        name = f"ggml-vocab-llama-spm.gguf{ext}"
        (HERE / name).write_bytes((src / "models" / name).read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        failed = []
        for name in only:
            try:
                make_case(name, src, a.bin, lib, Path(tmp))
            except SystemExit as e:
                print(f"{name}: FAILED: {str(e)[-1500:]}", flush=True)
                failed.append(name)
    ver = subprocess.run([str(a.bin / "llama-bench"), "--version"], capture_output=True,
                         text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(a.bin)))
    import gguf
    import torch
    import transformers
    info = {"llama.cpp": (ver.stdout + ver.stderr).strip().splitlines()[0],
            "llama.cpp source": f"llama-cpp-python {a.llama_cpp.name.rsplit('-', 1)[-1]} "
                                f"vendor/llama.cpp (convert_hf_to_gguf.py with its gguf-py)",
            "gguf (reader)": gguf.__version__ if hasattr(gguf, "__version__") else "?",
            "transformers": transformers.__version__, "torch": torch.__version__,
            "prompts": [list(p) for p in PROMPTS]}
    (HERE / "SOURCE.json").write_text(json.dumps(info) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
