"""What every sequence's cache has, whatever it stores (kvcache.KVCache: keys and values;
mla.MLACache: latents): its length, its lifetime in a pool, and truncation."""
from __future__ import annotations

from ..errors import KVCacheFreedError, RequestError


class SequenceCache:
    """Subclasses set `k`, `v` (arrays; None once freed), `capacity`, then call
    `_start()`; `_release()` drops their arrays."""

    def _start(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0          # positions filled
        self.pool = None         # the kvcache.KVPool it came from (None: unpooled)

    @property
    def freed(self) -> bool:
        return self.k is None

    def check_usable(self) -> None:
        if self.k is None:
            raise KVCacheFreedError("this KV cache was freed (KVPool.free) and holds nothing "
                                    "now; allocate a new one (engine.kv_pool.alloc)")

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, pos: int) -> None:
        """Drop positions >= pos: the next token goes to position `pos` (speculative
        decoding's rollback). Rows are only overwritten, so re-feeding the same tokens
        gives the same logits bit for bit."""
        self.check_usable()
        if not 0 <= pos <= self.length:
            raise RequestError(f"truncate({pos}): the cache holds positions 0..{self.length - 1}")
        self.length = int(pos)

    def _release(self) -> None:
        self.k = self.v = None
