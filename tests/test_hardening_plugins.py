"""A plugin's mistake never ends the engine (colibri_core/pluginguard.py; docs/PLUGINS.md,
"When a plugin fails").

- Observer hooks (the engine ignores their result): a plugin raising in any of them
  leaves the request's tokens as they are without it; the failure is logged once per
  (plugin, hook) and counted; the plugin is unregistered after plugin_max_failures.
- Decision hooks (firstresult): raising, or answering something that breaks the hook's
  contract, fails that request with one PluginError line naming the plugin, the hook and
  the value; the engine then serves a normal request. Checked on both forward paths
  (the pipeline's C blocks, and its reference blocks with float activations and routing).
- Strict mode re-raises; slow calls are logged and counted; perf_counter is not called
  while plugin_slow_ms is off.
- The dict keys every hookspec docstring documents (its "Keys of ``ARG``:" sections) are
  the ones a real generation with hot-plugged experts passes.
"""
from __future__ import annotations

import gc
import logging
import re
import time
import types

import numpy as np
import pytest

from colibri_core import hookspecs, pluginguard
from colibri_core.config import EngineConfig, HotplugConfig
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError, PluginError
from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import HOOK_NAMES, build_plugin_manager
from robust_helpers import maps_of

PROMPT, N_NEW = [1, 2, 3], 5
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


# ------------------------------------------------------------------ strict mode, slow hooks

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


# ------------------------------------------------------------------ documented dict keys

KEYS_HEADER = re.compile(r"^(\s*)Keys of ``(\w+)``:\s*$")
KEY_LINE = re.compile(r"^(\s*)(\w+) \(([^)]+)\): \S")
TYPES = {"str": lambda v: isinstance(v, str), "int": lambda v: type(v) is int,
         "bool": lambda v: type(v) is bool, "float": lambda v: isinstance(v, float),
         "list[int]": lambda v: isinstance(v, list) and all(type(x) is int for x in v)}


def documented_keys(doc: str) -> dict[str, dict[str, str]]:
    """``{argument: {key: type}}`` from a docstring's ``Keys of ``ARG``:`` sections."""
    out: dict[str, dict[str, str]] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = KEYS_HEADER.match(line)
        if not m:
            continue
        keys = out[m.group(2)] = {}
        indent = None
        for entry in lines[i + 1:]:
            if not entry.strip():
                break
            km = KEY_LINE.match(entry)
            depth = len(entry) - len(entry.lstrip())
            if indent is None:
                assert km, f"first line after {line.strip()!r} is not 'key (type): ...'"
                indent = depth
            if depth < indent or depth <= len(m.group(1)):
                break
            if depth == indent:
                assert km, f"malformed key line {entry.strip()!r}"
                assert km.group(3) in TYPES, f"unknown type {km.group(3)!r} in {entry.strip()!r}"
                keys[km.group(2)] = km.group(3)
    return out


SPEC_KEYS = {h: documented_keys(getattr(hookspecs, h).__doc__) for h in HOOK_NAMES}


def test_every_dict_argument_documents_its_keys():
    for hook in HOOK_NAMES:
        fn = getattr(hookspecs, hook)
        dict_args = {a for a, t in fn.__annotations__.items() if t == "dict"}
        assert set(SPEC_KEYS[hook]) == dict_args, hook
        assert all(SPEC_KEYS[hook].values()), hook
    assert SPEC_KEYS["colibri_expert_loaded"]["info"]["layer"] == "int"
    assert documented_keys("Keys of ``x``:\n    a (int): one\n        more\n    b (str): two\n\n"
                           "    c (int): not in it") == {"x": {"a": "int", "b": "str"}}


class RecordsEveryHook:
    """Implements every hook with all its arguments; ``calls``: (hook, arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []


def _recording_impl(hook: str):
    """``def <hook>(self, <its arguments>)`` appending them to self.calls (pluggy reads
    the arguments an implementation wants from its signature, so it is written out)."""
    spec = getattr(hookspecs, hook)
    args = spec.__code__.co_varnames[:spec.__code__.co_argcount]
    ns: dict = {}
    exec(f"def {hook}(self, {', '.join(args)}):\n"
         f"    self.calls.append(({hook!r}, dict({', '.join(f'{a}={a}' for a in args)})))\n", ns)
    return hookimpl(ns[hook])


for _hook in HOOK_NAMES:
    setattr(RecordsEveryHook, _hook, _recording_impl(_hook))


def test_documented_dict_keys_are_what_the_engine_passes(tiny_model_dir, tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    watched, build = tmp_path / "experts", tmp_path / "build"
    watched.mkdir(mode=0o755)
    build.mkdir()
    compile_test_expert(build / "good.so", name="good", hidden=128, layer=1)
    compile_test_expert(build / "wrong.so", name="wrong", hidden=64, layer=1)
    for so in ("good.so", "wrong.so"):
        (build / so).rename(watched / so)
    from colibri_core.builtin_plugins.metrics import Metrics
    rec, metrics = RecordsEveryHook(), Metrics()
    cfg = EngineConfig(experts_dir=str(watched), hotplug=HotplugConfig(settle_s=0.05))
    with engine_with(rec, "recorder", tiny_model_dir, cfg) as eng:
        assert eng.pm.get_plugin("recorder") is rec
        generate(eng)                                   # loaded + rejected at start-up
        eng.next_token_logits([4, 5])
        eng.register_plugin(metrics, name="metrics")
        metrics.colibri_expert_loaded(info=[kw for h, kw in rec.calls
                                            if h == "colibri_expert_loaded"][0]["info"])
        assert metrics.hot_experts == {(1, 4)}          # keyed by the documented keys
        (watched / "good.so").unlink()
        eng.hotplug.rescan()
        assert eng.hotplug.wait_idle(20)
        generate(eng)                                   # unloaded at a token boundary
        assert metrics.hot_experts == set()
        assert eng.plugin_failures() == {}
    seen = {hook for hook, _ in rec.calls}
    assert seen == set(HOOK_NAMES), set(HOOK_NAMES) - seen
    for hook, args in SPEC_KEYS.items():
        for arg, keys in args.items():
            given = [kw[arg] for h, kw in rec.calls if h == hook]
            assert given, (hook, arg)
            for d in given:
                for key, typ in keys.items():
                    assert key in d, f"{hook}: {arg}[{key!r}] is documented but not passed: {d}"
                    assert TYPES[typ](d[key]), f"{hook}: {arg}[{key!r}] = {d[key]!r}, not {typ}"
    loaded = [kw["info"] for h, kw in rec.calls if h == "colibri_expert_loaded"]
    assert [(i["name"], i["layer"], i["expert"], i["layers"]) for i in loaded] == [("good", 1, 4, [1])]
    unloaded = [kw["info"] for h, kw in rec.calls if h == "colibri_expert_unloaded"]
    assert [(i["name"], i["reason"], i["layers"]) for i in unloaded] == [("good", "deleted", [1])]
