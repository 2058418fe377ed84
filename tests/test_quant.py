"""INT4 group quantization (numpy reference) against float64, with written error bounds."""
import hashlib
import math
import warnings

import numpy as np
import pytest

from colibri_core.format import quant
from colibri_core.format.quant import (dequantize_q4, dequantize_q8, fake_quant_q4, matvec_q4_q8_ref,
                                matvec_q4_ref, pack_nibbles, quantize_act_q8, quantize_q4,
                                quantize_q8, unpack_nibbles)


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


@pytest.mark.parametrize("clip", ["minmax", "mse"])
@pytest.mark.parametrize("rows,cols,group", [(1, 128, 128), (7, 300, 128), (33, 64, 64), (5, 1000, 256)])
def test_q4_error_bound(rows, cols, group, clip):
    rng = np.random.default_rng(rows * cols)
    w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3)
    t = quantize_q4(w, group, clip=clip)
    d = dequantize_q4(t)
    assert d.shape == w.shape
    s = np.repeat(t.scales.astype(np.float64), group, axis=1)[:, :cols]
    if clip == "minmax":
        # Bound: each value within one step (scale) of its group: rounding contributes
        # scale/2 and rounding the zero point another scale/2 at the clamped ends.
        assert (np.abs(d - w) <= s * (1 + 1e-6)).all()
    else:
        # clipping trades a few larger errors at the ends for finer steps: never worse in total
        d0 = dequantize_q4(quantize_q4(w, group, clip="minmax"))
        assert ((d - w) ** 2).sum() <= ((d0 - w) ** 2).sum()
    # and on average much better than that: RMS error <= 0.35 steps (uniform rounding ~0.29)
    assert np.sqrt(np.mean(((d - w) / s) ** 2)) <= 0.35


@pytest.mark.parametrize("clip", ["minmax", "mse"])
def test_q4_partial_group_padding_is_exact_zero_and_constants_exact(clip):
    w = np.array([[3.0] * 5, [0.0] * 5, [-2.0] * 5, [1, 2, 3, 4, 5]])
    t = quantize_q4(w, 128, clip=clip)
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


# ----------------------------------------------------------------------------- q4 clipping
# An independent float64 reference of docs/FORMAT.md "Rounding": one group at a time in
# plain Python, squared errors summed exactly (math.fsum).

GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.86, 0.84, 0.82, 0.8)


def _ref_minmax(v):
    lo, hi = float(v.min()), float(v.max())
    scale = (hi - lo) / 15
    if scale <= 0:
        scale = abs(lo) if lo != 0 else 1.0
    s = float(np.float32(scale))
    if s == 0:
        s = float(np.finfo(np.float32).smallest_subnormal)
    return s, min(max(float(np.round(-lo / s)), 0.0), 15.0)


def _ref_candidates(v):
    """(scale, zero) candidates of clip="mse", in order, the min/max one first."""
    yield _ref_minmax(v)
    lo, hi = float(v.min()), float(v.max())
    span = max(hi, 0.0) - min(lo, 0.0)
    for f in GRID:
        s = float(np.float32(span * f / 15))
        if not (s > 0 and np.isfinite(s)):
            continue
        yield s, min(max(float(np.round(7.5 - (lo + hi) / 2 / s)), 0.0), 15.0)


def _ref_err(v, s, z):
    q = np.clip(np.round(v / s) + z, 0, 15)
    return math.fsum(((q - z) * s - v) ** 2)


def _groups(w, t):
    """(row, group, real values, stored scale, stored zero, stored codes) of every group."""
    q = unpack_nibbles(t.data)
    for r in range(t.rows):
        for g in range(t.scales.shape[1]):
            lo, hi = g * t.group, min((g + 1) * t.group, t.cols)
            yield (r, g, w[r, lo:hi], float(t.scales[r, g]), float(t.zeros[r, g]),
                   q[r, g * t.group:(g + 1) * t.group])


def _adversarial(cols, rng):
    rows = []
    g = rng.standard_normal(cols)
    rows.append(g)
    rows.append(np.full(cols, 3.0))                      # constant
    rows.append(np.full(cols, -2.0))
    rows.append(np.zeros(cols))                          # all zero
    o = g.copy(); o[7] = 50.0; rows.append(o)            # one outlier, each side
    o = g.copy(); o[-3] = -40.0; rows.append(o)
    rows.append(rng.uniform(1, 2, cols))                 # all positive / all negative
    rows.append(-rng.uniform(0.5, 3, cols))
    rows.append(g * 1e-30)                               # tiny
    rows.append(g * 1e-43)                               # scale in float32's subnormals
    rows.append(g * 1e-300)                              # scale below float32's range
    rows.append(g * 1e30)                                # huge
    sp = np.zeros(cols); sp[::17] = rng.standard_normal(len(sp[::17])); rows.append(sp)   # sparse
    rows.append(np.where(rng.random(cols) < 0.5, -1.0, 1.0))                          # two levels
    rows.append(np.arange(cols) % 16 - 7.5)              # ties at .5
    rows.append(rng.standard_t(2, cols))                 # heavy tails
    rows.append(np.exp(rng.standard_normal(cols) * 2))   # log-normal (positive, skewed)
    return np.array(rows)


@pytest.mark.parametrize("cols,group", [(320, 128), (200, 64), (64, 64), (100, 128)])
def test_q4_minmax_is_the_documented_rtn(cols, group):
    w = np.concatenate([_adversarial(cols, np.random.default_rng(cols)),
                        np.random.default_rng(1).standard_normal((20, cols))])
    t = quantize_q4(w, group, clip="minmax")
    for _, _, v, s, z, q in _groups(w, t):
        assert (s, z) == _ref_minmax(v)
        assert (q[:len(v)] == np.clip(np.round(v / s) + z, 0, 15)).all()
        assert (q[len(v):] == z).all()                   # padding -> exactly 0


@pytest.mark.parametrize("cols,group", [(320, 128), (200, 64), (64, 64), (100, 128), (1000, 256)])
def test_q4_mse_never_worse_than_minmax_on_any_group(cols, group):
    rng = np.random.default_rng(cols + group)
    w = np.concatenate([_adversarial(cols, rng), rng.standard_normal((30, cols)) * 0.05,
                        rng.standard_normal((10, cols)) * rng.uniform(0.1, 10, (10, 1))])
    t = quantize_q4(w, group)                            # default: mse
    tm = quantize_q4(w, group, clip="minmax")
    assert np.isfinite(t.scales).all() and (t.scales > 0).all() and (t.zeros <= 15).all()
    d = dequantize_q4(t)
    improved = 0
    for (r, g, v, s, z, q), (_, _, _, sm, zm, _) in zip(_groups(w, t), _groups(w, tm)):
        e, em = _ref_err(v, s, z), _ref_err(v, sm, zm)
        assert e <= em, (r, g, e, em)
        improved += e < em
        assert (q[:len(v)] == np.clip(np.round(v / s) + z, 0, 15)).all()
        assert (q[len(v):] == z).all()                   # padding -> exactly 0
        lo, hi = g * group, min((g + 1) * group, cols)
        assert math.fsum((d[r, lo:hi] - v) ** 2) == pytest.approx(e, rel=1e-12, abs=1e-300)
    assert improved > 0
    for i in (1, 2, 3):                                  # constants stay exact
        assert (d[i] == w[i]).all()


def test_q4_mse_picks_the_grids_best_candidate():
    """Brute force on a small case: every candidate of the documented grid is scored
    exactly; the stored one is a candidate and none is better."""
    assert quant.Q4_CLIP_GRID == GRID
    rng = np.random.default_rng(7)
    w = np.concatenate([rng.standard_normal((12, 200)), _adversarial(200, rng)[:12]])
    t = quantize_q4(w, 64)
    for r, g, v, s, z, _ in _groups(w, t):
        cands = list(_ref_candidates(v))
        errs = [_ref_err(v, cs, cz) for cs, cz in cands]
        assert (s, z) in cands, (r, g)
        e = _ref_err(v, s, z)
        assert e <= min(errs) * (1 + 1e-9), (r, g, e, min(errs))


def test_q4_mse_lowers_gaussian_error():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((256, 1024))
    rel = {c: np.sqrt(((dequantize_q4(quantize_q4(w, 128, clip=c)) - w) ** 2).sum() / (w ** 2).sum())
           for c in ("minmax", "mse")}
    assert 0.099 < rel["minmax"] < 0.102          # measured 0.1006
    assert rel["mse"] < 0.0960                    # measured 0.0950


def test_q4_deterministic_and_row_independent():
    """Same bytes every time, per row the same whatever else is in the matrix (the search
    runs in chunks of groups), and a pinned digest (same bytes on any machine)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 1000))                 # 2400 groups: more than one chunk
    a, b = quantize_q4(w, 128), quantize_q4(w.copy(), 128)
    for x, y in ((a.data, b.data), (a.scales, b.scales), (a.zeros, b.zeros)):
        assert x.tobytes() == y.tobytes()
    for r in (0, 137, 299):
        one = quantize_q4(w[r:r + 1], 128)
        assert one.data.tobytes() == a.data[r].tobytes()
        assert one.scales.tobytes() == a.scales[r].tobytes()
        assert one.zeros.tobytes() == a.zeros[r].tobytes()
    small = quantize_q4(np.random.default_rng(0).standard_normal((16, 200)), 64)
    h = hashlib.sha256(small.data.tobytes() + small.scales.tobytes() + small.zeros.tobytes())
    assert h.hexdigest() == PINNED_Q4_MSE_SHA256


PINNED_Q4_MSE_SHA256 = "72cc3bedb7a5ff232adc7ef288825e71483bf6f18ed4072c685a142513cac450"


def test_q4_act_scale_and_fake_quant_agree():
    from colibri_core.convert.awq import fake_quant
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 200))
    a = rng.uniform(0.2, 5, 200)
    for clip in ("mse", "minmax"):
        t1, t2 = quantize_q4(w, 64, act_scale=a, clip=clip), quantize_q4(w * a, 64, clip=clip)
        assert t1.data.tobytes() == t2.data.tobytes() and t1.scales.tobytes() == t2.scales.tobytes()
        assert t1.zeros.tobytes() == t2.zeros.tobytes()
        d = dequantize_q4(quantize_q4(w, 64, clip=clip))
        assert (fake_quant_q4(w, 64, clip) == d).all()
        assert (fake_quant(w, 4, 64, clip) == d).all()


def test_q4_non_finite_weights_give_a_non_finite_scale_quietly():
    w = np.random.default_rng(5).standard_normal((3, 256))
    w[0, 3], w[1, 200] = np.nan, np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = quantize_q4(w, 128)
    assert not np.isfinite(t.scales[0, 0]) and not np.isfinite(t.scales[1, 1])
    assert np.isfinite(t.scales[2]).all() and np.isfinite(t.scales[0, 1])


def test_bad_clip_refused():
    with pytest.raises(ValueError, match="clip"):
        quantize_q4(np.zeros((2, 64)), 64, clip="best")
