"""INT4 group quantization (numpy reference) against float64, with written error bounds."""
import numpy as np
import pytest

from colibri_core.quant import (dequantize_q4, dequantize_q8, matvec_q4_q8_ref, matvec_q4_ref,
                                pack_nibbles, quantize_act_q8, quantize_q4, quantize_q8,
                                unpack_nibbles)


def test_nibble_order_is_the_documented_one():
    # value 64*b + j -> low nibble of byte 32*b + j; value 64*b + 32 + j -> high nibble.
    q = (np.arange(128) % 16).astype(np.uint8)[None, :]
    packed = pack_nibbles(q)
    assert packed.shape == (1, 64)
    for v in (0, 5, 31, 32, 63, 64, 100, 127):
        b, r = divmod(v, 64)
        byte = packed[0, 32 * b + (r % 32)]
        nib = (byte & 0x0F) if r < 32 else (byte >> 4)
        assert nib == q[0, v]
    assert (unpack_nibbles(packed) == q).all()


@pytest.mark.parametrize("rows,cols,group", [(1, 128, 128), (7, 300, 128), (33, 64, 64), (5, 1000, 256)])
def test_q4_error_bound(rows, cols, group):
    rng = np.random.default_rng(rows * cols)
    w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3)
    t = quantize_q4(w, group)
    d = dequantize_q4(t)
    assert d.shape == w.shape
    # Bound: each value within one step (scale) of its group: rounding contributes
    # scale/2 and rounding the zero point another scale/2 at the clamped ends.
    s = np.repeat(t.scales.astype(np.float64), group, axis=1)[:, :cols]
    assert (np.abs(d - w) <= s * (1 + 1e-6)).all()
    # and on average much better than that: RMS error <= 0.35 steps (uniform rounding ~0.29)
    assert np.sqrt(np.mean(((d - w) / s) ** 2)) <= 0.35


def test_q4_partial_group_padding_is_exact_zero_and_constants_exact():
    w = np.array([[3.0] * 5, [0.0] * 5, [-2.0] * 5, [1, 2, 3, 4, 5]])
    t = quantize_q4(w, 128)
    assert t.data.shape == (4, 64)
    full = np.repeat(t.scales, 128, axis=1) * (unpack_nibbles(t.data).astype(np.float64)
                                              - np.repeat(t.zeros, 128, axis=1))
    assert (full[:, 5:] == 0).all()             # padding dequantizes to exactly 0
    assert (dequantize_q4(t)[:3] == w[:3]).all()  # constant groups reproduced exactly


def test_q4_matvec_error_bound_against_float64():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 200))
    x = rng.standard_normal(200)
    t = quantize_q4(w, 128)
    y = matvec_q4_ref(t, x)
    # |Wq x - W x| <= sum_g scale_g * sum_{i in g} |x_i|  (per-value bound above)
    ax = np.zeros(256)
    ax[:200] = np.abs(x)
    bound = (t.scales.astype(np.float64) * ax.reshape(2, 128).sum(1)[None, :]).sum(1)
    assert (np.abs(y - w @ x) <= bound + 1e-9).all()
    rel = np.abs(y - w @ x).max() / np.abs(w @ x).max()
    assert rel < 0.15   # measured ~0.08 for Gaussian weights, group 128


def test_int8_activation_path_reference():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 300))
    x = rng.standard_normal((3, 300)).astype(np.float32)
    t = quantize_q4(w, 128)
    xq, xs, xsum = quantize_act_q8(x, 128)
    assert xq.shape == (3, 384) and (xq[:, 300:] == 0).all()
    assert (np.abs(xq.astype(np.float64).reshape(3, 3, 128) * xs[:, :, None]
                   - np.pad(x, ((0, 0), (0, 84))).reshape(3, 3, 128)) <= xs[:, :, None] / 2 + 1e-7).all()
    y8, yf = matvec_q4_q8_ref(t, x), matvec_q4_ref(t, x)
    assert np.abs(y8 - yf).max() / np.abs(yf).max() < 0.02


def test_q8_roundtrip():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((9, 130))
    t = quantize_q8(w, 64)
    s = np.repeat(t.scales.astype(np.float64), 64, axis=1)[:, :130]
    assert (np.abs(dequantize_q8(t) - w) <= s / 2 + 1e-7).all()


def test_bad_group_size_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_q4(np.zeros((2, 2)), 100)
