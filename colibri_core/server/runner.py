"""EngineRunner: the one thread that calls the engine, fed by a bounded queue.

The server runs one request at a time on this thread (the engine's own scheduler can
batch many; moving the server onto it is issue 15's next step). The HTTP side never calls the engine: it submits a
*work* function and reads the events it emits as an async iterator.

    stream = runner.submit(work, request_id="req-1", timeout_s=60)   # QueueFull when full
    async for event in stream:                                        # what work() emitted
        ...
    stream.result                                                     # what work() returned

`work(ctx)` runs on the engine thread; it calls `ctx.emit(event)` for each event and
`ctx.check()` between two tokens, which raises Cancelled when the client went away, the
request timed out or the server is stopping: a request gives back its place within one
step. While no request runs, the thread applies queued expert changes every
`idle_poll_s`, so a dropped expert goes live without waiting for traffic.

A continuous-batching scheduler (issue 15) replaces this class behind the same submit()
interface: then one step serves many requests.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from .errors import QueueFull, RequestTimeout, ShuttingDown

log = logging.getLogger("colibri.server")

_END = object()


class Cancelled(Exception):
    """Raised by JobContext.check() inside work(): stop now, the result is not wanted."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why            # "disconnect" | "timeout" | "shutdown"


class JobContext:
    """What work() sees: emit events, check for cancellation, the engine."""

    def __init__(self, job: "Job", engine):
        self._job = job
        self.engine = engine
        self.request_id = job.request_id

    def emit(self, event: Any) -> None:
        self._job._deliver(event)

    def check(self) -> None:
        self._job.raise_if_cancelled()


class Job:
    """One submitted request: its work, its deadline, and the async side's queue."""

    def __init__(self, work: Callable[[JobContext], Any], request_id: str,
                 timeout_s: Optional[float], loop: asyncio.AbstractEventLoop):
        self.work = work
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.deadline = None if not timeout_s else time.monotonic() + timeout_s
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel_reason: Optional[str] = None
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.started_at: Optional[float] = None

    # -- engine thread ------------------------------------------------------------------
    def raise_if_cancelled(self) -> None:
        if self.cancel_reason is None and self.deadline is not None \
                and time.monotonic() > self.deadline:
            self.cancel_reason = "timeout"
        if self.cancel_reason is not None:
            raise Cancelled(self.cancel_reason)

    def _deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:        # the event loop is gone (server stopped): nobody listens
            pass

    # -- event loop ---------------------------------------------------------------------
    def cancel(self, why: str = "disconnect") -> None:
        if self.cancel_reason is None:
            self.cancel_reason = why


class Stream:
    """Async iterator over a job's events; raises the job's error (as an ApiError or the
    engine's exception) at the end. `result` holds work()'s return value afterwards."""

    def __init__(self, job: Job):
        self._job = job

    @property
    def result(self) -> Any:
        return self._job.result

    @property
    def request_id(self) -> str:
        return self._job.request_id

    def cancel(self, why: str = "disconnect") -> None:
        self._job.cancel(why)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._job.events.get()
        if item is _END:
            self._job.events.put_nowait(_END)       # later calls end too
            err = self._job.error
            if err is not None:
                self._job.error = None
                raise err
            raise StopAsyncIteration
        return item

    async def finish(self) -> Any:
        """Drain the remaining events and return the result (or raise the error)."""
        async for _ in self:
            pass
        return self.result


class EngineRunner:
    """Runs submitted work on one engine thread, in arrival order.

    queue_size: requests that may wait (beyond the one running) before 429.
    idle_poll_s: how often an idle thread applies queued expert changes.
    on_idle: optional callable run on the engine thread at each idle poll (after the
        expert changes), e.g. to refresh the server's view of the expert set.
    """

    def __init__(self, engine, queue_size: int = 64, idle_poll_s: float = 0.2,
                 on_idle: Optional[Callable[[], None]] = None):
        self.engine = engine
        self.queue_size = queue_size
        self.idle_poll_s = idle_poll_s
        self.on_idle = on_idle
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._running: Optional[Job] = None
        self._stopping = False
        self._avg_s = 1.0                      # recent request duration, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="colibri-engine", daemon=True)
        self.completed = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the running one)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, work: Callable[[JobContext], Any], *, request_id: str,
               timeout_s: Optional[float] = None) -> Stream:
        """Queue `work`; raises QueueFull (429) or ShuttingDown (503) at once."""
        if self._stopping:
            raise ShuttingDown()
        job = Job(work, request_id, timeout_s, asyncio.get_running_loop())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = self._avg_s * (self.depth + 1)
            raise QueueFull(self.depth, max(1, int(wait + 0.999))) from None
        return Stream(job)

    def stop(self, deadline_s: float = 10.0) -> None:
        """Refuse new work, cancel waiting jobs, let the running one finish until the
        deadline (then cancel it), and join the thread."""
        self._stopping = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.error = ShuttingDown()
            job._deliver(_END)
        self._thread.join(timeout=deadline_s)
        running = self._running
        if running is not None:
            running.cancel("shutdown")
        self._queue.put(None)               # wake the thread if it waits
        self._thread.join(timeout=10.0)

    # -- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_poll_s)
            except queue.Empty:
                if self._stopping:
                    return
                self._idle()
                continue
            if job is None:
                return
            self._run(job)

    def _idle(self) -> None:
        try:
            self.engine.apply_expert_changes()
            if self.on_idle is not None:
                self.on_idle()
        except Exception:  # noqa: BLE001 - the engine thread must survive anything
            log.exception("applying expert changes while idle failed")

    def _run(self, job: Job) -> None:
        self._running = job
        job.started_at = t0 = time.monotonic()
        try:
            job.raise_if_cancelled()            # gave up (or timed out) while waiting
            job.result = job.work(JobContext(job, self.engine))
        except Cancelled as c:
            job.error = RequestTimeout(job.timeout_s) if c.why == "timeout" else \
                ShuttingDown() if c.why == "shutdown" else c
        except BaseException as e:  # noqa: BLE001 - handed to the request, not raised here
            job.error = e
        finally:
            self._running = None
            self.completed += 1
            self._avg_s = 0.8 * self._avg_s + 0.2 * (time.monotonic() - t0)
            job._deliver(_END)
