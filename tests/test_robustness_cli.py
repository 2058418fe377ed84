"""The command line's mistakes (one `colibri: error: ...` line and exit 2), `inspect
--verify` on a corrupt and a NaN model, Ctrl-C during generation and during conversion
(exit 130, nothing left behind), and a checkpoint with a NaN refused at conversion.
docs/ROBUSTNESS.md lists the cases; the API's are in test_robustness.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri_core.model.testing import write_random_model

from robust_helpers import (_default_sigint, _tokenizer_with_id, colibri_cmd,  # noqa: F401
                            copy_model, damage_model, nan_model, part_offset, poke, read_config,
                            run_many, tok_model, write_config)


# ============================================================================ CLI

def test_cli_every_mistake_is_one_line_exit_2(tmp_path, tiny_model_dir, tok_model):
    def model_with(how):
        d = copy_model(tiny_model_dir, tmp_path / how.replace(" ", "_"))
        damage_model(d, how)
        return d

    top_k = copy_model(tiny_model_dir, tmp_path / "topk")
    cfg = read_config(top_k)
    cfg["top_k"] = 9
    write_config(top_k, cfg)
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("model: builtin\nengine: {sampling: {temperature: .nan}}\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text("model: builtin\nengine: {length_policy: [{k: 12}]}\n")
    bomb = tmp_path / "list.yaml"
    bomb.write_text("- model\n")
    (tmp_path / "bt").mkdir()
    tok_bad = write_random_model(tmp_path / "tokbad", vocab=260,
                                 tokenizer=_tokenizer_with_id(tmp_path / "bt", 300))
    assert tok_bad
    tm = str(tok_model)
    cases = {
        # configs
        "nan config": (colibri_cmd("run", "--config", bad_cfg), "field 'engine.sampling.temperature'"),
        "policy k": (colibri_cmd("run", "--config", policy, "-p", "hi"), "length_policy.0.k': value 12"),
        "list config": (colibri_cmd("run", "--config", bomb), "expected a mapping at the top level"),
        "threads": (colibri_cmd("run", "--model", tm, "--threads", "0"), "argument --threads: '0': expected an integer from 1"),
        "experts dir": (colibri_cmd("run", "--model", tm, "--experts-dir", tmp_path / "nope"), "no such folder"),
        # model directories
        "truncated": (colibri_cmd("run", "--model", model_with("truncated")), "size 5000 bytes"),
        "resized": (colibri_cmd("inspect", model_with("resized")), "routing.bin: size"),
        "missing": (colibri_cmd("run", "--model", model_with("expert file missing")), "missing (listed"),
        "bad magic": (colibri_cmd("inspect", model_with("bad magic")), "not a Colibri file"),
        "garbage table": (colibri_cmd("run", "--model", model_with("garbage table")), "unreadable section table"),
        "no config": (colibri_cmd("run", "--model", model_with("no config.json")), "is not a Colibri model directory (no config.json)"),
        "top_k model": (colibri_cmd("run", "--model", top_k), "FATAL: expert index out of bounds"),
        "tokenizer": (colibri_cmd("run", "--model", tmp_path / "tokbad", "-p", "hi"), "largest id 300"),
        # requests
        "top-k 0": (colibri_cmd("run", "--model", tm, "-p", "hi", "--experts-per-token", "0"), "argument --experts-per-token: '0': expected an integer >= 1"),
        "top-k 5": (colibri_cmd("run", "--model", tm, "-p", "hi", "--experts-per-token", "5"), "allowed 1..4"),
        "empty": (colibri_cmd("run", "--model", tm, "-p", ""), "empty prompt"),
        "mode only": (colibri_cmd("run", "--model", tm, "-p", "MODE:k1|"), "empty prompt"),
        "mode bad": (colibri_cmd("run", "--model", tm, "-p", "MODE:k|x"), "malformed MODE: prefix"),
        "mode k0": (colibri_cmd("run", "--model", tm, "-p", "MODE:k0|x"), "k must be at least 1"),
        "n negative": (colibri_cmd("run", "--model", tm, "-p", "x", "-n", "-1"), "argument -n: '-1': expected an integer >= 0"),
        "temperature": (colibri_cmd("run", "--model", tm, "-p", "x", "--temperature", "nan"), "argument --temperature: 'nan': expected a number >= 0"),
        "no tokenizer": (colibri_cmd("run", "--model", tiny_model_dir, "-p", "x"), "no tokenizer.json"),
    }
    results = run_many({k: c for k, (c, _) in cases.items()})
    for name, (_, message) in cases.items():
        r = results[name]
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("colibri: error: "), (name, r.stderr)
        assert message in lines[0], (name, lines[0])
        assert "Traceback" not in r.stderr


def test_cli_verify_reports_corruption_and_nan(tmp_path, tiny_model_dir):
    corrupt = copy_model(tiny_model_dir, tmp_path / "corrupt")
    off, n = part_offset(corrupt / "expert_2_1.bin", "w2", "data")
    poke(corrupt / "expert_2_1.bin", off + n // 2, b"\xAA")
    nan = nan_model(tmp_path)
    r = run_many({"corrupt": colibri_cmd("inspect", corrupt, "--verify"),
                  "nan": colibri_cmd("inspect", nan, "--verify"),
                  "clean": colibri_cmd("inspect", tiny_model_dir, "--verify")})
    assert r["clean"].returncode == 0 and "no NaN/Inf in any section" in r["clean"].stdout
    for name, what in (("corrupt", "expert_2_1.bin: sha256 mismatch"),
                       ("nan", "section 'lm_head' (q8): 1 non-finite scale(s)")):
        res = r[name]
        assert res.returncode == 2, res.stderr
        assert f"FAIL {corrupt if name == 'corrupt' else nan}" in res.stdout and what in res.stdout
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("colibri: error: ") and "verification failed" in lines[0]


# ============================================================================ interrupts

SLOW_PLUGIN = """
import time
from colibri_core.hookspecs import hookimpl

@hookimpl
def colibri_sample(logits, request):
    time.sleep(0.01)            # slow enough to interrupt mid-generation
    return 65                   # never the EOS token
"""


def test_ctrl_c_during_generation_exits_130(tmp_path, tok_model):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "slow.py").write_text(SLOW_PLUGIN)
    p = subprocess.Popen(colibri_cmd("run", "--model", tok_model, "-p", "hello", "-n", "120",
                                     "--plugins-dir", plugins),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                         preexec_fn=_default_sigint)
    os.set_blocking(p.stdout.fileno(), False)
    got, t0 = b"", time.time()
    while len(got) < len("hello") + 5 and time.time() - t0 < 60:    # a few tokens streamed
        got += p.stdout.read() or b""
        time.sleep(0.01)
    assert p.poll() is None, "generation ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    err = err.decode()
    assert "colibri: interrupted" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Qwen2-MoE checkpoint saved like a published one (safetensors)."""
    pytest.importorskip("transformers")
    from hf_helpers import make_hf_model, save
    return save(make_hf_model("qwen2_moe", num_hidden_layers=3, num_experts=6),
                tmp_path_factory.mktemp("hfck") / "hf")


def test_conversion_refuses_a_nan_checkpoint(hf_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file
    hf = tmp_path / "hf"
    shutil.copytree(hf_checkpoint, hf)
    st = next(hf.glob("*.safetensors"))
    tensors = load_file(st)
    name = next(k for k in sorted(tensors) if k.endswith("mlp.experts.2.up_proj.weight"))
    tensors[name][3, 5] = np.nan
    save_file(tensors, st, metadata={"format": "pt"})
    out = tmp_path / "out"
    r = subprocess.run(colibri_cmd("convert", hf, out), capture_output=True, text=True, cwd="/",
                       timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), r.stderr
    assert "non-finite" in lines[0] and "section 'w3'" in lines[0], lines[0]
    assert not out.exists() and sorted(x.name for x in tmp_path.iterdir()) == ["hf"]


def test_ctrl_c_during_conversion_leaves_nothing(hf_checkpoint, tmp_path):
    hf = hf_checkpoint
    out = tmp_path / "converted"
    # The conversion is slowed down (a pause after each file it writes) so that the
    # interrupt lands mid-way, whatever the machine's speed.
    code = ("import sys, time\n"
            "import colibri_core.model.weights as w\n"
            "orig = w.write_container\n"
            "def slow(*a, **k):\n"
            "    r = orig(*a, **k); time.sleep(0.05); return r\n"
            "w.write_container = slow\n"
            "from colibri_core.cli import main\n"
            f"sys.exit(main(['convert', {str(hf)!r}, {str(out)!r}]))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd="/", preexec_fn=_default_sigint)
    t0 = time.time()
    staged = []
    while time.time() - t0 < 60 and p.poll() is None:
        staged = [f for s in tmp_path.glob(".converted.partial-*") for f in s.glob("expert_*.bin")]
        if len(staged) >= 3:
            break
        time.sleep(0.005)
    assert p.poll() is None and len(staged) >= 3, "conversion ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    err = err.decode()
    assert p.returncode == 130, err
    assert "colibri: interrupted" in err and "Traceback" not in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
