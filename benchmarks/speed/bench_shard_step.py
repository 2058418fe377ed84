"""Decode through expert shards (issue 40): per-token latency of one engine, of the same
model with its routed experts on two in-process shards (fleet/expertshard.py: the
executor's own cost, no transport) and on two Ray actors on two nodes of Ray's test
cluster (ray.cluster_utils.Cluster: 1 CPU, 200 MB, loopback; fleet/shardactor.py).
The added latency per MoE layer = (sharded - one) / MoE layers.

    python -m benchmarks.speed.bench_shard_step [--model builtin|bench|DIR] [--tokens 48] [--rounds 3]

Rounds alternate the three; medians of per-token p50s. Tokens are checked identical.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_shard_step")
    ap.add_argument("--model", default="builtin",
                    help="builtin, bench (the Mixtral-shaped benchmark model) or a model directory")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
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
    res = {"one": [], "inprocess": [], "ray": []}
    with local_cluster(nodes=2, cpus=1, object_store_mb=200):
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
    out.update(commit=git_commit(), machine=machine(), loadavg=os.getloadavg())
    OUT.mkdir(parents=True, exist_ok=True)
    name = {"builtin": "shard_step", "bench": "shard_step_bench"}.get(a.model, "shard_step_model")
    (OUT / f"{name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
