"""What every route shares (app.py mounts each route through `endpoint()`): the request
id (X-Request-ID echoed or generated), the API key on /v1 routes, errors as OpenAI JSON,
the access-log line and the request counter (`Record`), and reading a call's events while
watching for the client's disconnect."""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..runtime.events import End, TokenEvent
from .errors import ApiError, from_exception
from .limits import ClientGone

access_log = logging.getLogger("colibri.server.access")

_RID_RE = re.compile(r"[\x21-\x7e]{1,128}")
HEAVY_ROUTES = ("completions", "chat", "score", "upload")   # the heap is trimmed after them


class Record:
    """One request's access-log line and counters, finished once."""

    def __init__(self, server, rid: str, route: str):
        self.server = server
        self.rid = rid
        self.route = route
        self.t0 = time.perf_counter()
        self.prompt_tokens = 0
        self.tokens = 0
        self.first_s: Optional[float] = None
        self.last_tok: dict[int, float] = {}
        self.gens: list = []
        self.deferred = False
        self.done = False

    def see(self, ev) -> None:
        """Observe an engine event (first-token and per-token timing, versions)."""
        m = self.server.metrics
        if isinstance(ev, TokenEvent):
            now = time.perf_counter()
            if ev.token_id >= 0:
                self.tokens += 1
                m.tokens.labels("completion").inc()
            if self.first_s is None:
                self.first_s = now - self.t0
                m.first_token.observe(self.first_s)
            prev = self.last_tok.get(ev.choice)
            if prev is not None and ev.token_id >= 0:
                m.per_token.observe(now - prev)
            self.last_tok[ev.choice] = now
            if not self.gens or self.gens[-1] != ev.expert_set_generation:
                self.gens.append(ev.expert_set_generation)
        elif isinstance(ev, End):
            self.prompt_tokens += ev.prompt_tokens
            m.tokens.labels("prompt").inc(ev.prompt_tokens)

    def finish(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        if self.route in HEAVY_ROUTES:
            self.server.trim_pending = True
        m = self.server.metrics
        m.requests.labels(self.route, str(status)).inc()
        if status == 499:
            m.cancelled.labels("disconnect").inc()
        elif status == 504:
            m.cancelled.labels("timeout").inc()
        total = (time.perf_counter() - self.t0) * 1000
        first = f"{self.first_s * 1000:.1f}" if self.first_s is not None else "-"
        gens = ",".join(map(str, self.gens)) or "-"
        access_log.info("%s %s %d prompt=%d tokens=%d first_ms=%s total_ms=%.1f gen=%s",
                        self.rid, self.route, status, self.prompt_tokens, self.tokens, first,
                        total, gens, extra={"fields": {     # --log-format json's fields
                            "request_id": self.rid, "route": self.route, "status": status,
                            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                            "first_ms": None if self.first_s is None else
                            round(self.first_s * 1000, 1), "total_ms": round(total, 1),
                            "generations": self.gens}})


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id", "")
    return rid if _RID_RE.fullmatch(rid) else f"req-{uuid.uuid4().hex[:16]}"


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def endpoint(server, route: str, fn, auth: bool = True):
    async def handler(request: Request) -> Response:
        rid = _request_id(request)
        rec = Record(server, rid, route)
        try:
            if auth:
                server.check_auth(request)
            response = await fn(server, request, rec)
        except asyncio.CancelledError:
            rec.finish(499)
            raise
        except ClientGone:                # one line in the access log, not a 500
            response = Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style answer
            response = error_response(from_exception(e, rid, server.backend.retry_after_s()))
        response.headers["X-Request-ID"] = rid
        if not rec.deferred:
            rec.finish(response.status_code)
        return response
    return handler


async def _watch_disconnect(request: Request, stream) -> None:
    """Cancel the job when the client goes away while we wait (non-streaming answers)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            stream.cancel("disconnect")
            return


async def collect(request: Request, stream, rec: Record, until_token: bool) -> list:
    """Events of `stream` until its end (or its first token), watching for a disconnect."""
    events = []
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    try:
        async for ev in stream:
            rec.see(ev)
            events.append(ev)
            if until_token and isinstance(ev, TokenEvent):
                break
    finally:
        watcher.cancel()
    return events
