"""The ASGI app: OpenAI routes, /v1/score, /v1/experts, /metrics, /health, /ready, /.

One `Server` object holds the backend (backend.py: one engine in this process, or a
fleet of engine replicas over Ray Serve, colibri_core/fleet/), the metrics and the chat
template. The routes are the module-level functions below, each of (the Server, the
request, its endpoint.Record): they only read requests, submit work to the backend (a
backend.Backend) and shape answers, whichever backend it is; build_app() mounts each
through endpoint.endpoint(), which does what all routes share (request id, API key,
errors as OpenAI JSON, the access-log line, the request counter).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import candidates, harmony, params, surface, toolstream, tools as toolcalls, training
from .calls import Cancelled
from .chat import ChatTemplate
from .errors import ApiError, bad_request, from_exception
from .experts import events_answer
from ..runtime.events import TokenEvent
from .endpoint import collect, endpoint, error_response
from .limits import LIMITS, check_upload, read_body, read_json, text_bound
from .metrics import ServerMetrics
from .responses import SSE_DONE, Chunker, Collector, sse

log = logging.getLogger("colibri.server")

GEN_HEADER = "X-Colibri-Expert-Set-Generation"
SET_HEADER = "X-Colibri-Expert-Set-Id"


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    cors_origins: list = field(default_factory=list)
    strict_params: bool = False
    allow_expert_upload: bool = False
    upload_allowlist: Optional[frozenset] = None    # sha256 digests an upload may have
    allow_expert_training: bool = False  # POST /v1/experts/train (training.py)
    train_data_dir: Optional[str] = None   # the folder its `path` may name files in
    queue_size: int = 256              # the engine's max_queued_requests (serve.py sets it)
    request_timeout_s: Optional[float] = 600.0
    shutdown_timeout_s: float = 10.0
    client_timeout_s: float = 10.0      # headers within it; no pause in a body over it
    model_id: str = "colibri"
    aliases: tuple = ()                 # --served-model-name: other names requests may give
    ctx_size: Optional[int] = None      # --ctx-size: per-request context (None: the model's)
    log_level: Optional[str] = None     # --log-level (None: info for ours, as always)
    log_format: str = "text"            # --log-format: text or json (logs.py)
    routing_stats: bool = True          # count routed tokens per expert


class Server:
    """The backend (backend.py: one engine here, or a fleet of replicas) and everything
    the routes share."""

    def __init__(self, backend, settings: Settings):
        self.backend = backend
        self.settings = settings
        self.metrics = ServerMetrics(self)
        self.template = ChatTemplate.from_model_dir(backend.model_dir)
        # gpt-oss: every chat answer is read by its channels (harmony.py)
        self.harmony = harmony.Harmony.of(backend.tokenizer) \
            if self.template is not None and harmony.is_harmony(self.template.source) else None
        self.ready = False
        self.started_at = time.time()
        self.last_snapshot: dict = {}
        self._tasks: list = []
        self.trim_pending = False        # requests ended since the heap was last trimmed

    # -- life cycle (the app's lifespan) ------------------------------------------------
    async def startup(self) -> None:
        await self.backend.startup()
        self.last_snapshot = await self.backend.snapshot()
        self._tasks = [asyncio.create_task(self._sample_every_second()),
                       asyncio.create_task(self._watch_loop_lag())]
        self.ready = True

    async def shutdown(self) -> None:
        self.ready = False
        training.close(self)
        for t in self._tasks:
            t.cancel()
        await self.backend.shutdown(self.settings.shutdown_timeout_s)

    async def _watch_loop_lag(self, period: float = 0.05) -> None:
        """A blocked event loop delays every stream: measure how late it wakes."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - t - period))

    async def _sample_every_second(self) -> None:
        while True:
            try:
                self.last_snapshot = await self.backend.snapshot()
                self.metrics.sample(self.last_snapshot["routed"])
                if self.trim_pending and not self.backend.running:
                    self.trim_pending = False        # idle again: give the heap back
                    await asyncio.to_thread(self.backend.trim_memory)
            except Exception:  # noqa: BLE001 - the status window is best effort
                log.exception("status sample failed")
            await asyncio.sleep(1.0)

    # -- shared request plumbing --------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    def versions(self) -> tuple[int, str]:
        """(expert_set_generation, expert_set_id) of the current expert set."""
        return self.backend.stamp()


# ----------------------------------------------------------------------------- routes
# Each route is a module-level function of (the Server, the request, its Record).


def version_headers(S: Server, events) -> dict:
    first = next((e for e in events if isinstance(e, TokenEvent)), None)
    g, sid = (first.expert_set_generation, first.expert_set_id) if first is not None \
        else S.versions()
    return {GEN_HEADER: str(g), SET_HEADER: sid}


async def openai_run(S: Server, request, rec, p, chat: bool, stream: bool, include_usage: bool,
                     reader=None):
    """`reader()`: a new reader of one choice's answer (toolstream.py; None: its text is
    the content)."""
    eng, st = S.backend, S.settings
    rid_body = ("chatcmpl-" if chat else "cmpl-") + rec.rid
    created = int(time.time())
    p.ctx_size = st.ctx_size
    job = eng.generate(p, rec.rid, st.request_timeout_s, stream)
    logprobs = p.logprobs is not None
    if not stream:
        try:
            events = await collect(request, job, rec, until_token=False)
        except Cancelled:
            return Response(status_code=499)
        coll = Collector(chat, logprobs, p.return_token_ids)
        for ev in events:
            coll.add(ev)
        body = coll.body(rid_body, created, st.model_id, job.result, S.versions())
        if reader is not None:             # content, reasoning, calls (toolstream.py)
            body = toolstream.rewrite_body(body, events, reader)
        return JSONResponse(body, headers=version_headers(S, events))
    try:
        first = await collect(request, job, rec, until_token=True)
    except Cancelled:
        return Response(status_code=499)
    chunker = Chunker(rid_body, created, st.model_id, chat, logprobs, include_usage,
                      p.return_token_ids)
    if reader is not None:
        chunker = toolstream.Chunker(chunker, reader)
    rec.deferred = True

    async def body():
        status, finished = 200, False
        try:
            for ev in first:
                c = chunker.chunk(ev)
                if c is not None:
                    yield sse(c)
            async for ev in job:
                rec.see(ev)
                c = chunker.chunk(ev)
                if c is not None:
                    yield sse(c)
            finished = True
            if include_usage:
                yield sse(chunker.usage_chunk(job.result))
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except Exception as e:  # noqa: BLE001 - sent in the stream, then [DONE]
            finished = True
            err = from_exception(e, rec.rid, S.backend.retry_after_s())
            status = err.status
            yield sse(err.body())
            yield SSE_DONE
        finally:
            if not finished:
                job.cancel("disconnect")
                status = 499
            rec.finish(status)
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**version_headers(S, first), "Cache-Control": "no-cache",
                                      "X-Request-ID": rec.rid})


async def completions(S: Server, request, rec):
    eng, st = S.backend, S.settings
    body = await read_json(request, LIMITS["generate"])
    surface.check_model(body, st)
    params.check_fields(body, "completions", st.strict_params, rec.rid)
    p = await params.sampling_off_loop(body, eng, "completions")
    p.prompts = params.completion_prompts(body)
    stream, include_usage = params.stream_options(body)
    return await openai_run(S, request, rec, p, False, stream, include_usage)


async def chat_completions(S: Server, request, rec):
    eng, st = S.backend, S.settings
    body = await read_json(request, LIMITS["generate"])
    surface.check_model(body, st)
    # gpt-oss's template reads reasoning_effort (elsewhere: a 400, unimplemented)
    effort = body.pop("reasoning_effort", None) if S.harmony is not None else None
    params.check_fields(body, "chat", st.strict_params, rec.rid)
    p = await params.sampling_off_loop(body, eng, "chat")
    messages, prefix_k = params.chat_messages(body)
    if S.template is None or eng.tokenizer is None:
        raise bad_request(f"this model ({eng.model_dir}) has no chat template "
                          f"(chat_template.jinja or tokenizer_config.json's "
                          f"chat_template): use /v1/completions", param="messages",
                          code="no_chat_template")
    tools = toolcalls.read(body, S.template)      # None: no tools, or tool_choice none
    if tools is not None and tools.fmt == "harmony" and S.harmony is None:
        raise bad_request(f"tools: this model's template is gpt-oss's (harmony) but its "
                          f"tokenizer lacks harmony's special tokens "
                          f"({', '.join(harmony.TOKENS)})", param="tools")
    if S.harmony is not None and p.sampling.grammar is not None:   # the final message's
        p.sampling = dataclasses.replace(p.sampling, grammar=await asyncio.to_thread(
            harmony.final_answer, p.sampling.grammar, S.harmony))
    if tools is not None:
        g = None if tools.choice == "auto" else \
            await asyncio.to_thread(toolcalls.grammar, tools, eng.tokenizer)  # required, named
        if g is not None and p.sampling.grammar is not None:
            raise bad_request("tool_choice: required or a named function is not possible "
                              "with response_format or grammar", param="tool_choice")
        if g is not None:
            p.sampling = dataclasses.replace(p.sampling, grammar=g)
    extra, reader = {}, None
    if S.harmony is not None:
        messages = harmony.template_messages(messages)
        p.stop_token_ids = S.harmony.stop_ids()       # <|call|> ends an answer too
        if effort is not None:
            if effort not in ("low", "medium", "high"):
                raise bad_request(f"reasoning_effort: {effort!r:.30} is not low, medium or "
                                  f"high", param="reasoning_effort")
            extra["reasoning_effort"] = effort
        names = set(tools.by_name()) if tools is not None else set()
        reader = lambda: harmony.HarmonyReader(S.harmony, names)  # noqa: E731
    elif tools is not None:
        reader = lambda: toolstream.CallReader(  # noqa: E731
            tools.fmt, set(tools.by_name()), eng.tokenizer)
    # Rendered and tokenized off the event loop, no more text than the context holds.
    ids = await asyncio.to_thread(S.template.prompt_ids, messages, eng.tokenizer,
                                  text_bound(eng, spare=16),
                                  tools.tools if tools is not None else None, **extra)
    if not ids:
        raise bad_request("messages: the chat template rendered them as empty text",
                          param="messages")
    p.prompts = [ids]
    if p.experts_per_token is None:
        p.experts_per_token = prefix_k
    stream, include_usage = params.stream_options(body)
    return await openai_run(S, request, rec, p, True, stream, include_usage, reader)


async def score(S: Server, request, rec):
    eng, st = S.backend, S.settings
    body = await read_json(request, LIMITS["score"])
    surface.check_model(body, st)
    # a thread: checking up to millions of token ids is Python work the loop shares
    raw, experts = await asyncio.to_thread(params.score_request, body, eng)
    job = eng.score(raw, experts, rec.rid, st.request_timeout_s)
    try:
        await collect(request, job, rec, until_token=False)
    except Cancelled:
        return Response(status_code=499)
    out = job.result
    rec.prompt_tokens = out["usage"]["prompt_tokens"]
    S.metrics.tokens.labels("prompt").inc(rec.prompt_tokens)
    g = out["expert_sets"][0]
    return JSONResponse({"object": "score", "model": st.model_id, **out},
                        headers={GEN_HEADER: str(g["generation"]), SET_HEADER: g["id"]})


async def models(S: Server, request, rec):
    st = S.settings
    return JSONResponse({"object": "list", "data": [
        surface.model_card(S, name) for name in surface.model_names(st)]})


async def experts(S: Server, request, rec):
    eng = S.backend
    return JSONResponse(await eng.listing())


async def expert_events(S: Server, request, rec):
    eng = S.backend
    return JSONResponse(events_answer(eng, request.query_params))


async def rollback(S: Server, request, rec):
    eng = S.backend
    return JSONResponse(await eng.rollback(request.path_params["name"]), status_code=202)


async def upload(S: Server, request, rec):
    eng, st = S.backend, S.settings
    name = request.path_params["name"]
    check_upload(st, name)
    data = await read_body(request, LIMITS["upload"])
    sha = hashlib.sha256(data).hexdigest()
    allow = st.upload_allowlist
    if not allow or sha not in allow:
        raise ApiError(403, f"sha256 {sha} is not on the server's upload allowlist",
                       type="permission_error", code="allowlist")
    return JSONResponse(await eng.upload(name, data, sha), status_code=202)


async def health(S: Server, request, rec):
    return JSONResponse({"status": "ok"})


async def ready(S: Server, request, rec):
    st = S.settings
    if not S.ready:
        return JSONResponse({"ready": False}, status_code=503)
    g, sid = S.versions()
    return JSONResponse({"ready": True, "model": st.model_id,
                         "expert_set_generation": g, "expert_set_id": sid})


async def metrics(S: Server, request, rec):
    eng = S.backend
    S.last_snapshot = await eng.snapshot()
    data, ctype = S.metrics.render()
    return Response(data, media_type=ctype)


async def status_json(S: Server, request, rec):
    eng, st = S.backend, S.settings
    listing = await eng.listing()
    snap = S.last_snapshot = await eng.snapshot()
    return JSONResponse({"model": st.model_id, "model_dir": str(eng.model_dir),
                         "backend": eng.kind, "uptime_s": time.time() - S.started_at,
                         "queue_depth": snap["queue_depth"],
                         "running": snap["batch_size"], "kv_pool": snap["kv_pool"],
                         "prefix_cache": snap.get("prefix_cache"),
                         "expert_set_generation": listing["expert_set_generation"],
                         "expert_set_id": listing["expert_set_id"],
                         "experts": listing["data"], "refusals": listing["refusals"][:10],
                         "candidates": listing.get("candidates", []),
                         "events": listing.get("events", [])[::-1],
                         "watched_folder": listing["watched_folder"],
                         "routing_stats": st.routing_stats,
                         **{k: snap[k] for k in ("rollout", "replica_failures", "expert_shards")
                            if k in snap},
                         "window": S.metrics.window(60.0)})


async def index(S: Server, request, rec):
    st = S.settings
    page = (Path(__file__).parent / "status.html").read_text(encoding="utf-8")
    return HTMLResponse(page.replace("{{MODEL}}", _html_escape(st.model_id)))


def build_app(server: Server) -> Starlette:
    """The Starlette app: the routes above, each through endpoint(), and the lifespan."""
    S = server
    st = server.settings

    def r(path, fn, name, methods=("GET",), auth=True):
        return Route(path, endpoint(S, name, fn, auth=auth), methods=list(methods))

    routes = [
        r("/v1/completions", completions, "completions", ("POST",)),
        r("/v1/chat/completions", chat_completions, "chat", ("POST",)),
        r("/v1/score", score, "score", ("POST",)),
        r("/v1/models", models, "models"),
        *(r(path, fn, name, methods) for path, fn, name, methods in surface.routes()),
        r("/v1/experts", experts, "experts"),
        r("/v1/experts/events", expert_events, "expert_events"),
        r("/v1/experts/{name}/rollback", rollback, "rollback", ("POST",)),
        *(r(path, fn, name, methods) for path, fn, name, methods in candidates.routes()),
        *(r(path, fn, name, methods) for path, fn, name, methods in training.routes()),
        r("/v1/experts/{name}", upload, "upload", ("PUT",)),
        r("/health", health, "health", auth=False),
        r("/ready", ready, "ready", auth=False),
        r("/metrics", metrics, "metrics", auth=False),
        r("/status.json", status_json, "status", auth=False),
        r("/", index, "index", auth=False),
    ]

    async def http_error(request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" \
            if exc.status_code == 405 else "http_error"
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
        err = ApiError(exc.status_code, msg, code=code)
        resp = error_response(err)
        S.metrics.requests.labels("unknown", str(exc.status_code)).inc()
        return resp

    middleware = []
    if st.cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(st.cors_origins),
                                     allow_methods=["*"], allow_headers=["*"],
                                     expose_headers=["X-Request-ID", GEN_HEADER, SET_HEADER]))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await S.startup()
        try:
            yield
        finally:
            await S.shutdown()

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: http_error, 405: http_error})
    app.state.client_timeout_s = st.client_timeout_s        # read_body's deadlines
    return app


def _html_escape(s: str) -> str:
    import html
    return html.escape(s)
