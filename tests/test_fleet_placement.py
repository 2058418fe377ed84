"""Issue 39, item 5: a fleet whose replicas cannot all be placed says so at start, /ready
counts the replicas that report, and the CPUs per replica fit the cluster it finds.
Before: `--replicas 2` on 2 CPUs asked 2 x 2 CPUs, one replica stayed pending forever
and /ready answered 200. (No Ray needed: the planning and the gate are plain code.)"""
import asyncio
import json

from colibri_core.fleet.placement import ReadyGate, plan


def test_default_cpus_fit_the_cluster():
    p = plan(replicas=2, cluster_cpus=2, threads=2)
    assert (p.cpus, p.placeable, p.warning) == (1, 2, None)
    assert plan(replicas=1, cluster_cpus=16, threads=4).cpus == 4     # threads cap it
    assert plan(replicas=4, cluster_cpus=16, threads=8).cpus == 4


def test_replicas_that_cannot_be_placed_are_said_at_start():
    p = plan(replicas=2, cluster_cpus=2, threads=2, cpus=2)           # --replica-cpus 2
    assert p.placeable == 1
    assert "only 1 of 2 engine replicas can be placed" in p.warning
    assert "\n" not in p.warning
    p = plan(replicas=3, cluster_cpus=2, threads=2)                   # 1 CPU each: 2 fit
    assert (p.cpus, p.placeable) == (1, 2) and "only 2 of 3" in p.warning


class _Registry:
    def __init__(self, n):
        self.n = n
        registry = self

        class Snap:
            @staticmethod
            async def remote():
                return {"replicas": {f"r{i}": {} for i in range(registry.n)}}
        self.snapshot = Snap()


def _get(gate, path="/ready"):
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request"}
    asyncio.run(gate({"type": "http", "path": path}, receive, send))
    return sent


def test_ready_counts_reporting_replicas():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ready": true}'})
    reg = _Registry(1)
    gate = ReadyGate(app, reg, expected=2)
    out = _get(gate)
    assert out[0]["status"] == 503
    assert json.loads(out[1]["body"]) == {"ready": False, "replicas": 1, "expected": 2,
                                          "reason": "1 of 2 engine replicas placed and "
                                                    "reporting"}
    assert _get(gate, "/v1/models")[0]["status"] == 200               # other routes pass
    reg.n = 2
    assert _get(gate)[0]["status"] == 200
