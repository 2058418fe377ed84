"""Operators see expert changes (issue 34 item 5): one INFO line per adoption,
replacement, rollback and removal, the history (Engine.expert_events, GET
/v1/experts/events, the status page), `colibri experts list` beside a running server,
rollback by the names list shows, a newer file rolled back from shown as such."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from colibri_core.experts.hotplug.errors import RollbackError
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
from hotplug_helpers import drain_until, drop, folder, make_manager, wait_for  # noqa: F401

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
REPO = Path(__file__).resolve().parent.parent


def _put(d: Path, filename: str, **kw) -> None:
    """Build a 128-wide test expert elsewhere and rename it in (one arrival)."""
    tmp = d.parent / f".{filename}.{time.monotonic_ns()}"
    compile_test_expert(tmp, hidden=128, layer=2, **kw)
    os.replace(tmp, d / filename)


def _wait_events(eng, n: int) -> list[dict]:
    def enough():
        eng.apply_expert_changes()
        return len(eng.expert_events.recent()) >= n
    wait_for(enough, f"{n} expert events")
    return eng.expert_events.recent()


def test_engine_history_and_one_info_line_each(tmp_path, caplog):
    from colibri_core.engine import Engine
    d = tmp_path / "experts"
    d.mkdir(mode=0o700)
    caplog.set_level(logging.INFO, logger="colibri.hotplug")
    with Engine.from_config("builtin", experts_dir=str(d)) as eng:
        _put(d, "a.so", name="alpha", version="1")
        _wait_events(eng, 1)
        _put(d, "a.so", name="alpha", version="2", scale=2.0)
        _wait_events(eng, 2)
        eng.hotplug.rollback("a.so")                     # the file name list() shows
        _wait_events(eng, 3)
        (d / "bad.so").write_bytes(b"not an ELF file at all" * 10)
        _wait_events(eng, 4)
        os.unlink(d / "a.so")
        ev = _wait_events(eng, 5)
        assert [e["event"] for e in ev] == ["adopt", "replace", "rollback", "refuse", "remove"]
        assert [e["seq"] for e in ev] == [1, 2, 3, 4, 5]
        assert [e["generation"] for e in ev] == [1, 2, 3, 3, 4]
        assert [e["version"] for e in ev] == ["1", "2", "1", None, "1"]
        assert ev[2]["previous_version"] == "2" and ev[4]["reason"] == "deleted"
        assert ev[3]["reason"] == "elf" and ev[3]["path"].endswith("bad.so")
        assert all(e["slot"] == 8 and e["layers"] == [2] for e in ev if e["event"] != "refuse")
        assert ev[-1]["expert_set_id"] == eng.expert_set_id
        assert eng.expert_events.recent(since=3) == ev[3:]
    info = [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.getMessage().startswith("hot-plug ")]
    assert len(info) == 4                               # the refusal: its WARNING line
    for line, (what, version, gen) in zip(info, [("adopt", "1", 1), ("replace", "2", 2),
                                                 ("rollback", "1", 3), ("remove", "1", 4)]):
        assert line.startswith(f"hot-plug {what}: alpha {version} slot 8 layers [2] sha256 ")
        assert f" portable generation {gen}" in line
    assert info[0].split(" sha256 ")[1][:12] == ev[0]["sha256"][:12]


def test_rollback_by_file_or_metadata_name(make_manager, folder):
    mgr, _ = make_manager(watch=False)
    drop(folder, "fraud-file.so", name="fraud", version="1")
    mgr.start()
    drain_until(mgr, 1)
    for version, target in (("2", "fraud-file.so"), ("3", "fraud")):
        drop(folder, "fraud-file.so", name="fraud", version=version, scale=float(version))
        mgr.rescan()
        drain_until(mgr, 1)
        (row,) = mgr.list()
        assert (row["name"], row["file"], row["version"]) == ("fraud", "fraud-file.so", version)
        mgr.rollback(target)              # the file name, then the metadata name: the same
        (back,) = drain_until(mgr, 1)
        assert back.reason == "rollback" and back.expert.version == "1"   # (2 was rolled
        #                                                         back from: not history)
    with pytest.raises(RollbackError, match="'nope.so' is not active"):
        mgr.rollback("nope.so")


def test_rolled_back_file_is_listed_and_list_works_beside_a_running_manager(
        make_manager, folder, tmp_path):
    mgr, _ = make_manager(watch=False)
    drop(folder, "a.so", name="alpha", version="1")
    mgr.start()
    drain_until(mgr, 1)
    drop(folder, "a.so", name="alpha", version="2", scale=2.0)
    mgr.rescan()
    drain_until(mgr, 1)
    mgr.rollback("alpha")
    drain_until(mgr, 1)
    held = mgr.list()[0]["refused"]       # at once: the folder still holds version 2
    assert held["reason"] == "rolled-back" and "alpha 2" in held["message"]
    assert mgr.refused() == [held]
    os.utime(folder / "a.so")             # looked at again: the newer bytes stay out
    mgr.rescan()
    wait_for(lambda: mgr.list()[0]["refused"] is not None, "the held-back file listed")
    (row,) = mgr.list()
    assert (row["version"], row["status"]) == ("1", "active")
    assert row["refused"]["reason"] == "rolled-back" and "alpha 2" in row["refused"]["message"]
    mgr._save_state()
    # the read-only view another process takes while this manager holds the state folder
    from colibri_core.experts.hotplug.listing import folder_view
    from colibri_core.experts.hotplug.state import state_dir_in_use
    assert state_dir_in_use(mgr.state_dir)
    view = folder_view(str(folder), mgr.state_dir)
    assert [(x["name"], x["version"], x["status"]) for x in view["experts"]] == [
        ("alpha", "1", "active")]
    (f,) = view["files"]
    assert (f["file"], f["name"], f["version"], f["state"]) == ("a.so", "alpha", "2",
                                                                "rolled-back")
    assert state_dir_in_use(mgr.state_dir)          # the view took nothing


def test_server_events_route_status_page_and_list_while_serving(tmp_path):
    from server_helpers import LiveServer
    d = tmp_path / "experts"
    d.mkdir(mode=0o700)
    _put(d, "a.so", name="alpha", version="1")
    srv = LiveServer(experts_dir=d)
    try:
        _put(d, "a.so", name="alpha", version="2", scale=2.0)
        get = lambda path: httpx.get(srv.url + path, timeout=30)  # noqa: E731
        wait_for(lambda: len(get("/v1/experts/events").json()["data"]) >= 2, "replace")
        r = httpx.post(srv.url + "/v1/experts/a.so/rollback", timeout=30)
        assert r.status_code == 202, r.text
        wait_for(lambda: len(get("/v1/experts/events").json()["data"]) >= 3, "rollback")
        os.utime(d / "a.so")
        body = get("/v1/experts/events").json()
        assert [e["event"] for e in body["data"]] == ["adopt", "replace", "rollback"]
        assert [e["generation"] for e in body["data"]] == [1, 2, 3]
        assert body["last_seq"] == 3
        assert [e["seq"] for e in get("/v1/experts/events?since=1").json()["data"]] == [2, 3]
        bad = get("/v1/experts/events?since=x")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        status = get("/status.json").json()
        assert [e["event"] for e in status["events"]] == ["rollback", "replace", "adopt"]
        hot = [e for e in status["experts"] if e["name"] == "alpha"]
        assert hot[0]["binding"] == "portable" and hot[0]["file"] == "a.so"
        wait_for(lambda: get("/v1/experts").json()["data"][-1].get("refused"), "held back")
        # `colibri experts list` while the server holds the folder
        cmd = [sys.executable, "-m", "colibri_core", "experts", "list", "--experts-dir",
               str(d)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("read-only: ")
        assert "alpha 2 (portable)" in r.stdout and "rolled back from" in r.stdout
        j = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True,
                                      timeout=120).stdout)
        assert j["read_only"] and j["experts"][0]["version"] == "1"
        assert j["files"][0]["state"] == "rolled-back"
    finally:
        srv.stop()
    log = "\n".join(srv.lines)
    assert "hot-plug adopt: alpha 1 slot 8" in log and "hot-plug rollback: alpha 1" in log


def test_upload_of_an_expert_built_for_another_model_is_refused(tmp_path):
    """An upload is checked as a dropped file: bound to the fraud model, the built-in
    model's server refuses it (base-model), names both fingerprints, keeps it in the
    history; bound to the built-in model it goes live."""
    import hashlib

    from colibri_core.model.fingerprint import fingerprint_for
    from server_helpers import LiveServer
    fps = {m: fingerprint_for(m) for m in ("builtin", "fraud")}
    d = tmp_path / "experts"
    d.mkdir(mode=0o700)
    data = {}
    for m in fps:
        so = compile_test_expert(tmp_path / f"{m}.so", hidden=128, layer=1, name=f"up_{m}",
                                 base_model=fps[m])
        data[m] = so.read_bytes()
    allow = tmp_path / "allow.txt"
    allow.write_text("".join(hashlib.sha256(b).hexdigest() + "\n" for b in data.values()))
    key = "k" * 32
    srv = LiveServer("--allow-expert-upload", "--expert-allowlist", str(allow),
                     experts_dir=d, env={"COLIBRI_API_KEY": key})
    try:
        auth = {"Authorization": f"Bearer {key}"}
        for m in ("fraud", "builtin"):
            r = httpx.put(srv.url + f"/v1/experts/up_{m}", content=data[m], headers=auth)
            assert r.status_code == 202, r.text
        events = lambda: httpx.get(srv.url + "/v1/experts/events", headers=auth,  # noqa: E731
                                   timeout=30).json()["data"]
        wait_for(lambda: len(events()) >= 2, "both uploads decided")
        got = {e["event"]: e for e in events()}
        assert got["refuse"]["reason"] == "base-model"
        assert got["refuse"]["path"].endswith("up_fraud.so")
        assert fps["fraud"] in got["refuse"]["message"]
        assert fps["builtin"] in got["refuse"]["message"]
        assert (got["adopt"]["name"], got["adopt"]["binding"]) == ("up_builtin", "bound")
    finally:
        srv.stop()
