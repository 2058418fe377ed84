"""Plugins that ship with Colibri, installed as the package ``colibri_core.plugins``.

    tracer.py      [ROUTING] / [MEMORY] / [TIME] debug lines (``--debug``, ``COLIBRI_DEBUG``)
    adaptive_k.py  per-token k from cumulative router probability
    metrics.py     per-request token, expert and latency counters, as JSON

The plugin manager itself is ``colibri_core/plugins.py``. In a source checkout that
module is ``colibri_core.plugins`` and points its ``__path__`` at this folder; in an
installed tree this package shadows it, so it loads that file and re-exports its names.
"""
from __future__ import annotations

if __name__ == "colibri_core.plugins":  # installed layout: bring in the manager's API
    import importlib.util as _util
    import sys as _sys
    from pathlib import Path as _Path

    _manager_file = _Path(__file__).resolve().parent.parent / "plugins.py"
    _spec = _util.spec_from_file_location("colibri_core._plugin_manager", _manager_file)
    _manager = _util.module_from_spec(_spec)
    _sys.modules[_spec.name] = _manager
    _spec.loader.exec_module(_manager)
    globals().update({name: getattr(_manager, name) for name in _manager.__all__})
    __all__ = list(_manager.__all__)
