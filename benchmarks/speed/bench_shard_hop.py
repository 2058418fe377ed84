"""The per-hop cost of expert parallelism's step on Ray (issue 40; docs/SCALE.md "A model
larger than one machine"): a driver sends [rows, H] float32 to an actor and gets
[rows, H] back: plain actor calls (.remote + ray.get) to an actor on another node of a
local multi-node cluster, to two at once (what one MoE layer of a two-shard step waits
for) and to one on the driver's node; through the shard's own socket
(fleet/shardchannel.py, what RayShard uses) to an actor on another node, over its Unix
socket and over TCP, one and two at once; with --compiled, Ray Compiled Graphs (ray.dag,
experimental_compile) to the same.

    python -m benchmarks.speed.bench_shard_hop [--calls 300] [--hidden 1024] [--compiled]

The cluster is Ray's own test cluster (ray.cluster_utils.Cluster) on this machine: a head
and two worker nodes of 1 CPU each, 200 MB object stores, the loopback address. Medians
per payload, the kinds one after the other per payload; then the least-squares line
latency = a + b * bytes over the payloads (a: the per-hop cost, b: the per-byte cost).
Writes benchmarks/out/shard_hop.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.common import OUT, git_commit, machine

ROWS = (1, 4, 16, 64, 256)


class Echo:
    """A shard stand-in: gives back a fresh array of the payload's shape (no compute);
    also on its socket (a request's experts and weights: one int64 and float32 a row)."""

    def __init__(self):
        import ray
        from colibri_core.fleet.shardchannel import ChannelServer
        self._server = ChannelServer(lambda layer, x, e, w: self.compute(x),
                                     ray.util.get_node_ip_address())

    def compute(self, x):
        return x + np.float32(1.0)

    def address(self):
        return self._server.address


def _sockets(chans, x, ids, w):
    hs = [c.send(0, x, ids, w) for c in chans]      # every send before any read
    for c, h in zip(chans, hs):
        c.recv(h, 60.0, 60.0)


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
                    help="also Ray Compiled Graphs: one actor and two on the worker nodes, one "
                         "on the driver's node")
    a = ap.parse_args(argv)
    # a graph's first execute sets its channels up (2-5 s here, loaded): past Ray's 10 s
    # default on a busy machine
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")
    import ray
    from ray.dag import InputNode, MultiOutputNode
    from colibri_core.fleet.localcluster import local_cluster
    from colibri_core.fleet.shardchannel import Channel
    out = {"ray": ray.__version__, "hidden": a.hidden, "calls": a.calls, "rows": {}}
    xs = {rows: np.random.default_rng(rows).standard_normal((rows, a.hidden)).astype(np.float32)
          for rows in ROWS}
    with local_cluster(nodes=2, cpus=1, object_store_mb=200):
        actor = ray.remote(Echo)
        # actors on the two worker nodes, and two on the driver's node
        shards = [actor.options(num_cpus=1, resources={f"shard{i}": 1}).remote() for i in range(2)]
        local = [actor.options(num_cpus=0).remote() for _ in range(2)]
        ray.get([s.compute.remote(np.zeros(1, np.float32)) for s in shards + local])
        addrs = ray.get([s.address.remote() for s in shards])
        unix = [Channel(ad, "auto") for ad in addrs]
        tcp = [Channel(ad, "tcp") for ad in addrs]
        assert [c.kind for c in unix + tcp] == ["unix"] * 2 + ["tcp"] * 2
        plain = {"actor_1": lambda x: ray.get(shards[0].compute.remote(x)),
                 "actor_2": lambda x: ray.get([s.compute.remote(x) for s in shards]),
                 "local_actor_1": lambda x: ray.get(local[0].compute.remote(x)),
                 "socket_1": lambda x: _sockets(unix[:1], x, *ew[len(x)]),
                 "socket_2": lambda x: _sockets(unix, x, *ew[len(x)]),
                 "tcp_1": lambda x: _sockets(tcp[:1], x, *ew[len(x)]),
                 "tcp_2": lambda x: _sockets(tcp, x, *ew[len(x)])}
        ew = {rows: (np.zeros(rows, np.int64), np.ones(rows, np.float32)) for rows in ROWS}
        for rows, x in xs.items():
            out["rows"][rows] = {"bytes_each_way": x.nbytes,
                                 **{k: _time(lambda: f(x), a.calls) for k, f in plain.items()}}
        if a.compiled:
            # after the plain calls, one graph at a time (an actor takes part in one
            # compiled graph at a time, and runs its loop meanwhile). A graph's result
            # must be let go before its next execute (its buffer is read in place): _time
            # drops it
            for name, group in (("compiled_1", shards[:1]), ("compiled_2", shards),
                                ("local_compiled_1", local[:1])):
                with InputNode() as inp:
                    g = MultiOutputNode([s.compute.bind(inp) for s in group]).experimental_compile()
                try:
                    for rows, x in xs.items():
                        out["rows"][rows][name] = _time(lambda: ray.get(g.execute(x)), a.calls)
                finally:
                    g.teardown()
        kinds = [k for k in out["rows"][ROWS[0]] if k != "bytes_each_way"]
        for rows, row in out["rows"].items():
            print(f"rows {rows:4d} ({row['bytes_each_way'] / 1024:7.1f} KiB each way): "
                  + "  ".join(f"{k} {row[k]:.3f} ms" for k in kinds), file=sys.stderr)
        for k in kinds:
            b = np.array([r["bytes_each_way"] for r in out["rows"].values()], float)
            y = np.array([r[k] for r in out["rows"].values()])
            slope, icpt = np.polyfit(b, y, 1)
            out[f"fit_{k}"] = {"per_hop_ms": float(icpt), "per_MiB_ms": float(slope * 2**20)}
            print(f"{k}: {icpt:.3f} ms + {slope * 2**20:.3f} ms/MiB (each way)", file=sys.stderr)
    out.update(commit=git_commit(), machine=machine(), loadavg=os.getloadavg())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shard_hop.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
