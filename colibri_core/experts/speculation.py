"""The expert cache's guesses (residency.speculative, expertcache.py): the next MoE
layers' experts guessed from the hidden state after a layer (each one's router on it) and
loaded early, nearer layers first; each guess scored when its layer runs; and the cost
rule that decides what a far guess may evict.

The cost rule (residency.far_guess_margin, issue 31). A guess for the next MoE layer
(depth 0) evicts as the cache's policy says. A guess for a layer further ahead (depth
>= 1) is less often right and waits longer before it is used, and every one is read
whether right or wrong, while the expert it evicts is read again only if it is used: it
may evict an expert only if that expert's use rate u (uses per forward since it came in,
with one forward's prior of top_k / num_experts, the rate of an expert of uniform
routing) is at most the far guesses' measured precision p at that depth (the share of
guessed experts that their layer then used, counted from a prior of 1 in 2) divided by
the margin: margin x u <= p. Experts in use (pinned) and guesses whose layer has not run
yet are never a far guess's victims; a far guess that finds no such victim is not loaded.
A margin of 0 turns the rule off (any victim, as the policy orders them).

Measured (docs/BENCHMARKS.md, issue 31): on the Mixtral-shaped benchmark model with half
its experts cached, far guesses 2 and 3 layers ahead were right 47 % and 34 % of the
time, their victims had come in a median 1-3 forwards before (58-89 % of them other
guesses not yet used), and every cached expert is used about one token in four: those
guesses cost reads the disk did not have to spare. Where the cache holds several tokens'
experts (Qwen3-30B-A3B in 8 GiB), most cached experts are used less than one token in
ten, and far guesses may evict them.
"""
from __future__ import annotations

import math

import numpy as np

from ..model import ops


class Speculation:
    """BudgetResidency's guesses (a mixin: the cache's entries, lock and admission are
    expertcache.py's)."""

    def _init_speculation(self, rc, cfg) -> None:
        self.speculative = rc.speculative and bool(cfg.moe_layers)
        self.spec_depth = rc.speculative_layers
        self.far_margin = rc.far_guess_margin
        self._base_rate = cfg.top_k / max(1, cfg.num_experts)
        self.spec_guessed = self.spec_correct = self.spec_loaded = self.spec_used = 0
        self.spec_wasted = 0
        self.far_guessed: dict = {}    # depth -> experts guessed at it (depth >= 1)
        self.far_correct: dict = {}    # depth -> of those, used by their layer
        self.far_skipped = 0           # far guesses not loaded: no victim cold enough
        self._spec_pending: dict = {}  # layer -> the depth-0 guess (scored)
        self._spec_far: dict = {}      # layer -> {depth: experts guessed from further back}
        moe = cfg.moe_layers
        self._ahead = {L: [m for m in moe if m > L] for L in range(cfg.num_layers)}

    def speculate(self, after_layer: int, x: np.ndarray, es, k) -> None:
        """Guess the next residency.speculative_layers MoE layers' experts from the hidden
        state after `after_layer` (each one's router on it) and start loading them, nearer
        layers first: several layers' misses in flight at once."""
        if x.shape[0] > 4:                         # a prefill needs most experts anyway
            return
        for depth, L in enumerate(self._ahead[after_layer][:self.spec_depth]):
            self._speculate_layer(L, x, es, k, depth)

    def far_precision(self, depth: int) -> float:
        """The measured share of depth-`depth` guesses their layer used (prior 1 in 2)."""
        return (self.far_correct.get(depth, 0) + 1) / (self.far_guessed.get(depth, 0) + 2)

    def use_rate(self, ent) -> float:
        """An entry's uses per forward since it came in, with one forward's prior of the
        uniform rate top_k / num_experts."""
        return (ent.uses + self._base_rate) / (self.forwards - ent.born + 1)

    def far_victim_ok(self, ent, p: float) -> bool:
        """May a far guess of measured precision `p` evict `ent`? (the module docstring)"""
        if ent.pins or (ent.spec and ent.score != -math.inf):
            return False
        return self.far_margin * self.use_rate(ent) <= p

    def _speculate_layer(self, L: int, x: np.ndarray, es, k, depth: int) -> None:
        lw = self._layers[L]
        xn = ops.rmsnorm(x, lw.ffn_norm, self.cfg.rms_norm_eps)
        logits = ops.router_logits(xn, es.routers[L], es.logit_bias[L])
        if es.select_bias[L] is not None:
            logits = logits + es.select_bias[L]
        kk = int(np.max(k)) if np.ndim(k) else int(k)
        kk = max(1, min(kk, logits.shape[1]))
        top = np.argpartition(-logits, kk - 1, axis=1)[:, :kk]
        guess = sorted(set(int(e) for e in top.reshape(-1)))
        exps = es.experts[L]
        far = depth > 0 and self.far_margin > 0
        p = self.far_precision(depth) if far else None
        with self._lock:
            if depth == 0:                         # the nearest guess is the one scored
                self._spec_pending[L] = guess
            else:
                self._spec_far.setdefault(L, {}).setdefault(depth, set()).update(guess)
            for e in guess:
                ex = exps[e]
                if ex is None or ex.file is None:
                    continue
                key = (L, e)
                if key in self.entries:
                    continue
                need = self.frame_bytes if self.mode == "copy" else ex.file.size
                if not self._make_room(need, optional=True, far_p=p):
                    if far:
                        self.far_skipped += 1
                    break
                ent = self._admit(key, ex, 1 + depth)
                ent.spec = True
                ent.uses = 0                       # guessed, not used yet
                self.spec_loaded += 1
            self._flush_drops()

    def _score_guess(self, layer: int, guess, used) -> None:
        """When `layer` runs: count its guesses right and wrong, and put its wrong guesses
        first in line for eviction."""
        actual = {int(e) for e in used}
        wrong = set()
        if guess is not None:
            g = set(guess)
            self.spec_guessed += len(g)
            self.spec_correct += len(g & actual)
            wrong |= g - actual
        for depth, g in self._spec_far.pop(layer, {}).items():
            self.far_guessed[depth] = self.far_guessed.get(depth, 0) + len(g)
            self.far_correct[depth] = self.far_correct.get(depth, 0) + len(g & actual)
            wrong |= g - actual
        for e in wrong:
            ent = self.entries.get((layer, e))
            if ent is not None and ent.spec and ent.pins == 0:
                ent.score = -math.inf

    def speculation_report(self) -> dict:
        far = {d: {"guessed": n, "correct": self.far_correct.get(d, 0),
                   "precision": self.far_correct.get(d, 0) / n if n else None}
               for d, n in sorted(self.far_guessed.items())}
        return {"guessed": self.spec_guessed, "correct": self.spec_correct,
                "loaded": self.spec_loaded, "used": self.spec_used, "wasted": self.spec_wasted,
                "hit_rate": (self.spec_correct / self.spec_guessed if self.spec_guessed else None),
                "far": far, "far_skipped": self.far_skipped, "far_margin": self.far_margin}
