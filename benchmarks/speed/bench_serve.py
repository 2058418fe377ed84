"""`colibri serve` under load: one asyncio load generator, several client counts.

    python -m benchmarks.speed.bench_serve                       # the benchmark model of issue 4
    python -m benchmarks.speed.bench_serve --model builtin --requests 16 --tokens 32   # quick
    python -m benchmarks.speed.bench_serve --clients 1,4,16,64 --requests 64 --tokens 128
    python -m benchmarks.speed.bench_serve --model benchmarks/out/vs_llamacpp/colibri_q4 \
        --llama-server build/llamacpp/build/bin/llama-server \
        --gguf benchmarks/out/vs_llamacpp/model-q4_0.gguf      # with the peer

For each client count, that many asyncio clients send streaming completions (prompts of
--prompt random token ids, distinct per client count and request; --tokens new tokens
each with ignore_eos, greedy) until --requests are done or --time-cap seconds passed.
Reported per client count: first-token and per-token p50/p99 (client side), aggregate
generated tokens/s, errors, the server's event-loop lag p99 (from its /metrics
histogram: the bucket bound), and the load generator's own CPU time (it shares the
machine's cores with the server).

One client is also compared side by side with the engine called directly in this process
(target: per-token time within 1.1x): --pairs times a request on the engine, then the
same prompt through the idle server, alternating, so that a change of the machine's load
hits both alike.

Peer: llama.cpp's `llama-server` (`--llama-server BIN --gguf MODEL.gguf`: the same model
as GGUF, one slot per client, the same threads) runs the same client counts after
Colibri, in the same run. The server runs on the engine's continuous-batching
scheduler: the clients' sequences share forward steps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, bench_model, git_commit, machine


def model_dir(name: str) -> Path:
    if name == "builtin":
        from colibri_core.config import builtin_model_dir
        return builtin_model_dir()
    if name == "bench":
        return bench_model()
    return Path(name)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


class Direct:
    """The engine called directly in this process: per-token times of one request."""

    def __init__(self, mdir: Path, threads: int):
        from colibri_core.engine import Engine
        self.eng = Engine.from_model_dir(mdir, threads=threads)

    def request(self, prompt: list, tokens: int) -> dict:
        t0 = time.perf_counter()
        times = [time.perf_counter() for _ in self.eng.generate(
            prompt, max_new_tokens=tokens, temperature=0.0)]
        return {"first": times[0] - t0, "gaps": list(np.diff(times))}

    def close(self) -> None:
        self.eng.close()


def paired(direct: Direct, url: str, ps: list, tokens: int, pairs: int) -> dict:
    """One client, side by side: a request on the engine directly, then the same prompt
    through the idle server, `pairs` times (ABAB: load changes hit both alike)."""
    import httpx
    d_gaps, s_gaps, d_first, s_first, d_mean, s_mean = [], [], [], [], [], []

    async def one(p):
        async with httpx.AsyncClient(timeout=600) as c:
            return await one_request(c, url, p, tokens)
    for i in range(pairs):
        p = ps[i % len(ps)]
        a = direct.request(p, tokens)
        b = asyncio.run(one(p))
        if "error" in b:
            raise SystemExit(f"server request failed: {b['error']}")
        d_gaps += a["gaps"]
        s_gaps += b["gaps"]
        d_mean.append(float(np.mean(a["gaps"])))      # a stream's chunks may arrive in
        s_mean.append(float(np.mean(b["gaps"])))      # bursts: its mean gap is the rate
        d_first.append(a["first"])
        s_first.append(b["first"])
    ms = lambda xs, q: 1000 * float(np.percentile(xs, q))  # noqa: E731
    return {"pairs": pairs, "direct_per_token_ms_p50": ms(d_gaps, 50),
            "direct_per_token_ms_p99": ms(d_gaps, 99), "server_per_token_ms_p50": ms(s_gaps, 50),
            "server_per_token_ms_p99": ms(s_gaps, 99), "direct_first_ms_p50": ms(d_first, 50),
            "server_first_ms_p50": ms(s_first, 50),
            "direct_mean_ms": 1000 * float(np.median(d_mean)),
            "server_mean_ms": 1000 * float(np.median(s_mean)),
            "ratio": float(np.median(s_mean) / np.median(d_mean))}


def launch(cmd: list, what: str, timeout_s: float, env: dict | None = None):
    """Start a `colibri serve` command; -> (process, its URL, its output lines so far: a
    thread keeps reading, access-log lines left out) once it prints "serving URL"."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    log: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if "colibri: access:" not in line:
                log.append(line.rstrip())
            m = re.search(r"serving (http://\S+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()
    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout_s) or not found:
        raise SystemExit(f"{what} did not start:\n" + "\n".join(log[-30:]))
    return proc, found[0], log


class Server:
    def __init__(self, mdir: Path, threads: int, queue: int, extra: list):
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
        experts = Path(self.tmp.name) / "experts"
        experts.mkdir(mode=0o755)
        cmd = [sys.executable, "-m", "colibri_core", "serve", "--model", str(mdir), "--port",
               "0", "--threads", str(threads), "--experts-dir", str(experts),
               "--queue-size", str(queue), "--model-id", "bench", *extra]
        self.proc, self.url, self.log = launch(cmd, "server", 120)

    def metrics(self) -> str:
        import httpx
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(60)
        self.tmp.cleanup()
        return rc


class LlamaServer:
    """llama.cpp's `llama-server` on the same model (its GGUF), one slot per client."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx: int):
        import httpx
        sock = __import__("socket").socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               "-c", str(ctx * slots), "--no-webui"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: [self.log.append(x.rstrip()) for x in self.proc.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit("llama-server did not start:\n" + "\n".join(self.log[-30:]))

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def lag_buckets(text: str) -> dict[float, float]:
    out = {}
    for m in re.finditer(r'colibri_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)', text):
        out[float(m.group(1))] = float(m.group(2))
    return out


def lag_p99(before: dict, after: dict) -> float:
    """The upper bound of the bucket holding the 99th percentile of the new samples."""
    les = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in les]
    total = counts[-1] if counts else 0
    if total <= 0:
        return float("nan")
    for b, c in zip(les, counts):
        if c >= 0.99 * total:
            return b
    return float("inf")


async def one_request(client, url: str, prompt: list, tokens: int) -> dict:
    t0 = time.perf_counter()
    times, err, used = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json={
                "model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"]["message"]
                    break
                # a model without a tokenizer first sends its prompt's ids (no token yet)
                if any(c.get("finish_reason") is None and "prompt_token_ids" not in c
                       for c in d["choices"]):
                    times.append(time.perf_counter())
                # llama-server sends a token that ends inside a UTF-8 character together
                # with the next one; its last chunk's usage counts them
                used = (d.get("usage") or {}).get("completion_tokens", used)
    except Exception as e:  # noqa: BLE001 - counted as an error of the run
        return {"error": f"{type(e).__name__}: {e}"}
    if err or (len(times) != tokens and used != tokens):
        return {"error": err or f"{len(times)} tokens instead of {tokens}"}
    return {"first": times[0] - t0, "gaps": list(np.diff(times))}


async def run_level(url: str, clients: int, ps: list, requests: int, tokens: int,
                    cap_s: float, keepalive: bool = True) -> dict:
    import httpx
    todo = list(range(requests))
    results = []
    deadline = time.monotonic() + cap_s
    lag_probe = []

    async def probe():                                 # the generator's own loop lag
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.05)
            lag_probe.append(time.perf_counter() - t - 0.05)

    async def worker(client):
        while todo and time.monotonic() < deadline:
            i = todo.pop(0)
            results.append(await one_request(client, url, ps[i % len(ps)], tokens))
    # (llama-server closes idle connections: a reused one fails; a new one per request)
    limits = httpx.Limits(max_connections=clients + 4,
                          max_keepalive_connections=clients + 4 if keepalive else 0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        pt = asyncio.create_task(probe())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
        pt.cancel()
    ok = [r for r in results if "error" not in r]
    firsts = np.array([r["first"] for r in ok]) * 1000
    gaps = np.array([g for r in ok for g in r["gaps"]]) * 1000
    errors = [r["error"] for r in results if "error" in r]
    return {"clients": clients, "requests": len(results), "errors": len(errors),
            "error_examples": errors[:3], "wall_s": wall,
            "tok_s": len(ok) * tokens / wall if wall > 0 else 0.0,
            "first_ms_p50": float(np.percentile(firsts, 50)) if ok else None,
            "first_ms_p99": float(np.percentile(firsts, 99)) if ok else None,
            "per_token_ms_p50": float(np.percentile(gaps, 50)) if gaps.size else None,
            "per_token_ms_p99": float(np.percentile(gaps, 99)) if gaps.size else None,
            "generator_lag_ms_p99": 1000 * float(np.percentile(lag_probe, 99))
            if lag_probe else None}


def fmt(v, nd=1):
    return "–" if v is None else f"{v:.{nd}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", help="bench (issue 4's model), builtin, or a "
                                                    "model directory")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per client count")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64, help="prompt length in token ids")
    ap.add_argument("--time-cap", type=float, default=300.0, help="seconds per client count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-routing-stats", dest="routing_stats", action="store_false",
                    help="serve with --no-routing-stats (no routing hook on the decode path)")
    ap.add_argument("--pairs", type=int, default=6, help="side-by-side requests, 1 client "
                    "(0: none)")
    ap.add_argument("--json", default=str(OUT / "serve.json"))
    ap.add_argument("--llama-server", dest="llama_server", type=Path,
                    help="llama.cpp's llama-server binary: the same client counts against it "
                         "(needs --gguf, the same model as GGUF)")
    ap.add_argument("--gguf", type=Path, help="the model as GGUF, for --llama-server")
    args = ap.parse_args(argv)
    mdir = model_dir(args.model)
    from colibri_core.config import load_model_config
    cfg = load_model_config(mdir / "config.json")
    if args.prompt + args.tokens > cfg.max_position_embeddings:
        raise SystemExit(f"--prompt {args.prompt} + --tokens {args.tokens} exceed the model's "
                         f"context of {cfg.max_position_embeddings}")
    levels = [int(x) for x in args.clients.split(",")]
    ps = prompts(cfg.vocab_size, max(levels) * 2, args.prompt)
    # each client count its own prompts, the same for both servers: llama-server keeps a
    # slot's prompt in its KV cache (cache_prompt), so prompts repeated from an earlier
    # client count would reach their first token without a prefill there, not here
    level_ps = {c: prompts(cfg.vocab_size, max(args.requests, c), args.prompt, seed=1000 + c)
                for c in levels}
    load = os.getloadavg()
    print(f"# bench_serve: {mdir.name}, prompt {args.prompt} ids, {args.tokens} tokens, "
          f"threads {args.threads}, routing stats {'on' if args.routing_stats else 'off'}; "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          file=sys.stderr)
    direct = Direct(mdir, args.threads)
    direct.request(ps[0], 4)                                                    # warm-up
    srv = Server(mdir, args.threads, queue=max(64, max(levels)),
                 extra=[] if args.routing_stats else ["--no-routing-stats"])
    rows = []
    try:
        asyncio.run(run_level(srv.url, 1, ps, 2, min(8, args.tokens), 60))       # warm-up
        side = paired(direct, srv.url, ps, args.tokens, args.pairs) if args.pairs else None
        if side:
            print(f"# 1 client side by side: server {side['server_mean_ms']:.2f} ms/token, direct "
                  f"{side['direct_mean_ms']:.2f} ({side['ratio']:.2f}x)", file=sys.stderr)
        for c in levels:
            before = lag_buckets(srv.metrics())
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            row = asyncio.run(run_level(srv.url, c, level_ps[c], args.requests, args.tokens,
                                        args.time_cap))
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            row["generator_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime -
                                                                         cpu0.ru_stime)
            row["server_loop_lag_p99_ms"] = 1000 * lag_p99(before, lag_buckets(srv.metrics()))
            rows.append(row)
            print(f"# {c} clients: {row['tok_s']:.1f} tok/s, errors {row['errors']}",
                  file=sys.stderr)
    finally:
        rc = srv.stop()
        direct.close()
    peer_rows = []
    if args.llama_server:
        peer = LlamaServer(args.llama_server, args.gguf, args.threads, max(levels),
                           args.prompt + args.tokens + 8)
        try:
            asyncio.run(run_level(peer.url, 1, ps, 2, min(8, args.tokens), 60,
                                  keepalive=False))                              # warm-up
            for c in levels:
                cpu0 = resource.getrusage(resource.RUSAGE_SELF)
                row = asyncio.run(run_level(peer.url, c, level_ps[c], args.requests, args.tokens,
                                            args.time_cap, keepalive=False))
                cpu1 = resource.getrusage(resource.RUSAGE_SELF)
                row["generator_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (
                    cpu1.ru_stime - cpu0.ru_stime)
                row["server_loop_lag_p99_ms"] = None
                peer_rows.append(row)
                print(f"# llama-server, {c} clients: {row['tok_s']:.1f} tok/s, errors "
                      f"{row['errors']} {row['error_examples'][:1]}", file=sys.stderr)
        finally:
            peer.stop()
    load = os.getloadavg()
    report = {"model": str(mdir), "prompt": args.prompt, "tokens": args.tokens,
              "routing_stats": args.routing_stats,
              "threads": args.threads, "side_by_side": side, "levels": rows,
              "llama_server_levels": peer_rows,
              "server_exit": rc, "machine": machine(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_after": list(load)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"| server | clients | requests | errors | tok/s | first-token p50 / p99 ms | "
          f"per-token p50 / p99 ms | server loop lag p99 ms | generator CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in [("colibri", r) for r in rows] + [("llama-server", r) for r in peer_rows]:
        print(f"| {name} | {r['clients']} | {r['requests']} | {r['errors']} | {r['tok_s']:.1f} | "
              f"{fmt(r['first_ms_p50'])} / {fmt(r['first_ms_p99'])} | "
              f"{fmt(r['per_token_ms_p50'], 2)} / {fmt(r['per_token_ms_p99'], 2)} | "
              f"≤ {fmt(r['server_loop_lag_p99_ms'])} | {r['generator_cpu_s']:.1f} |")
    if side is None:
        return 0
    print(f"\n1 client side by side ({side['pairs']} pairs): per-token time (median over "
          f"requests of each one's mean) server {side['server_mean_ms']:.2f} ms vs engine "
          f"direct {side['direct_mean_ms']:.2f} ms = {side['ratio']:.2f}x (gap p99 "
          f"{side['server_per_token_ms_p99']:.1f} vs {side['direct_per_token_ms_p99']:.1f}); "
          f"first token {side['server_first_ms_p50']:.0f} vs {side['direct_first_ms_p50']:.0f} "
          f"ms; server exit code {rc}; load after {load[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
