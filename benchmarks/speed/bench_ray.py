"""The fleet's overhead on one machine: `colibri serve --ray` against `colibri serve`.

    python -m benchmarks.speed.bench_ray                  # the benchmark model of issue 4
    python -m benchmarks.speed.bench_ray --model builtin --requests 16 --tokens 32 --drops 5

This 2-core machine cannot show scaling across machines, so this measures what Ray
Serve costs, in one run, with bench_serve.py's load generator (16 streaming clients,
token-id prompts, ignore_eos, greedy):

  1. `colibri serve --threads 2`;
  2. the fleet, 1 replica x 2 CPUs (a local cluster of 2 CPUs, tests/ray_helpers.py);
  3. the fleet, 2 replicas x 1 CPU (a second such cluster).

All three run at once (idle but for the one measured); --rounds rounds of aggregate
tokens/s, each round all three in a rotated order (the machine's load changes hit all
alike; ratios are per round, then the median). Then, for each, --drops expert drops (a
new version of one expert renamed into the watched folder each time, under a light
background load of 2 clients): drop -> routable (one engine: GET /v1/experts names the
new set; the fleet: the registry's rollout complete, every replica on the new set), the
background's failed requests, and each replica's own fetch and adoption times.

Each throughput round also reads the CPU time of every process of the measured
server (`colibri serve`'s process; each cluster's processes, tests/ray_helpers.py):
CPU milliseconds per token by process, then grouped (engine replicas, ingress, HAProxy,
Serve's Python proxy, the rest), in the JSON and on stderr.

Targets (issue 17): 2. >= 0.85x 1.'s tokens/s; 3. >= 0.85x 2.'s; 0 failed requests
during drops; drop -> routable p50 reported beside the single engine's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import OUT, git_commit, machine
from benchmarks.speed.bench_serve import Server, launch, model_dir, prompts, run_level
from tests.ray_helpers import RayCluster, free_port

BENCH_Q4 = OUT / "vs_llamacpp" / "colibri_q4"   # bench_vs_llamacpp.py makes it


class Fleet:
    """`colibri serve --ray` in a subprocess, on an existing cluster."""

    def __init__(self, mdir: Path, cluster: RayCluster, replicas: int, cpus: int,
                 queue: int):
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-ray-")
        self.experts = Path(self.tmp.name) / "experts"
        self.experts.mkdir(mode=0o755)
        port = free_port()
        cmd = [sys.executable, "-m", "colibri_core", "serve", "--ray", "--model", str(mdir),
               "--ray-address", cluster.address, "--replicas", str(replicas),
               "--replica-cpus", str(cpus), "--port", str(port), "--queue-size", str(queue),
               "--experts-dir", str(self.experts),
               "--registry-dir", str(Path(self.tmp.name) / "registry")]
        self.proc, self.url, self.log = launch(cmd, "fleet", 300, env=cluster.env)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self.tmp.cleanup()
        return rc


def compile_versions(scratch: Path, n: int, hidden: int, layer: int) -> list[Path]:
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    return [compile_test_expert(scratch / f"v{i}.so", hidden=hidden, layer=layer,
                                name="bench_drop", version=str(i + 1), scale=1.0 + i / 64)
            for i in range(n)]


def routable(url: str, before: str, fleet: bool) -> bool:
    d = httpx.get(url + "/v1/experts", timeout=30).json()
    if fleet:
        ro = d["rollout"]
        return ro["complete"] and ro["expert_set_id"] != before and \
            ro["expert_set_id"] == d["expert_set_id"]
    return d["expert_set_id"] != before


def drops(url: str, folder: Path, versions: list, scratch: Path, fleet: bool, ps: list,
          tokens: int) -> dict:
    """Each version renamed into the folder in turn, under 2 background clients:
    drop -> routable times, and the background's failed requests."""
    stop = threading.Event()
    bg: list = []

    def background():
        async def go():
            while not stop.is_set():
                bg.append(await run_level(url, 2, ps, 2, tokens, 120))
        asyncio.run(go())
    t = threading.Thread(target=background, daemon=True)
    t.start()
    times, per = [], []
    try:
        for i, so in enumerate(versions):
            before = httpx.get(url + "/v1/experts", timeout=30).json()["expert_set_id"]
            copy = scratch / f".drop{i}.so"
            copy.write_bytes(so.read_bytes())
            os.chmod(copy, 0o644)
            t0 = time.perf_counter()
            os.replace(copy, folder / "bench_drop.so")
            deadline = t0 + 120
            while not routable(url, before, fleet):
                if time.perf_counter() > deadline:
                    raise SystemExit(f"drop {i}: not routable within 120 s")
                time.sleep(0.005)
            times.append(time.perf_counter() - t0)
            if fleet:                          # each replica's own fetch and adoption
                for r in httpx.get(url + "/v1/experts", timeout=30).json()["replicas"]:
                    if r["live"] and r.get("timing"):
                        per.append(r["timing"])
    finally:
        stop.set()
        t.join(300)
    return {"drops": len(times), "p50_ms": 1000 * float(np.median(times)),
            "max_ms": 1000 * float(np.max(times)),
            "background_requests": sum(r["requests"] for r in bg),
            "failed_requests": sum(r["errors"] for r in bg),
            "error_examples": [e for r in bg for e in r["error_examples"]][:3],
            "replica_fetch_ms_p50": _p(per, "fetch_ms", 50),
            "replica_adopt_ms_p50": _p(per, "adopt_ms", 50),
            "replica_adopt_ms_max": _p(per, "adopt_ms", 100), "replica_samples": len(per)}


def _p(rows: list, key: str, q: float):
    return float(np.percentile([r[key] for r in rows], q)) if rows else None


def throughput(url: str, args, ps, cpu=None) -> dict:
    """One round of aggregate tokens/s; with `cpu` (a function -> {process: CPU seconds
    so far}), each process's CPU milliseconds per token of the round too."""
    before = cpu() if cpu else {}
    row = asyncio.run(run_level(url, args.clients, ps, args.requests, args.tokens,
                                args.time_cap))
    if cpu:
        after = cpu()
        tokens = row["tok_s"] * row["wall_s"]
        row["cpu_ms_per_token"] = {k: 1000 * (v - before.get(k, 0.0)) / tokens
                                   for k, v in after.items() if tokens > 0} if tokens else {}
    return row


def process_cpu(pid: int) -> dict:
    """`colibri serve`'s process: {"colibri serve": CPU seconds so far}."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"colibri serve": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}


PARTS = {"engine": ("colibri-engine", "colibri serve"), "ingress": ("colibri-ingress",),
         "haproxy": ("haproxy",), "serve proxy": ("ray::ProxyActor",)}


def cpu_parts(rounds: list) -> dict:
    """The rounds' CPU ms per token, median per process, then grouped: the engine
    replicas, the ingress, HAProxy, Serve's Python proxy, the rest of the cluster."""
    names = {k for r in rounds for k in r.get("cpu_ms_per_token", {})}
    med = {k: float(np.median([r["cpu_ms_per_token"].get(k, 0.0) for r in rounds]))
           for k in names}
    out = dict.fromkeys([*PARTS, "other"], 0.0)
    for k, v in med.items():
        part = next((part for part, keys in PARTS.items() if any(x in k for x in keys)),
                    "other")
        out[part] += v
    return {"by_process": med, **out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="q4", help="q4 (issue 4's model converted, "
                    f"{BENCH_Q4}, else the built-in), bench, builtin, or a model directory")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--drops", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds, interleaved")
    ap.add_argument("--time-cap", type=float, default=300.0)
    ap.add_argument("--json", default=str(OUT / "ray.json"))
    args = ap.parse_args(argv)
    mdir = (BENCH_Q4 if BENCH_Q4.is_dir() else model_dir("builtin")) if args.model == "q4" \
        else model_dir(args.model)
    from colibri_core.config import load_model_config
    cfg = load_model_config(mdir / "config.json")
    ps = prompts(cfg.vocab_size, args.clients * 2, args.prompt)
    load = os.getloadavg()
    print(f"# bench_ray: {mdir}, {args.clients} clients, prompt {args.prompt} ids, "
          f"{args.tokens} tokens; load {load[0]:.2f}", file=sys.stderr, flush=True)
    queue = max(64, args.clients * 2)
    names = ["colibri serve --threads 2", "--ray, 1 x 2 CPU", "--ray, 2 x 1 CPU"]
    runs: dict = {n: [] for n in names}
    drop: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-ray-so-") as sd:
        scratch = Path(sd)
        versions = compile_versions(scratch, args.drops, cfg.hidden_size, cfg.moe_layers[0])
        srv = Server(mdir, 2, queue, [])
        clusters, fleets = [], []
        try:
            for replicas, cpus in ((1, 2), (2, 1)):    # a cluster each: both stay up
                clusters.append(RayCluster(cpus=2))
                fleets.append(Fleet(mdir, clusters[-1], replicas, cpus, queue))
            targets = [(srv.url, Path(srv.tmp.name) / "experts", False)] + \
                [(f.url, f.experts, True) for f in fleets]
            cpus = [lambda: process_cpu(srv.proc.pid)] + [c.cpu_seconds for c in clusters]
            for url, _, _ in targets:                   # warm-up
                asyncio.run(run_level(url, 2, ps, 4, min(8, args.tokens), 120))
            for rnd in range(args.rounds):              # interleaved, order rotated
                order = list(range(3))[rnd % 3:] + list(range(3))[:rnd % 3]
                for i in order:
                    row = throughput(targets[i][0], args, ps, cpus[i])
                    runs[names[i]].append(row)
                    per = row.get("cpu_ms_per_token", {})
                    top = ", ".join(f"{k} {v:.2f}" for k, v in
                                    sorted(per.items(), key=lambda kv: -kv[1])[:4])
                    print(f"# round {rnd + 1}, {names[i]}: {row['tok_s']:.1f} tok/s, errors "
                          f"{row['errors']}; load {os.getloadavg()[0]:.2f}; CPU ms/token: "
                          f"{top}", file=sys.stderr, flush=True)
            for name, (url, folder, fleet) in zip(names, targets):
                drop[name] = drops(url, folder, versions, scratch, fleet, ps,
                                   min(16, args.tokens))
                d = drop[name]
                print(f"# {name}: drop -> routable p50 {d['p50_ms']:.0f} ms, "
                      f"{d['failed_requests']} failed of {d['background_requests']}",
                      file=sys.stderr, flush=True)
        finally:
            srv.stop()
            for f in fleets:
                f.stop()
            for c in clusters:
                c.stop()
    rows = []
    for name in names:
        rs = runs[name]
        rows.append({"name": name, "tok_s": float(np.median([r["tok_s"] for r in rs])),
                     "tok_s_rounds": [r["tok_s"] for r in rs],
                     "requests": sum(r["requests"] for r in rs),
                     "errors": sum(r["errors"] for r in rs),
                     "first_ms_p50": float(np.median([r["first_ms_p50"] for r in rs])),
                     "per_token_ms_p50": float(np.median([r["per_token_ms_p50"] for r in rs])),
                     "per_token_ms_p99": float(np.median([r["per_token_ms_p99"] for r in rs])),
                     "cpu_ms_per_token": cpu_parts(rs), "drop": drop[name]})
    one, ray1, ray2 = rows
    ratios1 = [b["tok_s"] / a["tok_s"] for a, b in zip(runs[names[0]], runs[names[1]])]
    ratios2 = [b["tok_s"] / a["tok_s"] for a, b in zip(runs[names[1]], runs[names[2]])]
    report = {"model": str(mdir), "clients": args.clients, "requests": args.requests,
              "tokens": args.tokens, "prompt": args.prompt, "rows": rows,
              "rounds": args.rounds,
              "ratio_ray1_vs_serve": float(np.median(ratios1)), "ratios1": ratios1,
              "ratio_ray2_vs_ray1": float(np.median(ratios2)), "ratios2": ratios2,
              "machine": machine(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_after": list(os.getloadavg())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    for r in rows:
        c = r["cpu_ms_per_token"]
        print(f"# {r['name']}: CPU ms per token (median of rounds): " + ", ".join(
            f"{part} {c[part]:.2f}" for part in [*PARTS, "other"] if c[part] > 0.0))
    for r in rows[1:]:
        d = r["drop"]
        print(f"# {r['name']}: per replica, fetch p50 {d['replica_fetch_ms_p50']:.1f} ms, "
              f"adoption p50 {d['replica_adopt_ms_p50']:.0f} ms, max "
              f"{d['replica_adopt_ms_max']:.0f} ms ({d['replica_samples']} samples)")
    print("| server | requests | errors | tok/s (median of rounds) | vs (median ratio) | "
          "first-token p50 ms | per-token p50 / p99 ms | drop -> routable p50 / max ms | "
          "failed during drops |")
    print("|---|---|---|---|---|---|---|---|---|")
    vs = ["", f"{report['ratio_ray1_vs_serve']:.2f}x serve",
          f"{report['ratio_ray2_vs_ray1']:.2f}x 1 x 2"]
    for r, v in zip(rows, vs):
        d = r["drop"]
        print(f"| {r['name']} | {r['requests']} | {r['errors']} | {r['tok_s']:.1f} | {v} | "
              f"{r['first_ms_p50']:.0f} | "
              f"{r['per_token_ms_p50']:.1f} / {r['per_token_ms_p99']:.1f} | "
              f"{d['p50_ms']:.0f} / {d['max_ms']:.0f} | {d['failed_requests']} of "
              f"{d['background_requests']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
