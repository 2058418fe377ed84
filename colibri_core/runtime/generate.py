"""Token generation over the scheduler: a Generation is one request, streamed.

The caller's thread iterates a Generation and reads the tokens its sequence (a Decode
job) produced on the scheduler's thread (scheduler.py), where sampling, stop strings,
streaming text and the per-token hooks run, once per step, after the step's forward.
Between two steps (and only there) the engine applies queued expert changes, so every
token is computed with exactly one expert set, whose generation and id are recorded on
the token; a pinned request keeps the snapshot it was admitted with.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import numpy as np

from ..config import EngineConfig, ModelConfig
from .audit import generation_record, routing_of
from .bridge import DONE, LoopQueue
from .events import TokenEvent, TokenTexts, token_logprob
from ..errors import ModelFormatError, RequestError
from ..forward.model import Model
from .sampler import Sampler
from .request import Job, Request, cancel_when_gone
from .scheduler import Scheduler
from .speculative import PromptLookup
from .stops import StopCutter
from .tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("colibri")


class Host(Protocol):
    """What a Generation uses of its engine (engine.Engine is the one host)."""
    model_cfg: ModelConfig
    config: EngineConfig            # speculative_decoding, draft_tokens
    model: Model
    model_dir: Path
    tokenizer: Optional[Tokenizer]
    hooks: Any                      # plugins.HookRelay
    scheduler: Scheduler            # where its request runs


@dataclass
class Generation:
    """Iterate to stream tokens (from any thread; `async for` in an event loop);
    afterwards `stop_reason`, `token_ids`, `text` are set. The request is submitted to
    the engine's scheduler at the first iteration (or start()); closing the iterator,
    close(), or dropping the Generation cancels it."""

    engine: Host
    prompt_ids: list[int]
    k: int
    k_source: str
    max_new_tokens: int
    sampler: Sampler
    stop: list[str]
    pin_experts: bool = False
    request_id: str = ""
    truncated_from: Optional[int] = None
    logprobs: Optional[int] = None          # alternatives per token's log-prob (None: off)
    choice: int = 0                         # the server's choice index, on every event
    stop_reason: Optional[str] = None      # "length" | "eos" | "stop" | "context" | "error"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tail: str = ""              # text after the last token's event (decoder, held back)
    events: list[TokenEvent] = field(default_factory=list)
    _request: Optional["_Stream"] = field(default=None, repr=False)
    _iterated: bool = field(default=False, repr=False)

    @property
    def experts_per_token(self) -> int:
        """k, the experts per token this request runs with (`k_source`: where it came
        from); `k` is the same number."""
        return self.k

    @property
    def speculation(self) -> dict:
        """Speculative decoding's counts so far: `rounds` (steps that fed draft tokens),
        `drafted` (draft tokens fed), `accepted` (of them, emitted); all 0 when off."""
        d = None if self._request is None else self._request.jobs[0]
        return {"rounds": d.rounds if d else 0, "drafted": d.drafted_total if d else 0,
                "accepted": d.accepted_total if d else 0}

    @property
    def expert_set(self) -> Optional[dict]:
        """{generation, id} of the one expert set that computed every token so far
        (always one with pin_experts=True); None before the first token, or when a
        change came between two of its tokens (each TokenEvent names its own)."""
        sets = {(ev.expert_set_generation, ev.expert_set_id) for ev in self.events}
        if len(sets) != 1:
            return None
        g, i = sets.pop()
        return {"generation": g, "id": i}

    @property
    def queue_wait_s(self) -> Optional[float]:
        """Seconds the request waited in the scheduler's queue before admission (None
        until admitted)."""
        return None if self._request is None else self._request.queue_wait_s

    def start(self, sink=None, on_done=None) -> "Generation":
        """Submit the request now (iterating does it otherwise): it starts computing at
        the next step. Raises what submitting raises (EngineClosedError, EngineBusyError
        with when_full="refuse", RequestTooLarge, InsufficientMemoryError). `sink`: an
        event loop's bridge.LoopQueue that gets the token events from the scheduler's
        thread, instead of iteration; `on_done()`: called on
        the scheduler's thread once the request is done."""
        if self._request is None:
            req = _Stream(self)
            req.sink = sink
            if on_done is not None:
                req.on_done.append(on_done)
            self.engine.scheduler.submit(req)
            self._request = req
            cancel_when_gone(self, req)           # dropped unread: its place is freed
        return self

    def close(self) -> None:
        """Cancel the request (it leaves the step, and its KV cache is freed, at the next
        step); idempotent."""
        if self._request is not None:
            self._request.cancel()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._run()

    def __aiter__(self):
        return self._arun()

    def run(self) -> "Generation":
        for _ in self:
            pass
        return self

    def _run(self) -> Iterator[TokenEvent]:
        if self._iterated:
            raise RequestError(f"request {self.request_id}: this Generation was iterated "
                               f"already; call engine.generate() again for a new run")
        self._iterated = True
        self.start()
        req = self._request
        try:
            while True:
                ev = req.next_event()
                if ev is None:
                    break
                self.token_ids.append(ev.token_id)
                self.text += ev.text
                self.events.append(ev)
                yield ev
            self.tail = req.tail
            self.text += req.tail
            self.stop_reason = req.stop_reason
        except Exception:
            self.stop_reason = "error"
            raise
        finally:
            req.cancel()                     # closed or dropped early: retired next step

    async def _arun(self):
        """`async for`: the token events come from the scheduler's thread straight into
        this loop (bridge.LoopQueue); the loop never waits on the engine. Submitting
        runs in a thread (a full queue may make it wait)."""
        if self._iterated:
            raise RequestError(f"request {self.request_id}: this Generation was iterated "
                               f"already; call engine.generate() again for a new run")
        self._iterated = True
        sink = LoopQueue()
        if self._request is None:
            await asyncio.to_thread(self.start, sink, lambda: sink.put(DONE))
        else:
            self._request.attach(sink, lambda: sink.put(DONE))
        req = self._request
        try:
            while True:
                ev = await sink.get()
                if ev is DONE:
                    break
                self.token_ids.append(ev.token_id)
                self.text += ev.text
                self.events.append(ev)
                yield ev
            if req.error is not None:
                raise req.error.with_traceback(None)
            self.tail = req.tail
            self.text += req.tail
            self.stop_reason = req.stop_reason
        except Exception:
            self.stop_reason = "error"
            raise
        finally:
            req.cancel()                     # closed or dropped early: retired next step


class _Stream(Request):
    """A generation's request on the scheduler: one Decode job. Holds no reference to
    its Generation (so that dropping the Generation cancels it)."""

    def __init__(self, gen: Generation):
        super().__init__(gen.request_id)
        eng = gen.engine
        self.hooks = eng.hooks
        self.n_prompt = len(gen.prompt_ids)
        self.k = gen.k
        self.n_tokens = 0
        self.tail = ""
        self.last_set = None            # (generation, id) of its last token's expert set
        ctx = eng.model_cfg.max_position_embeddings
        capacity = max(min(ctx, self.n_prompt + gen.max_new_tokens), self.n_prompt)
        self.jobs = [Decode(self, gen, capacity)]

    def started(self) -> None:
        self.jobs[0].t_prev = time.perf_counter()
        h = self.hooks
        if h is not None and h.request_start is not None:
            h.request_start(request_id=self.id, prompt_tokens=self.n_prompt, k=self.k)

    def ended(self) -> None:
        h = self.hooks
        if h is not None and h.request_end is not None:
            h.request_end(request_id=self.id, n_tokens=self.n_tokens,
                          stop_reason=self.stop_reason)
        d = self.jobs[0]
        if d.audit is not None and d.prompt_routed:     # its line (a dict: written elsewhere)
            d.audit.put(generation_record(self.id, d.tokens, d.sets, d.k, d.out_tokens,
                                          self.stop_reason, routing_of(d.routes, d.k),
                                          d.sampling), [es for _, es in d.sets])


class Decode(Job):
    """A generation's sequence: after its prompt, sample, stream, stop; one token per
    step, or with speculative decoding (EngineConfig.speculative_decoding) the decode
    token and a draft, of which the tokens sampled as plain decoding samples them are
    kept (speculative.py). Runs on the scheduler's thread."""

    decodes = True

    def __init__(self, request: _Stream, gen: Generation, capacity: int):
        super().__init__(request, gen.prompt_ids, gen.k, capacity, pin=gen.pin_experts)
        eng = gen.engine
        self.hooks = eng.hooks
        self.vocab_size = eng.model_cfg.vocab_size
        self.model_dir = eng.model_dir
        self.eos = set(eng.model_cfg.eos_token_ids)
        self.max_new_tokens = gen.max_new_tokens
        self.sampler = gen.sampler
        self.cut = StopCutter(gen.stop)          # stop strings, their starts held back
        self.request_id = gen.request_id
        self.choice = gen.choice
        self.top_n = gen.logprobs                 # log-probs on each event (None: off)
        self.texts = TokenTexts(eng.tokenizer) if gen.logprobs is not None else None
        self.logprob = None                       # the sampled token's, for its event
        self.decoder = StreamDecoder(eng.tokenizer) if eng.tokenizer is not None else None
        self.text = ""
        self.step = 0
        self.t_prev = 0.0
        self._warned_nonfinite = False
        cfg = eng.config
        self.lookup = None                  # the draft (None: plain decoding)
        self.max_draft = cfg.draft_tokens
        if cfg.speculative_decoding == "prompt_lookup" and gen.max_new_tokens > 1:
            self.lookup = PromptLookup(gen.prompt_ids, cfg.draft_ngram_max, cfg.draft_ngram_min)
        self.draft: list[int] = []          # what the running step feeds after `feed`
        self.rounds = self.drafted_total = self.accepted_total = 0
        # the audit log (audit.py): the prompt's routing, the tokens and their sets
        self.audit = getattr(eng, "audit", None)
        self.sink = eng.model.route_sink if self.audit is not None else None
        self.prompt_routed = False
        self.routes: list = []
        self.out_tokens: list[int] = []
        self.sets: list = []                # [(first token index, es)]
        # a caller's own sampler may wrap a Sampler (`inner`) and mask tokens (`mask`)
        inner = getattr(gen.sampler, "inner", gen.sampler)
        # penalties count this sequence's tokens (sampler.py); None: nothing per token
        self.penalties = getattr(inner, "penalties", None)
        if self.penalties is not None:
            self.penalties.start(gen.prompt_ids)
        self.sampling = getattr(inner, "audit_params", None) if self.audit is not None else None
        mask = getattr(gen.sampler, "mask", None)                # ignore_eos: EOS masked
        if self.sampling is not None and mask is not None and "mask" not in self.sampling:
            self.sampling = {**self.sampling, "mask": [int(t) for t in mask]}

    def ready(self) -> bool:
        return self.feed is not None and self.request.backlog < self.request._sched.ahead

    def decode_tokens(self, room: int) -> np.ndarray:
        """The step's tokens: `feed`, then up to `room` draft tokens (none past
        max_new_tokens or the cache's end)."""
        draft = []
        if self.lookup is not None and room > 0:
            limit = min(room, self.max_draft, self.max_new_tokens - self.step - 1,
                        self.cache.capacity - self.cache.length - 1)
            draft = self.lookup.draft(limit)
        self.draft = draft
        if not draft:
            return np.array([self.feed], np.int64)
        return np.array([self.feed] + draft, np.int64)

    def _finish(self, reason: str) -> None:
        req = self.request
        req.stop_reason = reason
        if reason != "stop":      # the decoder's tail and what was held back as a stop's start
            req.tail = self.cut.finish(self.decoder.flush() if self.decoder is not None else "")
        self.done = True

    def after_step(self, logits: np.ndarray, es, final: bool) -> None:
        if self.sink is not None:
            parts = self.sink.take(self.cache)
            if not self.prompt_routed:          # the prompt's chunks; decode rows dropped
                self.routes += parts
                self.prompt_routed = final
        if not final:
            return
        if self.step >= self.max_new_tokens:
            return self._finish("length")
        draft, self.draft = self.draft, []
        if not draft:
            tok = self._sample(logits)
            if self._emit(tok, es) and self._room():
                self.feed = tok
            return
        # logits [1 + len(draft), V]: row i follows draft[:i]; keep sampling while the
        # sampled token is the draft's
        self.rounds += 1
        self.drafted_total += len(draft)
        fed = self.cache.length - len(draft)      # positions up to the decode token's
        for i, row in enumerate(logits):
            tok = self._sample(row)
            if not self._emit(tok, es):
                return
            if i < len(draft) and tok == draft[i]:
                self.accepted_total += 1
                continue
            self.cache.truncate(fed + i)          # drop the rows of rejected tokens
            break
        if self._room():
            self.feed = tok

    def _room(self) -> bool:
        """Whether the cache has a place for the next token (else: finished)."""
        if self.cache.length >= self.cache.capacity:
            self._finish("context")
            return False
        return True

    def _emit(self, tok: int, es) -> bool:
        """One sampled token: EOS, text and stop strings, the event and the token hook.
        -> whether the sequence goes on."""
        if tok in self.eos:
            self._finish("eos")
            return False
        piece = self.decoder.push(tok) if self.decoder is not None else ""
        piece, stop_hit = self.cut.push(piece)
        self.text += piece
        now = time.perf_counter()
        ev = TokenEvent(self.step, tok, piece, es.generation, es.id, now - self.t_prev,
                        self.logprob, self.choice)
        self.t_prev = now
        req = self.request
        req.n_tokens += 1
        req.last_set = (es.generation, es.id)
        if self.penalties is not None:
            self.penalties.push(tok)
        if self.audit is not None:
            self.out_tokens.append(tok)
            if not self.sets or self.sets[-1][1] is not es:
                self.sets.append((self.step, es))
        hooks = self.hooks
        if hooks is not None and hooks.token is not None:
            hooks.token(request_id=self.request_id, step=self.step, token_id=tok, text=piece,
                        expert_set_generation=es.generation, expert_set_id=es.id)
        req.push(ev)
        self.step += 1
        if self.lookup is not None:
            self.lookup.push(tok)
        if stop_hit:
            self._finish("stop")
            return False
        if self.step >= self.max_new_tokens:
            self._finish("length")
            return False
        return True

    def _sample(self, logits: np.ndarray) -> int:
        hooks = self.hooks
        if hooks is not None and hooks.sample is not None:
            got = hooks.sample(logits=logits, request={"id": self.request_id, "k": self.k})
            if got is not None:
                tok = hooks.guard.check_sample(got, self.vocab_size)
                if self.top_n is not None:
                    self.logprob = token_logprob(logits, tok, self.top_n, self.texts)
                return tok
        if not np.isfinite(logits.max()):          # NaN or +Inf somewhere (no temporary array)
            logits = self._finite_logits(logits)
        tok = self.sampler(logits)
        if self.top_n is not None:                 # carried on the token's event
            self.logprob = token_logprob(logits, tok, self.top_n, self.texts)
        return tok

    def _finite_logits(self, logits: np.ndarray) -> np.ndarray:
        """NaN logits never win; +Inf ones always do. All NaN (weights with NaN/Inf, which a
        load does not scan for) is a typed error naming the check to run, not a crash."""
        logits = np.asarray(logits, dtype=np.float64)
        big = np.finfo(np.float64).max / 4
        fixed = np.nan_to_num(logits, nan=-np.inf, posinf=big, neginf=-np.inf)
        if not np.isfinite(fixed).any():
            d = self.model_dir
            raise ModelFormatError(
                f"{d}: the model produced no finite logit at step {self.step} (NaN/Inf in "
                f"its weights?); check it with `colibri inspect {d} --verify`")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("non-finite logits at step %d of %s: NaN ones are never sampled",
                        self.step, self.request_id)
        return fixed
