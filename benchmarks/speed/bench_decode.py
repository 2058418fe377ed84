"""Colibri decode/prefill timing on the benchmark model (token ids in, token id out).

    python -m benchmarks.speed.bench_decode [--tokens 128] [--prompt 64] [--threads 2]

Prints first-token latency, decode tokens/s, per-token p50/p99/std and peak RSS as JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.common import bench_model, latency_stats, peak_rss_mib


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    from colibri_core.engine import Engine
    path = a.model or bench_model()
    eng = Engine.from_model_dir(path, threads=a.threads)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, eng.model_cfg.vocab_size, a.prompt).tolist()
    eng.generate(prompt[:8], max_new_tokens=4, temperature=0).run()       # warm-up
    t0 = time.perf_counter()
    g = eng.generate(prompt, max_new_tokens=a.tokens, temperature=0)
    if a.profile:
        import cProfile, pstats
        pr = cProfile.Profile()
        pr.enable()
    ev = list(g)
    if a.profile:
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
    first = ev[0].latency_s
    res = {"engine": "colibri", "first_token_ms": first * 1000,
           **latency_stats([e.latency_s for e in ev[1:]]), "peak_rss_mib": peak_rss_mib()}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
