"""Issue 14's half-model budget, settings side by side (issue 31): bench_pipeline.py's part
c (a budget of half the model's files, decode after a 64-token prompt) with several
residency settings, alternating, against plain decode and the bound.

    python -m benchmarks.speed.ab_halfbudget [--rounds 4] [--tokens 128]
        [--settings mmap,copy,mmap-spec3,mmap-spec3-any]

Each setting is one fresh child per round (bench_pipeline.run_child: the model's files
dropped from the page cache before a budget run, read into it before the plain one), the
order reversed every other round. The cold read rate of the expert files (4 threads, the
cache's I/O pool) is measured before the first round and after the last; the bound of a
setting is bench_pipeline's: 1.2 x (plain p50 + MiB loaded per token / the cold rate), with
the lower of the two rates. Medians over rounds; per-round figures in
benchmarks/out/ab_halfbudget.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

from benchmarks.common import OUT, git_commit, machine
from benchmarks.speed._pipeline_inputs import cold_read_rate, model_bytes
from benchmarks.speed.bench_pipeline import KV_TOKENS, run_rounds

MiB = 1 << 20
SPEC3 = {"speculative": True, "speculative_layers": 3}
SETTINGS = {
    "mmap": {},
    "copy": {"load_mode": "copy"},
    "mmap-spec": {"residency": {"speculative": True}},
    "copy-spec": {"load_mode": "copy", "residency": {"speculative": True}},
    "mmap-spec3": {"residency": SPEC3},
    "mmap-spec3-any": {"residency": {**SPEC3, "far_guess_margin": 0}},
    "copy-spec3": {"load_mode": "copy", "residency": SPEC3},
    "copy-spec3-any": {"load_mode": "copy", "residency": {**SPEC3, "far_guess_margin": 0}},
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", type=lambda s: s.split(","), default=["mmap", "copy"],
                    help=f"of {', '.join(SETTINGS)}")
    a = ap.parse_args(argv)
    bad = [s for s in a.settings if s not in SETTINGS]
    if bad:
        raise SystemExit(f"--settings: unknown {', '.join(bad)} (have: {', '.join(SETTINGS)})")
    from colibri_core.config import ResidencyConfig
    from benchmarks.peers._vs_models import WORK, build_colibri, build_hf
    mix = build_colibri(build_hf(WORK / "hf"), WORK / "colibri_q4")
    half = round(0.5 * model_bytes(mix) / MiB, 1)
    base = dict(kind="decode", model=str(mix), threads=a.threads, tokens=a.tokens)
    jobs = [{**base, "name": "plain"}]
    for s in a.settings:
        st = json.loads(json.dumps(SETTINGS[s]))
        st.setdefault("residency", {})["kv_tokens"] = KV_TOKENS
        jobs.append({**base, "name": s, "settings": {"max_resident_mb": half, **st}})
    io = ResidencyConfig().io_threads
    res = {"command": "python -m benchmarks.speed.ab_halfbudget " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "load_before": os.getloadavg(),
           "max_resident_mb": half, "read_before": cold_read_rate(mix, io),
           "runs": {j["name"]: [] for j in jobs}}
    log(f"cold read, {io} threads: {res['read_before']['GBps']:.2f} GB/s")
    run_rounds(jobs, a.rounds, res["runs"], lambda got: (
        f"p50 {got['p50_ms']:.2f} ms, hit {got.get('hit_rate')}, loaded "
        f"{got.get('loaded_per_token', 0) / MiB:.1f} MiB/tok, stall "
        f"{got.get('stall_ms_per_token', 0):.1f} ms"))
    res["read_after"] = cold_read_rate(mix, io)
    res["load_after"] = os.getloadavg()
    rate = min(res["read_before"]["GBps"], res["read_after"]["GBps"]) * 1e9
    med = lambda rows, k: statistics.median(x[k] for x in rows if x.get(k) is not None)  # noqa: E731
    plain = med(res["runs"]["plain"], "p50_ms")
    print(f"| setting | p50 ms (rounds) | x plain | hit rate | MiB loaded / token | MiB read / token "
          f"| stall ms / token | bound ms | p50 / bound |\n|---|---|---|---|---|---|---|---|---|")
    res["summary"] = {}
    for name, rows in res["runs"].items():
        ok = [x for x in rows if "p50_ms" in x]
        if not ok:
            continue
        s = {"p50_ms": med(ok, "p50_ms"), "rounds": [round(x["p50_ms"], 2) for x in ok]}
        if name != "plain":
            s.update(hit_rate=med(ok, "hit_rate"), loaded=med(ok, "loaded_per_token") / MiB,
                     read=med(ok, "disk_read_per_token") / MiB, stall=med(ok, "stall_ms_per_token"))
            s["bound_ms"] = 1.2 * (plain + s["loaded"] * MiB / rate * 1e3)
        res["summary"][name] = s
        f = lambda k, d=2: f"{s[k]:.{d}f}" if k in s else "–"     # noqa: E731
        print(f"| {name} | {s['p50_ms']:.2f} ({', '.join(map(str, s['rounds']))}) "
              f"| {s['p50_ms'] / plain:.2f} | {f('hit_rate', 3)} | {f('loaded', 1)} | {f('read', 1)} "
              f"| {f('stall', 1)} | {f('bound_ms')} | "
              + (f"{s['p50_ms'] / s['bound_ms']:.2f} |" if "bound_ms" in s else "– |"))
    OUT.mkdir(exist_ok=True)
    (OUT / "ab_halfbudget.json").write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
