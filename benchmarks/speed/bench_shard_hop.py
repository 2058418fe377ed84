"""The per-hop cost of expert parallelism's step on Ray (issue 40; docs/SCALE.md "A model
larger than one machine"): a driver sends [rows, H] float32 to an actor and gets
[rows, H] back: plain actor calls (.remote + ray.get) to an actor on another node of a
local multi-node cluster, to two at once (what one MoE layer of a two-shard step waits
for) and to one on the driver's node; Ray Compiled Graphs (ray.dag, experimental_compile)
to one and two actors on the driver's node.

    python -m benchmarks.speed.bench_shard_hop [--calls 300] [--hidden 1024] [--compiled]

The cluster is Ray's own test cluster (ray.cluster_utils.Cluster) on this machine: a head
and two worker nodes of 1 CPU each, 200 MB object stores, the loopback address. Medians
per payload; then the least-squares line latency = a + b * bytes over the payloads (a:
the per-hop cost, b: the per-byte cost on loopback). Writes benchmarks/out/shard_hop.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from benchmarks.common import OUT

ROWS = (1, 4, 16, 64, 256)


class Echo:
    """A shard stand-in: gives back a fresh array of the payload's shape (no compute)."""

    def compute(self, x):
        return x + np.float32(1.0)


def _time(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    t = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_shard_hop")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--compiled", action="store_true",
                    help="also Compiled Graphs (on this machine, Ray 2.60: their first execute "
                         "times out, RayChannelTimeoutError, on the driver's node and across)")
    a = ap.parse_args(argv)
    import ray
    from ray.dag import InputNode, MultiOutputNode
    from colibri_core.fleet.localcluster import local_cluster
    out = {"ray": ray.__version__, "hidden": a.hidden, "calls": a.calls, "rows": {}}
    with local_cluster(nodes=2, cpus=1, object_store_mb=200):
        actor = ray.remote(Echo)
        # plain calls to actors on the two worker nodes; Compiled Graphs to actors on the
        # driver's node (shared-memory channels; across nodes the graph's first execute
        # timed out here with Ray 2.60)
        shards = [actor.options(num_cpus=1, resources={f"shard{i}": 1}).remote() for i in range(2)]
        local = [actor.options(num_cpus=0).remote() for _ in range(2)]
        ray.get([s.compute.remote(np.zeros(1, np.float32)) for s in shards + local])
        compiled = {}
        try:
            if not a.compiled:
                raise RuntimeError("not asked for (--compiled)")
            with InputNode() as inp:
                compiled[1] = local[0].compute.bind(inp).experimental_compile()
            with InputNode() as inp:
                compiled[2] = MultiOutputNode([s.compute.bind(inp) for s in local]).experimental_compile()
        except Exception as e:                      # noqa: BLE001 -- reported, not fatal
            print(f"compiled graphs: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        kinds = ["actor_1", "actor_2", "local_actor_1"] + [f"compiled_{k}" for k in compiled]
        try:
            for rows in ROWS:
                x = np.random.default_rng(rows).standard_normal((rows, a.hidden)).astype(np.float32)
                row = {"bytes_each_way": x.nbytes}
                row["actor_1"] = _time(lambda: ray.get(shards[0].compute.remote(x)), a.calls)
                row["actor_2"] = _time(lambda: ray.get([s.compute.remote(x) for s in shards]), a.calls)
                row["local_actor_1"] = _time(lambda: ray.get(local[0].compute.remote(x)), a.calls)
                for k, c in compiled.items():
                    row[f"compiled_{k}"] = _time(lambda: ray.get(c.execute(x)), a.calls)
                out["rows"][rows] = row
                print(f"rows {rows:4d} ({x.nbytes / 1024:7.1f} KiB each way): "
                      + "  ".join(f"{k} {v:.3f} ms" for k, v in row.items() if k != "bytes_each_way"),
                      file=sys.stderr)
        finally:
            for c in compiled.values():
                c.teardown()
        for k in kinds:
            b = np.array([r["bytes_each_way"] for r in out["rows"].values()], float)
            y = np.array([r[k] for r in out["rows"].values()])
            slope, icpt = np.polyfit(b, y, 1)
            out[f"fit_{k}"] = {"per_hop_ms": float(icpt), "per_MiB_ms": float(slope * 2**20)}
            print(f"{k}: {icpt:.3f} ms + {slope * 2**20:.3f} ms/MiB (each way)", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shard_hop.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
