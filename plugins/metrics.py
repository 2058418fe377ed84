"""Per-request metrics: tokens, experts used per layer, hot-plugged expert hits, and a
histogram of inter-token latency, exported as JSON.

    metrics = Metrics(hotplug_threshold=64)   # expert indices >= 64 are hot-plugged
    pm.register(metrics)
    ... run a request ...
    print(metrics.to_json())

A request's counters start from zero at colibri_request_start. Routing counts have no
request id: they go to every request active at that moment (the whole step's: the
scheduler batches requests into one forward). The last finished request stays readable
until the next one starts.

An expert counts as hot-plugged when its index is >= ``hotplug_threshold`` or when
colibri_expert_loaded announced it (and colibri_expert_unloaded has not removed it).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl

#: Upper bounds (milliseconds) of the inter-token latency buckets; a last bucket
#: collects everything above the largest bound.
DEFAULT_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@dataclass
class RequestMetrics:
    """Counters of one request."""

    request_id: str
    prompt_tokens: int = 0
    k: int = 0
    tokens: int = 0
    stop_reason: str | None = None
    expert_counts: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> int64 [E]
    hot_hits: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, expert) -> n
    intervals_s: list[float] = field(default_factory=list)
    last_token_at: float | None = None

    def to_dict(self, buckets_ms: tuple[float, ...]) -> dict:
        counts = {
            str(layer): {str(e): int(c[e]) for e in np.flatnonzero(c)}
            for layer, c in sorted(self.expert_counts.items())
        }
        ms = np.asarray(self.intervals_s, dtype=np.float64) * 1e3
        edges = [f"<={b}ms" for b in buckets_ms] + [f">{buckets_ms[-1]}ms"]
        hist = np.bincount(np.searchsorted(buckets_ms, ms, side="left"), minlength=len(edges))
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "k": self.k,
            "tokens": self.tokens,
            "stop_reason": self.stop_reason,
            "experts_per_layer": counts,
            "distinct_experts_per_layer": {layer: len(c) for layer, c in counts.items()},
            "hot_plugged_hits": sum(self.hot_hits.values()),
            "hot_plugged_hits_by_expert": {
                f"expert_{layer}_{e}": n for (layer, e), n in sorted(self.hot_hits.items())
            },
            "inter_token_ms": {
                "count": int(ms.size),
                "histogram": dict(zip(edges, map(int, hist))),
                "p50": _percentile(ms, 50),
                "p90": _percentile(ms, 90),
                "max": float(ms.max()) if ms.size else None,
            },
        }


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


class Metrics:
    """Plugin collecting :class:`RequestMetrics` per request.

    Arguments:
        hotplug_threshold: expert indices at or above it are hot-plugged (None: only
            experts announced by colibri_expert_loaded).
        buckets_ms: upper bounds of the latency histogram's buckets, increasing.
        clock: seconds clock used to time tokens (default time.perf_counter).
    """

    def __init__(
        self,
        hotplug_threshold: int | None = None,
        buckets_ms: tuple[float, ...] = DEFAULT_BUCKETS_MS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if list(buckets_ms) != sorted(set(buckets_ms)) or not buckets_ms:
            raise ConfigError(f"Metrics: buckets_ms must be increasing and not empty, got {buckets_ms}")
        self.hotplug_threshold = hotplug_threshold
        self.buckets_ms = tuple(buckets_ms)
        self.clock = clock
        self.hot_experts: set[tuple[int, int]] = set()  # (layer, expert) announced as loaded
        self.active: dict[str, RequestMetrics] = {}
        self.last: RequestMetrics | None = None

    # -- hooks ----------------------------------------------------------------------------

    @hookimpl
    def colibri_request_start(self, request_id: str, prompt_tokens: int, k: int) -> None:
        self.active[request_id] = self.last = RequestMetrics(request_id, int(prompt_tokens), int(k))

    @hookimpl
    def colibri_request_end(self, request_id: str, n_tokens: int, stop_reason: str) -> None:
        rec = self.active.pop(request_id, None)
        if rec is not None:
            rec.stop_reason = stop_reason
            rec.tokens = int(n_tokens)
            self.last = rec

    @hookimpl
    def colibri_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        if not self.active:
            return
        ids = np.asarray(expert_ids).ravel()
        ids = ids[ids >= 0]  # -1: unused slot of a per-token k
        counts = np.bincount(ids)
        hot = self._hot_mask(layer, counts.size)
        hits = {(layer, int(e)): int(counts[e]) for e in np.flatnonzero(hot & (counts > 0))}
        for rec in self.active.values():
            total = rec.expert_counts.get(layer)
            if total is None or total.size < counts.size:
                grown = np.zeros(counts.size, dtype=np.int64)
                if total is not None:
                    grown[: total.size] = total
                rec.expert_counts[layer] = total = grown
            total[: counts.size] += counts
            for key, n in hits.items():
                rec.hot_hits[key] = rec.hot_hits.get(key, 0) + n

    @hookimpl
    def colibri_token(self, request_id: str) -> None:
        rec = self.active.get(request_id)
        if rec is None:
            return
        now = self.clock()
        if rec.last_token_at is not None:
            rec.intervals_s.append(now - rec.last_token_at)
        rec.last_token_at = now
        rec.tokens += 1

    @hookimpl
    def colibri_expert_loaded(self, info: dict) -> None:
        self.hot_experts.update(_layer_expert_pairs(info))

    @hookimpl
    def colibri_expert_unloaded(self, info: dict) -> None:
        self.hot_experts.difference_update(_layer_expert_pairs(info))

    # -- export ---------------------------------------------------------------------------

    def _hot_mask(self, layer: int, n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=bool)
        if self.hotplug_threshold is not None:
            mask[self.hotplug_threshold :] = True
        for lay, e in self.hot_experts:
            if lay == layer and e < n:
                mask[e] = True
        return mask

    def get(self, request_id: str | None = None) -> RequestMetrics | None:
        """The metrics of an active request, or of the latest request when None."""
        return self.last if request_id is None else self.active.get(request_id) or (
            self.last if self.last is not None and self.last.request_id == request_id else None
        )

    def to_dict(self, request_id: str | None = None) -> dict:
        rec = self.get(request_id)
        return {} if rec is None else rec.to_dict(self.buckets_ms)

    def to_json(self, request_id: str | None = None, **json_kwargs) -> str:
        """JSON of a request's metrics (the latest request by default; "{}" if none)."""
        return json.dumps(self.to_dict(request_id), **json_kwargs)

    def reset(self) -> None:
        """Forget every request (hot-plugged experts stay known)."""
        self.active.clear()
        self.last = None


def from_env(environ: Mapping[str, str] | None = None) -> Metrics:
    """Built-in entry used by build_plugin_manager(builtins=("metrics",)): defaults."""
    return Metrics()


def _layer_expert_pairs(info: dict) -> list[tuple[int, int]]:
    """(layer, expert) for each layer a hot-plugged expert serves (``info["layers"]``;
    a dict with only ``layer`` counts for that one layer)."""
    if info.get("expert") is None:
        return []
    layers = info.get("layers") or ([info["layer"]] if info.get("layer") is not None else [])
    return [(int(layer), int(info["expert"])) for layer in layers]
