"""Adaptive k (plugins/adaptive_k.py) against fixed k on the built-in model.

    python -m benchmarks.accuracy.bench_adaptive_k [--tokens 512]

Teacher-forced over Python documentation text: for each setting, the mean number of
experts per token, prefill tokens/s, and quality as the mean KL divergence of next-token
distributions from the model's default k (KL(default || setting), nats). The measurement
is tests/adaptive_k_helpers.py's (tests/test_builtin_plugins.py holds a floor on it).
"""
from __future__ import annotations

import argparse
import json

from tests.adaptive_k_helpers import measure


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    a = ap.parse_args(argv)
    rows = measure(a.tokens, a.chunk)
    print("| setting | experts/token | prefill tok/s | KL vs k=2 (nats) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['experts_per_token']} | {r['tokens_per_s']} | {r['kl_vs_default']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
