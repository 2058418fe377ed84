"""Cold start: how the routed experts' files are brought in (EngineConfig.prefetch).

    python -m benchmarks.speed.bench_prefetch [--rounds 3] [--prompt 4] [--tokens 64]
                                        [--preload none|willneed|populate]

For each mode -- "none" (page faults as the kernels touch the weights), "willneed"
(MADV_WILLNEED on each routed expert's file as soon as the router has chosen it: the
kernel starts reading ahead while the layer's attention is done) and "populate"
(MADV_POPULATE_READ: the same, but the call returns once the pages are read and mapped)
-- a fresh process drops the model's files from the page cache (posix_fadvise DONTNEED,
checked with mincore), opens the engine and times a short prompt and the decode after it,
when most experts are first used. Modes alternate; medians of the rounds.
`--preload` is EngineConfig.preload for every run (default: the engine's default,
`willneed`, which advises every model file at load; `none` isolates the per-expert
prefetch). Default model: the one bench_vs_llamacpp.py converts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import OUT, REPO, git_commit, machine

CHILD = r'''
import json, sys, time, numpy as np
from pathlib import Path
from colibri_core.memstat import drop_file_cache, file_cache_bytes
from colibri_core.engine import Engine
from colibri_core.config import EngineConfig
model, mode, n_prompt, n_tok = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
preload = json.loads(sys.argv[5])
files = sorted(Path(model).glob("*.bin"))
for f in files:
    drop_file_cache(f, sync=True)
left = sum(file_cache_bytes(f) for f in files)
def read_bytes():
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
r0 = read_bytes()
t0 = time.perf_counter()
e = Engine(model, EngineConfig(threads=2, prefetch=mode, **preload))
t_open = time.perf_counter() - t0
prompt = list(np.random.default_rng(0).integers(1, e.model_cfg.vocab_size - 1, n_prompt))
t0 = time.perf_counter()
lat = [ev.latency_s for ev in e.generate(prompt, max_new_tokens=n_tok + 1, temperature=0)]
total = time.perf_counter() - t0
print(json.dumps({"cached_before_mb": left / 1e6, "open_ms": t_open * 1e3, "first_ms": lat[0] * 1e3,
                  "decode_mean_ms": float(np.mean(lat[1:])) * 1e3,
                  "decode_p50_ms": float(np.median(lat[1:])) * 1e3,
                  "decode_max_ms": float(np.max(lat[1:])) * 1e3,
                  "total_ms": total * 1e3, "read_mb": (read_bytes() - r0) / 1e6}))
'''


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=str(OUT / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--preload", choices=["none", "willneed", "populate"],
                    help="EngineConfig.preload for every run (default: the engine's)")
    a = ap.parse_args(argv)
    preload = json.dumps({"preload": a.preload} if a.preload else {})
    print(f"commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{machine()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    modes = ["none", "willneed", "populate"]
    runs = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            out = subprocess.run([sys.executable, "-c", CHILD, a.model, m, str(a.prompt), str(a.tokens),
                                  preload],
                                 capture_output=True, text=True, check=True, cwd=str(REPO))
            j = json.loads(out.stdout.strip().splitlines()[-1])
            runs[m].append(j)
            print(f"round {r} {m:9s} " + "  ".join(f"{k} {v:.1f}" for k, v in j.items()), flush=True)
    keys = ["first_ms", "decode_mean_ms", "decode_p50_ms", "decode_max_ms", "total_ms", "read_mb"]
    print("\n| prefetch | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for m in modes:
        print(f"| {m} | " + " | ".join(f"{statistics.median(x[k] for x in runs[m]):.1f}" for k in keys) + " |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "prefetch.json").write_text(json.dumps({"args": vars(a), "runs": runs,
                                                            "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
