"""The fleet's ingress: `colibri serve`'s ASGI app (server/app.py, unchanged) on a backend
that calls the engine replicas through a Ray Serve deployment handle.

RayBackend satisfies server/backend.py's Backend protocol, as LocalBackend does; a completion is one call of
the replicas' streaming `generate` (replica.py: lists of events, then an Outcome), a
score one call of `score`; the expert routes and the fleet's metrics go to the registry.

A replica that dies under a request (its process killed, its node gone):
  - a stream that has sent tokens ends with an OpenAI-style error event, code 503;
  - a stream that has not (no token yet, so no HTTP answer either) gets a 503;
  - a non-streaming request (completion or score) is sent once more, through the handle
    (Serve routes it to a live replica); a second failure is a 503.
Each case is counted: `colibri_replica_failures_total{outcome=stream_ended|not_started|
retried|retry_failed}` on /metrics and `replica_failures` in /status.json.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Optional

from ..config import load_model_config
from ..server.calls import Cancelled
from ..server.errors import ApiError, RequestTimeout, ShuttingDown
from ..runtime.events import TokenEvent
from .replica import Outcome

log = logging.getLogger("colibri.fleet")

OUTCOMES = ("stream_ended", "not_started", "retried", "retry_failed")
# the prefix-cache figures /metrics shows, each the sum over the live replicas
PREFIX_COUNTS = ("hits", "misses", "reused_tokens", "evictions", "bytes", "capacity_bytes")


class ReplicaLost(ApiError):
    def __init__(self, what: str):
        super().__init__(503, f"the engine replica serving this request stopped ({what}); "
                              f"retry: the fleet routes it to another replica",
                         type="server_error", code=503, headers={"Retry-After": "1"})


class RemoteCall:
    """One request on a replica, iterated like calls.py's Call: `async for` events,
    `.result`, `.cancel(why)`."""

    def __init__(self, backend: "RayBackend", method: str, args: tuple, stream: bool,
                 timeout_s: Optional[float]):
        self.backend, self.method, self.args = backend, method, args
        self.stream = stream            # events passed on as they come (no retry)
        self.timeout_s = timeout_s
        self.result = None
        self.cancel_reason: Optional[str] = None
        self._buffer: deque = deque()
        self._response = None
        self._done = False
        self._tokens_out = False
        self._t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_s, self.cancel, "timeout") if timeout_s else None
        backend.live.add(self)

    def cancel(self, why: str = "disconnect") -> None:
        if self.cancel_reason is not None or self._done:
            return
        self.cancel_reason = why
        if self._response is not None:
            self._response.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._buffer:
            if self._done:
                raise StopAsyncIteration
            try:
                await (self._pull() if self.stream else self._whole())
            except BaseException:
                self._finish()
                raise
        ev = self._buffer.popleft()
        if isinstance(ev, TokenEvent):
            self._tokens_out = True
        return ev

    async def _call(self):
        h = self.backend.engines
        if self.method == "generate":
            self._response = h.options(stream=True).generate.remote(*self.args)
        else:
            self._response = getattr(h, self.method).remote(*self.args)
        if self.cancel_reason is not None:
            self._response.cancel()
        return self._response

    async def _pull(self) -> None:
        """Streaming: the next list of events from the replica."""
        try:
            if self._response is None:
                await self._call()
            batch = await self._response.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica, its node or the call is gone
            self._raise_cancelled()
            lost = "stream_ended" if self._tokens_out else "not_started"
            self.backend.failed(lost, e)
            raise ReplicaLost(type(e).__name__) from None
        self._take(batch)

    async def _whole(self) -> None:
        """Non-streaming: the whole answer, from a second replica if the first died."""
        for attempt in (0, 1):
            try:
                await self._call()
                if self.method == "generate":
                    items = [x async for batch in self._response for x in batch]
                else:
                    items = [await self._response]
            except Exception as e:  # noqa: BLE001
                self._raise_cancelled()
                self.backend.failed("retried" if attempt == 0 else "retry_failed", e)
                if attempt == 0:
                    self._response = None
                    continue
                raise ReplicaLost(type(e).__name__) from None
            self._take(items)
            if not self._done:
                raise ReplicaLost("answer without an end")
            return

    def _take(self, items: list) -> None:
        for x in items:
            if isinstance(x, Outcome):
                self._done = True
                if x.error is not None:
                    status, message, type_, param, code, headers = x.error
                    raise ApiError(status, message, type=type_, param=param, code=code,
                                   headers=headers)
                self.result = x.result
            else:
                self._buffer.append(x)

    def _raise_cancelled(self) -> None:
        why = self.cancel_reason
        if why == "timeout":
            raise RequestTimeout(self.timeout_s)
        if why == "shutdown":
            raise ShuttingDown()
        if why is not None:
            raise Cancelled(why)

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self in self.backend.live:
            self.backend.live.discard(self)
            self.backend.took(time.monotonic() - self._t0)


class RayBackend:
    """The fleet, seen by server/app.py's routes."""

    kind = "ray"

    def __init__(self, engines, model_dir: str):
        from ..runtime.tokenizer import Tokenizer
        from .registry import get_registry
        self.engines = engines                      # Serve's handle on the engine replicas
        self.registry = get_registry()
        self.model_dir = Path(model_dir)
        self.model_cfg = load_model_config(self.model_dir / "config.json")
        tok = self.model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer(tok, self.model_cfg.vocab_size) if tok.exists() else None
        self.num_experts = self.model_cfg.num_experts
        self.live: set = set()
        self.failures = dict.fromkeys(OUTCOMES, 0)
        self._avg_s = 1.0
        self._stamp = (0, "")
        self._stopping = False

    async def startup(self) -> None:
        await self.snapshot()

    async def shutdown(self, deadline_s: float) -> None:
        self._stopping = True
        end = time.monotonic() + deadline_s
        while self.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for c in list(self.live):
            c.cancel("shutdown")

    # -- requests -----------------------------------------------------------------------
    def _start(self, method: str, args: tuple, stream: bool, timeout_s) -> RemoteCall:
        if self._stopping:
            raise ShuttingDown()
        return RemoteCall(self, method, args, stream, timeout_s)

    def generate(self, p, request_id: str, timeout_s, stream: bool = True):
        return self._start("generate", (p, request_id, timeout_s), stream, timeout_s)

    def score(self, raw: list, experts, request_id: str, timeout_s):
        return self._start("score", (raw, experts, request_id, timeout_s), False, timeout_s)

    def failed(self, outcome: str, e: BaseException) -> None:
        self.failures[outcome] += 1
        log.warning("replica failure (%s): %s: %s", outcome, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")

    def took(self, seconds: float) -> None:
        self._avg_s = 0.8 * self._avg_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        return max(1, int(self._avg_s + 0.999))

    @property
    def running(self) -> int:
        return len(self.live)

    def trim_memory(self) -> None:
        """Idle: this process's free heap back to the system (the replicas trim theirs)."""
        from ..server import memory
        memory.trim()

    def cancel_all(self) -> None:
        """Past the shutdown grace period: every request in flight ends with a 503."""
        for c in list(self.live):
            c.cancel("shutdown")

    # -- experts: the registry ----------------------------------------------------------
    def stamp(self) -> tuple[int, str]:
        return self._stamp

    async def listing(self) -> dict:
        out = await self.registry.listing.remote()
        self._stamp = (out["expert_set_generation"], out["expert_set_id"])
        return out

    @staticmethod
    def _checked(answer: dict) -> dict:
        if "error" in answer:
            status, message, code = answer["error"]
            raise ApiError(status, message, code=code)
        return answer

    async def rollback(self, name: str) -> dict:
        r = self._checked(await self.registry.rollback.remote(name))
        return {"name": name, "status": "queued", "generation": r["generation"],
                "detail": "the registry's previous version goes to every replica; GET "
                          "/v1/experts shows the rollout"}

    async def upload(self, name: str, data: bytes, sha: str) -> dict:
        r = self._checked(await self.registry.upload.remote(name, data))
        return {"name": name, "sha256": sha, "status": "registered" if r["changed"]
                else "unchanged", "generation": r["generation"],
                "detail": "every replica writes it into its folder, whose checks and probe "
                          "run next; GET /v1/experts shows the rollout"}

    # -- the fleet's metrics --------------------------------------------------------------
    async def snapshot(self) -> dict:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        fleet = await self.registry.snapshot.remote()
        self._stamp = (fleet["generation"], fleet["expert_set_id"])
        reps = fleet["replicas"]
        total = {"queue_depth": 0, "batch_size": 0, "adoptions": 0}
        refusals: dict = {}
        routed: dict = {}
        kv = {"free_tokens": 0, "capacity_tokens": 0}
        prefix = None               # the replicas' prefix caches summed (None: all off)
        gen = GaugeMetricFamily("colibri_replica_expert_set_generation", "The registry "
                                "generation each engine replica serves", labels=["replica"])
        queue = GaugeMetricFamily("colibri_replica_queue_depth", "Engine requests waiting "
                                  "on each replica", labels=["replica"])
        for rid, r in reps.items():
            c = r["counters"]
            for k in total:
                total[k] += c.get(k, 0)
            for k, n in c.get("refusals", {}).items():
                refusals[k] = refusals.get(k, 0) + n
            for k, n in c.get("routed", {}).items():
                routed[k] = routed.get(k, 0) + n
            for k in kv:
                kv[k] += c.get("kv_pool", {}).get(k, 0)
            pc = c.get("prefix_cache")
            if pc:
                prefix = prefix or dict.fromkeys(PREFIX_COUNTS, 0)
                for k in PREFIX_COUNTS:
                    prefix[k] += pc.get(k, 0)
            gen.add_metric([rid], r["generation"] if r["generation"] is not None else -1)
            queue.add_metric([rid], c.get("queue_depth", 0))
        fails = CounterMetricFamily("colibri_replica_failures", "Requests whose replica "
                                    "stopped under them, by what the client got",
                                    labels=["outcome"])
        for k, n in self.failures.items():
            fails.add_metric([k], n)
        ro = fleet["rollout"]
        states = GaugeMetricFamily("colibri_fleet_replicas", "Engine replicas by the state "
                                   "of the current generation's rollout", labels=["state"])
        for k in ("adopted", "pending", "failed", "lost"):
            states.add_metric([k], len(ro[k]))
        return {"expert_set_generation": fleet["generation"],
                "expert_set_id": fleet["expert_set_id"], **total, "refusals": refusals,
                "routed": routed, "kv_pool": kv, "prefix_cache": prefix,
                "requests_running": len(self.live),
                "families": [gen, queue, fails, states], "rollout": ro,
                "replica_failures": dict(self.failures)}


class Ingress:
    """The ingress deployment's body: the ASGI app over RayBackend (deploy.py wraps it
    with serve.ingress(); Serve runs the app's lifespan)."""

    def __init__(self, engines, model_dir: str, settings: dict, expected_replicas: int = 1):
        from ..server.app import Server, Settings, build_app
        from .placement import ReadyGate
        backend = RayBackend(engines, model_dir)
        self.server = Server(backend, Settings(**settings))
        # /ready counts the replicas that report (placement.py)
        self.asgi = ReadyGate(build_app(self.server), backend.registry, expected_replicas)

    def __serve_build_asgi_app__(self):
        return self.asgi
