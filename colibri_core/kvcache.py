"""The KV cache of one sequence, and the memory check before a large allocation."""
from __future__ import annotations

import numpy as np

from . import memstat, mla
from .config import ModelConfig
from .errors import InsufficientMemoryError


def check_memory(need: int, what: str) -> None:
    """Refuse an allocation the machine (or this cgroup) cannot hold, before making it."""
    avail = memstat.available_bytes()
    if avail is not None and need > avail:
        raise InsufficientMemoryError(
            f"{what} needs {need / 2**20:,.0f} MiB but {avail / 2**20:,.0f} MiB are available "
            f"(MemAvailable / cgroup limit); ask for fewer tokens (max_new_tokens, -n) or "
            f"fewer sequences per call")


class KVCache:
    """Keys and values of one sequence, every layer: [L, capacity, NKV, D] float32."""

    def __init__(self, cfg: ModelConfig, capacity: int):
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_size)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.capacity = capacity
        self.length = 0          # positions filled

    def reset(self) -> None:
        self.length = 0


def cache_bytes(cfg: ModelConfig, capacity: int) -> int:
    """What new_cache(cfg, capacity) allocates (keys and values, every layer)."""
    per_pos = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla" \
        else 2 * cfg.num_kv_heads * cfg.head_size
    return 4 * cfg.num_layers * int(capacity) * per_pos


def new_cache(cfg: ModelConfig, capacity: int):
    """A sequence's cache of `capacity` positions (MLA: its latent cache), after checking
    the memory is there."""
    check_memory(cache_bytes(cfg, capacity), f"a KV cache of {capacity} positions")
    if cfg.attention == "mla":
        return mla.MLACache(cfg, capacity)
    return KVCache(cfg, capacity)
