"""Decode through expert shards (issue 40): per-token latency of one engine, of the same
model with its routed experts on two in-process shards (fleet/expertshard.py: the
executor's own cost, no transport) and on two Ray actors on two nodes of Ray's test
cluster (ray.cluster_utils.Cluster: 1 CPU, 200 MB, loopback; fleet/shardactor.py).
The added latency per MoE layer = (sharded - one) / MoE layers.

    python -m benchmarks.speed.bench_shard_step [--model builtin] [--tokens 48] [--rounds 3]

Rounds alternate the three; medians of per-token p50s. Tokens are checked identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from benchmarks.common import OUT, REPO


def _p50(eng, prompt, n):
    lat, toks = [], []
    for ev in eng.generate(prompt, max_new_tokens=n + 1, temperature=0):
        lat.append(ev.latency_s)
        toks.append(ev.token_id)
    return float(np.median(lat[1:])) * 1e3, toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_shard_step")
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import colibri_core
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.fleet.expertplan import check_plan, place
    from colibri_core.fleet.expertshard import ExpertShard, ShardedExperts
    from colibri_core.fleet.shardactor import RayShard
    m = a.model if a.model != "builtin" else os.path.join(
        os.path.dirname(colibri_core.__file__), "models", "builtin")
    owners = check_plan(place(m, 2), m)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster
    ray_constants.ENABLE_RAY_CLUSTER = False    # ray.init keeps 127.0.0.1
    node = dict(num_cpus=1, object_store_memory=200 * 2**20, node_ip_address="127.0.0.1",
                include_dashboard=False)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    res = {"one": [], "inprocess": [], "ray": []}
    try:
        for i in range(2):
            cluster.add_node(**node, resources={f"shard{i}": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = EngineConfig(threads=1)
        one, local, remote = Engine(m, cfg), Engine(m, cfg), Engine(m, cfg)
        plain = [ExpertShard(m, s, owners) for s in range(2)]
        actors = [RayShard(m, s, owners, cpus=1, resources={f"shard{s}": 1}).ready() for s in range(2)]
        ShardedExperts(local.model.pipeline, owners, plain).install()
        ShardedExperts(remote.model.pipeline, owners, actors).install()
        moe = len(one.model_cfg.moe_layers)
        prompt = np.random.default_rng(0).integers(1, one.model_cfg.vocab_size - 1, 16).tolist()
        for r in range(a.rounds):
            got = {}
            for name, eng in (("one", one), ("inprocess", local), ("ray", remote)):
                p50, got[name] = _p50(eng, prompt, a.tokens)
                res[name].append(p50)
            assert got["one"] == got["inprocess"] == got["ray"], "tokens differ"
            print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.3f} ms" for k, v in res.items()),
                  file=sys.stderr)
        med = {k: statistics.median(v) for k, v in res.items()}
        out = {"model": a.model, "moe_layers": moe, "p50_ms": med,
               "added_ms_per_moe_layer": {k: (med[k] - med["one"]) / moe for k in ("inprocess", "ray")},
               "ratio_tok_s_ray_vs_one": med["one"] / med["ray"]}
        for e in (one, local, remote):
            e.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shard_step.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
