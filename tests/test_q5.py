"""The q5 format (format/q5.py, kernels/c/ck_q5.c; issue 33: what GGUF Q5_K classes are
requantized into): its byte layout built bit by bit here, its rounding, the C tiles against
the numpy references on every backend (and the backends' results equal bit for bit), the
container, the value checks, and q5 FFNs and attention through the C pipeline against the
reference model."""
import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.format.q5 import (Q5Tensor, dequantize_q5, matvec_q5_q8_ref, matvec_q5_ref,
                                    pack_q5, quantize_q5, unpack_q5)
from colibri_core.format.quant import dequantize_q4, quantize_q4
from colibri_core.kernels.q5 import q5_matmul


def _layout_by_hand(q: np.ndarray) -> np.ndarray:
    """docs/FORMAT.md `q5`, value by value: per 64 values 32 bytes (byte j: value j's low
    four bits, value 32+j's in the high nibble), then 8 bytes: bit k of byte i = bit 4 of
    value 8k + i."""
    rows, cp = q.shape
    out = np.zeros((rows, cp // 64 * 40), np.uint8)
    for r in range(rows):
        for b in range(cp // 64):
            v = [int(x) for x in q[r, b * 64:(b + 1) * 64]]
            for j in range(32):
                out[r, b * 40 + j] = (v[j] & 15) | ((v[32 + j] & 15) << 4)
            for i in range(8):
                out[r, b * 40 + 32 + i] = sum(((v[8 * k + i] >> 4) & 1) << k for k in range(8))
    return out


def test_layout_is_the_documented_one():
    q = np.random.default_rng(0).integers(0, 32, (3, 192)).astype(np.uint8)
    packed = pack_q5(q)
    assert np.array_equal(packed, _layout_by_hand(q))
    assert np.array_equal(unpack_q5(packed), q)


def test_rounding_more_levels_than_q4():
    """Every weight within half a step of its group's levels (min/max: the range is
    covered), zero points 0..31, padding stored exactly as 0, and about half q4's error."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 200))
    t = quantize_q5(w, 64, clip="minmax")
    assert t.data.shape == (16, 256 // 64 * 40) and t.zeros.max() <= 31
    deq = dequantize_q5(t)
    step = np.repeat(t.scales.astype(np.float64), 64, axis=1)[:, :200]
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-12)
    q = unpack_q5(t.data)
    assert np.array_equal(q[:, 200:], np.repeat(t.zeros[:, 3:4], 56, axis=1))   # padding = 0
    e5 = np.mean((dequantize_q5(quantize_q5(w, 128)) - w) ** 2)
    e4 = np.mean((dequantize_q4(quantize_q4(w, 128)) - w) ** 2)
    assert e5 < 0.3 * e4


def _backends():
    return [b for b in K.available_backends()]


@pytest.mark.parametrize("group,cols,rows,n", [(64, 200, 7, 3), (128, 256, 9, 1), (256, 640, 5, 2)])
def test_q5_tiles_match_the_numpy_references_on_every_backend(group, cols, rows, n):
    """int8 activations: the exact integer group dots of matvec_q5_q8_ref (only the float
    sum over groups differs: ~1e-7); float activations: the float64 dequantized product.
    The AVX2 and AVX-512 backends run the same tile (the same bits); the scalar one adds the
    groups in its own order; the float path is one tile on every backend."""
    rng = np.random.default_rng(group + cols)
    t = quantize_q5(rng.standard_normal((rows, cols)), group)
    x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
    ref8, ref = matvec_q5_q8_ref(t, x), matvec_q5_ref(t, x)
    before = K.backend()
    got = {}
    try:
        for b in _backends():
            K.set_backend(b)
            got[b] = (q5_matmul(t, x), q5_matmul(t, x, act="float"))
            scale = np.abs(ref).max()
            assert np.abs(got[b][0] - ref8).max() <= 1e-6 * scale, b
            assert np.abs(got[b][1] - ref).max() <= 1e-5 * scale, b
            assert np.abs(got[b][0] - ref).max() <= 0.02 * scale     # int8 activations
    finally:
        K.set_backend(before)
    first = next(iter(got.values()))
    simd = [g for b, g in got.items() if b in ("avx2", "avx512vnni")]
    for g in got.values():
        assert np.array_equal(g[1], first[1])
    for g in simd:
        assert np.array_equal(g[0], simd[0][0])
    assert np.array_equal(q5_matmul(t, x[0]), q5_matmul(t, x[:1])[0])   # x [C] -> [R]


def test_q5_matmul_refuses_wrong_parts():
    t = quantize_q5(np.ones((4, 64)), 64)
    with pytest.raises(ValueError, match="w.data"):
        q5_matmul(Q5Tensor(t.data[:, :-1], t.scales, t.zeros, 4, 64, 64), np.ones(64, np.float32))
    with pytest.raises(ValueError, match=r"x: expected \[N, 64\]"):
        q5_matmul(t, np.ones(65, np.float32))


def test_container_round_trip_and_value_checks(tmp_path):
    from colibri_core.format.container import FORMAT_MINOR, minor_for
    from colibri_core.format.modelfile import ContainerFile
    from colibri_core.format.validate import tensor_problems
    from colibri_core.format.writer import write_container
    t = quantize_q5(np.random.default_rng(3).standard_normal((10, 130)), 64)
    write_container(tmp_path / "m.bin", [("w", t)])
    f = ContainerFile(tmp_path / "m.bin")
    try:
        got = f.tensor("w")
        assert isinstance(got, Q5Tensor) and f.sections["w"].dtype == "q5"
        for p in ("data", "scales", "zeros"):
            assert np.array_equal(getattr(got, p), getattr(t, p))
    finally:
        f.close()
    assert minor_for(["q4", "q5"]) == 3 == FORMAT_MINOR
    assert tensor_problems("w", t) == []
    bad = Q5Tensor(t.data, t.scales, np.full_like(t.zeros, 32), 10, 130, 64)
    assert tensor_problems("w", bad) == [
        "section 'w' (q5): 30 zero point(s) outside 0..31, first at [0, 0]"]


def test_q5_ffns_and_attention_through_the_c_pipeline(tmp_path):
    """A model whose FFNs (dense, shared, routed) and attention projections are q5 runs
    the C step (ck_step.h's mat_tile -> ck_q5.c) within the int8 bound of the reference
    model (which runs ops.matmul on the same q5 weights), decode steps included, and a
    sequence's logits are the same alone and beside another (batch invariance). The
    embedding cannot be q5 (its rows are read one at a time): refused in one line."""
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.errors import ConfigError
    from colibri_core.forward.pipeline import Pipeline
    from colibri_core.forward.reference import ReferenceModel
    from colibri_core.model import ops
    from colibri_core.model.testing import write_random_model
    from pipeline_kernel_helpers import assert_decodes_as_reference
    d = tmp_path / "m"
    write_random_model(d, seed=21, vocab=300, context=64, hidden=192, layers=("dense", "moe"),
                       experts=4, top_k=2, inter=320, moe_inter=160, shared=96, heads=4,
                       kv_heads=2)
    with Engine(d, EngineConfig(routing="float")) as eng:
        m = eng.model
        for lw in m.w.layers:
            for f in [x for x in (lw.dense, lw.shared) if x is not None] + [e.ffn for e in lw.experts]:
                f.w1, f.w3, f.w2 = (quantize_q5(ops.float_matrix(getattr(f, n)), g)
                                    for n, g in (("w1", 128), ("w3", 128), ("w2", 64)))
            for n in ("wq", "wk", "wv", "wo"):
                setattr(lw.attn, n, quantize_q5(ops.float_matrix(getattr(lw.attn, n)), 64))
        m.w.lm_head = quantize_q5(ops.float_matrix(m.w.lm_head), 128)
        m.pipeline = Pipeline(m)
        ref = ReferenceModel(m.w, eng.config)
        prompt = np.random.default_rng(2).integers(0, 299, 9)
        c, r = m.new_cache(32), ref.new_cache(32)
        a = m.forward([prompt], [c], all_logits=True)[0]
        b = ref.forward([prompt], [r], all_logits=True)[0]
        rel = lambda u, v: float(np.linalg.norm(u - v) / np.linalg.norm(v))   # noqa: E731
        assert rel(a, b) < 0.03
        assert_decodes_as_reference(m, ref, prompt, c, r, b[-1], 3, 0.03)
        m.w.embed = quantize_q5(ops.float_matrix(m.w.embed), 64)
        with pytest.raises(ConfigError, match="^embed: q5 runs in matrix products only") as e:
            Pipeline(m)
        assert "\n" not in str(e.value)


def test_the_converters_c_search_gives_the_numpy_codes():
    """The converter quantizes q5 with kernels.q4_group_codes (the C search, qmax 31):
    the same bytes as the numpy reference search."""
    w = np.random.default_rng(4).standard_normal((33, 300)) * 0.02
    for clip in ("mse", "minmax"):
        a, b = quantize_q5(w, 128, clip), quantize_q5(w, 128, clip, group_codes=K.q4_group_codes)
        for p in ("data", "scales", "zeros"):
            assert np.array_equal(getattr(a, p), getattr(b, p)), (clip, p)
