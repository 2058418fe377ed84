"""Issue 39, item 1: deep nesting in every file Colibri parses, unreadable folders and
files, and a closed engine's every method and property -- one typed line each, never a
RecursionError, a PermissionError traceback, an AttributeError or a crash."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from colibri_core.closedguard import public_names
from colibri_core.config import builtin_model_dir, read_mapping
from colibri_core.convert.safetensors_reader import SafetensorsFile
from colibri_core.engine import Engine
from colibri_core.errors import (AuditLogError, ColibriError, ConfigError, EngineClosedError,
                                 ModelFormatError)
from colibri_core.experts.hotplug.errors import HotplugStateError
from colibri_core.experts.hotplug.state import STATE_FILE, load_state
from colibri_core.format.modelfile import MAGIC, MAX_EXPERT_TABLE_BYTES, parse_table
from colibri_core.nesting import TooDeep, json_loads, yaml_load
from colibri_core.replay import read_log

from robust_helpers import colibri_cmd, one_line, read_config, refresh_files

DEEP = 100_000
deep_json = "[" * DEEP + "]" * DEEP


@pytest.fixture
def model(tmp_path):
    return shutil.copytree(builtin_model_dir(), tmp_path / "m")


def _cli(*args):
    return subprocess.run(colibri_cmd(*args), capture_output=True, text=True, timeout=120,
                          cwd="/")


def _one_error_line(r, *words):
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), r.stderr[-2000:]
    for w in words:
        assert w in lines[0]


def test_json_and_yaml_helpers():
    with pytest.raises(TooDeep):
        json_loads(deep_json)
    import yaml
    with pytest.raises(TooDeep):
        yaml_load("x: " + deep_json, yaml.SafeLoader)
    assert json_loads('{"a": [[1]]}') == {"a": [[1]]}
    assert yaml_load("a: [[1]]", yaml.SafeLoader) == {"a": [[1]]}


@pytest.mark.parametrize("where", ["whole file", "a field"])
def test_config_json_nested_deep(model, where):
    if where == "whole file":
        (model / "config.json").write_text(deep_json)
    else:
        text = json.dumps(read_config(model))
        (model / "config.json").write_text(text[:-1] + ', "x": ' + deep_json + "}")
    with pytest.raises(ConfigError) as ei:
        Engine.from_model_dir(model)
    assert "config.json" in one_line(ei.value) and "nested" in str(ei.value)
    _one_error_line(_cli("run", "--model", model, "-n", "1"), "config.json", "nested")
    _one_error_line(_cli("inspect", model), "config.json", "nested")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_run_config_nested_deep(tmp_path, suffix):
    """YAML 100,000 deep used to kill the process with SIGSEGV (libyaml's composer)."""
    p = tmp_path / f"run{suffix}"
    p.write_text(("model: builtin\nx: " if suffix == ".yaml" else '{"model": "builtin", "x": ')
                 + deep_json + ("" if suffix == ".yaml" else "}"))
    with pytest.raises(ConfigError, match="nested"):
        read_mapping(p)
    _one_error_line(_cli("run", "--config", p, "-n", "1"), str(p), "nested")


def test_tokenizer_nested_deep(model):
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["x"] = 0
    (model / "tokenizer.json").write_text(json.dumps(tok).replace('"x": 0', '"x": ' + deep_json))
    refresh_files(model)
    with pytest.raises(ModelFormatError) as ei:
        Engine.from_model_dir(model)
    assert "tokenizer.json" in one_line(ei.value)


def test_section_table_nested_deep(tmp_path):
    n = (MAX_EXPERT_TABLE_BYTES - 64) // 2
    table = ("[" * n + "]" * n).encode()
    raw = struct.pack("<8sHHI", MAGIC, 1, 1, len(table)) + table
    with pytest.raises(ModelFormatError) as ei:
        parse_table(raw, len(raw), "expert_1_0.bin", MAX_EXPERT_TABLE_BYTES)
    assert "expert_1_0.bin" in one_line(ei.value)


def test_safetensors_header_nested_deep(tmp_path):
    head = deep_json.encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(ModelFormatError) as ei:
        SafetensorsFile(p)
    assert "model.safetensors" in one_line(ei.value)


def test_hotplug_state_nested_deep(tmp_path):
    (tmp_path / STATE_FILE).write_text(deep_json)
    with pytest.raises(HotplugStateError) as ei:
        load_state(str(tmp_path))
    assert STATE_FILE in one_line(ei.value) and "nested" in str(ei.value)


def test_fleet_registry_state_nested_deep(tmp_path):
    from colibri_core.fleet.fleetset import STATE_FILE as REG, FleetSet
    (tmp_path / REG).write_text(deep_json)
    with pytest.raises(HotplugStateError) as ei:
        FleetSet(str(tmp_path), first_slot=8, hidden_size=128, moe_layers=[1])
    assert REG in one_line(ei.value)


def test_tokenizer_config_nested_deep_for_the_chat_template(tmp_path, caplog):
    """The server's chat template reader: a warning naming the file, no template, no crash."""
    import logging
    from colibri_core.server.chat import ChatTemplate
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000)
    with caplog.at_level(logging.WARNING):
        assert ChatTemplate.from_model_dir(tmp_path) is None
        assert "tokenizer_config.json: not read" in caplog.text and "nested" in caplog.text
        (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
        assert ChatTemplate.from_model_dir(tmp_path) is None
    assert "expected a JSON object, found list" in caplog.text


def test_audit_log_line_nested_deep(tmp_path):
    p = tmp_path / "audit.jsonl"
    p.write_text(deep_json + "\n")
    with pytest.raises(AuditLogError) as ei:
        read_log([p])
    assert "audit.jsonl:1" in one_line(ei.value)


# ----------------------------------------------------------------------------- unreadable

def _unprivileged():
    """Run a command without root's permission override (or as is, when not root)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: mode 000 is not enforced")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def _run_unprivileged(*args):
    return subprocess.run(_unprivileged() + colibri_cmd(*args), capture_output=True,
                          text=True, timeout=120, cwd="/")


@pytest.mark.parametrize("target", ["folder", "config.json", "model.bin", "expert_1_0.bin",
                                    "tokenizer.json"])
def test_unreadable_model_folder_and_files(model, target):
    path = model if target == "folder" else model / target
    os.chmod(path, 0)
    try:
        cmds = [("run", "--model", model, "-n", "1")]
        if target != "tokenizer.json":             # inspect does not read the tokenizer
            cmds.append(("inspect", model))
        for cmd in cmds:
            r = _run_unprivileged(*cmd)
            _one_error_line(r, "Permission denied")
        code = ("from colibri_core import Engine\nfrom colibri_core.errors import ColibriError\n"
                f"try:\n    Engine.from_model_dir({str(model)!r}, max_resident_mb=64)\n"
                "except ColibriError as e:\n    print('typed', e)\n")
        r = subprocess.run(_unprivileged() + [sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=120, cwd="/")
        assert r.stdout.startswith("typed") and "Permission denied" in r.stdout, r.stderr[-2000:]
    finally:
        os.chmod(path, 0o755)


@pytest.mark.parametrize("what", ["experts", "plugins"])
def test_unreadable_experts_and_plugins_folders(tmp_path, what):
    d = tmp_path / what
    d.mkdir()
    os.chmod(d, 0)
    try:
        r = _run_unprivileged("run", "-n", "1", f"--{what}-dir", d)
        _one_error_line(r, str(d), "Permission denied")
    finally:
        os.chmod(d, 0o755)


# ----------------------------------------------------------------------------- closed engine

def _args_for(name):
    return {"register_plugin": (object(),), "encode": ("x",), "choose_k": (3, None, None),
            "prepare_ids": ("x",), "generate": ("x",), "next_token_logits": ([1, 2],),
            "score_batch": ([[1, 2]],), "score": ([[1, 2]],), "start_audit": ("/nonexistent/a",),
            "queue_expert_change": (lambda es: es,)}.get(name, ())


def test_every_method_and_property_of_a_closed_engine():
    names = public_names(Engine)
    assert {"expert_set_generation", "expert_set_id", "generate", "memory_report",
            "__enter__"} <= set(names)
    eng = Engine.from_model_dir(builtin_model_dir())
    eng.close()
    for name in names:
        attr = getattr(type(eng), name)
        with pytest.raises(EngineClosedError) as ei:
            if isinstance(attr, property):
                getattr(eng, name)
            else:
                getattr(eng, name)(*_args_for(name))
        assert "closed" in one_line(ei.value), name
    eng.close()                                   # idempotent
    eng.__exit__(None, None, None)
    assert eng.plugin_failures() == {}            # what engine_stop did stays readable


def test_engine_stop_hook_still_reads_the_engine():
    """Closing: plugins' colibri_engine_stop reads the engine before it is released."""
    from colibri_core.plugins import hookimpl
    seen = []

    class P:
        @hookimpl
        def colibri_engine_stop(self, engine):
            seen.append(engine.expert_set_generation)

    eng = Engine.from_model_dir(builtin_model_dir())
    eng.register_plugin(P())
    eng.close()
    assert seen == [0]
    assert isinstance(EngineClosedError("x"), ColibriError)


def test_expert_toml_nested_deep(tmp_path):
    """A bundle's metadata file (expert.toml, capped at 64 KiB): 30,000 `[` deep was a
    RecursionError in the hot-plug worker; now the bundle's typed refusal."""
    from colibri_core.experts.hotplug.bundle import _read_toml
    from colibri_core.experts.hotplug.errors import ExpertMetadataError
    p = tmp_path / "expert.toml"
    p.write_text('name = "x"\nlayers = ' + "[" * 30_000 + "]" * 30_000 + "\n")
    with pytest.raises(ExpertMetadataError) as ei:
        _read_toml(str(p))
    assert "expert.toml" in one_line(ei.value) and "nested" in str(ei.value)
