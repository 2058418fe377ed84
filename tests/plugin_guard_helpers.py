"""What the tests of the plugin guard (test_hardening_plugins*.py, test_hookspecs_dict_keys.py)
share: an engine with one plugin from the start, the one request they all run and its
tokens without plugins (`baseline`), plugins made of one hook, the guard's warnings."""
from __future__ import annotations

import logging
import types

import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import build_plugin_manager


PROMPT, N_NEW = [1, 2, 3], 5


def one_hook(hook: str, fn):
    """A plugin (a module object) implementing ``hook`` alone with ``fn``, which declares
    the hook's arguments it needs."""
    plugin = types.ModuleType(f"only_{hook}")
    setattr(plugin, hook, hookimpl(fn))
    return plugin


def engine_with(plugin, name: str, model_dir, config: EngineConfig = EngineConfig()):
    """An engine whose manager has ``plugin`` from the start (engine_start reaches it)."""
    pm = build_plugin_manager(load_entrypoints=False, builtins=(), environ={})
    pm.register(plugin, name=name)
    return Engine(model_dir, config, plugin_manager=pm)


def generate(eng) -> list[int]:
    """One request as every test here runs it; hot-plug events queued before it fire at
    its first token boundary."""
    return eng.generate(PROMPT, max_new_tokens=N_NEW, temperature=0).run().token_ids


@pytest.fixture(scope="module")
def baseline(tiny_model_dir) -> list[int]:
    with Engine(tiny_model_dir, EngineConfig(activations="float")) as eng:
        general = generate(eng)
    with Engine(tiny_model_dir) as eng:
        assert generate(eng) == general     # both paths agree on this model
    return general


def warnings_about(caplog, plugin: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and repr(plugin) in r.getMessage()]


def bad_answer(hook: str, answer):
    """A decision plugin that answers ``answer()`` on a decode step (one token), after
    answering None in the prefill: a decode step is what the fast path runs."""
    if hook == "colibri_routing":
        def fn(expert_ids):
            return answer() if expert_ids.shape[0] == 1 else None
    elif hook == "colibri_choose_k_token":
        def fn(probs):
            return answer() if probs.shape[0] == 1 else None
    elif hook == "colibri_sample":
        def fn():
            return answer()
    else:
        def fn():
            return answer()
    return one_hook(hook, fn)
