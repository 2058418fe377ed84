"""Plugin manager, HookRelay and the built-in plugins, with real plugins registered.

The engine's calls are simulated here (the engine-level tests live elsewhere): each
hook is called through HookRelay exactly as the forward loop calls it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
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
from colibri_core.builtin_plugins.tracer import Tracer, default_cycle_counter, measure_frequency, perf_counter_cycles

REPO = Path(__file__).resolve().parent.parent

ROUTING_RE = re.compile(r"\[ROUTING\] layer=\d+, top_k=\[\d+(,\d+)*\], scores=\[-?\d+\.\d{3}(,-?\d+\.\d{3})*\]")
MEMORY_RE = re.compile(r"\[MEMORY\] expert_\d+_\d+ @ 0x[0-9a-f]+ \(size=\d+\)")
TIME_RE = re.compile(r"\[TIME\] expert_\d+_\d+ FFN: \d+ cycles \(≈\d+\.\dus @ \d+\.\d\dGHz\)")


@pytest.fixture
def pm():
    return build_plugin_manager(load_entrypoints=False, builtins=(), environ={})


@pytest.fixture
def relay(pm):
    return HookRelay(pm)


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def read_lines(fd: int) -> list[str]:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode("utf-8").splitlines()


def short(name: str) -> str:
    return name[len("colibri_") :]


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
    def colibri_token(self, request_id, step, token_id, text, expert_set_version):
        self.calls.append(("colibri_token", request_id, step, token_id, text, expert_set_version))

    @hookimpl
    def colibri_expert_loaded(self, info):
        self.calls.append(("colibri_expert_loaded", info["path"]))

    @hookimpl
    def colibri_expert_rejected(self, path, reason):
        self.calls.append(("colibri_expert_rejected", path, reason))

    @hookimpl
    def colibri_expert_unloaded(self, info):
        self.calls.append(("colibri_expert_unloaded", info["path"]))


rng = np.random.default_rng(0)
LOGITS = rng.standard_normal((3, 8)).astype(np.float32)  # [N=3, E=8]
PROBS = np.exp(LOGITS) / np.exp(LOGITS).sum(1, keepdims=True)
IDS = np.argsort(-LOGITS, axis=1)[:, :2]  # [N, k=2]
SCORES = np.take_along_axis(PROBS, IDS, 1)
WEIGHTS = SCORES / SCORES.sum(1, keepdims=True)
HIDDEN = np.ones((3, 4), np.float32)
INFO = {"path": "experts_so/fraud.so", "layer": 1, "expert": 8, "expert_set_version": 2}

# hook -> (keyword arguments the engine passes, what the Recorder's call returns)
ENGINE_CALLS = {
    "colibri_engine_start": (dict(engine="ENGINE"), []),
    "colibri_engine_stop": (dict(engine="ENGINE"), []),
    "colibri_choose_k": (dict(prompt_tokens=5, request={}, default_k=2), 1),
    "colibri_request_start": (dict(request_id="r1", prompt_tokens=5, k=2), []),
    "colibri_request_end": (dict(request_id="r1", n_tokens=3, stop_reason="eos"), []),
    "colibri_before_layer": (dict(layer=1, hidden=HIDDEN), []),
    "colibri_choose_k_token": (dict(layer=1, probs=PROBS, default_k=2), [2, 2, 2]),
    "colibri_routing": (dict(layer=1, expert_ids=IDS, weights=WEIGHTS, scores=SCORES, logits=LOGITS), None),
    "colibri_expert_prefetch": (dict(layer=1, experts=[(3, 0x7F8A3C000000, 4096)]), []),
    "colibri_expert_timing": (dict(layer=1, expert=3, cycles=1000, seconds=1e-6), []),
    "colibri_after_layer": (dict(layer=1, hidden=HIDDEN), []),
    "colibri_sample": (dict(logits=np.array([0.1, 3.0, -1.0], np.float32), request={}), 1),
    "colibri_token": (dict(request_id="r1", step=0, token_id=7, text="hi", expert_set_version=2), []),
    "colibri_expert_loaded": (dict(info=INFO), []),
    "colibri_expert_rejected": (dict(path="experts_so/bad.so", reason="probe crashed"), []),
    "colibri_expert_unloaded": (dict(info=dict(INFO, reason="deleted")), []),
}


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


# -- tracer ---------------------------------------------------------------------------


def test_tracer_reference_lines_byte_for_byte(pm, relay, pipe):
    r, w = pipe
    pm.register(Tracer(kinds={"routing", "memory", "timing"}, fd=w, freq_hz=3.1845e9))
    relay.routing(layer=0, expert_ids=np.array([[3, 5]]), weights=np.array([[0.5, 0.5]], np.float32),
                  scores=np.array([[0.721, 0.689]], np.float32), logits=np.zeros((1, 8), np.float32))
    relay.expert_prefetch(layer=0, experts=[(3, 0x7F8A3C000000, 1245184)])
    relay.expert_timing(layer=0, expert=3, cycles=124832, seconds=39.2e-6)
    assert read_lines(r) == [
        "[ROUTING] layer=0, top_k=[3,5], scores=[0.721,0.689]",
        "[MEMORY] expert_0_3 @ 0x7f8a3c000000 (size=1245184)",
        "[TIME] expert_0_3 FFN: 124832 cycles (≈39.2us @ 3.18GHz)",
    ]


def test_tracer_routing_one_line_per_token_and_formats(pm, relay, pipe):
    r, w = pipe
    pm.register(Tracer(kinds={"routing", "memory", "timing"}, fd=w))  # measured frequency
    ids = np.array([[7, 1, 2], [0, 4, -1], [5, -1, -1]])  # per-token k = 3, 2, 1
    scores = np.array([[0.5, 0.25, 0.125], [0.9, 0.05, 0.0], [0.99, 0.0, 0.0]], np.float32)
    relay.routing(layer=12, expert_ids=ids, weights=scores, scores=scores, logits=np.zeros((3, 8), np.float32))
    relay.expert_prefetch(layer=12, experts=[(7, 140000000000000, 3 * 4096), (1, 0x1000, 4096)])
    for e in (7, 1):
        relay.expert_timing(layer=12, expert=e, cycles=99999, seconds=1e-4)
    lines = read_lines(r)
    assert len(lines) == 3 + 2 + 2
    assert all(ROUTING_RE.fullmatch(x) for x in lines[:3])
    assert all(MEMORY_RE.fullmatch(x) for x in lines[3:5])
    assert all(TIME_RE.fullmatch(x) for x in lines[5:])
    assert lines[1] == "[ROUTING] layer=12, top_k=[0,4], scores=[0.900,0.050]"
    assert lines[2] == "[ROUTING] layer=12, top_k=[5], scores=[0.990]"
    assert lines[3] == f"[MEMORY] expert_12_7 @ {hex(140000000000000)} (size=12288)"


def test_tracer_registers_only_enabled_kinds(pm, relay, pipe):
    r, w = pipe
    pm.register(Tracer(kinds={"memory"}, fd=w))
    assert relay.expert_prefetch is not None
    assert relay.routing is None and relay.expert_timing is None and relay.engine_stop is None
    pm.register(Tracer(kinds=(), fd=w))
    assert relay.active() == ["expert_prefetch"]


def test_tracer_frequency_measured_against_perf_counter():
    fake_3ghz = lambda: time.perf_counter_ns() * 3  # noqa: E731
    assert measure_frequency(fake_3ghz) == pytest.approx(3e9, rel=0.05)
    assert Tracer(kinds={"timing"}, cycle_counter=fake_3ghz).freq_hz == pytest.approx(3e9, rel=0.05)
    assert Tracer(kinds={"timing"}, cycle_counter=perf_counter_cycles).freq_hz == pytest.approx(1e9, rel=0.05)
    assert Tracer(kinds={"timing"}).cycle_counter is default_cycle_counter()  # what the engine times with
    assert Tracer(kinds={"routing"}).freq_hz is None  # not measured when timing is off


def test_tracer_from_spec():
    assert Tracer.from_spec("routing, MEMORY").kinds == {"routing", "memory"}
    assert Tracer.from_spec("all", freq_hz=1e9).kinds == {"routing", "memory", "timing"}
    with pytest.raises(ValueError, match="unknown trace kind 'routes'.*routing,memory,timing"):
        Tracer.from_spec("routes")
    with pytest.raises(ValueError, match="fd or path"):
        Tracer(fd=2, path="x.log")


def test_tracer_from_env(tmp_path, pipe):
    r, w = pipe
    assert Tracer.from_env({}) is None
    t = Tracer.from_env({"COLIBRI_DEBUG": "routing,timing", "COLIBRI_DEBUG_FD": str(w)}, freq_hz=2e9)
    assert t.kinds == {"routing", "timing"} and t.fd == w
    with pytest.raises(ValueError, match="COLIBRI_DEBUG_FD or COLIBRI_DEBUG_FILE"):
        Tracer.from_env({"COLIBRI_DEBUG": "routing", "COLIBRI_DEBUG_FD": "3", "COLIBRI_DEBUG_FILE": "x"})
    with pytest.raises(ValueError, match="COLIBRI_DEBUG_FD must be"):
        Tracer.from_env({"COLIBRI_DEBUG": "routing", "COLIBRI_DEBUG_FD": "stderr"})


def test_tracer_to_file_closed_at_engine_stop(pm, relay, tmp_path):
    path = tmp_path / "trace.log"
    tracer = Tracer.from_env({"COLIBRI_DEBUG": "memory", "COLIBRI_DEBUG_FILE": str(path)})
    pm.register(tracer)
    relay.expert_prefetch(layer=2, experts=[(0, 0xABC000, 8192)])
    relay.engine_stop(engine=None)
    assert tracer.fd is None
    assert path.read_text() == "[MEMORY] expert_2_0 @ 0xabc000 (size=8192)\n"


def test_tracer_write_error_warns_once_and_stops(pipe):
    r, w = pipe
    tracer = Tracer(kinds={"memory"}, fd=w)
    os.close(r)  # reader gone: EPIPE
    with pytest.warns(RuntimeWarning, match="tracing stopped"):
        tracer.colibri_expert_prefetch(layer=0, experts=[(1, 0x1000, 1)])
    tracer.colibri_expert_prefetch(layer=0, experts=[(1, 0x1000, 1)])  # silent now
    assert tracer.fd is None


def test_default_builtins_tracer_from_environment(pipe):
    r, w = pipe
    off = HookRelay(build_plugin_manager(load_entrypoints=False, environ={}))
    assert off.active() == []
    on = HookRelay(build_plugin_manager(load_entrypoints=False, environ={"COLIBRI_DEBUG": "routing", "COLIBRI_DEBUG_FD": str(w)}))
    assert on.active() == ["routing"]
    on.routing(layer=3, expert_ids=np.array([[1]]), weights=np.ones((1, 1), np.float32),
               scores=np.array([[1.0]], np.float32), logits=np.zeros((1, 2), np.float32))
    assert read_lines(r) == ["[ROUTING] layer=3, top_k=[1], scores=[1.000]"]


# -- adaptive k -----------------------------------------------------------------------


def adaptive_k_reference(probs, p, k_min, k_max, default_k):
    out = []
    for row in np.asarray(probs, np.float64):
        total = row.sum()
        if not np.isfinite(total) or total <= 0:
            out.append(min(max(default_k, k_min), k_max))
            continue
        cum, k = 0.0, 0
        for v in sorted(row / total, reverse=True):
            cum += v
            k += 1
            if cum >= p - 1e-6:
                break
        out.append(min(max(k, k_min), k_max))
    return out


@pytest.mark.parametrize("p,k_min,k_max", [(0.7, 1, 4), (0.5, 2, 3), (0.95, 1, 8), (1.0, 1, 64), (0.3, 1, 1)])
def test_adaptive_k_matches_reference(p, k_min, k_max):
    probs = np.random.default_rng(1).dirichlet(np.full(16, 0.3), size=200).astype(np.float32)
    got = adaptive_k(probs, p, k_min, k_max, default_k=2)
    assert got.dtype == np.int64 and got.shape == (200,)
    assert got.tolist() == adaptive_k_reference(probs, p, k_min, min(k_max, 16), 2)


def test_adaptive_k_edges():
    probs = np.array([[0.7, 0.3, 0.0], [0.4, 0.35, 0.25], [np.nan, 0.5, 0.5], [0.0, 0.0, 0.0]], np.float32)
    assert adaptive_k(probs, 0.7, 1, 3, default_k=2).tolist() == [1, 2, 2, 2]
    sigmoid = np.array([[0.9, 0.9, 0.1, 0.1]], np.float32)  # sums to 2: normalized
    assert adaptive_k(sigmoid, 0.7, 1, 4, default_k=2).tolist() == [2]
    assert adaptive_k(np.zeros((0, 4), np.float32), 0.7, 1, 4, 2).shape == (0,)
    with pytest.raises(ValueError, match="AdaptiveK: p"):
        AdaptiveK(p=0)
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_min=3, k_max=2)


def test_adaptive_k_plugin_through_relay(pm, relay):
    pm.register(AdaptiveK(p=0.7, k_min=1))  # k_max: the request's k
    probs = np.array([[0.9, 0.05, 0.03, 0.02], [0.3, 0.3, 0.2, 0.2]], np.float32)
    assert relay.choose_k_token(layer=4, probs=probs, default_k=2).tolist() == [1, 2]
    assert relay.choose_k_token(layer=4, probs=probs, default_k=4).tolist() == [1, 3]


# -- metrics --------------------------------------------------------------------------


def run_request(relay, request_id, steps, times, clock_values):
    """Simulate the engine: request_start, per token 2 MoE layers + token, request_end."""
    relay.request_start(request_id=request_id, prompt_tokens=4, k=2)
    for step, ids in enumerate(steps):
        for layer in (1, 3):
            relay.routing(layer=layer, expert_ids=ids, weights=np.ones(ids.shape, np.float32),
                          scores=np.ones(ids.shape, np.float32), logits=np.zeros((len(ids), 66), np.float32))
        clock_values.append(times[step])
        relay.token(request_id=request_id, step=step, token_id=100 + step, text="x", expert_set_version=0)
    relay.request_end(request_id=request_id, n_tokens=len(steps), stop_reason="max_tokens")


def test_metrics_per_request(pm, relay):
    clock_values = []
    metrics = Metrics(hotplug_threshold=64, clock=lambda: clock_values[-1])
    pm.register(metrics)
    relay.expert_loaded(info={"path": "experts_so/fraud.so", "layer": 3, "expert": 5, "expert_set_version": 1})
    steps = [np.array([[0, 5]]), np.array([[5, 64]]), np.array([[0, -1]])]
    run_request(relay, "r1", steps, times=[10.000, 10.004, 10.0995], clock_values=clock_values)
    data = json.loads(metrics.to_json())
    assert data["request_id"] == "r1" and data["tokens"] == 3 and data["stop_reason"] == "max_tokens"
    assert data["experts_per_layer"] == {"1": {"0": 2, "5": 2, "64": 1}, "3": {"0": 2, "5": 2, "64": 1}}
    assert data["distinct_experts_per_layer"] == {"1": 3, "3": 3}
    # expert 64 is hot-plugged by threshold in both layers; 5 is announced for layer 3 only
    assert data["hot_plugged_hits_by_expert"] == {"expert_1_64": 1, "expert_3_5": 2, "expert_3_64": 1}
    assert data["hot_plugged_hits"] == 4
    lat = data["inter_token_ms"]
    assert lat["count"] == 2 and lat["max"] == pytest.approx(95.5)
    assert lat["histogram"]["<=5ms"] == 1 and lat["histogram"]["<=100ms"] == 1
    assert sum(lat["histogram"].values()) == 2

    # the next request starts from zero; the unloaded expert is no longer hot
    relay.expert_unloaded(info={"path": "experts_so/fraud.so", "layer": 3, "expert": 5, "reason": "deleted"})
    run_request(relay, "r2", [np.array([[5, 1]])], times=[20.0], clock_values=clock_values)
    data = metrics.to_dict()
    assert data["request_id"] == "r2" and data["tokens"] == 1 and data["hot_plugged_hits"] == 0
    assert data["experts_per_layer"] == {"1": {"1": 1, "5": 1}, "3": {"1": 1, "5": 1}}
    assert data["inter_token_ms"]["count"] == 0 and data["inter_token_ms"]["p50"] is None
    metrics.reset()
    assert metrics.to_json() == "{}"


def test_metrics_ignores_routing_outside_requests(pm, relay):
    metrics = Metrics()
    pm.register(metrics)
    relay.routing(**ENGINE_CALLS["colibri_routing"][0])
    relay.token(request_id="nobody", step=0, token_id=1, text="", expert_set_version=0)
    assert metrics.to_dict() == {}


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
