"""DeepSeek multi-head latent attention (MLA). The rotary tables are ops.rope_frequencies.

MLA (DeepSeek-V2/V3) compresses keys and values into one latent vector per position:

    q        = wq x                       or  wq_b(rmsnorm(wq_a x))      [NH, nope + rope]
    kv_a     = wkv_a x                    -> latent c = rmsnorm(kv_a[:r]),  k_pe = kv_a[r:]
    k_h, v_h = (wkv_b c)[h]               keys [nope] (+ the shared k_pe), values [v]

The cache holds only `c` [r] and the rotated `k_pe` [rope] per position (the point of
MLA). Attention runs in the *absorbed* form, which never expands keys per position:

    score[h,t,s] = (q_nope[t,h] W_UK[h]) . c[s]  +  q_pe[t,h] . k_pe[s]
    out[t,h]     = W_UV[h] (sum_s p[h,t,s] c[s])

with W_UK / W_UV the key / value rows of wkv_b. wkv_b is therefore used as a float matrix
(dequantized once per layer and kept while the total stays under a budget).

Rotary layout: transformers applies DeepSeek's rope to interleaved pairs (x0,x1),(x2,x3)..
(`rope_interleave`, V3) and writes the result de-interleaved, or as complex pairs (V2); the
two differ only by a permutation applied to both q_pe and k_pe, so scores are the same.
YaRN scaling follows transformers: scaled inverse frequencies, cos/sin multiplied by the
attention factor, and the softmax scale multiplied by mscale(factor, mscale_all_dim)^2.

Shape legend: T tokens, NH heads, N nope dim, R rope dim, V value head dim, r latent rank,
S cached positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import ops
from ..config import ModelConfig
from .seqcache import SequenceCache

LORA_NORM_EPS = 1e-6          # q_a_layernorm / kv_a_layernorm: transformers' default eps
_DEQUANT_BUDGET = 256 << 20   # bytes of dequantized wkv_b kept across layers


# ----------------------------------------------------------------------------- scale

def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q·k head size), times mscale^2 under YaRN with mscale_all_dim (DeepSeek)."""
    scale = cfg.head_size ** -0.5
    rs = cfg.rope_scaling
    if cfg.attention == "mla" and rs is not None and rs.mscale_all_dim:
        m = ops.yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale *= m * m
    return scale


# ----------------------------------------------------------------------------- weights

@dataclass
class MLAWeights:
    wkv_a: object                     # [r + R, H]
    kv_a_norm: np.ndarray             # [r]
    wkv_b: object                     # [NH * (N + V), r]
    wo: object                        # [H, NH * V]
    wq: object = None                 # [NH * (N + R), H]          (q_lora_rank None)
    wq_a: object = None               # [q_lora_rank, H]
    q_a_norm: Optional[np.ndarray] = None
    wq_b: object = None               # [NH * (N + R), q_lora_rank]
    act_scales: dict = field(default_factory=dict)   # matrix name -> [cols] (AWQ)

    MATRICES = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")


def mla_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    H, NH = cfg.hidden_size, cfg.num_heads
    N, R, V, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    s = {"wkv_a": (r + R, H), "kv_a_norm": (r,), "wkv_b": (NH * (N + V), r), "wo": (H, NH * V)}
    if cfg.q_lora_rank is None:
        s["wq"] = (NH * (N + R), H)
    else:
        q = cfg.q_lora_rank
        s.update(wq_a=(q, H), q_a_norm=(q,), wq_b=(NH * (N + R), q))
    return s


def load_mla_weights(get, prefix: str, cfg: ModelConfig) -> MLAWeights:
    """`get(name, shape, optional=False)` reads one section of model.bin."""
    w = MLAWeights(**{k: get(prefix + k, shape) for k, shape in mla_shapes(cfg).items()})
    for m in MLAWeights.MATRICES:
        if getattr(w, m) is None:
            continue
        cols = mla_shapes(cfg)[m][1]
        s = get(prefix + m + ".act_scale", (cols,), optional=True)
        if s is not None:
            w.act_scales[m] = s
    return w


# ----------------------------------------------------------------------------- cache

class MLACache(SequenceCache):
    """Latent KV cache of one sequence: c [L, capacity, r] and rotated k_pe [L, capacity, R].
    (`k` / `v` name the two arrays for code that only sizes caches.)"""

    dtype = "f32"                     # always (kv_dtype applies to kvcache.KVCache)

    def __init__(self, cfg: ModelConfig, capacity: int):
        self.k = np.zeros((cfg.num_layers, capacity, cfg.kv_lora_rank), dtype=np.float32)
        self.v = np.zeros((cfg.num_layers, capacity, cfg.qk_rope_head_dim), dtype=np.float32)
        self._start(capacity)


# ----------------------------------------------------------------------------- attention

def _absorb_matrix(model, a: MLAWeights, layer: int) -> np.ndarray:
    """wkv_b as float32 [NH, N + V, r] (act scale already divided out of its columns)."""
    memo = model.__dict__.setdefault("_mla_wkv_b", {})
    w = memo.get(layer)
    if w is None:
        cfg = model.cfg
        w = ops.float_matrix(a.wkv_b)
        s = a.act_scales.get("wkv_b")
        if s is not None:
            w = w / np.asarray(s, np.float32)[None, :]
        w = np.ascontiguousarray(w.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                           cfg.kv_lora_rank), dtype=np.float32)
        free = isinstance(a.wkv_b, np.ndarray) and a.wkv_b.dtype == np.float32 and s is None
        if free or sum(m.nbytes for m in memo.values()) + w.nbytes <= _DEQUANT_BUDGET:
            memo[layer] = w
    return w


def attention(model, lw, xn: np.ndarray, pos: np.ndarray, spans) -> np.ndarray:
    """MLA for one layer: xn [T, H] (normed) -> [T, H]. `model` is the Model (for linear,
    rmsnorm, rotary tables, observer)."""
    cfg, a = model.cfg, lw.attn
    T, NH = xn.shape[0], cfg.num_heads
    N, R, V, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    sc = a.act_scales
    if a.wq is not None:
        q = model.linear(a.wq, xn, sc.get("wq"))
    else:
        qa = model.linear(a.wq_a, xn, sc.get("wq_a"))
        q = model.linear(a.wq_b, ops.rmsnorm(qa, a.q_a_norm, LORA_NORM_EPS), sc.get("wq_b"))
    q = q.reshape(T, NH, N + R)
    kv = model.linear(a.wkv_a, xn, sc.get("wkv_a"))
    c = ops.rmsnorm(kv[:, :r], a.kv_a_norm, LORA_NORM_EPS)                                 # [T, r]
    k_pe = kv[:, None, r:]                                             # [T, 1, R]
    inter = cfg.rope_interleave
    q_pe = ops.apply_rope(q[..., N:], pos, model._inv_freq, model._rope_factor, inter)
    k_pe = ops.apply_rope(k_pe, pos, model._inv_freq, model._rope_factor, inter)[:, 0]
    if getattr(model, "observer", None) is not None:
        model.observer(a.wkv_b, c)
    wkv_b = _absorb_matrix(model, a, lw.index)                         # [NH, N + V, r]
    q_lat = np.einsum("thn,hnr->thr", q[..., :N], wkv_b[:, :N, :])     # [T, NH, r]
    scale = softmax_scale(cfg)
    L = lw.index
    o_lat = np.empty((T, NH, r), dtype=np.float32)
    for t0, t1, cache in spans:
        s0, n = cache.length, t1 - t0
        cache.k[L, s0:s0 + n] = c[t0:t1]
        cache.v[L, s0:s0 + n] = k_pe[t0:t1]
        cs, ks = cache.k[L, :s0 + n], cache.v[L, :s0 + n]              # [S, r], [S, R]
        s = (np.einsum("thr,sr->hts", q_lat[t0:t1], cs)
             + np.einsum("thd,sd->hts", q_pe[t0:t1], ks)) * scale      # [NH, n, S]
        p = ops.causal_softmax(s, s0)
        o_lat[t0:t1] = np.einsum("hts,sr->thr", p.astype(np.float32), cs)
    out = np.einsum("thr,hvr->thv", o_lat, wkv_b[:, N:, :])            # [T, NH, V]
    return model.linear(a.wo, np.ascontiguousarray(out.reshape(T, NH * V), np.float32), sc.get("wo"))

