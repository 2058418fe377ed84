"""The candidate gate's bookkeeping and rule (colibri_core/experts/gates.py) against
recall and precision worked out here with numpy, and the canary's hash rule."""
from __future__ import annotations

import hashlib
import math

import numpy as np

from colibri_core.experts import gates
from colibri_core.experts.candidates import canary_point
from colibri_core.experts.gates import Gate, decision


def test_decision_one_and_several_continuations():
    assert decision([math.log(0.92)], 0.916) and not decision([math.log(0.91)], 0.916)
    assert decision([-1.0, -2.0], 0.99) and not decision([-2.0, -1.0], 0.0)


def reference(live, cand, labels, th):
    out = {}
    for name, s in (("live", live), ("candidate", cand)):
        d = np.exp(s) >= th
        tp, fp, fn = int((d & labels).sum()), int((d & ~labels).sum()), int((~d & labels).sum())
        out[name] = (tp / (tp + fn), tp / (tp + fp) if tp + fp else 1.0)
    return out


def test_feedback_rates_and_verdict_match_numpy():
    rng = np.random.default_rng(0)
    n, th = 400, 0.8
    labels = rng.random(n) < 0.2
    live = np.log(np.clip(np.where(labels, rng.beta(5, 2, n), rng.beta(1, 6, n)), 1e-9, 1))
    better = np.log(np.clip(np.where(labels, rng.beta(9, 1, n), rng.beta(1, 9, n)), 1e-9, 1))
    g = Gate(threshold=th, min_positives=10)
    for i in range(n):
        if i % 3:
            g.record_shadow(("r", i), [float(live[i])], [float(better[i])])
        else:                                   # not routed: the live score for both
            g.record_live(("r", i), [float(live[i])])
    cand = np.where(np.arange(n) % 3 == 0, live, better)
    assert g.verdict() is None                  # no labels yet
    assert not g.label(("other", 0), True)      # an item it never saw
    for i in range(n):
        assert g.label(("r", i), bool(labels[i]))
    fb, want = g.feedback(), reference(live, cand, labels, th)
    for name in ("live", "candidate"):
        assert (fb[name]["recall"], fb[name]["precision"]) == want[name]
    ok = want["candidate"][0] >= want["live"][0] and want["candidate"][1] >= want["live"][1]
    assert g.verdict() == ("promote" if ok else "drop")
    rep = g.report()
    changed = ((np.exp(cand) >= th) != (np.exp(live) >= th)).sum()
    assert rep["items"] == n and rep["routed"] == n - len(range(0, n, 3))
    assert rep["changed"] == changed and rep["agreement"] == 1 - changed / n
    g2 = Gate(threshold=th, min_positives=10)   # the same with the sets swapped: the other way
    for i in range(n):
        g2.record_shadow(("r", i), [float(cand[i])], [float(live[i])])
        g2.label(("r", i), bool(labels[i]))
    assert {g.verdict(), g2.verdict()} == {"promote", "drop"}


def test_min_positives_and_nothing_flagged():
    g = Gate(threshold=0.5, min_positives=3)
    for i in range(3):
        g.record_shadow(("r", i), [math.log(0.1)], [math.log(0.9)])
        g.label(("r", i), True)
        assert g.verdict() == (None if i < 2 else "promote")
    fb = g.feedback()
    assert fb["live"]["recall"] == 0 and fb["live"]["precision"] == 1.0   # flagged none


def test_precision_margin():
    """Recall 0 -> 1 at precision 1.0 -> 0.75 (one false positive in four flags)."""
    for margin, want in ((0.0, "drop"), (0.2, "drop"), (0.25, "promote")):
        g = Gate(threshold=0.5, min_positives=3, precision_margin=margin)
        for i in range(4):
            g.record_shadow(("r", i), [math.log(0.1)], [math.log(0.9)])
            g.label(("r", i), i < 3)
        assert g.verdict() == want, margin
        assert g.settings()["precision_margin"] == margin


def test_canary_items_are_not_compared_and_old_items_are_forgotten(monkeypatch):
    monkeypatch.setattr(gates, "MAX_ITEMS", 5)
    g = Gate(min_positives=1)
    g.record_canary(("c", 0), [0.0])
    g.label(("c", 0), True)
    assert g.feedback()["compared"] == 0 and g.verdict() is None
    for i in range(6):
        g.record_live(("r", i), [0.0])
    assert not g.label(("c", 0), True) and not g.label(("r", 0), True)
    assert g.labels == {} and g.label(("r", 5), True)      # its label forgotten with it


def test_canary_point_is_the_documented_hash():
    for rid in ("a", "canary-7", "ünïcode"):
        d = hashlib.sha256(rid.encode()).digest()
        assert canary_point(rid) == int.from_bytes(d[:8], "big") / 2.0 ** 64
    share = np.mean([canary_point(f"req-{i}") < 0.3 for i in range(4000)])
    assert abs(share - 0.3) < 0.03
