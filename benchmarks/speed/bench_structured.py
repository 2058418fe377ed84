"""Structured output's cost through `colibri serve`: per-token p50 of JSON-schema requests
against free ones, on the benchmark model, in the same run.

    python -m benchmarks.speed.bench_structured                    # 1 and 16 clients
    python -m benchmarks.speed.bench_structured --clients 1 --rounds 6

The benchmark model (issue 4's Mixtral shape, 32,000-token vocabulary) gets a 32,000-token
byte-level BPE tokenizer trained offline (bench_constraints.build_tokenizer) in a copy of
its folder, so that text and grammars apply. Each round sends, for each kind in turn
(alternating, so a change of the machine's load hits both), `clients`
concurrent streaming completions of --tokens tokens (greedy, the same prompt text; the
order of the two kinds swapped every round); a
schema request's answer is an array of at least 24 objects {"name": a string of at most
24 characters, "id": an integer}: long enough, and mostly inside strings, the costliest
state of the mask. Reported: per-token p50 of each kind (client side, chunk to chunk)
over all rounds, their ratio, and each round's ratio.
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

import numpy as np

from benchmarks.common import OUT, bench_model, git_commit, machine
from benchmarks.speed.bench_constraints import build_tokenizer
from benchmarks.speed.bench_serve import Server

SCHEMA = {"type": "array", "minItems": 24, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "id": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["name", "id"], "additionalProperties": False}}


def model_with_tokenizer() -> Path:
    src = bench_model()
    d = OUT / (src.name + "_tok32k")
    if not (d / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if not (d / f.name).exists():
                os.symlink(f.resolve(), d / f.name)
        tok = build_tokenizer(32000, "tok32k")
        (d / "tokenizer.json").write_bytes(tok.read_bytes())
    return d


async def one(client, url: str, body: dict) -> list:
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if "error" in d:
                    raise SystemExit(d["error"]["message"])
                if d["choices"] and d["choices"][0].get("finish_reason") is None:
                    times.append(time.perf_counter())
    return list(np.diff(times))


async def level(url: str, clients: int, body: dict) -> list:
    import httpx
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as c:
        gaps = await asyncio.gather(*(one(c, url, body) for _ in range(clients)))
    return [g for r in gaps for g in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    mdir = model_with_tokenizer()
    srv = Server(mdir, args.threads, 256, [])
    base = {"prompt": "A list of the people who came, as JSON:", "max_tokens": args.tokens,
            "temperature": 0, "stream": True}
    kinds = {"free": base, "schema": {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}}}
    out = {"command": "python -m benchmarks.speed.bench_structured " +
           " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "commit": git_commit(), "model": str(mdir),
           "tokens": args.tokens, "levels": []}
    try:
        for kind in kinds.values():                    # warm-up (the tokenizer's twin)
            asyncio.run(level(srv.url, 1, {**kind, "max_tokens": 8}))
        for clients in (int(c) for c in args.clients.split(",")):
            gaps = {k: [] for k in kinds}
            ratios = []
            for r in range(args.rounds):
                p50 = {}
                order = list(kinds.items())
                for k, body in order if r % 2 == 0 else reversed(order):
                    g = asyncio.run(level(srv.url, clients, body))
                    gaps[k] += g
                    p50[k] = float(np.median(g))
                ratios.append(p50["schema"] / p50["free"])
            res = {"clients": clients, "rounds": args.rounds,
                   **{f"{k}_p50_ms": 1e3 * float(np.median(v)) for k, v in gaps.items()},
                   "ratio": float(np.median(gaps["schema"]) / np.median(gaps["free"])),
                   "round_ratios": ratios, "round_ratio_median": statistics.median(ratios)}
            out["levels"].append(res)
            print(f"{clients:3d} clients: free {res['free_p50_ms']:.2f} ms/token, schema "
                  f"{res['schema_p50_ms']:.2f} ms/token, ratio {res['ratio']:.3f} (rounds: "
                  + ", ".join(f"{r:.3f}" for r in ratios) + ")", flush=True)
    finally:
        srv.stop()
    path = OUT / "bench_structured.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
