"""Work run on the engine thread for the OpenAI routes and /v1/score.

Each function takes the runner's JobContext, calls the engine and emits plain events:

    Start(choice, prompt_ids, echo)                 before a choice's first token
    Token(choice, token_id, text, logprob, generation, set_id)
    End(choice, finish_reason, prompt_tokens, completion_tokens)

The HTTP side turns them into SSE chunks or one JSON body (openai_api.py). Log-probs are
those of the model's own distribution (log-softmax of the raw logits, before logit bias,
temperature, top-k and top-p), as OpenAI and vLLM report them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from ..errors import RequestError
from ..ops import log_softmax, softmax
from ..sampler import Sampler

Prompt = Union[str, list]


@dataclass
class GenParams:
    prompts: list                       # each text or a list of token ids
    n: int = 1
    max_tokens: Optional[int] = 16      # None: until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    logit_bias: dict = field(default_factory=dict)
    ignore_eos: bool = False
    logprobs: Optional[int] = None      # None: off; else how many alternatives per token
    echo: bool = False
    experts: Optional[int] = None       # experts per token (None: the engine's choice)


@dataclass
class Start:
    choice: int
    prompt_ids: list
    echo_text: str = ""
    echo_logprobs: Optional[list] = None   # [(token, logprob | None, top | None)] per token


@dataclass
class Token:
    choice: int
    token_id: int
    text: str
    logprob: Optional[tuple]           # (token text, logprob, [(text, logprob), ...])
    generation: int
    set_id: str


@dataclass
class End:
    choice: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


FINISH = {"length": "length", "context": "length", "eos": "stop", "stop": "stop"}


class TokenTexts:
    """id -> the token's own text (special tokens shown), cached."""

    def __init__(self, engine):
        self.tok = engine.tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, i: int) -> str:
        s = self.cache.get(i)
        if s is None:
            s = self.tok.token_text(i) if self.tok is not None else str(i)
            self.cache[i] = s
        return s


def _entry(lp: np.ndarray, tok: int, top_n: int, texts: TokenTexts) -> tuple:
    top = []
    if top_n > 0:
        idx = np.argpartition(-lp, min(top_n, lp.size - 1))[:top_n]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(texts(int(i)), float(lp[i])) for i in idx]
    return texts(tok), float(lp[tok]), top


class RecordingSampler:
    """The request's Sampler, plus: EOS masked (ignore_eos), log-probs recorded."""

    def __init__(self, inner: Sampler, top_n: Optional[int], mask: list[int],
                 texts: TokenTexts):
        self.inner = inner
        self.top_n = top_n
        self.mask = np.asarray(mask, np.int64) if mask else None
        self.texts = texts
        self.records: list[tuple] = []

    def __call__(self, logits: np.ndarray) -> int:
        tok = self.inner(logits) if self.mask is None or self.inner.temperature == 0.0 \
            else None
        if tok is None or (self.mask is not None and tok in self.mask):
            masked = np.array(logits, dtype=np.float64)    # copied only when it matters
            masked[self.mask] = -np.inf
            tok = self.inner(masked)
        if self.top_n is not None:
            self.records.append(_entry(log_softmax(logits), tok,
                                       self.top_n, self.texts))
        return tok


def prompt_logprobs(engine, ids: list, k: Optional[int], top_n: int, texts: TokenTexts) -> list:
    """Echo log-probs: the first token has none; token i's is from position i-1."""
    logits = engine.next_token_logits(ids, top_k=k, all_positions=True)
    lp = log_softmax(logits)
    out = [(texts(ids[0]), None, None)]
    for i in range(1, len(ids)):
        out.append(_entry(lp[i - 1], ids[i], top_n, texts))
    return out


def run_generation(ctx, p: GenParams, book) -> dict:
    """All choices of a completion request, one after the other (choice = prompt*n + i)."""
    eng = ctx.engine
    texts = TokenTexts(eng)
    eos = list(eng.model_cfg.eos_token_ids) if p.ignore_eos else []
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for pi, prompt in enumerate(p.prompts):
        for i in range(p.n):
            ctx.check()
            choice = pi * p.n + i
            seed = None if p.seed is None else p.seed + i
            try:
                inner = Sampler(p.temperature, p.top_p, seed, top_k=p.top_k,
                                logit_bias=p.logit_bias)
            except (TypeError, ValueError) as e:
                raise RequestError(f"sampling settings: {e}") from None
            sampler = RecordingSampler(inner, p.logprobs, eos, texts)
            rid = ctx.request_id if len(p.prompts) * p.n == 1 else f"{ctx.request_id}.{choice}"
            n_new = eng.model_cfg.max_position_embeddings if p.max_tokens is None \
                else p.max_tokens          # the engine stops at the context's end anyway
            gen = eng.generate(prompt, max_new_tokens=n_new, top_k=p.experts, stop=[],
                               sampler=sampler, request_id=rid)
            ids = gen.prompt_ids
            start = Start(choice, ids)
            if p.echo:
                start.echo_text = _echo_text(eng, prompt, ids)
                if p.logprobs is not None:
                    start.echo_logprobs = prompt_logprobs(eng, ids, gen.k, p.logprobs, texts)
            ctx.emit(start)
            n_out, reason = 0, "length"
            if gen.max_new_tokens > 0:
                cut = StopCutter(p.stop)
                it = iter(gen)
                try:
                    for ev in it:
                        rec = sampler.records[ev.step] if p.logprobs is not None else None
                        g, sid = ev.expert_set_generation, ev.expert_set_id
                        text, hit = cut.push(ev.text)
                        ctx.emit(Token(choice, ev.token_id, text, rec, g, sid))
                        n_out += 1
                        if hit:
                            reason = "stop"
                            break
                        ctx.check()
                finally:
                    it.close()            # the generation's own cleanup (hooks, gc)
                if reason != "stop":
                    # text held back by the UTF-8 decoder or as a possible stop's start
                    tail = cut.finish(gen.text[len(cut.text):])
                    if tail:
                        g, sid = book.stamp()
                        ctx.emit(Token(choice, -1, tail, None, g, sid))
                    reason = FINISH.get(gen.stop_reason or "length", "stop")
            ctx.emit(End(choice, reason, len(ids), n_out))
            usage["prompt_tokens"] += len(ids)
            usage["completion_tokens"] += n_out
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


class StopCutter:
    """Stop strings over streamed text: text that may be the start of a stop string is
    held back until it is known not to be one, so the client never sees any part of
    the stop string (which may straddle tokens)."""

    def __init__(self, stops: list):
        self.stops = stops
        self.text = ""            # everything the tokens decoded to
        self.sent = 0             # characters of it passed on

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        if not self.stops:
            self.sent = len(self.text)
            return piece, False
        longest = max(map(len, self.stops))
        start = max(0, self.sent - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.sent = self.text[self.sent:end], max(self.sent, end)
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def finish(self, tail: str) -> str:
        """The held-back text (and the decoder's tail) once no stop string followed."""
        self.text += tail
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _echo_text(eng, prompt, ids) -> str:
    if isinstance(prompt, str):
        from ..kselect import split_mode_prefix
        return split_mode_prefix(prompt)[1]
    return eng.tokenizer.decode(ids) if eng.tokenizer is not None else ""


# ----------------------------------------------------------------------------- scoring

@dataclass
class ScoreItem:
    prompt_ids: list
    candidates: list          # list of token-id lists (the continuations)
    labels: list              # what the client sent for each candidate (text or ids)


def run_score(ctx, items: list, experts: Optional[int], book, max_batch_tokens: int) -> dict:
    """Log-probs of each item's candidate continuations: all sequences (prompt +
    candidate) go through engine.score_batch in as few batches as max_batch_tokens allows."""
    eng = ctx.engine
    seqs = [(ii, ci, it.prompt_ids + cand) for ii, it in enumerate(items)
            for ci, cand in enumerate(it.candidates)]
    sums: dict = {}
    per_tok: dict = {}
    batch: list = []
    tokens = 0
    g, sid = book.stamp()
    generations = set()

    def flush():
        nonlocal batch, tokens
        if not batch:
            return
        ctx.check()
        outs = eng.score_batch([s for _, _, s in batch], top_k=experts, all_positions=True)
        generations.add(book.stamp())
        for (ii, ci, seq), logits in zip(batch, outs):
            start = len(items[ii].prompt_ids)
            lp = log_softmax(np.asarray(logits)[start - 1:len(seq) - 1])
            tok = np.asarray(seq[start:])
            vals = lp[np.arange(tok.size), tok]
            per_tok[ii, ci] = [float(v) for v in vals]
            sums[ii, ci] = float(vals.sum())
        batch, tokens = [], 0

    for s in seqs:
        if batch and tokens + len(s[2]) > max_batch_tokens:
            flush()
        batch.append(s)
        tokens += len(s[2])
    flush()
    results = []
    for ii, it in enumerate(items):
        tot = np.array([sums[ii, ci] for ci in range(len(it.candidates))])
        norm = softmax(tot)
        results.append({"index": ii, "prompt_tokens": len(it.prompt_ids), "candidates": [
            {"index": ci, "candidate": it.labels[ci], "tokens": list(map(int, cand)),
             "token_logprobs": per_tok[ii, ci], "logprob": sums[ii, ci],
             "n_tokens": len(cand), "probability": float(norm[ci])}
            for ci, cand in enumerate(it.candidates)]})
    gens = sorted(generations) or [(g, sid)]
    return {"results": results, "expert_sets": [{"generation": a, "id": b} for a, b in gens],
            "usage": {"prompt_tokens": sum(len(s) for _, _, s in seqs), "total_tokens":
                      sum(len(s) for _, _, s in seqs)}}
