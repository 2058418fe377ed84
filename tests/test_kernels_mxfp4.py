"""MXFP4 matrices (format/mxfp4.py): the kernels' mxfp4 tiles on every backend against the
float64 references, and the layout against transformers' and the gguf package's
dequantizers, bit for bit.

Bounds: act="int8" vs matvec_mxfp4_q8_ref (the same exact integer block dots; the kernels
round each block's term to float32) and act="float" vs the float64 dequantized product:
1e-5 relative over the output. AVX-512 VNNI forms the same integer lanes as AVX2 and runs
the same float code: bit-identical. NEON: tests/test_neon_emulated.py (bit-identical to
the scalar tile)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.format import mxfp4 as M
from colibri_core.format.quant import quantize_act_q8

from kernel_helpers import BACKENDS, backend, rel, threads  # noqa: F401 (fixtures)

TOL = 1e-5


def random_mx(rows: int, cols: int, seed: int = 0, exp_range=(118, 130)) -> M.MXFP4Tensor:
    """Random codes (every one of the 16) and exponents, as a checkpoint holds them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(*exp_range, (rows, cols // 32), dtype=np.uint8)
    return M.from_blocks(blocks, scales)


# (rows, cols): cols a multiple of 64, and not (a padded last block pair); odd rows
@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (37, 96), (259, 1024), (5, 2880)])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 33])
def test_mxfp4_matmul(backend, threads, shape, n):
    rows, cols = shape
    t = random_mx(rows, cols, seed=rows * 31 + cols + n)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, ::17] *= 8.0
    out = np.empty((n, rows), np.float32)
    K.mxfp4_matmul(t, x, out, act="int8")
    assert rel(out, M.matvec_mxfp4_q8_ref(t, x)) < TOL
    K.mxfp4_matmul(t, x, out, act="float")
    assert rel(out, x.astype(np.float64) @ M.dequantize_mxfp4(t).T) < TOL


def test_mxfp4_reference_is_the_dequantized_product():
    """The int8 reference differs from the float product only by the activations' int8
    rounding (an independent check of the reference itself)."""
    t = random_mx(64, 512, seed=3)
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    xq, xs, _ = quantize_act_q8(x, 64)
    xd = (xq.reshape(5, -1, 64) * xs[:, :, None].astype(np.float64)).reshape(5, -1)
    np.testing.assert_allclose(M.matvec_mxfp4_q8_ref(t, x), xd @ M.dequantize_mxfp4(t).T,
                               rtol=1e-12, atol=1e-12)


def test_mxfp4_extreme_exponents(backend):
    """Exponents 0 and 1 (float32 subnormal block scales) and 254 run exactly as the
    reference says; a row of zero codes gives 0."""
    t = random_mx(8, 128, seed=5, exp_range=(0, 2))
    x = np.random.default_rng(6).standard_normal((2, 128)).astype(np.float32) * 1e30
    out = np.empty((2, 8), np.float32)
    K.mxfp4_matmul(t, x, out)
    assert rel(out, M.matvec_mxfp4_q8_ref(t, x)) < TOL
    t = random_mx(8, 128, seed=7, exp_range=(254, 255))
    x = np.random.default_rng(8).standard_normal((2, 128)).astype(np.float32) * 1e-30
    K.mxfp4_matmul(t, x, out)
    assert rel(out, M.matvec_mxfp4_q8_ref(t, x)) < TOL


def test_mxfp4_tiles_batch_invariant(backend):
    """A token's row is the same bits alone and among others (the tiles' shapes differ)."""
    t = random_mx(37, 320, seed=9)
    x = np.random.default_rng(10).standard_normal((9, 320)).astype(np.float32)
    full = K.mxfp4_matmul(t, x, np.empty((9, 37), np.float32))
    for i in (0, 4, 8):
        one = K.mxfp4_matmul(t, x[i:i + 1].copy(), np.empty((1, 37), np.float32))
        np.testing.assert_array_equal(one[0], full[i])


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(BACKENDS),
                    reason="needs both the avx2 and avx512vnni backends")
def test_mxfp4_avx512vnni_bit_identical_to_avx2():
    t = random_mx(37, 2880, seed=11)
    x = np.random.default_rng(12).standard_normal((7, 2880)).astype(np.float32)
    res = {}
    for be in ("avx2", "avx512vnni"):
        K.set_backend(be)
        res[be] = K.mxfp4_matmul(t, x, np.empty((7, 37), np.float32))
    K.set_backend("auto")
    np.testing.assert_array_equal(res["avx2"], res["avx512vnni"])


# ----------------------------------------------------------------------------- layout

def test_dequantize_matches_transformers_bit_for_bit():
    """A checkpoint's `*_blocks` / `*_scales` through transformers' gpt-oss dequantizer
    (integrations/mxfp4.py, float32) and through ours: the same floats."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(13)
    E, R, C = 2, 24, 192
    blocks = rng.integers(0, 256, (E, R, C // 32, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, (E, R, C // 32), dtype=np.uint8)   # float32-finite range
    theirs = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32).numpy()        # [E, C, R]
    for e in range(E):
        ours = M.dequantize_mxfp4(M.from_blocks(blocks[e], scales[e])).astype(np.float32)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs[e].T.view(np.uint32))
        assert np.array_equal(ours.astype(np.float64), M.dequantize_mxfp4(
            M.from_blocks(blocks[e], scales[e])))                  # float32 held it exactly


def test_gguf_blocks_match_the_gguf_dequantizer_bit_for_bit():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    rng = np.random.default_rng(14)
    R, C = 16, 256
    raw = rng.integers(0, 256, (R, C // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(0, 253, (R, C // 32))
    theirs = gguf_quants.dequantize(raw.reshape(R, -1), GGMLQuantizationType.MXFP4)
    # gguf's table is integers (code 8, e2m1's -0, is its 0): -0 + 0 = +0, nothing else moves
    ours = M.dequantize_mxfp4(M.from_gguf_blocks(raw, R, C)).astype(np.float32) + np.float32(0)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.reshape(R, C).view(np.uint32))


def test_quantize_mxfp4_round_trip_and_error():
    """Values on the grid come back exactly; Gaussian weights land within MXFP4's usual
    error (rel. RMS ~0.1, the same scale as gguf's quantizer, which may clip more)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    t = random_mx(16, 256, seed=15)
    w = M.dequantize_mxfp4(t)
    back = M.quantize_mxfp4(w)
    np.testing.assert_array_equal(M.dequantize_mxfp4(back), w)
    g = np.random.default_rng(16).standard_normal((64, 512))
    ours = rel(M.dequantize_mxfp4(M.quantize_mxfp4(g)), g)
    q = gguf_quants.quantize(g.astype(np.float32), GGMLQuantizationType.MXFP4)
    theirs = rel(gguf_quants.dequantize(q, GGMLQuantizationType.MXFP4), g)
    assert ours < 0.13 and ours <= theirs * 1.001, (ours, theirs)


def test_from_blocks_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"expected \[R, C/32, 16\]"):
        M.from_blocks(np.zeros((4, 2, 15), np.uint8), np.zeros((4, 2), np.uint8))
