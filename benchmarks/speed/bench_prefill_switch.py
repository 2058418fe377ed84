"""Prefill: matrix-vector tiles once per token vs the matrix-matrix (batch) tiles.

    nice -n 5 python -m benchmarks.speed.bench_prefill_switch [--reps 7] [--threads 1 2]
        [--backends avx512vnni avx2] [--ns 1 2 3 ...] [--cache cold hot] [--kernels ffn attn]

A prefill groups the prompt's tokens by expert and calls the fused expert kernel once per
expert with that expert's n tokens. For n tokens a kernel call either runs the backend's
batch tiles (1 row x up to 4 tokens, sharing each unpacked weight vector) or its
matrix-vector tiles (4 rows x 1 token, sharing each activation load) once per token;
`kernels._set_matmul_min_tokens` (C: ck_set_matmul_min_tokens) forces either. This
script times both for n = 1..16, 24, 32, 64 tokens on

  ffn   kernels.expert_ffn, the benchmark model's expert: hidden 1024, intermediate 2816,
        q4 group 128, int8 activations;
  attn  kernels.q4_matmul, a 1024 x 1024 attention projection (q4 group 128, int8),

with the weights hot (one matrix, in cache) and cold (cycling through enough distinct
matrices to exceed the L3 twice: --cold-mib), on 1 and 2 threads. Each repetition runs
the variants back to back (matvec, batch, and `default`: the built-in switch point),
rotating which goes first; a variant's time is the mean per call over a batch of calls,
and the tables give the median over repetitions and ratio = matvec / batch (> 1: the
batch tiles are faster). The machine may be shared: run it niced and read the medians,
never a single time.

Prints markdown tables (per backend and kernel) and, per configuration, the smallest n
from which the batch tiles are at least as fast for every larger n measured; writes
everything as JSON to benchmarks/out/prefill_switch.json (`--report FILE` prints the
tables of a saved run again).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from benchmarks.common import OUT

NS = list(range(1, 17)) + [24, 32, 64]
HIDDEN, INTER, GROUP, ATTN = 1024, 2816, 128, 1024
# min-token settings (kernels._set_matmul_min_tokens) of the variants timed
VARIANTS = {"matvec": 1 << 30, "batch": 1, "default": 0}


def rand_q4(rng, rows: int, cols: int, group: int):
    from colibri_core.format.quant import Q4Tensor, padded_cols
    cp = padded_cols(cols, group)
    return Q4Tensor(rng.integers(0, 256, (rows, cp // 2), dtype=np.uint8),
                    rng.uniform(1e-3, 2e-3, (rows, cp // group)).astype(np.float32),
                    rng.integers(0, 16, (rows, cp // group), dtype=np.uint8),
                    rows, cols, group)


def q4_bytes(w) -> int:
    return w.data.nbytes + w.scales.nbytes + w.zeros.nbytes


def make_pool(kind: str, count: int, rng):
    if kind == "ffn":
        return [(rand_q4(rng, INTER, HIDDEN, GROUP), rand_q4(rng, INTER, HIDDEN, GROUP),
                 rand_q4(rng, HIDDEN, INTER, GROUP)) for _ in range(count)]
    return [(rand_q4(rng, ATTN, ATTN, GROUP),) for _ in range(count)]


def pool_bytes(item) -> int:
    return sum(q4_bytes(w) for w in item)


class Case:
    """One kernel on a pool of weight sets, n tokens."""

    def __init__(self, kind: str, pool, n: int, rng):
        from colibri_core import kernels as K
        self.K, self.kind, self.pool, self.n = K, kind, pool, n
        cols = HIDDEN if kind == "ffn" else ATTN
        self.x = rng.standard_normal((n, cols)).astype(np.float32)
        self.out = np.zeros((n, cols), np.float32)
        self.rw = np.ones(n, np.float32)

    def call(self, item) -> None:
        if self.kind == "ffn":
            self.K.expert_ffn(*item, self.x, self.out, act="int8", row_weights=self.rw)
        else:
            self.K.q4_matmul(item[0], self.x, self.out, act="int8")

    def time_per_call(self, items) -> float:
        t0 = time.perf_counter()
        for it in items:
            self.call(it)
        return (time.perf_counter() - t0) / len(items)


def measure(case: Case, cache: str, reps: int, hot_target_s: float) -> dict:
    K = case.K
    if cache == "hot":
        item = case.pool[0]
        case.call(item)
        t0 = time.perf_counter()
        case.call(item)
        one = time.perf_counter() - t0
        items = [item] * max(3, min(200, int(hot_target_s / max(one, 1e-7))))
    else:
        items = case.pool
    names = list(VARIANTS)
    times = {v: [] for v in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]   # rotate who goes first
        if r // len(names) % 2:
            order.reverse()
        for v in order:
            K._set_matmul_min_tokens(VARIANTS[v])
            if cache == "hot":
                case.call(items[0])   # warm this variant's code path
            times[v].append(case.time_per_call(items))
    K._set_matmul_min_tokens(0)
    med = {v: statistics.median(t) for v, t in times.items()}
    mv, bt = med["matvec"], med["batch"]
    return {"matvec_us": mv * 1e6, "batch_us": bt * 1e6, "ratio": mv / bt,
            "default_us": med["default"] * 1e6, "default_vs_best": med["default"] / min(mv, bt),
            "calls": len(items), "raw_us": {k: [t * 1e6 for t in v] for k, v in times.items()}}


def crossover(rows: list[dict]) -> int | None:
    """Smallest measured n > 1 from which the batch tiles are at least as fast (ratio >= 1)
    at n itself and at most larger measured n: one noisy point (a stall of the shared
    machine during one variant) does not move it."""
    rows = sorted((r for r in rows if r["n"] > 1), key=lambda r: r["n"])
    for i, r in enumerate(rows):
        rest = [x["ratio"] >= 1.0 for x in rows[i + 1:]]
        if r["ratio"] >= 1.0 and sum(rest) * 2 >= len(rest):
            return r["n"]
    return None


def report(results: list[dict], default_min: int, reps: int) -> None:
    """Markdown tables, one per kernel, backend and thread count."""
    def uniq(key):
        return list(dict.fromkeys(r[key] for r in results))
    caches, ns = uniq("cache"), sorted(uniq("n"))
    print(f"default switch point (CK_MATMUL_MIN_TOKENS): {default_min}; times in us per "
          f"call, median of {reps}; ratio = matvec / batch (> 1: batch tiles faster); "
          f"default: the built-in switch point (batch tiles from n = {default_min}, a last "
          f"partial tile of fewer tokens per token)\n")
    for kind in uniq("kernel"):
        for be in uniq("backend"):
            for th in uniq("threads"):
                sel = [r for r in results if r["kernel"] == kind and r["backend"] == be
                       and r["threads"] == th]
                if not sel:
                    continue
                title = ("expert_ffn 1024 -> 2816 -> 1024" if kind == "ffn"
                         else "q4_matmul 1024 x 1024")
                print(f"**{title}, {be}, {th} thread{'s' if th > 1 else ''}**\n")
                print("| n |" + "".join(f" {c} matvec | {c} batch | ratio | {c} default |"
                                        for c in caches))
                print("|---:|" + "---:|---:|---:|---:|" * len(caches))
                for n in ns:
                    cells = []
                    for c in caches:
                        r = next(r for r in sel if r["n"] == n and r["cache"] == c)
                        cells.append(f" {r['matvec_us']:.0f} | {r['batch_us']:.0f} | "
                                     f"{r['ratio']:.2f} | {r['default_us']:.0f} |")
                    print(f"| {n} |" + "".join(cells))
                xs = [f"{c}: {crossover([r for r in sel if r['cache'] == c])}" for c in caches]
                print("\nbatch tiles at least as fast from n = " + ", ".join(xs) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backends", nargs="+", default=None, help="default: the active one")
    ap.add_argument("--ns", type=int, nargs="+", default=NS)
    ap.add_argument("--cache", nargs="+", default=["cold", "hot"], choices=["cold", "hot"])
    ap.add_argument("--kernels", nargs="+", default=["ffn", "attn"], choices=["ffn", "attn"])
    ap.add_argument("--cold-mib", type=float, default=80.0,
                    help="total size of the distinct weight sets cycled through when cold")
    ap.add_argument("--hot-ms", type=float, default=15.0, help="time per hot measurement")
    ap.add_argument("--json", default=str(OUT / "prefill_switch.json"))
    ap.add_argument("--report", metavar="JSON", help="only print the tables of a saved run")
    a = ap.parse_args(argv)
    if a.report:
        with open(a.report) as f:
            saved = json.load(f)
        report(saved["results"], saved["default_min_tokens"], saved["reps"])
        return

    from colibri_core import kernels as K
    default_min = K._set_matmul_min_tokens(0)
    backends = a.backends or [K.backend()]
    old_threads = K.get_threads()
    rng = np.random.default_rng(0)
    results = []
    for kind in a.kernels:
        one = pool_bytes(make_pool(kind, 1, rng)[0])
        count = max(2, int(np.ceil(a.cold_mib * 2**20 / one)))
        pool = make_pool(kind, count, rng)
        print(f"{kind}: {one / 2**20:.2f} MiB per weight set, {count} sets "
              f"({count * one / 2**20:.0f} MiB) when cold", file=sys.stderr)
        for be in backends:
            K.set_backend(be)
            for th in a.threads:
                K.set_threads(th)
                for cache in a.cache:
                    for n in a.ns:
                        case = Case(kind, pool if cache == "cold" else pool[:1], n, rng)
                        m = measure(case, cache, a.reps, a.hot_ms / 1000)
                        row = {"kernel": kind, "backend": be, "threads": th, "cache": cache,
                               "n": n, **m}
                        results.append(row)
                        print(f"{kind} {be} {th}t {cache} n={n:3d}: matvec {m['matvec_us']:9.1f} us"
                              f"  batch {m['batch_us']:9.1f} us  ratio {m['ratio']:.3f}",
                              file=sys.stderr, flush=True)
    K.set_backend("auto")
    K.set_threads(old_threads)

    print()
    report(results, default_min, a.reps)
    OUT.mkdir(exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"default_min_tokens": default_min, "reps": a.reps, "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
