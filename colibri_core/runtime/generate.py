"""Token generation over the scheduler: a Generation is one choice, streamed.

`generation()` (Engine.generate's body) checks the arguments, tokenizes the prompt and
chooses k into a Generation; `Generation.another()` is a further choice of the same
prompt (the server's n: tokenized and k chosen once). Starting a Generation submits one
request (`_Stream`) carrying its sequence, a decode.Decode job; `submit()` submits
several choices as one request (the server's n x prompts), their events on one reader
with their `choice` index. The caller's thread iterates a Generation and reads the
tokens its sequence produced on the scheduler's thread (scheduler.py), where sampling,
stop strings, streaming text and the per-token hooks run, once per step, after the
step's forward. Between two steps (and only there) the engine applies queued expert
changes, so every token is computed with exactly one expert set, whose generation and id
are recorded on the token; a pinned request keeps the snapshot it was admitted with.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, Union

import numpy as np

from ..config import EngineConfig, ModelConfig
from .audit import generation_record, routing_of
from .bridge import DONE, LoopQueue
from .decode import Decode
from .events import TokenEvent
from ..errors import RequestError
from ..forward.model import Model
from .sampler import Sampler, SamplingParams
from .request import Request, cancel_when_gone
from .prefixcache import PrefixCache
from .scheduler import Scheduler
from .tokenizer import Tokenizer


class Host(Protocol):
    """What a Generation uses of its engine (engine.Engine is the one host)."""
    model_cfg: ModelConfig
    config: EngineConfig            # speculative_decoding, draft_tokens
    model: Model
    model_dir: Path
    tokenizer: Optional[Tokenizer]
    hooks: Any                      # plugins.HookRelay
    scheduler: Scheduler            # where its request runs

    def prepare_ids(self, prompt, reserve: int = 1) -> tuple: ...

    def choose_k(self, prompt_tokens: int, explicit: Optional[int], prefix: Optional[int],
                 request: dict) -> tuple: ...


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
    stop_token_ids: tuple = ()              # tokens that end it as EOS does (not emitted)
    stop_reason: Optional[str] = None      # "length" | "eos" | "stop" | "context" | "error"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tail: str = ""              # text after the last token's event (decoder, held back)
    events: list[TokenEvent] = field(default_factory=list)
    _request: Optional["_Stream"] = field(default=None, repr=False)
    _job: Optional[Decode] = field(default=None, repr=False)     # its sequence, once started
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
        d = self._job
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

    def another(self, sampling: SamplingParams, request_id: str) -> "Generation":
        """A further choice of the same prompt (not started): this one's tokens, k, stop
        strings and length (tokenized and chosen once), a sampler of its own."""
        return replace(self, sampler=_sampler(sampling, self.engine), request_id=request_id,
                       logprobs=sampling.logprobs, stop_reason=None, token_ids=[], text="",
                       tail="", events=[], _request=None, _job=None, _iterated=False)

    def start(self, sink=None, on_done=None) -> "Generation":
        """Submit the request now (iterating does it otherwise): it starts computing at
        the next step. Raises what submitting raises (EngineClosedError, EngineBusyError
        with when_full="refuse", RequestTooLarge, InsufficientMemoryError). `sink`: an
        event loop's bridge.LoopQueue that gets the token events from the scheduler's
        thread, instead of iteration; `on_done()`: called on
        the scheduler's thread once the request is done."""
        if self._request is None:
            submit([self], self.request_id, sink=sink, on_done=on_done)
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
        req, job = self._request, self._job
        _only_choice(req, self.request_id)
        try:
            while True:
                ev = req.next_event()
                if ev is None:
                    break
                self.token_ids.append(ev.token_id)
                self.text += ev.text
                self.events.append(ev)
                yield ev
            self.tail = job.tail
            self.text += job.tail
            self.stop_reason = job.outcome
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
        req, job = self._request, self._job
        _only_choice(req, self.request_id)
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
            self.tail = job.tail
            self.text += job.tail
            self.stop_reason = job.outcome
        except Exception:
            self.stop_reason = "error"
            raise
        finally:
            req.cancel()                     # closed or dropped early: retired next step


class _Stream(Request):
    """A completion's request on the scheduler: one Decode job per choice (a Python
    API Generation: one). Holds no reference to its Generations (so that dropping one
    cancels it). `on_choice_end(job)`: called on the scheduler's thread as each choice
    ends (its last token's event pushed first)."""

    def __init__(self, gens: list, request_id: str):
        super().__init__(request_id)
        eng = gens[0].engine
        self.hooks = eng.hooks
        self.on_choice_end: Optional[Callable[[Decode], None]] = None
        ctx = eng.model_cfg.max_position_embeddings
        self.jobs = [Decode(self, g, max(min(ctx, len(g.prompt_ids) + g.max_new_tokens),
                                         len(g.prompt_ids))) for g in gens]
        # choices of one prompt (the same tokens and k, pinned): its prefill runs once,
        # the others wait for its rows (decode.Decode._hand_over); not while hooks or
        # the audit log must see every row (prefixcache.py's rule)
        if len(gens) > 1 and not PrefixCache.skipped(eng):
            first: dict = {}
            for g, d in zip(gens, self.jobs):
                key = (tuple(g.prompt_ids), g.k)
                lead = first.setdefault(key, d) if g.pin_experts else d
                if lead is not d:
                    lead.followers.append(d)
                    d.waiting = True

    def started(self) -> None:
        now = time.perf_counter()
        h = self.hooks
        for d in self.jobs:
            d.t_prev = now
            if h is not None and h.request_start is not None:
                h.request_start(request_id=d.request_id, prompt_tokens=len(d.tokens), k=d.k)

    def ended(self) -> None:
        h = self.hooks
        for d in self.jobs:
            if h is not None and h.request_end is not None:
                h.request_end(request_id=d.request_id, n_tokens=d.n_tokens,
                              stop_reason=d.outcome)
            if d.audit is not None and d.prompt_routed:     # its line (a dict: written elsewhere)
                d.audit.put(generation_record(d.request_id, d.tokens, d.sets, d.k,
                                              d.out_tokens, d.outcome, routing_of(d.routes, d.k),
                                              d.sampling), [es for _, es in d.sets])


def submit(gens: list, request_id: str, *, sink=None,
           on_choice_end: Optional[Callable[[Decode], None]] = None,
           on_done: Optional[Callable[[], None]] = None) -> _Stream:
    """Submit Generations (none started yet; one engine) as one request: one submission,
    one memory check, one queue place; their sequences share the steps, their events go
    to one reader (`sink`, or iteration when they are one) with their `choice`; a failure
    fails them all, and cancelling any one cancels them all. Raises what
    Scheduler.submit raises."""
    if not gens or any(g._request is not None for g in gens):
        raise RequestError(f"request {request_id}: submit takes Generations not started yet")
    req = _Stream(gens, request_id)
    req.sink = sink
    req.on_choice_end = on_choice_end
    if on_done is not None:
        req.on_done.append(on_done)
    gens[0].engine.scheduler.submit(req)
    for g, job in zip(gens, req.jobs):
        g._request, g._job = req, job
        cancel_when_gone(g, req)              # dropped unread: its place is freed
    return req


def _only_choice(req: _Stream, request_id: str) -> None:
    if len(req.jobs) > 1:
        raise RequestError(f"request {request_id}: a Generation submitted with others is "
                           f"read through its request's sink, not iterated")


def _sampler(sampling: SamplingParams, eng: Host):
    try:
        return sampling.sampler(eng.model_cfg.eos_token_ids, eng.tokenizer,
                                eng.model_cfg.vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(f"sampling settings: {e}") from None


def generation(eng: Host, prompt: Union[str, Sequence[int]], request_id: str, *,
               max_new_tokens: Optional[int], experts_per_token: Optional[int],
               sampling: Optional[SamplingParams], stop, pin_experts: bool, sampler,
               shorthands: dict) -> Generation:
    """Engine.generate's body (its docstring says what each argument does): the arguments
    checked, the prompt tokenized, k chosen, the sampler built; not started."""
    s = eng.config.sampling
    n_new = s.max_new_tokens if max_new_tokens is None else max_new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or n_new < 0:
        raise RequestError(f"max_new_tokens={n_new!r}: must be an integer >= 0")
    n_new = int(n_new)
    if stop is None:
        stop = list(s.stop)
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)):
        stop = list(stop)
    else:
        raise RequestError(f"stop={stop!r:.60}: expected a string or a list of strings")
    if not all(isinstance(x, str) and x for x in stop):
        raise RequestError(f"stop={stop!r:.60}: stop strings must be non-empty text")
    sh = shorthands           # the defaults (0, 1.0) mean "not given"
    given = {k: v for k, v in dict(
        sh, presence_penalty=sh["presence_penalty"] or None,
        frequency_penalty=sh["frequency_penalty"] or None, min_p=sh["min_p"] or None,
        repetition_penalty=None if sh["repetition_penalty"] == 1.0
        else sh["repetition_penalty"]).items() if v is not None}
    if sampling is None:
        sampling = SamplingParams(**{"temperature": s.temperature, "top_p": s.top_p,
                                     "seed": s.seed, **given})
    elif not isinstance(sampling, SamplingParams):
        raise RequestError(f"sampling={sampling!r:.60}: expected a SamplingParams")
    elif given:
        raise RequestError(f"generate: sampling=SamplingParams(...) and {sorted(given)} "
                           f"both given; put those settings in the SamplingParams")
    ids, prefix_k, truncated = eng.prepare_ids(prompt, reserve=1)
    k, source = eng.choose_k(len(ids), experts_per_token, prefix_k, {"id": request_id})
    if sampler is None:
        sampler = _sampler(sampling, eng)
    return Generation(eng, ids, k, source, n_new, sampler, stop, pin_experts=pin_experts,
                      request_id=request_id, truncated_from=truncated,
                      logprobs=sampling.logprobs)
