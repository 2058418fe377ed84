"""A/B of a streamed completion with n choices through `colibri serve`, two commits in
the same run: each side's server from its own checkout, one client, alternating.

    python -m benchmarks.speed.ab_serve_choices REF_A [REF_B] [--model builtin|bench|DIR]
        [--n 4] [--tokens 32] [--prompt 64] [--rounds 6] [--per-round 2] [--threads 2]

Each REF is checked out with `git worktree` into build/ab-<commit> with its kernels
built there (ab_decode.checkout); REF_B defaults to this working tree. Both servers run
at once, idle but for the one request in flight; each round sends --per-round requests
to one side, then the other (the order alternating by round). A request: --prompt random
token ids, --tokens new tokens per choice (greedy, ignore_eos), n choices, streamed.
Reported per side: the medians over all requests of the first-token time (request sent
-> the first token chunk of any choice), every choice's first token (-> the last choice's
first token) and the per-token time ((last token chunk - first) / (tokens - 1): one
decode step, which makes a token of every choice), and B / A.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, bench_model
from benchmarks.speed.ab_decode import checkout

SERVE = r'''
import importlib.util, sys
# the side's own built-in plugins (the editable install maps them to this checkout's)
spec = importlib.util.spec_from_file_location("colibri_core.builtin_plugins",
    sys.argv[1] + "/plugins/__init__.py", submodule_search_locations=[sys.argv[1] + "/plugins"])
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[spec.name])
from colibri_core.cli import main
sys.exit(main(sys.argv[2:]))
'''


class Server:
    def __init__(self, tree: Path, model: Path, threads: int, extra: tuple = ()):
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(tree), "serve", "--model", str(model),
             "--port", "0", "--threads", str(threads), *extra],
            cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = re.search(r"serving (http://\S+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120) or not self.url:
            self.proc.kill()
            raise SystemExit(f"the server from {tree} did not start:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def one(client, url: str, prompt: list, n: int, tokens: int) -> tuple[float, float, float]:
    """-> (first-token s, every choice's first token s, per-token s) of one streamed
    request of n choices."""
    t0 = time.perf_counter()
    times, counted, firsts = [], 0, {}
    with client.stream("POST", url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": tokens, "n": n, "temperature": 0,
            "ignore_eos": True, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise SystemExit(f"stream error: {d['error']}")
            toks = [c for c in d["choices"] if c.get("finish_reason") is None
                    and "prompt_token_ids" not in c]
            if toks:
                times.append(time.perf_counter())
                counted += len(toks)
                for c in toks:
                    firsts.setdefault(c["index"], times[-1])
    if counted != n * tokens:
        raise SystemExit(f"{counted} token chunks, expected {n * tokens}")
    return times[0] - t0, max(firsts.values()) - t0, (times[-1] - times[0]) / (tokens - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref_a")
    ap.add_argument("ref_b", nargs="?", default=None, help="default: this working tree")
    ap.add_argument("--model", default="builtin", help="builtin, bench, or a model directory")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import httpx
    from colibri_core.config import builtin_model_dir, load_model_config
    model = builtin_model_dir() if a.model == "builtin" else \
        bench_model() if a.model == "bench" else Path(a.model)
    vocab = load_model_config(model / "config.json").vocab_size
    sides = {a.ref_a: checkout(a.ref_a),
             (a.ref_b or "working tree"): checkout(a.ref_b) if a.ref_b else REPO}
    rng = np.random.default_rng(0)
    servers = {}
    try:
        for name, tree in sides.items():
            servers[name] = Server(tree, model, a.threads)
        res = {name: ([], [], []) for name in sides}
        with httpx.Client() as client:
            for name, s in servers.items():        # warm-up: each side's first request
                one(client, s.url, rng.integers(1, vocab, a.prompt).tolist(), a.n, 4)
            for r in range(a.rounds):
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for name, s in order:
                    for _ in range(a.per_round):
                        prompt = rng.integers(1, vocab, a.prompt).tolist()
                        for got, v in zip(res[name], one(client, s.url, prompt, a.n,
                                                         a.tokens)):
                            got.append(v)
                    first, every, per = (1e3 * statistics.median(v[-a.per_round:])
                                         for v in res[name])
                    print(f"round {r} {name:14s} first {first:7.1f} ms  every choice's "
                          f"first {every:7.1f} ms  per-token {per:6.2f} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = {name: [statistics.median(v) * 1e3 for v in vals] for name, vals in res.items()}
    for name, (f, e, p) in med.items():
        print(f"{name:14s} median first-token {f:7.1f} ms  every choice's first {e:7.1f} ms"
              f"  per-token {p:6.2f} ms ({len(res[name][0])} requests)")
    (na, ma), (nb, mb) = med.items()
    print(f"{nb} / {na}: first-token {mb[0] / ma[0]:.3f}  every choice's first "
          f"{mb[1] / ma[1]:.3f}  per-token {mb[2] / ma[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
