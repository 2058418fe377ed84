"""A plugin's mistake never ends the engine (colibri_core/pluginguard.py; docs/PLUGINS.md,
"When a plugin fails").

- Observer hooks (the engine ignores their result): a plugin raising in any of them
  leaves the request's tokens as they are without it; the failure is logged once per
  (plugin, hook) and counted; the plugin is unregistered after plugin_max_failures.
- Decision hooks (firstresult): raising, or answering something that breaks the hook's
  contract, fails that request with one PluginError line naming the plugin, the hook and
  the value; the engine then serves a normal request. Checked on both forward paths
  (the pipeline's C blocks, and its reference blocks with float activations and routing).

Strict mode and slow hooks: test_hardening_plugins_strict.py; the dict keys the hookspecs
document: test_hookspecs_dict_keys.py.
"""
from __future__ import annotations

import logging
import re
import types

import numpy as np
import pytest

from colibri_core import hookspecs
from colibri_core.config import EngineConfig
from colibri_core.errors import PluginError
from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import HOOK_NAMES
from robust_helpers import maps_of

from plugin_guard_helpers import (  # noqa: F401 (baseline: a fixture)
    N_NEW, bad_answer, baseline, engine_with, generate, one_hook, warnings_about)


OBSERVERS = [h for h in HOOK_NAMES
             if not getattr(hookspecs, h).colibri_spec.get("firstresult")]
DECISIONS = [h for h in HOOK_NAMES if h not in OBSERVERS]
PATHS = {"int8": EngineConfig(), "float": EngineConfig(activations="float", routing="float")}
# a hot-plug event as the manager reports it (fired at the next token boundary)
EVENT = {"path": "/srv/experts/fraud.so", "name": "fraud", "version": "1", "slot": 4,
         "layers": [1], "sha256": "ab" * 32, "kind": "add", "reason": "deleted"}


def test_hooks_split_into_observers_and_decisions():
    assert sorted(DECISIONS) == ["colibri_choose_k", "colibri_choose_k_token",
                                 "colibri_routing", "colibri_sample"]
    assert len(OBSERVERS) == 12


# ------------------------------------------------------------------ observer hooks

@pytest.mark.parametrize("hook", OBSERVERS)
def test_observer_that_raises_leaves_the_request_alone(hook, model, baseline, caplog):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError(f"boom in {hook}")

    name = f"bad-{hook}"
    eng = engine_with(one_hook(hook, boom), name, model, EngineConfig(plugin_max_failures=1000))
    try:
        for kind in ("loaded", "unloaded", "rejected"):
            eng._on_event(kind, EVENT)           # as the hot-plug manager reports them
        with caplog.at_level(logging.WARNING, logger="colibri"):
            assert generate(eng) == baseline
            assert generate(eng) == baseline
    finally:
        with caplog.at_level(logging.WARNING, logger="colibri"):
            eng.close()                          # engine_stop fails: mappings go anyway
    assert maps_of(model) == 0
    assert calls, f"{hook} was never called"
    report = eng.plugin_failures()[name]
    assert report["failures"] == {hook: len(calls)}
    assert not report["disabled"]
    assert report["last_error"].startswith(f"plugin {name!r} failed in {hook}: RuntimeError: boom")
    logged = warnings_about(caplog, name)
    assert len(logged) == 1, logged              # once per (plugin, hook), however often
    assert hook in logged[0] and "test_hardening_plugins.py:" in logged[0]


@pytest.mark.parametrize("hook", OBSERVERS)
def test_observer_disabled_at_max_failures(hook, tiny_model_dir, baseline):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("boom")

    plugin = one_hook(hook, boom)
    with engine_with(plugin, "once", tiny_model_dir, EngineConfig(plugin_max_failures=1)) as eng:
        for _ in range(2):
            for kind in ("loaded", "unloaded", "rejected"):
                eng._on_event(kind, EVENT)
            assert generate(eng) == baseline
    assert not eng.pm.is_registered(plugin)
    assert len(calls) == 1 and eng.plugin_failures()["once"]["disabled"]


def test_observer_disabled_after_max_failures(tiny_model_dir, baseline, caplog):
    class Flaky:
        def __init__(self):
            self.tokens = self.ends = 0

        @hookimpl
        def colibri_token(self):
            self.tokens += 1
            raise ValueError("flaky")

        @hookimpl
        def colibri_request_end(self):
            self.ends += 1

    class Good:
        tokens = 0

        @hookimpl
        def colibri_token(self):
            Good.tokens += 1

    flaky = Flaky()
    with engine_with(flaky, "flaky", tiny_model_dir, EngineConfig(plugin_max_failures=2)) as eng:
        eng.register_plugin(Good(), name="good")
        with caplog.at_level(logging.WARNING, logger="colibri"):
            assert generate(eng) == baseline
        assert (flaky.tokens, flaky.ends) == (2, 0)   # unregistered: request_end too
        assert Good.tokens == N_NEW                   # the other plugin saw every token
        assert not eng.pm.is_registered(flaky)
        assert eng.hooks.request_end is None
        report = eng.plugin_failures()
        last = report["flaky"].pop("last_error")
        assert report == {"flaky": {"failures": {"colibri_token": 2}, "slow": {},
                                    "slowest_ms": {}, "disabled": True}}
        assert re.fullmatch(r"plugin 'flaky' failed in colibri_token: ValueError: flaky "
                            r"\(at .*test_hardening_plugins.py:\d+\)", last), last
        assert generate(eng) == baseline and flaky.tokens == 2
        eng.register_plugin(flaky, name="flaky")      # registered again: afresh
        assert generate(eng) == baseline and flaky.tokens == 4
        assert not eng.pm.is_registered(flaky)
    logged = warnings_about(caplog, "flaky")
    assert len(logged) == 3                           # the failure once, each disabling
    assert all("disabled after 2 failures" in line for line in logged[1:])


def test_failures_count_per_plugin_across_hooks(tiny_model_dir):
    class TwoBugs:
        @hookimpl
        def colibri_request_start(self):
            raise KeyError("k")

        @hookimpl
        def colibri_request_end(self):
            raise ZeroDivisionError

    with engine_with(TwoBugs(), "two", tiny_model_dir, EngineConfig(plugin_max_failures=2)) as eng:
        generate(eng)
        report = eng.plugin_failures()["two"]
    assert report["failures"] == {"colibri_request_start": 1, "colibri_request_end": 1}
    assert report["disabled"]


# ------------------------------------------------------------------ decision hooks

def fails_then_recovers(eng, baseline, name: str, hook: str) -> str:
    """The request fails with one PluginError line naming plugin and hook; the plugin is
    disabled (plugin_max_failures=1) and the next request is served normally."""
    with pytest.raises(PluginError) as got:
        generate(eng)
    msg = str(got.value)
    assert "\n" not in msg and f"plugin {name!r}" in msg and hook in msg, msg
    assert (got.value.plugin, got.value.hook) == (name, hook)
    assert generate(eng) == baseline
    assert eng.plugin_failures()[name]["disabled"]
    return msg


def decide(path: str, **over) -> EngineConfig:
    return PATHS[path].model_copy(update={"plugin_max_failures": 1, **over})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hook", DECISIONS)
def test_decision_hook_that_raises_fails_only_that_request(hook, path, tiny_model_dir, baseline):
    def boom():
        raise RuntimeError("decision boom")

    with engine_with(bad_answer(hook, boom), "oops", tiny_model_dir, decide(path)) as eng:
        msg = fails_then_recovers(eng, baseline, "oops", hook)
    assert f"failed in {hook}: RuntimeError: decision boom (at " in msg


E, V, K = 4, 256, 2          # tiny_model_dir: 4 experts, vocabulary 256, top-2

BAD = {
    "colibri_choose_k": {
        "string": ("3", "an int k in 1..4"),
        "zero": (0, "an int k in 1..4"),
        "too big": (E + 1, "an int k in 1..4"),
        "bool": (True, "an int k"),
        "float": (2.0, "an int k"),
        "list": ([2], "an int k"),
    },
    "colibri_choose_k_token": {
        "too long": (np.ones(2, np.int64), "shape [1]"),
        "2-D": (np.ones((1, 1), np.int64), "shape [1]"),
        "floats": (np.ones(1), "an integer array"),
        "zero": (np.zeros(1, np.int64), "every k in 1..4"),
        "too big": (np.full(1, E + 1), "every k in 1..4"),
        "string": ("2", "an integer array"),
        "None inside": ([None], "an integer array"),
        "scalar": (2, "shape [1]"),
    },
    "colibri_routing": {
        "id too big": ((np.array([[0, E + 6]]), np.ones((1, 2), np.float32)), "ids in -1..3"),
        "id below -1": ((np.array([[0, -2]]), np.ones((1, 2), np.float32)), "ids in -1..3"),
        "wider than k": ((np.zeros((1, K + 1), np.int64), np.ones((1, K + 1))), "1 <= k' <= 2"),
        "more rows": ((np.zeros((2, K), np.int64), np.ones((2, K))), "shape [1, k']"),
        "1-D ids": ((np.zeros(K, np.int64), np.ones(K)), "shape [1, k']"),
        "float ids": ((np.zeros((1, K)), np.ones((1, K))), "an integer array"),
        "weights shape": ((np.zeros((1, K), np.int64), np.ones((1, 1))), "the expert ids' shape"),
        "NaN weight": ((np.zeros((1, K), np.int64), np.array([[np.nan, 1.0]])), "finite weights"),
        "Inf weight": ((np.zeros((1, K), np.int64), np.array([[np.inf, 1.0]])), "finite weights"),
        "overflows f32": ((np.zeros((1, K), np.int64), np.array([[1e300, 1.0]])), "finite weights"),
        "ids only": (np.zeros((1, K), np.int64), "a tuple (expert_ids, weights)"),
        "3-tuple": ((np.zeros((1, K)), np.ones((1, K)), None), "a tuple (expert_ids, weights)"),
        "Nones": ((None, None), "an integer array"),
        "ragged": (([[0, 1], [2]], np.ones((1, K))), "an integer array"),
        "string weights": ((np.zeros((1, K), np.int64), "heavy"), "a float array"),
    },
    "colibri_sample": {
        "minus one": (-1, "token id in 0..255"),
        "2**40": (2 ** 40, "token id in 0..255"),
        "vocab size": (V, "token id in 0..255"),
        "string": ("5", "an int token id"),
        "float": (3.5, "an int token id"),
        "np.float32": (np.float32(2), "an int token id"),
        "bool": (True, "an int token id"),
        "list": ([1], "an int token id"),
    },
}
CASES = [(hook, case) for hook, cases in BAD.items() for case in cases]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hook,case", CASES, ids=[f"{h[8:]}-{c}" for h, c in CASES])
def test_bad_answer_fails_the_request_with_a_typed_error(hook, case, path, tiny_model_dir, baseline):
    value, expected = BAD[hook][case]
    with engine_with(bad_answer(hook, lambda: value), "bad", tiny_model_dir, decide(path)) as eng:
        msg = fails_then_recovers(eng, baseline, "bad", hook)
    assert f"plugin 'bad': {hook} returned " in msg and expected in msg, msg
    assert len(msg) < 400


@pytest.mark.parametrize("path", PATHS)
def test_routing_to_a_vacant_hot_plug_slot_is_refused(path, tiny_model_dir, baseline):
    """Slot 4 of layer 1 exists but holds no expert (a hot-plugged one came and went)."""
    hot = types.SimpleNamespace(slot=4, layers=[1], router_row=np.zeros(128, np.float32),
                                router_bias=0.0, q4=None, forward=None, name="gone",
                                sha256="0" * 64)
    answer = (np.array([[0, 4]]), np.ones((1, 2), np.float32))
    with engine_with(bad_answer("colibri_routing", lambda: answer), "vacant", tiny_model_dir,
                     decide(path)) as eng:
        eng.queue_expert_change(lambda es: es.with_expert(hot).with_expert(hot, remove=True))
        msg = fails_then_recovers(eng, baseline, "vacant", "colibri_routing")
    assert "expert id 4 for layer 1" in msg and "slot 4 is vacant" in msg, msg


def test_good_overrides_are_used_alike_on_both_paths(tiny_model_dir, baseline):
    """A decode step's override to expert 3 alone (narrower than k=2) on each path."""
    answer = (np.array([[3]]), np.ones((1, 1), np.float32))
    tokens = {}
    for path, cfg in PATHS.items():
        with engine_with(bad_answer("colibri_routing", lambda: answer), "one", tiny_model_dir,
                         cfg) as eng:
            tokens[path] = generate(eng)
            assert eng.plugin_failures() == {}
            for t in eng.model.last_routing:
                assert t.routing.ids[0, 0] == 3 and (t.routing.ids[0, 1:] == -1).all()
    assert tokens["int8"] == tokens["float"] != baseline
