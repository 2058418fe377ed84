"""A request on the scheduler (scheduler.py): the one request object, from the caller
(Engine.generate's Generation, Engine.score) to the scheduler's thread and back.

A Request holds its jobs (one sequence each: generate.Decode, scoring.ScoreJob), its state
and what its reader takes: the events in `events` (a thread reads them, `next_event`) or,
once an event loop's LoopQueue is its `sink` (bridge.py), handed straight to that loop
from the scheduler's thread. A stream runs at most AHEAD events ahead of its reader.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Callable, Optional

import numpy as np

AHEAD = 4               # tokens a sequence may compute before its reader takes them


class Job:
    """One sequence: its prompt, k and KV capacity, and what it does with its logits
    (subclasses: generate.Decode, scoring.ScoreJob). Fields below `feed` belong to the scheduler."""

    all_logits = False          # every position's logits (scoring), or the last token's
    decodes = False             # a stream: after its prompt, one token per step

    def __init__(self, request: "Request", tokens, k: int, capacity: int, pin: bool = False):
        self.request = request
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.k = int(k)
        self.capacity = int(capacity)
        self.pin = pin
        self.feed: Optional[int] = None     # the next decode token (None: none yet)
        self.done = False
        self.fed = 0                        # prompt tokens already run
        self.cache = None
        self.es = None                      # its snapshot when pinned (set at admission)

    def ready(self) -> bool:
        """Whether the step may run its next decode token."""
        return self.feed is not None

    def decode_tokens(self, room: int) -> np.ndarray:
        """The tokens of its next decode step: `feed`, and a speculative decode's draft
        of at most `room` more (then after_step gets all their logits, [n, V])."""
        return np.array([self.feed], np.int64)

    def after_step(self, logits: np.ndarray, es, final: bool) -> None:
        """The logits of what this step ran for the sequence ([V], or [n, V] with
        all_logits or a draft), computed with expert set `es`; `final`: its prompt is complete (or
        it was a decode token). Set `feed` to go on, or `done`. On the scheduler thread;
        an exception fails this job's request only."""
        raise NotImplementedError


class Request:
    """What one caller submitted: its jobs, its state, and what its reader waits on."""

    def __init__(self, request_id: str):
        self.id = request_id
        self.jobs: list[Job] = []
        self.state = "new"              # new | queued | running | done
        self.error: Optional[BaseException] = None
        self.cancelled = False
        self.stop_reason: Optional[str] = None
        self.queue_wait_s: Optional[float] = None   # from submit() to its admission
        self.events: deque = deque()    # produced, not yet read (generations)
        # an event loop's reader (bridge.LoopQueue): events go straight to its loop, and
        # `_unacked` counts those its reader has not taken yet (None: `events` is read)
        self.sink = None
        self._unacked = 0
        self.on_done: list = []         # called on the scheduler's thread once done
        self._sched = None               # its Scheduler, once submitted
        self._cv: Optional[threading.Condition] = None
        self._t_submit = 0.0
        self._pending: deque = deque()  # jobs not admitted yet

    # -- the scheduler thread --------------------------------------------------------
    def started(self) -> None:
        """Admitted (before its first step): hooks such as colibri_request_start."""

    def ended(self) -> None:
        """Retired (finished, failed, cancelled or closed): colibri_request_end."""

    def push(self, event) -> None:
        with self._cv:
            sink = self.sink
            if sink is None:
                self.events.append(event)
                self._cv.notify_all()
                return
            self._unacked += 1
        sink.put(event, self._ack)

    @property
    def backlog(self) -> int:
        """Events produced that the reader has not taken yet."""
        return len(self.events) if self.sink is None else self._unacked

    def _done(self) -> None:                # under the lock: state is "done" now
        self._cv.notify_all()
        for fn in self.on_done:
            fn()

    # -- an event loop ------------------------------------------------------------------
    def attach(self, sink, on_done: Callable[[], None]) -> None:
        """Send the events to an event loop's LoopQueue from now on (those produced and
        not read yet first), and call `on_done` once done (at once if it is)."""
        with self._cv:
            self.sink = sink
            for ev in self.events:
                self._unacked += 1
                sink.put(ev, self._ack)
            self.events.clear()
            self.on_done.append(on_done)
            if self.state == "done":
                on_done()

    def _ack(self) -> None:
        """The loop's reader took an event (on the loop's thread)."""
        s = self._sched
        with s._lock:
            self._unacked -= 1
            if self._unacked == s.ahead - 1:         # its sequence may run again
                s._wake.notify_all()

    # -- any thread -----------------------------------------------------------------------
    def cancel(self) -> None:
        """The result is not wanted any more: retired at the next step (idempotent,
        never blocks; safe from a finalizer)."""
        s = self._sched
        if s is None or self.state == "done":
            return
        with s._lock:
            if self.state != "done" and not self.cancelled:
                self.cancelled = True
                s._wake.notify_all()

    def next_event(self):
        """The next event (blocks until there is one); None at the end; the request's
        error once its events are read."""
        s = self._sched
        with self._cv:
            while not self.events and self.state != "done":
                self._cv.wait()
            if self.events:
                ev = self.events.popleft()
                if len(self.events) == s.ahead - 1:    # its sequence may run again
                    s._wake.notify_all()
                return ev
        if self.error is not None:
            raise self.error.with_traceback(None)
        return None

    def wait_done(self, timeout: float) -> bool:
        """Whether the request is done, waiting up to `timeout` seconds for it."""
        with self._cv:
            if self.state != "done":
                self._cv.wait(timeout)
            return self.state == "done"

    def wait(self) -> None:
        """Until the request is done; raises its error."""
        with self._cv:
            while self.state != "done":
                self._cv.wait()
        if self.error is not None:
            raise self.error.with_traceback(None)


def cancel_when_gone(owner, req: Request) -> None:
    """Cancel `req` once `owner` (its Generation) is garbage: a weak reference both
    ways, so that nothing the request holds (its error's traceback) keeps `owner` alive."""
    ref = weakref.ref(req)
    weakref.finalize(owner, _cancel_ref, ref)


def _cancel_ref(ref) -> None:
    req = ref()
    if req is not None:
        req.cancel()
