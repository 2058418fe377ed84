"""What the routes run on: one engine in this process (LocalBackend), or a fleet of engine
replicas (colibri_core/fleet/ingress.py's RayBackend, the same methods over Ray Serve).

The routes (app.py) only parse, check, stream and answer; everything that touches an
engine goes through these methods (the Backend protocol below, which both backends
satisfy: tests/test_request_api.py checks it), so the API has one implementation
whatever runs it:

    model_cfg, tokenizer, model_dir, num_experts      the served model (what params check)
    generate(p, request_id, timeout_s, stream) -> call a completion's events (calls.py's Call:
    score(raw_items, experts, request_id, timeout_s)   `async for`, .result, .cancel(why))
    stamp() -> (generation, id)                        the current expert set
    await listing() / rollback(name) / upload(name, data)
    await snapshot() -> dict                           what /metrics and the status page show
    retry_after_s(), running                           a refused client's wait; calls in flight
    trim_memory(), cancel_all()                        idle: memory back; past the grace period
    await startup() / shutdown()                       the app's lifespan
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from ..files import write_atomic
from . import candidates, memory
from .calls import Calls
from .errors import ApiError
from .experts import ExpertBook
from .work import run_generation, run_score, score_items

log = logging.getLogger("colibri.server")


class CallHandle(Protocol):
    """A request in flight, as the routes hold it: calls.Call here, the fleet's
    RemoteCall over Ray. `async for` its events (runtime/events.py); `result` once they
    ended (the work's error is raised at the end instead); `cancel(why)`."""

    result: Any

    def cancel(self, why: str = "disconnect") -> None: ...
    def __aiter__(self): ...
    async def __anext__(self): ...


@runtime_checkable
class Backend(Protocol):
    """What the routes run on: LocalBackend (one engine here) or the fleet's RayBackend.
    generate / score return a CallHandle."""

    kind: str                       # "engine" | "ray" (/status.json)
    model_cfg: Any                  # the served model's ModelConfig
    tokenizer: Any                  # its Tokenizer, or None
    model_dir: Path
    num_experts: int

    async def startup(self) -> None: ...
    async def shutdown(self, deadline_s: float) -> None: ...
    def generate(self, p, request_id: str, timeout_s: Optional[float],
                 stream: bool = True) -> CallHandle: ...
    def score(self, raw: list, experts: Optional[int], request_id: str,
              timeout_s: Optional[float]) -> CallHandle: ...
    def retry_after_s(self) -> int: ...
    @property
    def running(self) -> int: ...
    def trim_memory(self) -> None: ...
    def cancel_all(self) -> None: ...
    def stamp(self) -> tuple[int, str]: ...
    async def listing(self) -> dict: ...
    async def rollback(self, name: str) -> dict: ...
    async def upload(self, name: str, data: bytes, sha: str) -> dict: ...
    async def snapshot(self) -> dict: ...


class LocalBackend:
    """One Engine in this process, shared by every request (its scheduler batches them)."""

    kind = "engine"

    def __init__(self, engine, book: ExpertBook | None = None, routing_stats: bool = True):
        self.engine = engine
        self.book = book or ExpertBook(engine)
        if routing_stats:
            engine.count_routed_tokens()        # the engine's own counter: no routing hook
        if engine.hotplug is not None:
            self.book.attach(engine.hotplug)
        self.calls = Calls(engine)
        engine.scheduler.budget()               # its KV pool and prefix cache, for /metrics
        self.model_cfg = engine.model_cfg
        self.tokenizer = engine.tokenizer
        self.model_dir = engine.model_dir
        self.num_experts = engine.num_experts
        self.max_call_tokens = engine.config.max_call_tokens   # checked before any work
        self._tasks: list = []
        self._upload_locks: dict[str, list] = {}     # name -> [lock, users]

    # -- life cycle ---------------------------------------------------------------------
    async def startup(self) -> None:
        self._tasks = [asyncio.create_task(self._apply_expert_changes_while_idle())]

    async def shutdown(self, deadline_s: float) -> None:
        for t in self._tasks:
            t.cancel()
        candidates.stop(self.engine)
        await asyncio.to_thread(self.calls.stop, deadline_s)
        self.engine.close()

    async def _apply_expert_changes_while_idle(self, period: float = 0.2) -> None:
        """The scheduler adopts queued expert changes before every step; while no step
        runs, this does, so that a dropped expert goes live without waiting for traffic."""
        if self.engine.hotplug is None:
            return
        sched = self.engine.scheduler
        while True:
            await asyncio.sleep(period)
            if sched.running or sched.queued:
                continue
            try:
                await asyncio.to_thread(self.engine.apply_expert_changes)
            except Exception:  # noqa: BLE001 - retried at the next period
                log.exception("applying expert changes while idle failed")

    # -- requests -----------------------------------------------------------------------
    def generate(self, p, request_id: str, timeout_s, stream: bool = True):
        return self.calls.submit(lambda ctx: run_generation(ctx, p, self.book),
                                 request_id=request_id, timeout_s=timeout_s)

    def score(self, raw: list, experts, request_id: str, timeout_s):
        return self.calls.submit(lambda ctx: run_score(ctx, score_items(ctx.engine, raw),
                                                       experts, self.book),
                                 request_id=request_id, timeout_s=timeout_s)

    def retry_after_s(self) -> int:
        return self.calls.retry_after_s()

    def trim_memory(self) -> None:
        """Idle: the engine's step scratch back to a small step's, then the heap's free
        memory back to the system (a thread's work: it waits for the scheduler)."""
        self.engine.trim_memory()
        memory.trim()

    def cancel_all(self) -> None:
        """Past the shutdown grace period: every request in flight ends with a 503."""
        self.calls.cancel_all("shutdown")

    @property
    def running(self) -> int:
        return self.calls.running

    # -- experts ------------------------------------------------------------------------
    def stamp(self) -> tuple[int, str]:
        return self.book.stamp()

    async def listing(self) -> dict:
        return self.book.listing()

    def _hotplug(self, what: str):
        if self.engine.hotplug is None:
            raise ApiError(409, f"this server watches no experts folder: {what}",
                           code="no_hotplug")
        return self.engine.hotplug

    async def rollback(self, name: str) -> dict:
        self._hotplug("nothing to roll back").rollback(name)
        return {"name": name, "status": "queued", "detail": "the previous version goes live "
                "between two tokens; GET /v1/experts shows it"}

    async def upload(self, name: str, data: bytes, sha: str) -> dict:
        folder = Path(self._hotplug("nowhere to upload to").experts_dir)
        final = folder / (name if name.endswith(".so") else f"{name}.so")
        # Uploads of one name take turns (the last one wins), each through a temporary
        # file of its own.
        turn = self._upload_locks.setdefault(final.name, [asyncio.Lock(), 0])
        turn[1] += 1
        try:
            async with turn[0]:
                await asyncio.to_thread(write_atomic, final, data, suffix=".upload")
        finally:
            turn[1] -= 1
            if not turn[1]:
                self._upload_locks.pop(final.name, None)
        return {"name": name, "path": str(final), "sha256": sha, "status": "written",
                "detail": "the folder's checks and probe run next; GET /v1/experts shows "
                          "adoption or refusal"}

    # -- what /metrics and the status page read -----------------------------------------
    async def snapshot(self) -> dict:
        return self.snapshot_now()

    def snapshot_now(self) -> dict:
        eng, book = self.engine, self.book
        g, sid = book.stamp()
        return {"expert_set_generation": g, "expert_set_id": sid,
                "queue_depth": eng.scheduler.queued, "batch_size": eng.scheduler.running,
                "requests_running": self.calls.running, "adoptions": book.adoptions,
                "refusals": book.refusal_counts(), "routed": book.routed_by_name(),
                "mixed_set_steps": eng.model.pipeline.mixed_passes,
                "kv_pool": {"free_tokens": eng.kv_pool.free_tokens,
                            "capacity_tokens": eng.kv_pool.capacity_tokens},
                "prefix_cache": prefix.stats() if (prefix := eng.scheduler.prefix) else None,
                "families": candidates.families(eng)}
