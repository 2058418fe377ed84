"""The converter's q4/q6 scale search in C (kernels.q4_group_codes, ck_qsearch.c) against
its numpy reference (quant.q4_group_codes): the same codes, scales and zero points, bit
for bit, on groups of many kinds (the candidates' sums are numpy's pairwise sums, so even
candidates within a last bit of each other are decided alike)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_core import kernels
from colibri_core.format import quant


def _groups(rng, n: int, k: int) -> np.ndarray:
    """n groups of k values: Gaussian, heavy-tailed, one-sided, outliers, lattice values
    (candidates tie exactly), constant, zero, tiny (subnormal scales) and huge ones."""
    kinds = [
        lambda: rng.standard_normal(k),
        lambda: rng.standard_t(2, k),
        lambda: rng.lognormal(0, 1.5, k),
        lambda: -rng.exponential(1, k),
        lambda: np.where(rng.random(k) < 0.02, 50.0, 1.0) * rng.standard_normal(k),
        lambda: rng.integers(-8, 8, k) * 0.25,
        lambda: np.full(k, rng.standard_normal()),
        lambda: np.zeros(k),
        lambda: rng.standard_normal(k) * 1e-44,
        lambda: rng.standard_normal(k) * 1e300,
        lambda: (rng.standard_normal(k) * 3).astype(np.float32).astype(np.float64) + 7,
        lambda: _half_way(rng, k),
    ]
    return np.stack([kinds[i % len(kinds)]() for i in range(n)])


def _half_way(rng, k: int) -> np.ndarray:
    """Values exactly half-way between two levels of min/max's scale (a float32 s0 with
    (max - min) / 15 == s0): rint's ties to even decide every code."""
    s0 = float(np.float32(rng.uniform(0.05, 2.0)))
    v = (rng.integers(0, 15, k) + 0.5) * s0
    v[:2] = 0.5 * s0, 15.5 * s0
    return v


@pytest.mark.parametrize("k", [64, 100, 128, 200, 256, 1024, 5])
@pytest.mark.parametrize("qmax", [15, 63])
@pytest.mark.parametrize("clip", ["mse", "minmax"])
def test_c_search_is_numpy_bit_for_bit(k, qmax, clip):
    blk = _groups(np.random.default_rng(k * qmax), 1100, k)
    q_ref, s_ref, z_ref = quant.q4_group_codes(blk, clip, qmax)
    q, s, z = kernels.q4_group_codes(blk, clip, qmax)
    assert s.dtype == np.float32 and z.dtype == np.uint8 and q.dtype == np.uint8
    assert np.array_equal(s, s_ref.astype(np.float32))
    assert np.array_equal(s.astype(np.float64), s_ref)          # numpy's scales are float32 values
    assert np.array_equal(z, z_ref.astype(np.uint8))
    assert np.array_equal(q, q_ref)


def test_mse_chooses_other_ranges_than_minmax():
    """The search is not minmax under another name: most Gaussian groups pick a shrunk range."""
    blk = np.random.default_rng(3).standard_normal((2000, 128))
    _, s_mse, _ = kernels.q4_group_codes(blk, "mse")
    _, s_mm, _ = kernels.q4_group_codes(blk, "minmax")
    assert (s_mse < s_mm).mean() > 0.5


def test_threads_do_not_change_the_result():
    blk = _groups(np.random.default_rng(5), 3000, 128)
    old = kernels.get_threads()
    try:
        kernels.set_threads(1)
        one = kernels.q4_group_codes(blk)
        kernels.set_threads(3)
        three = kernels.q4_group_codes(blk)
    finally:
        kernels.set_threads(old)
    for a, b in zip(one, three):
        assert np.array_equal(a, b)


def test_whole_matrices_match_the_numpy_quantizers():
    """quantize_rows with the C search == without it, partial last group included."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((70, 330)) * rng.lognormal(0, 1, (70, 1))).astype(np.float32)
    for kind in ("q4", "q6"):
        ref = quant.quantize_rows(kind, lambda a, b: w[a:b], 70, 330, 64)
        got = quant.quantize_rows(kind, lambda a, b: w[a:b], 70, 330, 64, "mse",
                                  kernels.q4_group_codes)
        for f in ("data", "scales", "zeros"):
            assert np.array_equal(getattr(got, f), getattr(ref, f)), (kind, f)


def test_non_finite_groups_follow_numpy():
    """A NaN or Inf gives numpy's result (a non-finite scale the validator refuses)."""
    blk = np.random.default_rng(9).standard_normal((600, 128))
    blk[17, 3] = np.nan
    blk[400, 0] = np.inf
    q_ref, s_ref, z_ref = quant.q4_group_codes(blk, "mse", 15)
    q, s, z = kernels.q4_group_codes(blk, "mse", 15)
    assert not np.isfinite(s[17]) and not np.isfinite(s[400])
    assert np.array_equal(s, s_ref.astype(np.float32), equal_nan=True)
    ok = np.isfinite(s_ref)
    assert np.array_equal(q[ok], q_ref[ok]) and np.array_equal(z[ok], z_ref[ok].astype(np.uint8))


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="clip 'best'"):
        kernels.q4_group_codes(np.zeros((2, 64)), "best")
    with pytest.raises(ValueError, match="blk: expected a float64"):
        kernels.q4_group_codes(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="blk: expected a float64"):
        kernels.q4_group_codes(np.zeros(64))


def test_the_converter_uses_it_and_writes_the_same_files(tmp_path, monkeypatch):
    """`colibri convert` searches in C, and its files are byte for byte those of the numpy
    search (config.json's sha256 of every file)."""
    import json

    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("hf_helpers")
    from colibri_core.convert import convert
    ck = hf.save(hf.make_hf_model("olmoe", vocab_size=512), tmp_path / "hf", dtype=torch.bfloat16)
    calls = []
    real = kernels.q4_group_codes
    monkeypatch.setattr(kernels, "q4_group_codes", lambda *a: calls.append(a[0].shape) or real(*a))
    convert(ck, tmp_path / "c")
    assert calls, "the converter did not call kernels.q4_group_codes"
    monkeypatch.setattr(kernels, "q4_group_codes", quant.q4_group_codes)
    convert(ck, tmp_path / "numpy")
    files = [json.loads((tmp_path / d / "config.json").read_text())["files"] for d in ("c", "numpy")]
    assert files[0] == files[1]
