"""Time of the converter's q4 scale search per expert matrix: numpy (quant.q4_group_codes)
against C (kernels.q4_group_codes, ck_qsearch.c), alternating, on one OLMoE-1B-7B expert
matrix (1,024 x 2,048, N(0, 1/2048) rounded to bf16, as bench_convert_scale's checkpoint).

    python -m benchmarks.speed.bench_q4_search [--rounds 7] [--rows 1024 --cols 2048]

Each round quantizes the matrix whole (quant.quantize_rows, "q4", group 128) with
numpy's search, then with the C one on 1 thread and on all the kernels' threads; the
outputs are asserted identical. Prints the medians, their ratios and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from colibri_core import kernels
from colibri_core.format import quant


def _matrix(rows: int, cols: int) -> np.ndarray:
    w = (np.random.default_rng(0).standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    bits = w.view(np.uint32) & np.uint32(0xFFFF0000)          # bf16's values, as float32
    return bits.view(np.float32)


def _run(w: np.ndarray, clip: str, search, threads: int):
    kernels.set_threads(threads)
    t0 = time.perf_counter()
    out = quant.quantize_rows("q4", lambda a, b: w[a:b], *w.shape, 128, clip, search)
    return time.perf_counter() - t0, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    w = _matrix(a.rows, a.cols)
    nth = kernels.get_threads()
    sides = [("numpy mse", "mse", None, 1), ("C mse, 1 thread", "mse", kernels.q4_group_codes, 1),
             (f"C mse, {nth} threads", "mse", kernels.q4_group_codes, nth),
             ("numpy minmax", "minmax", None, 1)]
    times = {name: [] for name, *_ in sides}
    load = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        ref = None
        for name, clip, search, th in sides:
            t, out = _run(w, clip, search, th)
            times[name].append(t)
            if clip == "mse":
                if ref is None:
                    ref = out
                for f in ("data", "scales", "zeros"):
                    assert np.array_equal(getattr(out, f), getattr(ref, f)), (name, f)
        load.append(os.getloadavg()[0])
    kernels.set_threads(nth)
    base = statistics.median(times["numpy mse"])
    res = {"matrix": [a.rows, a.cols], "rounds": a.rounds, "backend": kernels.backend(),
           "load_avg_1min": [min(load), max(load)], "seconds": {}}
    print(f"{a.rows} x {a.cols}, group 128, {a.rounds} rounds alternating, "
          f"load average {min(load):.1f}-{max(load):.1f}")
    for name in times:
        m = statistics.median(times[name])
        res["seconds"][name] = {"median": m, "min": min(times[name]), "max": max(times[name])}
        print(f"  {name:<20} median {m:.4f} s  ({min(times[name]):.4f}-{max(times[name]):.4f})"
              f"  numpy mse / this {base / m:5.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
