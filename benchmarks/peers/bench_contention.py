"""Decode while other processes want the same CPUs: Colibri vs llama.cpp, same run.

On a shared machine a second decode thread often cannot run (another job holds its CPU).
This starts `--busy` CPU-bound processes (a Python busy loop each, default priority) for
the duration of every timing, then times both engines exactly as bench_vs_llamacpp.py does
(same runners, same prompt, alternating, `--rounds` rounds) with and without them.
Colibri's decode path falls back to one thread while the second is not really running
(pipeline.py, ThreadControl); the table shows what that buys.

Needs the models of bench_vs_llamacpp.py (run it once first).

    python -m benchmarks.peers.bench_contention --rounds 3 --busy 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.peers import bench_vs_llamacpp as B

BUSY = "import time\nt = time.time() + 3600\nwhile time.time() < t: pass\n"


def timed(engine: str, model: str, a, prompt, warm, busy: int) -> dict:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(0.3 if busy else 0)
        job = {"mode": "time", "model": model, "threads": a.threads, "prompt": prompt,
               "warmup": warm, "tokens": a.tokens}
        r = B.run_child(engine, job, a.threads)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return B.stats(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the engine")
    a = ap.parse_args(argv)
    paths = {"colibri": B.WORK / "colibri_q4", "llama.cpp": B.WORK / "model-q4_0.gguf"}
    for p in paths.values():
        if not p.exists():
            sys.exit(f"{p} is missing: run benchmarks/peers/bench_vs_llamacpp.py first")
    B.LAUNCHER = B.Launcher()
    rng = np.random.default_rng(0)
    V = B.SHAPE["vocab_size"]
    prompt, warm = rng.integers(3, V, a.prompt).tolist(), rng.integers(3, V, a.prompt).tolist()
    res = {"args": vars(a), "machine": B.machine_info(), "loadavg_start": os.getloadavg(), "runs": []}
    try:
        for rnd in range(a.rounds):
            for busy in (0, a.busy):
                order = ["colibri", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "colibri"]
                for e in order:
                    s = timed(e, str(paths[e]), a, prompt, warm, busy)
                    res["runs"].append({"round": rnd, "busy": busy, "engine": e, **s})
                    print(f"round {rnd} busy {busy} {e:10s} decode {s['decode_tok_s']:7.2f} tok/s "
                          f"p50 {s['p50_ms']:6.2f}  p99 {s['p99_ms']:6.2f}  std {s['std_ms']:6.2f} ms",
                          flush=True)
    finally:
        B.LAUNCHER.close()
    res["loadavg_end"] = os.getloadavg()
    lines = ["| busy processes | engine | decode tok/s | p50 ms | p99 ms | std ms |",
             "|---|---|---|---|---|---|"]
    for busy in (0, a.busy):
        for e in ("colibri", "llama.cpp"):
            rs = [r for r in res["runs"] if r["busy"] == busy and r["engine"] == e]
            med = {k: float(np.median([r[k] for r in rs])) for k in ("decode_tok_s", "p50_ms", "p99_ms", "std_ms")}
            res.setdefault("medians", {})[f"{e} busy={busy}"] = med
            lines.append(f"| {busy} | {e} | {med['decode_tok_s']:.1f} | {med['p50_ms']:.2f} | "
                         f"{med['p99_ms']:.2f} | {med['std_ms']:.2f} |")
    md = "\n".join(lines)
    print()
    print(md)
    out = B.OUT / "contention.json"
    out.write_text(json.dumps(res, indent=1, default=float))
    print(f"load average: start {res['loadavg_start']}, end {res['loadavg_end']}; wrote {out}")


if __name__ == "__main__":
    main()
