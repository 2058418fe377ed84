"""How a file arrives decides whether it waits to settle (inotify masks), and the worker
is never held up: renames and closed files are checked at once, writers that never close
and the polling observer wait for the settle time, a FIFO never blocks, probes run side
by side, one expert name at a time. Real files, real compiler, real inotify.

With settle_s = 1000, anything adopted within the test's deadlines was checked without
settling: that is what these tests use instead of timing anything."""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from colibri_core.experts.hotplug.errors import ExpertSecurityError
from colibri_core.experts.hotplug.expert import _ffi
from colibri_core.experts.hotplug.staging import FileChanged, FileSig, open_source
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
from test_hotplug_manager import (FIRST_SLOT, H, Events, TokenLoop, drop,  # noqa: F401
                                  folder, make_manager)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

NEVER = 1000.0          # a settle time no test waits for
DEADLINE = 15.0


def wait_for(pred, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_renamed_in_from_outside_is_checked_without_settling(make_manager, folder):
    mgr, events = make_manager(settle_s=NEVER)
    mgr.start()
    assert mgr._watcher.kind == "inotify"
    loop = TokenLoop(mgr)
    loop.start()
    try:
        path = drop(folder, "out.so", name="out")           # built outside, renamed in
        (add,) = loop.wait_changes(1, DEADLINE)
        assert (add.kind, add.expert.name, add.expert.source_path) == ("add", "out", str(path))
    finally:
        loop.stop()
    assert not events.of("rejected")


def test_renamed_within_the_folder_the_expert_stays(make_manager, folder):
    """A dotted temporary name renamed to the final one (what the builder and the Makefile
    do), then the final name renamed again: the expert follows its file."""
    src = compile_test_expert(folder.parent / "w.so", hidden=H, name="walker")
    shutil.copyfile(src, folder / ".walker.so.tmp")              # ignored name
    os.chmod(folder / ".walker.so.tmp", 0o644)
    mgr, events = make_manager(settle_s=NEVER)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        os.rename(folder / ".walker.so.tmp", folder / "a.so")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.source_path == str(folder / "a.so")
        os.rename(folder / "a.so", folder / "b.so")
        wait_for(lambda: (mgr.active().get("walker") is not None
                          and mgr.active()["walker"].source_path == str(folder / "b.so")),
                 "the expert to come from b.so")
        assert mgr.wait_idle(DEADLINE)
        assert list(mgr.active()) == ["walker"]
        assert {c.expert.slot for c in loop.changes} == {FIRST_SLOT}
        os.unlink(folder / "b.so")
        wait_for(lambda: not mgr.active(), "the removal")
        assert loop.changes[-1].kind == "remove" and loop.changes[-1].reason == "deleted"
    finally:
        loop.stop()
    assert not events.of("rejected")


@pytest.mark.skipif(__import__("sys").version_info < (3, 11), reason="bundles need tomllib")
def test_a_bundle_renamed_in_is_checked_without_settling(make_manager, folder, tmp_path):
    from hotplug_helpers import write_bundle
    bundle = write_bundle(tmp_path / "scratch" / "ref.expert", name="ref", hidden=H)
    mgr, events = make_manager(settle_s=NEVER)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        os.rename(bundle, folder / "ref.expert")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert (add.kind, add.expert.name) == ("add", "ref")
    finally:
        loop.stop()
    assert not events.of("rejected")


def test_copied_in_it_is_checked_when_closed(make_manager, folder, tmp_path):
    """Written in place, in chunks, with pauses: nothing happens while the writer has it
    open (no settle time passes), it is checked once closed."""
    raw = compile_test_expert(tmp_path / "cp.so", hidden=H, name="copied").read_bytes()
    mgr, events = make_manager(settle_s=NEVER)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        with open(folder / "copied.so", "wb") as f:
            for i in range(0, len(raw), 1024):
                f.write(raw[i:i + 1024])
                f.flush()
                time.sleep(0.005)
            time.sleep(0.5)
            assert not loop.changes and not events.of("rejected")     # still open
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.name == "copied"
        shutil.copy(tmp_path / "cp.so", folder / "copied.so")     # cp over it: same bytes
        os.unlink(tmp_path / "cp.so")
        time.sleep(0.5)
    finally:
        loop.stop()
    assert not events.of("rejected")
    assert len(loop.changes) == 1          # same expert, same bytes: nothing to change


def test_a_writer_that_never_closes_waits_for_the_settle_time(make_manager, folder, tmp_path):
    raw = compile_test_expert(tmp_path / "open.so", hidden=H, name="held").read_bytes()
    mgr, events = make_manager(settle_s=0.3)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        with open(folder / "held.so", "wb") as f:
            f.write(raw[:len(raw) // 2])
            f.flush()
            wait_for(lambda: events.rejected(folder / "held.so"), "the incomplete refusal")
            assert [r["reason"] for r in events.rejected(folder / "held.so")] == \
                ["incomplete"]
            f.write(raw[len(raw) // 2:])
            f.flush()
            (add,) = loop.wait_changes(1, DEADLINE)              # settled while still open
            assert add.expert.name == "held"
    finally:
        loop.stop()


def test_the_polling_observer_settles(make_manager, folder):
    mgr, events = make_manager(polling=True)
    mgr.start()
    assert mgr._watcher.kind == "polling"
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "polled.so", name="polled")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.name == "polled"
        os.unlink(folder / "polled.so")
        loop.wait_changes(2, DEADLINE)
    finally:
        loop.stop()
    mgr2, _ = make_manager(settle_s=NEVER, polling=True, state_dir=folder.parent / "st2")
    mgr2.start()
    drop(folder, "never.so", name="never")
    time.sleep(1.5)                                  # three polls: seen, but not settled
    assert mgr2.drain() == [] and not mgr2.wait_idle(0.1)


def test_a_fifo_never_blocks_the_worker(make_manager, folder, tmp_path):
    fifo = tmp_path / "pipe.so"
    os.mkfifo(fifo)
    out: list = []

    def opener():                 # the first open of a file: O_NOFOLLOW | O_NONBLOCK
        try:
            out.append(open_source(str(fifo)))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    th = threading.Thread(target=opener, daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "opening a FIFO blocked"
    assert isinstance(out[0], ExpertSecurityError) and out[0].reason == "not-regular"
    link = tmp_path / "link.so"
    os.symlink(compile_test_expert(tmp_path / "real.so", hidden=H), link)
    sig = FileSig.of(os.stat(link))
    with pytest.raises(FileChanged):              # a symlink swapped in: not followed
        open_source(str(link), sig)

    mgr, events = make_manager()
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        os.mkfifo(folder / "fifo.so")
        drop(folder, "after.so", name="after")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.name == "after"
        wait_for(lambda: events.rejected(folder / "fifo.so"), "the FIFO's refusal")
        assert [r["reason"] for r in events.rejected(folder / "fifo.so")] == ["not-regular"]
    finally:
        loop.stop()


def test_a_good_file_is_not_held_behind_a_hanging_probe(make_manager, folder):
    mgr, events = make_manager(probe_slots=2, probe_timeout_s=5.0)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "hang.so", name="hang", fault="hang")
        drop(folder, "good.so", name="good")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.name == "good"
        assert not events.rejected(folder / "hang.so")          # its probe still runs
        wait_for(lambda: events.rejected(folder / "hang.so"), "the hang's refusal")
        assert [r["reason"] for r in events.rejected(folder / "hang.so")] == ["probe-timeout"]
    finally:
        loop.stop()


def test_with_every_slot_hanging_the_next_file_waits(make_manager, folder):
    mgr, events = make_manager(probe_slots=1, probe_timeout_s=1.0)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "hang.so", name="hang", fault="hang")
        wait_for(lambda: mgr._probes is not None and mgr._probes.running(),
                 "the hang's probe")
        drop(folder, "good.so", name="good")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert add.expert.name == "good"
        assert [r["reason"] for r in events.rejected(folder / "hang.so")] == ["probe-timeout"]
        kinds = [k for k, _ in events.items]
        assert kinds.index("rejected") < kinds.index("loaded")
    finally:
        loop.stop()


def test_one_file_per_expert_name_is_probed_at_a_time(make_manager, folder):
    """Two files carrying one name: the second waits for the first one's verdict, so the
    name ends as the files were checked (here: the first refused, the second adopted)."""
    mgr, events = make_manager(probe_slots=2, probe_timeout_s=1.0)
    mgr.start()
    loop = TokenLoop(mgr)
    loop.start()
    try:
        drop(folder, "first.so", name="same", version="1", fault="hang")
        wait_for(lambda: mgr._probes is not None and mgr._probes.running(),
                 "the first probe")
        drop(folder, "second.so", name="same", version="2")
        (add,) = loop.wait_changes(1, DEADLINE)
        assert (add.expert.name, add.expert.version) == ("same", "2")
        kinds = [k for k, _ in events.items]
        assert kinds.index("rejected") < kinds.index("loaded")
    finally:
        loop.stop()


def test_drain_only_adopts_what_the_worker_made(make_manager, folder):
    """dlopen happens on the worker; every change drain() returns was shown to `prepare`
    (with the same objects) before drain() could return it."""
    opened: list[str] = []
    real_dlopen = _ffi.dlopen

    def spy(*a, **k):
        opened.append(threading.current_thread().name)
        return real_dlopen(*a, **k)
    previews: list[tuple] = []
    mgr, events = make_manager(prepare=lambda changes: previews.extend(changes))
    _ffi.dlopen = spy
    try:
        mgr.start()
        loop = TokenLoop(mgr)
        loop.start()
        try:
            drop(folder, "a.so", name="a", version="1")
            loop.wait_changes(1, DEADLINE)
            drop(folder, "a.so", name="a", version="2", scale=2.0)      # replace
            loop.wait_changes(2, DEADLINE)
            drop(folder, "b.so", name="b")
            loop.wait_changes(3, DEADLINE)
            os.unlink(folder / "a.so")                                  # remove
            changes = loop.wait_changes(4, DEADLINE)
        finally:
            loop.stop()
    finally:
        _ffi.dlopen = real_dlopen
    assert [(c.kind, c.expert.name) for c in changes] == \
        [("add", "a"), ("replace", "a"), ("add", "b"), ("remove", "a")]
    assert [(k, e, p) for k, e, p in previews] == \
        [(c.kind, c.expert, c.previous) for c in changes]
    assert opened and set(opened) == {"colibri-hotplug-worker"}, opened
