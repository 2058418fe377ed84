"""Automatic prefix caching through `colibri serve` (issue 36 item 4's targets).

    python -m benchmarks.speed.bench_prefix_cache                  # the benchmark model
    python -m benchmarks.speed.bench_prefix_cache --turns 8 --chat-turns 4     # quicker
    python -m benchmarks.speed.bench_prefix_cache \\
        --model benchmarks/out/vs_llamacpp/colibri_q4 \\
        --llama-server build/llamacpp/build/bin/llama-server \\
        --gguf benchmarks/out/vs_llamacpp/model-q4_0.gguf           # with the peer

Two servers on the same model, one with the prefix cache (the default, 256 MB), one with
`--prefix-cache-mb 0`, each request sent to one then the other (their order swapped every
turn), one at a time, greedy, streamed:

- shared system prompt: --system token ids (1,000) then --turns (32) user turns of --user
  ids (16) each, every one a new request on the system prompt (--answer tokens each);
  reported: the turns' first-token p50 and p99 on each server and the ratio
  (target <= 0.15);
- multi-turn chat: --chat-turns (8) turns of --chat-tokens (200) user ids, each request
  the conversation so far (the earlier prompts and the answers' ids, returned with
  return_token_ids) plus the new turn; reported: the prompt tokens sent, the tokens
  prefilled (prompt less the prefix cache's reused tokens, from /metrics) and the ratio
  (target <= 0.3), and the summed first-token times.

The copy a hit costs (ms per 1,000 tokens, copying 16-token blocks into a sequence's
cache, and copying them out when a sequence ends) is timed on this model's KV shape and
on Qwen3-30B-A3B's (48 layers, 4 kv heads of 128), beside this run's prefill rate.

Peer (--llama-server BIN --gguf FILE, the same model as GGUF): llama.cpp's server, one
slot, two of them, the same workloads with its prompt cache (`cache_prompt: true`, the slot keeps the
last prompt's KV and reuses its common prefix) and without; its prefilled tokens are its
own `timings.prompt_n`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.common import OUT, bench_model, best_read_bandwidth, git_commit, machine
from benchmarks.speed.bench_serve import LlamaServer, Server


def first_token(url: str, prompt: list, tokens: int, llama: bool, cache: bool) -> dict:
    """One streamed greedy request: first-token seconds, the answer's ids, and (llama)
    its prompt tokens evaluated."""
    import httpx
    if llama:
        route, body = "/completion", {"prompt": prompt, "n_predict": tokens, "temperature": 0,
                                      "stream": True, "cache_prompt": cache,
                                      "return_tokens": True, "ignore_eos": True}
    else:
        route, body = "/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens":
                                          tokens, "temperature": 0, "stream": True,
                                          "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first, ids, prefilled = None, [], None
    with httpx.stream("POST", url + route, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}{route}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            got = d.get("tokens", []) if llama else \
                [t for c in d.get("choices", []) for t in c.get("token_ids") or []]
            if got and first is None:
                first = time.perf_counter() - t0
            ids += got
            if llama and "timings" in d:
                prefilled = d["timings"].get("prompt_n")
    return {"first": first, "ids": ids[:tokens], "prefilled": prefilled}


def counters(url: str) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    got = {}
    for line in text.splitlines():
        for key, name in (("prompt", 'colibri_tokens_total{kind="prompt"}'),
                          ("reused", "colibri_prefix_cache_reused_tokens_total"),
                          ("hits", "colibri_prefix_cache_hits_total")):
            if line.startswith(name + " "):
                got[key] = float(line.rsplit(" ", 1)[1])
    return got


def shared_system(targets: dict, rng, vocab: int, args) -> dict:
    system = rng.integers(1, vocab, args.system).tolist()
    turns = [system + rng.integers(1, vocab, args.user).tolist() for _ in range(args.turns)]
    firsts = {name: [] for name in targets}
    for i, p in enumerate(turns):
        order = list(targets) if i % 2 == 0 else list(reversed(targets))
        for name in order:
            url, llama, cache = targets[name]
            firsts[name].append(first_token(url, p, args.answer, llama, cache)["first"])
    return {name: {"p50_ms": 1000 * float(np.median(v)), "p99_ms": 1000 * float(
        np.percentile(v, 99)), "first_ms": 1000 * v[0]} for name, v in firsts.items()}


def chat(targets: dict, rng, vocab: int, args) -> dict:
    convo = {name: [] for name in targets}
    out = {name: {"prompt_tokens": 0, "prefilled": 0, "first_s": 0.0} for name in targets}
    before = {name: counters(t[0]) for name, t in targets.items() if not t[1]}
    for turn in range(args.chat_turns):
        user = rng.integers(1, vocab, args.chat_tokens).tolist()
        order = list(targets) if turn % 2 == 0 else list(reversed(targets))
        for name in order:
            url, llama, cache = targets[name]
            prompt = convo[name] + user
            got = first_token(url, prompt, args.answer, llama, cache)
            convo[name] = prompt + got["ids"]
            o = out[name]
            o["prompt_tokens"] += len(prompt)
            o["first_s"] += got["first"]
            if llama:
                o["prefilled"] += got["prefilled"]
    for name, c0 in before.items():                  # Colibri: prompt - reused, /metrics
        c1 = counters(targets[name][0])
        out[name]["prefilled"] = int(c1["prompt"] - c0["prompt"]
                                     - (c1.get("reused", 0) - c0.get("reused", 0)))
    return out


def copy_cost(layers: int, kv_heads: int, head: int, tokens: int = 1024, reps: int = 5) -> dict:
    """ms per 1,000 tokens to paste `tokens` kept rows (16-token blocks) into a
    sequence's f32 cache, and to copy them out (what a hit and an ending sequence cost)."""
    from colibri_core.model.kvcache import copy_rows, paste_rows
    from colibri_core.runtime.prefixcache import BLOCK
    shape = (layers, tokens + 64, kv_heads, head)
    cache = SimpleNamespace(k=np.random.default_rng(0).standard_normal(shape, np.float32),
                            v=np.random.default_rng(1).standard_normal(shape, np.float32))
    blocks = [copy_rows(cache, i, BLOCK) for i in range(0, tokens, BLOCK)]
    dst = SimpleNamespace(k=np.zeros(shape, np.float32), v=np.zeros(shape, np.float32))
    paste, take = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i, rows in enumerate(blocks):
            paste_rows(dst, i * BLOCK, rows)
        paste.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, tokens, BLOCK):
            copy_rows(cache, i, BLOCK)
        take.append(time.perf_counter() - t0)
    assert np.array_equal(dst.k[:, :tokens], cache.k[:, :tokens])
    per = 1000 / tokens * 1000
    return {"paste_ms_per_1k": per * float(np.median(paste)),
            "copy_out_ms_per_1k": per * float(np.median(take)),
            "bytes_per_token": 2 * layers * kv_heads * head * 4}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", help="bench (issue 4's shape at a 4,096 "
                    "context) or a model directory")
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--user", type=int, default=16)
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--answer", type=int, default=8, help="tokens per answer")
    ap.add_argument("--chat-turns", dest="chat_turns", type=int, default=8)
    ap.add_argument("--chat-tokens", dest="chat_tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", dest="llama_server", type=Path)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--json", default=str(OUT / "prefix_cache.json"))
    args = ap.parse_args(argv)
    mdir = bench_model(context=4096) if args.model == "bench" else Path(args.model)
    from colibri_core.config import load_model_config
    cfg = load_model_config(mdir / "config.json")
    need = args.chat_turns * (args.chat_tokens + args.answer)
    if max(need, args.system + args.user + args.answer) > cfg.max_position_embeddings:
        raise SystemExit(f"the workloads need {need} positions; {mdir} has a context of "
                         f"{cfg.max_position_embeddings}")
    load = os.getloadavg()
    print(f"# bench_prefix_cache: {mdir.name}; load {load[0]:.2f}", file=sys.stderr)
    servers = {"cached": Server(mdir, args.threads, 64, []),
               "uncached": Server(mdir, args.threads, 64, ["--prefix-cache-mb", "0"])}
    targets = {name: (s.url, False, True) for name, s in servers.items()}
    if args.llama_server:
        if not args.gguf:
            raise SystemExit("--llama-server needs --gguf (the same model as GGUF)")
        for name, cache in (("llama_cached", True), ("llama_uncached", False)):
            # one server each: an uncached request would overwrite the slot's kept prompt
            servers[name] = LlamaServer(args.llama_server, args.gguf, args.threads, 1,
                                        cfg.max_position_embeddings)
            targets[name] = (servers[name].url, True, cache)
    try:
        for url, llama, cache in targets.values():                         # warm-up
            first_token(url, list(range(5, 37)), 2, llama, cache)
        rng = np.random.default_rng(0)
        sysr = shared_system(targets, rng, cfg.vocab_size, args)
        chatr = chat(targets, rng, cfg.vocab_size, args)
    finally:
        for s in servers.values():
            s.stop()
    copies = {"model": copy_cost(cfg.num_layers, cfg.num_kv_heads, cfg.head_size),
              "qwen3_30b_a3b": copy_cost(48, 4, 128)}
    prefill_ms = sysr["uncached"]["p50_ms"] / (args.system + args.user) * 1000
    from colibri_core import kernels
    res = {"model": str(mdir), "machine": machine(), "commit": git_commit(),
           "backend": kernels.backend(), "load_after": os.getloadavg()[0],
           "read_GBps": best_read_bandwidth(args.threads)["GBps"],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
           "system_prompt": sysr, "chat": chatr, "copy": copies,
           "uncached_prefill_ms_per_1k": prefill_ms,
           "ratio_first_token_p50": sysr["cached"]["p50_ms"] / sysr["uncached"]["p50_ms"],
           "ratio_prefilled": chatr["cached"]["prefilled"] / chatr["uncached"]["prefilled"]}
    if "llama_cached" in sysr:
        res["llama_ratio_first_token_p50"] = (sysr["llama_cached"]["p50_ms"]
                                              / sysr["llama_uncached"]["p50_ms"])
        res["llama_ratio_prefilled"] = (chatr["llama_cached"]["prefilled"]
                                        / max(1, chatr["llama_uncached"]["prefilled"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(f"{args.turns} turns on a {args.system}-token system prompt, first token p50 / p99 ms:")
    for name, r in sysr.items():
        print(f"  {name:15s} {r['p50_ms']:9.1f} {r['p99_ms']:9.1f}   (turn 1: {r['first_ms']:.1f})")
    print(f"  ratio cached/uncached p50: {res['ratio_first_token_p50']:.3f} (target <= 0.15)")
    print(f"chat, {args.chat_turns} turns of {args.chat_tokens}: prompt tokens, prefilled, "
          f"first-token s summed:")
    for name, r in chatr.items():
        print(f"  {name:15s} {r['prompt_tokens']:7d} {r['prefilled']:7d} {r['first_s']:8.2f}")
    print(f"  ratio prefilled cached/uncached: {res['ratio_prefilled']:.3f} (target <= 0.3)")
    for k in ("llama_ratio_first_token_p50", "llama_ratio_prefilled"):
        if k in res:
            print(f"  {k}: {res[k]:.3f}")
    for name, c in copies.items():
        print(f"copy, {name} ({c['bytes_per_token']} B/token): paste {c['paste_ms_per_1k']:.2f}"
              f" ms / 1k tokens, copy out {c['copy_out_ms_per_1k']:.2f} ms / 1k tokens")
    print(f"uncached prefill: {prefill_ms:.0f} ms / 1k tokens (first-token p50 / prompt)")
    print(f"commit {res['commit']}; {res['machine']}; backend {res['backend']}; read "
          f"{res['read_GBps']:.1f} GB/s; load {load[0]:.2f} before, {res['load_after']:.2f} "
          f"after; {res['date']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
