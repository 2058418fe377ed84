"""HotplugManager end to end: real files, real compiler, real watchdog observer, and a
consumer thread that calls drain() between "tokens" like the engine's token loop."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import threading
import time

import numpy as np
import pytest

from colibri_core.experts.hotplug import HotplugManager
from colibri_core.experts.hotplug.errors import (ExpertCrashed, ExpertSecurityError, HotplugStateError,
                                         RollbackError)
from colibri_core.format.modelfile import sha256_file
from colibri_core.experts.hotplug.authoring.testing import MAGIC_INPUT, compile_test_expert
from hotplug_helpers import Events

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

H = 64
FIRST_SLOT = 16
SETTLE = 0.05


class TokenLoop(threading.Thread):
    """The engine's role: drain() between tokens, apply each change, run the experts."""

    def __init__(self, mgr: HotplugManager):
        super().__init__(daemon=True)
        self.mgr = mgr
        self.changes = []
        self.slots: dict[int, object] = {}
        self.tokens = 0
        self.crashes = 0
        self.failures: list[str] = []
        self._stop_evt = threading.Event()
        self._lock = threading.Lock()

    def run(self):
        x = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
        out = np.empty_like(x)
        try:
            while not self._stop_evt.is_set():
                for ch in self.mgr.drain():
                    self._apply(ch)
                for e in list(self.slots.values()):
                    try:
                        e.forward(x, out)
                    except ExpertCrashed:
                        self.crashes += 1            # the engine goes on
                self.tokens += 1
                time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001
            self.failures.append(repr(exc))

    def _apply(self, ch):
        with self._lock:
            expected_version = (self.changes[-1].version if self.changes else 0) + 1
            if ch.version != expected_version:
                self.failures.append(f"version {ch.version}, expected {expected_version}")
            if ch.kind == "add":
                if ch.expert.slot in self.slots:
                    self.failures.append(f"add into a used slot {ch.expert.slot}")
                self.slots[ch.expert.slot] = ch.expert
            elif ch.kind == "replace":
                if self.slots.get(ch.expert.slot) is not ch.previous:
                    self.failures.append("replace of an expert not in its slot")
                self.slots[ch.expert.slot] = ch.expert
                self.mgr.release(ch.previous)
            else:
                if self.slots.get(ch.expert.slot) is not ch.expert:
                    self.failures.append("remove of an expert not in its slot")
                del self.slots[ch.expert.slot]
                self.mgr.release(ch.expert)
            self.changes.append(ch)

    def wait_changes(self, n: int, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.changes) >= n:
                    return list(self.changes)
            time.sleep(0.005)
        raise AssertionError(f"{len(self.changes)} changes after {timeout} s, expected {n}:"
                             f" {[(c.kind, c.expert.name) for c in self.changes]}")

    def stop(self):
        self._stop_evt.set()
        self.join(5)
        assert not self.failures, self.failures


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "experts_so"
    d.mkdir()
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def make_manager(tmp_path, folder):
    made = []

    def make(**kw):
        events = Events()
        args = dict(experts_dir=folder, hidden_size=H, moe_layers={1, 3},
                    first_slot=FIRST_SLOT, state_dir=tmp_path / "state", settle_s=SETTLE,
                    probe_timeout_s=3.0, on_event=events)
        args.update(kw)
        mgr = HotplugManager(**args)
        made.append(mgr)
        return mgr, events
    yield make
    for m in made:
        m.close()


def drop(folder, filename, **kw):
    """Build in a scratch folder, then rename into the watched one (the safe way)."""
    scratch = folder.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    kw.setdefault("hidden", H)
    tmp = compile_test_expert(scratch / filename, **kw)
    os.replace(tmp, folder / filename)
    return folder / filename


def output_scale(expert) -> float:
    x = np.full((1, H), 0.5, np.float32)
    y = np.empty_like(x)
    expert.forward(x, y)
    return float(y[0, 1] / np.tanh(0.5))


def test_slots_file_gives_a_new_name_its_slot(make_manager, folder, tmp_path):
    """A fleet's registry numbers the experts: a name listed in the slots file gets that
    slot, others (and a listed slot already taken) the next free one."""
    slots = tmp_path / "slots.json"
    slots.write_text('{"beta": 21, "gamma": 21}')
    mgr, events = make_manager(slots_file=slots)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "beta.so", name="beta")
        (b,) = loop.wait_changes(1)
        drop(folder, "alpha.so", name="alpha")
        a = loop.wait_changes(2)[1]
        drop(folder, "gamma.so", name="gamma")
        g = loop.wait_changes(3)[2]
        assert (b.expert.slot, a.expert.slot, g.expert.slot) == (21, 22, 23)
    finally:
        loop.stop()


def test_add_replace_rollback_remove_through_the_observer(make_manager, folder):
    mgr, events = make_manager()
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        path = drop(folder, "fraud.so", name="fraud", version="1", scale=1.0)
        (add,) = loop.wait_changes(1)
        assert add.kind == "add" and add.expert.slot == FIRST_SLOT and add.version == 1
        assert add.expert.name == "fraud" and add.expert.layers == (1,)
        assert add.expert.source_path == str(path) and add.expert.isolation == "inprocess"
        assert add.expert.staged_path.endswith(f"{add.expert.sha256}.so")
        assert stat.S_IMODE(os.stat(os.path.dirname(add.expert.staged_path)).st_mode) == 0o700
        assert output_scale(add.expert) == pytest.approx(1.0)
        assert mgr.version == 1

        drop(folder, "fraud.so", name="fraud", version="2", scale=2.0)       # rename over
        replace = loop.wait_changes(2)[1]
        assert replace.kind == "replace" and replace.previous is add.expert
        assert replace.expert.slot == FIRST_SLOT and replace.expert.version == "2"
        assert output_scale(replace.expert) == pytest.approx(2.0)
        assert add.expert.status == "released"

        mgr.rollback("fraud")
        back = loop.wait_changes(3)[2]
        assert back.kind == "replace" and back.reason == "rollback"
        assert back.expert.sha256 == add.expert.sha256 and back.expert.version == "1"
        assert back.expert.staged_path == add.expert.staged_path
        assert output_scale(back.expert) == pytest.approx(1.0)
        with pytest.raises(RollbackError, match="no previous version"):
            mgr.rollback("fraud")
        rows = mgr.list()
        held = rows[0].pop("refused")       # the folder still holds version 2: listed
        assert rows == [{"slot": FIRST_SLOT, "name": "fraud", "version": "1", "layers": [1],
                         "origin": "hot-plugged", "sha256": back.expert.sha256,
                         "isolation": "inprocess", "status": "active", "binding": "portable",
                         "file": "fraud.so"}]
        assert (held["path"], held["reason"], held["sha256"]) == (
            str(path), "rolled-back", replace.expert.sha256)

        # A touch of the rolled-back-from file does not bring version 2 back.
        os.utime(path)
        time.sleep(4 * SETTLE)
        mgr.wait_idle(5)
        os.unlink(path)
        remove = loop.wait_changes(4)[3]
        assert remove.kind == "remove" and remove.expert is back.expert
        assert remove.reason == "deleted" and mgr.version == 4
        time.sleep(4 * SETTLE)
        assert len(loop.changes) == 4                       # each change exactly once
        assert [c.version for c in loop.changes] == [1, 2, 3, 4]
        assert loop.tokens > 10 and not loop.slots
    finally:
        loop.stop()
    kinds = [k for k, _ in events.items if k != "rejected"]
    assert kinds == ["loaded", "loaded", "loaded", "unloaded"]
    assert [i["reason"] for i in events.of("rejected")] in ([], ["rolled-back"])
    with pytest.raises(RollbackError, match="not active"):
        mgr.rollback("fraud")


def test_slow_chunked_copy_and_half_written_file_are_never_loaded(make_manager, folder,
                                                                  tmp_path):
    src = compile_test_expert(tmp_path / "src.so", hidden=H, name="slow")
    raw = src.read_bytes()
    mgr, events = make_manager(settle_s=0.15)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        # 1. Chunked copy straight into the final name, pauses shorter than settle_s.
        dst = folder / "slow.so"
        with open(dst, "wb") as f:
            for i in range(0, len(raw), 2048):
                f.write(raw[i:i + 2048])
                f.flush()
                time.sleep(0.01)
        (add,) = loop.wait_changes(1)
        assert add.expert.sha256 == sha256_file(str(src))
        assert not events.rejected(dst)

        # 2. A writer that stalls half-way (longer than settle_s): refused as incomplete,
        #    then adopted once the file is complete.
        src2 = compile_test_expert(tmp_path / "src2.so", hidden=H, name="stall")
        raw2 = src2.read_bytes()
        dst2 = folder / "stall.so"
        with open(dst2, "wb") as f:
            f.write(raw2[: len(raw2) // 2])
            f.flush()
            time.sleep(0.5)
            assert [r["reason"] for r in events.rejected(dst2)] == ["incomplete"]
            assert len(loop.changes) == 1
            f.write(raw2[len(raw2) // 2:])
        changes = loop.wait_changes(2)
        assert changes[1].kind == "add" and changes[1].expert.name == "stall"
        assert changes[1].expert.sha256 == sha256_file(str(src2))

        # 3. Hidden and temporary names are ignored.
        for name in (".hidden.so", "x.so.tmp", "x.so~", "x.so.part", "notes.txt"):
            shutil.copy(src, folder / name)
        time.sleep(6 * SETTLE)
        mgr.wait_idle(5)
        assert len(loop.changes) == 2
    finally:
        loop.stop()


def test_refusals_each_with_a_reason(make_manager, folder, tmp_path):
    good = compile_test_expert(tmp_path / "good.so", hidden=H, name="good")
    mgr, events = make_manager(probe_timeout_s=1.0)
    mgr.start()
    os.symlink(good, folder / "link.so")

    def placed(name, mode, owner=None):
        """A copy that arrives with its mode and owner already set (renamed in: a file
        copied in is checked once closed, before a later chmod)."""
        tmp = tmp_path / name
        shutil.copy(good, tmp)
        os.chmod(tmp, mode)
        if owner is not None:
            os.chown(tmp, owner, owner)
        os.replace(tmp, folder / name)
    placed("gw.so", 0o664)
    placed("ww.so", 0o646)
    if os.geteuid() == 0:
        placed("foreign.so", 0o644, owner=12345)
    drop(folder, "segv.so", name="segv", fault="segv")
    drop(folder, "hang.so", name="hang", fault="hang")
    drop(folder, "nan.so", name="nan", fault="nan")
    drop(folder, "abi.so", name="abi", abi=3)
    drop(folder, "wide.so", name="wide", hidden=128)
    drop(folder, "layer.so", name="layer", layer=2)
    raw = bytearray(good.read_bytes())
    raw[18:20] = (40).to_bytes(2, "little")                  # e_machine = ARM
    (tmp_path / "arm.so").write_bytes(bytes(raw))
    os.replace(tmp_path / "arm.so", folder / "arm.so")
    time.sleep(0.2)
    assert mgr.wait_idle(20)
    expected = {"link.so": "symlink", "gw.so": "writable", "ww.so": "writable",
                "segv.so": "probe-crash", "hang.so": "probe-timeout", "nan.so": "probe-failed",
                "abi.so": "abi", "wide.so": "metadata", "layer.so": "metadata",
                "arm.so": "architecture"}
    if os.geteuid() == 0:
        expected["foreign.so"] = "owner"
    for name, reason in expected.items():
        got = [r["reason"] for r in events.rejected(folder / name)]
        assert got == [reason], (name, got, [r["message"] for r in events.rejected(
            folder / name)])
        assert name in events.rejected(folder / name)[0]["message"]
    assert mgr.drain() == [] and mgr.version == 0
    assert not events.of("loaded")
    # Staged copies of refused files are not kept.
    assert os.listdir(mgr.staging_dir) == []


def test_allowlist_and_writable_folder(make_manager, folder, tmp_path):
    good = compile_test_expert(tmp_path / "good.so", hidden=H, name="good")
    other = compile_test_expert(tmp_path / "other.so", hidden=H, name="other", scale=3.0)
    mgr, events = make_manager(allowlist={sha256_file(str(good))}, watch=False)
    shutil.copy(good, folder / "good.so")
    shutil.copy(other, folder / "other.so")
    mgr.start()
    assert mgr.wait_idle(10)
    (add,) = mgr.drain()
    assert add.expert.name == "good"
    (rej,) = events.rejected(folder / "other.so")
    assert rej["reason"] == "allowlist" and rej["sha256"] == sha256_file(str(other))
    mgr.stop()

    os.chmod(folder, 0o777)
    mgr2, events2 = make_manager()
    with pytest.raises(ExpertSecurityError, match="folder is writable by group and others"):
        mgr2.start()
    assert events2.of("rejected")[0]["reason"] == "writable"
    os.chmod(folder, 0o755)
    link = tmp_path / "link_dir"
    os.symlink(folder, link)
    mgr3, _ = make_manager(experts_dir=link)
    with pytest.raises(ExpertSecurityError, match="symlink"):
        mgr3.start()


def test_isolated_expert_crash_disables_it_and_the_loop_goes_on(make_manager, folder):
    mgr, events = make_manager()
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "crashy.isolated.so", name="crashy", fault="crash_on_magic")
        drop(folder, "steady.so", name="steady")
        drop(folder, "victim.so", name="victim")
        changes = loop.wait_changes(3)
        by_name = {c.expert.name: c.expert for c in changes}
        crashy = by_name["crashy"]
        assert crashy.isolation == "isolated" and crashy.lib is None
        assert by_name["steady"].isolation == "inprocess"
        assert output_scale(crashy) == pytest.approx(1.0)   # runs in the helper
        tokens = loop.tokens
        x = np.ones((3, H), np.float32)
        x[0, 0] = MAGIC_INPUT
        with pytest.raises(ExpertCrashed, match="expert crashy .* SIGSEGV.* disabled"):
            crashy.forward(x, np.empty_like(x))
        remove = loop.wait_changes(4)[3]
        assert remove.kind == "remove" and remove.expert is crashy
        assert remove.reason == "crashed"
        time.sleep(0.1)
        assert loop.tokens > tokens + 5                      # the loop never stopped
        (unloaded,) = events.of("unloaded")
        assert unloaded["reason"] == "crashed" and "SIGSEGV" in unloaded["message"]
        rows = {r["name"]: r for r in mgr.list()}
        assert rows["crashy"]["status"] == "disabled" and rows["steady"]["status"] == "active"

        # The same bytes are not re-adopted; a helper killed from outside also disables.
        os.utime(folder / "crashy.isolated.so")
        time.sleep(4 * SETTLE)
        mgr.wait_idle(5)
        assert [r["reason"] for r in events.rejected(folder / "crashy.isolated.so")] == \
            ["disabled"]
        drop(folder, "victim.so", name="victim", version="2")   # replaced in-process...
        loop.wait_changes(5)
        drop(folder, "victim.isolated.so", name="victim2")
        victim = loop.wait_changes(6)[5].expert
        assert victim.isolation == "isolated"
        os.kill(victim.helper_pid, signal.SIGKILL)
        remove2 = loop.wait_changes(7)[6]
        assert remove2.expert is victim and remove2.reason == "crashed"
        assert loop.crashes >= 0 and len(loop.slots) == 2
    finally:
        loop.stop()


def test_restart_keeps_slots_and_rollbacks(make_manager, folder, tmp_path):
    mgr, _ = make_manager(watch=False)
    drop(folder, "a.so", name="a", version="1")
    drop(folder, "b.so", name="b", version="1")
    mgr.start()
    assert mgr.wait_idle(10)
    first = {c.expert.name: c.expert.slot for c in mgr.drain()}
    assert sorted(first.values()) == [FIRST_SLOT, FIRST_SLOT + 1]
    drop(folder, "b.so", name="b", version="2", scale=2.0)
    mgr.rescan()
    assert mgr.wait_idle(10)
    (rep,) = mgr.drain()
    assert rep.kind == "replace" and rep.expert.version == "2"
    mgr.rollback("b")
    (back,) = mgr.drain()
    assert back.expert.version == "1"
    os.unlink(folder / "a.so")
    mgr.rescan()
    assert mgr.wait_idle(10)
    assert [c.kind for c in mgr.drain()] == ["remove"]
    mgr.close()

    # Restart: "b" keeps its slot and its rolled-back version; "a" is gone but keeps its
    # slot reserved; a new expert gets the next slot; a returning "a" gets its old slot.
    drop(folder, "c.so", name="c")
    mgr2, events2 = make_manager(watch=False)
    mgr2.start()
    with pytest.raises(HotplugStateError, match="in use by another manager"):
        make_manager(watch=False)[0].start()        # one manager per state folder
    assert mgr2.wait_idle(10)
    got = {c.expert.name: c.expert for c in mgr2.drain()}
    assert got["b"].slot == first["b"] and got["b"].version == "1"
    assert got["c"].slot == FIRST_SLOT + 2 and "a" not in got
    drop(folder, "a.so", name="a", version="1")
    mgr2.rescan()
    assert mgr2.wait_idle(10)
    (again,) = mgr2.drain()
    assert again.expert.name == "a" and again.expert.slot == first["a"]
    assert [r["slot"] for r in mgr2.list()] == [FIRST_SLOT, FIRST_SLOT + 1, FIRST_SLOT + 2]


def test_release_refuses_an_active_expert(make_manager, folder):
    mgr, _ = make_manager(watch=False)
    drop(folder, "a.so", name="a", thread_safe=False)
    mgr.start()
    assert mgr.wait_idle(10)
    (add,) = mgr.drain()
    assert not add.expert.thread_safe
    with pytest.raises(ValueError, match="still active"):
        mgr.release(add.expert)
    # A non-thread-safe expert is serialized: concurrent calls all succeed.
    x = np.random.default_rng(3).standard_normal((5, H)).astype(np.float32)

    def call():
        y = np.empty_like(x)
        for _ in range(50):
            add.expert.forward(x, y)
            assert np.allclose(y, np.tanh(x), atol=1e-6)
    threads = [threading.Thread(target=call) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]


def test_a_file_that_now_provides_another_name(make_manager, folder):
    mgr, events = make_manager(watch=False)
    drop(folder, "slot.so", name="first")
    mgr.start()
    assert mgr.wait_idle(10)
    (add,) = mgr.drain()
    drop(folder, "slot.so", name="second")
    mgr.rescan()
    assert mgr.wait_idle(10)
    add2, remove = mgr.drain()
    assert (add2.kind, add2.expert.name, add2.expert.slot) == ("add", "second", FIRST_SLOT + 1)
    assert (remove.kind, remove.expert, remove.reason) == ("remove", add.expert, "renamed")
    assert [e["reason"] for e in events.of("unloaded")] == ["renamed"]
    assert mgr.version == 3 and list(mgr.active()) == ["second"]
