"""Shared helpers for the benchmarks: the benchmark model, RSS, percentiles, and what a
figure was measured on (commit, machine)."""
from __future__ import annotations

import importlib.util
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent        # benchmarks/
REPO = BENCH.parent                             # the repository root
OUT = BENCH / "out"

# The Mixtral-shaped benchmark model of issue 4.
BENCH_SHAPE = dict(vocab=32000, hidden=1024, layers=("moe",) * 8, experts=8, top_k=2,
                   inter=2816, moe_inter=2816, shared=0, heads=16, kv_heads=4, context=512)


def bench_model(path: Path | None = None, **shape) -> Path:
    """Build (or reuse) a random Colibri benchmark model directory."""
    from colibri_core.model.testing import write_random_model
    spec = {**BENCH_SHAPE, **shape}
    path = path or OUT / ("bench_model_" + "_".join(f"{k}{len(v) if isinstance(v, tuple) else v}"
                                                    for k, v in sorted(spec.items())))
    if not (path / "config.json").exists():
        t0 = time.time()
        print(f"building benchmark model in {path} ...", file=sys.stderr)
        write_random_model(path, seed=0, **spec)
        print(f"  built in {time.time() - t0:.0f} s", file=sys.stderr)
    return path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def latency_stats(lat_s: list[float]) -> dict:
    a = np.asarray(lat_s) * 1000
    return {"n": len(a), "mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)), "std_ms": float(a.std()),
            "tok_s": float(1000 / a.mean())}


def machine() -> str:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM, Linux {platform.release()}"


def git_commit() -> str:
    """The commit measured (`+dirty` when the work tree has uncommitted changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH,
                               text=True, capture_output=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def read_bandwidth(threads: int, mib: int = 1024, reps: int = 7) -> dict:
    """Best-of-`reps` bytes/s of a `threads`-thread streaming read of a `mib` MiB array
    (numpy reductions release the GIL): float64 sum and uint64 OR, the faster counts. (The
    figure the tables of docs/BENCHMARKS.md quote as "read bandwidth".)"""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(mib * 2**20 // 8)
    chunks = np.array_split(a, threads)
    res = {}
    with ThreadPoolExecutor(threads) as ex:
        for name, fn in (("sum_f64", lambda c: c.sum()),
                         ("or_u64", lambda c: np.bitwise_or.reduce(c.view(np.uint64)))):
            got = []
            for _ in range(reps):
                t = time.perf_counter()
                list(ex.map(fn, chunks))
                got.append(a.nbytes / (time.perf_counter() - t))
            res[name] = {"best_GBps": max(got) / 1e9, "median_GBps": float(np.median(got)) / 1e9}
    del a
    res["GBps"] = max(v["best_GBps"] for v in res.values())
    res.update(threads=threads, array_mib=mib, reps=reps)
    return res


_STREAM_C = r"""
#include <stddef.h>
#include <stdint.h>
/* Reads n uint64 words once (eight independent accumulators, vectorized by -O3). */
uint64_t stream_read_u64(const uint64_t *p, size_t n) {
    uint64_t a[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a[j] ^= p[i + j];
    for (; i < n; i++) a[0] ^= p[i];
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}
"""


def _stream_lib():
    """The C streaming read, compiled once with cffi (API mode) under benchmarks/out/."""
    import importlib.util
    build = OUT / "_stream_read"
    so = sorted(build.glob("_bench_stream_read*.so")) if build.is_dir() else []
    if not so:
        from cffi import FFI
        ffi = FFI()
        ffi.cdef("uint64_t stream_read_u64(const uint64_t *p, size_t n);")
        ffi.set_source("_bench_stream_read", _STREAM_C, extra_compile_args=["-O3", "-march=native"])
        build.mkdir(parents=True, exist_ok=True)
        ffi.compile(tmpdir=str(build), verbose=False)
        so = sorted(build.glob("_bench_stream_read*.so"))
    spec = importlib.util.spec_from_file_location("_bench_stream_read", so[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def c_read_bandwidth(threads: int, mib: int = 1024, reps: int = 7) -> dict:
    """Best-of-`reps` bytes/s of a `threads`-thread streaming read in C (cffi releases the
    GIL during the call) of a `mib` MiB array: the counterpart of read_bandwidth's numpy
    reductions without numpy's per-chunk overheads."""
    from concurrent.futures import ThreadPoolExecutor
    mod = _stream_lib()
    a = np.ones(mib * 2**20 // 8, np.uint64)
    chunks = np.array_split(a, threads)
    ptrs = [(mod.ffi.cast("const uint64_t *", c.ctypes.data), c.size) for c in chunks]
    got = []
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t = time.perf_counter()
            list(ex.map(lambda pc: mod.lib.stream_read_u64(*pc), ptrs))
            got.append(a.nbytes / (time.perf_counter() - t))
    del a
    return {"best_GBps": max(got) / 1e9, "median_GBps": float(np.median(got)) / 1e9,
            "threads": threads, "array_mib": mib, "reps": reps}


def best_read_bandwidth(threads: int, mib: int = 1024, reps: int = 7) -> dict:
    """One read-bandwidth figure per run: the higher of read_bandwidth (numpy) and
    c_read_bandwidth (C), both at `threads` threads; `GBps` is that figure and `source`
    says which gave it (the C read is skipped, with the reason, where cffi cannot build)."""
    res = {"numpy": read_bandwidth(threads, mib, reps)}
    try:
        res["c"] = c_read_bandwidth(threads, mib, reps)
    except Exception as e:          # no compiler: the numpy figure alone
        res["c_error"] = f"{type(e).__name__}: {e}"
    cands = {"numpy": res["numpy"]["GBps"], **({"c": res["c"]["best_GBps"]} if "c" in res else {})}
    res["source"] = max(cands, key=cands.get)
    res["GBps"] = cands[res["source"]]
    res.update(threads=threads, array_mib=mib, reps=reps)
    return res


def fraud_module(name: str):
    """examples/fraud/<name>.py loaded from its file. The example's scripts import each
    other by bare name (they run from their folder), so fraud_stream and fraud_common are
    loaded first under those names."""
    for n in ("fraud_stream", "fraud_common", name):
        if n not in sys.modules:
            spec = importlib.util.spec_from_file_location(n, REPO / "examples" / "fraud" / f"{n}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[n] = mod
            spec.loader.exec_module(mod)
    return sys.modules[name]


def import_colibri_core(code: Path):
    """colibri_core from the checkout `code` (a benchmark measuring another checkout's code):
    this one's imported as usual, another's loaded from its folder, before anything imports
    the package."""
    if code == REPO or "colibri_core" in sys.modules:
        import colibri_core
        return colibri_core
    pkg = code / "colibri_core"
    spec = importlib.util.spec_from_file_location("colibri_core", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["colibri_core"] = mod
    spec.loader.exec_module(mod)
    return mod
