"""The KV cache (kvcache.py): f16 and q8 storage (the C row codecs and attention against
their numpy references, the error against f32 end to end), truncation, the pool and its
accounting through every way a request can end, the budget's share, the CLI flag."""
import gc
import subprocess
import sys

import numpy as np
import pytest

from colibri_core.model import ops
from colibri_core.config import EngineConfig, builtin_model_dir
from colibri_core.engine import Engine
from colibri_core.errors import RequestTooLarge, KVCacheFreedError, KVPoolFullError, PluginError, RequestError
from colibri_core.hookspecs import hookimpl
from colibri_core.kernels import ffi, lib
from colibri_core.model.kvcache import KVPool
from colibri_core.format.quant import dequantize_kv_q8, quantize_kv_q8
from colibri_core.experts.residency import kv_bytes_per_position, plan_budget
from colibri_core.model.testing import write_random_model
from kv_error_helpers import measure, prompt_for, random_model

DTYPES = ["f32", "f16", "q8"]


def fp(a, ctype="float *"):
    return ffi.cast(ctype, ffi.from_buffer(a))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv") / "m"
    write_random_model(d, seed=4, vocab=300, hidden=128, layers=("dense", "moe"), experts=4,
                       top_k=2, inter=192, moe_inter=128, shared=64, heads=4, kv_heads=2,
                       context=64)
    return d


@pytest.fixture(scope="module")
def eng(model_dir):
    with Engine(model_dir, EngineConfig(threads=2)) as e:
        yield e


# ----------------------------------------------------------------------------- row codecs

def rows(n=300, d=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.choice([1e-7, 1e-4, 1.0, 300.0, 7e4], (n, 1))
    x = x.astype(np.float32)
    x[0, :6] = [65504, 65519.9, 65520, -1e6, -0.0, 0.0]      # largest half, rounding to Inf
    x[1, :4] = [6e-8, 2.98e-8, 2.99e-8, 1e-40]                # half subnormals, underflow
    x[2, :] = 0.0                                              # an all-zero row: scale 0
    return x


def test_f16_rows_round_as_numpy_and_read_back_exactly():
    x = rows()
    h = np.zeros(x.shape, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    lib.ck_kv_store(lib.CK_KV_F16, fp(x), len(x), x.shape[1], fp(h, "void *"), ffi.NULL)
    assert np.array_equal(h, want.view(np.uint16))
    every = np.arange(1 << 16, dtype=np.uint16).reshape(-1, 64)     # every half, NaNs too
    back = np.zeros(every.shape, np.float32)
    lib.ck_kv_load(lib.CK_KV_F16, fp(every, "void *"), ffi.NULL, len(every), 64, fp(back))
    ref = every.view(np.float16).astype(np.float32)
    same = (back.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(back) & np.isnan(ref))
    assert same.all()


def test_q8_rows_match_quant_reference():
    x = rows()
    q, s = np.zeros(x.shape, np.int8), np.zeros(len(x), np.float32)
    lib.ck_kv_store(lib.CK_KV_Q8, fp(x), len(x), x.shape[1], fp(q, "void *"), fp(s))
    wq, ws = quantize_kv_q8(x)
    assert np.array_equal(q, wq) and np.array_equal(s, ws)
    assert s[2] == 0 and not q[2].any()
    back = np.zeros_like(x)
    lib.ck_kv_load(lib.CK_KV_Q8, fp(q, "void *"), fp(s), len(x), x.shape[1], fp(back))
    assert np.array_equal(back, dequantize_kv_q8(q, s))
    # symmetric, half to even, within half a step of the row's scale
    assert np.all(np.abs(dequantize_kv_q8(wq, ws) - x) <= ws[:, None] * 0.5 * (1 + 1e-6))


@pytest.mark.parametrize("kind", ["f16", "q8"])
def test_low_precision_attention_matches_numpy(kind):
    """ck_kv_attention (what ck_step_attention runs for f16/q8 caches) against
    ops.attention over the dequantized rows: g=3 heads, 37 positions, d=48, a row
    stride of 2 kv heads."""
    rng = np.random.default_rng(7)
    g, d, nkv, S = 3, 48, 2, 37
    q = rng.standard_normal((g, d)).astype(np.float32)
    kf = (rng.standard_normal((S, nkv, d)) * 2).astype(np.float32)
    vf = rng.standard_normal((S, nkv, d)).astype(np.float32)
    out = np.zeros((g, d), np.float32)
    if kind == "f16":
        k, v = kf.astype(np.float16), vf.astype(np.float16)
        ks = vs = None
        kd, vd = k.astype(np.float32), v.astype(np.float32)
        code = lib.CK_KV_F16
    else:
        (k, ks), (v, vs) = quantize_kv_q8(kf), quantize_kv_q8(vf)
        kd, vd = dequantize_kv_q8(k, ks), dequantize_kv_q8(v, vs)
        code = lib.CK_KV_Q8
    j = 1                                  # kv head 1: its rows start j * d values in
    k_j = ffi.cast("char *", ffi.from_buffer(k)) + j * d * k.itemsize
    v_j = ffi.cast("char *", ffi.from_buffer(v)) + j * d * v.itemsize
    rc = lib.ck_kv_attention(code, fp(q), g, d, k_j, v_j,
                             fp(ks) + j if ks is not None else ffi.NULL,
                             fp(vs) + j if vs is not None else ffi.NULL, nkv * d, S, 0.3, fp(out))
    assert rc == 0
    want = ops.attention(q[None].astype(np.float64), kd[:, j:j + 1].astype(np.float64),
                         vd[:, j:j + 1].astype(np.float64), 0.3, S - 1)[0]
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(vd).max())


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("kv", ["f16", "q8"])
def test_batch_invariance_with_low_precision_caches(eng, kv):
    """A sequence's logits with an f16/q8 cache alone and beside others (of every type)."""
    m = eng.model
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 299, 11)
    solo = m.new_cache(32, kv)
    a = m.forward([prompt], [solo])[0].copy()
    a1 = m.decode_step(5, solo, 2).copy()
    crowd = [m.new_cache(32, kv)] + [m.new_cache(32, DTYPES[i % 3]) for i in range(4)]
    others = [rng.integers(0, 299, int(n)) for n in rng.integers(1, 9, 4)]
    b = m.forward([prompt] + others, crowd)[0]
    assert np.array_equal(a, b)
    b1 = m.forward([[5]] + [[7]] * 4, crowd)[0]
    assert np.array_equal(a1, b1)


FLOORS = {
    # model/activations: (f16 max rel, q8 max rel, greedy agreement at least)
    # measured (benchmarks/accuracy/kv_dtype_error.py, docs/BENCHMARKS.md): int8 activations
    # 2.6e-2 / 3.1e-2 (random), 2.5e-2 / 2.9e-2 (built-in) -- the floor of any
    # perturbation through int8 activations --; float activations 1.7e-4 / 4.1e-3
    # (random), 3.5e-4 / 0.19 (built-in: one step's routing flips)
    "random/int8": (0.06, 0.07, 0.85),
    "builtin/int8": (0.05, 0.06, 0.95),
    "random/float": (1e-3, 1e-2, 0.95),
    "builtin/float": (1e-3, 0.4, 0.9),
}


@pytest.mark.parametrize("act", ["int8", "float"])
@pytest.mark.parametrize("which", ["random", "builtin"])
def test_error_against_f32_over_64_steps(which, act, tmp_path):
    path = random_model(tmp_path / "m") if which == "random" else builtin_model_dir()
    with Engine.from_model_dir(path, threads=2, activations=act) as e:
        got = measure(e.model, prompt_for(e), 64)
    f16_max, q8_max, agree = FLOORS[f"{which}/{act}"]
    assert got["f16"]["max_rel"] < f16_max, got
    assert got["q8"]["max_rel"] < q8_max, got
    assert got["f16"]["median_rel"] <= got["q8"]["median_rel"] * 1.5, got
    for dt in ("f16", "q8"):
        assert got[dt]["greedy_agreement"] >= agree, got


# ----------------------------------------------------------------------------- truncation

@pytest.mark.parametrize("kv", DTYPES)
def test_truncate_then_refeed_gives_the_same_logits_bit_for_bit(eng, kv):
    m = eng.model
    prompt = np.arange(3, 15)
    toks = [7, 19, 4, 250, 33, 8, 100, 2]
    c = m.new_cache(40, kv)
    first = [m.forward([prompt], [c])[0].copy()]
    first += [m.decode_step(t, c, 2).copy() for t in toks]
    assert c.length == len(prompt) + len(toks)
    p = len(prompt) + 3
    c.truncate(p)
    assert c.length == p
    again = [m.decode_step(t, c, 2).copy() for t in toks[3:]]
    for a, b in zip(first[4:], again):
        assert np.array_equal(a, b)
    c.truncate(len(prompt) - 4)                  # into the prompt: re-feed it as a chunk
    got = m.forward([prompt[-4:]], [c])[0]
    assert np.array_equal(got, first[0])
    with pytest.raises(RequestError, match="truncate"):
        c.truncate(c.length + 1)
    c.reset()
    assert c.length == 0


# ----------------------------------------------------------------------------- the pool

def test_pool_accounting_and_refusal(eng):
    cfg = eng.model_cfg
    pool = KVPool(cfg, 100, "q8")
    assert (pool.capacity_tokens, pool.free_tokens, pool.used_sequences) == (100, 100, 0)
    a = pool.alloc(60)
    assert a.dtype == "q8" and a.capacity == 60 and a.k.dtype == np.int8
    assert (pool.free_tokens, pool.used_sequences) == (40, 1)
    with pytest.raises(KVPoolFullError, match="40 of 100 positions free") as ei:
        pool.alloc(41)
    assert ei.value.http_status == 503 and ei.value.code == "kv_pool_full"
    assert pool.free_tokens == 40                # a refusal takes nothing
    b = pool.alloc(40)
    assert pool.free_tokens == 0
    pool.free(a)
    pool.free(a)                                 # idempotent
    assert (pool.free_tokens, pool.used_sequences) == (60, 1)
    assert a.freed and a.k is None
    with pytest.raises(KVCacheFreedError, match="freed"):
        eng.model.decode_step(1, a, 2)
    with pytest.raises(KVCacheFreedError):
        eng.model.forward([[1, 2]], [a])
    with pytest.raises(KVCacheFreedError):
        a.truncate(0)
    pool.free(b)
    assert (pool.free_tokens, pool.used_sequences) == (100, 0)
    other = KVPool(cfg, 10)
    c = other.alloc(5)
    pool.free(c)                                 # not this pool's: ignored
    assert other.used_sequences == 1 and not c.freed


def test_engine_pool_defaults_and_settings(model_dir, eng):
    # without a budget, memory to spare: 65,536 positions (or the context if larger)
    assert eng.kv_pool.capacity_tokens == max(65536, eng.model_cfg.max_position_embeddings)
    with Engine(model_dir, EngineConfig(threads=1, max_resident_mb=64)) as e:
        assert e.kv_pool.capacity_tokens == e.model_cfg.max_position_embeddings
    assert eng.kv_pool.dtype == "f32"
    with Engine(model_dir, EngineConfig(threads=1, kv_pool_tokens=30, kv_dtype="f16")) as e:
        assert (e.kv_pool.capacity_tokens, e.kv_pool.dtype) == (30, "f16")
        g = e.generate([1, 2, 3], max_new_tokens=4, temperature=0).run()
        assert len(g.token_ids) == 4 and e.kv_pool.free_tokens == 30
        with pytest.raises(RequestTooLarge, match="kv_pool_tokens=30"):
            e.generate(list(range(1, 20)), max_new_tokens=20).run()   # 39 positions: never
        assert e.kv_pool.free_tokens == 30
        # score_batch: chunks fit the pool (10 x 12 tokens through 30 positions)
        seqs = [list(range(i + 1, i + 13)) for i in range(10)]
        got = e.score_batch(seqs)
        want = [e.model.forward([s], [e.model.new_cache(12)])[0] for s in seqs]
        for a, b in zip(got, want):
            assert np.array_equal(a, b)
        assert e.kv_pool.free_tokens == 30 and e.kv_pool.used_sequences == 0


class _BadSampler:
    @hookimpl
    def colibri_sample(self, logits, request):
        return -5


def _back_to_full(pool, full, timeout=5.0) -> bool:
    """The scheduler retires a closed or dropped generation at its next step: wait for it."""
    import time
    end = time.monotonic() + timeout
    while pool.free_tokens != full or pool.used_sequences:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_pool_is_full_again_however_a_generation_ends(model_dir):
    with Engine(model_dir, EngineConfig(threads=1)) as e:
        pool, full = e.kv_pool, e.kv_pool.capacity_tokens
        e.generate([1, 2, 3], max_new_tokens=5, temperature=0).run()                  # to the end
        assert _back_to_full(pool, full)
        it = iter(e.generate([1, 2, 3], max_new_tokens=20, temperature=0))           # closed early
        next(it)
        assert pool.free_tokens < full and pool.used_sequences == 1
        it.close()
        assert _back_to_full(pool, full)
        it = iter(e.generate([1, 2, 3], max_new_tokens=20, temperature=0))           # garbage-collected
        next(it)
        del it
        gc.collect()
        assert _back_to_full(pool, full)
        e.register_plugin(_BadSampler(), name="bad-sampler")           # failed
        with pytest.raises(PluginError):
            e.generate([1, 2, 3], max_new_tokens=5, temperature=0).run()
        assert _back_to_full(pool, full)


# ----------------------------------------------------------------------------- budget, CLI

def test_budget_counts_the_pool_in_its_type(eng):
    cfg = eng.model_cfg
    b = {dt: kv_bytes_per_position(cfg, dt) for dt in DTYPES}
    d = cfg.head_size
    assert b["f16"] * 2 == b["f32"] and b["q8"] * 4 * d == b["f32"] * (d + 4)
    plans = {dt: plan_budget(cfg, EngineConfig(max_resident_mb=1000, kv_dtype=dt,
                                               kv_pool_tokens=640), {}) for dt in DTYPES}
    for dt, p in plans.items():
        assert p.kv_tokens == 640 and p.kv == 640 * b[dt]
    assert plans["q8"].capacity - plans["f32"].capacity == plans["f32"].kv - plans["q8"].kv
    assert plan_budget(cfg, EngineConfig(max_resident_mb=1000), {}).kv_tokens == \
        cfg.max_position_embeddings


def test_cli_kv_dtype():
    from colibri_core.cli import build_parser
    assert build_parser().parse_args(["run", "--kv-dtype", "q8"]).kv_dtype == "q8"
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--kv-dtype", "f16", "-n",
                        "4", "--seed", "0", "--prompt", "The import statement"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The import statement") and "4 tokens" in r.stderr
