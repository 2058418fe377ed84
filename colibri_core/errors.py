"""Typed errors. Each message is one line naming the thing (file, field, value) and the fix.

The CLI prints `str(error)` and exits non-zero; it never shows a traceback for these.
"""
from pathlib import Path


class ColibriError(Exception):
    """Base class of every error a user can cause."""


class ConfigError(ColibriError, ValueError):
    """A model or engine configuration is invalid (one line per problem)."""


class ModelFormatError(ColibriError, ValueError):
    """A model directory or one of its files is missing, truncated or malformed."""


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


class ExpertError(ColibriError):
    """An expert was refused or failed: the base of the hot-plug errors (hotplug/errors.py).
    The model catches it around an expert's own code, which then contributes nothing."""


class KernelError(ColibriError, RuntimeError):
    """The compiled kernels are missing or were called with bad arguments."""
