"""Every public method and property of a closed engine raises EngineClosedError.

Once `Engine.close()` has released the model, its attributes point at closed objects
(`model.expert_set` is None, the files are unmapped): a property read then failed with
`AttributeError: 'NoneType' object has no attribute 'generation'`. Checking in each method
is easy to forget for the next one added, so the class is wrapped once, here: each public
function and property first asks `obj._after_close()` (true once the release is complete,
so plugins' `colibri_engine_stop` hooks still read the engine while it is being closed).
"""
from __future__ import annotations

import functools

# Safe on a closed engine, and needed there: close() is idempotent, `with` ends in it, and
# plugin_failures() is how a colibri_engine_stop that failed during close() is seen.
ALWAYS_OPEN = frozenset({"close", "__exit__", "plugin_failures"})


def _guarded(fn):
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        if self._after_close():
            raise self._closed_error()
        return fn(self, *args, **kwargs)
    return call


def refuse_after_close(cls):
    """Class decorator: guard every public method and property of `cls` (and
    `__enter__`), except ALWAYS_OPEN, class and static methods. An instance says it is
    closed by setting `self._after_close = lambda: True` at the end of its release."""
    cls._after_close = staticmethod(lambda: False)
    for name, attr in list(vars(cls).items()):
        if name in ALWAYS_OPEN or (name.startswith("_") and name != "__enter__"):
            continue
        if isinstance(attr, property):
            setattr(cls, name, property(_guarded(attr.fget), attr.fset, attr.fdel, attr.__doc__))
        elif callable(attr) and not isinstance(attr, (classmethod, staticmethod, type)):
            setattr(cls, name, _guarded(attr))
    return cls


def public_names(cls) -> list[str]:
    """The names the decorator guards (what a test walks)."""
    return sorted(n for n, a in vars(cls).items()
                  if n not in ALWAYS_OPEN and (not n.startswith("_") or n == "__enter__")
                  and (isinstance(a, property) or callable(a))
                  and not isinstance(a, (classmethod, staticmethod, type)))
