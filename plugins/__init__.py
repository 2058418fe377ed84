"""Plugins that ship with Colibri, installed as the package ``colibri_core.builtin_plugins``.

    tracer.py      [ROUTING] / [MEMORY] / [TIME] debug lines (``--debug``, ``COLIBRI_DEBUG``)
    adaptive_k.py  per-token k from cumulative router probability
    metrics.py     per-request token, expert and latency counters, as JSON

The plugin manager that loads them is ``colibri_core/plugins.py``.
"""
