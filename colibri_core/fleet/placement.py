"""Placing the fleet's replicas on the cluster it finds, and a /ready that counts them.

`colibri serve --ray --replicas 2` on a 2-CPU machine asked 2 x 2 CPUs (the engine's
default threads), Ray placed one replica, the other stayed pending forever, and /ready
answered 200. Now: the CPUs per replica default to what the cluster can give every
replica (at most the engine's threads, at least 1); replicas that still cannot all be
placed are said so at start, in one line; and /ready answers 503 until as many replicas
as requested (autoscale: its minimum) report to the registry.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Placement:
    cpus: int              # CPUs each replica reserves (and its compute threads)
    replicas: int          # replicas requested (autoscale: the minimum)
    placeable: int         # how many of them the cluster's CPUs hold
    cluster_cpus: float

    @property
    def warning(self) -> Optional[str]:
        if self.placeable >= self.replicas:
            return None
        return (f"colibri: fleet: only {self.placeable} of {self.replicas} engine replicas "
                f"can be placed: each reserves {self.cpus} CPU(s) and the cluster has "
                f"{self.cluster_cpus:g}; the others stay pending (and /ready answers 503) "
                f"until CPUs are added; lower --replica-cpus or --replicas")


def plan(replicas: int, cluster_cpus: float, threads: int,
         cpus: Optional[int] = None) -> Placement:
    """CPUs per replica: `cpus` when given (--replica-cpus), else the engine's `threads`
    cut to the cluster's share of one replica (at least 1)."""
    if cpus is None:
        share = int(cluster_cpus // max(1, replicas))
        cpus = max(1, min(int(threads), share))
    placeable = int(cluster_cpus // cpus) if cpus > 0 else replicas
    return Placement(int(cpus), int(replicas), min(int(replicas), placeable), cluster_cpus)


class ReadyGate:
    """ASGI middleware of the fleet's ingress: GET /ready is 503 while fewer than
    `expected` engine replicas report to the registry (a pending one never does);
    everything else, and /ready once they do, goes to the app."""

    def __init__(self, app, registry, expected: int):
        self.app, self.registry, self.expected = app, registry, int(expected)

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("path") == "/ready" \
                and self.expected > 1:
            try:
                live = len((await self.registry.snapshot.remote())["replicas"])
            except Exception:  # noqa: BLE001 - the registry unreachable: not ready
                live = 0
            if live < self.expected:
                body = json.dumps({"ready": False, "replicas": live,
                                   "expected": self.expected,
                                   "reason": f"{live} of {self.expected} engine replicas "
                                             f"placed and reporting"}).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
