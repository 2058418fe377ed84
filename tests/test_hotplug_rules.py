"""One rule across restarts (docs/HOTPLUG.md, "One rule for refused files"): the last good
version of an expert stays active when a refused file replaces its file, in the running
manager and after a restart (adopted from staging); list() shows the refused file and its
reason beside it; a folder refused for its permissions is checked again, files and all,
once it is safe; every refusal is one log line naming the file and the rule.

Real files, a real compiler, real watchdog observers; no timed assertions."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from hotplug_helpers import folder, make_manager  # noqa: F401  (fixtures)
from hotplug_helpers import (FIRST_SLOT, drain_until, drop, drop_bytes, output_scale,
                             wait_for)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def refusal_lines(caplog, path) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "colibri.hotplug" and r.levelno >= logging.WARNING
            and str(path) in r.getMessage()]


# How a refused file replaces fraud.so, and the rule that refuses it.
def _segv(folder):
    drop(folder, "fraud.so", name="fraud", version="2", fault="segv")


def _wide(folder):
    drop(folder, "fraud.so", name="fraud", version="2", hidden=128)


def _garbage(folder):
    drop_bytes(folder, "fraud.so", b"not an ELF file" * 20)


def _writable(folder):
    drop(folder, "fraud.so", name="fraud", version="2", scale=5.0)
    os.chmod(folder / "fraud.so", 0o664)


REFUSED = {"probe-crash": _segv, "metadata": _wide, "elf": _garbage, "writable": _writable}


@pytest.mark.parametrize("rule", sorted(REFUSED))
def test_last_good_version_stays_active_now_and_after_a_restart(make_manager, folder, rule,
                                                                caplog):
    caplog.set_level(logging.INFO, logger="colibri.hotplug")
    mgr, events = make_manager()
    drop(folder, "fraud.so", name="fraud", version="1", scale=1.0)
    mgr.start()
    (add,) = drain_until(mgr, 1)
    good = add.expert

    REFUSED[rule](folder)                                   # a refused file replaces it
    path = folder / "fraud.so"
    wait_for(lambda: events.rejected(path), f"a {rule} refusal of {path}")
    assert [r["reason"] for r in events.rejected(path)] == [rule]
    assert mgr.drain() == [] and mgr.active() == {"fraud": good}
    assert good.status == "active" and output_scale(good) == pytest.approx(1.0)
    (row,) = mgr.list()
    assert (row["name"], row["version"], row["status"]) == ("fraud", "1", "active")
    assert row["refused"]["path"] == str(path) and row["refused"]["reason"] == rule
    assert str(path) in row["refused"]["message"]
    (line,) = refusal_lines(caplog, path)
    assert f"rule {rule}" in line
    mgr.close()

    # Restart with the refused file still there: the last good version comes back from
    # staging, same slot, same bytes, not probed again; the refusal is listed beside it.
    caplog.clear()
    mgr2, events2 = make_manager()
    mgr2.start()
    assert mgr2.wait_idle(20)
    (again,) = drain_until(mgr2, 1)
    assert again.kind == "add" and again.expert.name == "fraud"
    assert again.expert.sha256 == good.sha256 and again.expert.slot == FIRST_SLOT
    assert again.expert.staged_path == good.staged_path
    assert again.expert.source_path == str(path)
    assert output_scale(again.expert) == pytest.approx(1.0)
    assert [r["reason"] for r in events2.rejected(path)] == [rule]
    (row,) = mgr2.list()
    assert row["status"] == "active" and row["version"] == "1"
    assert row["refused"]["reason"] == rule
    assert len(refusal_lines(caplog, path)) == 1

    # A good file replaces the refused one: adopted, and the refusal is gone.
    if rule == "writable":
        os.chmod(path, 0o644)
    else:
        drop(folder, "fraud.so", name="fraud", version="3", scale=3.0)
    mgr2.rescan()
    (rep,) = drain_until(mgr2, 1)
    assert rep.kind == "replace" and rep.previous is again.expert
    assert rep.expert.slot == FIRST_SLOT
    (row,) = mgr2.list()
    assert row["refused"] is None and row["version"] == ("2" if rule == "writable" else "3")


def test_a_file_deleted_while_stopped_is_not_revived(make_manager, folder):
    mgr, _ = make_manager(watch=False)
    drop(folder, "a.so", name="a")
    mgr.start()
    drain_until(mgr, 1)
    mgr.close()
    os.unlink(folder / "a.so")
    mgr2, _ = make_manager(watch=False)
    mgr2.start()
    assert mgr2.wait_idle(20)
    assert mgr2.drain() == [] and mgr2.active() == {}
    assert [(r["name"], r["status"]) for r in mgr2.list()] == [("a", "removed")]
    # ... nor by a refused file that later takes its name.
    drop_bytes(folder, "a.so", b"not an elf")
    mgr2.rescan()
    assert mgr2.wait_idle(20)
    assert mgr2.drain() == [] and mgr2.active() == {}


def test_refused_file_of_another_name_leaves_the_expert_alone(make_manager, folder):
    mgr, events = make_manager(watch=False)
    drop(folder, "a.so", name="a")
    mgr.start()
    (add,) = drain_until(mgr, 1)
    drop(folder, "a.so", name="b", fault="nan")           # refused, would have renamed it
    mgr.rescan()
    wait_for(lambda: events.rejected(folder / "a.so"), "the refusal")
    assert mgr.drain() == [] and list(mgr.active()) == ["a"]
    mgr.close()
    mgr2, _ = make_manager(watch=False)
    mgr2.start()
    (again,) = drain_until(mgr2, 1)
    assert again.expert.name == "a" and again.expert.sha256 == add.expert.sha256


def test_folder_made_safe_is_checked_again_without_touching_files(make_manager, folder,
                                                                  caplog):
    caplog.set_level(logging.INFO, logger="colibri.hotplug")
    mgr, events = make_manager()
    drop(folder, "a.so", name="a", version="1")
    mgr.start()
    (add,) = drain_until(mgr, 1)
    os.chmod(folder, 0o777)                                 # unsafe from now on
    drop(folder, "a.so", name="a", version="2", scale=2.0)  # replace: refused
    drop(folder, "b.so", name="b")                          # new: refused
    for name in ("a.so", "b.so"):
        wait_for(lambda: events.rejected(folder / name), f"refusal of {name}")
        (rej,) = events.rejected(folder / name)
        assert rej["reason"] == "writable", rej
        assert str(folder / name) in rej["message"] and "folder" in rej["message"]
        (line,) = refusal_lines(caplog, folder / name)
        assert "rule writable" in line
    assert mgr.drain() == [] and mgr.active() == {"a": add.expert}
    assert {r["name"]: r["refused"]["reason"] for r in mgr.list()} == {"a": "writable"}

    os.chmod(folder, 0o755)                                 # safe again: nothing else
    got = drain_until(mgr, 2)
    assert sorted((c.kind, c.expert.name) for c in got) == [("add", "b"), ("replace", "a")]
    assert output_scale(mgr.active()["a"]) == pytest.approx(2.0)
    assert all(r["refused"] is None for r in mgr.list())


def test_folder_made_safe_without_a_watcher(make_manager, folder):
    mgr, events = make_manager(watch=False)
    mgr.start()
    os.chmod(folder, 0o775)
    drop(folder, "c.so", name="c")
    mgr.rescan()
    wait_for(lambda: events.rejected(folder / "c.so"), "refusal of c.so")
    os.chmod(folder, 0o755)
    (add,) = drain_until(mgr, 1)
    assert add.expert.name == "c"


def test_every_refusal_logs_one_line_naming_file_and_rule(make_manager, folder, caplog):
    caplog.set_level(logging.INFO, logger="colibri.hotplug")
    mgr, events = make_manager(watch=False)
    drop(folder, "segv.so", name="segv", fault="segv")
    drop(folder, "abi.so", name="abi", abi=3)
    drop_bytes(folder, "junk.so", b"junk")
    mgr.start()
    assert mgr.wait_idle(20)
    for name in ("segv.so", "abi.so", "junk.so"):
        (rej,) = events.rejected(folder / name)
        (line,) = refusal_lines(caplog, folder / name)
        assert line.startswith(f"hot-plug refused {folder / name} (rule {rej['reason']}):")
        assert "\n" not in line


def test_experts_list_shows_the_refused_file_beside_the_active_version(tmp_path):
    """`colibri experts list` twice (two restarts) on the built-in model's folder."""
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def colibri(*args):
        r = subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True,
                           text=True, timeout=300, cwd="/")
        assert r.returncode == 0, r.stderr
        return r

    compile_test_expert(scratch / "f.so", hidden=128, layer=1, name="fraud", version="1")
    os.replace(scratch / "f.so", d / "fraud.so")
    first = json.loads(colibri("experts", "list", "--experts-dir", str(d), "--json").stdout)
    (hot,) = [e for e in first["experts"] if e["origin"] == "hot-plugged"]
    assert (hot["name"], hot["status"], hot["refused"]) == ("fraud", "active", None)
    compile_test_expert(scratch / "f.so", hidden=128, layer=1, name="fraud", version="2",
                        fault="nan")
    os.replace(scratch / "f.so", d / "fraud.so")
    second = json.loads(colibri("experts", "list", "--experts-dir", str(d), "--json").stdout)
    (hot,) = [e for e in second["experts"] if e["origin"] == "hot-plugged"]
    assert (hot["name"], hot["version"], hot["status"]) == ("fraud", "1", "active")
    assert hot["refused"]["path"] == str(d / "fraud.so")
    assert hot["refused"]["reason"] == "probe-failed"
    text = colibri("experts", "list", "--experts-dir", str(d)).stdout
    line = next(ln for ln in text.splitlines() if " fraud " in ln)
    assert "active" in line
    assert f"refused {d / 'fraud.so'}: probe-failed" in text
