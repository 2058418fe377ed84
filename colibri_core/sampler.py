"""Turning next-token logits into a token: greedy, temperature, top-p; seeded."""
from __future__ import annotations

import math

import numpy as np

from . import ops


class Sampler:
    """One per request. The same seed and logits give the same tokens."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        if not (math.isfinite(temperature) and temperature >= 0):   # NaN fails too
            raise ValueError(f"temperature={temperature}: must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
        self.temperature = temperature
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0.0:      # on the logits as they are: no float64 copy
            return int(np.argmax(logits))
        logits = np.asarray(logits, dtype=np.float64)
        p = ops.softmax(logits / self.temperature)
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]  # smallest set >= top_p
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(len(p), p=p))
