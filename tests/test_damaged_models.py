"""Damaged model directories and NaN/Inf weights: refused at load with one line naming
the file and what is wrong, caught by `colibri inspect --verify`, or (NaN that a load
does not scan for) a typed error at generation, never a crash. docs/ROBUSTNESS.md."""
from __future__ import annotations


import numpy as np
import pytest

from colibri_core.config import ModelConfig
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError, ModelFormatError
from colibri_core.format.quant import Q4Tensor, Q8Tensor, quantize_q4, quantize_q8
from colibri_core.model.testing import write_random_model
from colibri_core.format.validate import check_tensor, scan_model_dir, tensor_problems
from colibri_core.model.weights import load_model, verify_checksums, write_model_dir

from robust_helpers import (damage_model, fd_count, maps_of, model_dict, nan_model, one_line,
                            part_offset, poke, poke_f32)



# ============================================================================ model dirs

DAMAGE = {
    "no config.json": (ConfigError, "config.json: file not found"),
    "config.json truncated": (ConfigError, "not valid json"),
    "config.json not an object": (ConfigError, "expected a mapping"),
    "model.bin missing": (ModelFormatError, "model.bin: missing (listed in config.json)"),
    "expert file missing": (ModelFormatError, "expert_2_3.bin: missing"),
    "expert file missing, unlisted": (ModelFormatError, "expert_2_3.bin: file not found"),
    "truncated": (ModelFormatError, "expert_1_0.bin: size 5000 bytes, config.json records"),
    "truncated, size re-recorded": (ModelFormatError, "truncated"),
    "resized": (ModelFormatError, "routing.bin: size"),
    "bad magic": (ModelFormatError, "not a Colibri file"),
    "future major version": (ModelFormatError, "format version 7.0 is not readable"),
    "garbage table": (ModelFormatError, "unreadable section table"),
    "table offset past end": (ModelFormatError, "expert_1_1.bin: section 'w1'"),
    "file name escapes": (ModelFormatError, "is not a plain name"),
    "file name with NUL": (ModelFormatError, "is not a plain name"),
    "model.bin is a folder": (ModelFormatError, "model.bin: is a directory, expected a regular file"),
    "no format field": (ModelFormatError, "no 'format' field"),
    "format 2.0": (ModelFormatError, "format 2.0, this Colibri reads 1.x"),
    "hidden_size changed": (ModelFormatError, "expected [64, 64] from config.json"),
    "more experts than files": (ModelFormatError, "'layer.1.router' has shape [4, 128], expected [5, 128]"),
    "vocab_size changed": (ModelFormatError, "section 'embed' has shape [256, 128], expected [300, 128]"),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_model_dir_is_refused_with_one_line(model, how):
    damage_model(model, how)
    err, match = DAMAGE[how]
    fds, maps = fd_count(), maps_of(model)
    for mode in ("mmap", "copy"):
        with pytest.raises(err) as e:
            load_model(model, mode)
        assert match in one_line(e.value), str(e.value)
    assert (fd_count(), maps_of(model)) == (fds, maps), "a refused model left files open"


def test_corrupted_bytes_are_caught_by_verify(model):
    off, n = part_offset(model / "expert_2_1.bin", "w2", "data")
    poke(model / "expert_2_1.bin", off + n // 2, b"\xAA")       # same size, other bytes
    load_model(model).close()                                   # sizes fine: loads
    problems = verify_checksums(model)
    assert len(problems) == 1 and "expert_2_1.bin: sha256 mismatch" in problems[0]


# ============================================================================ NaN / Inf

def test_check_tensor_every_number_type():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    q4, q8 = quantize_q4(rng.standard_normal((4, 128)), 64), quantize_q8(rng.standard_normal((4, 128)), 64)
    for t in (f32, f32.astype(np.float16), (f32.view(np.uint32) >> 16).astype(np.uint16), q4, q8,
              np.arange(5, dtype=np.int8)):
        assert tensor_problems("ok", t) == []
        check_tensor("ok", t)
    bad_f32 = f32.copy()
    bad_f32[2, 1] = np.nan
    bad_f16 = f32.astype(np.float16)
    bad_f16[0, 4] = np.inf
    bad_bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    bad_bf16[1, 0] = 0x7FC0                                            # bf16 NaN
    s = q4.scales.copy()
    s[3, 1] = np.inf
    bad_q4 = Q4Tensor(q4.data, s, q4.zeros, q4.rows, q4.cols, q4.group)
    z = q4.zeros.copy()
    z[0, 0] = 16
    bad_zero = Q4Tensor(q4.data, q4.scales, z, q4.rows, q4.cols, q4.group)
    s8 = q8.scales.copy()
    s8[1, 0] = np.nan
    bad_q8 = Q8Tensor(q8.data, s8, q8.rows, q8.cols, q8.group)
    for t, where in ((bad_f32, "first at [2, 1]"), (bad_f16, "first at [0, 4]"),
                     (bad_bf16, "first at [1, 0]"), (bad_q4, "row 3, group 1 (columns 64..127)"),
                     (bad_zero, "zero point(s) outside 0..15"), (bad_q8, "row 1, group 0")):
        with pytest.raises(ModelFormatError) as e:
            check_tensor("layer.1.wq", t, "ckpt")
        assert "ckpt: section 'layer.1.wq'" in one_line(e.value) and where in str(e.value)


def test_conversion_refuses_non_finite_weights(tmp_path):
    cfg = ModelConfig(**model_dict(layer_types=["dense"], num_layers=1, num_experts=0, top_k=0))
    bad = np.ones((cfg.vocab_size, cfg.hidden_size), np.float32)
    bad[7, 3] = np.inf
    with pytest.raises(ModelFormatError, match=r"model\.bin: section 'embed' \(f32\): 1 non-finite"):
        write_model_dir(tmp_path / "out", cfg, iter([("embed", bad)]), [], [])
    assert not (tmp_path / "out" / "config.json").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_verify_scan_finds_nan_but_load_does_not_scan(tmp_path):
    d = nan_model(tmp_path)
    assert verify_checksums(d) == []                        # the checksum was re-recorded
    problems = scan_model_dir(d)
    assert len(problems) == 1
    assert "model.bin: section 'lm_head' (q8): 1 non-finite scale(s)" in problems[0]
    load_model(d).close()                                   # loads: no scan at every load


def test_generation_on_nan_weights_is_typed_not_a_crash(tmp_path):
    # one NaN lm_head row: that token is never sampled, generation goes on
    d = nan_model(tmp_path)
    with Engine.from_model_dir(d, threads=1) as e:
        for temp in (0.0, 1.0):
            g = e.generate([1, 2, 3], max_new_tokens=6, temperature=temp, seed=0).run()
            assert 0 not in g.token_ids and len(g.token_ids) > 0
    # NaN in the final norm: every logit is NaN -> ModelFormatError naming --verify
    d2 = tmp_path / "n2"
    write_random_model(d2, seed=2)
    poke_f32(d2, "model.bin", "final_norm", "data", 5, float("nan"))
    with Engine.from_model_dir(d2, threads=1) as e:
        with pytest.raises(ModelFormatError, match="no finite logit.*--verify") as ex:
            e.generate([1, 2, 3], max_new_tokens=3, temperature=0.7).run()
        one_line(ex.value)
