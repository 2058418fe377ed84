"""`colibri serve --log-level` and `--log-format json`, on the standard logging library.

JSON: one object per line on stderr, {"ts", "level", "logger", "msg"} and, for an access
line, its fields (request_id, route, status, prompt_tokens, tokens, first_ms, total_ms,
generations); engine events (hot-plug adoptions and refusals, warnings) come the same
way, and so do uvicorn's own lines. Text (the default) is what it always was.
"""
from __future__ import annotations

import json
import logging
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
# the loggers serve.py and experts.py give a handler or a level of their own
OURS = ("colibri", "colibri.server", "colibri.server.access", "colibri.hotplug")


class JsonFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        d = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.created))
             + f".{int(r.msecs):03d}Z", "level": r.levelname.lower(), "logger": r.name,
             "msg": r.getMessage()}
        fields = getattr(r, "fields", None)       # logging's `extra={"fields": {...}}`
        if isinstance(fields, dict):
            d.update(fields)
        if r.exc_info:
            d["exc"] = self.formatException(r.exc_info)
        return json.dumps(d, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`colibri: LEVEL: message` (the CLI's warning line, with the record's own level)."""

    def format(self, r: logging.LogRecord) -> str:
        return f"colibri: {r.levelname.lower()}: {super().format(r)}"


def configure(level: str | None, fmt: str) -> None:
    """After serve.py and experts.py installed their handlers, before the engine starts
    (its startup events come out in the chosen format)."""
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in OURS]
    if fmt == "json" and not loggers[0].handlers:        # used as a library: none yet
        loggers[0].addHandler(logging.StreamHandler())
    if level is not None:
        lv = getattr(logging, level.upper())
        for lg in loggers[1:]:
            lg.setLevel(lv)
    if fmt == "json" or level is not None:
        for lg in loggers:
            for h in lg.handlers:
                if lg.name == "colibri.server.access" and fmt != "json":
                    continue                      # its own `colibri: access:` prefix
                h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    if fmt == "json":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            lg = logging.getLogger(name)          # through the root's JSON handler
            lg.handlers.clear()
            lg.propagate = True
