"""What the audit log costs (audit.py), and what replaying it takes (replay.py).

    python -m benchmarks.speed.bench_audit                         # ~3 min on 2 shared cores
    python -m benchmarks.speed.bench_audit --rounds 7 --replay-items 10000

(1) Scoring: the fraud model (examples/fraud), --txns transactions of its stream scored
with `Engine.score_batch` in batches of --batch, on one engine, the audit log started
before and stopped after every "on" run; the rounds alternate which goes first. Timed until the log's
writer thread has written every line (`AuditLog.flush`): its serialization is part of
the cost. Reported: the median transactions/s of each and the ratio (target >= 0.97).

(2) Decode: the benchmark model (benchmarks/common.py, or --decode-model), --streams
concurrent greedy generations of --tokens tokens each (prompts of 16 random ids), the
same alternation; tokens/s from the first to the last token. Ratio target
>= 0.97.

(3) Replay: --replay-items transactions scored with the card-testing expert live (so the
expert set holds a hot-plugged expert, kept by the log), then `replay()` of the log on a
fresh engine of the fraud model: seconds, items/s, items that differ (target 0).

Writes benchmarks/out/bench_audit.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, bench_model, fraud_module, git_commit, machine


def fraud_ids(n: int, seed: int = 11) -> list:
    make_stream = fraud_module("run_demo").make_stream
    return [tx.token_ids() for tx in make_stream(n, seed, 0.008, 0.010)]


def time_scoring(eng, ids: list, batch: int) -> tuple[float, float]:
    """(transactions/s of wall time, transactions per CPU second of this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(ids), batch):
        eng.score_batch(ids[i:i + batch])
    if eng.audit is not None:
        eng.audit.flush()
    return len(ids) / (time.perf_counter() - t0), len(ids) / (time.process_time() - c0)


def time_decode(eng, streams: int, tokens: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, eng.model_cfg.vocab_size - 1, 16).tolist() for _ in range(streams)]
    gens = [eng.generate(p, max_new_tokens=tokens, temperature=0) for p in prompts]
    c0 = time.process_time()
    firsts, lasts, counts = [0.0] * streams, [0.0] * streams, [0] * streams

    def read(i):
        for ev in gens[i]:
            if counts[i] == 0:
                firsts[i] = time.perf_counter()
            counts[i] += 1
        lasts[i] = time.perf_counter()
    th = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if eng.audit is not None:
        eng.audit.flush()
    end = max(lasts) if eng.audit is None else time.perf_counter()
    n = sum(counts) - streams
    return n / (end - max(firsts)), sum(counts) / (time.process_time() - c0)


def ab(name: str, fn, eng, rounds: int, log: Path) -> dict:
    """Alternating rounds on one engine, the audit log started and stopped around each
    "on" run (two engines side by side measured their own placement, not the log)."""
    rates = {"off": [], "on": []}
    cpu = {"off": [], "on": []}
    for r in range(rounds):
        for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if k == "on":
                eng.start_audit(log)
            try:
                wall, per_cpu = fn(eng)
            finally:
                eng.stop_audit()
            rates[k].append(wall)
            cpu[k].append(per_cpu)
        print(f"{name} round {r + 1}: off {rates['off'][-1]:.1f}, on {rates['on'][-1]:.1f} "
              f"(per CPU second {cpu['off'][-1]:.1f} / {cpu['on'][-1]:.1f})", flush=True)
    m_off, m_on = statistics.median(rates["off"]), statistics.median(rates["on"])
    # the ratio of each round's pair, then its median: robust to the machine's drift
    ratios = [b / a for a, b in zip(rates["off"], rates["on"])]
    # work per CPU second of this process: what other processes on the machine take
    # from it cancels out
    cpu_ratios = [b / a for a, b in zip(cpu["off"], cpu["on"])]
    return {"off": rates["off"], "on": rates["on"], "median_off": m_off, "median_on": m_on,
            "ratio_of_medians": m_on / m_off, "median_ratio": statistics.median(ratios),
            "cpu_off": cpu["off"], "cpu_on": cpu["on"],
            "cpu_median_ratio": statistics.median(cpu_ratios)}


def attributed(eng, fn, log: Path) -> dict:
    """CPU time of the threads running the audit's own code (time.thread_time inside
    RouteSink calls and takes, the score lines' rendering and queueing, the writer's
    writes), per item, over one run with the log on: what the log costs, measured apart
    from the machine's other load (which a wall-time A/B on a shared machine cannot)."""
    from colibri_core.runtime import audit, scoring
    spent = [0.0]

    def wrap(obj, name):
        orig = getattr(obj, name)

        def timed(*args, **kw):
            t = time.thread_time()
            try:
                return orig(*args, **kw)
            finally:
                spent[0] += time.thread_time() - t
        setattr(obj, name, timed)
        return orig
    saved = [(audit.RouteSink, "__call__", wrap(audit.RouteSink, "__call__")),
             (audit.RouteSink, "take", wrap(audit.RouteSink, "take")),
             (scoring, "score_lines", wrap(scoring, "score_lines")),
             (audit.AuditLog, "_write", wrap(audit.AuditLog, "_write")),
             (audit.AuditLog, "put_many", wrap(audit.AuditLog, "put_many"))]
    eng.start_audit(log)
    try:
        t0 = time.perf_counter()
        n = fn(eng)
        wall = time.perf_counter() - t0
        lines = eng.audit.lines
    finally:
        eng.stop_audit()
        for obj, name, orig in saved:
            setattr(obj, name, orig)
    return {"audit_cpu_us_per_line": spent[0] / max(1, lines) * 1e6, "lines": lines,
            "run_wall_s": wall, "items": n}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--txns", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode-model", type=Path, default=None)
    ap.add_argument("--replay-items", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: score,decode,replay")
    ap.add_argument("--out", type=Path, default=OUT / "bench_audit")
    a = ap.parse_args(argv)
    from colibri_core.engine import Engine
    fc = fraud_module("fraud_common")
    CONFIG, EXPERT_NPZ, MODEL_DIR = fc.CONFIG, fc.EXPERT_NPZ, fc.MODEL_DIR
    NEW_EXPERT_LAYER, expert_q4_clip = fc.NEW_EXPERT_LAYER, fc.expert_q4_clip
    skip = set(filter(None, a.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="bench_audit-"))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}}
    try:
        if "score" not in skip:
            ids = fraud_ids(a.txns)
            with Engine.from_config(CONFIG, threads=a.threads) as eng:
                from colibri_core import kernels
                res["backend"] = kernels.backend()
                time_scoring(eng, ids[:512], a.batch)                     # warm-up
                log = tmp / "score.jsonl"
                res["scoring"] = ab("scoring txn/s", lambda e: time_scoring(e, ids, a.batch),
                                    eng, a.rounds, log)
                res["scoring"]["audit_bytes_per_item"] = log.stat().st_size / (a.rounds * len(ids))
                att = attributed(eng, lambda e: (time_scoring(e, ids, a.batch), len(ids))[1], log)
                best = max(res["scoring"]["off"])          # the quietest round's rate
                att["share_of_best_off_item"] = att["audit_cpu_us_per_line"] * 1e-6 * best
                res["scoring"]["attributed"] = att
        if "decode" not in skip:
            model = a.decode_model or bench_model()
            with Engine.from_model_dir(model, threads=a.threads) as eng:
                time_decode(eng, a.streams, 8, 0)                         # warm-up
                res["decode"] = ab("decode tok/s",
                                   lambda e: time_decode(e, a.streams, a.tokens, 1), eng,
                                   a.rounds, tmp / "decode.jsonl")
                from colibri_core.runtime import audit as audit_mod
                tok = [0]
                att = attributed(eng, lambda e: (time_decode(e, a.streams, a.tokens, 1),
                                                 a.streams * a.tokens)[1], tmp / "decode.jsonl")
                # per token: the sink runs every step; the writer once per sequence
                att["audit_cpu_us_per_token"] = att["audit_cpu_us_per_line"] * att["lines"] \
                    / (a.streams * a.tokens)
                best = max(res["decode"]["off"])
                att["share_of_best_off_token"] = att["audit_cpu_us_per_token"] * 1e-6 * best
                res["decode"]["attributed"] = att
                del tok, audit_mod
        if "replay" not in skip:
            from colibri_core.model.fingerprint import fingerprint_of_dir
            from colibri_core.experts.hotplug.authoring.builder import build_expert
            from colibri_core.replay import replay
            watched = tmp / "experts"
            watched.mkdir(mode=0o700)
            so = tmp / "card_testing.so"
            build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "card_testing", "1",
                         q4_clip=expert_q4_clip(), base_model=fingerprint_of_dir(MODEL_DIR))
            shutil.copyfile(so, watched / so.name)
            ids = fraud_ids(a.replay_items, seed=12)
            log = tmp / "replay.jsonl"
            with Engine.from_config(CONFIG, threads=a.threads, experts_dir=str(watched)) as e:
                assert e.expert_set_generation >= 1, "card_testing was not adopted"
                e.start_audit(log)
                t0 = time.perf_counter()
                for i in range(0, len(ids), a.batch):
                    e.score_batch(ids[i:i + a.batch])
                e.audit.flush()
                scored_s = time.perf_counter() - t0
            shutil.rmtree(watched)                     # replay finds it by the log's copy
            with Engine.from_config(CONFIG, threads=a.threads) as e:
                t0 = time.perf_counter()
                rep = replay(e, [log])
                dt = time.perf_counter() - t0
            res["replay"] = {"items": rep.items, "sets": rep.sets, "differ": len(rep.differ),
                             "seconds": dt, "items_per_s": rep.items / dt,
                             "scored_seconds": scored_s, "log_mb": log.stat().st_size / 2**20}
            print(f"replay: {rep.items} items under {rep.sets} sets in {dt:.1f} s "
                  f"({rep.items / dt:.0f}/s): {len(rep.differ)} differ", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = [f"{res['date']}, commit {res['commit']}, {res['machine']}, backend "
          f"{res.get('backend')}", "",
          "| part | audit off (median) | audit on (median) | on/off (median of round ratios) "
          "| on/off per CPU second of the process (median) |",
          "|---|---|---|---|---|"]
    for k, unit in (("scoring", "txn/s"), ("decode", "tok/s")):
        if k in res:
            r = res[k]
            md.append(f"| {k} | {r['median_off']:.1f} {unit} | {r['median_on']:.1f} {unit} | "
                      f"{r['median_ratio']:.3f} (of medians {r['ratio_of_medians']:.3f}) | "
                      f"{r['cpu_median_ratio']:.3f} |")
    for k, what in (("scoring", "item"), ("decode", "token")):
        if k in res and "attributed" in res[k]:
            t = res[k]["attributed"]
            us = t.get(f"audit_cpu_us_per_{what}", t["audit_cpu_us_per_line"])
            md.append(f"\n{k}: the audit's own code {us:.1f} us CPU per {what}, "
                      f"{100 * t[f'share_of_best_off_{what}']:.1f} % of a {what}'s time at the "
                      f"best audit-off rate")
    if "replay" in res:
        r = res["replay"]
        md += ["", f"replay: {r['items']} items, {r['sets']} expert set(s), {r['seconds']:.1f} s "
                   f"({r['items_per_s']:.0f} items/s), {r['differ']} differ; log "
                   f"{r['log_mb']:.1f} MB"]
    a.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return res


if __name__ == "__main__":
    main()
