"""Work of the OpenAI routes and /v1/score.

Each function runs in its request's own thread (calls.py), takes its CallContext, calls
the engine (shared with every other request: its scheduler batches them) and emits plain
events:

    Start(choice, prompt_ids, echo)                 before a choice's first token
    Token(choice, token_id, text, logprob, generation, set_id)
    End(choice, finish_reason, prompt_tokens, completion_tokens)

The HTTP side turns them into SSE chunks or one JSON body (openai_api.py). Log-probs are
those of the model's own distribution (log-softmax of the raw logits, before logit bias,
temperature, top-k and top-p), as OpenAI and vLLM report them.
"""
from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from ..errors import EngineBusyError, RequestCancelled, RequestError
from ..model.ops import log_softmax, softmax
from ..runtime.sampler import Sampler
from . import surface

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    return_token_ids: bool = False      # token_ids and prompt_token_ids on each choice
    ctx_size: Optional[int] = None      # the server's per-request context (--ctx-size)


@dataclass
class Start:
    choice: int
    prompt_ids: list
    echo_text: str = ""
    echo_logprobs: Optional[list] = None   # [(token, logprob | None, top | None)] per token
    echo_offsets: Optional[list] = None    # where each prompt token starts in echo_text


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


class _Choice:
    """One choice of a completion request: its Generation and its stream's state."""

    def __init__(self, index: int, gen, sampler: RecordingSampler, stops: list):
        self.index = index
        self.gen = gen
        self.sampler = sampler
        self.cut = StopCutter(stops)
        self.it = None                # the Generation's iterator, once submitted
        self.n_out = 0


def run_generation(ctx, p: GenParams, book) -> dict:
    """All choices of a completion request (choice = prompt*n + i), submitted together so
    that they share the engine's steps, and read in turn (each is at most a few tokens
    ahead of its reader). Only the first choice's submission may be refused (the queue is
    full: EngineBusyError, 429); later ones that find the queue full are submitted again
    as the request goes on (its other choices read meanwhile)."""
    eng = ctx.engine
    texts = TokenTexts(eng)
    eos = list(eng.model_cfg.eos_token_ids) if p.ignore_eos else []
    many = len(p.prompts) * p.n > 1
    n_new = eng.model_cfg.max_position_embeddings if p.max_tokens is None \
        else p.max_tokens          # the engine stops at the context's end anyway

    def choice(pi: int, i: int) -> _Choice:
        index = pi * p.n + i
        seed = None if p.seed is None else p.seed + i
        try:
            inner = Sampler(p.temperature, p.top_p, seed, top_k=p.top_k,
                            logit_bias=p.logit_bias, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty,
                            repetition_penalty=p.repetition_penalty, min_p=p.min_p)
        except (TypeError, ValueError) as e:
            raise RequestError(f"sampling settings: {e}") from None
        sampler = RecordingSampler(inner, p.logprobs, eos, texts)
        rid = f"{ctx.request_id}.{index}" if many else ctx.request_id
        # pinned: a choice is computed under one expert set, the one it names
        gen = eng.generate(p.prompts[pi], max_new_tokens=n_new, top_k=p.experts, stop=[],
                           sampler=sampler, request_id=rid, pin_experts=True)
        surface.fit_context(gen, p.ctx_size)          # --ctx-size
        return _Choice(index, gen, sampler, p.stop)
    # Each prompt's first choice gives its length: the answer's size is checked before
    # the other choices (and any echo) cost anything.
    firsts = [choice(pi, 0) for pi in range(len(p.prompts))]
    _check_answer_size(eng, p, firsts)
    choices = [firsts[pi] if i == 0 else choice(pi, i)
               for pi in range(len(p.prompts)) for i in range(p.n)]
    echoed: dict = {}                 # a prompt's echo, computed once for its n choices
    for c in choices:
        gen, pi = c.gen, c.index // p.n
        start = Start(c.index, gen.prompt_ids)
        if p.echo:
            if pi not in echoed:
                lps = prompt_logprobs(eng, gen.prompt_ids, gen.k, p.logprobs, texts) \
                    if p.logprobs is not None else None
                text = surface.echo_text(eng, p.prompts[pi], gen.prompt_ids)
                offs = surface.echo_offsets(eng, gen.prompt_ids, text) \
                    if lps is not None else None
                echoed[pi] = (text, lps, offs)
            start.echo_text, start.echo_logprobs, start.echo_offsets = echoed[pi]
        ctx.emit(start)
    usage = {"prompt_tokens": sum(len(c.gen.prompt_ids) for c in choices),
             "completion_tokens": 0}
    pending = [c for c in choices if c.gen.max_new_tokens > 0]
    for c in choices:
        if c.gen.max_new_tokens == 0:
            ctx.emit(End(c.index, "length", len(c.gen.prompt_ids), 0))
    active: list = []
    _submit(ctx, pending, active, first=True)
    if len(active) == 1 and not pending:          # one choice: read here
        c = active[0]
        while not _advance(ctx, c, p, book):
            pass
        usage["completion_tokens"] = c.n_out
    else:
        usage["completion_tokens"] = _read_choices(ctx, p, book, pending, active)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


def _check_answer_size(eng, p: GenParams, firsts: list) -> None:
    """413 before any token is computed when the answer would be over the server's
    bound: each choice's tokens (max_tokens, or what the context leaves; the echoed
    prompt's too), each counting 1 + its log-prob alternatives. `firsts`: each
    prompt's first choice (its n choices have the same prompt)."""
    from .limits import check_answer
    ctx_len = eng.model_cfg.max_position_embeddings
    per = 1 + (p.logprobs or 0)
    units = 0
    for c in firsts:
        n_prompt = len(c.gen.prompt_ids)
        units += (min(c.gen.max_new_tokens, max(ctx_len - n_prompt, 0))
                  + (n_prompt if p.echo else 0)) * per * p.n
    check_answer(units, f"{len(p.prompts)} prompt(s) x n {p.n}")


def _read_choices(ctx, p: GenParams, book, pending: list, active: list) -> int:
    """Several choices: each read by a thread of its own (a reader that waited on one
    choice would pause the others, a few tokens ahead, and one waiting for admission
    could wait for them); this thread submits the pending ones as places free up."""
    ended: queue.Queue = queue.Queue()

    def read(c: _Choice) -> None:
        try:
            while not _advance(ctx, c, p, book):
                pass
            ended.put((c, None))
        except BaseException as e:  # noqa: BLE001 - raised by the request's thread
            ended.put((c, e))

    def spawn(cs) -> None:
        for c in cs:
            threading.Thread(target=read, args=(c,), daemon=True,
                             name=f"colibri-choice-{ctx.request_id}.{c.index}").start()
    spawn(active)
    running, n_out = len(active), 0
    while running or pending:
        if pending:
            fresh: list = []
            _submit(ctx, pending, fresh, first=False)
            spawn(fresh)
            running += len(fresh)
        try:
            c, err = ended.get(timeout=0.05 if pending else 1.0)
        except queue.Empty:
            ctx.check()
            continue
        running -= 1
        if err is not None:
            ctx.cancel("failed")          # the other choices stop too
            raise err
        n_out += c.n_out
    return n_out


def _submit(ctx, pending: list, active: list, first: bool) -> None:
    """Submit pending choices in order until the engine's queue is full."""
    while pending:
        c = pending[0]
        try:
            c.gen.start()
        except EngineBusyError:
            if first and not active:
                raise
            return
        ctx.track(c.gen)
        c.it = iter(c.gen)
        active.append(pending.pop(0))


def _advance(ctx, c: _Choice, p: GenParams, book) -> bool:
    """Read one token of choice `c` (blocking) and emit it; True when the choice ended
    (its End emitted)."""
    ev = next(c.it, None)
    ctx.check()                       # a cancelled generation ends early: not an End
    gen = c.gen
    if ev is not None:
        rec = c.sampler.records[ev.step] if p.logprobs is not None else None
        text, hit = c.cut.push(ev.text)
        ctx.emit(Token(c.index, ev.token_id, text, rec, ev.expert_set_generation,
                       ev.expert_set_id))
        c.n_out += 1
        if not hit:
            return False
        c.it.close()                  # the generation's own cleanup (hooks, its KV)
        reason = "stop"
    else:
        # text held back by the UTF-8 decoder or as a possible stop's start
        tail = c.cut.finish(gen.text[len(c.cut.text):])
        if tail:
            g, sid = (gen.events[-1].expert_set_generation, gen.events[-1].expert_set_id) \
                if gen.events else book.stamp()
            ctx.emit(Token(c.index, -1, tail, None, g, sid))
        reason = FINISH.get(gen.stop_reason or "length", "stop")
    ctx.emit(End(c.index, reason, len(gen.prompt_ids), c.n_out))
    return True


class StopCutter:
    """Stop strings over streamed text: text that may be the start of a stop string is
    held back until it is known not to be one, so the client never sees any part of
    the stop string (which may straddle tokens). Each stop string is matched by a
    Knuth-Morris-Pratt automaton fed each new character once: time linear in the text,
    whatever the stop strings' length (params.py bounds their number and length)."""

    def __init__(self, stops: list):
        self.stops = stops
        self.tables = [_kmp_table(x) for x in stops]
        self.states = [0] * len(stops)   # per stop: the longest suffix of text that is its prefix
        self.text = ""            # everything the tokens decoded to
        self.sent = 0             # characters of it passed on

    def push(self, piece: str) -> tuple[str, bool]:
        base = len(self.text)
        self.text += piece
        if not self.stops:
            self.sent = len(self.text)
            return piece, False
        hits = []
        for n, (stop, table) in enumerate(zip(self.stops, self.tables)):
            k = self.states[n]
            for i, ch in enumerate(piece):
                while k and ch != stop[k]:
                    k = table[k - 1]
                if ch == stop[k]:
                    k += 1
                    if k == len(stop):         # its first occurrence: where it starts
                        hits.append(base + i + 1 - k)
                        break
            self.states[n] = k
        if hits:
            end = min(hits)
            out, self.sent = self.text[self.sent:end], max(self.sent, end)
            return out, True
        hold = max(self.states)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def finish(self, tail: str) -> str:
        """The held-back text (and the decoder's tail) once no stop string followed."""
        self.text += tail
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@functools.lru_cache(maxsize=64)
def _kmp_table(stop: str) -> tuple:
    """table[i]: the longest proper prefix of stop[:i+1] that is also its suffix."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


# ----------------------------------------------------------------------------- scoring

@dataclass
class ScoreItem:
    prompt_ids: list
    candidates: list          # list of token-id lists (the continuations)
    labels: list              # what the client sent for each candidate (text or ids)


def score_items(eng, raw: list) -> list:
    """The request's items ({prompt, candidates}, checked) -> ScoreItems."""
    return [_score_item(eng, x, i) for i, x in enumerate(raw)]


def _score_item(eng, x, i: int) -> ScoreItem:
    """{prompt, candidates} -> token ids: a text candidate's tokens are
    tokenize(prompt + candidate) minus tokenize(prompt), as scoring harnesses count them."""
    if not isinstance(x, dict):
        raise RequestError(f"items[{i}]: expected an object {{prompt, candidates}}")
    prompt, cands = x.get("prompt"), x.get("candidates")
    if not isinstance(cands, list) or not cands:
        raise RequestError(f"items[{i}].candidates: expected a non-empty list")
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"items[{i}].prompt: empty text")
        pids = eng.encode(prompt)
    elif isinstance(prompt, list) and prompt:
        pids = eng.prepare_ids(prompt, reserve=0)[0]
    else:
        raise RequestError(f"items[{i}].prompt: expected text or a non-empty list of token ids")
    ctx = eng.model_cfg.max_position_embeddings
    out = []
    for j, c in enumerate(cands):
        if isinstance(c, str):
            if not isinstance(prompt, str):
                raise RequestError(f"items[{i}].candidates[{j}]: a text candidate needs a "
                                   f"text prompt")
            ids = eng.encode(prompt + c)[len(pids):]
        elif isinstance(c, list):
            ids = eng.prepare_ids(c, reserve=0)[0] if c else []
        else:
            raise RequestError(f"items[{i}].candidates[{j}]: expected text or token ids")
        if not ids:
            raise RequestError(f"items[{i}].candidates[{j}]: no tokens after the prompt")
        if len(pids) + len(ids) > ctx:
            raise RequestError(f"items[{i}].candidates[{j}]: {len(pids) + len(ids)} tokens "
                               f"with the prompt, over the model's context of {ctx}")
        out.append(ids)
    return ScoreItem(pids, out, list(cands))



def run_score(ctx, items: list, experts: Optional[int], book) -> dict:
    """Log-probs of each item's candidate continuations: all sequences (prompt +
    candidate) in one engine.score_batch, which the scheduler runs in as few steps as
    max_step_tokens (max_batch_tokens while no stream decodes) allows, sharing them with
    the other requests' sequences. A disconnect or the timeout cancels it: its
    sequences leave the engine at the next step."""
    eng = ctx.engine
    seqs = [(ii, ci, it.prompt_ids + cand) for ii, it in enumerate(items)
            for ci, cand in enumerate(it.candidates)]
    sums: dict = {}
    per_tok: dict = {}
    ctx.check()
    try:        # an item's candidates run under one expert set, the one its result names
        scored = eng.score([s for _, _, s in seqs], top_k=experts, all_positions=True,
                           track=ctx.track, request_id=ctx.request_id,
                           groups=[ii for ii, _, _ in seqs])
    except RequestCancelled:
        ctx.check()                  # why it was cancelled: disconnect, timeout, shutdown
        raise
    ctx.check()
    outs = [x.logits for x in scored]
    item_set = {ii: x.expert_set for (ii, _, _), x in zip(seqs, scored)}
    for (ii, ci, seq), logits in zip(seqs, outs):
        start = len(items[ii].prompt_ids)
        lp = log_softmax(np.asarray(logits)[start - 1:len(seq) - 1])
        tok = np.asarray(seq[start:])
        vals = lp[np.arange(tok.size), tok]
        per_tok[ii, ci] = [float(v) for v in vals]
        sums[ii, ci] = float(vals.sum())
    results = []
    for ii, it in enumerate(items):
        tot = np.array([sums[ii, ci] for ci in range(len(it.candidates))])
        norm = softmax(tot)
        results.append({"index": ii, "prompt_tokens": len(it.prompt_ids),
                        "expert_set": item_set[ii], "candidates": [
            {"index": ci, "candidate": it.labels[ci], "tokens": list(map(int, cand)),
             "token_logprobs": per_tok[ii, ci], "logprob": sums[ii, ci],
             "n_tokens": len(cand), "probability": float(norm[ci])}
            for ci, cand in enumerate(it.candidates)]})
    # expert_sets (deprecated, one release): the distinct sets of the items
    gens = sorted({(x["generation"], x["id"]) for x in item_set.values()})
    return {"results": results, "expert_sets": [{"generation": a, "id": b} for a, b in gens],
            "usage": {"prompt_tokens": sum(len(s) for _, _, s in seqs), "total_tokens":
                      sum(len(s) for _, _, s in seqs)}}
