"""A budget that holds the whole model against plain decode, in both page-cache states
(issue 30, item 2: "runs at plain speed whatever state the page cache is in").

    python -m benchmarks.speed.ab_whole_budget MODEL_DIR [--rounds 4] [--tokens 64]
        [--warmup 8] [--threads 2] [--modes mmap,copy]
    python -m benchmarks.speed.ab_whole_budget --write /tmp/wb_model ...   # a random model
        # of the benchmark shape (common.BENCH_SHAPE, about 300 MB) written there first

Configurations: plain (no budget) and, per load mode of `--modes`, max_resident_mb = the
smallest budget whose plan holds every file (whole_budget_mb: the expert cache holds
every expert file, the embedding counted at its full size), each in two page-cache
states: "cached" (every model file read first) and "dropped" (posix_fadvise DONTNEED on
the model's own files: _pipeline_inputs.drop_cache; never drop_caches). Each run is a
fresh child (bench_pipeline.run_child/child_decode: a 64-token prompt of fixed random
ids, greedy, EOS ignored); the per-token p50 leaves out the first token and `--warmup`
more. The order alternates every other round. Per state: medians over rounds of plain's
and the budget's p50, the ratio budget / plain of the medians, the per-round ratios (and
their median: paired, steadier on a loaded machine) and the rounds where the budget is
more than 5 % slower. Writes
benchmarks/out/ab_whole_budget.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

from benchmarks.common import OUT, git_commit, machine
from benchmarks.speed._pipeline_inputs import model_bytes
from benchmarks.speed.bench_pipeline import KV_TOKENS, run_rounds

MiB = 1 << 20
STATES = ("cached", "dropped")
SLOWER = 1.05          # a round "slower" when the budget's p50 exceeds plain's by 5 %


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def whole_budget_mb(model_dir: Path, mode: str = "mmap") -> float:
    """The smallest max_resident_mb (0.1 MiB steps) whose plan holds every file of the
    model: the expert cache takes every expert file and the embedding fits at its full
    size (the plan counts it by rows: the difference is the margin)."""
    from colibri_core.config import EngineConfig
    from colibri_core.experts.residency import check_budget
    mb = model_bytes(model_dir) / MiB
    for _ in range(16):
        plan = check_budget(model_dir, EngineConfig(max_resident_mb=mb, load_mode=mode,
                                                    residency={"kv_tokens": KV_TOKENS}))
        short = (plan.experts_total - plan.capacity) + (plan.embed_total - plan.embed_reserve)
        if short <= 0:
            return mb
        mb = -(-(mb + short / MiB) * 10 // 1) / 10        # up, to 0.1 MiB
    raise SystemExit(f"{model_dir}: no budget up to {mb:.1f} MiB holds the whole model")


def jobs_for(model: Path, a) -> list[dict]:
    """Per page-cache state: plain, then a whole-model budget per load mode."""
    jobs = []
    for state in STATES:
        plain = dict(kind="decode", model=str(model), threads=a.threads, tokens=a.tokens,
                     warmup=a.warmup, ignore_eos=True, cache="warm" if state == "cached" else "cold")
        jobs.append({**plain, "name": f"plain, {state}"})
        for mode in a.modes:
            jobs.append({**plain, "name": f"budget {mode}, {state}", "settings": {
                "max_resident_mb": whole_budget_mb(model, mode), "load_mode": mode,
                "residency": {"kv_tokens": KV_TOKENS}}})
    return jobs


def summarize(res: dict, modes: list) -> dict:
    med = lambda rows: statistics.median(x["p50_ms"] for x in rows)  # noqa: E731
    out = {}
    for state in STATES:
        plain = [x for x in res["runs"][f"plain, {state}"] if "p50_ms" in x]
        for mode in modes:
            bud = res["runs"][f"budget {mode}, {state}"]
            pairs = [(p["p50_ms"], b["p50_ms"]) for p, b in zip(res["runs"][f"plain, {state}"], bud)
                     if "p50_ms" in p and "p50_ms" in b]
            if not pairs:
                continue
            ok = [b for b in bud if "p50_ms" in b]
            ratios = [b / p for p, b in pairs]
            out[f"{mode}, {state}"] = {
                "plain_ms": med(plain), "budget_ms": med(ok), "ratio": med(ok) / med(plain),
                "round_ratios": [round(r, 3) for r in ratios], "median_round_ratio": statistics.median(ratios),
                "slower_rounds": sum(r > SLOWER for r in ratios), "rounds": len(ratios),
                "hit_rate": (statistics.median(b["hit_rate"] for b in ok)
                             if all(b.get("hit_rate") is not None for b in ok) else None),
                "whole_model_path": all(b.get("whole_model") for b in ok),
                "loaded_mib_per_token": statistics.median(b.get("loaded_per_token", 0) for b in ok) / MiB,
                "path": ok[-1].get("decode_path")}
    return out


def table(summary: dict) -> str:
    rows = ["| mode, page cache | plain ms/token | budget ms/token | budget / plain | per round "
            "(median) | rounds > 5 % slower | budget's path | MiB loaded / token |",
            "|---|---|---|---|---|---|---|---|"]
    for k, s in summary.items():
        rows.append(f"| {k} | {s['plain_ms']:.2f} | {s['budget_ms']:.2f} | {s['ratio']:.3f} "
                    f"| {', '.join(f'{r:.2f}' for r in s['round_ratios'])} ({s['median_round_ratio']:.2f}) "
                    f"| {s['slower_rounds']} of {s['rounds']} | " + ("plain (whole model)"
                    if s["whole_model_path"] else f"expert cache, hit rate {s['hit_rate'] or 0:.3f}")
                    + f" | {s['loaded_mib_per_token']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="a Colibri model directory")
    ap.add_argument("--write", type=Path, help="write a random model of the benchmark shape "
                                               "here first (if not there yet) and use it")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="timed tokens per run")
    ap.add_argument("--warmup", type=int, default=8, help="decode tokens left out before them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["mmap"],
                    help="load modes of the budget runs: mmap, copy or mmap,copy")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    if (a.model is None) == (a.write is None):
        ap.error("give a model directory or --write DIR (one of the two)")
    if set(a.modes) - {"mmap", "copy"}:
        ap.error(f"--modes {','.join(a.modes)}: expected mmap, copy or mmap,copy")
    if a.write is not None:
        from benchmarks.common import bench_model
        a.model = bench_model(a.write)
    if not (a.model / "config.json").is_file():
        ap.error(f"{a.model}: no config.json (not a Colibri model directory)")
    jobs = jobs_for(a.model, a)
    res = {"command": "python -m benchmarks.speed.ab_whole_budget " + " ".join(map(str, argv)),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "load_before": os.getloadavg(),
           "model": str(a.model), "model_mib": model_bytes(a.model) / MiB,
           "budget_mb": {j["name"]: j["settings"]["max_resident_mb"] for j in jobs if "settings" in j},
           "runs": {j["name"]: [] for j in jobs}}
    log(f"model {res['model_mib']:.1f} MiB of files; budgets {res['budget_mb']}")
    run_rounds(jobs, a.rounds, res["runs"], lambda got: f"p50 {got['p50_ms']:.2f} ms, whole model "
               f"{got.get('whole_model')}, load {os.getloadavg()[0]:.1f}")
    res["load_after"] = os.getloadavg()
    res["backend"] = next((x["backend"] for rows in res["runs"].values() for x in rows if "backend" in x), "?")
    res["summary"] = summarize(res, a.modes)
    print(f"{res['date']}, {res['machine']}, backend {res['backend']}, commit {res['commit']}, "
          f"load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}; model "
          f"{res['model_mib']:.1f} MiB, budgets {res['budget_mb']}, {a.rounds} rounds x "
          f"{a.tokens} tokens (after {a.warmup} + 1)\n" + table(res["summary"]))
    OUT.mkdir(exist_ok=True)
    (OUT / "ab_whole_budget.json").write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
