"""Leaks of the lifetime and refusal cases: each case repeated N times; RSS and open file
descriptors compared before and after (docs/ROBUSTNESS.md, "Callers and lifetimes").

    python -m benchmarks.robustness.leaks --reps 200          # the documented run
    python -m benchmarks.robustness.leaks --reps 20 --json    # what CI runs (tests/test_hardening_engine.py)
    python -m benchmarks.robustness.leaks --slope 1000        # RSS slope of engine open/close (<= 1 KB)

A case passes when, after N/4 warm-up repetitions (at least one), N more grow RSS by less
than --rss-mib (default 5) and leave the descriptor count unchanged. The warm-up is that
long because opening engines grows RSS for the first few dozen (glibc's malloc arenas and
the allocator's caches settle: about 3.5 MiB over the first 50, then flat), which one
warm-up repetition counted as a leak; a real leak grows with every repetition, warm-up or
not.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
from typing import Callable

from colibri_core.engine import Engine
from colibri_core.errors import ColibriError
from colibri_core.memstat import proc_memory


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    return proc_memory().get("VmRSS", 0)


def _refused(fn: Callable) -> None:
    try:
        fn()
    except ColibriError:
        return
    raise AssertionError("expected a typed refusal")


def case_engine_open_close() -> None:
    with Engine.from_config("builtin", threads=1) as e:
        e.generate("The with statement", max_new_tokens=4, temperature=0).run()


def case_abandoned_generations(e: Engine) -> None:
    g = iter(e.generate("The with statement", max_new_tokens=16))
    next(g)
    del g                                   # finalized: frees the engine
    g = iter(e.generate("The import system", max_new_tokens=16))
    next(g)
    g.close()


def case_side_by_side(e: Engine) -> None:
    g = iter(e.generate("The with statement", max_new_tokens=8))
    next(g)
    e.score_batch([[1, 2, 3]])              # served beside the open generation
    e.generate("x", max_new_tokens=2).run()
    g.close()


def case_bad_values(e: Engine) -> None:
    _refused(lambda: e.generate("x", stop=123))
    _refused(lambda: e.score_batch(5))
    _refused(lambda: e.generate([10**9]))
    _refused(lambda: e.generate("x", temperature=float("nan")))


def case_close_during_generate() -> None:
    e = Engine.from_config("builtin", threads=1)
    started = threading.Event()

    def run():
        try:
            for _ in e.generate("The with statement", max_new_tokens=64):
                started.set()
        except ColibriError:
            pass

    t = threading.Thread(target=run)
    t.start()
    started.wait(10)
    e.close()
    t.join(10)


def case_after_close() -> None:
    e = Engine.from_config("builtin", threads=1)
    g = e.generate("The with", max_new_tokens=4)
    e.close()
    _refused(lambda: list(g))
    _refused(e.memory_report)


def run(reps: int, rss_mib: float = 5.0) -> list[dict]:
    shared = Engine.from_config("builtin", threads=1)
    cases = [("engine open/close", case_engine_open_close),
             ("abandoned generations", lambda: case_abandoned_generations(shared)),
             ("requests side by side", lambda: case_side_by_side(shared)),
             ("bad values", lambda: case_bad_values(shared)),
             ("close during generate", case_close_during_generate),
             ("use after close", case_after_close)]
    out = []
    try:
        for name, fn in cases:
            for _ in range(max(1, reps // 4)):    # warm-up: caches, lazy imports, arenas
                fn()
            gc.collect()
            rss0, fds0 = _rss(), _fds()
            for _ in range(reps):
                fn()
            gc.collect()
            grow = (_rss() - rss0) / 2**20
            out.append({"case": name, "reps": reps, "rss_growth_mib": round(grow, 2),
                        "fd_delta": _fds() - fds0,
                        "ok": grow < rss_mib and _fds() == fds0})
    finally:
        shared.close()
    return out


def slope(cycles: int, max_bytes: float = 1024.0) -> dict:
    """Engine open/close `cycles` times (the first fifth is warm-up): RSS every 10 cycles,
    the slope of a least-squares line over the rest, in bytes per cycle (issue 39: <= 1 KB;
    a leak of one engine's objects, ~36 KB, would show at once)."""
    xs, ys = [], []
    for i in range(1, cycles + 1):
        case_engine_open_close()
        if i % 10 == 0:
            gc.collect()
            xs.append(i)
            ys.append(_rss())
    pts = [(x, y) for x, y in zip(xs, ys) if x >= cycles // 5]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"case": "engine open/close slope", "cycles": cycles, "from": pts[0][0],
            "bytes_per_cycle": round(b), "rss_kib": [pts[0][1] // 1024, pts[-1][1] // 1024],
            "ok": b <= max_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rss-mib", type=float, default=5.0)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--slope", type=int, metavar="CYCLES", help="instead: RSS slope of "
                    "CYCLES engine open/close cycles after the first fifth (<= 1 KB each)")
    args = ap.parse_args(argv)
    if args.slope:
        r = slope(args.slope)
        print(json.dumps(r) if args.json else
              f"engine open/close: {r['bytes_per_cycle']} bytes/cycle over cycles "
              f"{r['from']}..{r['cycles']} (RSS {r['rss_kib'][0]} -> {r['rss_kib'][1]} KiB) "
              f"{'ok' if r['ok'] else 'LEAK'}")
        return 0 if r["ok"] else 1
    res = run(args.reps, args.rss_mib)
    if args.json:
        print(json.dumps(res))
    else:
        for r in res:
            print(f"{r['case']:24s} {r['reps']} reps: RSS {r['rss_growth_mib']:+.2f} MiB, "
                  f"fds {r['fd_delta']:+d}  {'ok' if r['ok'] else 'LEAK'}")
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
