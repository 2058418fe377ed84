"""The model's math in plain numpy, one function per op: the one home of every op.

The reference forward (reference.py, mla.py), the router (routing.py), the sampler and the
expert cache's speculation call these; the C kernels (kernels/, ck_step*.c) compute the
same ops fast and are tested against them. `matmul` is the kernels' matrix product in
numpy, int8 activations included: the reference forward calls no C. Every function computes in the dtype it is
given: the engine passes float32 (what its results were always computed in), the tests
pass float64 to get the exact value a kernel must come close to.

The weight formats (q4 / q8 packing, quantize and dequantize, the int8 activation
quantization) live in quant.py, their one home; here they are only used.

Shape legend: T tokens, H hidden, NH / NKV query / key-value heads, D head dim, S cached
positions, E experts (router slots), K experts per token, I intermediate size.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import ModelConfig
from ..format.quant import (Q4Tensor, Q6Tensor, Q8Tensor, dequantize_q4, dequantize_q6,
                            dequantize_q8, matvec_q4_q8_ref, matvec_q4_ref, padded_cols,
                            quantize_act_q8, unpack_nibbles, unpack_q6)
from ..format.mxfp4 import MXFP4Tensor, dequantize_mxfp4, matvec_mxfp4_q8_ref
from ..format.q5 import Q5Tensor, dequantize_q5, unpack_q5


# ----------------------------------------------------------------------------- elementwise

def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written as the kernels do (ck_silu): x / (1 + e^-x)."""
    return x / (1.0 + np.exp(-x))


def gated_act(g: np.ndarray, u: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """An FFN's h from gate g and up u (cfg.ffn_act): silu(g) * u, or gpt-oss's clamped
    SwiGLU (transformers' GptOssExperts._apply_gate): g clamped above at the limit, u to
    +-limit, g * sigmoid(alpha * g) * (u + 1), written as the kernels do."""
    if cfg.ffn_act != "swiglu_clamped":
        return silu(g) * u
    lim = g.dtype.type(cfg.swiglu_limit)
    g = np.minimum(g, lim)
    u = np.clip(u, -lim, lim)
    return g / (1 + np.exp(-g.dtype.type(cfg.swiglu_alpha) * g)) * (u + 1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum along `axis` (max subtracted: no overflow)."""
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    z /= z.sum(axis=axis, keepdims=True)
    return z


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """log(softmax(x)) along `axis`, in float64 (log-probabilities of tokens)."""
    z = np.asarray(x, np.float64)
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """bf16 values stored as uint16 -> float32 (the upper half of a float32)."""
    return (np.asarray(a).astype(np.uint32) << 16).view(np.float32)


def float_matrix(w) -> np.ndarray:
    """Any stored matrix (q4, q6, q8, bf16 as uint16, float) as float32."""
    if isinstance(w, Q4Tensor):
        return dequantize_q4(w).astype(np.float32)
    if isinstance(w, Q6Tensor):
        return dequantize_q6(w).astype(np.float32)
    if isinstance(w, Q5Tensor):
        return dequantize_q5(w).astype(np.float32)
    if isinstance(w, Q8Tensor):
        return dequantize_q8(w).astype(np.float32)
    if isinstance(w, MXFP4Tensor):
        return dequantize_mxfp4(w).astype(np.float32)
    a = np.asarray(w)
    if a.dtype == np.uint16:
        return bf16_to_f32(a)
    return a.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- matrix product

_MATMUL_BYTES = 64 << 20      # float64 group dots of one slice of tokens, at most


def matmul(w, x: np.ndarray, act: str = "int8") -> np.ndarray:
    """x [T, C] @ w^T -> float32 [T, R] for any stored matrix, as the C kernels compute it.

    act="int8" and a q4 / q6 / q8 matrix: x quantized per group of w
    (quant.quantize_act_q8, bit-identical to the kernels'), exact integer dots per group,
    then sum over groups of scale_w * scale_x * (dot - zero * xsum), in float64 (the
    kernels round each group's term to float32: they agree to ~1e-7 relative).
    act="float", or a float matrix (f32 / f16 / bf16 as uint16): x @ the matrix as
    float32 (quantized ones dequantized)."""
    x = np.asarray(x, np.float32)
    if act == "int8" and isinstance(w, MXFP4Tensor):      # exact block dots (mxfp4.py)
        return matvec_mxfp4_q8_ref(w, np.atleast_2d(x)).astype(np.float32)
    if act != "int8" or not isinstance(w, (Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor)):
        return (x @ float_matrix(w).T).astype(np.float32, copy=False)
    g, rows = w.group, w.rows
    ng = padded_cols(w.cols, g) // g
    if isinstance(w, Q8Tensor):
        codes, zeros = np.asarray(w.data), None
    else:
        codes = (unpack_nibbles if isinstance(w, Q4Tensor) else unpack_q5 if isinstance(w, Q5Tensor)
                 else unpack_q6)(np.asarray(w.data))
        zeros = np.asarray(w.zeros, np.float64).T                         # [NG, R]
    q = codes.reshape(rows, ng, g).transpose(1, 2, 0).astype(np.float64)  # [NG, G, R]
    sw = np.asarray(w.scales, np.float64).T                              # [NG, R]
    out = np.empty((x.shape[0], rows), np.float32)
    step = max(1, _MATMUL_BYTES // max(1, 8 * ng * rows))
    for t0 in range(0, x.shape[0], step):
        xq, xs, xsum = quantize_act_q8(x[t0:t0 + step], g)
        n = xq.shape[0]
        xg = xq.reshape(n, ng, g).transpose(1, 0, 2).astype(np.float64)   # [NG, n, G]
        dots = np.matmul(xg, q)                                          # [NG, n, R]: exact
        if zeros is not None:
            dots -= xsum.T.astype(np.float64)[:, :, None] * zeros[:, None, :]
        dots *= sw[:, None, :]
        dots *= xs.T.astype(np.float64)[:, :, None]
        out[t0:t0 + n] = dots.sum(axis=0)
    return out


# ----------------------------------------------------------------------------- embedding, norm

def embedding(table, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` [T] of the embedding table (q4, q6, q8, bf16 or float) as float32 [T, H]."""
    if isinstance(table, Q4Tensor):
        rows = Q4Tensor(table.data[ids], table.scales[ids], table.zeros[ids], len(ids),
                        table.cols, table.group)
        return dequantize_q4(rows).astype(np.float32)
    if isinstance(table, (Q5Tensor, Q6Tensor)):
        rows = type(table)(table.data[ids], table.scales[ids], table.zeros[ids], len(ids),
                           table.cols, table.group)
        return float_matrix(rows)
    if isinstance(table, Q8Tensor):
        rows = Q8Tensor(table.data[ids], table.scales[ids], len(ids), table.cols, table.group)
        return dequantize_q8(rows).astype(np.float32)
    rows = np.asarray(table[ids])
    if rows.dtype == np.uint16:
        return bf16_to_f32(rows)
    return rows.astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * w


# ----------------------------------------------------------------------------- rotary

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_dim(cfg: ModelConfig) -> int:
    """Dimensions rotated per head: the whole head, its first rotary_dim (partial rotary),
    or MLA's rope part."""
    return cfg.qk_rope_head_dim if cfg.attention == "mla" else (cfg.rotary_dim or cfg.head_size)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """The rotary table of a model: (inverse frequencies [D/2] float64, attention factor
    applied to cos/sin). YaRN scaling follows transformers (the tables in float32)."""
    dim = rope_dim(cfg)
    base = cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    if rs.type == "llama3":
        return _llama3_inv_freq(1.0 / pos_freqs, rs), 1.0
    if rs.type == "longrope":
        # transformers 5's PhiMoE: 1 / (short_factor * base^(2i/d)) in float32 at every
        # length (its forward never passes the length that would pick long_factor), cos/sin
        # times attention_factor (the converter's mscale)
        ext = np.asarray(rs.short_factor, np.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"config.json: rope_scaling.short_factor has {ext.size} entries, "
                             f"expected {dim // 2} (rotary dims / 2)")
        shape = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        inv = np.float32(1.0) / (ext * np.power(np.float32(base), shape, dtype=np.float32))
        af = 1.0 if rs.attention_factor is None else rs.attention_factor
        return inv.astype(np.float32).astype(np.float64), float(af)
    factor = rs.factor
    af = rs.attention_factor
    if af is None:
        if rs.mscale and rs.mscale_all_dim:
            af = yarn_mscale(factor, rs.mscale) / yarn_mscale(factor, rs.mscale_all_dim)
        else:
            af = yarn_mscale(factor)

    def corr_dim(rot):
        return (dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float64)
    extra = 1.0 - ramp                                   # extrapolation weight
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv.astype(np.float32).astype(np.float64), float(af)


def _llama3_inv_freq(inv: np.ndarray, rs) -> np.ndarray:
    """transformers' _compute_llama3_parameters: wavelengths above the original context /
    low_freq_factor divided by factor, below it / high_freq_factor kept, between them a
    blend."""
    ctx = rs.original_max_position_embeddings
    wl = 2 * math.pi / inv
    out = np.where(wl > ctx / rs.low_freq_factor, inv / rs.factor, inv)
    mid = (wl >= ctx / rs.high_freq_factor) & (wl <= ctx / rs.low_freq_factor)
    with np.errstate(divide="ignore", invalid="ignore"):     # equal factors: no blend band
        smooth = (ctx / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        return np.where(mid, (1 - smooth) * out / rs.factor + smooth * out, out)


def apply_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, factor: float,
               interleave: bool = False) -> np.ndarray:
    """Rotary embedding of x [T, heads, D] at positions pos [T]; cos/sin in float32.

    interleave=False: rotate-half (pairs (i, i + D/2), the Hugging Face layout); True:
    pairs (2i, 2i+1), result written de-interleaved (first the rotated even lanes, then
    the odd ones: DeepSeek's rope_interleave). Fewer frequencies than D/2 (partial rotary):
    only the first 2 * len(inv_freq) dims rotate, the rest pass through."""
    rot = 2 * len(inv_freq)
    if rot < x.shape[-1]:
        return np.concatenate([apply_rope(x[..., :rot], pos, inv_freq, factor, interleave),
                               x[..., rot:]], axis=-1)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]             # [T, D/2]
    cos = (np.cos(ang) * factor).astype(np.float32)[:, None, :]
    sin = (np.sin(ang) * factor).astype(np.float32)[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ----------------------------------------------------------------------------- attention

def causal_softmax(scores: np.ndarray, start: int) -> np.ndarray:
    """Attention weights from scores [..., n, S] of n new tokens at positions start..
    start+n-1 over S = start + n positions: later positions masked out, softmax over S."""
    n, S = scores.shape[-2:]
    if n > 1:
        mask = np.arange(S)[None, :] > (start + np.arange(n))[:, None]
        scores = np.where(mask, -np.inf, scores)
    return softmax(scores, axis=-1)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
              start: int, window: int = 0, chunk: int = 0,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query attention of n new tokens q [n, NH, D] (positions start..) over the
    cached keys / values [S, NKV, D] (S = start + n, the new tokens' rows included),
    NH a multiple of NKV -> [n, NH, D]. window > 0: a token sees positions pos-window+1..pos;
    chunk > 0: those of its own chunk; sinks [NH]: a logit per head in each softmax's
    denominator (a position with no value)."""
    n, NH, D = q.shape
    S, NKV = keys.shape[:2]
    qs = q.reshape(n, NKV, NH // NKV, D)
    sc = np.einsum("tkgd,skd->kgts", qs, keys) * scale                   # [NKV, G, n, S]
    if not (window or chunk or sinks is not None):
        p = causal_softmax(sc, start)
    else:
        qp, kp = start + np.arange(n)[:, None], np.arange(S)[None, :]
        hide = kp > qp
        if window:
            hide |= kp <= qp - window
        if chunk:
            hide |= kp // chunk != qp // chunk
        sc = np.where(hide, -np.inf, sc)
        if sinks is not None:                   # one more column, dropped after the softmax
            col = np.broadcast_to(np.asarray(sinks, sc.dtype).reshape(NKV, NH // NKV, 1, 1),
                                  sc.shape[:3] + (1,))
            p = softmax(np.concatenate([sc, col], axis=-1), axis=-1)[..., :S]
        else:
            p = softmax(sc, axis=-1)
    o = np.einsum("kgts,skd->tkgd", p.astype(values.dtype), values)
    return o.reshape(n, NH, D)


# ----------------------------------------------------------------------------- router

def router_logits(x: np.ndarray, router: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, H] @ router [E, H]^T (+ bias [E]) -> [T, E]."""
    logits = x @ router.T
    if bias is not None:
        logits += bias
    return logits


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices [T, k] of the k largest values per row, largest first, ties -> lower index."""
    order = np.argsort(-values, axis=1, kind="stable")
    return order[:, :k]


# ----------------------------------------------------------------------------- FFN

def gated_ffn(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """SiLU-gated FFN on float matrices: silu(x W1^T) * (x W3^T) @ W2^T."""
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def expert_ffn_ref(w1: Q4Tensor, w3: Q4Tensor, w2: Q4Tensor, x: np.ndarray,
                   act: str = "float") -> np.ndarray:
    """float64 reference of the kernels' expert FFN (kernels.expert_ffn, ck_step_experts;
    before the routing weight): silu(x W1^T) * (x W3^T) @ W2^T. act="int8" follows the int8 kernel: x and the hidden
    activation h (rounded to float32) are quantized per group before each product."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    mv = matvec_q4_q8_ref if act == "int8" else matvec_q4_ref
    h = silu(mv(w1, x)) * mv(w3, x)
    return mv(w2, h.astype(np.float32) if act == "int8" else h)
