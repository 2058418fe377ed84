"""Decode through expert shards (issue 40): per-token latency of one engine, of the same
model with its routed experts on two in-process shards (fleet/expertshard.py: the
executor's own cost, no transport) and on two Ray actors on two nodes of Ray's test
cluster (fleet/localcluster.py: 1 CPU, 200 MB, loopback; fleet/shardactor.py): through
each shard's socket (fleet/shardchannel.py; all nodes are on this host: the Unix
socket, and with `ray_tcp` TCP on loopback) and, on the same actors, through plain Ray
actor calls per layer (`ray_plain`: the data path before the socket, commit 68cedaf, as
a measurement adapter); with --compiled also through Ray Compiled Graphs (one graph per
shard actor: its compute, the executor's submit = execute, result = get) to two actors
on the worker nodes and two on the driver's node. The added latency per MoE layer =
(sharded - one) / MoE layers.

    python -m benchmarks.speed.bench_shard_step [--model builtin|bench|DIR] [--tokens 48]
        [--rounds 3] [--compiled]

Rounds alternate the kinds; medians of per-token p50s. Tokens are checked identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from benchmarks.common import OUT, bench_model, git_commit, machine


def _p50(eng, prompt, n):
    lat, toks = [], []
    for ev in eng.generate(prompt, max_new_tokens=n + 1, temperature=0):
        lat.append(ev.latency_s)
        toks.append(ev.token_id)
    return float(np.median(lat[1:])) * 1e3, toks


class PlainShard:
    """A shard actor's compute as a plain Ray call per layer, as RayShard did before its
    socket (a measurement: no fault handling)."""

    def __init__(self, shard):
        import ray
        self._ray, self.actor, self.deadline_s = ray, shard.actor, shard.deadline_s

    def submit(self, layer, xn, experts, weights):
        return self.actor.compute.remote(layer, xn, experts, weights)

    def result(self, ref):
        self._ray.wait([ref], timeout=self.deadline_s)     # the slow count's wait
        return self._ray.get(ref)


class CompiledShard:
    """A shard actor behind a compiled graph of its own (a measurement: no hot-plug or
    restart; docs/SCALE.md says why the server does not use one)."""

    def __init__(self, shard):
        import ray
        from ray.dag import InputNode
        self._get = ray.get
        with InputNode() as inp:
            self.graph = shard.actor.compute.bind(inp[0], inp[1], inp[2], inp[3]) \
                .experimental_compile()

    def submit(self, layer, xn, experts, weights):
        return self.graph.execute(layer, xn, experts, weights)

    def result(self, ref):
        return self._get(ref)          # copied into the step's buffer, then let go


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_shard_step")
    ap.add_argument("--model", default="builtin",
                    help="builtin, bench (the Mixtral-shaped benchmark model) or a model directory")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="also through Ray Compiled Graphs")
    a = ap.parse_args(argv)
    import colibri_core
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.fleet.expertplan import check_plan, place
    from colibri_core.fleet.expertshard import ExpertShard, ShardedExperts
    from colibri_core.fleet.shardactor import RayShard
    from colibri_core.fleet.localcluster import local_cluster
    m = os.path.join(os.path.dirname(colibri_core.__file__), "models", "builtin") \
        if a.model == "builtin" else str(bench_model()) if a.model == "bench" else a.model
    owners = check_plan(place(m, 2), m)
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")    # a graph's first execute
    with local_cluster(nodes=2, cpus=1, object_store_mb=200):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        cfg = EngineConfig(threads=1)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        node = lambda s: {"resources": {f"shard{s}": 0.25}}   # noqa: E731
        where = {"ray": node, "ray_tcp": lambda s: {**node(s), "transport": "tcp"}}
        if a.compiled:
            where.update(compiled_nodes=node,
                         compiled_here=lambda s: {"scheduling_strategy": here})
        engines = {k: Engine(m, cfg) for k in ("one", "inprocess", "ray_plain", *where)}
        ShardedExperts(engines["inprocess"].model.pipeline, owners,
                       [ExpertShard(m, s, owners) for s in range(2)]).install()
        for k, opts in where.items():
            shards = [RayShard(m, s, owners, cpus=0, **opts(s)).ready() for s in range(2)]
            if k == "ray":                          # the same actors, plain calls
                ShardedExperts(engines["ray_plain"].model.pipeline, owners,
                               [PlainShard(s) for s in shards]).install()
            if k.startswith("compiled"):
                shards = [CompiledShard(s) for s in shards]
            ShardedExperts(engines[k].model.pipeline, owners, shards).install()
        res = {k: [] for k in engines}
        one = engines["one"]
        moe = len(one.model_cfg.moe_layers)
        prompt = np.random.default_rng(0).integers(1, one.model_cfg.vocab_size - 1, 16).tolist()
        for r in range(a.rounds):
            got = {}
            for name, eng in engines.items():
                p50, got[name] = _p50(eng, prompt, a.tokens)
                res[name].append(p50)
            assert all(t == got["one"] for t in got.values()), "tokens differ"
            print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.3f} ms" for k, v in res.items()),
                  file=sys.stderr)
        med = {k: statistics.median(v) for k, v in res.items()}
        out = {"model": a.model, "moe_layers": moe, "p50_ms": med,
               "added_ms_per_moe_layer": {k: (med[k] - med["one"]) / moe for k in med if k != "one"},
               "ratio_tok_s_vs_one": {k: med["one"] / med[k] for k in med if k != "one"}}
        for e in engines.values():
            e.close()
    out.update(commit=git_commit(), machine=machine(), loadavg=os.getloadavg())
    OUT.mkdir(parents=True, exist_ok=True)
    name = {"builtin": "shard_step", "bench": "shard_step_bench"}.get(a.model, "shard_step_model")
    (OUT / f"{name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
