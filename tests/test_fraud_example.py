"""The fraud example (examples/fraud/, docs/FRAUD.md), reduced to fit CI.

- the generator: base rates, every pattern present, overlap with legitimate traffic,
  determinism, card testing absent from the base model's stream;
- the committed model (configs/fraud.yaml): loads, its tokenizer agrees with the
  generator, it scores the old patterns above a floor and clearly above a deliberately weak
  rule; batched scoring gives the one-by-one scores;
- the demo, small: the new expert is built, dropped into the watched folder while the
  scoring loop runs, goes live between two batches, and card testing starts being caught
  on a fixed set of transactions while the old patterns' decisions do not change.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAUD_DIR = ROOT / "examples" / "fraud"
sys.path.insert(0, str(FRAUD_DIR))

import fraud_common as common  # noqa: E402
import fraud_stream as stream  # noqa: E402
from fraud_stream import OLD_PATTERNS, PATTERNS, StreamConfig, generate, summary  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    from colibri_core.engine import Engine
    with Engine.from_config(common.CONFIG) as eng:
        yield eng


def _probs(engine, txns, batch=256):
    ids = [tx.token_ids() for tx in txns]
    out = []
    for i in range(0, len(ids), batch):
        out.append(common.fraud_prob(np.stack(engine.score_batch(ids[i:i + batch]))))
    return np.concatenate(out)


# ----------------------------------------------------------------------------- generator
def test_generator_base_rates_patterns_and_determinism():
    cfg = StreamConfig(n_cards=300, days=14, old_fraud_rate=0.01, new_fraud_rate=0.008, seed=11)
    txns = generate(cfg)
    s = summary(txns)
    assert s["transactions"] > 8000
    assert 0.008 <= s["fraud_rate"] <= 0.03              # realistic: ~1-2 % fraud
    old = sum(s[p]["n"] for p in OLD_PATTERNS) / s["transactions"]
    assert 0.004 <= old <= 0.02
    for p in PATTERNS:
        assert s[p]["n"] > 0, p
    assert all(a.t <= b.t for a, b in zip(txns, txns[1:]))          # a time-ordered stream
    again = generate(cfg)
    assert [t.text() for t in again[:500]] == [t.text() for t in txns[:500]]
    for tx in txns[:2000]:
        ids = tx.token_ids()
        assert len(ids) == stream.SEQ_LEN and ids[-1] == stream.LABEL
        assert all(0 <= i < len(stream.VOCAB) for i in ids)
    base = summary(generate(StreamConfig(n_cards=200, days=7, seed=3)))
    assert base["card_testing"]["n"] == 0                           # the base model's world


def test_generator_patterns_overlap_legit_traffic():
    txns = generate(StreamConfig(n_cards=400, days=14, old_fraud_rate=0.01,
                                 new_fraud_rate=0.01, seed=5))
    legit = [t.fields for t in txns if not t.is_fraud]
    ct = [t.fields for t in txns if t.pattern == "card_testing"]
    old = [t.fields for t in txns if t.pattern in OLD_PATTERNS]
    # legitimate look-alikes exist for each telltale sign
    tiny_new_online = sum(f["amt"] <= 1 and f["mer"] == "new" and f["ch"] == "online"
                          for f in legit)
    abroad_big = sum(f["loc"] == "abroad" and f["amt"] >= 5 for f in legit)
    impossible = sum(f["geo"] == "impossible" for f in legit)
    new_device = sum(f["dev"] == "new" for f in legit)
    fast = sum(f["gap"] == 0 for f in legit)
    assert min(tiny_new_online, abroad_big, impossible, new_device, fast) >= 10, \
        (tiny_new_online, abroad_big, impossible, new_device, fast)
    # and the fraud is not one rule: patterns vary in every field
    assert len({f["amt"] for f in ct}) >= 2 and len({f["mcc"] for f in ct}) >= 3
    assert len({f["ch"] for f in old}) >= 3 and len({f["amt"] for f in old}) >= 5
    # token sequences of legit and fraud transactions collide sometimes (not separable)
    legit_texts = {" ".join(f"{k}_{f[k]}" for k in stream.FIELDS if k not in ("hr", "cty"))
                   for f in legit}
    ct_texts = [" ".join(f"{k}_{f[k]}" for k in stream.FIELDS if k not in ("hr", "cty"))
                for f in ct]
    assert sum(t in legit_texts for t in ct_texts) >= 1


# ----------------------------------------------------------------------------- the model
def test_committed_model_and_tokenizer(engine):
    cfg = engine.model_cfg
    assert cfg.layer_types == ["dense", "moe", "moe", "moe"]
    assert cfg.num_experts == 8 and cfg.top_k == 2
    size = sum(f.stat().st_size for f in common.MODEL_DIR.iterdir())
    assert size < 4e6, f"committed model is {size / 1e6:.1f} MB"
    for tx in generate(StreamConfig(n_cards=20, days=3, seed=2))[:50]:
        assert engine.encode(tx.text()) == tx.token_ids()
    sc = common.load_scoring()
    assert 0 < sc["threshold"] < 1


def test_old_patterns_above_floor_and_beat_weak_baseline(engine):
    txns = generate(StreamConfig(n_cards=400, days=14, old_fraud_rate=0.012, seed=12345))
    rng = np.random.default_rng(0)
    fraud = [t for t in txns if t.is_fraud]
    legit_all = [t for t in txns if not t.is_fraud]
    legit = [legit_all[i] for i in rng.choice(len(legit_all), 1200, replace=False)]
    w = len(legit_all) / len(legit)         # legit subsampled: false positives count w each
    thr = common.load_scoring()["threshold"]
    pf, pl = _probs(engine, fraud), _probs(engine, legit)

    def rates(flag_f, flag_l):
        tp, fp = int(flag_f.sum()), float(flag_l.sum()) * w
        rec, prec = tp / len(fraud), tp / max(tp + fp, 1e-9)
        return rec, prec, 2 * rec * prec / max(rec + prec, 1e-9)

    m = rates(pf >= thr, pl >= thr)
    b = rates(np.array([stream.weak_baseline(t) for t in fraud]),
              np.array([stream.weak_baseline(t) for t in legit]))
    assert len(fraud) >= 100
    assert m[0] >= 0.6 and m[1] >= 0.5, f"model recall/precision {m[:2]}"
    assert m[2] >= b[2] + 0.3, f"model F1 {m[2]:.3f} vs weak baseline {b[2]:.3f}"
    assert common.roc_auc(np.concatenate([pf, pl]),
                          np.r_[np.ones(len(pf), bool), np.zeros(len(pl), bool)]) > 0.95


def test_score_batch_equals_one_by_one(engine):
    txns = generate(StreamConfig(n_cards=40, days=7, old_fraud_rate=0.05, seed=8))[:24]
    ids = [t.token_ids() for t in txns]
    batch = np.stack(engine.score_batch(ids))
    single = np.stack([engine.next_token_logits(s) for s in ids])
    np.testing.assert_allclose(batch, single, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(common.fraud_prob(batch), common.fraud_prob(single), atol=1e-5)


def test_statistics_helpers():
    p, lo, hi = common.wilson(0, 50)
    assert p == 0 and lo == 0 and 0.05 < hi < 0.09               # 0/50: [0, 7.1 %]
    p, lo, hi = common.wilson(40, 50)
    assert lo < 0.8 < hi and abs(lo - 0.670) < 0.002 and abs(hi - 0.888) < 0.002
    d, lo, hi = common.newcombe_diff(10, 100, 30, 100)
    assert lo < 0.2 < hi and lo > 0


# ----------------------------------------------------------------------------- hot-plug demo
@pytest.mark.skipif(shutil.which("gcc") is None, reason="the expert builder needs gcc")
def test_demo_reduced_hotplug_while_scoring(tmp_path):
    import run_demo
    res = run_demo.main(["--before", "768", "--after", "768", "--batch", "128",
                         "--latency-sample", "16", "--check-size", "300", "--no-plot",
                         "--out", str(tmp_path / "demo"), "--seed", "3"])
    live = res["live"]
    assert live["live_batch"] >= live["drop_batch"]
    assert live["seconds_drop_to_live"] < 30
    assert live["hook_event"] is not None and live["hook_event"]["slot"] == 8
    # scoring never stopped: the loop did not wait for the expert
    co = res["continuity"]
    assert co["max_pause_between_batches_s"] < 0.5
    assert co["max_completion_period_near_drop_s"] < 5 * co["median_completion_period_s"] + 1.0
    # the same transactions before and after: card testing now caught, old ones unchanged
    st = res["same_transactions"]
    assert st["new_recall"][0] <= 0.2 and st["new_recall"][1] >= st["new_recall"][0] + 0.4
    assert st["new_recall"][1] >= 0.7      # 0.83 as built (minmax); 0.43 with mse rounding
    assert st["flips_old"] <= max(1, st["n_old"] // 20)
    assert abs(st["old_recall"][1] - st["old_recall"][0]) <= 0.05
    # the after phase scored again by the base model alone: only card testing changed
    cf = res["after_phase_same_transactions"]
    assert cf["old patterns"]["gained"] + cf["old patterns"]["lost"] <= 1
    assert cf["new pattern (card testing)"]["lost"] == 0
    assert cf["legit"]["new_fp"] <= max(3, cf["legit"]["n"] // 500)
    assert res["latency"]["max_abs_prob_diff"] < 1e-5
    assert (tmp_path / "demo" / "fraud_demo.json").is_file()


# ----------------------------------------------------------------------------- the expert as built
def card_testing_scores(engine_with_expert, legit_n=1500, seed=0):
    """Recall and one-vs-legit precision on card testing over the expert's validation stream
    (train_new_expert.py's VALID: live base rates), every card-testing transaction and a
    subsample of the legit ones, whose false positives count for the whole."""
    import train_new_expert as tne
    txns = generate(tne.VALID)
    ct = [t for t in txns if t.pattern == "card_testing"]
    legit_all = [t for t in txns if not t.is_fraud]
    rng = np.random.default_rng(seed)
    legit = [legit_all[i] for i in rng.choice(len(legit_all), legit_n, replace=False)]
    thr = common.load_scoring()["threshold"]
    tp = int((_probs(engine_with_expert, ct) >= thr).sum())
    fp = float((_probs(engine_with_expert, legit) >= thr).sum()) * len(legit_all) / legit_n
    return tp / len(ct), tp / max(tp + fp, 1e-9), len(ct)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the expert builder needs gcc")
def test_built_expert_keeps_its_validated_recall_and_precision(tmp_path):
    """The .so built as the demo builds it (the q4 clipping recorded with the expert)
    catches card testing at the validated rate. Built with the other clipping (mse instead
    of the minmax it was trained with) the recall falls below the floor (measured here:
    0.80 -> 0.63; precision 0.92 -> 0.90), which is how the documented figures once
    drifted (full demo: 78.6 % -> 60.7 %)."""
    from colibri_core.engine import Engine
    from colibri_core.model.fingerprint import fingerprint_of_dir
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    meta = json.loads(common.EXPERT_JSON.read_text())
    assert meta["q4_clip"] == common.expert_q4_clip() == "minmax"
    folder = tmp_path / "experts"
    folder.mkdir(mode=0o700)
    info = build_expert(common.EXPERT_NPZ, folder / "card_testing.so", common.NEW_EXPERT_LAYER,
                        "card_testing", "1", q4_clip=common.expert_q4_clip(),
                        base_model=fingerprint_of_dir(common.MODEL_DIR))
    assert info.meta.target.endswith("q4-clip=minmax")
    with Engine.from_config(common.CONFIG, experts_dir=str(folder)) as eng:
        assert eng.expert_set_generation == 1
        recall, precision, n = card_testing_scores(eng)
    valid = meta["valid_after_int4"]["new"]
    assert n >= 300
    assert recall >= 0.75 and recall >= valid["recall"][0] - 0.05, (recall, valid["recall"])
    assert precision >= 0.8, precision
