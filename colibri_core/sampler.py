"""Turning next-token logits into a token: logit bias, greedy, temperature, top-k, top-p;
seeded."""
from __future__ import annotations

import math

import numpy as np

from . import ops


class Sampler:
    """One per request. The same seed and logits give the same tokens."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 top_k: int = 0, logit_bias: dict[int, float] | None = None):
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name}={v!r:.40}: must be a number")
        if not (math.isfinite(temperature) and temperature >= 0):   # NaN fails too
            raise ValueError(f"temperature={temperature}: must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0: no top-k cut)")
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k                  # keep the k most likely tokens (0: all)
        # token id -> value added to its logit before anything else (OpenAI's logit_bias)
        self.bias = None
        if logit_bias:
            self.bias = (np.fromiter(logit_bias.keys(), np.int64, len(logit_bias)),
                         np.fromiter(logit_bias.values(), np.float64, len(logit_bias)))
        self.rng = np.random.default_rng(seed)
        self.seed = seed

    @property
    def audit_params(self) -> dict:
        """What the audit log records of the sampling (audit.py)."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": self.top_k, "seed": self.seed, "logit_bias": self.bias is not None}

    def __call__(self, logits: np.ndarray) -> int:
        if self.bias is not None:
            logits = np.array(logits, dtype=np.float64)
            logits[self.bias[0]] += self.bias[1]
        if self.temperature == 0.0:      # on the logits as they are: no float64 copy
            return int(np.argmax(logits))
        logits = np.asarray(logits, dtype=np.float64)
        # Shifted so the largest is 0 before dividing: a tiny temperature (1e-308) sends
        # the others to -inf (greedy in effect) instead of overflowing to +inf.
        with np.errstate(over="ignore"):
            z = (logits - logits.max()) / self.temperature
        if 0 < self.top_k < z.size:      # ties at the k-th value are kept
            z = np.where(z >= np.partition(z, -self.top_k)[-self.top_k], z, -np.inf)
        p = ops.softmax(z)
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]  # smallest set >= top_p
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(len(p), p=p))
