"""gpt-oss-20b's shape for _realscale_models.py: its published config (SHAPE) and what
its writers need beyond the common sections, for both engines.

Colibri: what `colibri convert` makes of the released checkpoint at its defaults -- the
experts MXFP4 as the checkpoint ships them (kept byte for byte, convert/gptoss.py) with f32
biases on gate, up and down; attention as every family's (q/o q4, k/v q8) plus f32 q/k/v/o
biases and a sink logit per head; the router with its logit bias (routing.bin).

GGUF: llama.cpp's `gpt-oss` graph as its converter writes the checkpoint
(conversion/gpt_oss.py of the vendored llama.cpp: gate_up split into ffn_gate_exps and
ffn_up_exps, MXFP4 blocks repacked, biases apart, `attn_sinks`, the post-attention norm
`post_attention_norm`) at the types of ggml-org's MXFP4 release (`--outtype q8_0`): experts
MXFP4, every other matrix Q8_0, the router, norms, biases and sinks F32.

Drawn bytes, as the other shapes': e2m1 codes uniform over the 16 (values mean 0, mean
square VAR_MX) and e8m0 block exponents drawn between the two powers of two about
1 / sqrt(VAR_MX x fan-in), the upper one with the probability that makes the mean square
exactly that: products keep their input's scale. Biases and sinks small (N(0, 0.02^2))."""
from __future__ import annotations

import numpy as np

# openai/gpt-oss-20b's config.json, the fields that shape the model
SHAPE = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
    "vocab_size": 201088, "max_position_embeddings": 131072, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4"}}   # the experts' (the rest: bf16)
VAR_MX = float(np.mean(np.array([0, .5, 1, 1.5, 2, 3, 4, 6]) ** 2))     # 8.5625
MX_BLOCK_BYTES = 17                     # GGUF's MXFP4 block: the exponent, 16 code bytes
Q8_0_BLOCK = 34                         # an f16 scale, 32 int8


def mx_exps(dr, rows: int, nb: int, cols: int, gain: float = 1.0) -> np.ndarray:
    """e8m0 exponents uint8 [rows, nb]: 2^e is 2^k or 2^(k-1) about s = gain / sqrt(VAR_MX x
    cols) (2^(k-1) < s <= 2^k), 2^k with probability p such that the mean of 4^e is s^2."""
    s2 = gain * gain / (VAR_MX * cols)
    k = int(np.ceil(0.5 * np.log2(s2)))
    hi, lo = 4.0 ** k, 4.0 ** (k - 1)
    up = dr.rng.random((rows, nb)) < (s2 - lo) / (hi - lo)
    return (127 + k - 1 + up).astype(np.uint8)


def mxfp4(dr, rows: int, cols: int, gain: float = 1.0):
    """A random MXFP4 matrix in Colibri's layout (format/mxfp4.from_blocks: the checkpoint's
    blocks and scales)."""
    from colibri_core.format.mxfp4 import from_blocks
    nb = cols // 32
    return from_blocks(dr.bytes(rows, nb, 16), mx_exps(dr, rows, nb, cols, gain))


# ----------------------------------------------------------------------------- Colibri

def attention_vectors(cfg, dr, p: str):
    """Layer p's attention biases and sinks (families.attention_sections' names)."""
    hd, nh, nkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    for name, n in (("bq", nh * hd), ("bk", nkv * hd), ("bv", nkv * hd),
                    ("bo", cfg.hidden_size), ("sinks", nh)):
        yield p + name, dr.small(n)


def experts(cfg, dr):
    from colibri_core.model.weights import FFNWeights
    H, I = cfg.hidden_size, cfg.expert_intermediate
    for L in cfg.moe_layers:
        for e in range(cfg.num_experts):
            yield L, e, FFNWeights(mxfp4(dr, I, H), mxfp4(dr, I, H), mxfp4(dr, H, I), biases={
                "w1": dr.small(I), "w3": dr.small(I), "w2": dr.small(H)})


def routing_extra(cfg, dr) -> list:
    return [(f"layer.{L}.router_logit_bias", dr.small(cfg.num_experts)) for L in cfg.moe_layers]


def expert_bytes(cfg, r) -> int:
    """One expert file's bytes: a header page, each part rounded up by r to 4 KiB."""
    from colibri_core.format.quant import padded_cols
    H, I = cfg.hidden_size, cfg.expert_intermediate
    def mat(rows, cols):                        # codes, then exponents
        cp = padded_cols(cols, 64)
        return r(rows * cp // 2) + r(rows * cp // 32)
    return 4096 + 2 * mat(I, H) + mat(H, I) + 2 * r(4 * I) + r(4 * H)


# ----------------------------------------------------------------------------- GGUF

def q8_0_rows(dr, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
    """Random Q8_0 blocks [rows, cols / 32 * 34]: an f16 scale d, 32 int8 values -127..127."""
    nb = cols // 32
    out = dr.bytes(rows, nb, Q8_0_BLOCK).copy()
    q = out[:, :, 2:].view(np.int8)
    q[q == -128] = -127
    d = (gain / np.sqrt(dr.VAR["q8"] * cols)) * (0.75 + 0.5 * dr.rng.random((rows, nb)))
    out[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return out.reshape(rows, nb * Q8_0_BLOCK)


def mxfp4_rows(dr, rows: int, cols: int) -> np.ndarray:
    """Random GGUF MXFP4 blocks [rows, cols / 32 * 17]: the e8m0 exponent, then 16 bytes of
    two e2m1 codes each (any order: the codes are uniform)."""
    nb = cols // 32
    out = dr.bytes(rows, nb, MX_BLOCK_BYTES).copy()
    out[:, :, 0] = mx_exps(dr, rows, nb, cols)
    return out.reshape(rows, nb * MX_BLOCK_BYTES)


def gguf_tensors(cfg, dr, f32):
    """(name, type, numpy shape, make) of llama.cpp's `gpt-oss` GGUF, in order."""
    H, V, I, E = cfg.hidden_size, cfg.vocab_size, cfg.expert_intermediate, cfg.num_experts
    hd, nh, nkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    q8 = lambda r, c, g=1.0: (lambda: q8_0_rows(dr, r, c, g))            # noqa: E731
    sm = lambda *s: (lambda: dr.small(*s))                                # noqa: E731
    yield "token_embd.weight", "Q8_0", (V, H), q8(V, H, np.sqrt(H))
    for L in range(cfg.num_layers):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", "F32", (H,), f32(H)
        for name, (r, c) in (("attn_q", (nh * hd, H)), ("attn_k", (nkv * hd, H)),
                             ("attn_v", (nkv * hd, H)), ("attn_output", (H, nh * hd))):
            yield b + name + ".weight", "Q8_0", (r, c), q8(r, c)
            yield b + name + ".bias", "F32", (r,), sm(r)
        yield b + "attn_sinks.weight", "F32", (nh,), sm(nh)
        yield b + "post_attention_norm.weight", "F32", (H,), f32(H)
        yield b + "ffn_gate_inp.weight", "F32", (E, H), (lambda: dr.router(E, H))
        yield b + "ffn_gate_inp.bias", "F32", (E,), sm(E)
        for part, (r, c) in (("gate", (I, H)), ("down", (H, I)), ("up", (I, H))):
            yield (f"{b}ffn_{part}_exps.weight", "MXFP4", (E, r, c),
                   (lambda r=r, c=c: np.stack([mxfp4_rows(dr, r, c) for _ in range(E)])))
            yield f"{b}ffn_{part}_exps.bias", "F32", (E, r), sm(E, r)
    yield "output_norm.weight", "F32", (H,), f32(H)
    yield "output.weight", "Q8_0", (V, H), q8(V, H)


def gguf_metadata(w, gguf, cfg, hf: dict) -> None:
    """The keys llama.cpp's converter adds for gpt-oss: the sliding window and YaRN's (the
    published config's rope_scaling)."""
    w.add_sliding_window(int(hf["sliding_window"]))
    rs = hf["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rs["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
    w.add_rope_scaling_yarn_beta_fast(float(rs["beta_fast"]))
    w.add_rope_scaling_yarn_beta_slow(float(rs["beta_slow"]))
