"""The MoE router: choose top-k experts from the router logits and weight them.

The choice is made on the logits themselves (softmax is monotonic, so it never depends on
an approximation). Weights come from a fixed-point softmax by default (every weight within
0.003 of float softmax; measured in tests) or from float softmax ("float" mode, for exact
parity checks). Every token costs the same: the work is the same vectorized steps whatever
the values. Tokens whose logits are not all finite get uniform weights over the first k
finite-or-not experts in index order instead of propagating NaN.

Shape legend: T tokens, E experts, K = max k in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ops

# Fixed-point exp: x = d * log2(e) (d <= 0) is split into an integer part and a fraction
# quantized to 1/FRAC_STEPS; 2^-frac comes from a table in Q30. Error of one weight:
# |2^(1/2048) - 1| ~ 3.4e-4 relative before normalisation, well inside 0.003.
FRAC_BITS = 10
FRAC_STEPS = 1 << FRAC_BITS
Q = 30
_EXP2_TABLE = np.round(2.0 ** (-np.arange(FRAC_STEPS) / FRAC_STEPS) * (1 << Q)).astype(np.int64)
_LOG2E = 1.4426950408889634
_MAX_SHIFT = 62


@dataclass
class Routing:
    ids: np.ndarray      # int64 [T, K]   chosen experts (-1 where a token's k < K)
    weights: np.ndarray  # float32 [T, K] mixing weights (0 where id is -1)
    scores: np.ndarray   # float32 [T, K] router scores of the chosen experts (softmax
                         #                probabilities over all experts, or sigmoid scores)


@dataclass
class LayerTrace:
    """What the router did in one layer (handed to hooks / kept for tests)."""
    layer: int
    routing: Routing
    logits: np.ndarray   # [T, E] router logits


def fixed_point_softmax_weights(logits: np.ndarray, sel: np.ndarray,
                                normalize_selected: bool) -> np.ndarray:
    """Fixed-point softmax of `logits` [T, E], returning the weights of columns `sel` [T, K].

    Integer-only after the logit differences are quantized: exp via shift + table, the sum
    and the division in int64. normalize_selected: divide by the sum over the selected
    experts (norm_topk_prob) instead of over all experts.
    """
    m = logits.max(axis=1, keepdims=True)
    d = (logits - m).astype(np.float64) * _LOG2E                   # <= 0, log2 units
    fx = np.minimum(np.round(-d * FRAC_STEPS), _MAX_SHIFT * FRAC_STEPS).astype(np.int64)
    shift, frac = fx >> FRAC_BITS, fx & (FRAC_STEPS - 1)
    e = _EXP2_TABLE[frac] >> np.minimum(shift, _MAX_SHIFT)          # Q30, int64
    esel = np.take_along_axis(e, sel, axis=1)
    total = esel.sum(axis=1, keepdims=True) if normalize_selected else e.sum(axis=1, keepdims=True)
    w_q = (esel << 16) // np.maximum(total, 1)                      # Q16 weights
    return (w_q.astype(np.float64) / 65536.0).astype(np.float32)


def route(logits: np.ndarray, k: np.ndarray, *, mode: str = "fixed", scoring: str = "softmax",
          norm_topk_prob: bool = True, bias: np.ndarray | None = None,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
          bias_on_probs: bool = False, jitter_eps: float = 0.0) -> Routing:
    """Route T tokens. `k` is an int array [T] (per-token k; each 1..E). bias_on_probs:
    with softmax scores the selection bias is added to the probabilities (ERNIE-4.5).
    scoring "sparsemixer": Phi-3.5-MoE's two experts and weights (sparsemixer below)."""
    logits = np.asarray(logits, dtype=np.float32)
    T, E = logits.shape
    k = np.asarray(k, dtype=np.int64).reshape(-1)
    K = int(k.max()) if T else 0
    finite = np.isfinite(logits).all(axis=1)
    safe = np.where(finite[:, None], logits, 0.0).astype(np.float32)

    if scoring in ("softmax", "sparsemixer"):
        probs = ops.softmax(safe.astype(np.float64), axis=1)
        select_on = safe.astype(np.float64)
    else:  # sigmoid scores (DeepSeek-V3): selection may add a bias and be group-limited
        probs = ops.sigmoid(safe.astype(np.float64))
        select_on = probs + (bias.astype(np.float64)[None, :] if bias is not None else 0.0)
    if bias is not None and scoring == "softmax":
        select_on = (probs if bias_on_probs else select_on) + bias.astype(np.float64)[None, :]
    if n_group > 1 and topk_group < n_group:
        select_on = _group_limit(select_on, n_group, topk_group, top2=scoring == "sigmoid")

    sel = ops.top_k(select_on, K)                                 # [T, K]
    if scoring == "sparsemixer":                # at most two experts; the rest unused
        sel2, w2 = sparsemixer(safe, jitter_eps)
        sel[:, :min(K, 2)], k = sel2[:, :K], np.minimum(k, 2)
    scores = np.take_along_axis(probs, sel, axis=1)
    if scoring == "sparsemixer":
        weights = np.zeros((T, K))
        weights[:, :min(K, 2)] = w2[:, :K]
    elif scoring == "softmax":
        if mode == "fixed":
            weights = fixed_point_softmax_weights(safe, sel, normalize_selected=False).astype(np.float64)
        else:
            weights = scores.copy()
    else:
        weights = scores.copy()

    active = np.arange(K)[None, :] < k[:, None]                       # per-token k
    weights = np.where(active, weights, 0.0)
    if norm_topk_prob:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-20)
    weights *= scaling
    if not finite.all():                                               # NaN/Inf fallback
        bad = ~finite
        weights[bad] = np.where(active[bad], 1.0 / k[bad][:, None], 0.0)
        sel[bad] = np.arange(K)[None, :]
        scores[bad] = np.nan
    ids = np.where(active, sel, -1)
    return Routing(ids.astype(np.int64), weights.astype(np.float32), scores.astype(np.float32))


def _group_limit(values: np.ndarray, n_group: int, topk_group: int, top2: bool) -> np.ndarray:
    """Keep only experts of the best `topk_group` groups (others set to -inf).

    Group score: sum of the two best values (DeepSeek-V3, sigmoid) or the best value
    (DeepSeek-V2 'group_limited_greedy')."""
    T, E = values.shape
    g = values.reshape(T, n_group, E // n_group)
    if top2:
        gs = np.sort(g, axis=2)[:, :, -2:].sum(axis=2)
    else:
        gs = g.max(axis=2)
    keep = ops.top_k(gs, topk_group)
    mask = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=1)
    return np.where(np.repeat(mask, E // n_group, axis=1), values, -np.inf)


def sparsemixer(logits: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' PhiMoE sparsemixer in eval mode: (ids [T, 2], weights [T, 2]). The first
    expert is the best logit m; its weight its softmax probability among the logits s with
    (m - s) / max(|s|, m) <= 2 eps (the others masked out). The second: the same with the
    first expert removed and m the best of the rest. The comparisons in float32, as there."""
    s = np.asarray(logits, np.float32)
    T, E = s.shape
    ids, w = np.zeros((T, 2), np.int64), np.zeros((T, 2))
    two_eps, rows = np.float32(2.0 * eps), np.arange(T)
    avail = np.ones((T, E), bool)
    for j in range(2):
        cand = np.where(avail, s, -np.inf).astype(np.float32)
        best = np.argmax(cand, axis=1)
        m = cand[rows, best][:, None]
        keep = avail & ~(((m - s) / np.maximum(np.abs(s), m)) > two_eps)
        z = np.where(keep, s.astype(np.float64) - m, -np.inf)
        p = np.exp(z)
        ids[:, j], w[:, j] = best, p[rows, best] / p.sum(axis=1)
        avail[rows, best] = False
    return ids, w
