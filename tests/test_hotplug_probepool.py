"""The warm probe helper (probe.py --serve) and its pool (probepool.py), on real faulty
experts: the same verdicts as a fresh interpreter, probes side by side, a timeout that
kills the whole process group, a clean helper, restarts."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

from colibri_core.experts.hotplug.errors import ExpertProbeError
from colibri_core.experts.hotplug.probe import interpret, run_probe
from colibri_core.experts.hotplug.probepool import ProbePool
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

H = 64
FAULTS = ["none", "segv", "abort_on_load", "nan", "rc", "partial", "hang", "fork_hang"]


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    return {f: str(compile_test_expert(d / f"{f}.so", hidden=H, fault=f)) for f in FAULTS}


@pytest.fixture
def pool(tmp_path):
    p = ProbePool(2, cwd=str(tmp_path))
    p.start()
    yield p
    p.close()


class Answers:
    """done(raw, err) callbacks, in the order they came."""

    def __init__(self):
        self.got: list[tuple[str, dict | None, BaseException | None]] = []
        self.cond = threading.Condition()

    def done(self, label: str):
        def cb(raw, err):
            with self.cond:
                self.got.append((label, raw, err))
                self.cond.notify_all()
        return cb

    def wait(self, n: int, timeout: float = 30.0) -> list:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.got) < n:
                left = deadline - time.monotonic()
                assert left > 0, f"{len(self.got)} answers after {timeout} s, expected {n}"
                self.cond.wait(left)
            return list(self.got)

    def order(self) -> list[str]:
        with self.cond:
            return [label for label, _, _ in self.got]


def verdict(path: str, raw, err, timeout: float):
    """What the manager makes of an answer: the verdict, or the refusal."""
    if err is not None:
        return ("refused", err.reason, str(err))
    try:
        return ("ok", interpret(path, raw, timeout))
    except ExpertProbeError as e:
        return ("refused", e.reason, str(e))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fault", FAULTS)
def test_same_verdict_as_a_fresh_interpreter(experts, pool, tmp_path, fault):
    timeout = 1.0 if "hang" in fault else 10.0
    answers = Answers()
    pool.submit(experts[fault], H, timeout, answers.done(fault), cwd=str(tmp_path))
    ((_, raw, err),) = answers.wait(1)
    warm = verdict(experts[fault], raw, err, timeout)
    try:
        fresh = ("ok", run_probe(experts[fault], H, timeout, cwd=str(tmp_path)))
    except ExpertProbeError as e:
        fresh = ("refused", e.reason, str(e))
    assert warm == fresh
    assert (warm[0] == "ok") == (fault == "none")


def test_the_helper_is_a_clean_interpreter_not_a_fork_of_the_engine(pool):
    pid = pool.helper_pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"colibri_core.experts.hotplug.probe" in argv and b"--serve" in argv, argv
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    import numpy                                   # loaded here, in the engine's process
    assert os.path.dirname(numpy.__file__) in open("/proc/self/maps").read()
    assert os.path.dirname(numpy.__file__) not in maps        # ... not in the helper
    assert "_colibri_kernels" not in maps
    with open(f"/proc/{pid}/status") as f:
        ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    assert ppid == os.getpid()


def test_a_hanging_probe_leaves_the_other_slot_free(experts, pool, tmp_path):
    answers = Answers()
    pool.submit(experts["hang"], H, 3.0, answers.done("hang"), cwd=str(tmp_path))
    pool.submit(experts["none"], H, 10.0, answers.done("good"), cwd=str(tmp_path))
    answers.wait(2)
    assert answers.order() == ["good", "hang"]
    (raw,) = [r for label, r, _ in answers.got if label == "hang"]
    assert verdict(experts["hang"], raw, None, 3.0)[1] == "probe-timeout"


def test_with_every_slot_hanging_the_next_probe_waits(experts, tmp_path):
    pool = ProbePool(1, cwd=str(tmp_path))
    try:
        answers = Answers()
        pool.submit(experts["hang"], H, 1.0, answers.done("hang"), cwd=str(tmp_path))
        pool.submit(experts["none"], H, 10.0, answers.done("good"), cwd=str(tmp_path))
        answers.wait(2)
        assert answers.order() == ["hang", "good"]
    finally:
        pool.close()


def test_the_timeout_kills_the_probe_and_what_it_forked(experts, pool, tmp_path):
    answers = Answers()
    pool.submit(experts["fork_hang"], H, 2.0, answers.done("fork"), cwd=str(tmp_path))
    pidfile = tmp_path / "fork_hang.pid"
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the expert never forked"
        time.sleep(0.01)
    grandchild = int(pidfile.read_text())
    ((_, raw, err),) = answers.wait(1)
    assert verdict(experts["fork_hang"], raw, err, 2.0)[1] == "probe-timeout"
    deadline = time.monotonic() + 10
    while alive(grandchild):
        assert time.monotonic() < deadline, f"pid {grandchild} outlived its probe"
        time.sleep(0.01)


def test_a_dead_helper_is_restarted_and_takes_its_children_along(experts, pool, tmp_path):
    answers = Answers()
    pool.submit(experts["hang"], H, 60.0, answers.done("hang"), cwd=str(tmp_path))
    deadline = time.monotonic() + 20
    while not (pool.running() and pool.running()[0]["child_pid"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child, helper = pool.running()[0]["child_pid"], pool.helper_pid
    os.kill(helper, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while alive(child) or pool.helper_pid in (None, helper):   # PR_SET_PDEATHSIG
        assert time.monotonic() < deadline, "the child outlived its helper"
        time.sleep(0.01)
    assert pool.restarts == 1
    # The probe that was running is sent again, once: a second death refuses it.
    while not (pool.running() and pool.running()[0]["child_pid"] not in (None, child)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(pool.helper_pid, signal.SIGKILL)
    ((_, raw, err),) = answers.wait(1)
    assert isinstance(err, ExpertProbeError) and err.reason == "probe-crash"
    assert "died twice" in str(err)
    # The pool goes on with a third helper.
    pool.submit(experts["none"], H, 10.0, answers.done("good"), cwd=str(tmp_path))
    _, (_, raw, err) = answers.wait(2)
    assert verdict(experts["none"], raw, err, 10.0)[0] == "ok"
    assert pool.restarts == 2


def test_close_kills_the_helper_and_what_runs_in_it(experts, tmp_path):
    pool = ProbePool(2, cwd=str(tmp_path))
    pool.submit(experts["hang"], H, 60.0, lambda raw, err: None, cwd=str(tmp_path))
    deadline = time.monotonic() + 20
    while not (pool.running() and pool.running()[0]["child_pid"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child, helper = pool.running()[0]["child_pid"], pool.helper_pid
    fds = len(os.listdir("/proc/self/fd"))
    pool.close()
    assert not alive(helper)
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) < fds          # its pipes are closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(experts["none"], H, 1.0, lambda raw, err: None)
