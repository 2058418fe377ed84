"""Warm load to first token, the load path as it is against an older state of it,
alternating, each start a new process (issue 30: Qwen3-30B-A3B's 6,146 files).

    python -m benchmarks.speed.ab_warm_load MODEL_DIR [--starts 4] [--old mincore] [--no-read]

`--old` names the state patched back in: "mincore" (before 140968f: whether a file is
cached past its header asked of every page of its first 2 MB, not of two), "files" (that
and, as before the same change, every expert file's table checked on its own: a fresh
dict of its Sections per file, so expert_ffn checks each), "parse" (before
f6665d2 and e9385f7: a section-table parse per file, the background preload started
inside `Engine()`). The files are read once first (warm page cache; `--no-read`: they are
already, e.g. by an earlier run). Prints each start's imports, `Engine()`, first forward
(8-token prompt, 1 token) and total, with the load average, then medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_CHILD = """
import json, os, sys, time
t0 = float(sys.argv[3])
from colibri_core.engine import Engine
from colibri_core.format import modelfile
old = sys.argv[4] if sys.argv[2] == "old" else None
if old == "parse":
    modelfile._parsed = lambda h, n, src, mt: {s.name: s for s in modelfile.parse_table(h, n, src, mt)}
if old == "files":
    _shared = modelfile._parsed
    modelfile._parsed = lambda h, n, src, mt: dict(_shared(h, n, src, mt))
if old in ("mincore", "files"):
    from colibri_core.format.container import HUGE_PAGE, resident_bytes
    def _whole(mm, start):
        end = min(HUGE_PAGE, mm.size) // 4096 * 4096
        return end > start and resident_bytes(mm.address + start, end - start) > 0
    modelfile._cached_after = _whole
t1, c1 = time.time(), time.process_time()
eng = Engine.from_model_dir(sys.argv[1], threads=2)
c2 = time.process_time()
if old == "parse":
    eng.model.residency._first_step_done.set()
t2 = time.time()
import resource
r0 = resource.getrusage(resource.RUSAGE_SELF)
eng.generate([5, 6, 7, 8, 9, 10, 11, 12], max_new_tokens=1, temperature=0).run()
t3 = time.time()
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"imports": t1 - t0, "engine": t2 - t1, "first": t3 - t2, "total": t3 - t0,
                  "engine_cpu": c2 - c1,
                  "first_cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                  "first_majflt": r1.ru_majflt - r0.ru_majflt, "load": os.getloadavg()[0]}), flush=True)
os._exit(0)
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--starts", type=int, default=4)
    ap.add_argument("--old", choices=("mincore", "files", "parse"), default="files")
    ap.add_argument("--no-read", action="store_true", help="the files are cached already")
    a = ap.parse_args(argv)
    buf = bytearray(8 << 20)
    for f in [] if a.no_read else sorted(a.model.iterdir()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    got = {"old": [], "new": []}
    for i in range(a.starts):
        for mode in (("old", "new") if i % 2 == 0 else ("new", "old")):
            p = subprocess.run([sys.executable, "-c", _CHILD, str(a.model), mode, str(time.time()),
                                a.old],
                               capture_output=True, text=True, check=True)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            got[mode].append(r)
            print(mode, " ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    for mode, rows in got.items():
        print(mode, "medians:", " ".join(f"{k} {statistics.median(r[k] for r in rows):.2f}"
                                         for k in ("imports", "engine", "engine_cpu", "first", "first_cpu",
                                                   "first_majflt", "total")))


if __name__ == "__main__":
    main()
