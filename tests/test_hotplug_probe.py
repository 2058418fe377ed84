"""The out-of-process probe and the isolated helper, on real faulty experts."""
from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest

from colibri_core.experts.hotplug.errors import ExpertCrashed, ExpertProbeError
from colibri_core.experts.hotplug.isolated import IsolatedRunner
from colibri_core.experts.hotplug.probe import run_probe
from colibri_core.experts.hotplug.authoring.testing import MAGIC_INPUT, compile_test_expert

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

H = 64


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    faults = ["none", "segv", "hang", "nan", "rc", "partial", "crash_on_magic",
              "abort_on_load"]
    return {f: str(compile_test_expert(d / f"{f}.so", hidden=H, fault=f)) for f in faults}


def test_healthy_expert_passes(experts):
    assert run_probe(experts["none"], H, 5.0)["ok"] is True
    assert run_probe(experts["crash_on_magic"], H, 5.0)["ok"] is True   # only on one input


@pytest.mark.parametrize("fault, reason, message", [
    ("segv", "probe-crash", "crashed with SIGSEGV"),
    ("abort_on_load", "probe-crash", "crashed with SIGABRT"),
    ("nan", "probe-failed", "is NaN"),
    ("rc", "probe-failed", "returned 7 .* expected 0"),
    ("partial", "probe-failed", "y\\[1\\]\\[0\\] is NaN .* not written"),
])
def test_faulty_experts_are_refused_with_a_reason(experts, fault, reason, message):
    with pytest.raises(ExpertProbeError, match=message) as e:
        run_probe(experts[fault], H, 5.0)
    assert e.value.reason == reason and experts[fault] in str(e.value)


def test_hanging_expert_is_killed_at_the_time_limit(experts):
    t0 = time.monotonic()
    with pytest.raises(ExpertProbeError, match="hung: no verdict within 0.5 s") as e:
        run_probe(experts["hang"], H, 0.5)
    assert e.value.reason == "probe-timeout"
    assert time.monotonic() - t0 < 3.0


def test_wrong_hidden_size_is_a_nonzero_return(experts):
    with pytest.raises(ExpertProbeError, match="returned 1"):
        run_probe(experts["none"], 32, 5.0)


def test_isolated_runner_matches_in_process_and_chunks(experts):
    r = IsolatedRunner(experts["none"], H, capacity=4, call_timeout_s=5.0)
    try:
        x = np.random.default_rng(0).standard_normal((11, H)).astype(np.float32)
        out = np.full_like(x, np.nan)
        assert r.forward(x, out) == 0                 # 11 tokens through a 4-token window
        np.testing.assert_allclose(out, np.tanh(x), rtol=1e-6, atol=1e-6)
        assert r.alive()
    finally:
        r.close()
    assert not r.alive()


def test_isolated_helper_crash_is_reported_not_propagated(experts):
    r = IsolatedRunner(experts["crash_on_magic"], H, call_timeout_s=5.0)
    x = np.ones((2, H), np.float32)
    out = np.empty_like(x)
    r.forward(x, out)
    x[0, 0] = MAGIC_INPUT
    with pytest.raises(ExpertCrashed, match="SIGSEGV"):
        r.forward(x, out)
    assert not r.alive()
    with pytest.raises(ExpertCrashed, match="dead"):
        r.forward(np.ones((1, H), np.float32), out[:1])
    r.close()


def test_isolated_helper_killed_between_calls_and_hang(experts):
    r = IsolatedRunner(experts["none"], H, call_timeout_s=5.0)
    os.kill(r.pid, signal.SIGKILL)
    r.proc.wait()
    assert not r.alive()
    with pytest.raises(ExpertCrashed):
        r.forward(np.ones((1, H), np.float32), np.empty((1, H), np.float32))
    r.close()
    hang = IsolatedRunner(experts["hang"], H, call_timeout_s=0.3)
    with pytest.raises(ExpertCrashed, match="no answer within 0.3 s"):
        hang.forward(np.ones((1, H), np.float32), np.empty((1, H), np.float32))
    assert not hang.alive()
    hang.close()
