"""RequestGate: an Engine serves one request at a time, and is closed between steps.

A request holds the gate from its first token to its end, close or finalization
(`claim` / `release`); a second one meanwhile is refused with EngineBusyError, never
mixed into the first one's buffers. Every computation of the model runs inside `step()`,
which `close()` waits for, so nothing is unmapped under a running kernel; a close from
inside a step (a plugin hook) runs its release when that step ends. (A scheduler that
batches many requests into one step is issue 15; it replaces the one-request rule.)
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Optional

from .errors import EngineBusyError, EngineClosedError


class RequestGate:
    def __init__(self, what: str):
        self.what = what                          # named in the errors (the model folder)
        self.closed = False
        self.active: Optional[str] = None         # the request holding the engine
        self._active_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._step_thread: Optional[int] = None
        self._on_close: Optional[Callable[[], None]] = None   # deferred to the step's end

    def closed_error(self) -> EngineClosedError:
        return EngineClosedError(f"{self.what}: this engine is closed; create a new one")

    def claim(self, request_id: str) -> None:
        with self._active_lock:
            if self.closed:
                raise self.closed_error()
            if self.active is not None and self.active != request_id:
                raise EngineBusyError(
                    f"engine busy: request {self.active!r} is active on this Engine, which "
                    f"serves one request at a time; finish or close that Generation first, "
                    f"use one Engine per thread, or `colibri serve` for concurrent clients")
            self.active = request_id

    def release(self, request_id: str) -> None:
        with self._active_lock:
            if self.active == request_id:
                self.active = None

    def in_step(self) -> bool:
        """Whether the calling thread is inside step() (a hook, the step's own code)."""
        return self._step_thread == threading.get_ident()

    @contextmanager
    def step(self):
        with self._step_lock:
            if self.closed:
                raise self.closed_error()
            self._step_thread = threading.get_ident()
            try:
                yield
            finally:
                self._step_thread = None
                if self._on_close is not None:      # closed from inside this step
                    on_close, self._on_close = self._on_close, None
                    on_close()

    def close(self, release: Callable[[], None]) -> None:
        """Refuse from now on, then run `release` once no step runs (at the end of the
        current one when called from inside it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.in_step():
            self._on_close = release
            return
        with self._step_lock:
            release()
