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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import numpy as np

from ..config import EngineConfig, ModelConfig
from .audit import generation_record, routing_of
from ..errors import ModelFormatError, RequestError
from ..forward.model import Model
from .sampler import Sampler
from .scheduler import Job, Request, Scheduler, cancel_when_gone
from .speculative import PromptLookup
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


@dataclass(frozen=True)
class TokenEvent:
    step: int                  # 0-based index of the generated token
    token_id: int
    text: str                  # new text this token completed (may be "")
    expert_set_generation: int  # the expert set the token was computed with: its counter
    expert_set_id: str          # ... and its digest (expertset.expert_set_id)
    latency_s: float           # time from the previous token (or the request's admission)

    @property
    def expert_set(self) -> dict:
        """{generation, id} of the set that computed the token: the one name used
        everywhere (expert_set_generation / expert_set_id are its two parts)."""
        return {"generation": self.expert_set_generation, "id": self.expert_set_id}


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
    stop_reason: Optional[str] = None      # "length" | "eos" | "stop" | "context" | "error"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    events: list[TokenEvent] = field(default_factory=list)
    _request: Optional["_Stream"] = field(default=None, repr=False)
    _iterated: bool = field(default=False, repr=False)

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

    def start(self) -> "Generation":
        """Submit the request now (iterating does it otherwise): it starts computing at
        the next step. Raises what submitting raises (EngineClosedError, EngineBusyError
        with when_full="refuse", RequestTooLarge, InsufficientMemoryError)."""
        if self._request is None:
            req = _Stream(self)
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
        return _AsyncTokens(self._run())

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
            self.text += req.tail
            self.stop_reason = req.stop_reason
        except Exception:
            self.stop_reason = "error"
            raise
        finally:
            req.cancel()                     # closed or dropped early: retired next step


class _AsyncTokens:
    """`async for ev in generation`: a thread of its own waits for each token and hands
    it to the event loop. Not the loop's default executor: streams waiting for admission
    would hold all of its few threads, and the running streams' readers, queued behind
    them, would never be served (the scheduler pauses a stream its reader does not take
    tokens from: a deadlock). The thread fetches a token only when one is asked for, so
    an abandoned iteration stops its stream as a stopped reader does."""

    def __init__(self, it: Iterator[TokenEvent]):
        self._box = _Pump(it)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        kind, value = await self._box.take(asyncio.get_running_loop())
        if kind == "event":
            return value
        if kind == "error":
            raise value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._box.stop()

    def __del__(self):                      # abandoned: let the thread end the stream
        self._box.stop()


class _Pump:
    """The thread behind _AsyncTokens (holds the iterator, not the _AsyncTokens)."""

    def __init__(self, it: Iterator[TokenEvent]):
        self._it = it
        self._want = threading.Semaphore(0)
        self._stopped = False
        self._thread: Optional[threading.Thread] = None
        self._loop = None
        self._future = None

    def take(self, loop) -> "asyncio.Future":
        self._loop = loop
        self._future = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="colibri-async-stream",
                                            daemon=True)
            self._thread.start()
        self._want.release()
        return self._future

    def stop(self) -> None:
        self._stopped = True
        self._want.release()

    def _deliver(self, kind: str, value) -> None:
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result((kind, value))

    def _run(self) -> None:
        try:
            while True:
                self._want.acquire()
                if self._stopped:
                    break
                try:
                    ev = next(self._it, None)
                except BaseException as exc:        # noqa: BLE001 - handed to the reader
                    self._loop.call_soon_threadsafe(self._deliver, "error", exc)
                    break
                self._loop.call_soon_threadsafe(self._deliver, "event" if ev is not None else "end", ev)
                if ev is None:
                    break
        except RuntimeError:                        # the event loop is gone: just end
            pass
        finally:
            self._it.close()                        # cancels the request if not finished


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
        self.stop = gen.stop
        self.request_id = gen.request_id
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
        inner = getattr(gen.sampler, "inner", gen.sampler)      # the server's wraps one
        # penalties count this sequence's tokens (sampler.py); None: nothing per token
        self.penalties = getattr(inner, "penalties", None)
        if self.penalties is not None:
            self.penalties.start(gen.prompt_ids)
        self.sampling = getattr(inner, "audit_params", None) if self.audit is not None else None
        mask = getattr(gen.sampler, "mask", None)                # ignore_eos: EOS masked
        if self.sampling is not None and mask is not None:
            self.sampling = {**self.sampling, "mask": [int(t) for t in mask]}

    def ready(self) -> bool:
        return self.feed is not None and len(self.request.events) < self.request._sched.ahead

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
        if self.decoder is not None and reason != "stop":
            req.tail = self.decoder.flush()
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
        piece, stop_hit = self._cut_at_stop(piece)
        self.text += piece
        now = time.perf_counter()
        ev = TokenEvent(self.step, tok, piece, es.generation, es.id, now - self.t_prev)
        self.t_prev = now
        req = self.request
        req.n_tokens += 1
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
                return hooks.guard.check_sample(got, self.vocab_size)
        if not np.isfinite(logits.max()):          # NaN or +Inf somewhere (no temporary array)
            logits = self._finite_logits(logits)
        return self.sampler(logits)

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

    def _cut_at_stop(self, piece: str) -> tuple[str, bool]:
        """Cut the new text before the first stop string (which may straddle tokens)."""
        if not self.stop:
            return piece, False
        # Only the text a stop string can straddle: earlier text had no stop string
        # (constant work per token, not a search of the whole text).
        back = min(len(self.text), max(map(len, self.stop)) - 1)
        candidate = self.text[len(self.text) - back:] + piece
        cuts = [i for i in (candidate.find(s) for s in self.stop) if i >= 0]
        if not cuts:
            return piece, False
        return candidate[back:max(min(cuts), back)], True
