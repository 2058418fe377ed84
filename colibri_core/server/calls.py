"""Calls: each HTTP request's engine work, in a worker thread of its own.

The Engine is shareable (its scheduler batches every caller's sequences into the same
forward steps), so the server does not serialize anything: each request runs a *work*
function in its own thread, which submits one request to the engine (a completion's
choices: runtime.generate.submit; a score call: Engine.score) and waits for it; the loop
never waits on the engine. Everything reaches the event loop through one bridge, the
call's `runtime.bridge.LoopQueue` (`call.sink`): the work's own events (Start, End) from
its thread, and the token events straight from the scheduler's thread (submit(...,
sink=call.sink)), without passing through the work's thread: a streamed token is handed
over twice, scheduler -> event loop -> the client's response.

    call = calls.submit(work, request_id="req-1", timeout_s=60)   # ShuttingDown when stopping
    async for event in call:                                       # what work() emitted
        ...
    call.result                                                    # what work() returned

`work(call)` (the Call itself: `engine`, `request_id`, `sink`) calls `call.track(request)`
for the engine request it submits (anything with `close()`), `call.emit(event)` for each
event of its own and `call.check()` while it waits. `call.cancel(why)` (a disconnect,
the timeout, shutdown) closes every tracked request -- its sequences leave the step and
free their KV caches at the next step -- and makes `call.check()` raise Cancelled, so
the work ends at once.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Optional

from ..runtime.bridge import LoopQueue
from .errors import RequestTimeout, ShuttingDown

log = logging.getLogger("colibri.server")

_END = object()
_WAKE = object()        # wakes the reader: the call was cancelled by the shutdown


class Cancelled(Exception):
    """Raised by Call.check() inside work(): stop now, the result is not wanted."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why            # "disconnect" | "timeout" | "shutdown"


class Call:
    """One request's work, its deadline, its engine requests and the async side's queue.
    Iterate it (`async for`) for the events; an error of the work is raised at the end.
    work(call) sees `engine`, `request_id`, `sink`, `emit`, `check`, `track`, `cancel`."""

    def __init__(self, work: Callable[["Call"], Any], request_id: str, engine,
                 timeout_s: Optional[float], loop: asyncio.AbstractEventLoop):
        self.work = work
        self.engine = engine
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.deadline = None if not timeout_s else time.monotonic() + timeout_s
        self.loop = loop
        self.events = LoopQueue(loop)
        self.sink = self.events           # the bridge to the loop (generate.submit(sink=))
        self.cancel_reason: Optional[str] = None
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._tracked: list = []            # engine requests: closed on cancel
        self.on_done: Optional[Callable[[], None]] = None     # run in the loop at the end
        self._timer = loop.call_later(timeout_s, self.cancel, "timeout") if timeout_s else None
        self._thread = threading.Thread(target=self._run, name=f"colibri-call-{request_id}",
                                        daemon=True)

    # -- the worker thread ----------------------------------------------------------------
    def check(self) -> None:
        """Raises Cancelled once the call is not wanted any more (or past its deadline)."""
        if self.cancel_reason is None and self.deadline is not None \
                and time.monotonic() > self.deadline:
            self.cancel("timeout")
        if self.cancel_reason is not None:
            raise Cancelled(self.cancel_reason)

    def track(self, req) -> None:
        """An engine request of this call (close() cancels it): closed when the call is
        cancelled, and when its work ends."""
        with self._lock:
            self._tracked.append(req)
            cancelled = self.cancel_reason is not None
        if cancelled:
            req.close()

    def emit(self, item: Any) -> None:
        """An event of the work's own, to the loop (nothing when the loop is gone)."""
        self.events.put(item)

    def _run(self) -> None:
        try:
            self.result = self.work(self)
        except Cancelled as c:
            self.error = RequestTimeout(self.timeout_s) if c.why == "timeout" else \
                ShuttingDown() if c.why == "shutdown" else c
        except BaseException as e:  # noqa: BLE001 - handed to the request, not raised here
            self.error = e
        finally:
            for r in self._tracked:
                r.close()
            self.done.set()
            self.emit(_END)
            if self.on_done is not None:
                try:
                    self.loop.call_soon_threadsafe(self.on_done)
                except RuntimeError:
                    pass

    # -- any thread -----------------------------------------------------------------------
    def cancel(self, why: str = "disconnect") -> None:
        """Not wanted any more: its requests leave the engine at the next step."""
        with self._lock:
            if self.cancel_reason is not None or self.done.is_set():
                return
            self.cancel_reason = why
            tracked = list(self._tracked)
        for r in tracked:
            r.close()
        if why == "shutdown":
            self.emit(_WAKE)

    # -- the event loop -------------------------------------------------------------------
    async def batches(self):
        """The events in lists of those ready at once (a fleet replica sends each list as
        one message); the work's error is raised at the end, as by `async for`."""
        async for first in self:
            batch = [first]
            while not self.events.empty():
                item = self.events.get_nowait()
                if item is _END or item is _WAKE:
                    self.events.unget(item)
                    break
                batch.append(item)
            yield batch

    def __aiter__(self):
        return self

    async def __anext__(self):
        # Past the shutdown grace period the events not yet sent are dropped: a slow
        # reader's stream ends now with its error, not after its backlog.
        if self.cancel_reason == "shutdown":
            raise ShuttingDown()
        item = await self.events.get()
        if item is _WAKE:
            raise ShuttingDown()
        if item is _END:
            self.events.unget(_END)            # later calls end too
            if self._timer is not None:
                self._timer.cancel()
            err = self.error
            if err is not None:
                self.error = None
                raise err
            raise StopAsyncIteration
        return item


class Calls:
    """The requests in flight: submit, count, stop.

    Requests are not queued here: the engine's scheduler queues their sequences
    (EngineConfig.max_queued_requests, refused with EngineBusyError -> 429 when full).
    `retry_after_s()` estimates when a refused client may retry: the recent duration of
    a request (an exponential average)."""

    def __init__(self, engine):
        self.engine = engine
        self._live: set = set()
        self._stopping = False
        self._avg_s = 1.0
        self.completed = 0

    @property
    def running(self) -> int:
        """Requests whose work is in flight."""
        return len(self._live)

    def retry_after_s(self) -> int:
        return max(1, int(self._avg_s + 0.999))

    def submit(self, work: Callable[[Call], Any], *, request_id: str,
               timeout_s: Optional[float] = None) -> Call:
        """Start `work` in its own thread; ShuttingDown (503) once stopping."""
        if self._stopping:
            raise ShuttingDown()
        call = Call(work, request_id, self.engine, timeout_s, asyncio.get_running_loop())
        self._live.add(call)
        t0 = time.monotonic()

        def forget():
            self._live.discard(call)
            self.completed += 1
            self._avg_s = 0.8 * self._avg_s + 0.2 * (time.monotonic() - t0)
        call.on_done = forget
        call._thread.start()
        return call

    def cancel_all(self, why: str = "shutdown") -> None:
        """Cancel every request in flight: each ends with its error (a stream with its
        error event and [DONE]) at once (any thread)."""
        for call in list(self._live):
            call.cancel(why)

    def stop(self, deadline_s: float = 10.0) -> None:
        """Refuse new work, let the requests in flight finish until the deadline, then
        cancel them, and wait for their threads (any thread but the loop's)."""
        self._stopping = True
        end = time.monotonic() + deadline_s
        for call in list(self._live):
            call.done.wait(max(0.0, end - time.monotonic()))
        self.cancel_all("shutdown")
        for call in list(self._live):
            call._thread.join(10.0)

