"""Automatic prefix caching: the KV rows of ended sequences, kept in blocks and copied
into a later sequence whose prompt starts with the same tokens.

A sequence's rows 0..n depend only on its tokens 0..n, the expert set that computed them,
its k and the cache's storage type (batch invariance, forward/pipeline.py: not on how the
prompt was split into steps, nor on the other sequences of a step). So when a sequence
ends, its rows are cut into blocks of BLOCK tokens and kept, each keyed by its parent
block and its own token ids, the first by (expert-set id, k, kv dtype): a chain of blocks
is a prefix. At admission (scheduler.py) a generation's prompt walks the chain as far as
its blocks match (at most its length - 1 tokens: the last one must run for its logits),
the matched rows are copied into its new cache, and its prefill starts after them: the
same rows, bit for bit, as computing them, so the same logits.

Why a copy at admission rather than a paged pool (attention reading blocks): a sequence's
cache stays one contiguous block that C reads as one run, nothing changes in the kernels,
and the copy costs about a memcpy of the rows (docs/SERVE.md "Prefix caching" has the
measurement against a prefill of the same tokens).

Kept: up to EngineConfig.prefix_cache_mb of rows, least recently used evicted first. A
hit touches its chain leaf first, so a block is never older than its descendants and the
oldest block is always a leaf. Skipped while anything could make rows differ from a plain
prefill or needs to see every prompt row: a plugin implementing `routing`,
`choose_k_token`, `before_layer` or `after_layer`, and the audit log (it records the
prompt's routing). Scoring jobs neither use nor feed it (they want every position).
Rows computed while the expert set changed (an unpinned sequence across a change) are
kept only up to the change; blocks of other sets are dropped once the set changes.

On the scheduler's thread: attach (admission), note (after a step's forward), release
(the sequence's cache freed). evict_bytes and stats from any thread (one lock).
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from ..model.kvcache import copy_rows, paste_rows

BLOCK = 16                    # tokens per block: a prompt's last partial block is computed
_HOOKS = ("routing", "choose_k_token", "before_layer", "after_layer")


class _Block:
    __slots__ = ("key", "serial", "set_id", "rows", "nbytes", "children", "parent")

    def __init__(self, key, serial: int, set_id: str, rows: tuple, parent):
        self.key, self.serial, self.set_id, self.rows = key, serial, set_id, rows
        self.parent = parent                      # the block before it (None: the first)
        self.nbytes = sum(a.nbytes for a in rows if a is not None)
        self.children: set = set()


class _Track:
    """A sequence since admission: its set, the rows computed with it alone (`limit`),
    and the ids of its decode tokens (rows after the prompt)."""
    __slots__ = ("set_id", "limit", "decoded")

    def __init__(self, set_id: str):
        self.set_id, self.limit, self.decoded = set_id, None, []


class PrefixCache:
    def __init__(self, capacity_bytes: int, kv_dtype: str, block: int = BLOCK):
        self.capacity_bytes = int(capacity_bytes)
        self.kv_dtype = kv_dtype
        self.block = int(block)
        self._blocks: OrderedDict = OrderedDict()    # key -> _Block, oldest first
        self._tracks: dict = {}                      # id(job) -> (job, _Track)
        self._serial = itertools.count(1)
        self._lock = threading.Lock()
        self._set_id: Optional[str] = None           # the set the kept blocks are for
        self.bytes = 0
        self.hits = self.misses = self.reused_tokens = self.evictions = 0

    @classmethod
    def for_engine(cls, engine) -> Optional["PrefixCache"]:
        """The engine's prefix cache, or None when EngineConfig.prefix_cache_mb is 0."""
        mb = engine.config.prefix_cache_mb
        return cls(int(mb * 2**20), engine.kv_pool.dtype) if mb > 0 else None

    @staticmethod
    def skipped(engine) -> bool:
        """Whether rows may not be reused now: a hook that changes or watches every
        row's computation, or the audit log (docs above)."""
        hooks = engine.hooks
        if hooks is not None and any(getattr(hooks, h) is not None for h in _HOOKS):
            return True
        return getattr(engine, "audit", None) is not None

    # ------------------------------------------------------------ the scheduler's thread
    def attach(self, job, es, engine) -> int:
        """At admission, its cache allocated: copy the longest kept prefix of its prompt
        into it and start its prefill after it. -> tokens reused."""
        if not job.decodes or job.all_logits or job.cache is None or \
                job.request.error is not None or self.skipped(engine):
            return 0                       # (freed already: its request failed at admission)
        current = engine.model.expert_set.id
        tokens, b = job.tokens, self.block
        with self._lock:
            if current != self._set_id:                 # the set changed: old rows go
                self._set_id = current
                for blk in [x for x in self._blocks.values() if x.set_id != current]:
                    self._drop(blk)
            self._tracks[id(job)] = (job, _Track(es.id))
            chain, parent = [], (es.id, job.k, self.kv_dtype)
            for i in range((len(tokens) - 1) // b):
                blk = self._blocks.get((parent, tokens[i * b:(i + 1) * b].tobytes()))
                if blk is None:
                    break
                chain.append(blk)
                parent = blk.serial
            for i, blk in enumerate(chain):
                paste_rows(job.cache, i * b, blk.rows)
            self._touch(chain)
            n = len(chain) * b
            if n:
                self.hits += 1
                self.reused_tokens += n
            else:
                self.misses += 1
        job.cache.length = job.fed = n
        return n

    def note(self, plan: list, outs: list, sets: list) -> None:
        """After a step's forward (caches advanced, before sampling): each tracked
        sequence's decode token ids, and where its expert set changed."""
        tracks = self._tracks
        for (j, toks, _), out, es in zip(plan, outs, sets):
            got = tracks.get(id(j))
            if got is None or got[0] is not j or isinstance(out, BaseException):
                continue
            tr = got[1]
            pos = j.cache.length - len(toks)             # the step's first row
            if es.id != tr.set_id and (tr.limit is None or pos < tr.limit):
                tr.limit = pos
            d = pos - len(j.tokens)
            if d >= 0:                                   # a decode token (and its draft)
                del tr.decoded[d:]                       # rows a rejected draft left
                tr.decoded.extend(toks.tolist())

    def release(self, job, engine, ok: bool) -> None:
        """Its cache is about to be freed: keep its rows' full blocks (when `ok`: its
        request did not fail, and nothing makes its rows unreusable)."""
        got = self._tracks.pop(id(job), None)
        if got is None or got[0] is not job or not ok or job.cache is None \
                or job.cache.freed or self.skipped(engine):
            return
        tr, cache, b = got[1], job.cache, self.block
        n = cache.length if tr.limit is None else min(cache.length, tr.limit)
        ids = job.tokens[:n]
        if n > len(ids):
            ids = np.concatenate([ids, np.asarray(tr.decoded, np.int64)])[:n]
        with self._lock:
            chain, parent, on_chain = [], (tr.set_id, job.k, self.kv_dtype), set()
            for i in range(len(ids) // b):
                key = (parent, ids[i * b:(i + 1) * b].tobytes())
                blk = self._blocks.get(key)
                if blk is None:
                    rows = copy_rows(cache, i * b, b)
                    blk = _Block(key, next(self._serial), tr.set_id, rows,
                                 chain[-1] if chain else None)
                    if not self._room(blk.nbytes, on_chain):
                        break
                    self._blocks[key] = blk
                    self.bytes += blk.nbytes
                    if blk.parent is not None:
                        blk.parent.children.add(key)
                else:
                    self._blocks.move_to_end(key)        # newer than what may be evicted
                chain.append(blk)
                on_chain.add(key)
                parent = blk.serial
            self._touch(chain)

    # ------------------------------------------------------------------- any thread
    def evict_bytes(self, nbytes: int) -> int:
        """Drop least recently used blocks until `nbytes` are freed (or none is left):
        the KV memory check's reclaim (kvcache.check_memory). -> bytes freed."""
        with self._lock:
            before = self.bytes
            while self._blocks and before - self.bytes < nbytes:
                self._drop(next(iter(self._blocks.values())))
                self.evictions += 1
            return before - self.bytes

    def clear(self) -> None:
        with self._lock:
            while self._blocks:
                self._drop(next(iter(self._blocks.values())))

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens,
                "evictions": self.evictions, "bytes": self.bytes, "blocks": len(self._blocks),
                "capacity_bytes": self.capacity_bytes, "block_tokens": self.block}

    # ------------------------------------------------------------------- under _lock
    def _touch(self, chain: list) -> None:
        for blk in reversed(chain):                      # leaf first: parents newer
            if blk.key in self._blocks:
                self._blocks.move_to_end(blk.key)

    def _room(self, nbytes: int, keep: set) -> bool:
        """Evict least recently used blocks (never those in `keep`) until `nbytes` fit."""
        if nbytes > self.capacity_bytes:
            return False
        while self.bytes + nbytes > self.capacity_bytes:
            oldest = next(iter(self._blocks.values()), None)
            if oldest is None or oldest.key in keep:
                return False
            self._drop(oldest)
            self.evictions += 1
        return True

    def _drop(self, blk: _Block) -> None:
        """A block and what hangs below it (nothing, by the touch order; kept safe)."""
        todo = [blk]
        while todo:
            x = todo.pop()
            if self._blocks.pop(x.key, None) is None:
                continue
            self.bytes -= x.nbytes
            todo += [self._blocks[k] for k in x.children if k in self._blocks]
            if x.parent is not None:
                x.parent.children.discard(x.key)
