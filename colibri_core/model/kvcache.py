"""The KV cache: a sequence's keys and values (f32, f16 or q8 rows), the engine's pool
they are allocated from, and the memory check before a large allocation.

A `KVCache` is two arrays [layers, capacity, nkv, d] (and, for q8, their scales [layers,
capacity, nkv]), contiguous per sequence: the pipeline hands their addresses to C
(ck_step.c), which writes each new key and value row in the cache's type and dequantizes
the rows it attends over. MLA's latent cache (mla.MLACache) is float32 whatever the type.

The `KVPool` is the accounting and the admission rule: a capacity in positions
(EngineConfig.kv_pool_tokens; its default follows the memory available, the context
and the row size: residency.kv_pool_tokens), from
which `alloc(positions)` takes a sequence's cache (its own block, allocated then) or
refuses with KVPoolFullError, and `free(cache)` gives the positions back and the memory
with them. The memory budget (residency.plan_budget) counts the pool at its capacity and
type.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from .. import memstat
from . import mla
from ..memstat import available_bytes
from ..config import EngineConfig, ModelConfig
from ..errors import InsufficientMemoryError, KVPoolFullError, RequestError
from ..format.quant import dequantize_kv_q8, quantize_kv_q8
from .seqcache import SequenceCache

KV_DTYPES = {"f32": np.float32, "f16": np.float16, "q8": np.int8}


def kv_bytes_per_position(cfg: ModelConfig, dtype: str = "f32") -> int:
    """KV-cache bytes of one position of one sequence, all layers (kvcache.KVCache in
    `dtype`: f32 4 bytes a value, f16 2, q8 1 plus a float32 scale per kv head; MLA's
    latent cache is float32 whatever the dtype)."""
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    row = {"f32": 4 * cfg.head_size, "f16": 2 * cfg.head_size, "q8": cfg.head_size + 4}[dtype]
    return 2 * cfg.num_layers * cfg.num_kv_heads * row


DEFAULT_POOL_TOKENS = 65536   # without a memory budget, at most: shared by many requests
MIN_POOL_TOKENS = 4096        # ... and at least (or the context if shorter): one long prompt


def model_bytes(cfg: ModelConfig) -> int:
    """The model's files' bytes, as config.json records them (0 when it lists none)."""
    return sum(info.size for info in cfg.files.values())


def kv_pool_tokens(cfg: ModelConfig, engine: EngineConfig,
                   available: Optional[int] = None) -> int:
    """The KV pool's capacity in positions: EngineConfig.kv_pool_tokens, else the older
    residency.kv_tokens; else under a memory budget one sequence at the model's full
    context (what the budget reserves). Without one: half of the memory available at
    start, less the model's files (they must stay in the page cache), over a position's
    bytes, within [min(4,096, context), max(65,536, context)]. Capacity alone costs no
    memory (rows are allocated per sequence), but the scheduler admits sequences up to
    it: Qwen3-30B-A3B's 65,536 f32 positions are 12 GiB (docs/ARCHITECTURE.md)."""
    got = engine.kv_pool_tokens or engine.residency.kv_tokens
    if got:
        return got
    ctx = cfg.max_position_embeddings
    if engine.max_resident_mb is not None:
        return ctx
    most, least = max(DEFAULT_POOL_TOKENS, ctx), min(MIN_POOL_TOKENS, ctx)
    avail = available_bytes() if available is None else available
    if avail is None:
        return most
    # the prefix cache's cap (runtime/prefixcache.py) is KV rows kept: set aside first
    avail -= int(engine.prefix_cache_mb * 2**20)
    fit = (avail - model_bytes(cfg)) // 2 // kv_bytes_per_position(cfg, engine.kv_dtype)
    return int(max(least, min(most, fit)))



def check_memory(need: int, what: str, reclaim=None) -> None:
    """Refuse an allocation the machine (or this cgroup) cannot hold, before making it.
    `reclaim(nbytes) -> bytes freed`: memory that may be given back first (the prefix
    cache's rows, runtime/prefixcache.py)."""
    avail = memstat.available_bytes()
    if avail is not None and need > avail and reclaim is not None:
        avail += reclaim(need - avail)
    if avail is not None and need > avail:
        raise InsufficientMemoryError(
            f"{what} needs {need / 2**20:,.0f} MiB but {avail / 2**20:,.0f} MiB are available "
            f"(MemAvailable / cgroup limit); ask for fewer tokens (max_new_tokens, -n) or "
            f"fewer sequences per call")


class KVCache(SequenceCache):
    """Keys and values of one sequence, every layer: k, v [L, capacity, NKV, D] of
    float32, float16 or int8 (`dtype` "f32", "f16", "q8"); q8 adds k_scale, v_scale
    [L, capacity, NKV] float32 (row = codes * scale, quant.quantize_kv_q8)."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: str = "f32"):
        if dtype not in KV_DTYPES:
            raise RequestError(f"kv_dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_size)
        self.dtype = dtype
        self.k = np.zeros(shape, dtype=KV_DTYPES[dtype])
        self.v = np.zeros(shape, dtype=KV_DTYPES[dtype])
        self.k_scale = self.v_scale = None
        if dtype == "q8":
            self.k_scale = np.zeros(shape[:3], dtype=np.float32)
            self.v_scale = np.zeros(shape[:3], dtype=np.float32)
        self._start(capacity)

    def write(self, layer: int, s0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Rows s0.. of layer `layer` from float32 k, v [n, NKV, D], in the cache's type."""
        n = len(k)
        if self.dtype == "q8":
            self.k[layer, s0:s0 + n], self.k_scale[layer, s0:s0 + n] = quantize_kv_q8(k)
            self.v[layer, s0:s0 + n], self.v_scale[layer, s0:s0 + n] = quantize_kv_q8(v)
        else:
            self.k[layer, s0:s0 + n] = k
            self.v[layer, s0:s0 + n] = v

    def read(self, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows 0..n of layer `layer` as float32 [n, NKV, D] (views for f32)."""
        if self.dtype == "q8":
            return (dequantize_kv_q8(self.k[layer, :n], self.k_scale[layer, :n]),
                    dequantize_kv_q8(self.v[layer, :n], self.v_scale[layer, :n]))
        if self.dtype == "f16":
            return self.k[layer, :n].astype(np.float32), self.v[layer, :n].astype(np.float32)
        return self.k[layer, :n], self.v[layer, :n]

    def _release(self) -> None:
        self.k = self.v = self.k_scale = self.v_scale = None


ROW_ARRAYS = ("k", "v", "k_scale", "v_scale")   # a cache's arrays, each [L, positions, ...]


def copy_rows(cache, s0: int, n: int) -> tuple:
    """Rows s0..s0+n of every layer, copied out of `cache` (KVCache or MLACache) as
    contiguous arrays in its storage type, one per array of ROW_ARRAYS it has (None where
    it has none): what the prefix cache keeps (runtime/prefixcache.py)."""
    return tuple(None if a is None else np.ascontiguousarray(a[:, s0:s0 + n])
                 for a in (getattr(cache, name, None) for name in ROW_ARRAYS))


def paste_rows(cache, s0: int, rows: tuple) -> None:
    """Write rows taken by copy_rows (from a cache of the same model and type) at
    positions s0.. of `cache`: the same bits as computing them there."""
    for name, src in zip(ROW_ARRAYS, rows):
        if src is not None:
            getattr(cache, name)[:, s0:s0 + src.shape[1]] = src


def cache_bytes(cfg: ModelConfig, capacity: int, dtype: str = "f32") -> int:
    """What new_cache(cfg, capacity, dtype) allocates (keys and values, every layer)."""
    return int(capacity) * kv_bytes_per_position(cfg, dtype)


def new_cache(cfg: ModelConfig, capacity: int, dtype: str = "f32"):
    """A sequence's cache of `capacity` positions (MLA: its latent cache, float32), after
    checking the memory is there. Unpooled: tests and the reference model; the engine
    allocates from its KVPool."""
    check_memory(cache_bytes(cfg, capacity, dtype), f"a KV cache of {capacity} positions")
    return _alloc_cache(cfg, capacity, dtype)


def _alloc_cache(cfg: ModelConfig, capacity: int, dtype: str):
    if cfg.attention == "mla":
        return mla.MLACache(cfg, capacity)
    return KVCache(cfg, capacity, dtype)


class KVPool:
    """The engine's KV capacity in positions, and the caches taken from it.

    alloc(positions) -> a cache of that many positions (its own contiguous block,
    allocated now), or KVPoolFullError when fewer positions are free; free(cache) gives
    them back (idempotent; the cache refuses any further use). Thread-safe: a Generation
    garbage-collected on another thread frees its cache from there."""

    def __init__(self, cfg: ModelConfig, capacity_tokens: int, dtype: str = "f32"):
        if capacity_tokens < 1:
            raise RequestError(f"kv_pool_tokens={capacity_tokens}: must be at least 1")
        if dtype not in KV_DTYPES:
            raise RequestError(f"kv_dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        self.cfg = cfg
        self.dtype = dtype if cfg.attention != "mla" else "f32"
        self.capacity_tokens = int(capacity_tokens)
        self._used: dict[int, tuple[object, int]] = {}     # id(cache) -> (cache, positions)
        self._taken = 0
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, cfg: ModelConfig, engine: EngineConfig) -> "KVPool":
        return cls(cfg, kv_pool_tokens(cfg, engine), engine.kv_dtype)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self._taken

    @property
    def used_sequences(self) -> int:
        return len(self._used)

    @property
    def bytes_per_position(self) -> int:
        return kv_bytes_per_position(self.cfg, self.dtype)

    def alloc(self, positions: int):
        """A cache of `positions` positions, counted against the pool until free()."""
        positions = int(positions)
        if positions < 1:
            raise RequestError(f"a KV cache of {positions} positions: ask for at least 1")
        with self._lock:
            if positions > self.capacity_tokens - self._taken:
                raise KVPoolFullError(
                    f"the KV pool has {self.capacity_tokens - self._taken} of "
                    f"{self.capacity_tokens} positions free and a sequence asks for "
                    f"{positions}; retry when other sequences have ended, or raise "
                    f"kv_pool_tokens (engine config)")
            self._taken += positions          # reserved before the (slow) allocation
        try:   # no memory check here: the scheduler checked the request's caches together
            cache = _alloc_cache(self.cfg, positions, self.dtype)
        except BaseException:
            with self._lock:
                self._taken -= positions
            raise
        cache.pool = self
        with self._lock:
            self._used[id(cache)] = (cache, positions)
        return cache

    def free(self, cache) -> None:
        """Give a cache's positions back and drop its arrays; a second free is a no-op."""
        if cache is None:
            return
        with self._lock:
            got = self._used.pop(id(cache), None)
            if got is None or got[0] is not cache:
                if got is not None:                  # another cache of the same id: keep it
                    self._used[id(cache)] = got
                return
            self._taken -= got[1]
        cache._release()
