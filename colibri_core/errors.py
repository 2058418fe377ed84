"""Typed errors. Each message is one line naming the thing (file, field, value) and the fix.

The CLI prints `str(error)` and exits non-zero; it never shows a traceback for these.
"""


class ColibriError(Exception):
    """Base class of every error a user can cause."""


class ConfigError(ColibriError, ValueError):
    """A model or engine configuration is invalid (one line per problem)."""


class ModelFormatError(ColibriError, ValueError):
    """A model directory or one of its files is missing, truncated or malformed."""


class ExpertIndexError(ModelFormatError):
    """`top_k` / expert indices that do not fit the model's experts (reference-design text)."""

    def __init__(self, detail: str):
        super().__init__(f"FATAL: expert index out of bounds: {detail}")


class RequestError(ColibriError, ValueError):
    """A request is invalid: bad token ids, bad k, empty prompt, malformed MODE: prefix."""


class ExpertError(ColibriError):
    """An expert was refused or failed: the base of the hot-plug errors (hotplug/errors.py).
    The model catches it around an expert's own code, which then contributes nothing."""


class KernelError(ColibriError, RuntimeError):
    """The compiled kernels are missing or were called with bad arguments."""


class PluginError(ColibriError, RuntimeError):
    """A plugin's decision hook raised, or returned a value the engine cannot use: the
    request fails with one line naming the plugin, the hook, the value and what was
    expected; the engine goes on (pluginguard.py, docs/PLUGINS.md "When a plugin fails")."""

    def __init__(self, message: str, plugin: str = "", hook: str = ""):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
