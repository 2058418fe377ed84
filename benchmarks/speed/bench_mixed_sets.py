"""Several expert sets in one step (issue 35 item 1): the throughput of steps whose
sequences use a pinned snapshot, a canary's set and the live set, against steps of the
same batch size under the live set alone.

The benchmark model (benchmarks/common.py, 8 MoE layers of 8 experts of 2,816, top-2)
with hot-plugged INT4 experts of the same size: the pinned snapshot holds `a` v1; the
live set `a` v2 and `b` v1; the canary's set is the live set with `b` v2 (built as
experts/candidates.py builds one). A third of the batch runs under each. The experts sit
in the last MoE layer (`--hot-layers last`: one layer, as the expert builder makes them)
or in every MoE layer (`all`: the worst case, two of ten experts differ in each layer).

    python -m benchmarks.speed.bench_mixed_sets              # ~2 min on 2 busy cores
    python -m benchmarks.speed.bench_mixed_sets --batch 24 --steps 16 --rounds 9
    python -m benchmarks.speed.bench_mixed_sets --hot-layers all

Variants, each over the same prompts and decode tokens: `one set` (every sequence live),
`mixed` (one pass: forward/mixedsets.py) and `pass per set` (the step as it was before:
one forward per set, forced by an experts executor the union cannot use). Phases:
`decode` (one token per sequence per step, after a 64-token context) and `prefill` (each
sequence's 32-token prompt in one step). The variants alternate step by step, the order
rotating; a round is `--steps` decode steps and 4 prefills of each. The figures are the
medians over rounds of tokens per second, and of each round's ratio to `one set`; the
same per CPU second of the process (the work, which the other jobs' load moves much less
than the wall time: with --threads 1 no thread spins); the load average is recorded
before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from benchmarks.common import OUT, bench_model, best_read_bandwidth, git_commit, machine

VARIANTS = ("one set", "mixed", "pass per set")


class QHot:
    """A hot-plugged expert with embedded INT4 weights (what a built .so carries), in
    `slot` of every MoE layer; its router row drawn like the model's."""

    def __init__(self, cfg, slot, seed, name, layers):
        from colibri_core.format.quant import quantize_q4
        rng = np.random.default_rng(seed)
        H, I = cfg.hidden_size, cfg.expert_intermediate
        self.q4 = type("Q4", (), {})()
        self.q4.w1 = quantize_q4(rng.standard_normal((I, H)) / np.sqrt(H), 128, clip="minmax")
        self.q4.w3 = quantize_q4(rng.standard_normal((I, H)) / np.sqrt(H), 128, clip="minmax")
        self.q4.w2 = quantize_q4(rng.standard_normal((H, I)) / np.sqrt(I), 128, clip="minmax")
        self.layers = list(layers)
        self.slot, self.name, self.sha256 = slot, name, f"{seed:064d}"
        self.router_row = (rng.standard_normal(H) / np.sqrt(H) * 3).astype(np.float32)
        self.router_bias = 0.0
        self.forward = None


def make_sets(eng, where: str):
    cfg, base = eng.model_cfg, eng.model.expert_set
    E = cfg.num_experts
    L = cfg.moe_layers if where == "all" else cfg.moe_layers[-1:]
    pinned = base.with_expert(QHot(cfg, E, 1, "a", L))
    live = pinned.with_expert(QHot(cfg, E, 2, "a", L)).with_expert(QHot(cfg, E + 1, 3, "b", L))
    canary = dataclasses.replace(live.with_expert(QHot(cfg, E + 1, 4, "b", L)),
                                 version=live.version, candidate="b")
    return pinned, live, canary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=24, help="sequences per step (a multiple of 3)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per variant and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot-layers", choices=("last", "all"), default="last")
    a = ap.parse_args(argv)
    from colibri_core.engine import Engine
    from colibri_core.kernels import backend
    B = a.batch - a.batch % 3
    load0 = os.getloadavg()
    eng = Engine.from_model_dir(str(bench_model()), threads=a.threads)
    m = eng.model
    pinned, live, canary = make_sets(eng, a.hot_layers)
    m.expert_set = live
    rng = np.random.default_rng(0)
    V = m.cfg.vocab_size
    ctx = [rng.integers(0, V, 64) for _ in range(B)]
    prompts = [rng.integers(0, V, 32) for _ in range(B)]
    toks = rng.integers(0, V, (a.steps, B))
    mixed_sets = [pinned] * (B // 3) + [canary] * (B // 3) + [live] * (B // 3)
    sets = {"one set": [live] * B, "mixed": mixed_sets, "pass per set": mixed_sets}
    caches = {v: [m.new_cache(64 + a.steps + 32) for _ in range(B)] for v in VARIANTS}
    pipe = m.pipeline
    per_set = lambda *args: pipe._experts(*args)     # noqa: E731 - not the pipeline's own

    def step(v: str, phase: str, s: int) -> tuple[float, float]:
        """Seconds of one step of variant v, wall and the process's CPU: decode step s
        (its caches at 64 + s), or the prompts' prefill."""
        cs = caches[v]
        pipe.experts = per_set if v == "pass per set" else pipe._experts
        try:
            for c in cs:
                c.length = 0 if phase == "prefill" else 64 + s
            feed = prompts if phase == "prefill" else [toks[s, i:i + 1] for i in range(B)]
            t0, c0 = time.perf_counter(), time.process_time()
            m.forward(feed, cs, [2] * B, expert_set=sets[v])
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            pipe.experts = pipe._experts

    for v in VARIANTS:                               # the contexts; warm (tables, unions)
        m.forward(ctx, caches[v], [2] * B, expert_set=sets[v])
        step(v, "decode", 0)
        step(v, "prefill", 0)
    p0 = pipe.passes
    step("mixed", "decode", 0)
    assert pipe.passes - p0 == 1, "a mixed step was not one pass"
    mix = pipe._mix
    rate = {(v, ph): [] for v in VARIANTS for ph in ("decode", "prefill")}
    cpu_rate = {key: [] for key in rate}
    for r in range(a.rounds):
        spent = {key: np.zeros(2) for key in rate}
        for ph, n in (("decode", a.steps), ("prefill", 4)):
            for s in range(n):
                k = r + s
                for v in VARIANTS[k % 3:] + VARIANTS[:k % 3]:
                    spent[(v, ph)] += step(v, ph, s)
        for (v, ph), (t, c) in spent.items():
            toks_done = B * (a.steps if ph == "decode" else 4 * 32)
            rate[(v, ph)].append(toks_done / t)
            cpu_rate[(v, ph)].append(toks_done / c)
    load1 = os.getloadavg()
    rows = {}
    for ph in ("decode", "prefill"):
        base = np.array(rate[("one set", ph)])
        cbase = np.array(cpu_rate[("one set", ph)])
        for v in VARIANTS:
            got, cpu = np.array(rate[(v, ph)]), np.array(cpu_rate[(v, ph)])
            rows[f"{ph}: {v}"] = {"tok_per_s": float(np.median(got)),
                                  "ratio_to_one_set": float(np.median(got / base)),
                                  "tok_per_cpu_s": float(np.median(cpu)),
                                  "cpu_ratio_to_one_set": float(np.median(cpu / cbase)),
                                  "rounds": got.round(1).tolist(),
                                  "cpu_rounds": cpu.round(1).tolist()}
    eng.close()
    bw = best_read_bandwidth(a.threads, mib=512, reps=5)
    res = {"command": "python -m benchmarks.speed.bench_mixed_sets " + " ".join(argv or sys.argv[1:]),
           "batch": B, "steps": a.steps, "rounds": a.rounds, "threads": a.threads,
           "hot_layers": a.hot_layers,
           "union_entries_per_layer": mix.entries_max, "shared_slots": mix.shared_entries(),
           "machine": machine(), "backend": backend(), "read_GBps": round(bw["GBps"], 1),
           "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in load1],
           "variants": rows}
    for name, v in rows.items():
        print(f"{name:>22}: {v['tok_per_s']:8.1f} tok/s  x{v['ratio_to_one_set']:.3f} of one set;"
              f" {v['tok_per_cpu_s']:8.1f} tok per CPU s  x{v['cpu_ratio_to_one_set']:.3f}")
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; read {bw['GBps']:.1f} GB/s; "
          f"{backend()}; {git_commit()}")
    OUT.mkdir(exist_ok=True)
    (OUT / f"bench_mixed_sets_{a.hot_layers}.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
