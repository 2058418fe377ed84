"""The plugin guard's settings (docs/PLUGINS.md, "When a plugin fails"): strict mode
re-raises a plugin's exception; slow calls are logged once and counted; perf_counter is
not called while plugin_slow_ms is off; bad settings are refused; the guard works on a
plain pluggy manager and names unnamed plugins by their class."""
from __future__ import annotations

import gc
import logging
import re
import time

import pytest

from colibri_core import hookspecs, pluginguard
from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError, PluginError
from colibri_core.hookspecs import hookimpl
from robust_helpers import maps_of

from plugin_guard_helpers import (  # noqa: F401 (baseline: a fixture)
    N_NEW, bad_answer, baseline, engine_with, generate, one_hook, warnings_about)


class Exploding:
    @hookimpl
    def colibri_token(self):
        raise RuntimeError("original token")

    @hookimpl
    def colibri_engine_stop(self):
        raise RuntimeError("original stop")


@pytest.mark.parametrize("how", ["config", "env"])
def test_strict_mode_reraises_the_plugins_exception(how, model, monkeypatch):
    if how == "env":
        monkeypatch.setenv("COLIBRI_PLUGIN_STRICT", "1")
    cfg = EngineConfig(plugin_strict=how == "config", plugin_max_failures=1)
    plugin = Exploding()
    eng = engine_with(plugin, "strict", model, cfg)
    with pytest.raises(RuntimeError) as got:
        generate(eng)
    assert type(got.value) is RuntimeError and str(got.value) == "original token"
    assert eng.pm.is_registered(plugin)            # strict mode disables nothing
    del got                                        # its traceback's frames hold model views
    with pytest.raises(RuntimeError, match="^original stop$"):
        eng.close()
    gc.collect()
    assert maps_of(model) == 0                     # released although engine_stop raised
    assert eng.plugin_failures()["strict"]["failures"] == {"colibri_token": 1,
                                                           "colibri_engine_stop": 1}


def test_strict_mode_bad_answer_is_still_a_plugin_error(tiny_model_dir):
    with engine_with(bad_answer("colibri_sample", lambda: -1), "s", tiny_model_dir,
                     EngineConfig(plugin_strict=True)) as eng:
        with pytest.raises(PluginError, match="colibri_sample returned -1"):
            generate(eng)


def test_slow_hooks_are_logged_once_and_counted(tiny_model_dir, baseline, caplog):
    def slow():
        time.sleep(0.004)

    with engine_with(one_hook("colibri_token", slow), "sleepy", tiny_model_dir,
                     EngineConfig(plugin_slow_ms=1)) as eng:
        with caplog.at_level(logging.WARNING, logger="colibri"):
            assert generate(eng) == baseline
        report = eng.plugin_failures()["sleepy"]
    assert report["slow"] == {"colibri_token": N_NEW} and report["failures"] == {}
    assert report["slowest_ms"]["colibri_token"] >= 4
    logged = warnings_about(caplog, "sleepy")
    assert len(logged) == 1 and re.search(r"colibri_token took \d+\.\d ms \(plugin_slow_ms=1;",
                                          logged[0]), logged


def test_no_clock_reads_while_slow_hooks_are_off(tiny_model_dir, monkeypatch):
    reads = []
    real = pluginguard.perf_counter
    monkeypatch.setattr(pluginguard, "perf_counter", lambda: reads.append(1) or real())
    with engine_with(one_hook("colibri_token", lambda: None), "quick", tiny_model_dir) as eng:
        generate(eng)
        assert reads == []
        eng.hooks.guard.configure(slow_ms=1000)
        generate(eng)
    assert len(reads) == 2 * N_NEW
    assert eng.plugin_failures() == {}


def test_settings_are_checked():
    for bad in ({"plugin_max_failures": 0}, {"plugin_slow_ms": 0}, {"plugin_slow_ms": "fast"},
                {"plugin_strict": "maybe"}, {"plugin_max_failure": 3}):
        with pytest.raises(ConfigError):
            Engine.from_model_dir("/nonexistent", **bad)


def test_guard_on_a_plain_pluggy_manager():
    import pluggy
    from colibri_core.plugins import HookRelay
    pm = pluggy.PluginManager("colibri")
    pm.add_hookspecs(hookspecs)
    relay = HookRelay(pm)
    pm.register(one_hook("colibri_token", lambda: 1 / 0), name="zero")
    relay.token(request_id="r", step=0, token_id=1, text="", expert_set_generation=0,
                expert_set_id="")
    assert relay.guard.report()["zero"]["failures"] == {"colibri_token": 1}


def test_unnamed_plugins_are_named_by_class(tiny_model_dir):
    class NoName:
        @hookimpl
        def colibri_sample(self):
            return "x"

    with Engine(tiny_model_dir) as eng:
        eng.register_plugin(NoName())
        with pytest.raises(PluginError, match=r"^plugin 'NoName': colibri_sample returned 'x'; "
                                               r"expected an int token id in 0..255, or None$"):
            generate(eng)
