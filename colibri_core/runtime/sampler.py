"""Turning next-token logits into a token: logit bias, penalties, greedy, temperature,
top-k, top-p, min-p; seeded.

Penalties (vLLM's semantics, applied here and nowhere else, after logit bias):
repetition (HF/llama.cpp style: a positive logit divided by it, a negative one multiplied)
on every token of the prompt and the output so far; then frequency (count in the output
times the penalty, subtracted) and presence (subtracted once per token that is in the
output). The decode loop tells the sampler each emitted token (`Penalties.push`); a
sampler without penalties has `penalties = None` and costs nothing more per token.

A grammar (`SamplingParams.grammar`, constraints.py) masks, last of all, every token
that would take the output out of it; the sampler then tells the sequence's matcher the
token it chose. Greedy first tries the unmasked arg-max (one check, no mask); a sampler
without a grammar has `constraint = None` and does nothing for it."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..model import ops
from .constraints import Grammar, constraint


@dataclass(frozen=True)
class SamplingParams:
    """How a request turns logits into tokens: one object, the Python API's
    (`Engine.generate(..., sampling=SamplingParams(...))`) and the one the server fills
    from an OpenAI body. `top_k` here is the sampling top-k (keep the k most likely
    tokens; 0: off), never the experts per token (`experts_per_token`). `logprobs`: None,
    or how many alternatives each token event carries with its log-prob
    (TokenEvent.logprob). `ignore_eos`: the model's EOS tokens are never sampled."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    grammar: Optional[Grammar] = None

    def with_seed(self, seed: Optional[int]) -> "SamplingParams":
        return replace(self, seed=seed)

    def sampler(self, eos_ids=(), tokenizer=None, n_vocab: int = 0) -> "Sampler":
        """A Sampler of these settings (one per sequence: it holds the seeded generator,
        the penalties' counts and the grammar's matcher, made here with `tokenizer` and
        the model's `n_vocab`); ValueError naming a bad value."""
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos: not with a grammar (the grammar decides where "
                             "the answer ends)")
        return Sampler(self.temperature, self.top_p, self.seed, top_k=self.top_k,
                       logit_bias=self.logit_bias, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty,
                       repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                       mask=list(eos_ids) if self.ignore_eos else None,
                       constraint=constraint(self.grammar, tokenizer, n_vocab, list(eos_ids)))


class Penalties:
    """A sequence's token counts for the penalties; `start` with the prompt, `push` each
    emitted token (generate.py's decode loop)."""

    def __init__(self, presence: float, frequency: float, repetition: float):
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.counts: dict[int, int] = {}           # output token -> times emitted
        self.prompt: set[int] = set()
        self._arrays = None                        # (out ids, counts, prompt|output ids)

    def start(self, prompt_ids) -> None:
        self.prompt = {int(t) for t in prompt_ids}
        self.counts = {}
        self._arrays = None

    def push(self, tok: int) -> None:
        self.counts[tok] = self.counts.get(tok, 0) + 1
        self._arrays = None                        # rebuilt at the next step: O(distinct)

    def apply(self, x: np.ndarray) -> None:
        """In place on float64 logits."""
        if self._arrays is None:
            ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
            cnt = np.fromiter(self.counts.values(), np.float64, len(self.counts))
            seen = np.fromiter(self.prompt.union(self.counts), np.int64)
            self._arrays = ids, cnt, seen
        ids, cnt, seen = self._arrays
        if self.repetition != 1.0 and seen.size:
            v = x[seen]
            x[seen] = np.where(v > 0, v / self.repetition, v * self.repetition)
        if ids.size and (self.frequency or self.presence):
            x[ids] -= cnt * self.frequency + self.presence


def _number(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
            or not math.isfinite(v):
        raise ValueError(f"{name}={v!r:.40}: must be a finite number")


class Sampler:
    """One per request. The same seed and logits give the same tokens."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 top_k: int = 0, logit_bias: dict[int, float] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, min_p: float = 0.0,
                 mask: list[int] | None = None, constraint=None):
        for name, v in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_p", min_p)):
            _number(name, v)
        if not -2 <= presence_penalty <= 2 or not -2 <= frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty: must be in [-2, 2]")
        if not 0 < repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty={repetition_penalty}: must be in (0, 10]")
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p={min_p}: must be in [0, 1]")
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name}={v!r:.40}: must be a number")
        if not (math.isfinite(temperature) and temperature >= 0):   # NaN fails too
            raise ValueError(f"temperature={temperature}: must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0: no top-k cut)")
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k                  # keep the k most likely tokens (0: all)
        # token id -> value added to its logit before anything else (OpenAI's logit_bias)
        self.bias = None
        if logit_bias:
            self.bias = (np.fromiter(logit_bias.keys(), np.int64, len(logit_bias)),
                         np.fromiter(logit_bias.values(), np.float64, len(logit_bias)))
        self.min_p = float(min_p)
        self.penalties = None               # None: no penalty, nothing counted per token
        if presence_penalty or frequency_penalty or repetition_penalty != 1.0:
            self.penalties = Penalties(float(presence_penalty), float(frequency_penalty),
                                       float(repetition_penalty))
        # tokens never sampled (ignore_eos: the model's EOS ids); None: none
        self.mask = np.asarray(mask, np.int64) if mask else None
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.constraint = constraint        # the grammar's matcher (None: no grammar)

    @property
    def audit_params(self) -> dict:
        """What the audit log records of the sampling (audit.py)."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": self.top_k, "seed": self.seed, "logit_bias": self.bias is not None,
                **self._extra_params()}

    def _extra_params(self) -> dict:
        pen = self.penalties
        out = {"min_p": self.min_p} if self.min_p else {}
        if pen is not None:
            out.update(presence_penalty=pen.presence, frequency_penalty=pen.frequency,
                       repetition_penalty=pen.repetition)
        if self.mask is not None:
            out["mask"] = [int(t) for t in self.mask]
        if self.constraint is not None:             # not replayed (replay.py)
            out["grammar"] = True
        return out

    def __call__(self, logits: np.ndarray) -> int:
        if self.constraint is not None:
            return self._constrained(logits)
        if self.mask is not None:
            if self.temperature == 0.0:              # copied only when it matters
                tok = self._sample(logits)
                if tok not in self.mask:
                    return tok
            logits = np.array(logits, dtype=np.float64)
            logits[self.mask] = -np.inf
        return self._sample(logits)

    def _constrained(self, logits: np.ndarray) -> int:
        """The grammar's tokens only: greedy keeps the unmasked arg-max when the grammar
        allows it (one check, no mask), else everything samples from the masked logits;
        the matcher then takes the token."""
        c = self.constraint
        if c.broken:                              # a plugin's token left the grammar
            return self._sample(logits)
        if self.temperature == 0.0 and self.mask is None:
            tok = self._sample(logits)
            if c.allows(tok):
                c.advance(tok)
                return tok
        x = c.masked(logits)
        if self.mask is not None:
            x[self.mask] = -np.inf
        if not np.isfinite(x.max()):              # nothing allowed: end the sequence
            tok = c.eos if c.eos is not None else int(np.argmax(logits))
        else:
            tok = self._sample(x)
        c.advance(tok)
        return tok

    def _sample(self, logits: np.ndarray) -> int:
        if self.bias is not None:
            logits = np.array(logits, dtype=np.float64)
            logits[self.bias[0]] += self.bias[1]
        if self.penalties is not None:
            if self.bias is None:
                logits = np.array(logits, dtype=np.float64)
            self.penalties.apply(logits)
        if self.temperature == 0.0:      # on the logits as they are: no float64 copy
            return int(np.argmax(logits))
        logits = np.asarray(logits, dtype=np.float64)
        # Shifted so the largest is 0 before dividing: a tiny temperature (1e-308) sends
        # the others to -inf (greedy in effect) instead of overflowing to +inf.
        with np.errstate(over="ignore"):
            z = (logits - logits.max()) / self.temperature
        if 0 < self.top_k < z.size:      # ties at the k-th value are kept
            z = np.where(z >= np.partition(z, -self.top_k)[-self.top_k], z, -np.inf)
        p = ops.softmax(z)
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]  # smallest set >= top_p
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        if self.min_p > 0.0:             # after top-k/top-p, on the tempered distribution
            p = np.where(p >= self.min_p * p.max(), p, 0.0)
            p = p / p.sum()
        return int(self.rng.choice(len(p), p=p))
