"""Prometheus metrics of one server (its own registry, so several servers can live in
one process, e.g. in tests). Scraped at GET /metrics."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter,
                               Histogram, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class _ExpertCollector:
    """Read at scrape time from the backend's last snapshot (backend.py): no bookkeeping
    on the token path. A fleet's snapshot sums its replicas and adds one series each."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        snap = s.last_snapshot or {}
        for name, doc, key in (
                ("colibri_expert_set_generation", "Expert-set generation (grows by one per "
                 "applied change; a fleet's: the registry's)", "expert_set_generation"),
                ("colibri_queue_depth", "Engine requests (sequences) waiting for admission "
                 "(the scheduler's queue; a fleet's: summed over replicas)", "queue_depth"),
                ("colibri_batch_size", "Engine requests admitted by the scheduler: their "
                 "sequences share each step", "batch_size")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], snap.get(key, 0))
            yield g
        r = GaugeMetricFamily("colibri_requests_running", "HTTP requests in flight")
        r.add_metric([], s.backend.running)
        yield r
        a = CounterMetricFamily("colibri_expert_adoptions", "Hot-plugged experts adopted")
        a.add_metric([], snap.get("adoptions", 0))
        yield a
        m = CounterMetricFamily("colibri_mixed_set_steps", "Steps whose sequences ran under "
                                "more than one expert set in one forward pass (a pinned "
                                "snapshot's, a canary's, the live set's)")
        m.add_metric([], snap.get("mixed_set_steps", 0))
        yield m
        ref = CounterMetricFamily("colibri_expert_refusals", "Expert files refused, by reason",
                                  labels=["reason"])
        for reason, n in sorted(snap.get("refusals", {}).items()):
            ref.add_metric([reason], n)
        yield ref
        rt = CounterMetricFamily("colibri_routed_tokens", "Tokens routed to each expert, "
                                 "summed over its layers", labels=["expert"])
        for name, n in sorted(snap.get("routed", {}).items()):
            rt.add_metric([name], n)
        yield rt
        yield from _prefix_families(snap.get("prefix_cache"))
        yield from snap.get("families", ())          # a fleet's per-replica series


def _prefix_families(pc):
    """Automatic prefix caching (runtime/prefixcache.py); none while it is off."""
    if not pc:
        return
    for name, doc, key in (
            ("colibri_prefix_cache_hits", "Generations whose prompt started with kept KV "
             "rows (copied in, not computed)", "hits"),
            ("colibri_prefix_cache_misses", "Generations that looked for a kept prefix and "
             "found none", "misses"),
            ("colibri_prefix_cache_reused_tokens", "Prompt tokens whose KV rows were copied "
             "from the prefix cache instead of computed", "reused_tokens"),
            ("colibri_prefix_cache_evictions", "Blocks of kept rows evicted (least recently "
             "used first)", "evictions")):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], pc[key])
        yield c
    for name, doc, key in (
            ("colibri_prefix_cache_bytes", "Bytes of KV rows the prefix cache keeps", "bytes"),
            ("colibri_prefix_cache_capacity_bytes", "The prefix cache's cap "
             "(--prefix-cache-mb)", "capacity_bytes")):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], pc[key])
        yield g


class ServerMetrics:
    def __init__(self, server):
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("colibri_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=reg)
        self.tokens = Counter("colibri_tokens", "Tokens processed", ["kind"], registry=reg)
        self.first_token = Histogram("colibri_first_token_seconds",
                                     "Time from request to its first token",
                                     buckets=LATENCY_BUCKETS, registry=reg)
        self.per_token = Histogram("colibri_token_seconds", "Time between two tokens of a "
                                   "request", buckets=LATENCY_BUCKETS, registry=reg)
        self.loop_lag = Histogram("colibri_event_loop_lag_seconds", "How late the server's "
                                  "event loop woke from a 50 ms sleep",
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                           0.1, 0.25, 0.5, 1.0), registry=reg)
        self.cancelled = Counter("colibri_requests_cancelled", "Requests stopped early",
                                 ["why"], registry=reg)
        reg.register(_ExpertCollector(server))
        # (time, completion tokens so far, routed tokens by name): the status page's window
        self.history: deque = deque(maxlen=130)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def completion_total(self) -> float:
        return self.tokens.labels("completion")._value.get()

    def sample(self, routed: dict) -> None:
        """One point of the status page's one-minute window (called every second) from
        the routed tokens by expert name so far."""
        self.history.append((time.monotonic(), self.completion_total(), dict(routed)))

    def window(self, seconds: float = 60.0) -> dict:
        """tokens/s and each expert's share of routed tokens over the last `seconds`."""
        if not self.history:
            return {"seconds": 0.0, "tokens_per_s": 0.0, "routed": {}}
        now_t, now_tok, now_routed = self.history[-1]
        old = self.history[0]
        for h in self.history:
            if now_t - h[0] <= seconds:
                old = h
                break
        dt = now_t - old[0]
        delta = {k: v - old[2].get(k, 0) for k, v in now_routed.items()}
        delta = {k: v for k, v in delta.items() if v > 0}
        total = sum(delta.values())
        return {"seconds": dt, "tokens_per_s": (now_tok - old[1]) / dt if dt > 0 else 0.0,
                "routed": {k: {"tokens": v, "share": v / total} for k, v in
                           sorted(delta.items(), key=lambda kv: -kv[1])}}
