"""Typed errors. Each message is one line naming the thing (file, field, value) and the fix.

The CLI prints `str(error)` and exits non-zero; it never shows a traceback for these.
Each class also says how a server answers it: `http_status`, `error_type` (OpenAI's
`type` field) and `code`, so `colibri serve` (server/errors.py) maps an error by class,
never by its message.
"""
from pathlib import Path


class ColibriError(Exception):
    """Base class of every error a user can cause."""
    http_status = 500
    error_type = "server_error"
    code = "colibri_error"


class ConfigError(ColibriError, ValueError):
    """A model or engine configuration is invalid (one line per problem)."""
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_config"


class AuditLogError(ColibriError, ValueError):
    """An audit log line that cannot be read, or an expert set replay cannot rebuild
    (the message names the file, the line and the field or the missing expert)."""
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_audit_log"


class ModelFormatError(ColibriError, ValueError):
    """A model directory or one of its files is missing, truncated or malformed."""
    code = "model_error"


class ModelFileDamaged(ModelFormatError):
    """A mapped model file was truncated in place while the engine was using it: the pages
    it lost read as zeros (mapguard.py), so the model gives no more results until it is
    reloaded."""

    def __init__(self, path):
        self.path = str(path)
        super().__init__(
            f"{path}: the file was truncated while the model was using it; restore or "
            f"re-convert it (`colibri inspect {Path(path).parent} --verify` "
            f"names the damaged files), then reload the model")


class ExpertIndexError(ModelFormatError):
    """`top_k` / expert indices that do not fit the model's experts (reference-design text)."""

    def __init__(self, detail: str):
        super().__init__(f"FATAL: expert index out of bounds: {detail}")


class RequestError(ColibriError, ValueError):
    """A request is invalid: bad token ids, bad k, empty prompt, malformed MODE: prefix."""
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class RequestTooLarge(RequestError):
    """A request asks for more than a configured limit (tokens per call, memory)."""
    http_status = 413
    code = "request_too_large"


class RequestCancelled(ColibriError, RuntimeError):
    """The caller cancelled a request before it finished (a score_batch closed from
    another thread: a server client that disconnected or timed out)."""
    http_status = 499
    error_type = "cancelled"
    code = "cancelled"


class EngineUnavailable(ColibriError, RuntimeError):
    """The engine cannot take the request now; retrying later (or elsewhere) can work."""
    http_status = 503
    code = "engine_unavailable"


class EngineBusyError(EngineUnavailable):
    """The engine's request queue is full (EngineConfig.max_queued_requests, with
    when_full="refuse"): 429, retry later (the server adds Retry-After)."""
    http_status = 429
    error_type = "rate_limit_error"
    code = "engine_busy"


class EngineClosedError(EngineUnavailable):
    """The engine was closed (before or during the request)."""
    code = "engine_closed"


class InsufficientMemoryError(EngineUnavailable):
    """What a request needs (KV cache, activations) exceeds the memory available now."""
    code = "insufficient_memory"


class KVPoolFullError(EngineUnavailable):
    """The engine's KV pool (kvcache.KVPool, EngineConfig.kv_pool_tokens) has fewer free
    positions than a sequence asks for: retry when other sequences have ended."""
    code = "kv_pool_full"


class KVCacheFreedError(RequestError):
    """A KV cache was used after it went back to its pool (KVPool.free)."""
    code = "kv_cache_freed"


class ExpertError(ColibriError):
    """An expert was refused or failed: the base of the hot-plug errors (hotplug/errors.py).
    The model catches it around an expert's own code, which then contributes nothing."""
    code = "expert_error"


class KernelError(ColibriError, RuntimeError):
    """The compiled kernels are missing or were called with bad arguments."""
    code = "kernel_error"


class PluginError(ColibriError, RuntimeError):
    """A plugin's decision hook raised, or returned a value the engine cannot use: the
    request fails with one line naming the plugin, the hook, the value and what was
    expected; the engine goes on (pluginguard.py, docs/PLUGINS.md "When a plugin fails")."""

    def __init__(self, message: str, plugin: str = "", hook: str = ""):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook

    code = "plugin_error"
