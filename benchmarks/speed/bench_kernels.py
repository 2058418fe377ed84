"""Micro benchmark of the kernels, backends side by side: GB/s of weight bytes
(q4, q6: data + scales + zeros; q8: data + scales; attention: keys + values read).

    python -m benchmarks.speed.bench_kernels [--quick] [--reps R] [--backends avx2,avx512vnni]

Cases, each at 1 and 2 threads, int8 activations, group 128 (mxfp4: blocks of 32, group 64):
  q4 matvec (decode, N=1) 1024x2816 and 2816x1024, and the same with N=8 tokens
  q4 and mxfp4 matvec 2880x2880 (gpt-oss's expert matrices), N=1 and 8
  q8 and q6 matvec 32000x1024 (an LM head)
  fused expert FFN, hidden 1024, intermediate 2816, N=1
  decode attention (the same code on every SIMD backend: a control for the noise)
in two settings:
  hot:  the same weights again and again (the q4 cases fit in L2/L3: compute-bound)
  cold: cycling through enough copies to overflow the last-level cache (memory-bound,
        what decode of a large MoE actually sees)
Each case measures every backend in turn, `--reps` times (alternating, so that load from
other jobs hits them alike); one measurement is the best of many ~2 ms batches, and the
table shows the median over the repetitions and its ratio to the first SIMD backend
listed (avx2 where there is one).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from colibri_core import kernels as K
from colibri_core.format.mxfp4 import MXFP4Tensor, quantize_mxfp4
from colibri_core.format.quant import (Q4Tensor, Q6Tensor, Q8Tensor, quantize_q4, quantize_q6,
                                quantize_q8)

COLD_BYTES = 160 << 20  # > any L3 we expect to meet


def nbytes(t) -> int:
    if isinstance(t, MXFP4Tensor):
        return t.data.nbytes + t.exps.nbytes
    return sum(a.nbytes for a in (t.data, t.scales, getattr(t, "zeros", None)) if a is not None)


def copies(t, k: int) -> list:
    if isinstance(t, MXFP4Tensor):
        return [MXFP4Tensor(t.data.copy(), t.exps.copy(), t.rows, t.cols) for _ in range(k)]
    if isinstance(t, Q8Tensor):
        return [Q8Tensor(t.data.copy(), t.scales.copy(), t.rows, t.cols, t.group)
                for _ in range(k)]
    return [type(t)(t.data.copy(), t.scales.copy(), t.zeros.copy(), t.rows, t.cols, t.group)
            for _ in range(k)]     # q4 or q6


def bench(fn, min_time: float) -> float:
    """Seconds per call: the best of many ~2 ms batches over min_time. Short batches and
    the minimum keep the figure meaningful on a machine shared with other jobs."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t > 2e-3:
            break
        n *= 2
    best, spent = t / n, t
    while spent < min_time:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        best, spent = min(best, t / n), spent + t
    return best


def cycler(items: list):
    """A function returning the next item of `items` on each call (round robin)."""
    state = [0]

    def nxt():
        state[0] = (state[0] + 1) % len(items)
        return items[state[0]]
    return nxt


class Runner:
    def __init__(self, backends: list[str], threads: list[int], reps: int, min_time: float):
        self.backends, self.threads, self.reps, self.min_time = backends, threads, reps, min_time
        simd = [b for b in backends if b != "scalar"]
        self.base = "avx2" if "avx2" in backends else (simd or backends)[0]
        print(f"backends {backends}, cpus {os.cpu_count()}, group 128, int8 act; medians "
              f"of {reps}; ratio = {self.base} time / backend time (> 1: faster)")
        cols = "".join(f" {b + ' us':>15} {'GB/s':>6}" for b in backends)
        ratios = "".join(f" {b + '/' + self.base:>16}" for b in backends if b != self.base)
        print(f"{'case':<26} {'N':>2} {'thr':>3} {'mode':>4}{cols}{ratios}")

    def case(self, name: str, n: int, mode: str, nbytes_: int, make_call) -> None:
        """make_call() -> a zero-argument function doing one call with the current
        backend and threads."""
        for th in self.threads:
            K.set_threads(th)
            times = {b: [] for b in self.backends}
            for _ in range(self.reps):
                for be in self.backends:
                    K.set_backend(be)
                    mt = self.min_time if be != "scalar" else self.min_time / 4
                    times[be].append(bench(make_call(), mt))
            med = {b: statistics.median(v) for b, v in times.items()}
            cols = "".join(f" {med[b] * 1e6:15.1f} {nbytes_ / med[b] / 1e9:6.2f}"
                           for b in self.backends)
            ratios = "".join(f" {med[self.base] / med[b]:16.2f}"
                             for b in self.backends if b != self.base)
            print(f"{name:<26} {n:>2} {th:>3} {mode:>4}{cols}{ratios}", flush=True)
        K.set_backend("auto")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per backend (median)")
    ap.add_argument("--backends", default=",".join(K.available_backends()),
                    help="comma-separated (default: all available here)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in K.available_backends():
            ap.error(f"backend {b} is not available here ({K.available_backends()})")
    min_time = 0.05 if args.quick else 0.25
    rng = np.random.default_rng(0)
    threads = sorted({1, min(2, os.cpu_count() or 1)})
    run = Runner(backends, threads, args.reps, min_time)
    want = lambda name: args.only in name  # noqa: E731

    def matvec_cases(kind: str, rows: int, cols: int, ns: tuple) -> None:
        name = f"{kind} matvec {rows}x{cols}"
        if not want(name):
            return
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        t = {"q4": quantize_q4, "q6": quantize_q6, "q8": quantize_q8,
             "mxfp4": lambda a, g: quantize_mxfp4(a)}[kind](w, 128)
        mm = {"q4": K.q4_matmul, "q6": K.q6_matmul, "q8": K.q8_matmul,
              "mxfp4": K.mxfp4_matmul}[kind]
        cold = copies(t, max(2, COLD_BYTES // nbytes(t)))
        for n in ns:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            out = np.empty((n, rows), np.float32)
            for mode, mats in [("hot", [t])] + ([("cold", cold)] if n == 1 else []):
                def make(mats=mats, x=x, out=out):
                    nxt = cycler(mats)
                    return lambda: mm(nxt(), x, out, "int8")
                run.case(name, n, mode, nbytes(t), make)

    matvec_cases("q4", 1024, 2816, (1, 8))
    matvec_cases("q4", 2816, 1024, (1, 8))
    matvec_cases("q8", 32000, 1024, (1,))
    matvec_cases("q6", 32000, 1024, (1,))
    for kind in ("q4", "mxfp4"):         # gpt-oss's expert matrices (hidden = inter = 2880)
        matvec_cases(kind, 2880, 2880, (1, 8))

    H, I = 1024, 2816
    if want(f"expert_ffn {H}x{I}"):
        w1, w3 = (quantize_q4(rng.standard_normal((I, H)).astype(np.float32), 128)
                  for _ in range(2))
        w2 = quantize_q4(rng.standard_normal((H, I)).astype(np.float32), 128)
        tot = nbytes(w1) + nbytes(w3) + nbytes(w2)
        k = max(2, COLD_BYTES // tot)
        experts = list(zip(copies(w1, k), copies(w3, k), copies(w2, k)))
        x = rng.standard_normal((1, H)).astype(np.float32)
        out = np.empty((1, H), np.float32)
        for mode, ex in (("hot", [(w1, w3, w2)]), ("cold", experts)):
            def make(ex=ex):
                nxt = cycler(ex)
                return lambda: K.expert_ffn(*nxt(), x, out, "int8")
            run.case(f"expert_ffn {H}x{I}", 1, mode, tot, make)

    nh, nkv, d, length = 16, 4, 128, 2048
    if want(f"attention len={length}"):
        kc = rng.standard_normal((length, nkv, d)).astype(np.float32)
        vc = rng.standard_normal((length, nkv, d)).astype(np.float32)
        q = rng.standard_normal((nh, d)).astype(np.float32)
        o = np.empty((nh, d), np.float32)
        run.case(f"attention len={length}", 1, "hot", kc.nbytes + vc.nbytes,
                 lambda: (lambda: K.attention_decode(q, kc, vc, length, o)))


if __name__ == "__main__":
    main()
