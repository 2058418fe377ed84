"""Continuous batching: many requests share one engine, batched into the same forward steps.

One thread per engine (`colibri-sched`, started with the first request, ended when the
engine closes or after `IDLE_EXIT_S` without work) is the only one that calls the model,
applies expert changes and calls the per-token hooks. Callers on any thread (or event
loop) submit a Request -- a generation is one sequence, a score_batch many -- and read
what it produced; nothing they do touches the model.

    queue (bounded: max_queued_requests; when full, wait or EngineBusyError)
      -> between two steps: expert changes applied, cancelled requests retired, queued
         sequences admitted while the KV budget has room (first come, first served)
      -> one step: running decodes first (one token each, or with speculative
         decoding that token and its draft: Job.decode_tokens), then prompt chunks fill
         the rest, at most max_step_tokens tokens while a stream decodes
         (max_batch_tokens while none does) and then at most max_prefill_tokens of
         each prompt; one Model.forward for the step's sequences, each with its
         expert set (a pinned sequence keeps its snapshot or its canary's set; the others
         use the current one: steprun.py), each sequence with its kind of output
         (last-token logits, or all its positions: scoring, a draft's verification)
      -> per sequence, in the step's order: its logits handled (sampling, stop strings,
         hooks: Job.after_step), then finished sequences retired and their KV freed

Batch invariance (pipeline.py) makes a sequence's logits independent of the others in
its step and of how its prompt was split, so every request gets exactly the tokens it
would get alone. A failing forward is run again one sequence at a time, so that a fault
one sequence causes (a plugin's bad answer for its rows) fails only its request.

A sequence may run at most AHEAD tokens ahead of its reader: a reader that stops reading
pauses its sequence (and keeps its KV cache) until it reads on, closes its Generation, or
drops it (the finalizer cancels it; freed at the next step).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from ..errors import EngineBusyError, EngineClosedError, RequestError, RequestTooLarge
from ..model.kvcache import check_memory
from .prefixcache import PrefixCache
from .request import AHEAD, Job, Request  # noqa: F401 - Job and Request re-exported
from .steprun import run_step

log = logging.getLogger("colibri")

IDLE_EXIT_S = 2.0       # the thread ends after this long without work (restarted on demand)


class Scheduler:
    """The engine's batching loop (see the module docstring). `engine` gives `model`,
    `config` and `kv_pool`; what the engine does on this thread is passed in as
    callbacks: `between_steps()` before each step (the engine adopts queued expert
    changes there), `requests_ended()` after requests retire (it releases what no
    snapshot uses any more)."""

    def __init__(self, engine, what: str, between_steps: Callable[[], None] = lambda: None,
                 requests_ended: Callable[[], None] = lambda: None):
        self.engine = engine
        self.what = what                        # named in the errors (the model folder)
        self.between_steps = between_steps
        self.requests_ended = requests_ended
        cfg = engine.config
        self.max_step_tokens = cfg.max_step_tokens
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_batch_tokens = max(cfg.max_batch_tokens, cfg.max_step_tokens)
        self.max_queued = cfg.max_queued_requests
        self.when_full = cfg.when_full
        self._lock = threading.RLock()          # an RLock: cancel() may run in a finalizer
        self._wake = threading.Condition(self._lock)     # work for the thread
        self._room = threading.Condition(self._lock)     # a queue place for submit()
        self._queue: deque[Request] = deque()
        self._running: list[Job] = []           # admitted, in admission order
        self._requests: list[Request] = []      # running requests, in admission order
        self._ops: deque = deque()              # [fn, done, result/error] run between steps
        self._thread: Optional[threading.Thread] = None
        self._ident: Optional[int] = None
        self._rr = 0                            # decode rotation when more than fit
        self.closed = False
        self._closing = False
        self._release: Optional[Callable[[], None]] = None
        self._release_error: Optional[BaseException] = None
        self.kv = None                          # the engine's KV pool (kvcache.KVPool)
        self.prefix: Optional[PrefixCache] = None   # kept prompt rows (prefixcache.py)
        self.steps = 0                          # steps run
        self.ahead = AHEAD                      # tokens a stream may run ahead of its reader
        # For tests: called on this thread between two steps, before admission, with the
        # step number; and, when a list, one entry per step: [(request id, tokens, expert
        # set generation)] in the step's order.
        self.step_hook: Optional[Callable[[int], None]] = None
        self.trace: Optional[list] = None

    # ------------------------------------------------------------------ any thread
    def closed_error(self) -> EngineClosedError:
        return EngineClosedError(f"{self.what}: this engine is closed; create a new one")

    @property
    def queued(self) -> int:
        """Requests waiting for admission (not counting cancelled ones)."""
        return sum(1 for r in self._queue if not r.cancelled)

    @property
    def running(self) -> int:
        """Requests admitted and not retired (their sequences in the steps)."""
        return len(self._requests)

    def on_thread(self) -> bool:
        """Whether the caller is the scheduler's thread (a hook, the step's own code)."""
        return self._ident == threading.get_ident()

    def budget(self):
        """The engine's KV pool (kvcache.KVPool): admission is by its free positions."""
        if self.kv is None:
            self.prefix = PrefixCache.for_engine(self.engine)
            self.kv = self.engine.kv_pool
        return self.kv

    def submit(self, req: Request) -> Request:
        """Queue `req` (its jobs set). Refused at once when it can never run (memory, KV
        budget) or the engine is closed; when the queue is full, waits for a place or
        raises EngineBusyError (EngineConfig.when_full)."""
        kv = self.budget()
        # One look at the machine's memory per request, for all its sequences together
        # (it reads /proc and the cgroup's files: per sequence it cost more than a scored item)
        positions = sum(j.capacity for j in req.jobs)
        check_memory(kv.bytes_per_position * positions,
                     f"KV caches of {positions} positions ({len(req.jobs)} sequences)",
                     self.prefix.evict_bytes if self.prefix is not None else None)
        for j in req.jobs:
            if j.capacity > kv.capacity_tokens:
                raise RequestTooLarge(
                    f"request {req.id}: a sequence needs {j.capacity} KV positions, more than "
                    f"the KV pool holds (kv_pool_tokens={kv.capacity_tokens}, engine config); "
                    f"ask for fewer tokens or raise kv_pool_tokens")
        with self._lock:
            while True:
                if self.closed:
                    raise self.closed_error()
                waiting = sum(1 for r in self._queue if not r.cancelled)
                if waiting < self.max_queued:        # (cancelled ones leave at the next step)
                    break
                if self.when_full == "refuse" or self.on_thread():
                    raise EngineBusyError(
                        f"engine busy: {waiting} requests wait already "
                        f"(max_queued_requests={self.max_queued}); retry later, or set "
                        f"when_full='wait'")
                self._room.wait()
            req._sched, req._cv = self, threading.Condition(self._lock)
            req._pending = deque(req.jobs)
            req._t_submit = time.perf_counter()
            req.state = "queued"
            self._queue.append(req)
            self._ensure_thread()
            self._wake.notify_all()
        return req

    def call(self, fn: Callable[[], object]):
        """Run `fn` on the scheduler's thread between two steps and return its result
        (at once when called on that thread). Nothing when the engine is closed."""
        if self.on_thread():
            return fn()
        op = [fn, threading.Event(), None, None]
        with self._lock:
            if self.closed:
                return None
            self._ops.append(op)
            self._ensure_thread()
            self._wake.notify_all()
        op[1].wait()
        if op[3] is not None:
            raise op[3]
        return op[2]

    def close(self, release: Callable[[], None]) -> None:
        """Refuse from now on, cancel queued and running requests (EngineClosedError),
        run `release`, and return once all that is done -- except on the scheduler's own
        thread (a hook): then it happens when the current step ends. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = self._closing = True
            self._release = release
            thread = self._thread
            self._wake.notify_all()
            self._room.notify_all()
        if thread is None:
            self._shutdown()                   # no thread: nothing runs, done here
        elif thread.ident != threading.get_ident():
            thread.join()
            err, self._release_error = self._release_error, None
            if err is not None:                # release() raised on the thread: here too
                raise err.with_traceback(None)

    # ------------------------------------------------------------------ the thread
    def _ensure_thread(self) -> None:        # under _lock
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._loop, name="colibri-sched",
                                            daemon=True)
            self._thread.start()

    def _has_work(self) -> bool:             # under _lock
        if self._ops or any(r.cancelled for r in self._requests) \
                or any(r.cancelled for r in self._queue):
            return True
        if self._queue:
            q = self._queue[0]
            if q.cancelled or (q._pending and q._pending[0].capacity <= self.kv.free_tokens):
                return True
        return any(not j.waiting and (j.fed < len(j.tokens) or j.ready())
                   for j in self._running)

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        self.budget()
        while True:
            with self._lock:
                while not self._closing and not self._has_work():
                    if not self._wake.wait(IDLE_EXIT_S) and not self._closing \
                            and not self._has_work():
                        self._thread = self._ident = None      # idle: ends (restarted
                        return                                 # by the next request)
                if self._closing:
                    break
            try:
                self._step()
            except BaseException as exc:         # noqa: BLE001 - a bug here: fail what ran
                log.exception("scheduler step failed")
                for r in list(self._requests):
                    self._fail(r, exc)
                self._retire()
        try:
            self._shutdown()
        except BaseException as exc:             # noqa: BLE001 - close() raises it
            self._release_error = exc

    def _step(self) -> None:
        """Between two steps: expert changes, queued calls, cancellations, admission;
        then one step and the retirement of what it finished."""
        self.between_steps()
        while self._ops:
            with self._lock:
                op = self._ops.popleft()
            try:
                op[2] = op[0]()
            except BaseException as exc:         # noqa: BLE001 - handed to the caller
                op[3] = exc
            op[1].set()
        if self.step_hook is not None:
            self.step_hook(self.steps)
        self._retire()
        self._admit()
        plan = self._compose()
        if plan:
            self._run(plan)
            self.steps += 1
        self._retire()

    def _admit(self) -> None:
        kv, started, admitted = self.kv, [], []
        with self._lock:
            while self._queue:
                req = self._queue[0]
                if req.cancelled:
                    self._finish(req)
                    continue
                while req._pending and req._pending[0].capacity <= kv.free_tokens:
                    j = req._pending[0]
                    try:
                        j.cache = kv.alloc(j.capacity)
                    except Exception as exc:      # noqa: BLE001 - memory: this request only
                        self._fail(req, exc)
                        break
                    req._pending.popleft()
                    if j.pin:        # preset (a shadow pass), else live or a canary's
                        j.es = j.es or self.engine.set_for(req.id)
                    admitted.append(j)
                    self._running.append(j)
                    if req.state == "queued":
                        req.state = "running"
                        req.queue_wait_s = time.perf_counter() - req._t_submit
                        self._requests.append(req)
                        started.append(req)
                if req.error is not None:
                    self._finish(req)
                    continue
                if not req._pending:
                    self._queue.popleft()
                    self._room.notify()
                    continue
                break                            # the head waits for room: first come first
        for j in admitted if self.prefix is not None else ():   # kept prefixes copied in
            self.prefix.attach(j, j.es or self.engine.model.expert_set, self.engine)
        for req in started:
            try:
                req.started()
            except Exception as exc:             # noqa: BLE001 - this request only
                self._fail(req, exc)

    def _compose(self) -> list:
        """[(job, tokens)] of the next step: decodes, then prompt chunks."""
        running = [j for j in self._running if not j.done and not j.waiting
                   and j.request.error is None and not j.request.cancelled]
        decoding = any(j.decodes and j.fed >= len(j.tokens) for j in running)
        budget = self.max_step_tokens if decoding else self.max_batch_tokens
        ready = [j for j in running if j.fed >= len(j.tokens) and j.ready()]
        if len(ready) > budget:                  # more streams than a step carries: rotate
            r = self._rr % len(ready)
            ready = ready[r:] + ready[:r]
            self._rr += budget
        take = ready[:budget]
        budget -= len(take)
        plan = []
        for j in take:                           # a draft takes what the step has left
            toks = j.decode_tokens(budget)
            budget -= len(toks) - 1
            plan.append((j, toks, len(toks) > 1))
        # beside running streams each prompt advances at most max_prefill_tokens a step:
        # one long prompt barely slows the streams, and prompts arriving together advance
        # together (one shared cap would prefill them one after another)
        per_prompt = self.max_prefill_tokens if decoding else None
        for j in running:
            if budget <= 0:
                break
            left = len(j.tokens) - j.fed
            if left > 0:
                n = min(left, budget, per_prompt or left)
                plan.append((j, j.tokens[j.fed:j.fed + n], j.all_logits))
                budget -= n
        return plan

    def _run(self, plan: list) -> None:
        run_step(self, plan)

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.error is None:
            req.error = exc
            req.stop_reason = "error"

    def _retire(self) -> None:
        """Requests finished, failed or cancelled: out of the step, their KV freed (and
        cancelled ones out of the queue). A finished sequence of a request with more to
        run (score_batch's) gives its KV back at once, so the rest can be admitted."""
        with self._lock:
            done = [j for j in self._running if j.done and j.cache is not None]
            if done:
                self._running = [j for j in self._running if not (j.done and j.cache is not None)]
        pipe = self.engine.model.pipeline
        for j in done:
            pipe.forget_cache(j.cache)
            if self.prefix is not None:          # its rows kept for later prompts
                self.prefix.release(j, self.engine, j.request.error is None)
            self.kv.free(j.cache)
            j.cache = None
        with self._lock:
            gone = [r for r in self._requests
                    if r.error is not None or r.cancelled or
                    (not r._pending and all(j.done for j in r.jobs))]
            gone += [r for r in self._queue if r.cancelled and r.state == "queued"]
            if not gone:
                return
        pinned = any(j.pin for r in gone for j in r.jobs)
        for r in gone:
            self._finish(r)
        if pinned:
            self.engine.model.pipeline.keep_pinned(
                [j.es for j in self._running if j.es is not None])
        self.requests_ended()

    def _finish(self, req: Request) -> None:
        """Take a request out of the queue and the step, free its caches, tell its hooks
        and its reader. Idempotent."""
        mine = set(map(id, req.jobs))
        with self._lock:
            if req.state == "done":
                return
            self._running = [j for j in self._running if id(j) not in mine]
            if req in self._requests:
                self._requests.remove(req)
            if req in self._queue:
                self._queue.remove(req)
                self._room.notify()
        pipe = self.engine.model.pipeline
        for j in req.jobs:
            if j.cache is not None:
                pipe.forget_cache(j.cache)
                if self.prefix is not None:
                    self.prefix.release(j, self.engine, req.error is None)
                self.kv.free(j.cache)
                j.cache = None
        if req.state != "queued":
            if req.cancelled and req.error is None:
                req.stop_reason = None          # the reader stopped early
            try:
                req.ended()
            except Exception as exc:             # noqa: BLE001 - logged: it has ended
                log.warning("request %s: its end hook failed: %s", req.id, exc)
        with self._lock:
            req.state = "done"
            req._done()

    def _shutdown(self) -> None:
        """The engine closes: queued and running requests end with EngineClosedError
        (their end hooks first), then the engine's resources are released."""
        with self._lock:
            queued, running = list(self._queue), list(self._requests)
            self._queue.clear()
            self._requests = []
            ops, self._ops = list(self._ops), deque()
        err = self.closed_error()
        for r in running:
            self._fail(r, err)
            try:
                r.ended()
            except Exception as exc:             # noqa: BLE001
                log.warning("request %s: its end hook failed: %s", r.id, exc)
        release, self._release = self._release, None
        try:
            if release is not None:
                release()
        finally:
            with self._lock:
                for r in queued + running:
                    self._fail(r, err)
                    for j in r.jobs:
                        if j.cache is not None and self.kv is not None:
                            self.kv.free(j.cache)
                            j.cache = None
                    r.state = "done"
                    if r._cv is not None:
                        r._done()
                self._running = []
                for op in ops:
                    op[1].set()
                self._thread = self._ident = None
                self._room.notify_all()


def ensure_not_on_thread(sched: Scheduler, what: str) -> None:
    """A blocking call from the scheduler's own thread (a plugin hook) would wait for
    itself: refused."""
    if sched.on_thread():
        raise RequestError(f"{what} called from inside a step (a plugin hook on the engine's "
                           f"thread): it would wait for itself; call it from another thread")
