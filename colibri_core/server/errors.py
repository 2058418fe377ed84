"""HTTP errors in OpenAI's shape, and the engine's typed errors mapped onto them.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with a
4xx/5xx status; a bug inside the server becomes a 500 whose message names the request id
(the traceback goes to the server's log, never to the client).
"""
from __future__ import annotations

import logging
from typing import Optional

from ..errors import ColibriError

log = logging.getLogger("colibri.server")


class ApiError(Exception):
    """An error answered to the client: HTTP status + OpenAI error body (+ headers)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class RequestTimeout(ApiError):
    def __init__(self, seconds: float):
        super().__init__(504, f"the request ran past the server's per-request timeout of "
                              f"{seconds:g} s (--request-timeout)", type="timeout_error",
                         code="request_timeout")


class ShuttingDown(ApiError):
    def __init__(self):
        super().__init__(503, "the server is shutting down; retry on another instance",
                         type="server_error", code="shutting_down",
                         headers={"Retry-After": "1"})


def from_exception(exc: BaseException, request_id: str, retry_after_s: int = 1) -> ApiError:
    """Map any exception raised while serving a request to the error the client sees;
    a 429 (the engine's queue is full) or 503 says when to retry (`retry_after_s`)."""
    if isinstance(exc, ApiError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, ColibriError):
        # Each error class says how it is answered (errors.py): status, type and code.
        msg = str(exc).splitlines()[0] if str(exc) else name
        status = exc.http_status
        if status == 409 and "not active" in msg:       # rollback of an unknown expert
            status = 404
        headers = {"Retry-After": str(max(1, int(retry_after_s)))} \
            if status in (429, 503) else None
        return ApiError(status, msg, type=exc.error_type, code=exc.code, headers=headers)
    log.error("request %s failed with an internal error", request_id, exc_info=exc)
    return ApiError(500, f"internal error while serving request {request_id} ({name}); the "
                         f"server log has the details", type="server_error",
                    code="internal_error")
