"""Fraud detection with a hot-plugged expert: a new pattern goes live while scoring runs.

    python examples/fraud/run_demo.py                  # ~1.5-3 min on 2 cores
    python examples/fraud/run_demo.py --quick          # ~30 s, wide intervals

What it does, with the committed model (examples/fraud/model, configs/fraud.yaml) and the
committed new expert's weights (examples/fraud/new_expert/card_testing.npz):

1. builds the expert into a hot-pluggable .so with the hot-plug builder
   (`colibri_core.experts.hotplug.authoring.builder.build_expert`, INT4, with the q4 clipping the expert was
   trained and validated with, recorded in card_testing.json);
2. starts an Engine whose `experts_dir` is a fresh watched folder;
3. measures batched scoring (`Engine.score_batch`, one forward, prefill only) against
   scoring the same transactions one by one (`Engine.next_token_logits`);
4. scores a synthetic transaction stream (old fraud patterns 0.8 %, the new pattern,
   card testing, 1.0 %) batch after batch; after `--before` transactions a helper thread
   drops the .so into the watched folder (written under a hidden name, then renamed), and
   the scoring loop goes on without waiting: the engine adopts the expert between two
   batches;
5. reports, each with a 95 % Wilson interval: recall and precision on the new pattern and
   on the old ones, before and after the expert went live; the moment it went live (wall
   clock and batch index); scoring continuity across the drop (batches per second, the
   longest pause); and plots recall over time (PNG; needs matplotlib:
   `pip install -e '.[plot]'`).

Precision per group is one-vs-legit: among the flagged transactions that are legit or of
that group (the other group's fraud left out). A transaction is flagged when
P(FRAUD) >= the threshold in examples/fraud/scoring.json (chosen by train_base.py on a
validation stream, never on this one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import (BUILD, CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER,  # noqa: E402
                    PLOT_INSTALL, episode_bootstrap, expert_q4_clip, fmt_ci, fraud_prob,
                    group_metrics, load_scoring, newcombe_diff, wilson)
from fraud_stream import OLD_PATTERNS, SEQ_LEN, StreamConfig, generate  # noqa: E402

TXNS_PER_CARD = 38.0        # about, over 14 days (used to size the simulated population)


def _pct(p: float) -> str:
    return "n/a" if math.isnan(p) else f"{100 * p:.0f}%"


def clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


class LoadedRecorder:
    """A Colibri plugin recording when the engine adopted a hot-plugged expert."""

    def __init__(self):
        self.events = []

    def colibri_expert_loaded(self, info):
        self.events.append({"wall": time.time(), "perf": time.perf_counter(), **info})


def _make_plugin():
    from colibri_core.hookspecs import hookimpl
    rec = LoadedRecorder()
    LoadedRecorder.colibri_expert_loaded = hookimpl(LoadedRecorder.colibri_expert_loaded)
    return rec


def make_stream(n: int, seed: int, old_rate: float, new_rate: float) -> list:
    cards = max(50, int(math.ceil(n / TXNS_PER_CARD * 1.15)))
    txns = generate(StreamConfig(n_cards=cards, days=14, old_fraud_rate=old_rate,
                                 new_fraud_rate=new_rate, seed=seed))
    while len(txns) < n:                      # rare: the population came out small
        cards = int(cards * 1.3)
        txns = generate(StreamConfig(n_cards=cards, days=14, old_fraud_rate=old_rate,
                                     new_fraud_rate=new_rate, seed=seed))
    return txns[:n]


def score(engine, ids: np.ndarray, batch: int) -> np.ndarray:
    out = []
    for i in range(0, len(ids), batch):
        out.append(fraud_prob(np.stack(engine.score_batch([list(r) for r in ids[i:i + batch]]))))
    return np.concatenate(out) if out else np.zeros(0)


def batch_vs_one_by_one(engine, ids: np.ndarray) -> dict:
    """Throughput and per-transaction latency: one batched forward vs one call each."""
    seqs = [list(r) for r in ids]
    engine.score_batch(seqs[:8])                                      # warm-up
    tb = []
    for _ in range(3):                    # median of 3: the machine may be shared
        t = time.perf_counter()
        pb = fraud_prob(np.stack(engine.score_batch(seqs)))
        tb.append(time.perf_counter() - t)
    t_batch = float(np.median(tb))
    lat, p1 = [], []
    for s in seqs:
        t = time.perf_counter()
        p1.append(fraud_prob(engine.next_token_logits(s)))
        lat.append(time.perf_counter() - t)
    lat = np.array(lat)
    n = len(seqs)
    return {
        "n": n, "tokens_per_txn": SEQ_LEN,
        "batch": {"seconds": t_batch, "txn_per_s": n / t_batch,
                  "latency_ms_per_txn_amortized": 1e3 * t_batch / n,
                  "latency_ms_wall": 1e3 * t_batch},
        "one_by_one": {"seconds": float(lat.sum()), "txn_per_s": n / float(lat.sum()),
                       "txn_per_s_from_median": 1.0 / float(np.median(lat)),
                       "latency_ms_median": 1e3 * float(np.median(lat)),
                       "latency_ms_p95": 1e3 * float(np.percentile(lat, 95))},
        "speedup": float(lat.sum()) / t_batch,
        "max_abs_prob_diff": float(np.abs(pb - np.array(p1)).max()),
    }


def dropper(ev: threading.Event, so: Path, folder: Path, rec: dict) -> None:
    """Waits for the signal, then puts the .so in the watched folder atomically."""
    ev.wait()
    tmp = folder / f".{so.name}.part"
    shutil.copyfile(so, tmp)
    os.chmod(tmp, 0o644)
    rec["wall"], rec["perf"] = time.time(), time.perf_counter()
    os.replace(tmp, folder / so.name)


def binned_recall(pattern: np.ndarray, flag: np.ndarray, group, B: int, n_batches: int,
                  live_batch: int, per_bin: int):
    """Recall per bin of `per_bin` batches, bins aligned on the live batch (none straddles
    it): (first batch, last batch + 1, k, n) per bin."""
    m = np.isin(pattern, list(group))
    starts = list(range(live_batch, -1, -per_bin))[::-1]
    if starts[0] != 0:
        starts = [0] + starts
    starts += list(range(live_batch + per_bin, n_batches, per_bin))
    edges = sorted(set(starts)) + [n_batches]
    out = []
    for b0, b1 in zip(edges[:-1], edges[1:]):
        sl = slice(b0 * B, b1 * B)
        out.append((b0, b1, int((flag[sl] & m[sl]).sum()), int(m[sl].sum())))
    return out


def plot(path: Path, pattern: np.ndarray, flag: np.ndarray, t0s: np.ndarray, t1s: np.ndarray,
         B: int, live_batch: int, t_drop: float, t_live: float, per_bin: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.4]})
    nb = len(t0s)
    for name, group, color, dx in (("card testing (new pattern)", ["card_testing"], "tab:red", 0.0),
                                   ("old patterns", OLD_PATTERNS, "tab:blue", 0.15)):
        xs, ps, lo, hi = [], [], [], []
        for b0, b1, k, n in binned_recall(pattern, flag, group, B, nb, live_batch, per_bin):
            if n == 0:
                continue
            p, a, c = wilson(k, n)
            x = 0.5 * (t0s[b0] + t1s[b1 - 1]) + dx
            xs.append(x), ps.append(p), lo.append(max(0.0, p - a)), hi.append(max(0.0, c - p))
        ax.errorbar(xs, ps, yerr=[lo, hi], fmt="o-", color=color, ms=4, capsize=2, lw=1,
                    label=f"{name}: recall per {per_bin} batches (95% Wilson)")
    for a in (ax, ax2):
        a.axvline(t_drop, color="gray", ls="--", lw=1)
        a.axvline(t_live, color="green", ls="-", lw=1.2)
    ax.text(t_drop, 1.03, ".so dropped ", color="gray", fontsize=8, va="bottom", ha="right")
    ax.text(t_live, 1.03, " live", color="green", fontsize=8, va="bottom")
    ax.set_ylim(-0.03, 1.1)
    ax.set_ylabel("recall")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Colibri fraud demo: a new expert hot-plugged while scoring")
    rate = B / np.maximum(t1s - t0s, 1e-9)
    ax2.hlines(rate, t0s, t1s, color="k", lw=1.5)
    ax2.vlines(t1s[:-1], rate[:-1], rate[1:], color="k", lw=0.5)
    ax2.set_ylim(0, rate.max() * 1.25)
    ax2.set_ylabel("txn/s (each batch)")
    ax2.set_xlabel("seconds since scoring started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=int, default=12000, help="transactions before the drop")
    ap.add_argument("--after", type=int, default=12000, help="transactions after it is live")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--latency-sample", type=int, default=256)
    ap.add_argument("--check-size", type=int, default=1000,
                    help="fixed transactions scored before and after (fraud first)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(BUILD / "demo"))
    ap.add_argument("--quick", action="store_true", help="small run (about 30 s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--live-timeout", type=float, default=60.0,
                    help="give up if the expert is not live this long after the drop")
    a = ap.parse_args(argv)
    if a.quick:
        a.before, a.after, a.latency_sample, a.check_size = 2000, 2000, 64, 600
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from colibri_core.engine import Engine
    from colibri_core.experts.hotplug.authoring.builder import build_expert

    thr = load_scoring()["threshold"]
    say = lambda *s: print(*s, flush=True)  # noqa: E731

    # 1. build the expert
    t = time.perf_counter()
    so = out / "card_testing.so"
    clip = expert_q4_clip()
    from colibri_core.model.fingerprint import fingerprint_of_dir
    info = build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "card_testing", "1", q4_clip=clip,
                        base_model=fingerprint_of_dir(MODEL_DIR))   # bound to this model
    say(f"built {so.name}: layer {list(info.meta.layers)}, hidden {info.meta.hidden_size}, "
        f"intermediate {info.meta.intermediate_size}, q4 clip {clip}, {info.size} bytes "
        f"({time.perf_counter() - t:.1f}s)")

    # 2. engine watching an empty folder
    folder = out / "experts_so"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(mode=0o700, parents=True)
    engine = Engine.from_config(CONFIG, experts_dir=str(folder))
    if getattr(engine, "hotplug", None) is None:
        raise SystemExit("this Engine does not watch experts_dir (no hot-plug integration)")
    recorder = _make_plugin()
    engine.register_plugin(recorder, name="fraud-demo-recorder")
    n_base = engine.model_cfg.num_experts
    say(f"engine: {CONFIG.name}, {n_base} experts per MoE layer, watching {folder}")

    # data: the live stream, and a fixed check set scored before and after
    B = a.batch
    slack = 40 * B
    txns = make_stream(a.before + a.after + slack, a.seed, 0.008, 0.010)
    ids = np.array([tx.token_ids() for tx in txns], np.int64)
    pattern = np.array([tx.pattern for tx in txns])
    episode = np.array([tx.episode for tx in txns])
    check = make_stream(max(2000, 5 * a.check_size), a.seed + 1, 0.05, 0.05)   # enriched
    keep = [i for i, tx in enumerate(check) if tx.is_fraud][:a.check_size // 3]
    keep += [i for i, tx in enumerate(check) if not tx.is_fraud][:a.check_size - len(keep)]
    check_ids = np.array([check[i].token_ids() for i in keep], np.int64)
    check_pat = np.array([check[i].pattern for i in keep])

    # 3. batch vs one by one
    lat = batch_vs_one_by_one(engine, ids[-a.latency_sample:])
    say(f"batch of {lat['n']}: {lat['batch']['txn_per_s']:.0f} txn/s "
        f"({lat['batch']['latency_ms_per_txn_amortized']:.2f} ms/txn amortised, "
        f"{lat['batch']['latency_ms_wall']:.0f} ms for the batch); one by one: "
        f"{lat['one_by_one']['txn_per_s']:.0f} txn/s (median "
        f"{lat['one_by_one']['latency_ms_median']:.1f} ms, "
        f"p95 {lat['one_by_one']['latency_ms_p95']:.1f} ms); x{lat['speedup']:.1f}; "
        f"max |dp| {lat['max_abs_prob_diff']:.2e}")
    p_check_before = score(engine, check_ids, B)

    # 4. the scoring loop, with the drop
    ev, drop = threading.Event(), {}
    th = threading.Thread(target=dropper, args=(ev, so, folder, drop), daemon=True)
    th.start()
    drop_batch = int(math.ceil(a.before / B))
    probs = np.full(len(ids), np.nan)
    rows = []                                # per batch: i, t0, t1, version
    live_batch = None
    t_start = time.perf_counter()
    wall_start = time.time()
    i = 0
    nb = int(math.ceil(len(ids) / B))
    while i < nb:
        if i == drop_batch:
            ev.set()
        v0 = engine.expert_set_generation
        t0 = time.perf_counter()
        lo, hi = i * B, min(len(ids), (i + 1) * B)
        logits = engine.score_batch([list(r) for r in ids[lo:hi]])
        t1 = time.perf_counter()
        probs[lo:hi] = fraud_prob(np.stack(logits))
        v1 = engine.expert_set_generation
        rows.append((i, t0, t1, v1))
        if live_batch is None and v1 != v0:
            live_batch = i
            say(f"batch {i}: expert set v{v0} -> v{v1}: card_testing is live "
                f"({t0 - drop['perf']:.2f}s after the drop)")
        i += 1
        if live_batch is None and i > drop_batch and "perf" in drop \
                and time.perf_counter() - drop["perf"] > a.live_timeout:
            raise SystemExit(f"the expert was not live {a.live_timeout:.0f}s after the drop; "
                             f"hot-plug state: {engine.hotplug.list()}")
        if live_batch is not None and (i - live_batch) * B >= a.after:
            break
        if i % 10 == 0:
            say(f"  scored {i * B} txns, {i / (time.perf_counter() - t_start):.1f} batches/s")
    if live_batch is None:
        raise SystemExit("the stream ended before the expert went live: raise --after")
    n_scored = min(len(ids), len(rows) * B)
    probs, pat, epi = probs[:n_scored], pattern[:n_scored], episode[:n_scored]
    p_check_after = score(engine, check_ids, B)
    rows_a = np.array(rows)
    t_live_perf = rows_a[live_batch, 1]
    loaded = recorder.events[0] if recorder.events else None

    # 5. numbers
    flag = probs >= thr
    split = live_batch * B
    res = {"threshold": thr, "batch_size": B, "transactions_scored": int(n_scored),
           "latency": lat}
    table = {}
    for name, group in (("new pattern (card testing)", ["card_testing"]),
                        ("old patterns", OLD_PATTERNS)):
        g0 = group_metrics(flag[:split], pat[:split], group)
        g1 = group_metrics(flag[split:], pat[split:], group)
        table[name] = {"before": g0, "after": g1,
                       "recall_change": newcombe_diff(g0["tp"], g0["positives"], g1["tp"],
                                                      g1["positives"]),
                       "precision_change": newcombe_diff(g0["tp"], g0["tp"] + g0["fp"],
                                                         g1["tp"], g1["tp"] + g1["fp"]),
                       "episode_bootstrap": episode_bootstrap(flag, pat, epi, group, split),
                       "per_pattern_recall": {
                           p: [wilson(int((flag[:split] & (pat[:split] == p)).sum()),
                                      int((pat[:split] == p).sum())),
                               wilson(int((flag[split:] & (pat[split:] == p)).sum()),
                                      int((pat[split:] == p).sum()))] for p in group}}
    fp0 = group_metrics(flag[:split], pat[:split], ["card_testing"])["fp_rate"]
    fp1 = group_metrics(flag[split:], pat[split:], ["card_testing"])["fp_rate"]
    res["table"] = table
    res["legit_fp_rate"] = {"before": fp0, "after": fp1}
    old_m = np.isin(check_pat, OLD_PATTERNS)
    dec0, dec1 = p_check_before >= thr, p_check_after >= thr
    res["same_transactions"] = {
        "n_old": int(old_m.sum()), "n_new": int((check_pat == "card_testing").sum()),
        "n_legit": int((check_pat == "legit").sum()),
        "old_recall": [float(dec0[old_m].mean()), float(dec1[old_m].mean())],
        "new_recall": [float(dec0[check_pat == "card_testing"].mean()),
                       float(dec1[check_pat == "card_testing"].mean())],
        "flips_old": int((dec0 != dec1)[old_m].sum()),
        "flips_legit": int((dec0 != dec1)[check_pat == "legit"].sum()),
        "max_abs_prob_change_old": float(np.abs(p_check_after - p_check_before)[old_m].max()),
    }
    # continuity
    t0s, t1s = rows_a[:, 1] - t_start, rows_a[:, 2] - t_start
    gaps = t0s[1:] - t1s[:-1]                              # loop overhead between batches
    period = np.diff(t1s)                                  # completion to completion
    near = slice(max(0, drop_batch - 4), min(len(rows) - 1, live_batch + 3))
    t_drop_rel = drop["perf"] - t_start
    t_live_rel = t_live_perf - t_start
    around = range(max(1, drop_batch - 3), min(len(rows), live_batch + 4))
    res["live"] = {
        "drop_wall": clock(drop["wall"]), "live_wall": clock(wall_start + t_live_rel),
        "drop_batch": drop_batch, "live_batch": live_batch,
        "seconds_drop_to_live": float(t_live_perf - drop["perf"]),
        "batches_scored_between": int(live_batch - drop_batch),
        "hook_event": None if loaded is None else {
            "wall": clock(loaded["wall"]), "expert_set_generation": loaded.get("expert_set_generation"),
            "slot": loaded.get("slot"), "name": loaded.get("name")},
        "hotplug_list": engine.hotplug.list(),
    }
    res["continuity"] = {
        "batches": len(rows), "median_batch_s": float(np.median(t1s - t0s)),
        "max_pause_between_batches_s": float(gaps.max()) if len(gaps) else 0.0,
        "median_completion_period_s": float(np.median(period)) if len(period) else 0.0,
        "max_completion_period_near_drop_s":
            float(period[near].max()) if len(period[near]) else 0.0,
        "max_completion_period_s": float(period.max()) if len(period) else 0.0,
        "live_batch_s": float(t1s[live_batch] - t0s[live_batch]),
        "around_drop": [{"batch": int(j), "end_s": float(t1s[j] - t_drop_rel),
                         "seconds": float(t1s[j] - t0s[j]),
                         "batches_per_s": float(1.0 / max(t1s[j] - t1s[j - 1], 1e-9)),
                         "expert_set_generation": int(rows_a[j, 3])} for j in around],
        "recall_bins": {name: binned_recall(pat, flag, group, B, len(rows), live_batch,
                                            8 if not a.quick else 2)
                        for name, group in (("new", ["card_testing"]), ("old", OLD_PATTERNS))},
    }
    engine.close()

    # the counterfactual: the after phase's transactions scored by the base model alone
    # (a second engine, no hot-plug), so that before/after is also compared on the same
    # transactions, free of the stream's drift between the two phases
    base = Engine.from_config(CONFIG)
    p_base = score(base, ids[split:n_scored], B)
    base.close()
    flag_b = p_base >= thr
    cf = {}
    for name, group in (("new pattern (card testing)", ["card_testing"]),
                        ("old patterns", OLD_PATTERNS)):
        m = np.isin(pat[split:], group)
        cf[name] = {"base": group_metrics(flag_b, pat[split:], group),
                    "with_expert": group_metrics(flag[split:], pat[split:], group),
                    "gained": int((flag[split:] & ~flag_b & m).sum()),
                    "lost": int((~flag[split:] & flag_b & m).sum())}
    lm = pat[split:] == "legit"
    cf["legit"] = {"base_fp": int((flag_b & lm).sum()),
                   "with_expert_fp": int((flag[split:] & lm).sum()),
                   "new_fp": int((flag[split:] & ~flag_b & lm).sum()),
                   "removed_fp": int((~flag[split:] & flag_b & lm).sum()), "n": int(lm.sum())}
    res["after_phase_same_transactions"] = cf

    # report
    say("")
    say(f"threshold P(FRAUD) >= {thr:.4f}; {n_scored} transactions in {len(rows)} batches of {B}")
    say(f"{'':40s} {'before':>22s} {'after':>22s}   {'change, Newcombe':>22s}"
        f"   {'change, by episode':>18s}")
    for name, r in table.items():
        eb = r["episode_bootstrap"]
        for metric in ("recall", "precision"):
            b, c = r["before"][metric], r["after"][metric]
            d, e = r[f"{metric}_change"], eb[f"{metric}_change"]
            say(f"{name + ' ' + metric:40s} {fmt_ci(*b):>22s} {fmt_ci(*c):>22s}   "
                f"{100 * d[0]:+5.1f} [{100 * d[1]:+5.1f}, {100 * d[2]:+5.1f}]"
                f"     [{100 * e[0]:+5.1f}, {100 * e[1]:+5.1f}]")
        say(f"{'':40s} n={r['before']['positives']:<4d} ({eb['episodes'][0]} episodes) "
            f"tp={r['before']['tp']:<4d} fp={r['before']['fp']:<3d}  "
            f"n={r['after']['positives']:<4d} ({eb['episodes'][1]} episodes) "
            f"tp={r['after']['tp']:<4d} fp={r['after']['fp']:<3d}")
    pp = table["old patterns"]["per_pattern_recall"]
    say("old patterns, recall by pattern (before -> after): " + ", ".join(
        f"{p} {_pct(v[0][0])} (n={int((pat[:split] == p).sum())})"
        f" -> {_pct(v[1][0])} (n={int((pat[split:] == p).sum())})" for p, v in pp.items()))
    say(f"{'legit false-positive rate':40s} {fmt_ci(*fp0):>22s} {fmt_ci(*fp1):>22s}")
    say(f"after phase, the same {n_scored - split} transactions scored by the base model alone "
        f"vs with the expert:")
    for name in ("new pattern (card testing)", "old patterns"):
        c = cf[name]
        for metric in ("recall", "precision"):
            say(f"  {name + ' ' + metric:38s} {fmt_ci(*c['base'][metric]):>22s} "
                f"{fmt_ci(*c['with_expert'][metric]):>22s}")
        say(f"  {'':38s} decisions changed on {c['gained'] + c['lost']} of "
            f"{c['base']['positives']} txns: {c['gained']} now caught, {c['lost']} now missed")
    lg = cf["legit"]
    say(f"  legit: {lg['base_fp']} -> {lg['with_expert_fp']} false positives of {lg['n']} "
        f"({lg['new_fp']} new, {lg['removed_fp']} gone)")
    st = res["same_transactions"]
    say(f"same {st['n_old']} old-pattern / {st['n_new']} card-testing / {st['n_legit']} legit "
        f"txns scored before and after: old recall {st['old_recall'][0]:.3f} -> "
        f"{st['old_recall'][1]:.3f} ({st['flips_old']} decisions flipped), card testing "
        f"{st['new_recall'][0]:.3f} -> {st['new_recall'][1]:.3f}, legit flips {st['flips_legit']}")
    lv, co = res["live"], res["continuity"]
    say(f"dropped at {lv['drop_wall']} (before batch {lv['drop_batch']}); live at "
        f"{lv['live_wall']} in batch {lv['live_batch']} ({lv['seconds_drop_to_live']:.2f}s, "
        f"{lv['batches_scored_between']} batches scored in between)"
        + (f"; expert_loaded hook at {lv['hook_event']['wall']}, expert set "
           f"v{lv['hook_event']['expert_set_generation']}, slot {lv['hook_event']['slot']}"
           if lv["hook_event"] else ""))
    say(f"continuity: median batch {1e3 * co['median_batch_s']:.0f} ms, live batch "
        f"{1e3 * co['live_batch_s']:.0f} ms, longest pause between batches "
        f"{1e3 * co['max_pause_between_batches_s']:.1f} ms, longest completion-to-completion "
        f"near the drop {1e3 * co['max_completion_period_near_drop_s']:.0f} ms "
        f"(median {1e3 * co['median_completion_period_s']:.0f} ms, whole run "
        f"{1e3 * co['max_completion_period_s']:.0f} ms)")
    say("batches around the drop (end time relative to the drop, duration, rate, expert set):")
    for r in co["around_drop"]:
        mark = "  <- live" if r["batch"] == live_batch else ("  <- drop before it"
                                                             if r["batch"] == drop_batch else "")
        say(f"  batch {r['batch']:4d}  ends {r['end_s']:+7.2f}s  took {1e3 * r['seconds']:6.0f} ms"
            f"  {r['batches_per_s']:5.2f} batches/s  v{r['expert_set_generation']}{mark}")

    if not a.no_plot:
        png = out / "fraud_demo.png"
        if plot(png, pat, flag, t0s, t1s, B, live_batch, t_drop_rel, t_live_rel,
                8 if not a.quick else 2):
            res["plot"] = str(png)
            say(f"plot: {png}")
        else:
            say(f"plot skipped: matplotlib is not installed; to get it: {PLOT_INSTALL}")
    (out / "fraud_demo.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    say(f"results: {out / 'fraud_demo.json'}")
    return res


if __name__ == "__main__":
    main()
