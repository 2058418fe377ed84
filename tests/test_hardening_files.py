"""Hardening: the files a user hands Colibri (docs/ROBUSTNESS.md, "Files").

- a FIFO, device, socket or folder in place of config.json, model.bin, an expert file,
  tokenizer.json, a plugin module or a run config is refused at once with one typed line
  (never waited on: every case runs with a 10 s cap, so a regression fails, not hangs);
- a section table is bounded per file (docs/FORMAT.md);
- no message quotes another file's content (model files may be symlinks);
- a refused `colibri expert build` leaves nothing at -o;
- the converter reads the safetensors files transformers reads, nothing else;
- YAML configs are parsed by libyaml when PyYAML has it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from colibri_core.config import builtin_model_dir, load_run_config, read_mapping
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError, ModelFormatError
from colibri_core.format.modelfile import MAGIC, MAX_EXPERT_TABLE_BYTES, MAX_TABLE_BYTES, ContainerFile
from colibri_core.plugins import PluginLoadError
from colibri_core.model.weights import load_model

from robust_helpers import colibri_cmd, memory_limit, one_line, read_config, refresh_files, write_config

CAP_S = 10          # the longest any case may take: a regression fails here, never hangs
FIFO_MSG = "is a FIFO (named pipe), expected a regular file"


@pytest.fixture
def intact(tmp_path):
    return Path(shutil.copytree(builtin_model_dir(), tmp_path / "intact"))


@pytest.fixture
def damaged(tmp_path):
    return Path(shutil.copytree(builtin_model_dir(), tmp_path / "damaged"))


def fifo_in_place_of(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def within_cap(fn, fifos=()):
    """fn() on a thread, at most CAP_S seconds: -> the exception it raised (or None). If
    it is still running (blocked on a FIFO: the bug), the FIFOs get a writer so that the
    thread ends, and the test fails."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:          # noqa: BLE001 - handed back to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CAP_S)
    if t.is_alive():
        for f in fifos:                     # O_RDWR opens a FIFO without waiting
            os.close(os.open(f, os.O_RDWR | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"blocked for {CAP_S} s (on {', '.join(map(str, fifos))}?)")
    return box.get("error")


def cli(*args, cwd="/") -> subprocess.CompletedProcess:
    """`python -m colibri_core ARGS` with the cap; asserts exit 2, one error line, no
    traceback, and returns the result."""
    try:
        r = subprocess.run(colibri_cmd(*args), capture_output=True, text=True,
                           timeout=CAP_S, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`colibri {' '.join(map(str, args))}` ran past {CAP_S} s (hang?)")
    errors = [line for line in r.stderr.splitlines() if line.startswith("colibri: error:")]
    assert r.returncode == 2 and len(errors) == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def serves(model_dir: Path) -> None:
    """The process is still fine: a normal request on an intact model."""
    with Engine.from_model_dir(model_dir, threads=1) as eng:
        g = eng.generate("The ", max_new_tokens=3, temperature=0)
        assert len(list(g)) == 3


# ============================================================================ 1. FIFOs

def _plugins_fifo(tmp_path):
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "good.py").write_text("X = 1\n")
    return d, fifo_in_place_of(d / "p.py")


def _run_config_fifo(tmp_path):
    return fifo_in_place_of(tmp_path / "run.yaml")


# what to damage -> (the file made a FIFO, the API call, the typed error)
API_CASES = {
    "config.json": ("config.json", lambda d, tmp: Engine.from_model_dir(d), ConfigError),
    "model.bin": ("model.bin", lambda d, tmp: load_model(d), ModelFormatError),
    "model.bin, unlisted": ("model.bin", lambda d, tmp: load_model(d), ModelFormatError),
    "expert file": ("expert_2_5.bin", lambda d, tmp: load_model(d, "copy"), ModelFormatError),
    "expert file, unlisted, lazy": ("expert_2_5.bin", lambda d, tmp: load_model(
        d, lazy_experts=True), ModelFormatError),
    "tokenizer.json": ("tokenizer.json", lambda d, tmp: Engine.from_model_dir(d),
                       ModelFormatError),
    "tokenizer.json, unlisted": ("tokenizer.json", lambda d, tmp: Engine.from_model_dir(d),
                                 ModelFormatError),      # read by us, not by the library
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_fifo_model_files_are_refused_at_once(damaged, intact, tmp_path, case):
    name, call, err = API_CASES[case]
    if "unlisted" in case:                  # not in config.json: the container reader's check
        cfg = read_config(damaged)
        del cfg["files"][name]
        write_config(damaged, cfg)
    fifo = fifo_in_place_of(damaged / name)
    e = within_cap(lambda: call(damaged, tmp_path), [fifo])
    assert isinstance(e, err), repr(e)
    assert one_line(e) == f"{fifo}: {FIFO_MSG}"
    serves(intact)


def test_fifo_plugin_module_and_run_config(intact, tmp_path):
    folder, fifo = _plugins_fifo(tmp_path)
    e = within_cap(lambda: Engine.from_model_dir(intact, plugins_dir=str(folder)), [fifo])
    assert isinstance(e, PluginLoadError) and f"{fifo}: {FIFO_MSG}" in one_line(e), repr(e)
    run = _run_config_fifo(tmp_path)
    e = within_cap(lambda: load_run_config(run), [run])
    assert isinstance(e, ConfigError) and one_line(e) == f"{run}: {FIFO_MSG}", repr(e)
    serves(intact)


@pytest.mark.parametrize("case", ["config.json", "model.bin", "expert file", "tokenizer.json",
                                  "plugin module", "run config"])
def test_fifo_cli_one_line_exit_2(damaged, intact, tmp_path, case):
    if case == "plugin module":
        folder, fifo = _plugins_fifo(tmp_path)
        args = ("run", "--model", intact, "--plugins-dir", folder)
    elif case == "run config":
        fifo = _run_config_fifo(tmp_path)
        args = ("run", "--config", fifo)
    else:
        fifo = fifo_in_place_of(damaged / {"expert file": "expert_1_0.bin"}.get(case, case))
        args = ("run", "--model", damaged)
    r = cli(*args, "-n", "2", "-q")
    assert f"{fifo}: {FIFO_MSG}" in r.stderr, r.stderr


def test_devices_sockets_folders_and_symlinks_to_them(damaged, tmp_path):
    """Symlinks are followed (model folders of links are normal), to regular files only."""
    (damaged / "model.bin").unlink()
    os.symlink("/dev/zero", damaged / "model.bin")
    e = within_cap(lambda: load_model(damaged))
    assert isinstance(e, ModelFormatError) and "is a character device, expected a regular " \
        "file" in one_line(e), repr(e)
    (damaged / "tokenizer.json").unlink()
    (damaged / "tokenizer.json").mkdir()
    (damaged / "model.bin").unlink()
    shutil.copy(builtin_model_dir() / "model.bin", damaged / "model.bin")
    e = within_cap(lambda: Engine.from_model_dir(damaged))
    assert isinstance(e, ModelFormatError) and "tokenizer.json: is a directory" in str(e)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s.yaml"))
        e = within_cap(lambda: read_mapping(tmp_path / "s.yaml"))
        assert isinstance(e, ConfigError) and "s.yaml: is a socket" in one_line(e), repr(e)
    finally:
        sock.close()


def test_fifo_in_a_checkpoint_folder(hf_checkpoint, tmp_path):
    from colibri_core.convert import convert
    hf = Path(shutil.copytree(hf_checkpoint, tmp_path / "hf"))
    fifo = fifo_in_place_of(hf / "model.safetensors")
    e = within_cap(lambda: convert(hf, tmp_path / "out"), [fifo])
    assert isinstance(e, ModelFormatError) and one_line(e) == f"{fifo}: {FIFO_MSG}", repr(e)
    shutil.copy(hf_checkpoint / "model.safetensors", fifo.with_name("x"))
    os.replace(fifo.with_name("x"), fifo)
    fifo = fifo_in_place_of(hf / "tokenizer.json")
    r = cli("convert", hf, tmp_path / "out")
    assert f"{fifo}: {FIFO_MSG}" in r.stderr and not (tmp_path / "out").exists()


# ============================================================================ 2. table cap

def _prefix(tlen: int) -> bytes:
    return struct.pack("<8sHHI", MAGIC, 1, 0, tlen)


def _container(path: Path, table: bytes) -> Path:
    """A container file holding `table`, then zeros up to a page past it (the data)."""
    body = _prefix(len(table)) + table
    path.write_bytes(body + b"\0" * (-len(body) % 4096 + 4096))
    return path


def _table(n_bytes: int, data_at: int) -> bytes:
    """A legal table of `n_bytes` (JSON whitespace at the end): one f32 [1] section whose
    data is at `data_at`."""
    t = json.dumps({"sections": [{"name": "v", "dtype": "f32", "shape": [1],
                                  "parts": {"data": [data_at, 4]}}]}).encode()
    return t + b" " * (n_bytes - len(t))


def test_section_table_is_capped_before_it_is_parsed(tmp_path):
    at = (16 + MAX_TABLE_BYTES + 1) // 4096 * 4096 + 4096
    big = _container(tmp_path / "big.bin", _table(MAX_TABLE_BYTES + 1, at))
    with memory_limit(4 << 20, "a table over the cap"), pytest.raises(ModelFormatError) as e:
        ContainerFile(big, "header")
    assert one_line(e.value) == (f"{big}: section table of {MAX_TABLE_BYTES + 1} bytes "
                                 f"exceeds the cap of {MAX_TABLE_BYTES} bytes (docs/FORMAT.md); "
                                 f"the file is corrupt")
    at = (16 + MAX_TABLE_BYTES) // 4096 * 4096 + 4096
    ok = ContainerFile(_container(tmp_path / "ok.bin", _table(MAX_TABLE_BYTES, at)))
    assert list(ok.sections) == ["v"]            # a legal table at the cap loads
    ok.close()


def test_expert_file_table_has_its_own_smaller_cap(damaged):
    """The same expert file with its table padded (JSON whitespace) to one byte over the
    expert cap, the data moved up behind the longer header."""
    name = "expert_1_2.bin"
    raw = (damaged / name).read_bytes()
    tlen = struct.unpack_from("<I", raw, 12)[0]
    sections = json.loads(raw[16:16 + tlen])["sections"]
    first = min(p[0] for s in sections for p in s["parts"].values())
    header = (16 + MAX_EXPERT_TABLE_BYTES + 1 + 4095) // 4096 * 4096
    for s in sections:
        for p in s["parts"].values():
            p[0] += header - first
    t = json.dumps({"sections": sections}, separators=(",", ":")).encode()
    t += b" " * (MAX_EXPERT_TABLE_BYTES + 1 - len(t))
    out = _prefix(len(t)) + t
    (damaged / name).write_bytes(out + b"\0" * (header - len(out)) + raw[first:])
    refresh_files(damaged)
    assert ContainerFile(damaged / name).sections      # fine under the general cap ...
    with pytest.raises(ModelFormatError) as e:          # ... not as a model's expert file
        load_model(damaged)
    assert f"{name}: section table of {MAX_EXPERT_TABLE_BYTES + 1} bytes exceeds the cap " \
        f"of {MAX_EXPERT_TABLE_BYTES} bytes" in one_line(e.value)


def test_writer_refuses_a_table_over_the_cap(tmp_path):
    from colibri_core.format.modelfile import write_container
    long = [(f"{i}" + "n" * (MAX_TABLE_BYTES // 3), np.zeros(1, np.float32)) for i in range(4)]
    with pytest.raises(ValueError, match="exceeds the format's cap"):
        write_container(tmp_path / "x.bin", long)
    assert not any(tmp_path.iterdir())


# ============================================================================ 3. content

SECRET = "SECRET-do-not-show"


def _no_secret(text: str) -> None:
    for form in (SECRET, SECRET[:4], SECRET.encode()[:4].hex(), repr(SECRET.encode()[:4])[2:-1]):
        assert form not in text, text


def test_messages_never_quote_another_files_content(damaged, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.encode() + b"\n" * 5000)
    (damaged / "model.bin").unlink()
    os.symlink(secret, damaged / "model.bin")
    refresh_files(damaged)                          # size and sha256 match: only the magic
    with pytest.raises(ModelFormatError, match="not a Colibri file") as e:
        load_model(damaged)
    _no_secret(one_line(e.value))
    _no_secret(cli("inspect", damaged).stderr)

    other = tmp_path / "other.json"                 # config.json a link to some JSON file
    other.write_text(json.dumps({"auths": {"registry": {"auth": SECRET}}}))
    (damaged / "config.json").unlink()
    os.symlink(other, damaged / "config.json")
    with pytest.raises(ConfigError, match="field 'auths': unknown field") as e:
        load_model(damaged)
    _no_secret(str(e.value))

    bad = tmp_path / "bad.json"                     # not UTF-8: the offset, not the byte
    bad.write_bytes(b"\xff" + SECRET.encode())
    os.replace(bad, other)
    with pytest.raises(ConfigError, match=r"cannot read it as UTF-8 text \(invalid byte at "
                                          r"offset 0\)") as e:
        load_model(damaged)
    assert "xff" not in str(e.value)


def test_tokenizer_messages_blank_the_files_strings(intact, tmp_path):
    tok = json.loads((intact / "tokenizer.json").read_text())
    tok["version"] = SECRET                          # the library quotes such values
    (tmp_path / "t.json").write_text(json.dumps(tok))
    (intact / "tokenizer.json").unlink()
    os.symlink(tmp_path / "t.json", intact / "tokenizer.json")
    refresh_files(intact)
    with pytest.raises(ModelFormatError, match="unreadable tokenizer") as e:
        Engine.from_model_dir(intact)
    _no_secret(one_line(e.value))


# ============================================================================ 4. expert build

FAKE_CC = """#!/bin/sh
# writes what gcc would not (a non-ELF file) to -o, then {how}
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
[ -n "$out" ] && printf 'not an ELF file' > "$out"
exit {rc}
"""


@pytest.mark.parametrize("how,rc,match", [
    ("claims success: the check after compiling refuses it", 0,
     "the built file fails the expert checks, not written"),
    ("fails", 1, "compiler failed"),
])
def test_refused_expert_build_leaves_nothing_at_output(tmp_path, how, rc, match):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "w.npz", w1=rng.normal(size=(64, 128)), w3=rng.normal(size=(64, 128)),
             w2=rng.normal(size=(128, 64)), router_row=rng.normal(size=128))
    cc = tmp_path / "fake-cc"
    cc.write_text(FAKE_CC.format(how=how, rc=rc))
    cc.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    args = ("expert", "build", tmp_path / "w.npz", "--layer", "1", "--name", "x",
            "--version", "1", "--cc", cc, "--portable")
    r = cli(*args, "-o", out / "new.so")
    assert match in r.stderr and "new.so" in r.stderr and ".tmp" not in r.stderr, r.stderr
    assert list(out.iterdir()) == []                 # nothing at -o, no temporary file
    (out / "old.so").write_bytes(b"the previous build")
    cli(*args, "-o", out / "old.so")
    assert [p.name for p in out.iterdir()] == ["old.so"]
    assert (out / "old.so").read_bytes() == b"the previous build"


# ============================================================================ 5. converter

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Mixtral checkpoint (model.safetensors) with a tokenizer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_helpers import make_hf_model, save, write_tokenizer
    d = save(make_hf_model("mixtral", num_hidden_layers=2), tmp_path_factory.mktemp("hf") / "m")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def converted(hf_checkpoint, tmp_path_factory):
    from colibri_core.convert import convert
    out = tmp_path_factory.mktemp("conv") / "clean"
    convert(hf_checkpoint, out, bits=4)
    return out


def _weight_bytes(d: Path) -> dict:
    names = json.loads((d / "config.json").read_text())["files"]
    return {n: (d / n).read_bytes() for n in names}


def _save_st(path: Path, **arrays) -> None:
    from safetensors.numpy import save_file
    save_file({k: np.asarray(v, np.float32) for k, v in arrays.items()}, str(path))


def test_extra_safetensors_files_are_not_read(hf_checkpoint, converted, tmp_path):
    """Beside model.safetensors: a consolidated copy with the same tensor names (read as a
    shard it made the conversion fail) and an adapter with other names (read, they would
    be ignored or worse): the conversion is byte-identical to the clean folder's."""
    from safetensors.numpy import load_file
    from colibri_core.convert import convert
    hf = Path(shutil.copytree(hf_checkpoint, tmp_path / "hf"))
    weights = load_file(str(hf / "model.safetensors"))
    _save_st(hf / "consolidated.safetensors", **{k: v * 0 for k, v in weights.items()})
    _save_st(hf / "adapter_model.safetensors", **{"base_model.model.lora_A.weight": np.ones((4, 4))})
    convert(hf, tmp_path / "out", bits=4)
    assert (tmp_path / "out" / "config.json").read_bytes() == (converted / "config.json").read_bytes()
    assert _weight_bytes(tmp_path / "out") == _weight_bytes(converted)


def test_checkpoint_file_rule_follows_transformers(tmp_path):
    pytest.importorskip("safetensors")
    from colibri_core.convert.safetensors_reader import checkpoint_files
    d = tmp_path / "ck"
    d.mkdir()
    with pytest.raises(ModelFormatError) as e:
        checkpoint_files(d)
    assert one_line(e.value) == (f"{d}: no model.safetensors and no model.safetensors.index.json "
                                 f"(the checkpoint files transformers reads)")
    _save_st(d / "consolidated.safetensors", a=[1])
    with pytest.raises(ModelFormatError, match=r"the other safetensors files here "
                                               r"\(consolidated.safetensors\) are not"):
        checkpoint_files(d)
    for n in ("s-1.safetensors", "s-2.safetensors", "stray.safetensors"):
        _save_st(d / n, a=[1])
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "s-2.safetensors", "y": "s-1.safetensors", "z": "s-2.safetensors"}}))
    assert [p.name for p in checkpoint_files(d)] == ["s-1.safetensors", "s-2.safetensors"]
    _save_st(d / "model.safetensors", a=[1])          # transformers prefers it to the index
    assert [p.name for p in checkpoint_files(d)] == ["model.safetensors"]
    assert [p.name for p in checkpoint_files(d, "s-1.safetensors")] == ["s-1.safetensors"]
    with pytest.raises(ConfigError, match="transformers_weights 'a.bin': expected"):
        checkpoint_files(d, "a.bin")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../up.safetensors"}}))
    with pytest.raises(ModelFormatError, match="is not a file inside"):
        checkpoint_files(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ModelFormatError, match="shard.s. gone.safetensors missing"):
        checkpoint_files(d)


# ============================================================================ 6. YAML

def test_yaml_uses_libyaml_and_reads_the_same(tmp_path):
    import yaml
    from colibri_core.config import _yaml_loader, configs_dir
    assert _yaml_loader() is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for p in sorted(configs_dir().glob("*.yaml")):
        assert read_mapping(p) == yaml.safe_load(p.read_text()), p
    p = tmp_path / "big.yaml"                       # a large file, for good measure
    p.write_text("model: builtin\nengine:\n  threads: 2\nnotes:\n"
                 + "".join(f"  - {{max_tokens: {i}, k: 2}}\n" for i in range(20000)))
    from robust_helpers import time_limit
    with time_limit(CAP_S, "a 0.6 MB YAML file"):
        assert len(read_mapping(p)["notes"]) == 20000
