"""What a request's stream carries, from the scheduler's thread to any reader (the
Python API, the server's routes, a fleet replica): the one event vocabulary.

    Start(choice, prompt_ids, echo...)      before a choice's first token (the server)
    TokenEvent(step, token_id, text, ...)   one generated token, with its expert set, its
                                            latency and (asked for) its log-prob
    End(choice, finish_reason, ...)         a choice ended (the server)

A token's log-prob is computed on the scheduler's thread with the token, and travels on
its event (`logprob`): (token text, logprob, [(text, logprob), ...] of the top
alternatives), of the model's own distribution (log-softmax of the raw logits, before
logit bias, penalties, temperature, top-k and top-p), as OpenAI and vLLM report it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..model.ops import log_softmax


@dataclass(frozen=True)
class TokenEvent:
    step: int                  # 0-based index of the generated token (-1: held-back text)
    token_id: int              # -1: text with no token of its own (the held-back tail)
    text: str                  # new text this token completed (may be "")
    expert_set_generation: int  # the expert set the token was computed with: its counter
    expert_set_id: str          # ... and its digest (expertset.expert_set_id)
    latency_s: float = 0.0     # time from the previous token (or the request's admission)
    logprob: Optional[tuple] = None   # (text, logprob, [(text, logprob), ...]) when asked
    choice: int = 0            # which choice of a request of several (the server's n)

    @property
    def expert_set(self) -> dict:
        """{generation, id} of the set that computed the token: the one name used
        everywhere (expert_set_generation / expert_set_id are its two parts)."""
        return {"generation": self.expert_set_generation, "id": self.expert_set_id}


@dataclass
class Start:
    choice: int
    prompt_ids: list
    echo_text: str = ""
    echo_logprobs: Optional[list] = None   # [(token, logprob | None, top | None)] per token
    echo_offsets: Optional[list] = None    # where each prompt token starts in echo_text


@dataclass
class End:
    choice: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class TokenTexts:
    """id -> the token's own text (special tokens shown), cached."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, i: int) -> str:
        s = self.cache.get(i)
        if s is None:
            s = self.tok.token_text(i) if self.tok is not None else str(i)
            self.cache[i] = s
        return s


def logprob_entry(lp: np.ndarray, tok: int, top_n: int, texts: TokenTexts) -> tuple:
    """(text, logprob, [(text, logprob)] of the top_n) of token `tok` under log-probs `lp`."""
    top = []
    if top_n > 0:
        idx = np.argpartition(-lp, min(top_n, lp.size - 1))[:top_n]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(texts(int(i)), float(lp[i])) for i in idx]
    return texts(tok), float(lp[tok]), top


def token_logprob(logits: np.ndarray, tok: int, top_n: int, texts: TokenTexts) -> tuple:
    return logprob_entry(log_softmax(logits), tok, top_n, texts)
