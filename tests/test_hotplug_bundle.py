"""Experts written the reference design's way (docs/HOTPLUG.md, "Bundles"): a plain C file
exporting only ffn_forward, built with `gcc -shared -fPIC`, dropped as a folder
`expert_32.expert/` (the .so, expert.toml, router_row.npy) with one rename; its identity
covers all of its files; every other check applies; a bare .so is refused with the fix.

Real compiler, real files, real watchdog observer; no timed assertions."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess

import numpy as np
import pytest

from colibri_core.experts.hotplug.bundle import bundle_identity, read_bundle
from colibri_core.format.modelfile import sha256_file
from hotplug_helpers import folder, make_manager  # noqa: F401  (fixtures)
from hotplug_helpers import (CRASHING_C, FIRST_SLOT, H, drain_until, output_scale,
                             reference_so, wait_for, write_bundle)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture
def scratch(tmp_path):
    d = tmp_path / "scratch"
    d.mkdir(exist_ok=True)
    return d


def test_bundle_dropped_with_one_mv_is_adopted(make_manager, folder, scratch):
    mgr, events = make_manager()
    mgr.start()
    b = write_bundle(scratch / "expert_32.expert", version="2024.1", layers=(1, 3),
                     router_bias=-0.5, scale=2.0)
    identity = bundle_identity(b)
    os.rename(b, folder / "expert_32.expert")                      # one mv
    (add,) = drain_until(mgr, 1)
    e = add.expert
    assert (add.kind, e.name, e.version, e.layers) == ("add", "expert_32", "2024.1", (1, 3))
    assert e.slot == FIRST_SLOT and e.router_bias == pytest.approx(-0.5)
    assert e.q4 is None and not e.thread_safe and e.isolation == "inprocess"
    assert e.source_path == str(folder / "expert_32.expert")
    assert e.sha256 == identity
    staged = os.path.dirname(e.staged_path)
    assert staged == os.path.join(mgr.staging_dir, f"{identity}.expert")
    assert sorted(os.listdir(staged)) == ["expert.toml", "expert_32.so", "router_row.npy"]
    assert all(stat.S_IMODE(os.stat(os.path.join(staged, n)).st_mode) == 0o400
               for n in os.listdir(staged))
    want = np.zeros(H, np.float32)
    want[0], want[-1] = 1.0, -1.0
    assert np.array_equal(e.router_row, want) and not e.router_row.flags.writeable
    assert output_scale(e) == pytest.approx(2.0)
    assert not events.of("rejected")
    (row,) = mgr.list()
    assert (row["name"], row["sha256"], row["status"]) == ("expert_32", identity, "active")

    # Another bundle of the same name replaces it (same slot); deleting the old folder
    # changes nothing; deleting the live one removes the expert.
    b2 = write_bundle(scratch / "expert_32-v2.expert", version="2024.2", scale=3.0)
    os.rename(b2, folder / "expert_32-v2.expert")
    (rep,) = drain_until(mgr, 1)
    assert rep.kind == "replace" and rep.expert.slot == FIRST_SLOT
    assert output_scale(rep.expert) == pytest.approx(3.0)
    mgr.release(rep.previous)
    shutil.rmtree(folder / "expert_32.expert")
    mgr.rescan()
    assert mgr.wait_idle(20)
    assert mgr.drain() == [] and list(mgr.active()) == ["expert_32"]
    shutil.rmtree(folder / "expert_32-v2.expert")
    (rm,) = drain_until(mgr, 1)
    assert rm.kind == "remove" and rm.reason == "deleted"


def test_identity_is_the_documented_sha256sum_recipe(scratch):
    b = write_bundle(scratch / "x.expert")
    out = subprocess.run("LC_ALL=C ls | xargs sha256sum | sha256sum", shell=True, cwd=b,
                         capture_output=True, text=True, check=True).stdout.split()[0]
    assert out == bundle_identity(b)
    # it covers every file: one byte of the TOML changes it
    before = bundle_identity(b)
    (b / "expert.toml").write_text((b / "expert.toml").read_text() + "\n")
    assert bundle_identity(b) != before


def test_allowlist_is_the_bundle_identity(make_manager, folder, scratch):
    b = write_bundle(scratch / "a.expert", name="a")
    c = write_bundle(scratch / "c.expert", name="c")
    so_hash = sha256_file(str(c / "expert_32.so"))
    mgr, events = make_manager(allowlist={bundle_identity(b), so_hash}, watch=False)
    os.rename(b, folder / "a.expert")
    os.rename(c, folder / "c.expert")
    mgr.start()
    assert mgr.wait_idle(20)
    (add,) = drain_until(mgr, 1)
    assert add.expert.name == "a"
    (rej,) = events.rejected(folder / "c.expert")
    assert rej["reason"] == "allowlist"            # the .so's own hash is not the identity
    assert os.listdir(mgr.staging_dir) == [f"{add.expert.sha256}.expert"]


def test_bare_reference_so_is_refused_with_the_fix(make_manager, folder, scratch):
    mgr, events = make_manager(watch=False)
    so = reference_so(scratch / "expert_32.so")
    os.rename(so, folder / "expert_32.so")
    mgr.start()
    assert mgr.wait_idle(20)
    (rej,) = events.rejected(folder / "expert_32.so")
    assert rej["reason"] == "abi"
    for words in ("ffn_forward", "colibri_expert_meta", "colibri expert build --from-c",
                  "expert.toml", "router_row.npy", ".expert/"):
        assert words in rej["message"], words


def _missing_row(b):
    os.unlink(b / "router_row.npy")


def _extra_file(b):
    (b / "README").write_text("notes")
    os.chmod(b / "README", 0o644)


def _two_so(b):
    shutil.copy(b / "expert_32.so", b / "other.so")


def _subfolder(b):
    (b / "src").mkdir(mode=0o755)


def _symlink_inside(b):
    os.rename(b / "router_row.npy", b.parent / "row.npy")
    os.symlink(b.parent / "row.npy", b / "router_row.npy")


def _writable_inside(b):
    os.chmod(b / "expert.toml", 0o666)


def _writable_folder(b):
    os.chmod(b, 0o775)


def _wide_row(b):
    np.save(b / "router_row.npy", np.zeros(2 * H, np.float32))


def _float64_row(b):
    np.save(b / "router_row.npy", np.zeros(H, np.float64))


def _nan_row(b):
    np.save(b / "router_row.npy", np.full(H, np.nan, np.float32))


def _dense_layer(b):
    (b / "expert.toml").write_text('name = "x"\nversion = "1"\nlayers = [0]\n')


def _bad_toml(b):
    (b / "expert.toml").write_text('name = "x\nversion = 1\n')


def _unknown_key(b):
    (b / "expert.toml").write_text('name = "x"\nversion = "1"\nlayers = [1]\nrouter-bias = 1.0\n')


def _no_version(b):
    (b / "expert.toml").write_text('name = "x"\nlayers = [1]\n')


def _abi_3(b):
    (b / "expert.toml").write_text('name = "x"\nversion = "1"\nlayers = [1]\nabi_version = 3\n')


def _crashing(b):
    reference_so(b / "expert_32.so", source=CRASHING_C)


def _with_metadata(b):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    compile_test_expert(b / "expert_32.so", hidden=H, name="x")


def _arm(b):
    raw = bytearray((b / "expert_32.so").read_bytes())
    raw[18:20] = (40).to_bytes(2, "little")                  # e_machine = ARM
    (b / "expert_32.so").write_bytes(bytes(raw))


def _truncated(b):
    raw = (b / "expert_32.so").read_bytes()
    (b / "expert_32.so").write_bytes(raw[: len(raw) // 2])


BROKEN = {
    "missing-row": (_missing_row, "bundle", "missing router_row.npy"),
    "extra-file": (_extra_file, "bundle", "unexpected README"),
    "two-so": (_two_so, "bundle", "2 .so files"),
    "subfolder": (_subfolder, "not-regular", "src: not a regular file, expected a bundle"),
    "symlink-inside": (_symlink_inside, "symlink", "router_row.npy"),
    "writable-inside": (_writable_inside, "writable", "expert.toml"),
    "writable-folder": (_writable_folder, "writable", "bundle folder"),
    "wide-row": (_wide_row, "metadata", "hidden_size 64"),
    "float64-row": (_float64_row, "metadata", "float32"),
    "nan-row": (_nan_row, "metadata", "non-finite"),
    "dense-layer": (_dense_layer, "metadata", "not MoE layers"),
    "bad-toml": (_bad_toml, "metadata", "not valid TOML"),
    "unknown-key": (_unknown_key, "metadata", "router-bias"),
    "no-version": (_no_version, "metadata", "missing version"),
    "abi-3": (_abi_3, "abi", "abi_version"),
    "crashing": (_crashing, "probe-crash", "SIGSEGV"),
    "own-metadata": (_with_metadata, "abi", "colibri_expert_meta"),
    "truncated": (_truncated, "incomplete", "expert_32.so"),
    "arm": (_arm, "architecture", "expert_32.so"),
}


def test_every_other_check_applies_to_a_bundle(make_manager, folder, scratch, caplog):
    caplog.set_level(logging.INFO, logger="colibri.hotplug")
    for case, (breakit, _, _) in BROKEN.items():
        b = write_bundle(scratch / f"{case}.expert", name=case)
        breakit(b)
        os.rename(b, folder / f"{case}.expert")
    os.symlink(write_bundle(scratch / "target.expert", name="t"), folder / "link.expert")
    (folder / "file.expert").write_bytes(b"not a folder")
    os.chmod(folder / "file.expert", 0o644)
    mgr, events = make_manager(watch=False)
    mgr.start()
    assert mgr.wait_idle(60)
    expected = {case: (reason, words) for case, (_, reason, words) in BROKEN.items()}
    expected["link"] = ("symlink", "symlink")
    expected["file"] = ("bundle", "not a folder")
    for case, (reason, words) in expected.items():
        path = folder / f"{case}.expert"
        got = events.rejected(path)
        assert [r["reason"] for r in got] == [reason], (case, [r["message"] for r in got])
        assert str(path) in got[0]["message"] and words in got[0]["message"], (case, got)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
            f"hot-plug refused {path} (rule {reason}):")]
        assert len(lines) == 1, (case, lines)
    assert mgr.drain() == [] and mgr.version == 0
    assert os.listdir(mgr.staging_dir) == []            # refused copies are not kept


def test_bundle_built_in_place_is_checked_when_complete(make_manager, folder, scratch):
    """A bundle folder made in the watched folder and filled file by file: refused while
    incomplete, adopted once complete (the watcher sees files inside bundle folders)."""
    mgr, events = make_manager()
    mgr.start()
    b = write_bundle(scratch / "src.expert", name="inplace")
    dst = folder / "inplace.expert"
    dst.mkdir(mode=0o755)
    shutil.copy(b / "expert.toml", dst / "expert.toml")
    wait_for(lambda: events.rejected(dst), "the refusal of the incomplete bundle")
    assert events.rejected(dst)[0]["reason"] == "bundle"
    shutil.copy(b / "router_row.npy", dst / "router_row.npy")
    shutil.copy(b / "expert_32.so", dst / "expert_32.so")
    (add,) = drain_until(mgr, 1)
    assert add.expert.name == "inplace" and add.expert.sha256 == bundle_identity(b)
    assert all(r["refused"] is None for r in mgr.list())


def test_bundle_across_restarts_and_isolation(make_manager, folder, scratch):
    mgr, _ = make_manager(watch=False)
    os.rename(write_bundle(scratch / "a.isolated.expert", name="a", scale=2.0),
              folder / "a.isolated.expert")
    mgr.start()
    (add,) = drain_until(mgr, 1)
    assert add.expert.isolation == "isolated" and add.expert.lib is None
    assert output_scale(add.expert) == pytest.approx(2.0)
    mgr.close()

    # Restart: the same bundle comes back (same slot, same staged copy). A refused bundle
    # replacing it keeps it (the one rule), also after a further restart.
    mgr2, events2 = make_manager(watch=False)
    mgr2.start()
    (again,) = drain_until(mgr2, 1)
    assert again.expert.slot == add.expert.slot
    assert again.expert.staged_path == add.expert.staged_path
    _missing_row(folder / "a.isolated.expert")   # in place: seen without any event
    wait_for(lambda: events2.rejected(folder / "a.isolated.expert"), "the refusal")
    assert mgr2.drain() == [] and mgr2.active()["a"] is again.expert
    mgr2.close()
    mgr3, _ = make_manager(watch=False)
    mgr3.start()
    (third,) = drain_until(mgr3, 1)
    assert third.expert.sha256 == add.expert.sha256
    assert output_scale(third.expert) == pytest.approx(2.0)
    (row,) = mgr3.list()
    assert row["refused"]["reason"] == "bundle"

    # Deleted: gone, and its staged copy is deleted at the next start.
    shutil.rmtree(folder / "a.isolated.expert")
    mgr3.rescan()
    (rm,) = drain_until(mgr3, 1)
    assert rm.kind == "remove"
    mgr3.close()
    mgr4, _ = make_manager(watch=False)
    mgr4.start()
    assert mgr4.wait_idle(20) and mgr4.drain() == []
    assert os.listdir(mgr4.staging_dir) == []


def test_read_bundle_fields(scratch):
    b = write_bundle(scratch / "f.expert", name="f", version="v 1", layers=(3, 1),
                     router_bias=None,
                     toml='name = "f"\nversion = "v 1"\nlayers = [3, 1]\nthread_safe = true\n'
                          "abi_version = 1  # the only one\n")
    info = read_bundle(str(b / "expert_32.so"), H, {1, 3})
    m = info.meta
    assert (m.name, m.version, m.layers, m.router_bias) == ("f", "v 1", (3, 1), 0.0)
    assert m.thread_safe and not m.has_q4 and m.hidden_size == H and m.abi_version == 1
    assert info.router_file == str(b / "router_row.npy") and info.q4 is None


def test_toml_needs_tomllib_or_tomli(scratch, monkeypatch):
    import sys

    from colibri_core.experts.hotplug.errors import ExpertRejected
    b = write_bundle(scratch / "f.expert")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ExpertRejected, match=r"needs Python >= 3.11 \(tomllib\) or the tomli"
                                             r" package") as err:
        read_bundle(str(b / "expert_32.so"), H, {1})
    assert err.value.reason == "bundle"


def test_bundle_through_the_engine(tiny_model_dir, tmp_path):
    """A reference-design expert, bundled, routed by the real engine (hidden 128)."""
    from colibri_core.config import EngineConfig, HotplugConfig
    from colibri_core.engine import Engine
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    b = write_bundle(tmp_path / "build" / "hot.expert", name="hot", hidden=128,
                     router_bias=50.0, row=np.zeros(128, np.float32))
    os.rename(b, watched / "hot.expert")
    with Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                             hotplug=HotplugConfig(settle_s=0.05))) as eng:
        assert [r["name"] for r in eng.hotplug.list() if r["status"] == "active"] == ["hot"]
        slot = eng.hotplug.active()["hot"].slot
        eng.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
        routed = [t.routing.ids for t in eng.model.last_routing if t.layer == 1][0]
        assert (routed == slot).any()


# -- colibri expert build --from-c: the same source made a regular expert -------------

def test_build_from_c_makes_a_regular_expert(make_manager, folder, tmp_path, capsys):
    from colibri_core.cli import main as cli_main
    from colibri_core.experts.hotplug.meta import read_expert_file
    from colibri_core.experts.hotplug.probe import run_probe
    from hotplug_helpers import REFERENCE_C
    src = tmp_path / "ref" / "expert_32.c"
    src.parent.mkdir()
    src.write_text(REFERENCE_C.replace("SCALE", "2.5f"))
    row = np.linspace(-1, 1, H).astype(np.float64)          # any float dtype: made float32
    np.save(tmp_path / "row.npy", row)
    rc = cli_main(["expert", "build", "--from-c", str(src), "--router-row",
                   str(tmp_path / "row.npy"), "--layer", "3", "--router-bias", "0.75",
                   "--portable"])
    assert rc == 0, capsys.readouterr().err
    assert "built" in capsys.readouterr().out
    out = src.with_suffix(".so")                            # the default output
    info = read_expert_file(str(out), H, {1, 3})
    m = info.meta
    assert (m.name, m.version, m.layers, m.hidden_size) == ("expert_32", "1.0", (3,), H)
    assert m.router_bias == pytest.approx(0.75) and not m.thread_safe and not m.has_q4
    assert m.target.endswith("from-c=expert_32.c") and "-fvisibility" not in m.target
    raw = out.read_bytes()
    got = np.frombuffer(raw[info.router_row.offset:info.router_row.offset + 4 * H], "<f4")
    assert np.array_equal(got, row.astype(np.float32))
    assert run_probe(str(out), H, 5.0)["ok"]

    mgr, events = make_manager(watch=False)
    shutil.copy(out, folder / "expert_32.so")
    mgr.start()
    (add,) = drain_until(mgr, 1)
    assert add.expert.name == "expert_32" and output_scale(add.expert) == pytest.approx(2.5)
    assert not events.of("rejected")


def test_build_from_c_errors(tmp_path, capsys):
    from colibri_core.experts.hotplug.authoring.builder import main
    np.save(tmp_path / "row.npy", np.zeros(H, np.float32))
    hidden = tmp_path / "hidden.c"
    hidden.write_text("__attribute__((visibility(\"hidden\")))\n"
                      "int ffn_forward(const float *x, float *y, int n, int h)"
                      " { (void)x; (void)y; (void)n; (void)h; return 0; }\n")
    assert main(["--from-c", str(hidden), "--router-row", str(tmp_path / "row.npy"),
                 "--layer", "1", "--portable"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and len(err.strip().splitlines()) == 1
    assert "no exported function 'ffn_forward'" in err
    np.save(tmp_path / "bad.npy", np.zeros((2, H), np.float32))
    assert main(["--from-c", str(hidden), "--router-row", str(tmp_path / "bad.npy"),
                 "--layer", "1"]) == 2
    assert "expected the router row" in capsys.readouterr().err
    for argv in (["--from-c", str(hidden), "--layer", "1"],            # no --router-row
                 [str(tmp_path / "w.npz"), "--layer", "1"],            # npz without -o...
                 [str(tmp_path / "w.npz"), "--from-c", str(hidden), "--router-row",
                  str(tmp_path / "row.npy"), "--layer", "1"]):
        with pytest.raises(SystemExit) as ex:
            main(argv)
        assert ex.value.code == 2
