"""A/B of decode speed between two commits, in the same run: each side in its own
checkout and fresh processes, alternating, several rounds; medians and the ratio.

    python -m benchmarks.speed.ab_decode REF [--rounds 5] [--threads 2] [--model DIR]

REF is any commit: it is checked out with `git worktree` into build/ab-<commit> and its
kernels are built there; the other side is this working tree (uncommitted changes
included). Each round runs one generation of 128 tokens after a 64-token prompt on each
side (bench_vs_llamacpp.py's model by default) and records the per-token p50.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import OUT, REPO

CHILD = r'''
import importlib.util, json, sys, numpy as np
# the side's own built-in plugins: the editable install maps colibri_core.builtin_plugins
# to this checkout's plugins/ whatever PYTHONPATH says
spec = importlib.util.spec_from_file_location("colibri_core.builtin_plugins",
    sys.argv[3] + "/plugins/__init__.py", submodule_search_locations=[sys.argv[3] + "/plugins"])
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[spec.name])
from colibri_core.engine import Engine
from colibri_core.config import EngineConfig
e = Engine(sys.argv[1], EngineConfig(threads=int(sys.argv[2])))
prompt = list(np.random.default_rng(0).integers(1, e.model_cfg.vocab_size - 1, 64))
e.generate(prompt[:8], max_new_tokens=4, temperature=0).run()
lat = [ev.latency_s for ev in e.generate(prompt, max_new_tokens=129, temperature=0)][1:]
print(json.dumps({"p50_ms": float(np.median(lat)) * 1e3, "mean_ms": float(np.mean(lat)) * 1e3}))
'''


BUILD_SCRIPTS = ("colibri_core/kernels/build.py", "colibri_core/_kernels_build.py")


def checkout(ref: str) -> Path:
    """A worktree of `ref` (resolved to its commit now: "HEAD" moves) with its kernels."""
    commit = subprocess.run(["git", "rev-parse", "--verify", ref + "^{commit}"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.strip()
    path = REPO / "build" / f"ab-{commit[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True)
    # the kernels' build script moved with issue 37's layout (kernels/build.py)
    script = next(s for s in BUILD_SCRIPTS if (path / s).exists())
    subprocess.run([sys.executable, script], cwd=path, check=True, stdout=subprocess.DEVNULL)
    return path


def run(tree: Path, model: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), str(tree)], env=env, cwd="/",
                         capture_output=True, text=True)
    if out.returncode != 0:                 # the child's own error, not just its exit status
        raise SystemExit(f"ab_decode: the run in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=str(OUT / "vs_llamacpp" / "colibri_q4"))
    a = ap.parse_args(argv)
    sides = {a.ref: checkout(a.ref), "working tree": REPO}
    res = {name: [] for name in sides}
    for r in range(a.rounds):
        for name, tree in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            p = run(tree, a.model, a.threads)["p50_ms"]
            res[name].append(p)
            print(f"round {r} {name:14s} p50 {p:.3f} ms", flush=True)
    med = {n: statistics.median(v) for n, v in res.items()}
    print(json.dumps(med), f"working tree / {a.ref}: {med['working tree'] / med[a.ref]:.3f}")


if __name__ == "__main__":
    main()
