"""Work of the OpenAI routes and /v1/score.

Each function runs in its request's own thread (calls.py), takes its Call (`ctx`), calls
the engine (shared with every other request: its scheduler batches them) and emits the
stream's events (runtime/events.py, the one vocabulary):

    Start(choice, prompt_ids, echo)                 before a choice's first token
    TokenEvent(step, token_id, text, set, latency, logprob, choice)   as the engine made it
    End(choice, finish_reason, prompt_tokens, completion_tokens)

The HTTP side turns them into SSE chunks or one JSON body (responses.py). Stop strings
are cut, and log-probs computed, on the scheduler's thread (runtime/stops.py,
runtime/events.py): a token event arrives here as the client gets it.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from ..errors import RequestCancelled, RequestError
from ..model.ops import log_softmax, softmax
from ..runtime.events import End, Start, TokenEvent, TokenTexts, logprob_entry
from ..runtime.generate import submit
from ..runtime.sampler import SamplingParams
from . import surface

Prompt = Union[str, list]


@dataclass
class GenParams:
    """A completion request as the routes checked it: its prompts, how many choices and
    tokens, the sampling (one SamplingParams, the Python API's), k, what to return."""
    prompts: list                       # each text or a list of token ids
    n: int = 1
    max_tokens: Optional[int] = 16      # None: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list = field(default_factory=list)
    echo: bool = False
    experts_per_token: Optional[int] = None   # None: the engine's choice (kselect.py)
    return_token_ids: bool = False      # token_ids and prompt_token_ids on each choice
    ctx_size: Optional[int] = None      # the server's per-request context (--ctx-size)
    stop_token_ids: tuple = ()          # end the answer as EOS does (harmony's <|call|>)

    @property
    def logprobs(self) -> Optional[int]:
        return self.sampling.logprobs


FINISH = {"length": "length", "context": "length", "eos": "stop", "stop": "stop"}


def prompt_logprobs(engine, ids: list, k: Optional[int], top_n: int, texts: TokenTexts) -> list:
    """Echo log-probs: the first token has none; token i's is from position i-1."""
    logits = engine.next_token_logits(ids, experts_per_token=k, all_positions=True)
    lp = log_softmax(logits)
    out = [(texts(ids[0]), None, None)]
    for i in range(1, len(ids)):
        out.append(logprob_entry(lp[i - 1], ids[i], top_n, texts))
    return out


def run_generation(ctx, p: GenParams, book) -> dict:
    """All choices of a completion request (choice = prompt*n + i) as one request to the
    engine (runtime.generate.submit): each prompt tokenized and its k chosen once, one
    submission (refused whole when the engine's queue is full: EngineBusyError, 429),
    one memory check; the choices share the engine's steps and stream their token events
    (each with its `choice`) from the scheduler's thread to the event loop, each at most
    a few tokens ahead of the loop's reader; a failure of one fails them all."""
    eng = ctx.engine
    texts = TokenTexts(eng.tokenizer)
    many = len(p.prompts) * p.n > 1
    n_new = eng.model_cfg.max_position_embeddings if p.max_tokens is None \
        else p.max_tokens          # the engine stops at the context's end anyway

    def sampling(i: int) -> SamplingParams:
        seed = p.sampling.seed
        return p.sampling if seed is None else p.sampling.with_seed(seed + i)

    def rid(index: int) -> str:
        return f"{ctx.request_id}.{index}" if many else ctx.request_id

    firsts = []         # each prompt's first choice: tokenized, k chosen
    for pi, prompt in enumerate(p.prompts):
        # pinned: a choice is computed under one expert set, the one it names
        gen = eng.generate(prompt, max_new_tokens=n_new, experts_per_token=p.experts_per_token,
                           sampling=sampling(0), stop=p.stop, request_id=rid(pi * p.n),
                           pin_experts=True)
        surface.fit_context(gen, p.ctx_size)          # --ctx-size
        gen.stop_token_ids = tuple(p.stop_token_ids)
        firsts.append(gen)
    # the answer's size is checked before the other choices (and any echo) cost anything
    _check_answer_size(eng, p, firsts)
    choices = []
    for pi, first in enumerate(firsts):
        for i in range(p.n):
            gen = first if i == 0 else first.another(sampling(i), rid(pi * p.n + i))
            gen.choice = pi * p.n + i                 # on each of its events
            choices.append(gen)
    echoed: dict = {}                 # a prompt's echo, computed once for its n choices
    for gen in choices:
        pi = gen.choice // p.n
        start = Start(gen.choice, gen.prompt_ids)
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
    usage = {"prompt_tokens": sum(len(c.prompt_ids) for c in choices),
             "completion_tokens": 0}
    pending = [c for c in choices if c.max_new_tokens > 0]
    for c in choices:
        if c.max_new_tokens == 0:
            ctx.emit(End(c.choice, "length", len(c.prompt_ids), 0))
    if pending:
        usage["completion_tokens"] = _stream_choices(ctx, book, pending)
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
        n_prompt = len(c.prompt_ids)
        units += (min(c.max_new_tokens, max(ctx_len - n_prompt, 0))
                  + (n_prompt if p.echo else 0)) * per * p.n
    check_answer(units, f"{len(p.prompts)} prompt(s) x n {p.n}")


def _stream_choices(ctx, book, choices: list) -> int:
    """Submit the choices as one request, their token events going from the scheduler's
    thread straight to the call's event loop (ctx.sink: no thread between them); this
    thread waits and, as each choice ends, emits its held-back text and its End (after
    its last token: the loop gets them in that order). -> completion tokens."""
    ended: queue.Queue = queue.Queue()
    req = submit(choices, ctx.request_id, sink=ctx.sink, on_choice_end=ended.put,
                 on_done=lambda: ended.put(None))
    ctx.track(req)
    left, n_out = len(choices), 0
    while True:
        try:
            job = ended.get(timeout=1.0)
        except queue.Empty:
            ctx.check()
            continue
        ctx.check()                   # a cancelled request ends early: no End
        if job is None:               # the request is done (retired: its hooks ran)
            break
        n_out += _end(ctx, job, book)
        left -= 1
    if req.error is not None:
        raise req.error.with_traceback(None)
    if left:
        raise RequestCancelled(f"request {req.id}: cancelled before its choices ended")
    return n_out


def _end(ctx, job, book) -> int:
    """A choice (its Decode job) ended: its held-back text and its End. -> its tokens."""
    if job.tail:                      # held back by the UTF-8 decoder or as a stop's start
        g, sid = job.last_set if job.last_set is not None else book.stamp()
        ctx.emit(TokenEvent(-1, -1, job.tail, g, sid, choice=job.choice))
    ctx.emit(End(job.choice, FINISH.get(job.stop_reason or "length", "stop"),
                 len(job.tokens), job.n_tokens))
    return job.n_tokens


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
        scored = eng.score([s for _, _, s in seqs], experts_per_token=experts, all_positions=True,
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
    if eng.candidates is not None:   # the candidates' gates and shadow pass (never returned)
        from .candidates import after_score
        after_score(eng, items, seqs, scored, ctx.request_id, experts)
    # expert_sets (deprecated, one release): the distinct sets of the items
    gens = sorted({(x["generation"], x["id"]) for x in item_set.values()})
    return {"results": results, "expert_sets": [{"generation": a, "id": b} for a, b in gens],
            "usage": {"prompt_tokens": sum(len(s) for _, _, s in seqs), "total_tokens":
                      sum(len(s) for _, _, s in seqs)}}
