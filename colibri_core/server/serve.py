"""Start the server: build the engine, print what is served, run uvicorn (one worker).

SIGTERM (and Ctrl-C) stop accepting connections, let requests in flight finish within
the shutdown deadline (then cancel them), close the engine and exit 0 (130 for Ctrl-C).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..files import read_text
from .app import Server, Settings, build_app
from .backend import LocalBackend
from .experts import ExpertBook

API_KEY_ENV = "COLIBRI_API_KEY"
SERVE_PREFIX_CACHE_MB = 256.0   # prefix caching's default in the server (docs/SERVE.md)
STREAM_CLOSE_S = 5.0     # after the grace period: for streams to send their error and [DONE]



def add_speculation_arguments(p) -> None:
    """--speculative-decoding / --draft-tokens (colibri run and serve)."""
    p.add_argument("--speculative-decoding", choices=["off", "prompt_lookup"],
                   dest="speculative_decoding",
                   help="self-speculative decoding: prompt_lookup drafts tokens from the "
                        "text so far and verifies them in one step (same output; default "
                        "off, docs/BENCHMARKS.md \"Self-speculative decoding\")")
    p.add_argument("--draft-tokens", type=int, dest="draft_tokens", metavar="N",
                   help="at most N draft tokens per decode step (default 4)")


def speculation_overrides(args, overrides: dict) -> None:
    if getattr(args, "speculative_decoding", None):
        overrides["speculative_decoding"] = args.speculative_decoding
    if getattr(args, "draft_tokens", None) is not None:
        overrides["draft_tokens"] = args.draft_tokens


def prefix_overrides(args, base, overrides: dict) -> None:
    """--prefix-cache-mb; without it the server keeps SERVE_PREFIX_CACHE_MB of prefixes,
    unless the config sets prefix_cache_mb or a memory limit (which would have to hold
    them: then the config's value, 0 by default)."""
    mb = getattr(args, "prefix_cache_mb", None)
    if mb is not None:
        if not mb >= 0:
            raise ConfigError(f"--prefix-cache-mb {mb}: expected MB >= 0 (0: off)")
        overrides["prefix_cache_mb"] = mb
    elif "prefix_cache_mb" not in base.model_fields_set and base.max_resident_mb is None \
            and base.process_limit_mb is None:
        overrides["prefix_cache_mb"] = SERVE_PREFIX_CACHE_MB


def default_experts_dir(configured: Optional[str]) -> Optional[str]:
    """The config's experts_dir, else ./experts_so when it exists (the repository's)."""
    if configured:
        return configured
    return "experts_so" if Path("experts_so").is_dir() else None


def load_allowlist(path: Optional[str]) -> Optional[frozenset]:
    if path is None:
        return None
    lines = read_text(path, lambda msg: ConfigError(f"--expert-allowlist {msg}")).split()
    bad = [x for x in lines if len(x) != 64 or any(c not in "0123456789abcdef" for c in x.lower())]
    if bad:
        raise ConfigError(f"--expert-allowlist {path}: {bad[0]!r:.70} is not a sha256 hex "
                          f"digest (expected one 64-character digest per line)")
    return frozenset(x.lower() for x in lines)


def run_server(engine_factory, settings: Settings, out=sys.stderr, backend=LocalBackend) -> int:
    """Build the engine (engine_factory()), bind, print the URL, serve until stopped;
    `backend(engine, book, routing_stats)` makes what the routes run on (fleet/
    shardserve.py's adds the expert shards' series)."""
    import uvicorn

    from . import logs, memory
    from .protocol import GracefulServer, with_header_timeout
    memory.pin_thresholds()             # before the engine's threads take their arenas
    _quiet_access_logs()
    # The engine's startup scan of the watched folder logs refusals before the server can
    # listen to its events: capture them for /v1/experts.
    book = ExpertBook(engine=None)
    logs.configure(settings.log_level, settings.log_format)
    with book.capture_startup_refusals():
        engine = engine_factory()
    try:
        book.engine = engine
        ctx = engine.model_cfg.max_position_embeddings
        if settings.ctx_size is not None and settings.ctx_size > ctx:
            raise ConfigError(f"--ctx-size {settings.ctx_size}: more than the model's "
                              f"context of {ctx} tokens")
        server = Server(backend(engine, book, settings.routing_stats), settings)
        sock = _bind(settings.host, settings.port)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        _print_banner(engine, server, url, out)
        app = build_app(server)
        # uvicorn's own deadline comes after ours (below), which ends streams cleanly.
        config = uvicorn.Config(app, log_level="warning", access_log=False, workers=1,
                                timeout_graceful_shutdown=settings.shutdown_timeout_s
                                + STREAM_CLOSE_S, lifespan="on",
                                http=with_header_timeout(settings.client_timeout_s),
                                # json: uvicorn's lines through our root handler (logs.py)
                                **({"log_config": None} if settings.log_format == "json"
                                   else {}))
        uv = GracefulServer(config, server)
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown; a no-op
        # handler underneath makes that re-raise harmless, so SIGTERM exits 0.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            uv.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
            sock.close()
        print("colibri: server stopped", file=out, flush=True)
        return 0
    finally:
        engine.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                          f"pick another port (--port 0 picks a free one)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _print_banner(engine, server: Server, url: str, out) -> None:
    cfg = engine.model_cfg
    s = server.settings
    print(f"colibri: model {s.model_id} ({engine.model_dir}): {cfg.architecture}, "
          f"{cfg.num_layers} layers ({len(cfg.moe_layers)} MoE, {cfg.num_experts} experts, "
          f"top-{cfg.top_k}), context {cfg.max_position_embeddings}", file=out)
    if engine.hotplug is None:
        print("colibri: experts: no watched folder (--experts-dir DIR, or run from a folder "
              "with experts_so/)", file=out)
    else:
        live = [r for r in engine.hotplug.list() if r["status"] == "active"]
        names = ", ".join(f"{r['name']} {r['version']} (slot {r['slot']})" for r in live)
        print(f"colibri: experts: watching {engine.hotplug.experts_dir}; adopted "
              f"{len(live)}{': ' + names if names else ''}", file=out)
        for r in server.backend.book.listing()["refusals"]:
            print(f"colibri: experts: refused {r['path']}: {r['reason']}", file=out)
    chat = "chat template " + ("yes" if server.template is not None else "none")
    auth = "API key required on /v1" if s.api_key else "no API key"
    generation, set_id = server.versions()
    print(f"colibri: {chat}; {auth}; queue {s.queue_size}; expert-set generation "
          f"{generation}, id {set_id[:16]}", file=out)
    print(f"colibri: serving {url}  (status page {url}/, OpenAI API {url}/v1)", file=out,
          flush=True)


def _quiet_access_logs() -> None:
    """Our access log: one line per request on stderr, `colibri: access: ...`."""
    lg = logging.getLogger("colibri.server.access")
    if not lg.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("colibri: access: %(message)s"))
        lg.addHandler(h)
        lg.propagate = False
    lg.setLevel(logging.INFO)
    logging.getLogger("colibri.server").setLevel(logging.INFO)


def api_key(args) -> Optional[str]:
    """--api-key, else --api-key-file's first line, else $COLIBRI_API_KEY."""
    path = getattr(args, "api_key_file", None)
    if args.api_key and path:
        raise ConfigError("--api-key and --api-key-file: give one of them")
    if path:
        text = read_text(path, lambda msg: ConfigError(f"--api-key-file {msg}"))
        key = text.splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise ConfigError(f"--api-key-file {path}: the file is empty (expected the key "
                              f"on its first line)")
        return key
    if args.api_key:
        logging.getLogger("colibri.server").warning(
            "--api-key puts the key in the process list (ps, /proc/PID/cmdline) for every "
            "local user to read: prefer $%s or --api-key-file", API_KEY_ENV)
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def settings_from_args(args, engine_cfg) -> Settings:
    key = api_key(args)
    allow = load_allowlist(args.expert_allowlist)
    if allow is None and engine_cfg.hotplug.allowlist:
        allow = frozenset(x.lower() for x in engine_cfg.hotplug.allowlist)
    if args.allow_expert_upload and (not key or not allow):
        raise ConfigError("--allow-expert-upload needs an API key (--api-key or "
                          f"${API_KEY_ENV}) and a hash allowlist (--expert-allowlist FILE or "
                          "the config's hotplug.allowlist): an uploaded expert is native code")
    training = getattr(args, "allow_expert_training", False)
    if training and (not key or not allow):
        raise ConfigError("--allow-expert-training needs an API key (--api-key or "
                          f"${API_KEY_ENV}) and a hash allowlist (--expert-allowlist FILE or "
                          "the config's hotplug.allowlist): a trained expert is native code")
    train_dir = getattr(args, "train_data_dir", None)
    if train_dir is not None and not os.path.isdir(train_dir):
        raise ConfigError(f"--train-data-dir {train_dir}: not a folder")
    ctx_size = getattr(args, "ctx_size", None)
    if ctx_size is not None and ctx_size < 1:
        raise ConfigError(f"--ctx-size {ctx_size}: expected at least 1 token")
    if args.queue_size < 1:
        raise ConfigError(f"--queue-size {args.queue_size}: expected at least 1")
    for flag, v in (("--request-timeout", args.request_timeout),
                    ("--client-timeout", getattr(args, "client_timeout", 10.0)),
                    ("--shutdown-timeout", getattr(args, "shutdown_timeout", 10.0))):
        if v is not None and not v > 0:
            raise ConfigError(f"{flag} {v}: expected seconds > 0")
    return Settings(host=args.host, port=args.port, api_key=key,
                    cors_origins=list(args.cors_origin or []),
                    strict_params=args.strict_params,
                    allow_expert_upload=args.allow_expert_upload, upload_allowlist=allow,
                    allow_expert_training=training, train_data_dir=train_dir,
                    queue_size=args.queue_size, request_timeout_s=args.request_timeout,
                    routing_stats=args.routing_stats,
                    client_timeout_s=getattr(args, "client_timeout", 10.0),
                    shutdown_timeout_s=getattr(args, "shutdown_timeout", 10.0),
                    model_id=args.model_id,
                    aliases=tuple(getattr(args, "served_model_name", None) or ()),
                    ctx_size=ctx_size, log_level=getattr(args, "log_level", None),
                    log_format=getattr(args, "log_format", None) or "text")


def resolve(args):
    """`colibri serve`'s options -> (model directory, EngineConfig, Settings); the
    fleet (colibri_core/fleet/deploy.py) starts from the same three."""
    from ..config import EngineConfig, find_config, load_run_config, parse
    if args.model:
        base, model_dir = EngineConfig(), Path(args.model)
        model_id = args.model_id or model_dir.resolve().name
    else:
        name = args.config or "builtin"
        cfg, model_dir = load_run_config(find_config(name))
        base = cfg.engine
        model_id = args.model_id or Path(name).stem
    # The scheduler's queue is the server's: a full one refuses (429 with Retry-After).
    overrides = {"experts_dir": args.experts_dir or default_experts_dir(base.experts_dir),
                 "max_queued_requests": args.queue_size, "when_full": "refuse"}
    if args.threads is not None:
        overrides["threads"] = args.threads
    k = getattr(args, "experts_per_token", None)
    if k is not None:                       # below a request's own k (kselect.py)
        if k < 1:
            raise ConfigError(f"--experts-per-token {k}: expected at least 1 expert")
        overrides["length_policy"] = [{"k": k}]
    speculation_overrides(args, overrides)
    prefix_overrides(args, base, overrides)
    if args.plugins_dir:
        overrides["plugins_dir"] = args.plugins_dir
    engine_cfg = parse(EngineConfig, {**base.model_dump(), **overrides}, "command line")
    args.model_id = model_id
    return Path(model_dir), engine_cfg, settings_from_args(args, engine_cfg)


def main(args) -> int:
    """`colibri serve` (the options: colibri_core.server.add_arguments)."""
    from ..engine import Engine
    model_dir, engine_cfg, settings = resolve(args)

    def engine():
        eng = Engine(model_dir, engine_cfg)
        if getattr(args, "audit_log", None):       # opt-in (audit.py)
            eng.start_audit(args.audit_log, args.audit_max_mb)
        return eng
    return run_server(engine, settings)
