"""Hot-plug costs: drop-to-drain latency, probe, first dlopen, in-process vs isolated calls.

    python benchmarks/bench_hotplug.py [--drops 30] [--json benchmarks/out/hotplug.json]

1. drop -> drain: a new version of an expert is compiled to a scratch folder, then renamed
   into the watched folder; the time from that rename to the ExpertChange coming out of a
   drain() loop (polled every 0.5 ms, like a token loop) is measured for each drop; every
   drop is a new file (a different sha256), so every drop is settled, staged and probed.
   Run with the default settle time (0.2 s) and with 0.05 s.
2. probe: `run_probe` alone (a fresh interpreter + the checks).
3. first dlopen: dlopen(RTLD_NOW) of a staged copy never loaded before, and the whole
   drain() call that adopts one expert.
4. per call: HotExpert.forward in-process vs isolated (helper process, shared memory, two
   pipes), on a trivial expert (y = tanh x) to expose the call overhead, at hidden 64 and
   2048, n_tokens 1 and 16.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from colibri_core.hotplug import HotplugManager  # noqa: E402
from colibri_core.hotplug.expert import _ffi  # noqa: E402
from colibri_core.hotplug.probe import run_probe  # noqa: E402
from colibri_core.hotplug.testing import compile_test_expert  # noqa: E402


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def summary(values, unit="ms", scale=1e3):
    return {"p50": pct(values, 50) * scale, "p99": pct(values, 99) * scale,
            "min": min(values) * scale, "max": max(values) * scale, "n": len(values),
            "unit": unit}


def bench_drop_to_drain(work: Path, drops: int, settle_s: float, hidden: int = 64) -> dict:
    folder, state, scratch = work / "experts", work / "state", work / "scratch"
    for d in (folder, scratch):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    builds = [compile_test_expert(scratch / f"v{i}.so", hidden=hidden, name="bench",
                                  version=f"v{i}", scale=1.0 + i) for i in range(drops)]
    mgr = HotplugManager(folder, hidden, {1}, 64, state, settle_s=settle_s)
    mgr.start()
    seen: dict[str, float] = {}
    drain_cost: list[float] = []
    stop = threading.Event()

    def token_loop():
        while not stop.is_set():
            t = time.perf_counter()
            changes = mgr.drain()
            if changes:
                done = time.perf_counter()
                drain_cost.append(done - t)
                for ch in changes:
                    seen[ch.expert.version] = done
                    if ch.previous is not None:
                        mgr.release(ch.previous)
            time.sleep(0.0005)

    th = threading.Thread(target=token_loop, daemon=True)
    th.start()
    lat = []
    try:
        for i, so in enumerate(builds):
            t0 = time.perf_counter()
            os.replace(so, folder / "bench.so")
            deadline = time.monotonic() + 30
            while f"v{i}" not in seen and time.monotonic() < deadline:
                time.sleep(0.0005)
            if f"v{i}" not in seen:
                raise RuntimeError(f"drop {i} never appeared in drain()")
            lat.append(seen[f"v{i}"] - t0)
    finally:
        stop.set()
        th.join()
        mgr.close()
    return {"settle_s": settle_s, "latency": summary(lat),
            "drain_with_change": summary(drain_cost, "us", 1e6)}


def bench_probe(so: Path, hidden: int, n: int = 15) -> dict:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run_probe(str(so), hidden, 10.0)
        times.append(time.perf_counter() - t)
    return summary(times)


def bench_dlopen(so: Path, work: Path, n: int = 30) -> dict:
    times = []
    for i in range(n):
        fresh = work / f"fresh{i}.so"
        shutil.copy(so, fresh)                 # a new path + inode: not in the loader cache
        t = time.perf_counter()
        lib = _ffi.dlopen(str(fresh), _ffi.RTLD_NOW)
        times.append(time.perf_counter() - t)
        _ffi.dlclose(lib)
    return summary(times, "us", 1e6)


def bench_calls(work: Path) -> list[dict]:
    rows = []
    for hidden in (64, 2048):
        folder, state = work / f"calls{hidden}", work / f"calls{hidden}-state"
        folder.mkdir()
        os.chmod(folder, 0o755)
        compile_test_expert(folder / "inproc.so", hidden=hidden, name="inproc")
        compile_test_expert(folder / "iso.isolated.so", hidden=hidden, name="iso")
        mgr = HotplugManager(folder, hidden, {1}, 64, state, settle_s=0.01, watch=False)
        mgr.start()
        mgr.wait_idle(30)
        experts = {c.expert.name: c.expert for c in mgr.drain()}
        for n_tokens in (1, 16):
            x = np.random.default_rng(0).standard_normal((n_tokens, hidden)).astype(np.float32)
            y = np.empty_like(x)
            res = {"hidden": hidden, "n_tokens": n_tokens}
            for label, e in (("inprocess", experts["inproc"]), ("isolated", experts["iso"])):
                for _ in range(200):
                    e.forward(x, y)
                reps = 2000 if hidden == 64 else 500
                samples = []
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(reps):
                        e.forward(x, y)
                    samples.append((time.perf_counter() - t) / reps)
                res[f"{label}_us"] = statistics.median(samples) * 1e6
            res["overhead_us"] = res["isolated_us"] - res["inprocess_us"]
            rows.append(res)
        mgr.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drops", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    results: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="colibri-bench-hotplug-") as d:
        work = Path(d)
        so = compile_test_expert(work / "probe_me.so", hidden=2048, name="probe_me")
        results["drop_to_drain"] = [
            bench_drop_to_drain(work / f"drop{s}", args.drops, s) for s in (0.2, 0.05)]
        results["probe_ms"] = bench_probe(so, 2048)
        results["first_dlopen_us"] = bench_dlopen(so, work)
        results["calls"] = bench_calls(work)

    print(f"hot-plug benchmark ({results['cpus']} CPUs, Python {results['python']})")
    for r in results["drop_to_drain"]:
        lat, dc = r["latency"], r["drain_with_change"]
        print(f"  rename -> drain(), settle {r['settle_s']:.2f} s: p50 {lat['p50']:.0f} ms,"
              f" p99 {lat['p99']:.0f} ms (n={lat['n']}); drain() that adopts:"
              f" p50 {dc['p50']:.0f} us, max {dc['max']:.0f} us")
    p = results["probe_ms"]
    print(f"  probe (fresh interpreter + 10 calls): p50 {p['p50']:.0f} ms, p99 {p['p99']:.0f} ms")
    dl = results["first_dlopen_us"]
    print(f"  first dlopen(RTLD_NOW): p50 {dl['p50']:.0f} us, p99 {dl['p99']:.0f} us")
    print("  per call (y = tanh x):  hidden  n_tokens  in-process   isolated   overhead")
    for r in results["calls"]:
        print(f"                          {r['hidden']:6d}  {r['n_tokens']:8d}"
              f"  {r['inprocess_us']:8.1f} us {r['isolated_us']:8.1f} us"
              f" {r['overhead_us']:8.1f} us")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
