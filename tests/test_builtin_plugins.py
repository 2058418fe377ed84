"""The built-in plugins -- tracer, adaptive k, metrics -- with the engine's calls simulated
through HookRelay exactly as the forward loop makes them."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_core.plugins import HookRelay, build_plugin_manager
from colibri_core.builtin_plugins.adaptive_k import AdaptiveK, adaptive_k
from colibri_core.builtin_plugins.metrics import Metrics
from colibri_core.builtin_plugins.tracer import Tracer, default_cycle_counter, measure_frequency, perf_counter_cycles

from plugin_helpers import ENGINE_CALLS, MEMORY_RE, ROUTING_RE, TIME_RE, read_lines

REPO = Path(__file__).resolve().parent.parent


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
        relay.token(request_id=request_id, step=step, token_id=100 + step, text="x", expert_set_generation=0,
                    expert_set_id="")
    relay.request_end(request_id=request_id, n_tokens=len(steps), stop_reason="max_tokens")


def test_metrics_per_request(pm, relay):
    clock_values = []
    metrics = Metrics(hotplug_threshold=64, clock=lambda: clock_values[-1])
    pm.register(metrics)
    relay.expert_loaded(info={"path": "experts_so/fraud.so", "layer": 3, "expert": 5, "expert_set_generation": 1,
                               "expert_set_id": ""})
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
    relay.token(request_id="nobody", step=0, token_id=1, text="", expert_set_generation=0,
                expert_set_id="")
    assert metrics.to_dict() == {}


def test_adaptive_k_figures_on_the_builtin_model():
    """The floor of docs/BENCHMARKS.md's adaptive-k table (benchmarks/accuracy/bench_adaptive_k.py):
    p = 0.5 routes fewer experts than k = 2, at well under fixed k = 1's KL from k = 2."""
    from adaptive_k_helpers import measure
    rows = {r["setting"]: r for r in measure(ps=(0.5,))}
    ada, k1 = rows["adaptive p=0.5"], rows["fixed k=1"]
    assert ada["experts_per_token"] < 2.0
    assert ada["kl_vs_default"] < 0.6 * k1["kl_vs_default"], rows
