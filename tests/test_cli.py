"""The command line: the main job, inspect, and one-line errors with a non-zero exit."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from colibri_core.config import builtin_model_dir


def colibri(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True,
                          text=True, timeout=timeout, cwd="/")


def test_run_builtin_streams_text():
    r = colibri("run", "--prompt", "The import statement", "-n", "24", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The import statement")
    assert len(r.stdout.split()) > 5
    assert "24 tokens, stop=length" in r.stderr


def test_run_with_mode_prefix_and_quiet():
    r = colibri("run", "--prompt", "MODE:k1|The class", "-n", "4", "--quiet", "--seed", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The class") and r.stderr == ""


def test_inspect_verify():
    r = colibri("inspect", str(builtin_model_dir()), "--verify")
    assert r.returncode == 0, r.stderr
    assert "qwen2_moe" in r.stdout and "verify: all" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("run", "--prompt", "MODE:kx|hi"), "malformed MODE: prefix"),
    (("run", "--prompt", "hi", "--top-k", "9"), "top_k=9 from the top_k argument is out of range"),
    (("run", "--prompt", "hi", "--threads", "0"), "field 'threads': value 0"),
    (("run", "--model", "/nonexistent"), "/nonexistent: model directory not found"),
    (("run", "--config", "nope"), "config 'nope': no such file"),
    (("run", "--prompt", ""), "empty prompt"),
    (("inspect", "/tmp"), "config.json: file not found"),
])
def test_user_errors_are_one_line(args, message):
    r = colibri(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), r.stderr
    assert message in lines[0]


def test_prompt_beyond_context_is_truncated_with_warning():
    r = colibri("run", "--prompt", "word " * 400, "-n", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "exceeds the context" in r.stderr


def test_experts_list_json(tmp_path):
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    r = colibri("experts", "list", "--experts-dir", str(d), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["expert_set_version"] == 0
    assert sum(e["origin"] == "model file" for e in data["experts"]) == 24
