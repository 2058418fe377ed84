"""A request on the scheduler (scheduler.py): the one request object, from the caller
(Engine.generate's Generation, Engine.score) to the scheduler's thread and back.

A Request holds its jobs (one sequence each: decode.Decode, a completion's choices;
scoring.ScoreJob, a score call's sequences), its state and what its reader takes: the
events in `events` (a thread reads them, `next_event`) or, once an event loop's LoopQueue
is its `sink` (bridge.py), handed straight to that loop from the scheduler's thread. Each
sequence runs at most AHEAD events ahead of its reader. A failure fails the whole request,
a cancel cancels it: all its jobs leave the step together.
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
    (subclasses: decode.Decode, scoring.ScoreJob). Fields below `feed` belong to the scheduler."""

    all_logits = False          # every position's logits (scoring), or the last token's
    decodes = False             # a stream: after its prompt, one token per step
    waiting = False             # its prompt's rows come from another job of its request
                                # (decode.Decode's followers): out of the steps till then

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
        self.unacked = 0                    # events pushed that its reader has not taken

    def taken(self) -> None:
        """Its reader took one of its events (any thread): under AHEAD again, it may run."""
        s = self.request._sched
        with s._lock:
            self.unacked -= 1
            if self.unacked == s.ahead - 1:
                s._wake.notify_all()

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
        self.events: deque = deque()    # (event, its job): produced, not yet read
        # an event loop's reader (bridge.LoopQueue): events go straight to its loop
        # (None: `events` is read)
        self.sink = None
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

    def push(self, event, job: Job) -> None:
        """An event of `job`'s to the reader (counted until taken: Job.taken)."""
        with self._cv:
            job.unacked += 1
            sink = self.sink
            if sink is None:
                self.events.append((event, job))
                self._cv.notify_all()
                return
        sink.put(event, job.taken)

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
            for ev, job in self.events:
                sink.put(ev, job.taken)
            self.events.clear()
            self.on_done.append(on_done)
            if self.state == "done":
                on_done()

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

    close = cancel          # what a tracker calls (the server's Call.track)

    def next_event(self):
        """The next event (blocks until there is one); None at the end; the request's
        error once its events are read."""
        with self._cv:
            while not self.events and self.state != "done":
                self._cv.wait()
            if self.events:
                ev, job = self.events.popleft()
                job.taken()                 # the same lock (an RLock), held already
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
