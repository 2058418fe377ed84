"""Self-speculative decoding: drafts from the sequence's own text, and the rule that
accepts them so that the output is what plain decoding gives.

A round feeds the last token and gamma draft tokens d1..dg in one forward (all their
logits: batch invariance makes row i bit-identical to the logits sequential decoding
would compute after d1..di), then walks the rows in order: row i's token is sampled as
plain decoding samples it; while it equals d(i+1) the next row is conditioned on exactly
that token and the walk goes on; the first token that differs (or the token of the last
row) ends the round, and the KV cache is cut back after the last accepted draft token.
For a deterministic draft (q one-hot on d), "sample y ~ p and accept d iff y == d" is
speculative sampling's rule exactly: d is accepted with probability p(d) = min(1,
p(d)/q(d)), and on a rejection y is distributed as the normalised residual max(p - q, 0)
(p without d). It also keeps the sampler's random stream as plain decoding's, so a
seeded request gives the same tokens with and without speculation. `speculative_choice`
is the rule for a draft that samples from a distribution q (the unit tests check both
exactly, tests/test_speculative.py).

The cost model and what it measured are in docs/BENCHMARKS.md ("Self-speculative
decoding"): speed-up = E[tokens per round] * T1 / (gamma * T_draft + T_verify(gamma + 1)),
and only drafts with T_draft <= 0.3 * T1 can pay. Prompt lookup costs a few dictionary
operations per token.
"""
from __future__ import annotations

import numpy as np

MODES = ("off", "prompt_lookup")


class PromptLookup:
    """Drafts from the sequence's own tokens (prompt and generated): the tokens that
    followed the latest earlier occurrence of its last n tokens, n from `ngram_max` down
    to `ngram_min` (the longest match wins). A match close to the end is continued
    periodically (a loop in the text drafts its next turns). One per sequence; `push`
    every emitted token, `draft(limit)` before a step."""

    def __init__(self, tokens, ngram_max: int = 3, ngram_min: int = 2):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min={ngram_min}, ngram_max={ngram_max}: expected "
                             f"1 <= ngram_min <= ngram_max")
        self.hist: list[int] = [int(t) for t in tokens]
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # index[n]: n-gram (tuple) -> the last position where one ending there was seen
        self.index: list[dict] = [{} for _ in range(ngram_max + 1)]
        self.indexed = 0            # n-grams ending before this position are indexed

    def push(self, token: int) -> None:
        self.hist.append(int(token))

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens to follow the sequence (maybe none)."""
        h = self.hist
        end = len(h) - 1                       # the last token: its n-grams are the keys
        if limit <= 0 or end < 1:
            return []
        lo, hi = self.ngram_min, self.ngram_max
        for e in range(self.indexed, end):     # what is new since the last call
            for n in range(lo, min(hi, e + 1) + 1):
                self.index[n][tuple(h[e - n + 1:e + 1])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(hi, end + 1), lo - 1, -1):
            e = self.index[n].get(tuple(h[end - n + 1:]))
            if e is None:
                continue
            period = end - e                   # h[e + 1 + i] for i < period, then repeat
            return [h[e + 1 + i % period] for i in range(limit)]
        return []


def speculative_choice(p: np.ndarray, q: np.ndarray, x: int, u: float, v: float) -> tuple[int, bool]:
    """Speculative sampling's rule for a draft token `x` drawn from distribution `q`,
    where the target distribution is `p` (both [V], each summing to 1): accept x when
    u < min(1, p(x) / q(x)); otherwise the token is drawn, by inverse CDF at v, from the
    residual max(p - q, 0) normalised. u, v uniform in [0, 1). -> (token, accepted).
    The token is then distributed exactly as p."""
    px, qx = float(p[x]), float(q[x])
    if qx <= 0.0:
        raise ValueError(f"draft token {x} has probability 0 under the draft's distribution")
    if u * qx < px:                            # u < p(x) / q(x), without dividing
        return int(x), True
    r = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    cum = np.cumsum(r)
    tok = int(np.searchsorted(cum, v * cum[-1], side="right"))
    return min(tok, len(r) - 1), False

