"""Colibri: a CPU-first inference engine for Mixture-of-Experts models.

Start at `engine.Engine`; the data flows config -> modelfile/weights -> kernels -> model
-> generate (see docs/ARCHITECTURE.md for the module map).
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import colibri_core.format.quant` stays light
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)
