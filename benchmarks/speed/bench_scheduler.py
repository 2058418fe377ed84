"""The continuous-batching scheduler (scheduler.py) against the model driven by hand.

    python -m benchmarks.speed.bench_scheduler                      # the benchmark model
    python -m benchmarks.speed.bench_scheduler --model PATH --steps 64,128,256,512

(1) Throughput: --streams caller threads each run `engine.generate` on a --prompt-token
prompt (random token ids), --tokens new tokens, greedy, no stop (the model has no EOS).
Compared with the same sequences decoded directly: prefilled, then one
`engine.model.forward([[t], ...], caches)` per token in one loop (no scheduler, no
threads), --repeats times alternating. Reported (medians): decode tokens/s of each (the
scheduler's counted from the moment every stream has its first token, the prefill being
done) and their ratio (target: the scheduler within 10%); the tokens must be equal
(batch invariance).

(2) A long prompt during decodes: --streams - 1 streams decode; once each has produced
--before tokens, one --long-token prompt arrives. The streams' per-token times (the
scheduler's TokenEvent.latency_s) before it (once every stream decodes), and while it is prefilled (until its first
token), p50/p99, for each EngineConfig.max_step_tokens in --steps (the engine's
scheduler is re-set between rows: one load), --repeats times interleaved, medians (the
p99 ratio: the median of each run's ratio). Target: p99 while <= 2x p99 before. The
aggregate rate of that window counts every token the steps computed (decoded and
prefilled) per second; the chosen value is the one meeting the target with the best
aggregate rate.

Writes benchmarks/out/bench_scheduler.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, best_read_bandwidth, git_commit, machine

DEFAULT_MODEL = OUT / "vs_llamacpp" / "colibri_q4"


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, vocab, length))) for _ in range(n)]


def direct(eng, ps: list, n_tokens: int) -> dict:
    """Prefill each prompt, then decode all sequences in one loop of Model.forward."""
    model, pool = eng.model, eng.kv_pool
    caches = [pool.alloc(len(p) + n_tokens) for p in ps]
    try:
        t0 = time.perf_counter()
        logits = [model.forward([np.asarray(p, np.int64)], [c])[0] for p, c in zip(ps, caches)]
        t1 = time.perf_counter()
        toks = [[int(np.argmax(lg))] for lg in logits]
        for _ in range(n_tokens - 1):
            outs = model.forward([np.array([t[-1]], np.int64) for t in toks], caches)
            for t, lg in zip(toks, outs):
                t.append(int(np.argmax(lg)))
        t2 = time.perf_counter()
    finally:
        for c in caches:
            eng.model.pipeline.forget_cache(c)
            pool.free(c)
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1,
            "decode_tok_s": len(ps) * (n_tokens - 1) / (t2 - t1),
            "total_tok_s": len(ps) * n_tokens / (t2 - t0), "tokens": toks}


def scheduled(eng, ps: list, n_tokens: int) -> dict:
    """One thread per prompt, each iterating its own Generation."""
    stamps: list = [None] * len(ps)
    toks: list = [None] * len(ps)
    go = threading.Barrier(len(ps) + 1)

    def caller(i):
        gen = eng.generate(ps[i], max_new_tokens=n_tokens, temperature=0.0, stop=[])
        go.wait()
        ts, ids = [], []
        for ev in gen:
            ts.append(time.perf_counter())
            ids.append(ev.token_id)
        stamps[i], toks[i] = ts, ids

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    t_first = max(s[0] for s in stamps)          # every stream decodes from here
    t_end = max(s[-1] for s in stamps)
    n_after = sum(sum(1 for x in s if x > t_first) for s in stamps)
    return {"decode_s": t_end - t_first, "decode_tok_s": n_after / (t_end - t_first),
            "total_tok_s": sum(map(len, toks)) / (t_end - t0), "tokens": toks}


def long_prompt_row(eng, step_tokens: int, streams: list, long_ids: list, before: int,
                    prefill=None) -> dict:
    sched = eng.scheduler
    sched.max_step_tokens = step_tokens
    sched.max_prefill_tokens = prefill
    per_step = max(1, step_tokens - len(streams))
    if prefill is not None:
        per_step = min(per_step, prefill)
    n_new = before + 2 * len(long_ids) // per_step + 64
    n_new = min(n_new, eng.model_cfg.max_position_embeddings - len(streams[0]) - 1)
    lat: list = [[] for _ in streams]            # (time received, latency_s)
    reached = threading.Semaphore(0)
    stop = threading.Event()

    def stream(i):
        gen = eng.generate(streams[i], max_new_tokens=n_new, temperature=0.0, stop=[])
        try:
            for ev in gen:
                lat[i].append((time.perf_counter(), ev.latency_s))
                if len(lat[i]) == before:
                    reached.release()
                if stop.is_set():
                    break
        finally:
            gen.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for _ in streams:
        reached.acquire()
    steps0 = sched.steps
    t_submit = time.perf_counter()
    gen = eng.generate(long_ids, max_new_tokens=1, temperature=0.0, stop=[])
    next(iter(gen))
    t_done = time.perf_counter()
    steps = sched.steps - steps0
    stop.set()
    for t in threads:
        t.join()
    # "before": once every stream decodes (all prompts prefilled), until the long prompt
    t_all = max(s[0][0] for s in lat)
    pre = [x[1] for s in lat for x in s if t_all < x[0] <= t_submit]
    during = [x[1] for s in lat for x in s if t_submit < x[0] <= t_done]
    window = t_done - t_submit
    a, b = np.asarray(pre) * 1000, np.asarray(during) * 1000
    row = {"max_step_tokens": step_tokens, "before_p50_ms": float(np.percentile(a, 50)),
           "before_p99_ms": float(np.percentile(a, 99)),
           "while_p50_ms": float(np.percentile(b, 50)) if b.size else None,
           "while_p99_ms": float(np.percentile(b, 99)) if b.size else None,
           "while_tokens": int(b.size), "prefill_s": window, "steps": steps,
           "aggregate_tok_s": (b.size + len(long_ids)) / window}
    row["p99_ratio"] = row["while_p99_ms"] / row["before_p99_ms"] if b.size else None
    row["meets"] = row["p99_ratio"] is not None and row["p99_ratio"] <= 2.0
    return row


def median_row(rows: list) -> dict:
    """The median of each figure over the repeats (the p99 ratio recomputed from them)."""
    out = {"max_step_tokens": rows[0]["max_step_tokens"], "repeats": len(rows)}
    for k in ("before_p50_ms", "before_p99_ms", "while_p50_ms", "while_p99_ms",
              "while_tokens", "prefill_s", "steps", "aggregate_tok_s"):
        vals = [r[k] for r in rows if r[k] is not None]
        out[k] = float(np.median(vals)) if vals else None
    out["p99_ratio"] = float(np.median([r["p99_ratio"] for r in rows if r["p99_ratio"]])) \
        if any(r["p99_ratio"] for r in rows) else None
    out["meets"] = out["p99_ratio"] is not None and out["p99_ratio"] <= 2.0
    out["runs"] = rows
    return out


def report(res: dict) -> str:
    t = res["throughput"]
    out = [f"Machine: {res['machine']}; kernel backend `{res['backend']}`; {res['threads']} "
           f"threads; read bandwidth {res['bandwidth_GBps']:.1f} GB/s; commit {res['commit']}; "
           f"{res['date']}", "",
           f"Throughput: {t['streams']} streams, {t['prompt']}-token prompts, {t['tokens']} "
           f"tokens each, greedy; medians of {t['repeats']} alternating runs", "",
           "| path | decode tok/s | tok/s incl. prefill |", "|---|---:|---:|",
           f"| direct `model.forward` loop | {t['direct']['decode_tok_s']:.1f} | "
           f"{t['direct']['total_tok_s']:.1f} |",
           f"| scheduler, {t['streams']} `generate` threads | {t['scheduler']['decode_tok_s']:.1f} "
           f"| {t['scheduler']['total_tok_s']:.1f} |", "",
           f"Scheduler / direct (decode, median of the runs' ratios): **{t['ratio']:.2f}** "
           f"(target >= 0.90); tokens "
           f"equal: {t['equal']}", "",
           f"Long prompt: {res['long']['tokens']}-token prompt arriving during "
           f"{res['long']['streams']} decoding streams (per-token time of the streams; "
           f"medians of {res['long']['repeats']} interleaved runs)", "",
           "| max_step_tokens | p50 before ms | p99 before ms | p50 while ms | p99 while ms | "
           "p99 ratio | prefill s | steps | aggregate tok/s | p99 <= 2x |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|"]
    for r in res["long"]["rows"]:
        f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        out.append(f"| {r['max_step_tokens']} | {f(r['before_p50_ms'])} | {f(r['before_p99_ms'])} "
                   f"| {f(r['while_p50_ms'])} | {f(r['while_p99_ms'])} | {f(r['p99_ratio'], 2)} "
                   f"| {f(r['prefill_s'], 2)} | {r['steps']:.0f} | {f(r['aggregate_tok_s'])} | "
                   f"{'yes' if r['meets'] else 'no'} |")
    out += ["", f"Chosen max_step_tokens: **{res['long']['chosen']}** (meets the p99 target "
                f"with the best aggregate rate)" if res["long"]["chosen"] else
            "No max_step_tokens value met the p99 target."]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=1920)
    ap.add_argument("--before", type=int, default=24, help="tokens per stream before the long prompt")
    ap.add_argument("--steps", default="64,128,256,512")
    ap.add_argument("--prefill", type=int, default=None,
                    help="EngineConfig.max_prefill_tokens for every row (default: the config's)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each --steps value "
                    "(interleaved; the table has their medians)")
    ap.add_argument("--out", type=Path, default=OUT / "bench_scheduler")
    a = ap.parse_args(argv)
    from colibri_core import kernels as K
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine

    if not (a.model / "config.json").exists():
        print(f"{a.model}: no model there; pass --model (the benchmark model of "
              f"bench_vs_llamacpp.py, benchmarks/out/vs_llamacpp/colibri_q4)", file=sys.stderr)
        return 2
    bw = best_read_bandwidth(a.threads)
    eng = Engine(a.model, EngineConfig(threads=a.threads))
    try:
        V = eng.model_cfg.vocab_size
        ps = prompts(a.streams, a.prompt, V, seed=1)
        scheduled(eng, ps[:2], 4)                        # warm-up (thread, pages)
        pairs = []
        for _ in range(a.repeats):               # alternating: a load change hits both
            d = direct(eng, ps, a.tokens)
            s = scheduled(eng, ps, a.tokens)
            pairs.append((d, s))
            print(f"throughput: direct {d['decode_tok_s']:.1f} tok/s, scheduler "
                  f"{s['decode_tok_s']:.1f} tok/s, equal {d['tokens'] == s['tokens']}",
                  flush=True)
        med = lambda side, k: float(np.median([p[side][k] for p in pairs]))  # noqa: E731
        keys = ("decode_tok_s", "total_tok_s")
        thr = {"streams": a.streams, "prompt": a.prompt, "tokens": a.tokens,
               "repeats": a.repeats,
               "direct": {k: med(0, k) for k in keys}, "scheduler": {k: med(1, k) for k in keys},
               "ratio": float(np.median([s["decode_tok_s"] / d["decode_tok_s"]
                                         for d, s in pairs])),
               "equal": all(d["tokens"] == s["tokens"] for d, s in pairs),
               "runs": [{"direct": {k: d[k] for k in keys}, "scheduler": {k: s[k] for k in keys}}
                        for d, s in pairs]}
        long_ids = prompts(1, a.long, V, seed=2)[0]
        runs: dict = {}
        for _ in range(a.repeats):               # interleaved: a load change hits all alike
            for st in map(int, a.steps.split(",")):
                r = long_prompt_row(eng, st, ps[:a.streams - 1], long_ids, a.before, a.prefill)
                print(json.dumps(r), flush=True)
                runs.setdefault(st, []).append(r)
        rows = [median_row(rs) for rs in runs.values()]
        eng.scheduler.max_step_tokens = eng.config.max_step_tokens
        eng.scheduler.max_prefill_tokens = eng.config.max_prefill_tokens
        ok = [r for r in rows if r["meets"]]
        chosen = max(ok, key=lambda r: r["aggregate_tok_s"])["max_step_tokens"] if ok else None
    finally:
        eng.close()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "backend": K.backend(),
           "threads": a.threads, "bandwidth_GBps": bw["GBps"], "bandwidth": bw,
           "model": str(a.model), "throughput": thr,
           "long": {"tokens": a.long, "streams": a.streams - 1, "before": a.before,
                    "repeats": a.repeats,
                    "rows": rows, "chosen": chosen}}
    md = report(res)
    print(md)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    a.out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
