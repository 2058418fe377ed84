"""Plugin manager, HookRelay and plugin loading, with real plugins registered (the
built-in plugins: test_builtin_plugins.py).

The engine's calls are simulated here (the engine-level tests live elsewhere): each
hook is called through HookRelay exactly as the forward loop calls it.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pluggy
import pytest

from colibri_core import plugins as plugins_mod
from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import (
    HOOK_NAMES,
    HookRelay,
    PluginLoadError,
    build_plugin_manager,
)
from colibri_core.builtin_plugins.adaptive_k import AdaptiveK, adaptive_k
from colibri_core.builtin_plugins.metrics import Metrics
from colibri_core.builtin_plugins.tracer import Tracer

from plugin_helpers import ENGINE_CALLS, PROBS, short

REPO = Path(__file__).resolve().parent.parent



# -- a real plugin implementing every hook, with the engine's arguments ---------------


class Recorder:
    """Records every call; answers the firstresult hooks with fixed values."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def colibri_engine_start(self, engine):
        self.calls.append(("colibri_engine_start", engine))

    @hookimpl
    def colibri_engine_stop(self, engine):
        self.calls.append(("colibri_engine_stop", engine))

    @hookimpl
    def colibri_choose_k(self, prompt_tokens, request, default_k):
        self.calls.append(("colibri_choose_k", prompt_tokens))
        return 1 if prompt_tokens < 16 else default_k

    @hookimpl
    def colibri_request_start(self, request_id, prompt_tokens, k):
        self.calls.append(("colibri_request_start", request_id, prompt_tokens, k))

    @hookimpl
    def colibri_request_end(self, request_id, n_tokens, stop_reason):
        self.calls.append(("colibri_request_end", request_id, n_tokens, stop_reason))

    @hookimpl
    def colibri_before_layer(self, layer, hidden):
        self.calls.append(("colibri_before_layer", layer, float(hidden.sum())))

    @hookimpl
    def colibri_choose_k_token(self, layer, probs, default_k):
        self.calls.append(("colibri_choose_k_token", layer))
        return np.full(len(probs), default_k)

    @hookimpl
    def colibri_routing(self, layer, expert_ids, weights, scores, logits):
        self.calls.append(("colibri_routing", layer, expert_ids.tolist()))
        return None  # an observer

    @hookimpl
    def colibri_expert_prefetch(self, layer, experts):
        self.calls.append(("colibri_expert_prefetch", layer, list(experts)))

    @hookimpl
    def colibri_expert_timing(self, layer, expert, cycles, seconds):
        self.calls.append(("colibri_expert_timing", layer, expert, cycles))

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        self.calls.append(("colibri_after_layer", layer, float(hidden.sum())))

    @hookimpl
    def colibri_sample(self, logits, request):
        self.calls.append(("colibri_sample",))
        return int(np.argmax(logits))

    @hookimpl
    def colibri_token(self, request_id, step, token_id, text, expert_set_generation, expert_set_id):
        self.calls.append(("colibri_token", request_id, step, token_id, text, expert_set_generation,
                           expert_set_id))

    @hookimpl
    def colibri_expert_loaded(self, info):
        self.calls.append(("colibri_expert_loaded", info["path"]))

    @hookimpl
    def colibri_expert_rejected(self, path, reason):
        self.calls.append(("colibri_expert_rejected", path, reason))

    @hookimpl
    def colibri_expert_unloaded(self, info):
        self.calls.append(("colibri_expert_unloaded", info["path"]))


def test_engine_calls_cover_every_hook():
    assert set(ENGINE_CALLS) == set(HOOK_NAMES)


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_reaches_a_registered_plugin(pm, relay, hook):
    assert getattr(relay, short(hook)) is None
    rec = Recorder()
    pm.register(rec)
    caller = getattr(relay, short(hook))
    assert caller is not None and caller is getattr(pm.hook, hook)
    kwargs, expected = ENGINE_CALLS[hook]
    result = caller(**kwargs)
    if isinstance(result, np.ndarray):
        result = result.tolist()
    assert result == expected
    assert len(rec.calls) == 1 and rec.calls[0][0] == hook


# -- HookRelay ------------------------------------------------------------------------


def test_relay_attributes_none_without_plugins(relay):
    assert relay.active() == []
    for name in HOOK_NAMES:
        assert getattr(relay, short(name)) is None


def test_relay_follows_register_and_unregister(pm, relay):
    metrics = Metrics()
    pm.register(metrics, name="metrics")
    assert relay.routing is not None and relay.token is not None
    assert relay.sample is None and relay.before_layer is None
    assert set(relay.active()) == {
        "request_start", "request_end", "routing", "token", "expert_loaded", "expert_unloaded"
    }
    pm.unregister(metrics)
    assert relay.routing is None and relay.token is None and relay.active() == []
    pm.register(metrics, name="metrics")
    pm.set_blocked("metrics")
    assert relay.routing is None


def test_relay_on_a_plain_pluggy_manager():
    from colibri_core import hookspecs

    plain = pluggy.PluginManager("colibri")
    plain.add_hookspecs(hookspecs)
    relay = HookRelay(plain)
    second = HookRelay(plain)
    assert relay.routing is None
    rec = Recorder()
    plain.register(rec)
    assert relay.routing is not None and second.sample is not None
    plain.unregister(rec)
    assert relay.routing is None and second.sample is None


def test_relay_two_plugins_one_hook(pm, relay):
    metrics, tracer = Metrics(), Tracer(kinds={"routing"}, fd=2)
    pm.register(metrics)
    pm.register(tracer)
    pm.unregister(metrics)
    assert relay.routing is not None  # the tracer still listens
    pm.unregister(tracer)
    assert relay.routing is None


# -- firstresult hooks ----------------------------------------------------------------


class KFromPrefix:
    @hookimpl
    def colibri_choose_k(self, request, default_k):
        prompt = request.get("prompt", "")
        return int(prompt[len("MODE:k")]) if prompt.startswith("MODE:k") else None


def test_choose_k_first_non_none_result_wins(pm, relay):
    pm.register(Recorder())  # answers 1 for short prompts
    pm.register(KFromPrefix())  # registered last: asked first
    assert relay.choose_k(prompt_tokens=5, request={"prompt": "MODE:k3|hi"}, default_k=2) == 3
    assert relay.choose_k(prompt_tokens=5, request={"prompt": "hi"}, default_k=2) == 1
    assert relay.choose_k(prompt_tokens=50, request={"prompt": "hi"}, default_k=2) == 2


class DropExpert:
    """Overrides routing: never use expert 0, give its slot to the next best."""

    @hookimpl
    def colibri_routing(self, expert_ids, weights, logits):
        masked = logits.copy()
        masked[:, 0] = -np.inf
        ids = np.argsort(-masked, axis=1)[:, : expert_ids.shape[1]]
        return ids, np.full(ids.shape, 1.0 / ids.shape[1], np.float32)


def test_routing_override_and_observer(pm, relay):
    rec = Recorder()
    pm.register(rec)
    pm.register(DropExpert())
    logits = np.array([[5.0, 1.0, 2.0, 0.0]], np.float32)
    ids = np.array([[0, 2]])
    new_ids, new_w = relay.routing(layer=0, expert_ids=ids, weights=np.ones((1, 2), np.float32), scores=np.ones((1, 2), np.float32), logits=logits)
    assert new_ids.tolist() == [[2, 1]] and new_w.tolist() == [[0.5, 0.5]]
    assert rec.calls == []  # firstresult: the observer after the override is not reached


def test_routing_observer_only_returns_none(pm, relay):
    pm.register(Metrics())
    pm.register(Recorder())
    assert relay.routing(**ENGINE_CALLS["colibri_routing"][0]) is None


class Greedy:
    @hookimpl
    def colibri_sample(self, logits, request):
        return None if request.get("temperature", 0) > 0 else int(np.argmax(logits))


def test_sample_plugin(pm, relay):
    pm.register(Greedy())
    logits = np.array([0.0, 0.5, 4.0, 1.0], np.float32)
    assert relay.sample(logits=logits, request={"temperature": 0}) == 2
    assert relay.sample(logits=logits, request={"temperature": 0.8}) is None


class ScaleHidden:
    """Before/after layer hooks see the engine's buffer and may edit it in place."""

    def __init__(self):
        self.norms = []

    @hookimpl
    def colibri_before_layer(self, layer, hidden):
        self.norms.append(("before", layer, float(np.linalg.norm(hidden))))

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        hidden *= 0.5
        self.norms.append(("after", layer, float(np.linalg.norm(hidden))))


def test_before_and_after_layer(pm, relay):
    plugin = ScaleHidden()
    pm.register(plugin)
    hidden = np.full((1, 4), 2.0, np.float32)  # norm 4
    for layer in range(2):  # the forward loop
        if relay.before_layer is not None:
            relay.before_layer(layer=layer, hidden=hidden)
        if relay.after_layer is not None:
            relay.after_layer(layer=layer, hidden=hidden)
    assert plugin.norms == [("before", 0, 4.0), ("after", 0, 2.0), ("before", 1, 2.0), ("after", 1, 1.0)]


def test_engine_start_stop_and_rejected(pm, relay):
    rec = Recorder()
    pm.register(rec)
    relay.engine_start(engine="E")
    relay.expert_rejected(path="/x/evil.so", reason="world-writable file")
    relay.engine_stop(engine="E")
    assert rec.calls == [("colibri_engine_start", "E"),
                         ("colibri_expert_rejected", "/x/evil.so", "world-writable file"),
                         ("colibri_engine_stop", "E")]


# -- loading: plugins folder, entry points, built-ins, tracing ----------------------------

K_PLUGIN = textwrap.dedent(
    """
    from pathlib import Path
    from colibri_core.hookspecs import hookimpl

    with open(Path(__file__).with_suffix(".loads"), "a") as f:
        f.write("loaded\\n")

    @hookimpl
    def colibri_choose_k(prompt_tokens, default_k):
        return 4 if prompt_tokens > 100 else None
    """
)


def test_plugins_dir_loads_each_module_once(tmp_path):
    (tmp_path / "long_prompts.py").write_text(K_PLUGIN)
    (tmp_path / "_helper.py").write_text("raise RuntimeError('never imported')\n")
    (tmp_path / "notes.txt").write_text("not a plugin")
    for _ in range(2):
        pm = build_plugin_manager(plugins_dir=tmp_path, load_entrypoints=False, builtins=(), environ={})
        relay = HookRelay(pm)
        assert relay.choose_k(prompt_tokens=500, request={}, default_k=2) == 4
        assert relay.choose_k(prompt_tokens=5, request={}, default_k=2) is None
        assert [n for n, _ in pm.list_name_plugin()] == [f"plugins_dir:{tmp_path.resolve() / 'long_prompts.py'}"]
    plugins_mod.load_plugins_dir(pm, tmp_path)  # again into the same manager: no-op
    assert (tmp_path / "long_prompts.loads").read_text() == "loaded\n"


def test_plugins_dir_overrides_builtins(tmp_path):
    (tmp_path / "k.py").write_text(K_PLUGIN)
    pm = build_plugin_manager(plugins_dir=tmp_path, load_entrypoints=False, builtins=(Recorder(),), environ={})
    assert HookRelay(pm).choose_k(prompt_tokens=500, request={}, default_k=2) == 4


@pytest.mark.parametrize(
    "source,message",
    [
        ("x = 1\ndef broken(:\n", r"line 2: SyntaxError"),
        ("import no_such_module_colibri\n", r"line 1: ModuleNotFoundError: No module named 'no_such_module_colibri'"),
        ("x = 1\nraise ValueError('bad\\nconfig')\n", r"line 2: ValueError: bad config"),
        ("from colibri_core.hookspecs import hookimpl\n@hookimpl\ndef colibri_routng(layer):\n    pass\n",
         r"invalid plugin file .*: unknown hook 'colibri_routng'"),
        ("from colibri_core.hookspecs import hookimpl\n@hookimpl\ndef colibri_routing(layer, nope):\n    pass\n",
         r"invalid plugin file .*colibri_routing.*nope"),
    ],
)
def test_broken_plugin_file_is_one_clear_line(tmp_path, source, message):
    bad = tmp_path / "bad_plugin.py"
    bad.write_text(source)
    with pytest.raises(PluginLoadError) as info:
        build_plugin_manager(plugins_dir=tmp_path, load_entrypoints=False, builtins=(), environ={})
    text = str(info.value)
    assert "\n" not in text and str(bad.resolve()) in text
    assert re.search(message, text), text


def test_broken_plugin_leaves_manager_clean(tmp_path, pm):
    (tmp_path / "bad.py").write_text(
        "from colibri_core.hookspecs import hookimpl\n"
        "@hookimpl\ndef colibri_token(request_id):\n    pass\n"
        "@hookimpl\ndef colibri_nope():\n    pass\n"
    )
    relay = HookRelay(pm)
    with pytest.raises(PluginLoadError, match="unknown hook 'colibri_nope'"):
        plugins_mod.load_plugins_dir(pm, tmp_path)
    assert relay.token is None and pm.list_name_plugin() == []


def test_missing_plugins_dir(tmp_path):
    with pytest.raises(PluginLoadError, match="plugins folder .*missing.* does not exist"):
        build_plugin_manager(plugins_dir=tmp_path / "missing", load_entrypoints=False, builtins=())


def make_distribution(root: Path, name: str, module_source: str) -> None:
    """A real installed distribution on a sys.path folder, declaring a colibri entry point."""
    (root / f"{name}.py").write_text(module_source)
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[colibri]\n{name} = {name}\n")


def test_entry_point_plugins(tmp_path, monkeypatch):
    make_distribution(tmp_path, "colibri_greedy_ep", "from colibri_core.hookspecs import hookimpl\n"
                      "import numpy as np\n@hookimpl\ndef colibri_sample(logits):\n    return int(np.argmax(logits))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = build_plugin_manager(builtins=(), environ={})
    assert pm.get_plugin("colibri_greedy_ep") is not None
    assert HookRelay(pm).sample(logits=np.array([0.0, 2.0, 1.0]), request={}) == 1
    assert plugins_mod.load_entrypoint_plugins(pm) == 0  # idempotent
    without = build_plugin_manager(load_entrypoints=False, builtins=(), environ={})
    assert without.get_plugin("colibri_greedy_ep") is None


def test_broken_entry_point_names_it(tmp_path, monkeypatch):
    make_distribution(tmp_path, "colibri_broken_ep", "raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginLoadError, match=r"entry point 'colibri_broken_ep' \(colibri_broken_ep\): ImportError: needs libfoo"):
        build_plugin_manager(builtins=(), environ={})


def test_builtins_by_name_and_object(pipe):
    r, w = pipe
    tracer = Tracer(kinds={"timing"}, fd=w, freq_hz=1e9)
    pm = build_plugin_manager(load_entrypoints=False, builtins=("metrics", "adaptive_k", tracer), environ={})
    names = dict(pm.list_name_plugin())
    assert isinstance(names["builtin:metrics"], Metrics) and isinstance(names["builtin:adaptive_k"], AdaptiveK)
    assert tracer in names.values()
    with pytest.raises(PluginLoadError, match="cannot import built-in plugin colibri_core.builtin_plugins.nope"):
        build_plugin_manager(load_entrypoints=False, builtins=("nope",), environ={})


def test_trace_hooks_env_prints_calls(capsys):
    pm = build_plugin_manager(load_entrypoints=False, builtins=(), environ={"COLIBRI_TRACE_HOOKS": "1"})
    pm.register(Recorder(), name="recorder")
    relay = HookRelay(pm)
    relay.choose_k(prompt_tokens=3, request={}, default_k=2)
    relay.routing(**ENGINE_CALLS["colibri_routing"][0])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "colibri hook: colibri_choose_k(prompt_tokens=3, request={}, default_k=2) -> [recorder]"
    assert err[1] == "colibri hook: colibri_choose_k returned 1"
    assert err[2].startswith("colibri hook: colibri_routing(layer=1, expert_ids=array([[")
    assert "logits=<float32 array [3, 8]>" in err[2] and len(err) == 3
    pm.register(AdaptiveK())  # an array result
    relay.choose_k_token(layer=0, probs=PROBS, default_k=2)
    expected = adaptive_k(PROBS, 0.7, 1, 2, 2).tolist()
    assert capsys.readouterr().err.splitlines()[-1] == f"colibri hook: colibri_choose_k_token returned array({expected}, int64)"
