"""Self-speculative decoding (issue 20, item 4): the cost model's inputs and what prompt
lookup gives, measured on the benchmark model and the built-in model.

    python -m benchmarks.speed.bench_speculative [--rounds 3] [--prompts 8] [--tokens 128]
                                           [--gammas 1,2,4,8] [--ngram-min 2,1] [--threads 2]
                                           [--bench-model DIR] [--models bench,builtin]

Per model, in one process:

  cost   T1 (one decode token, last-token logits) and T_verify(g) (g tokens of one
         sequence, all their logits: what a round with g - 1 draft tokens runs) for
         g = 1..9, medians of interleaved repeats at ~100 positions; the experts a step
         reads (the union over its tokens of each MoE layer's routed experts, from
         Model.last_routing) and the weight bytes that makes (the model files' sections:
         _pipeline_inputs.weights_per_token); and T_draft, one PromptLookup.draft call
  runs   greedy generation of `--tokens` tokens for `--prompts` held-out prompts (the
         built-in model's validation documents, scripts/builtin_corpus.py: never trained
         on; the benchmark model gets the same texts' token ids), plain and with
         speculative_decoding=prompt_lookup at draft_tokens = each of `--gammas`, plus
         one sampled pair (temperature 0.8, seeded) at the middle gamma; engines
         alternating per prompt, the order reversed every round. Per setting: decode
         tokens/s (the tokens after the first over their time, TokenEvent.latency_s),
         speed-up (per round over plain, median), acceptance (accepted / drafted), tokens
         per step and per draft round, weight bytes per emitted token (an untimed rerun
         that records each step's expert union), the cost model's predicted speed-up
         (the steps' T_verify from `cost`, against T1 per token), and the outputs'
         distinct-4-gram ratio (distinct 4-grams / 4-grams, mean over prompts).

Writes benchmarks/out/bench_speculative.json and prints the tables of docs/BENCHMARKS.md
("Self-speculative decoding").
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, best_read_bandwidth, git_commit, machine

MiB = 1 << 20
G_MAX = 9                 # tokens of the largest verify step measured (8 drafts)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def bench_model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    for cand in (OUT / "vs_llamacpp" / "colibri_q4",
                 REPO.parent / "main" / "benchmarks" / "out" / "vs_llamacpp" / "colibri_q4"):
        if (cand / "config.json").exists():
            return cand
    from benchmarks.peers import _vs_models                                   # builds it (torch, transformers)
    hf = _vs_models.build_hf(_vs_models.WORK / "hf")
    return _vs_models.build_colibri(hf, _vs_models.WORK / "colibri_q4")


def held_out_texts(n: int, chars: int = 240) -> list[str]:
    """The first `chars` characters of the built-in model's validation documents (the
    ones the corpus split keeps out of training), longest documents first."""
    from scripts.builtin_corpus import build_corpus, split_docs
    _, val = split_docs(build_corpus())
    val = [d for d in val if len(d) >= 2 * chars]
    val.sort(key=lambda d: (-len(d), d))
    return [d[:chars] for d in val[:n]]


def distinct4(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(len(grams), 1)


# ------------------------------------------------------------------------------- cost

def expert_bytes(model_dir: Path) -> tuple[float, float]:
    """(bytes every token reads whatever its experts, bytes of one routed expert)."""
    from benchmarks.speed._pipeline_inputs import weights_per_token
    w = weights_per_token(model_dir)
    return float(w["fixed_bytes"]), float(w["routed_expert"]["bytes"])


def step_bytes(model, fixed: float, one: float) -> float:
    """Weight bytes the last step read: the fixed part once, each MoE layer's union of
    routed experts once."""
    return fixed + one * sum(len(np.unique(t.routing.ids)) for t in model.last_routing)


def measure_cost(eng, fixed: float, one: float, reps: int) -> dict:
    m = eng.model
    V = m.cfg.vocab_size
    rng = np.random.default_rng(0)
    cache = m.new_cache(256)
    m.forward([rng.integers(1, V, 96)], [cache])
    base = cache.length
    times = {g: [] for g in range(1, G_MAX + 1)}
    nbytes = {g: [] for g in range(1, G_MAX + 1)}
    for r in range(reps + 1):
        order = list(range(1, G_MAX + 1))
        if r % 2:
            order.reverse()
        for g in order:
            toks = rng.integers(1, V, g)
            t0 = time.perf_counter()
            m.forward([toks], [cache], all_logits=g > 1)
            dt = time.perf_counter() - t0
            cache.truncate(base)
            if r:                                           # the first pass warms up
                times[g].append(dt)
                nbytes[g].append(step_bytes(m, fixed, one))
    t1 = statistics.median(times[1])
    from colibri_core.runtime.speculative import PromptLookup
    hist = list(rng.integers(1, V, 600))
    d = PromptLookup(hist)
    d.draft(8)
    ts = []
    for t in rng.integers(1, V, 200):
        d.push(int(t))
        t0 = time.perf_counter()
        d.draft(8)
        ts.append(time.perf_counter() - t0)
    return {"T1_ms": 1e3 * t1,
            "T_verify_ms": {g: 1e3 * statistics.median(v) for g, v in times.items()},
            "ratio": {g: statistics.median(v) / t1 for g, v in times.items()},
            "bytes_MiB": {g: float(np.mean(v)) / MiB for g, v in nbytes.items()},
            "bytes_ratio": {g: float(np.mean(v) / np.mean(nbytes[1])) for g, v in nbytes.items()},
            "T_draft_us": 1e6 * statistics.median(ts)}


# ------------------------------------------------------------------------------- runs

def settings(gammas: list[int], nmin: list[int]) -> list[tuple[str, dict, dict]]:
    """(name, engine settings, generate() sampling) of each configuration: gamma
    `gammas` at the first n-gram minimum, the first gamma at the other minima."""
    greedy = dict(temperature=0.0)

    def spec(g, n):
        return dict(speculative_decoding="prompt_lookup", draft_tokens=g, draft_ngram_min=n,
                    draft_ngram_max=max(3, n))
    out = [("plain", {}, greedy)]
    out += [(f"lookup g={g} n>={nmin[0]}", spec(g, nmin[0]), greedy) for g in gammas]
    out += [(f"lookup g={gammas[0]} n>={n}", spec(gammas[0], n), greedy) for n in nmin[1:]]
    mid = gammas[len(gammas) // 2]
    out += [("plain, T=0.8", {}, dict(temperature=0.8, top_p=1.0)),
            (f"lookup g={mid} n>={nmin[0]}, T=0.8", spec(mid, nmin[0]),
             dict(temperature=0.8, top_p=1.0))]
    return out


def run_one(eng, prompt, n: int, sampling: dict, seed: int) -> dict:
    g = eng.generate(prompt, max_new_tokens=n, seed=seed, **sampling)
    lat = [ev.latency_s for ev in g]
    return {"ids": g.token_ids, "decode_s": float(sum(lat[1:])), "tokens": len(lat),
            **g.speculation}


def record_steps(eng, prompt, n: int, sampling: dict, seed: int, fixed: float, one: float):
    """Untimed: each decode step's token count and weight bytes."""
    pipe = eng.model.pipeline
    steps = []
    orig = pipe.run

    def run(ids, spans, *a, **k):
        out = orig(ids, spans, *a, **k)
        if len(spans) == 1 and len(ids) <= G_MAX + 1 and spans[0][2].length > len(ids):
            steps.append((len(ids), step_bytes(eng.model, fixed, one)))
        return out
    pipe.run = run
    try:
        g = eng.generate(prompt, max_new_tokens=n, seed=seed, **sampling).run()
    finally:
        pipe.run = orig
    return g.token_ids, steps


def measure_runs(model_dir: Path, prompts: list, a, fixed: float, one: float, cost: dict) -> dict:
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    confs = settings(a.gammas, a.ngram_min)
    engines = [Engine(model_dir, EngineConfig(threads=a.threads, preload="populate", **s))
               for _, s, _ in confs]
    res = {name: {"rounds": []} for name, _, _ in confs}
    try:
        for r in range(a.rounds):
            per = {name: {"decode_s": 0.0, "tokens": 0, "rounds": 0, "drafted": 0,
                          "accepted": 0, "ids": []} for name, _, _ in confs}
            for pi, p in enumerate(prompts):
                order = list(range(len(confs)))
                if (r + pi) % 2:
                    order.reverse()
                for ci in order:
                    name, _, sampling = confs[ci]
                    got = run_one(engines[ci], p, a.tokens, sampling, seed=100 + pi)
                    acc = per[name]
                    for k in ("decode_s", "tokens", "rounds", "drafted", "accepted"):
                        acc[k] += got[k]
                    acc["ids"].append(got["ids"])
            for name in per:
                res[name]["rounds"].append(per[name])
            log(f"  round {r + 1}: " + ", ".join(
                f"{n} {(v['tokens'] - len(prompts)) / v['decode_s']:.0f} tok/s"
                for n, v in per.items()))
        # the untimed pass: steps and bytes, one per setting (greedy ones must agree)
        for (name, _, sampling), eng in zip(confs, engines):
            steps, outs = [], []
            for pi, p in enumerate(prompts):
                ids, st = record_steps(eng, p, a.tokens, sampling, 100 + pi, fixed, one)
                steps += st
                outs.append(ids)
            res[name]["steps"] = steps
            res[name]["ids"] = outs
    finally:
        for e in engines:
            e.close()
    return summarize(res, confs, cost, len(prompts))


def summarize(res: dict, confs, cost: dict, n_prompts: int) -> dict:
    out = {}
    base = {"greedy": res["plain"], "sampled": res["plain, T=0.8"]}
    for name, _, sampling in confs:
        r = res[name]
        kind = "sampled" if sampling["temperature"] else "greedy"
        plain = base[kind]
        rates = [(x["tokens"] - n_prompts) / x["decode_s"] for x in r["rounds"]]
        prates = [(x["tokens"] - n_prompts) / x["decode_s"] for x in plain["rounds"]]
        x = r["rounds"][0]
        dec = x["tokens"] - n_prompts                      # tokens after each first one
        steps = [s for s in r["steps"]]
        n_steps = len(steps)
        emitted = dec
        pred_time = sum(cost["ratio"][min(n, G_MAX)] for n, _ in steps)
        out[name] = {
            "kind": kind,
            "tok_s": statistics.median(rates),
            "speedup": statistics.median(a / b for a, b in zip(rates, prates)),
            "acceptance": x["accepted"] / x["drafted"] if x["drafted"] else None,
            "draft_rounds_share": x["rounds"] / max(n_steps, 1),
            "tokens_per_step": emitted / max(n_steps, 1),
            "tokens_per_round": (x["rounds"] + x["accepted"]) / x["rounds"] if x["rounds"] else None,
            "MiB_per_token": sum(b for _, b in steps) / max(emitted, 1) / MiB,
            "predicted_speedup": emitted / pred_time if pred_time else None,
            "distinct4": float(np.mean([distinct4(ids) for ids in x["ids"]])),
            "same_as_plain": r["ids"] == plain["ids"],
        }
    return out


# ------------------------------------------------------------------------------- report

def render(doc: dict) -> str:
    lines = []
    for mname, m in doc["models"].items():
        c = m["cost"]
        lines.append(f"**{mname}** (`{m['dir']}`): T1 = {c['T1_ms']:.2f} ms, T_draft (one "
                     f"prompt-lookup call) = {c['T_draft_us']:.1f} µs\n")
        lines.append("| g (tokens per step) | " + " | ".join(str(g) for g in range(1, G_MAX + 1)) + " |")
        lines.append("|---|" + "---:|" * G_MAX)
        lines.append("| T_verify(g) ms | " + " | ".join(f"{c['T_verify_ms'][g]:.2f}" for g in range(1, G_MAX + 1)) + " |")
        lines.append("| T_verify(g) / T1 | " + " | ".join(f"{c['ratio'][g]:.2f}" for g in range(1, G_MAX + 1)) + " |")
        lines.append("| weight MiB read | " + " | ".join(f"{c['bytes_MiB'][g]:.1f}" for g in range(1, G_MAX + 1)) + " |")
        lines.append("| bytes / bytes(1) | " + " | ".join(f"{c['bytes_ratio'][g]:.2f}" for g in range(1, G_MAX + 1)) + " |")
        lines.append("")
        lines.append("| setting | decode tok/s | speed-up | predicted | acceptance | tokens / step "
                     "| tokens / draft round | steps with a draft | MiB / token | distinct 4-grams | output = plain |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|")
        for name, r in m["runs"].items():
            f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
            lines.append(f"| {name} | {r['tok_s']:.1f} | {r['speedup']:.2f} | {f(r['predicted_speedup'])} "
                         f"| {f(r['acceptance'])} | {r['tokens_per_step']:.2f} | {f(r['tokens_per_round'])} "
                         f"| {100 * r['draft_rounds_share']:.0f}% | {r['MiB_per_token']:.1f} "
                         f"| {r['distinct4']:.2f} | {'yes' if r['same_as_plain'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gammas", default="1,2,4,8")
    ap.add_argument("--ngram-min", dest="ngram_min", default="2,1",
                    help="draft_ngram_min values: the first for every gamma, the others at "
                         "the first gamma")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-reps", type=int, default=15)
    ap.add_argument("--bench-model", dest="bench_model")
    ap.add_argument("--models", default="bench,builtin")
    ap.add_argument("--render", action="store_true", help="the tables of the last run again")
    a = ap.parse_args(argv)
    path = OUT / "bench_speculative.json"
    if a.render:
        print(render(json.loads(path.read_text())))
        return
    a.gammas = [int(g) for g in a.gammas.split(",")]
    a.ngram_min = [int(n) for n in a.ngram_min.split(",")]
    from colibri_core import kernels
    from colibri_core.config import EngineConfig, builtin_model_dir
    from colibri_core.engine import Engine
    from colibri_core.runtime.tokenizer import Tokenizer
    texts = held_out_texts(a.prompts)
    tok = Tokenizer(builtin_model_dir() / "tokenizer.json", 1024)
    ids = [tok.encode(t) for t in texts]
    bw = best_read_bandwidth(a.threads)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "read_GBps": bw["GBps"],
           "command": " ".join(["python", "benchmarks/speed/bench_speculative.py"] + (argv or sys.argv[1:])),
           "models": {}}
    dirs = {"bench": bench_model_dir(a.bench_model), "builtin": builtin_model_dir()}
    for mname in a.models.split(","):
        d = dirs[mname]
        log(f"{mname}: {d}")
        fixed, one = expert_bytes(d)
        with Engine(d, EngineConfig(threads=a.threads, preload="populate")) as eng:
            doc["backend"] = kernels.backend()
            cost = measure_cost(eng, fixed, one, a.cost_reps)
        log(f"  T1 {cost['T1_ms']:.2f} ms, ratios " +
            " ".join(f"{cost['ratio'][g]:.2f}" for g in range(1, G_MAX + 1)))
        prompts = texts if mname == "builtin" else ids
        runs = measure_runs(d, prompts, a, fixed, one, cost)
        doc["models"][mname] = {"dir": str(d), "cost": cost, "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=float))
    print(f"{doc['date']}, commit {doc['commit']}, {doc['machine']}, backend {doc['backend']}, "
          f"read bandwidth {doc['read_GBps']:.1f} GB/s\n")
    print(render(doc))


if __name__ == "__main__":
    main()
