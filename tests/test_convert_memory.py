"""The converter's memory at scale (issue 30, item 4): a quantized matrix is read and
quantized a block of rows at a time, so a conversion holds the output tensor and one
block, never the tensor in float64 (an OLMoE-1B-7B embedding, 50,304 x 2,048, took the
converter past a 3 GiB cgroup limit on its first tensor). Shown at small dimensions with
a small block size: tracemalloc counts numpy's buffers."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from colibri_core.format import quant

hf = pytest.importorskip("hf_helpers")


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _arrays(t):
    return [np.asarray(t.data), np.asarray(t.scales)] + ([np.asarray(t.zeros)]
                                                         if hasattr(t, "zeros") else [])


QUANTIZE = {"q4": lambda w: quant.quantize_q4(w, 128),
            "q6": lambda w: quant.quantize_q6(w, 128),
            "q8": lambda w: quant.quantize_q8(w, 128)}


@pytest.mark.parametrize("kind", sorted(QUANTIZE))
def test_blocks_give_the_whole_matrix_result(kind, monkeypatch):
    """Row blocks of 7 rows (a partial last group, a partial last block) give what one
    block of the whole matrix gives, bit for bit, and it dequantizes to within half a
    step of the float64 input (an independent check of the stitched rows)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((301, 320)).astype(np.float32)
    monkeypatch.setattr(quant, "ROW_BLOCK_BYTES", 1 << 40, raising=False)
    whole = QUANTIZE[kind](w)
    monkeypatch.setattr(quant, "ROW_BLOCK_BYTES", 8 * 320 * 7, raising=False)
    blocks = QUANTIZE[kind](w)
    for a, b in zip(_arrays(whole), _arrays(blocks)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    deq = {"q4": quant.dequantize_q4, "q6": quant.dequantize_q6, "q8": quant.dequantize_q8}[kind]
    step = np.repeat(np.asarray(blocks.scales, np.float64), 128, axis=1)[:, :320]
    err = np.abs(deq(blocks) - w.astype(np.float64))
    if kind == "q8":                     # symmetric round to nearest: within half a step
        assert (err <= 0.5 * step * (1 + 1e-6)).all()
    assert err.max() < np.abs(w).max() / 4


@pytest.mark.parametrize("kind", sorted(QUANTIZE))
def test_quantizer_holds_one_block(kind, monkeypatch):
    """A [2048, 1024] float32 matrix (8 MiB; 16 MiB in float64): with 256 KiB blocks the
    quantizer's own allocations stay under 4 MiB (its output is 1-2 MiB)."""
    w = np.random.default_rng(1).standard_normal((2048, 1024)).astype(np.float32)
    monkeypatch.setattr(quant, "ROW_BLOCK_BYTES", 256 << 10, raising=False)
    _, peak = _peak(lambda: QUANTIZE[kind](w))
    assert peak < 4 << 20, f"{kind}: peak {peak / 2**20:.1f} MiB"


def test_convert_holds_one_block(tmp_path, monkeypatch):
    """A bf16 OLMoE checkpoint whose embedding and lm_head (8,192 x 192) are the largest
    tensors: converting it allocates less than one of them in float32 (6 MiB), and the
    files are byte for byte those of a conversion in one block per tensor."""
    from colibri_core.convert import convert
    torch = pytest.importorskip("torch")
    model = hf.make_hf_model("olmoe", vocab_size=8192)
    ck = hf.save(model, tmp_path / "hf", dtype=torch.bfloat16)
    f32_bytes = 8192 * 192 * 4
    monkeypatch.setattr(quant, "ROW_BLOCK_BYTES", 64 << 10, raising=False)
    _, peak = _peak(lambda: convert(ck, tmp_path / "blocks"))
    assert peak < f32_bytes, f"peak {peak / 2**20:.1f} MiB >= one float32 tensor"
    monkeypatch.setattr(quant, "ROW_BLOCK_BYTES", 1 << 40, raising=False)
    convert(ck, tmp_path / "whole")
    files = [json.loads((tmp_path / d / "config.json").read_text())["files"]
             for d in ("blocks", "whole")]
    assert files[0] == files[1]
