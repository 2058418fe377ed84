"""Micro benchmark of the q4 kernels: GB/s of weight bytes (data + scales + zeros).

    python benchmarks/bench_kernels.py [--quick]

Matrix-vector (decode, N=1, int8 activations) at 1024x2816 and 2816x1024, for every
available backend and 1 / 2 threads, in two settings:
  hot:  the same matrix again and again (it fits in L2/L3: compute-bound figure)
  cold: cycling through enough copies to overflow the last-level cache (memory-bound,
        what decode of a large MoE actually sees)
plus the N>1 path (tokens batched per call), the fused expert FFN and decode attention.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from colibri_core import kernels as K  # noqa: E402
from colibri_core.quant import Q4Tensor, quantize_q4  # noqa: E402

COLD_BYTES = 160 << 20  # > any L3 we expect to meet


def nbytes(t: Q4Tensor) -> int:
    return t.data.nbytes + t.scales.nbytes + t.zeros.nbytes


def copies(t: Q4Tensor, k: int) -> list[Q4Tensor]:
    return [Q4Tensor(t.data.copy(), t.scales.copy(), t.zeros.copy(), t.rows, t.cols, t.group)
            for _ in range(k)]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    args = ap.parse_args()
    min_time = 0.2 if args.quick else 1.0
    rng = np.random.default_rng(0)
    threads = sorted({1, min(2, os.cpu_count() or 1)})
    print(f"backends {K.available_backends()}, cpus {os.cpu_count()}, group 128, int8 act")
    print(f"{'shape':>10} {'N':>3} {'backend':>7} {'thr':>3} {'mode':>4} {'us/call':>9} {'GB/s':>7}")
    for rows, cols in [(1024, 2816), (2816, 1024)]:
        t = quantize_q4(rng.standard_normal((rows, cols)).astype(np.float32), 128)
        cold = copies(t, max(2, COLD_BYTES // nbytes(t)))
        for n in (1, 8):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            out = np.empty((n, rows), np.float32)
            ws = K.Workspace(n, cols, 128)
            for be in K.available_backends():
                K.set_backend(be)
                for th in threads:
                    K.set_threads(th)
                    modes = [("hot", [t])] + ([("cold", cold)] if n == 1 else [])
                    for mode, mats in modes:
                        it = iter(range(1 << 62))
                        def call(mats=mats, it=it):
                            K.q4_matmul(mats[next(it) % len(mats)], x, out, "int8", ws)
                        s = bench(call, min_time if be != "scalar" else min_time / 2)
                        gbs = nbytes(t) / s / 1e9
                        print(f"{rows}x{cols:<5} {n:>3} {be:>7} {th:>3} {mode:>4} "
                              f"{s * 1e6:9.1f} {gbs:7.2f}", flush=True)
    # fused expert FFN, hidden 1024, intermediate 2816 (decode)
    H, I = 1024, 2816
    w1, w3 = (quantize_q4(rng.standard_normal((I, H)).astype(np.float32), 128) for _ in range(2))
    w2 = quantize_q4(rng.standard_normal((H, I)).astype(np.float32), 128)
    tot = nbytes(w1) + nbytes(w3) + nbytes(w2)
    ex = [copies(w, max(2, COLD_BYTES // tot)) for w in (w1, w3, w2)]
    x = rng.standard_normal((1, H)).astype(np.float32)
    out = np.empty((1, H), np.float32)
    ws = K.Workspace(1, I, 128)
    K.set_backend("auto")
    for th in threads:
        K.set_threads(th)
        it = iter(range(1 << 62))
        def ffn(it=it):
            i = next(it) % len(ex[0])
            K.expert_ffn(ex[0][i], ex[1][i], ex[2][i], x, out, "int8", workspace=ws)
        s = bench(ffn, min_time)
        print(f"expert_ffn H={H} I={I} N=1 {K.backend()} thr={th} cold: {s * 1e6:.1f} us, "
              f"{tot / s / 1e9:.2f} GB/s")
    # decode attention over a KV cache (GB/s of keys + values read)
    nh, nkv, d, length = 16, 4, 128, 2048
    kc = rng.standard_normal((length, nkv, d)).astype(np.float32)
    vc = rng.standard_normal((length, nkv, d)).astype(np.float32)
    q = rng.standard_normal((nh, d)).astype(np.float32)
    o = np.empty((nh, d), np.float32)
    for th in threads:
        K.set_threads(th)
        s = bench(lambda: K.attention_decode(q, kc, vc, length, o), min_time)
        print(f"attention_decode NH={nh} NKV={nkv} D={d} len={length} {K.backend()} thr={th}: "
              f"{s * 1e6:.1f} us, {(kc.nbytes + vc.nbytes) / s / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
