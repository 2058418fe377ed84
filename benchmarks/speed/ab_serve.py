"""bench_serve's load as an A/B of two commits with llama-server beside, in the same run.

    python -m benchmarks.speed.ab_serve REF_A [REF_B] [--model DIR] [--gguf MODEL.gguf]
        [--llama-server BIN | --no-peer] [--clients 1,4,16] [--rounds 5] [--tokens 128]
        [--prompt 64] [--threads 2]

Three servers run at once, idle but for the level being measured: `colibri serve` from
REF_A's checkout (git worktree under build/ab-<commit> with its kernels, as
ab_decode.checkout), from REF_B's (default: this working tree), and llama.cpp's
`llama-server -np <largest client count>` on the same model as GGUF. A round runs each
client count on each server in turn, the servers' order rotating by round: c clients send
max(c, 2) streaming completions (--prompt random token ids, --tokens tokens with
ignore_eos, greedy; bench_serve.run_level), prompts new for each round and client count
and the same for the three servers (no prompt cache hit anywhere). Reported per server
and client count: the medians over rounds of aggregate tokens/s, first-token p50 and
per-token p50, and each side over REF_A as the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, REPO, git_commit, machine
from benchmarks.speed.ab_decode import checkout
from benchmarks.speed.ab_serve_choices import Server
from benchmarks.speed.bench_serve import LlamaServer, prompts, run_level

METRICS = ("tok_s", "first_ms_p50", "per_token_ms_p50")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref_a")
    ap.add_argument("ref_b", nargs="?", default=None, help="default: this working tree")
    ap.add_argument("--model", default=str(OUT / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--gguf", type=Path, default=OUT / "vs_llamacpp" / "model-q4_0.gguf")
    ap.add_argument("--llama-server", dest="llama_server", type=Path,
                    default=REPO / "build" / "llamacpp" / "build" / "bin" / "llama-server")
    ap.add_argument("--no-peer", dest="peer", action="store_false",
                    help="the two sides only, without llama-server")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(OUT / "ab_serve.json"))
    a = ap.parse_args(argv)
    from colibri_core.config import load_model_config
    model = Path(a.model)
    vocab = load_model_config(model / "config.json").vocab_size
    levels = [int(x) for x in a.clients.split(",")]
    name_b = a.ref_b or "working tree"
    trees = {a.ref_a: checkout(a.ref_a), name_b: checkout(a.ref_b) if a.ref_b else REPO}
    load0 = os.getloadavg()
    print(f"# ab_serve: {model.name}, {a.rounds} rounds, load {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}; " + ", ".join(f"{n}: {t}" for n, t in trees.items()),
          file=sys.stderr, flush=True)
    servers: dict = {}
    try:
        for name, tree in trees.items():
            servers[name] = Server(tree, model, a.threads, ("--model-id", "bench"))
        if a.peer:
            servers["llama-server"] = LlamaServer(a.llama_server, a.gguf, a.threads, max(levels),
                                                  a.prompt + a.tokens + 8)
        keep = {name: name != "llama-server" for name in servers}  # it closes idle sockets
        for name, s in servers.items():                                        # warm-up
            asyncio.run(run_level(s.url, 1, prompts(vocab, 2, a.prompt, seed=1), 2, 8, 60,
                                  keepalive=keep[name]))
        res = {name: {c: [] for c in levels} for name in servers}
        names = list(servers)
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for c in levels:
                ps = prompts(vocab, max(c, 2), a.prompt, seed=10_000 * (r + 1) + c)
                for name in order:
                    row = asyncio.run(run_level(servers[name].url, c, ps, max(c, 2), a.tokens,
                                                600, keepalive=keep[name]))
                    if row["errors"]:
                        raise SystemExit(f"{name}, {c} clients: {row['error_examples']}")
                    res[name][c].append({k: row[k] for k in METRICS})
                    print(f"round {r} {name:14s} {c:2d} clients: {row['tok_s']:6.1f} tok/s  "
                          f"first p50 {row['first_ms_p50']:7.1f} ms  per-token p50 "
                          f"{row['per_token_ms_p50']:6.2f} ms  load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    load1 = os.getloadavg()
    med = {n: {c: {k: statistics.median(x[k] for x in res[n][c]) for k in METRICS}
               for c in levels} for n in res}
    ratio = {n: {c: {k: statistics.median(x[k] / y[k] for x, y in zip(res[n][c],
                                                                        res[a.ref_a][c]))
                     for k in METRICS} for c in levels} for n in res}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({
        "rounds": res, "medians": med, "ratios_over_a": ratio, "a": a.ref_a, "b": name_b,
        "trees": {n: str(t) for n, t in trees.items()},
        "commit": git_commit(), "machine": machine(), "load_before": load0,
        "load_after": load1, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        indent=1))
    print(f"| server | clients | tok/s | first-token p50 ms | per-token p50 ms | "
          f"tok/s / {a.ref_a} | first-token / {a.ref_a} | per-token / {a.ref_a} |")
    print("|---|---|---|---|---|---|---|---|")
    for n in res:
        for c in levels:
            m, q = med[n][c], ratio[n][c]
            print(f"| {n} | {c} | {m['tok_s']:.1f} | {m['first_ms_p50']:.0f} | "
                  f"{m['per_token_ms_p50']:.2f} | {q['tok_s']:.3f} | {q['first_ms_p50']:.3f} | "
                  f"{q['per_token_ms_p50']:.3f} |")
    print(f"load before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
