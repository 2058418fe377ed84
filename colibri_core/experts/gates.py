"""A candidate's gate: what its shadow and canary passes did to scored items, labelled
feedback on them, and the rule that promotes or drops the candidate (candidates.py).

An item is one scored prompt (a `/v1/score` item), known by (request id, index). Its
score is the summed log-prob of its first candidate continuation (the fraud example's
log P(FRAUD)); its decision is positive when that probability is at least the gate's
`threshold` (one candidate continuation), or when the first continuation is the most
likely one (several). While the candidate is in shadow, every item the live set scores
is recorded with the live score and the candidate's: recomputed under the candidate's
set when its routing chose the candidate's slot, else the live one (the candidate's set
is not run for it). Feedback labels items positive or negative; the rule compares recall
and precision of both sets on the labelled items that have both.

Thread-safe: one lock; the server's threads record and label, the listing reads.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

MAX_ITEMS = 200_000          # items remembered for feedback (the oldest forgotten first)


def decision(scores: list[float], threshold: float) -> bool:
    """Positive or not: P(first continuation) >= threshold with one continuation; the
    first one the most likely with several."""
    if len(scores) == 1:
        return math.exp(scores[0]) >= threshold
    return scores[0] >= max(scores)


def rates(tp: int, fp: int, fn: int) -> dict:
    """Recall and precision (precision 1.0 when nothing was flagged: nothing wrong)."""
    return {"tp": tp, "fp": fp, "fn": fn,
            "recall": tp / (tp + fn) if tp + fn else None,
            "precision": tp / (tp + fp) if tp + fp else 1.0}


class Gate:
    def __init__(self, threshold: float = 0.5, min_positives: int = 20, auto: bool = True,
                 precision_margin: float = 0.0):
        self.lock = threading.Lock()
        # precision the candidate may lose against the live set (a new pattern caught at
        # the cost of a few false positives); 0: at least the live set's
        self.precision_margin = float(precision_margin)
        self.threshold = float(threshold)
        self.min_positives = int(min_positives)
        self.auto = bool(auto)
        # (request id, item) -> [live scores or None, candidate scores or None]
        self.items: OrderedDict = OrderedDict()
        self.labels: dict = {}               # (request id, item) -> bool
        self.n = {"items": 0, "routed": 0, "changed": 0, "canary": 0, "pending": 0,
                  "skipped": 0}
        self.delta_sum = 0.0                 # |candidate - live| log-prob, routed items
        self.delta_max = 0.0

    def settings(self) -> dict:
        return {"threshold": self.threshold, "min_positives": self.min_positives,
                "auto": self.auto, "precision_margin": self.precision_margin}

    def _put(self, key, live, cand) -> None:
        old = self.items.get(key)
        if old is not None:                  # a live score and a canary one: keep both
            live = live if live is not None else old[0]
            cand = cand if cand is not None else old[1]
        self.items[key] = [live, cand]
        self.items.move_to_end(key)
        while len(self.items) > MAX_ITEMS:
            gone, _ = self.items.popitem(last=False)
            self.labels.pop(gone, None)

    def record_live(self, key, live: list[float]) -> None:
        """An item the live set scored whose routing did not choose the candidate."""
        with self.lock:
            self.n["items"] += 1
            self._put(key, live, live)

    def record_shadow(self, key, live: list[float], cand: list[float]) -> None:
        """An item recomputed under the candidate's set (its output never returned)."""
        with self.lock:
            self.n["items"] += 1
            self.n["routed"] += 1
            if decision(live, self.threshold) != decision(cand, self.threshold):
                self.n["changed"] += 1
            d = abs(cand[0] - live[0])
            self.delta_sum += d
            self.delta_max = max(self.delta_max, d)
            self._put(key, live, cand)

    def record_canary(self, key, cand: list[float]) -> None:
        """An item the candidate's set answered (canary): no live score for it."""
        with self.lock:
            self.n["canary"] += 1
            self._put(key, None, cand)

    def count(self, what: str, by: int = 1) -> None:
        with self.lock:
            self.n[what] += by

    def label(self, key, positive: bool) -> bool:
        """Feedback on one item; False when the item is not known (never scored while
        this candidate was there, or forgotten)."""
        with self.lock:
            if key not in self.items:
                return False
            self.labels[key] = bool(positive)
            return True

    def feedback(self) -> dict:
        """Recall and precision of the live set and of the candidate on the labelled
        items that have both scores."""
        with self.lock:
            th = self.threshold
            c = {"live": [0, 0, 0], "candidate": [0, 0, 0]}
            both = positives = 0
            for key, y in self.labels.items():
                live, cand = self.items.get(key, (None, None))
                if live is None or cand is None:
                    continue
                both += 1
                positives += y
                for name, s in (("live", live), ("candidate", cand)):
                    d = decision(s, th)
                    if d or y:          # a true positive, a false positive, a miss
                        c[name][0 if d and y else 1 if d else 2] += 1
        return {"labelled": len(self.labels), "compared": both, "positives": positives,
                "live": rates(*c["live"]), "candidate": rates(*c["candidate"])}

    def verdict(self) -> str | None:
        """The rule: None until `min_positives` labelled positives are compared; then
        "promote" when the candidate's recall is at least the live set's and its precision
        at least the live set's minus `precision_margin` (default 0), else "drop"."""
        fb = self.feedback()
        if fb["positives"] < max(1, self.min_positives):
            return None
        live, cand = fb["live"], fb["candidate"]
        ok = cand["recall"] >= live["recall"] and \
            cand["precision"] >= live["precision"] - self.precision_margin
        return "promote" if ok else "drop"

    def report(self) -> dict:
        with self.lock:
            n = dict(self.n)
            mean = self.delta_sum / n["routed"] if n["routed"] else 0.0
            dmax = self.delta_max
        return {**n, "agreement": 1.0 - n["changed"] / n["items"] if n["items"] else None,
                "score_delta_mean": mean, "score_delta_max": dmax,
                "feedback": self.feedback(), **self.settings()}
