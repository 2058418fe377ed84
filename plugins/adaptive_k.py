"""Adaptive top-k: each token gets as many experts as it needs to cover probability p.

Per token, experts are taken in decreasing router probability until their cumulative
probability reaches ``p``; the count is clamped to ``[k_min, k_max]``. A confident
router (one expert at 0.9) costs one expert; an undecided one costs up to ``k_max``.

    pm.register(AdaptiveK(p=0.7, k_min=1, k_max=4))

Sigmoid scores (DeepSeek-V3 style routers) do not sum to one, so each row is divided
by its sum first; softmax rows already sum to one and are unchanged by that.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl

# Cumulative sums are compared with this slack, so that p=0.7 and probabilities
# [0.7, 0.3] give k=1 whatever the float32 rounding of 0.7.
_EPS = 1e-6


def adaptive_k(probs: np.ndarray, p: float, k_min: int, k_max: int, default_k: int) -> np.ndarray:
    """k per token for router probabilities ``probs`` [N, E]; returns int64 [N].

    Rows that are not finite or sum to zero get ``default_k`` (clamped like the rest).
    """
    probs = np.asarray(probs)
    if probs.ndim != 2:
        raise ValueError(f"adaptive_k: probs must be [N, E], got shape {probs.shape}")
    n, e = probs.shape
    k_max = max(1, min(k_max, e))
    k_min = max(1, min(k_min, k_max))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    top = probs if k_max == e else -np.partition(-probs, k_max - 1, axis=1)[:, :k_max]  # [N, k_max]
    top = -np.sort(-top, axis=1).astype(np.float64)  # [N, k_max], best first
    total = probs.sum(axis=1, dtype=np.float64)  # [N]
    ok = np.isfinite(total) & (total > 0)
    cum = np.cumsum(top, axis=1) / np.where(ok, total, 1.0)[:, None]  # [N, k_max]
    k = (cum < p - _EPS).sum(axis=1) + 1  # first position reaching p, 1-based
    k = np.where(ok, k, default_k)
    return np.clip(k, k_min, k_max).astype(np.int64)


class AdaptiveK:
    """Plugin: per-token k from cumulative router probability.

    Arguments:
        p: probability mass to cover, in (0, 1] (default 0.7).
        k_min: fewest experts per token (default 1).
        k_max: most experts per token; None uses the request's k (default_k).
    """

    def __init__(self, p: float = 0.7, k_min: int = 1, k_max: int | None = None) -> None:
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"AdaptiveK: p must be in (0, 1], got {p}")
        if k_min < 1:
            raise ConfigError(f"AdaptiveK: k_min must be >= 1, got {k_min}")
        if k_max is not None and k_max < k_min:
            raise ConfigError(f"AdaptiveK: k_max ({k_max}) must be >= k_min ({k_min})")
        self.p, self.k_min, self.k_max = float(p), int(k_min), k_max

    @hookimpl
    def colibri_choose_k_token(self, probs: np.ndarray, default_k: int) -> np.ndarray:
        k_max = default_k if self.k_max is None else self.k_max
        return adaptive_k(probs, self.p, self.k_min, k_max, default_k)

    def __repr__(self) -> str:
        return f"AdaptiveK(p={self.p}, k_min={self.k_min}, k_max={self.k_max})"


def from_env(environ: Mapping[str, str] | None = None) -> AdaptiveK:
    """Built-in entry used by build_plugin_manager(builtins=("adaptive_k",)): defaults."""
    return AdaptiveK()
