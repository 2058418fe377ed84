"""Values the engine did not check: sampling settings, stop strings, score_batch
arguments, mismatched weight formats, an unwritable or non-UTF-8 standard output
(docs/ROBUSTNESS.md, "Unchecked values")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_core.format import modelfile
from colibri_core.engine import Engine

from robust_helpers import solo_tokens as _solo
from colibri_core.errors import ModelFormatError, RequestError
from colibri_core.format.modelfile import sha256_file
from colibri_core.format.quant import quantize_q4
from colibri_core.model.testing import write_random_model


def test_bad_request_values_are_typed_errors(eng):
    with pytest.raises(RequestError, match="stop"):
        eng.generate("x", stop=123)
    with pytest.raises(RequestError, match="list of token-id lists"):
        eng.score_batch(5)
    with pytest.raises(RequestError, match="sequence 1"):
        eng.score_batch([[1, 2], 7])
    with pytest.raises(RequestError, match="sequence 0 is text"):
        eng.score_batch(["ab"])
    with pytest.raises(RequestError, match="temperature"):
        eng.generate("x", temperature="hot")


def test_a_tiny_temperature_is_greedy(eng):
    greedy = _solo(eng, "The with statement", 10)
    tiny = eng.generate("The with statement", max_new_tokens=10, temperature=1e-308,
                        seed=3).run().token_ids
    assert tiny == greedy


def test_gate_and_up_with_different_groups_are_refused_at_load(tmp_path):
    d = tmp_path / "m"
    write_random_model(d, layers=("moe",))
    rng = np.random.default_rng(0)
    mats = [("w1", quantize_q4(rng.standard_normal((128, 128)), 64)),
            ("w3", quantize_q4(rng.standard_normal((128, 128)), 128)),
            ("w2", quantize_q4(rng.standard_normal((128, 128)), 128))]
    modelfile.write_container(d / "expert_0_0.bin", mats)
    _refresh_manifest(d)
    with pytest.raises(ModelFormatError, match="same number type and group size"):
        Engine.from_model_dir(d)


def _refresh_manifest(d):
    """Record the rewritten file's size and hash in config.json, as a conversion would."""
    cfg = json.loads((d / "config.json").read_text())
    for name, info in cfg.get("files", {}).items():
        info["size"] = (d / name).stat().st_size
        if "sha256" in info:
            info["sha256"] = sha256_file(d / name)
    (d / "config.json").write_text(json.dumps(cfg))




def test_cli_on_a_full_disk_and_a_non_utf8_terminal():
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "-n", "20", "-q"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        "colibri: error: cannot write the output: No space left on device"
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "-n", "20", "-q",
                        "--prompt", "café ü"], capture_output=True, timeout=60,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and b"Traceback" not in r.stderr
