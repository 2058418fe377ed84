"""`colibri serve`: an OpenAI-compatible HTTP server around one Engine.

    calls.py       each request's engine work in a thread of its own (Calls.submit)
    generation.py  that work: completions/chat choices (batched by the engine), scoring
    params.py      request bodies -> checked parameters (400 naming the field)
    responses.py   engine events -> OpenAI bodies and SSE chunks
    chat.py        the checkpoint's chat template (sandboxed Jinja, as transformers)
    experts.py     expert-set generation/id, listing, refusals, routed tokens
    metrics.py     Prometheus registry; the status page's one-minute window
    backend.py     what the routes run on: LocalBackend (one engine here); fleet/ has the
                   same methods over Ray Serve replicas
    app.py         the Starlette app: routes, auth, request ids, errors, access log
    serve.py       engine + app + uvicorn from the command line's options

Design notes: docs/SERVE.md.
"""


def add_arguments(p) -> None:
    """`colibri serve`'s options (cli/ adds the subcommand)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="run config file or shipped config name (default: builtin)")
    src.add_argument("--model", help="model directory (engine defaults)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    p.add_argument("--model-id", dest="model_id",
                   help="the model name clients see (default: the config's or folder's name)")
    p.add_argument("--ctx-size", dest="ctx_size", type=int, metavar="N",
                   help="per-request context in tokens, prompt and answer (default: the "
                        "model's; at most that): a longer prompt is a 400, an answer stops "
                        "where it fills it")
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning",
                                                             "error"),
                   help="the server's and engine's log level (default: info for access "
                        "lines and engine events, warning for the rest)")
    p.add_argument("--log-format", dest="log_format", choices=("text", "json"),
                   default="text", help="text (default) or json: one JSON object per line "
                                        "on stderr, access lines with their fields")
    p.add_argument("--served-model-name", dest="served_model_name", nargs="+", metavar="NAME",
                   default=[], help="other names requests may give for the model (aliases; "
                                    "any other name is a 404 model_not_found)")
    p.add_argument("--experts-dir", dest="experts_dir",
                   help="watched folder of hot-plugged experts (default: the config's "
                        "experts_dir, else ./experts_so when it exists)")
    p.add_argument("--threads", type=int, help="compute threads (default: the config's; engine default 2)")
    p.add_argument("--experts-per-token", dest="experts_per_token", type=int, metavar="K",
                   help="the server's default experts per token: the engine config's "
                        "length_policy becomes K for every prompt (a request's "
                        "experts_per_token field, a MODE:kN| prefix or a plugin wins)")
    p.add_argument("--plugins-dir", dest="plugins_dir", help="folder of plugin modules")
    p.add_argument("--api-key", dest="api_key",
                   help="require 'Authorization: Bearer KEY' on /v1 routes; visible to "
                        "every local user in the process list: prefer $COLIBRI_API_KEY "
                        "or --api-key-file")
    p.add_argument("--api-key-file", dest="api_key_file", metavar="FILE",
                   help="read the API key from FILE (its first line)")
    p.add_argument("--cors-origin", dest="cors_origin", action="append",
                   help="allow browser requests from this origin (repeatable; off by default)")
    p.add_argument("--strict-params", dest="strict_params", action="store_true",
                   help="answer 400 to unknown request fields instead of ignoring them")
    p.add_argument("--allow-expert-upload", dest="allow_expert_upload", action="store_true",
                   help="enable PUT /v1/experts/NAME (needs an API key and an allowlist)")
    p.add_argument("--allow-expert-training", dest="allow_expert_training",
                   action="store_true", help="enable POST /v1/experts/train (needs an API "
                   "key and an allowlist; trains and builds candidates at nice 10)")
    p.add_argument("--train-data-dir", dest="train_data_dir", metavar="DIR",
                   help="folder whose files POST /v1/experts/train may name as its examples")
    p.add_argument("--expert-allowlist", dest="expert_allowlist", metavar="FILE",
                   help="sha256 digests (one per line) an uploaded expert may have")
    p.add_argument("--no-routing-stats", dest="routing_stats", action="store_false",
                   help="do not count routed tokens per expert (saves a bincount per MoE "
                        "layer and step; /metrics and the status page then show no shares)")
    p.add_argument("--prefix-cache-mb", dest="prefix_cache_mb", type=float, metavar="MB",
                   help="KV rows of ended requests kept for later prompts that start with "
                        "the same tokens (automatic prefix caching; default 256, or the "
                        "config's prefix_cache_mb when it sets one or a memory limit; 0: off)")
    p.add_argument("--queue-size", dest="queue_size", type=int, default=256,
                   help="engine requests (one per choice or score call) that may wait for "
                        "admission before 429 (the engine's max_queued_requests; default 256)")
    from .serve import add_speculation_arguments
    add_speculation_arguments(p)
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=600.0,
                   help="seconds a request may take, queue included (default 600)")
    p.add_argument("--client-timeout", dest="client_timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers, and the longest "
                        "pause in its body (the whole body: 6 times that; default 10)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout", type=float, default=10.0,
                   help="seconds requests in flight may finish after SIGTERM or Ctrl-C; "
                        "then each ends with an error (default 10)")
    p.add_argument("--audit-log", dest="audit_log", metavar="PATH",
                   help="write one JSON line per scored item and generated sequence (its "
                        "expert set, k, input, output, routing; docs/SERVE.md); off by default")
    p.add_argument("--audit-max-mb", dest="audit_max_mb", type=float, default=1024,
                   help="rotate the audit log past this size in MB (default 1024)")


def main(args) -> int:
    from .serve import main as serve_main
    return serve_main(args)
