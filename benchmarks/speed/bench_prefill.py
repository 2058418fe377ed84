"""A/B of prefill speed between two commits, beside llama.cpp, in the same run: prefill
tokens/s through Model.forward (1x64, 16x64 and 1x1024 tokens), the q4 batch kernel's
multiply-adds per second (q4_matmul 1024x2816, int8, N = 8, 64, 256), and
llama-batched-bench's prompt processing (npl 1 and 16 of 64 tokens) as the peer.

    python -m benchmarks.speed.bench_prefill REF [--rounds 5] [--threads 2] [--llama-bin DIR]

    python -m benchmarks.speed.bench_prefill --parts [--rounds 3]

REF is checked out and built as benchmarks/speed/ab_decode.py does (build/ab-<commit>); the
other side is this working tree. Each round runs every side in a fresh process (order
alternating) and llama-batched-bench once; the table gives the medians over the rounds
and the working tree's ratio to REF. Default model: bench_vs_llamacpp.py's (its Colibri
conversion and its Q4_0 GGUF). Without --llama-bin (default:
build/llamacpp/build/bin of the main checkout, if there) the peer is left out.
--parts: where a forward's time goes in this tree alone (one process, its C calls timed
as bench_decode_breakdown.py does), the panels on and off (kernels._set_panel_min_tokens)
in turn; medians over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, REPO, best_read_bandwidth
from benchmarks.speed.ab_decode import checkout

SHAPES = [(1, 64), (16, 64), (1, 1024)]     # sequences x tokens per forward
MATMUL_NS = [8, 64, 256]

CHILD = r'''
import importlib.util, json, sys, time, numpy as np
spec = importlib.util.spec_from_file_location("colibri_core.builtin_plugins",
    sys.argv[3] + "/plugins/__init__.py", submodule_search_locations=[sys.argv[3] + "/plugins"])
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[spec.name])
from colibri_core import kernels as K
from colibri_core.engine import Engine
from colibri_core.config import EngineConfig
from colibri_core.format.quant import quantize_q4
shapes, ns = json.loads(sys.argv[4]), json.loads(sys.argv[5])
e = Engine(sys.argv[1], EngineConfig(threads=int(sys.argv[2])))
m, rng, out = e.model, np.random.default_rng(0), {"backend": K.backend()}
for nseq, L in shapes:
    best = []
    for rep in range(3 if nseq * L <= 64 else 2):     # the first is a warm-up
        toks = [rng.integers(1, m.cfg.vocab_size - 1, L) for _ in range(nseq)]
        caches = [m.new_cache(L + 1) for _ in range(nseq)]
        t0 = time.perf_counter()
        m.forward(toks, caches)
        best.append(time.perf_counter() - t0)
    out[f"prefill {nseq}x{L}"] = nseq * L / min(best[1:])
e.close()
w = quantize_q4(rng.standard_normal((1024, 2816)).astype(np.float32), 128)
for n in ns:
    x = rng.standard_normal((n, 2816)).astype(np.float32)
    y = np.empty((n, 1024), np.float32)
    K.q4_matmul(w, x, y)
    reps, best = max(3, 256 // n), 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        K.q4_matmul(w, x, y)
        best = min(best, time.perf_counter() - t0)
    out[f"q4_matmul N={n}"] = 1024 * 2816 * n / best / 1e9
print(json.dumps(out))
'''


def run_side(tree: Path, model: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), str(tree),
                        json.dumps(SHAPES), json.dumps(MATMUL_NS)],
                       env=env, cwd="/", capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_prefill: the run in {tree} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama(bindir: Path, gguf: str, threads: int) -> dict:
    """llama-batched-bench's S_PP t/s for 1 and 16 sequences of 64 prompt tokens."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(bindir))
    r = subprocess.run([str(bindir / "llama-batched-bench"), "-m", gguf, "-t", str(threads),
                        "-c", "4096", "-b", "2048", "-ub", "512", "-npp", "64", "-ntg", "4",
                        "-npl", "1,16"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_prefill: llama-batched-bench failed:\n{r.stderr[-2000:]}")
    res = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == "64" and re.fullmatch(r"\d+", cells[2]):
            res[f"prefill {cells[2]}x64"] = float(cells[5])
    return res


def parts(model: str, threads: int, rounds: int) -> None:
    """Per shape and mode: ms per forward in attention, router, experts, lm_head, rest."""
    import numpy as np
    from benchmarks.speed.bench_decode_breakdown import TimedLib
    from colibri_core import kernels as K
    from colibri_core.forward import pipeline
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    eng = Engine(model, EngineConfig(threads=threads))
    m, rng = eng.model, np.random.default_rng(0)
    timed = TimedLib(pipeline.lib)
    pipeline.lib = timed
    modes = {"panels": 0, "tiles": 1 << 30}
    print(f"{threads} threads, backend {K.backend()}, medians of {rounds} rounds, ms per forward")
    print("| shape | kernels | tokens/s | attention | router | experts | lm_head | rest |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for nseq, L in SHAPES:
            got: dict = {k: [] for k in modes}
            for r in range(rounds + 1):                  # round 0: warm-up
                for name, mt in modes.items():
                    K._set_panel_min_tokens(mt)
                    toks = [rng.integers(1, m.cfg.vocab_size - 1, L) for _ in range(nseq)]
                    caches = [m.new_cache(L + 1) for _ in range(nseq)]
                    timed.t.clear()
                    t0 = time.perf_counter()
                    m.forward(toks, caches)
                    tot = time.perf_counter() - t0
                    if r:
                        got[name].append({"total": tot, **timed.t})
            for name, runs in got.items():
                med = {k: statistics.median(d.get(k, 0.0) for d in runs) * 1e3
                       for k in ("total", "attention", "router", "ffn", "lm_head")}
                rest = med["total"] - sum(v for k, v in med.items() if k != "total")
                print(f"| {nseq}x{L} | {name} | {nseq * L / med['total'] * 1e3:.0f} | "
                      f"{med['attention']:.1f} | {med['router']:.1f} | {med['ffn']:.1f} | "
                      f"{med['lm_head']:.1f} | {rest:.1f} |", flush=True)
    finally:
        K._set_panel_min_tokens(0)
        pipeline.lib = timed._lib
        eng.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", nargs="?")
    ap.add_argument("--parts", action="store_true", help="the time per part, this tree only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=str(OUT / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--gguf", default=str(OUT / "vs_llamacpp" / "model-q4_0.gguf"))
    main_bin = REPO / "build" / "llamacpp" / "build" / "bin"   # _llamacpp_tools.py
    ap.add_argument("--llama-bin", default=str(main_bin) if main_bin.is_dir() else "")
    a = ap.parse_args(argv)
    if a.parts:
        parts(a.model, a.threads, min(a.rounds, 3))
        return
    if not a.ref:
        ap.error("REF (a commit) or --parts")
    sides = {a.ref: checkout(a.ref), "working tree": REPO}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    bw = best_read_bandwidth(a.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, read bandwidth {bw['GBps']:.1f} GB/s "
          f"({bw['source']}, {a.threads} threads)", flush=True)
    res: dict = {name: [] for name in sides}
    peer: list = []
    backend = ""
    for r in range(a.rounds):
        for name, tree in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            d = run_side(tree, a.model, a.threads)
            backend = d.pop("backend")
            res[name].append(d)
            print(f"round {r} {name:14s} " + "  ".join(f"{k} {v:.1f}" for k, v in d.items()),
                  flush=True)
        if a.llama_bin:
            peer.append(run_llama(Path(a.llama_bin), a.gguf, a.threads))
            print(f"round {r} llama.cpp      " + "  ".join(f"{k} {v:.1f}" for k, v in peer[-1].items()),
                  flush=True)
    keys = list(res[a.ref][0])
    med = {n: {k: statistics.median(d[k] for d in v) for k in keys} for n, v in res.items()}
    pmed = {k: statistics.median(d[k] for d in peer) for k in peer[0]} if peer else {}
    print(f"\nmedians of {a.rounds} rounds, {a.threads} threads, backend {backend}, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"| measure | {a.ref} | working tree | ratio | llama.cpp | working tree / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        unit = "G MAC/s" if k.startswith("q4_matmul") else "tokens/s"
        ours, base, p = med["working tree"][k], med[a.ref][k], pmed.get(k)
        vs = f"{p:.1f} | {ours / p:.2f}" if p else " | "
        print(f"| {k} ({unit}) | {base:.1f} | {ours:.1f} | {ours / base:.2f} | {vs} |")

if __name__ == "__main__":
    main()
