"""Random-weight models of published MoE shapes at full size, for bench_realscale.py:
Colibri's format at the converter's default precisions, and llama.cpp GGUFs.

    python -m benchmarks.speed._realscale_models write olmoe-1b-7b [--dir D] [--no-gguf]
    python -m benchmarks.speed._realscale_models delete olmoe-1b-7b [--dir D]
    python -m benchmarks.speed._realscale_models sizes

Shapes (SHAPES: OLMoE-1B-7B, Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral-8x7B, gpt-oss-20b)
are the published Hugging Face configs, mapped to Colibri's ModelConfig
by the converter's own code (convert.families.model_config_fields), so a shape is what
`colibri convert` would make of the real checkpoint. Weights are not quantized floats
(7-30 B of them would take hours): the quantized bytes are drawn directly -- random
nibbles / codes, zero points at the middle level, and per-tensor scales 1 / sqrt(levels'
variance x fan-in), so that every product keeps its input's scale and the logits stay
finite (bench_realscale.py asserts that at every step). Colibri's precisions are the
converter's defaults for --bits 4: experts, dense and shared FFNs and q/o projections
q4 (group 128), k/v projections and the embedding q8, the lm_head q6, norms and routers
f32 (gpt-oss's experts MXFP4, as its checkpoint ships them). The GGUF is what
llama-quantize Q4_0 makes: every matrix Q4_0, `output` Q6_K, norms and routers
(`ffn_gate_inp`) F32, no tokenizer (`tokenizer.ggml.model = none`); DeepSeek-V2-Lite's in
llama.cpp's `deepseek2` layout (_realscale_deepseek2.py); gpt-oss-20b's as ggml-org's MXFP4
release, experts MXFP4 and the other matrices Q8_0 (_realscale_gptoss.py).

Routers are random (N(0, 1/hidden) rows): they route near-uniformly, so every expert is
used about equally -- unlike a trained model, whose routing is skewed. Say so beside
every figure.

Written tensor by tensor (modelfile.write_container streams; GGUFWriter gets every
tensor's info first, then the data one tensor at a time): memory stays at the largest
tensor. Files are checked to be really on disk (st_blocks x 512 >= size: a sparse file
would read back as zeros without any I/O), and free disk >= need + 10 GB is checked
before writing. One shape on disk at a time (`write` deletes the others under --dir).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.speed import _realscale_gptoss as gptoss

DEFAULT_DIR = Path(os.environ.get("COLIBRI_REALSCALE_DIR", "/work/realscale_models"))
SPARE_DISK = 10 << 30
GROUP = 128

# Published configs (config.json of each Hugging Face repository), the fields that shape
# the model.
SHAPES = {
    "olmoe-1b-7b": {     # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
        "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "vocab_size": 50304, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-05, "norm_topk_prob": False, "clip_qkv": None,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "eos_token_id": 50279, "pad_token_id": 1, "bos_token_id": None},
    "qwen3-30b-a3b": {   # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645},
    "deepseek-v2-lite": {   # deepseek-ai/DeepSeek-V2-Lite
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40,
                                              "original_max_position_embeddings": 4096,
                                              "beta_fast": 32, "beta_slow": 1,
                                              "mscale": 0.707, "mscale_all_dim": 0.707},
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "rms_norm_eps": 1e-06,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 100000, "eos_token_id": 100001, "aux_loss_alpha": 0.001},
}
SHAPES["mixtral-8x7b"] = {   # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05, "sliding_window": None, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
SHAPES["gpt-oss-20b"] = gptoss.SHAPE      # openai/gpt-oss-20b (_realscale_gptoss.py)
GGUF_ARCH = {"olmoe-1b-7b": "olmoe", "qwen3-30b-a3b": "qwen3moe", "mixtral-8x7b": "llama",
             "deepseek-v2-lite": "deepseek2", "gpt-oss-20b": "gpt-oss"}
GGUF_FTYPE = {"gpt-oss": "MOSTLY_MXFP4_MOE"}       # llama-bench's "MXFP4 MoE"; others Q4_0


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def model_config(shape: str):
    """Colibri's ModelConfig of a shape, by the converter's mapping of the HF config."""
    from colibri_core.config import ModelConfig
    from colibri_core.convert.families import model_config_fields
    return ModelConfig.model_validate(model_config_fields(SHAPES[shape]))


# ----------------------------------------------------------------------------- Colibri

class Draw:
    """Random quantized tensors whose products keep their input's scale."""

    # variance of (q - zero): q4 codes 1..15 about 8 with code 0 drawn as 8 (values -7..7,
    # 0 twice as often: mean 0), q6 0..63 about 32, q8 -127..127 about 0. q4's codes must
    # have mean 0: uniform 0..15 about 8 have mean -0.5, a rank-one part in every matrix
    # (-0.5 x scale x the input's sum) that grows layer by layer until every token's
    # hidden state points the same way and routes to the same experts (measured: 99 % hits
    # for random tokens under an 8 GiB budget on Qwen3-30B-A3B's shape).
    VAR = {"q4": 2 * sum(k * k for k in range(1, 8)) / 16, "q6": (64 ** 2 - 1) / 12 + 0.25,
           "q8": 127 * 128 / 3}

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def bytes(self, *shape) -> np.ndarray:
        return np.frombuffer(self.rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape)

    def nibbles(self, *shape) -> np.ndarray:
        """Random bytes of two q4 codes each, code 0 replaced by 8 (mean-zero values)."""
        b = self.bytes(*shape).copy()
        b ^= ((b & 0x0F) == 0).astype(np.uint8) << 3
        b ^= ((b >> 4) == 0).astype(np.uint8) << 7
        return b

    def scales(self, rows: int, ng: int, s: float) -> np.ndarray:
        return (s * (0.75 + 0.5 * self.rng.random((rows, ng), np.float32))).astype(np.float32)

    def mat(self, kind: str, rows: int, cols: int, gain: float = 1.0):
        from colibri_core.format.quant import Q4Tensor, Q6Tensor, Q8Tensor, padded_cols
        cp = padded_cols(cols, GROUP)
        ng = cp // GROUP
        s = gain / np.sqrt(self.VAR[kind] * cols)
        if kind == "q4":
            return Q4Tensor(self.nibbles(rows, cp // 2), self.scales(rows, ng, s),
                            np.full((rows, ng), 8, np.uint8), rows, cols, GROUP)
        if kind == "q6":
            return Q6Tensor(self.bytes(rows, cp // 64 * 48), self.scales(rows, ng, s),
                            np.full((rows, ng), 32, np.uint8), rows, cols, GROUP)
        d = self.bytes(rows, cp).view(np.int8).copy()
        d[d == -128] = -127
        return Q8Tensor(d, self.scales(rows, ng, s), rows, cols, GROUP)

    def norm(self, n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    def router(self, E: int, H: int) -> np.ndarray:
        return (self.rng.standard_normal((E, H), np.float32) / np.sqrt(H)).astype(np.float32)

    def small(self, *shape) -> np.ndarray:              # biases and sinks: N(0, 0.02^2)
        return (0.02 * self.rng.standard_normal(shape)).astype(np.float32)


def _main_sections(cfg, dr: Draw):
    from colibri_core.model.mla import mla_shapes
    H, V = cfg.hidden_size, cfg.vocab_size
    # the embedding: unit-variance rows (q8 codes times 1/sqrt(var): gain sqrt(H))
    yield "embed", dr.mat("q8", V, H, gain=np.sqrt(H))
    for L, kind in enumerate(cfg.layer_types):
        p = f"layer.{L}."
        yield p + "attn_norm", dr.norm(H)
        yield p + "ffn_norm", dr.norm(H)
        if cfg.attention == "mla":
            for name, shape in mla_shapes(cfg).items():
                yield p + name, (dr.norm(shape[0]) if len(shape) == 1
                                 else dr.mat("q4", *shape))
        else:
            hd, nh, nkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
            yield p + "wq", dr.mat("q4", nh * hd, H)
            yield p + "wk", dr.mat("q8", nkv * hd, H)
            yield p + "wv", dr.mat("q8", nkv * hd, H)
            yield p + "wo", dr.mat("q4", H, nh * hd)
            if cfg.attention_sinks:                 # gpt-oss: biases on q/k/v/o, sinks
                yield from gptoss.attention_vectors(cfg, dr, p)
            if cfg.qk_norm == "per_head":
                yield p + "q_norm", dr.norm(hd)
                yield p + "k_norm", dr.norm(hd)
            elif cfg.qk_norm == "full":
                yield p + "q_norm", dr.norm(nh * hd)
                yield p + "k_norm", dr.norm(nkv * hd)
        if kind == "dense":
            inter = cfg.intermediate_size
            yield p + "w1", dr.mat("q4", inter, H)
            yield p + "w3", dr.mat("q4", inter, H)
            yield p + "w2", dr.mat("q4", H, inter)
        elif cfg.shared_expert_intermediate_size:
            S = cfg.shared_expert_intermediate_size
            yield p + "shared_w1", dr.mat("q4", S, H)
            yield p + "shared_w3", dr.mat("q4", S, H)
            yield p + "shared_w2", dr.mat("q4", H, S)
    yield "final_norm", dr.norm(H)
    yield "lm_head", dr.mat("q6", V, H)


def _experts(cfg, dr: Draw):
    from colibri_core.model.weights import FFNWeights
    H, I = cfg.hidden_size, cfg.expert_intermediate
    if cfg.architecture == "gpt_oss":                   # MXFP4 with biases
        yield from gptoss.experts(cfg, dr)
        return
    for L in cfg.moe_layers:
        for e in range(cfg.num_experts):
            yield L, e, FFNWeights(dr.mat("q4", I, H), dr.mat("q4", I, H), dr.mat("q4", H, I))


def colibri_bytes(cfg) -> int:
    """The bytes write_colibri writes (parts rounded up to 4 KiB, a header page each)."""
    from colibri_core.format.quant import padded_cols
    r = lambda n: -(-n // 4096) * 4096                             # noqa: E731

    def mat(kind, rows, cols):
        cp = padded_cols(cols, GROUP)
        data = {"q4": cp // 2, "q6": cp // 64 * 48, "q8": cp}[kind] * rows
        return r(data) + r(rows * cp // GROUP * 4) + (r(rows * cp // GROUP) if kind != "q8" else 0)
    H, I = cfg.hidden_size, cfg.expert_intermediate
    expert = 4096 + 2 * mat("q4", I, H) + mat("q4", H, I)
    est = 0
    if cfg.architecture == "gpt_oss":      # MXFP4 experts; the routers' biases, a table page
        expert = gptoss.expert_bytes(cfg, r)
        est = r(4 * cfg.num_experts) * len(cfg.moe_layers) + 4096
    n_exp = len(cfg.moe_layers) * cfg.num_experts
    for name, t in _shapes_only(cfg):
        est += mat(*t) if isinstance(t, tuple) else r(4 * t)
    return est + n_exp * expert + (64 << 10) + 4096 + r(4 * cfg.num_experts * H) * len(cfg.moe_layers)


def _shapes_only(cfg):
    """(name, (kind, rows, cols)) or (name, n) of model.bin's sections, without data."""
    class _S:
        def mat(self, kind, rows, cols, gain=1.0):
            return (kind, rows, cols)

        def norm(self, n):
            return n
        small = norm
    return _main_sections(cfg, _S())


def check_disk(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need + SPARE_DISK:
        raise SystemExit(f"{where}: {free / 2**30:.1f} GiB free, writing needs "
                         f"{need / 2**30:.1f} GiB + {SPARE_DISK / 2**30:.0f} GiB spare")


def check_written(files) -> None:
    """Every file really on disk: st_blocks x 512 >= size (a sparse file reads zeros
    back without I/O, which would make every cold-cache figure a lie)."""
    for f in files:
        st = os.stat(f)
        if st.st_blocks * 512 < st.st_size:
            raise SystemExit(f"{f}: {st.st_blocks * 512} bytes allocated for {st.st_size}: "
                             f"a sparse file")


def write_colibri(shape: str, out: Path, seed: int = 0) -> Path:
    from colibri_core.model.weights import write_model_dir
    cfg = model_config(shape)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(out.parent, colibri_bytes(cfg))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    dr = Draw(seed)
    t = time.perf_counter()
    routing = [(f"layer.{L}.router", dr.router(cfg.num_experts, cfg.hidden_size))
               for L in cfg.moe_layers]
    if cfg.architecture == "gpt_oss":
        routing += gptoss.routing_extra(cfg, dr)
    write_model_dir(tmp, cfg, _main_sections(cfg, dr), routing, _experts(cfg, dr))
    check_written(p for p in tmp.iterdir() if p.suffix == ".bin")
    os.replace(tmp, out)
    log(f"{out}: written in {time.perf_counter() - t:.0f} s, "
        f"{sum(p.stat().st_size for p in out.iterdir()) / 2**30:.2f} GiB")
    return out


# ----------------------------------------------------------------------------- GGUF

Q4_0_BLOCK, Q6_K_BLOCK = 18, 210      # bytes per 32 / 256 values


def q4_0_rows(dr: Draw, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
    """Random Q4_0 blocks [rows, cols / 32 * 18]: an f16 scale d, then 16 bytes whose low
    nibbles are values 0..15 and high nibbles 16..31, value (q - 8) * d (codes as
    Draw.nibbles: mean zero)."""
    nb = cols // 32
    out = dr.nibbles(rows, nb, Q4_0_BLOCK)
    d = (gain / np.sqrt(Draw.VAR["q4"] * cols)) * (0.75 + 0.5 * dr.rng.random((rows, nb)))
    out[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return out.reshape(rows, nb * Q4_0_BLOCK)


def q6_k_rows(dr: Draw, rows: int, cols: int) -> np.ndarray:
    """Random Q6_K blocks [rows, cols / 256 * 210]: ql[128], qh[64], 16 int8 sub-block
    scales, an f16 d; value d * scale * (q - 32), q 0..63."""
    nb = cols // 256
    out = dr.bytes(rows, nb, Q6_K_BLOCK).copy()
    out[:, :, 192:208] = 16                                  # sub-block scales (int8)
    d = 1.0 / np.sqrt(Draw.VAR["q6"] * cols) / 16
    out[:, :, 208:210] = np.full((rows, nb), d, np.float16).view(np.uint8).reshape(rows, nb, 2)
    return out.reshape(rows, nb * Q6_K_BLOCK)


def _gguf_tensors(cfg, dr: Draw):
    """(name, ggml type name, numpy array) of the GGUF, in order; arrays made lazily by
    the yielded callables."""
    H, V, I, E = cfg.hidden_size, cfg.vocab_size, cfg.expert_intermediate, cfg.num_experts
    hd, nh, nkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    f32 = lambda n: (lambda: np.ones(n, np.float32))                      # noqa: E731
    q4 = lambda r, c, g=1.0: (lambda: q4_0_rows(dr, r, c, g))              # noqa: E731
    if cfg.architecture == "gpt_oss":
        yield from gptoss.gguf_tensors(cfg, dr, f32)
        return
    yield "token_embd.weight", "Q4_0", (V, H), q4(V, H, np.sqrt(H))
    if cfg.attention == "mla":
        from benchmarks.speed._realscale_deepseek2 import gguf_tensors
        yield from gguf_tensors(cfg, dr, f32, q4)
        return
    for L in range(cfg.num_layers):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", "F32", (H,), f32(H)
        yield b + "attn_q.weight", "Q4_0", (nh * hd, H), q4(nh * hd, H)
        yield b + "attn_k.weight", "Q4_0", (nkv * hd, H), q4(nkv * hd, H)
        yield b + "attn_v.weight", "Q4_0", (nkv * hd, H), q4(nkv * hd, H)
        yield b + "attn_output.weight", "Q4_0", (H, nh * hd), q4(H, nh * hd)
        if cfg.qk_norm in ("per_head", "full"):      # "none": no norm tensors
            qn, kn = (hd, hd) if cfg.qk_norm == "per_head" else (nh * hd, nkv * hd)
            yield b + "attn_q_norm.weight", "F32", (qn,), f32(qn)
            yield b + "attn_k_norm.weight", "F32", (kn,), f32(kn)
        yield b + "ffn_norm.weight", "F32", (H,), f32(H)
        yield (b + "ffn_gate_inp.weight", "F32", (E, H),
               lambda: dr.router(E, H))
        for part, (r, c) in (("gate", (I, H)), ("down", (H, I)), ("up", (I, H))):
            yield (f"{b}ffn_{part}_exps.weight", "Q4_0", (E, r, c),
                   (lambda r=r, c=c: np.stack([q4_0_rows(dr, r, c) for _ in range(E)])))
    yield "output_norm.weight", "F32", (H,), f32(H)
    yield "output.weight", "Q6_K", (V, H), (lambda: q6_k_rows(dr, V, H))


# (values, bytes) per block of each GGUF type written (gguf's GGML_QUANT_SIZES)
GGUF_BLOCKS = {"F32": (1, 4), "Q4_0": (32, 18), "Q6_K": (256, 210), "Q8_0": (32, 34),
               "MXFP4": (32, 17)}


def gguf_tensor_bytes(t: str, shape) -> int:
    bs, ts = GGUF_BLOCKS[t]
    return int(np.prod(shape)) // bs * ts


def gguf_bytes(cfg) -> int:
    return sum(gguf_tensor_bytes(t, s) for _, t, s, _ in _gguf_tensors(cfg, None)) + (1 << 20)


def write_gguf(shape: str, out: Path, seed: int = 1) -> Path:
    """The shape as a GGUF for llama.cpp's graph of its architecture (GGUF_ARCH): Q4_0, or
    gpt-oss's MXFP4 experts with Q8_0 matrices."""
    from benchmarks.peers._llamacpp_tools import import_gguf
    gguf = import_gguf()
    if out.exists():
        return out
    if shape not in GGUF_ARCH:
        raise SystemExit(f"{shape}: no GGUF writer for this shape (have: {', '.join(GGUF_ARCH)})")
    cfg, hf = model_config(shape), SHAPES[shape]
    check_disk(out.parent, gguf_bytes(cfg))
    arch = GGUF_ARCH[shape]
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"colibri-realscale-{shape}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_expert_feed_forward_length(cfg.expert_intermediate)
    w.add_head_count(cfg.num_heads)
    if arch == "deepseek2":
        from benchmarks.speed._realscale_deepseek2 import gguf_metadata
        gguf_metadata(w, gguf, cfg, hf)
    else:
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_size)
        w.add_value_length(cfg.head_size)
        w.add_rope_dimension_count(cfg.head_size)
    if arch == "gpt-oss":
        gptoss.gguf_metadata(w, gguf, cfg, hf)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    if arch == "qwen3moe":
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(getattr(gguf.LlamaFileType, GGUF_FTYPE.get(arch, "MOSTLY_Q4_0")))
    w.add_tokenizer_model("none")
    dr = Draw(seed)
    plan = list(_gguf_tensors(cfg, dr))
    for name, t, shp, _ in plan:
        if t == "F32":
            w.add_tensor_info(name, shp, np.dtype(np.float32), gguf_tensor_bytes(t, shp))
        else:
            bs, ts = GGUF_BLOCKS[t]
            w.add_tensor_info(name, (*shp[:-1], shp[-1] // bs * ts), np.dtype(np.uint8),
                              gguf_tensor_bytes(t, shp), raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for name, t, shp, make in plan:
        a = make()
        if t == "F32":
            assert np.isfinite(a).all()
        w.write_tensor_data(a)
        del a
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    check_written([tmp])
    os.replace(tmp, out)
    log(f"{out}: written in {time.perf_counter() - t0:.0f} s, {out.stat().st_size / 2**30:.2f} GiB")
    return out


# ----------------------------------------------------------------------------- files

def paths(shape: str, root: Path = DEFAULT_DIR) -> dict:
    kind = "mxfp4" if GGUF_ARCH.get(shape) == "gpt-oss" else "q4_0"
    return {"colibri": root / shape, "gguf": root / f"{shape}-{kind}.gguf"}


def delete(shape: str, root: Path = DEFAULT_DIR) -> None:
    for p in paths(shape, root).values():
        for q in (p, p.with_name(p.name + ".partial")):
            if q.is_dir():
                shutil.rmtree(q)
            elif q.exists():
                q.unlink()


def ensure(shape: str, root: Path = DEFAULT_DIR, gguf: bool = True) -> dict:
    """Both files of `shape` under `root`, written if missing; other shapes deleted first
    (one shape on disk at a time)."""
    for other in SHAPES:
        if other != shape:
            delete(other, root)
    p = paths(shape, root)
    write_colibri(shape, p["colibri"])
    if gguf:
        write_gguf(shape, p["gguf"])
    return p


def main(argv=None) -> None:
    from benchmarks.speed._realscale_routing import ROUTING, set_routing
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("write", "delete", "sizes", "routing"))
    ap.add_argument("--routing", choices=ROUTING, default="uniform",
                    help="with `routing`: the routers to write into both files")
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--no-gguf", action="store_true")
    a = ap.parse_args(argv)
    if a.action == "sizes":
        for s in SHAPES:
            cfg = model_config(s)
            g = gguf_bytes(cfg) / 2**30 if s in GGUF_ARCH else float("nan")
            print(f"{s:18s} colibri {colibri_bytes(cfg) / 2**30:6.2f} GiB  gguf {g:6.2f} GiB  "
                  f"expert files {len(cfg.moe_layers) * cfg.num_experts}")
        return
    if a.shape is None:
        ap.error("name a shape")
    if a.action == "delete":
        delete(a.shape, a.dir)
    elif a.action == "routing":
        set_routing(a.shape, a.routing, a.dir)
    else:
        print(json.dumps({k: str(v) for k, v in ensure(a.shape, a.dir, not a.no_gguf).items()}))


if __name__ == "__main__":
    main()
