"""The expert cache behind a memory budget (EngineConfig.max_resident_mb): what
residency.py's module docstring describes as "the cache" -- entries per (layer, expert),
pinning, LRU/LFU eviction, loads on I/O threads (mapped pages through MADV_POPULATE_READ,
or copy-in frames read with preadv, O_DIRECT where possible) and speculative loads of the
next MoE layers' likely experts. residency.py plans the budget and picks this class;
expertio.py does its reads and runs its I/O threads; speculation.py makes its guesses and
holds the rule for what a far guess may evict.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Optional

import numpy as np

from ..config import EngineConfig
from ..errors import RequestError
from ..memstat import (MADV_DONTNEED, MADV_POPULATE_READ, MADV_RANDOM, MADV_WILLNEED, PAGE,
                       drop_file_cache, madvise, proc_memory, proc_read_bytes)
from .expertio import IOPool, direct_reads_work, fix_malloc, populate, read_into
from .residency import (BudgetPlan, EmbeddingLayout, Residency, layout_of, model_file_sizes,
                        plan_budget)
from ..format.modelfile import expert_name
from ..model.weights import ModelExpert, ModelWeights, expert_ffn
from .speculation import Speculation

class CopyInExpert:
    """A routed expert living in a copy-in frame: its views point into the frame and are
    valid while the expert is pinned (between acquire and release)."""

    __slots__ = ("layer", "index", "ffn", "file", "address", "nbytes")

    def __init__(self, ex: ModelExpert, ffn, address: int, nbytes: int):
        self.layer, self.index, self.ffn, self.file = ex.layer, ex.index, ffn, ex.file
        self.address, self.nbytes = address, nbytes

    @property
    def name(self) -> str:
        return expert_name(self.layer, self.index)


class Pending:
    """Stands for an expert whose load is in flight: the first attribute read (the model
    reads `.ffn` just before computing it) waits for the load, so expert i computes while
    experts i+1.. are still being read."""

    __slots__ = ("_fut", "_res")

    def __init__(self, fut: Future, res: "BudgetResidency"):
        self._fut, self._res = fut, res

    def __getattr__(self, name):
        fut = self._fut
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self._res.stall_s += time.perf_counter() - t0
        return getattr(fut.result(), name)


class _Entry:
    __slots__ = ("key", "nbytes", "pins", "score", "future", "obj", "spec", "frame", "ex", "drops",
                 "uses", "born")

    def __init__(self, key, nbytes: int, ex, born: int = 0):
        self.key, self.nbytes, self.ex = key, nbytes, ex
        self.pins = 0
        self.uses = 1             # forwards that used it (a miss's load is its first)
        self.born = born          # the forward it came in
        self.score = 0.0
        self.future: Optional[Future] = None
        self.obj = None
        self.spec = False
        self.frame = -1
        self.drops: list = []     # evicted experts whose pages its load job drops first


# ----------------------------------------------------------------------------- the cache

class BudgetResidency(Speculation, Residency):
    """The expert cache of a memory budget (see the module docstring)."""

    active = True

    def __init__(self, weights: ModelWeights, engine: EngineConfig, plan: BudgetPlan,
                 embed: Optional[EmbeddingLayout] = None, main=None):
        super().__init__(weights, None)
        rc = engine.residency
        cfg = weights.cfg
        self.cfg, self.plan, self.mode = cfg, plan, engine.load_mode
        self.chunk_tokens = plan.chunk_tokens
        self.poison = rc.debug_poison or os.environ.get("COLIBRI_POISON_EVICTED") == "1"
        self.lru = rc.policy == "lru"
        self._growth = 2.0 ** (1.0 / rc.half_life_tokens)
        self._inc = 1.0
        self._clock = 0
        self._lock = threading.RLock()
        self.entries: dict = {}
        self.used = 0
        self.peak_used = 0
        self.hits = self.misses = self.loads = self.evictions = 0
        self.loaded_bytes = 0
        self.stall_s = 0.0
        self.forwards = self.tokens = 0
        self._init_speculation(rc, cfg)
        self._to_drop: list = []    # mmap: evicted, pages not dropped yet (next load job does)
        self._dropping: dict = {}   # key -> the job that drops that expert's pages
        self._layers = {lw.index: lw for lw in weights.layers}
        self._mem0 = proc_memory()
        experts = [ex for lw in weights.layers for ex in lw.experts]
        self.capacity = plan.capacity
        if self.mode == "copy":
            self._setup_frames(experts, rc.io_threads)
        else:
            for ex in experts:       # the header reads at load touched the files: start empty
                self._drop_mapped(ex, sync=True)
        self._embed_rows: Optional[set] = None    # rows touched since the last drop
        self.embed_drops = 0
        if plan.embed_rows and main is not None and main._mm is not None:
            self._setup_embedding(embed, main)
        self._pool = IOPool(rc.io_threads)
        self._read0 = proc_read_bytes()
        fix_malloc()

    # --- the embedding, counted by rows (residency.py)
    def _setup_embedding(self, embed: EmbeddingLayout, main) -> None:
        """model.bin: no read-around on faults (MADV_RANDOM), the sections other than the
        embedding read now (MADV_WILLNEED, exactly their ranges), the embedding's pages
        dropped: from here on it holds the rows forwards touch."""
        self._main, self._embed_parts = main, embed.parts
        base, size = main.base_address, main.size
        madvise(base, -(-size // PAGE) * PAGE, MADV_RANDOM)
        pos = 0
        for off, n in sorted(embed.parts) + [(size, 0)]:
            a, b = pos // PAGE * PAGE, off // PAGE * PAGE
            if b > a:
                madvise(base + a, b - a, MADV_WILLNEED)
            pos = off + n
        self._embed_rows = set()
        self._drop_embedding(sync=True)     # a model written moments ago is still dirty

    def _drop_embedding(self, sync: bool = False) -> None:
        main = self._main
        for off, n in self._embed_parts:
            a, b = off // PAGE * PAGE, -(-(off + n) // PAGE) * PAGE
            madvise(main.base_address + a, b - a, MADV_DONTNEED)
            drop_file_cache(main.path, a, b - a, sync=sync)
        self._embed_rows.clear()

    def embed_touch(self, ids) -> None:
        """Before a forward embeds `ids`: drop the embedding's pages first if its rows since
        the last drop and these would exceed plan.embed_rows distinct rows."""
        rows = self._embed_rows
        if rows is None:
            return
        new = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if len(new) == 1:
            if new[0] in rows:
                return
            if len(rows) + 1 > self.plan.embed_rows:
                self._drop_embedding()
                self.embed_drops += 1
            rows.add(new[0])
            return
        fresh = set(new) - rows
        if len(rows) + len(fresh) > self.plan.embed_rows:
            self._drop_embedding()
            self.embed_drops += 1
            fresh = set(new)
        rows.update(fresh)

    # --- copy-in frames
    def _setup_frames(self, experts: list, io_threads: int) -> None:
        spans = {}
        for ex in experts:
            f = ex.file
            if f.buf is not None:      # loaded in full (Model built on eager weights): let go
                f.buf = None
                ex.ffn = None
            spans[id(ex)] = f.data_span()
        self._span = spans
        self.frame_bytes = max((b - a for a, b in spans.values()), default=PAGE)
        self.frame_bytes = -(-self.frame_bytes // PAGE) * PAGE
        self.direct = bool(experts) and direct_reads_work(experts[0].file.path,
                                                          spans[id(experts[0])][0])
        n = self.capacity // self.frame_bytes
        if not self.direct:        # buffered reads hold one expert per thread in the cache
            n = max(self.plan.top_k, (self.capacity - io_threads * self.frame_bytes) // self.frame_bytes)
        self.n_frames = n
        self.capacity = n * self.frame_bytes
        raw = np.empty(n * self.frame_bytes + PAGE, np.uint8)      # pages come as frames fill
        a = (-raw.ctypes.data) % PAGE
        self._frames = raw[a:a + n * self.frame_bytes].reshape(n, self.frame_bytes)
        self._free = list(range(n - 1, -1, -1))
        for f in self.weights.files:       # private copies made; no page-cache duplicates
            drop_file_cache(f.path, sync=True)

    # --- mapped experts
    def _drop_mapped(self, ex, sync: bool = False) -> None:
        f = ex.file
        if f.buf is not None and f._mm is not None:
            madvise(f.base_address, f.size, MADV_DONTNEED)
        drop_file_cache(f.path, sync=sync)

    # --- policy
    def _touch(self, ent: _Entry) -> None:
        if self.lru:
            self._clock += 1
            ent.score = float(self._clock)
        else:
            ent.score += self._inc

    def begin_forward(self, ntokens: int, caches) -> None:
        need = sum(c.capacity for c in caches)
        if need > self.plan.kv_tokens:
            raise RequestError(f"this batch's KV caches hold {need} positions; the memory "
                               f"budget reserves {self.plan.kv_tokens} (raise "
                               f"residency.kv_tokens and max_resident_mb, or split the batch)")
        self.forwards += 1
        self.tokens += ntokens
        if not self.lru:
            self._inc *= self._growth
            if self._inc > 1e100:
                for ent in self.entries.values():
                    ent.score /= self._inc
                self._inc = 1.0

    # --- admission and eviction
    def _make_room(self, need: int, optional: bool = False, far_p: Optional[float] = None) -> bool:
        """Evict until `need` bytes fit, lowest score first; `far_p`: for a far guess of
        that measured precision, only victims speculation.py's rule allows."""
        while self.used + need > self.capacity:
            victim = None
            for ent in self.entries.values():
                if (ent.pins == 0 and (victim is None or ent.score < victim.score)
                        and (far_p is None or self.far_victim_ok(ent, far_p))):
                    victim = ent
            if victim is None:
                if optional:
                    return False
                raise RuntimeError(f"expert cache: {need} bytes needed but all "
                                   f"{len(self.entries)} cached experts are pinned "
                                   f"(capacity {self.capacity}); the budget plan is wrong")
            self._evict(victim)
        return True

    def _evict(self, ent: _Entry) -> None:
        fut = ent.future
        if fut is not None:
            if fut.cancel():                    # never started: its drops still have to run
                self._to_drop.extend(ent.drops)
            else:
                try:
                    fut.result()                # a read in progress finishes first
                except Exception:
                    pass
        del self.entries[ent.key]
        self.used -= ent.nbytes
        self.evictions += 1
        if ent.spec:
            self.spec_wasted += 1
        if self.mode == "copy":
            if self.poison:                     # a stale view would now compute NaN
                self._frames[ent.frame].fill(0xFF)
            self._free.append(ent.frame)
        else:
            # The pages are dropped by the next load job, on its I/O thread, before it reads
            # anything: the engine's thread does not wait for it, and what is resident never
            # exceeds what the cache has accounted for.
            self._to_drop.append(ent.ex)

    def _flush_drops(self) -> None:
        if self._to_drop:
            drops, self._to_drop = self._to_drop, []
            fut = self._pool.submit(0, self._load_mapped, None, drops)
            for d in drops:
                self._dropping[(d.layer, d.index)] = fut

    def _admit(self, key, ex, prio: int) -> _Entry:
        f = ex.file
        if self.mode == "copy":
            ent = _Entry(key, self.frame_bytes, ex, self.forwards)
            self._make_room(ent.nbytes)
            ent.frame = self._free.pop()
            ent.future = self._pool.submit(prio, self._load_frame, ex, ent.frame)
        else:
            ent = _Entry(key, f.size, ex, self.forwards)
            self._make_room(ent.nbytes)
            prev = self._dropping.pop(key, None)
            if prev is not None and not prev.done():
                try:
                    prev.result()                # its old pages are being dropped: let it
                except Exception:
                    pass
            ent.drops, self._to_drop = self._to_drop, []
            ent.future = self._pool.submit(prio, self._load_mapped, ex, ent.drops)
            for d in ent.drops:
                self._dropping[(d.layer, d.index)] = ent.future
            if len(self._dropping) > 4 * len(self.entries) + 64:
                self._dropping = {k: v for k, v in self._dropping.items() if not v.done()}
        self.entries[key] = ent
        self.used += ent.nbytes
        self.peak_used = max(self.peak_used, self.used)
        self.loads += 1
        self.loaded_bytes += ent.nbytes
        self._touch(ent)
        return ent

    def _load_mapped(self, ex, drops=()):          # on an I/O thread
        for d in drops:
            self._drop_mapped(d)
        if ex is None:
            return None
        f = ex.file
        populate(f)
        return ex

    def _load_frame(self, ex, frame: int):            # on an I/O thread
        a, b = self._span[id(ex)]
        buf = self._frames[frame]
        read_into(ex.file.path, memoryview(buf[:b - a]), a, self.direct)
        ffn = expert_ffn(ex.file, self.cfg.hidden_size, self.cfg.expert_intermediate, buf, a)
        return CopyInExpert(ex, ffn, int(buf.ctypes.data), ex.file.size)

    def _ready(self, ent: _Entry):
        fut = ent.future
        if fut is not None and fut.done():
            ent.obj = fut.result()                  # raises a load's error
            ent.future = None
        return ent.obj if ent.future is None else Pending(ent.future, self)

    # --- the model's interface
    def waves(self, used):
        """The routed experts of one layer, in groups that fit the cache together (one group
        unless a prefill routes to more experts than the budget holds)."""
        w = max(1, self.capacity // max(1, self.plan.expert_bytes if self.mode != "copy"
                                        else self.frame_bytes))
        if len(used) <= w:
            return (used,)
        return tuple(used[i:i + w] for i in range(0, len(used), w))

    def acquire(self, layer: int, used, experts):
        run = {}
        pinned = []
        with self._lock:
            try:
                guess = self._spec_pending.pop(layer, None)
                if guess is not None or layer in self._spec_far:
                    self._score_guess(layer, guess, used)
                misses = []
                for e in used:
                    ex = experts[e]
                    if ex.file is None:            # hot-plugged: outside the budget
                        run[e] = ex
                        continue
                    key = (layer, int(e))
                    ent = self.entries.get(key)
                    if ent is None:
                        misses.append((e, key, ex))
                        continue
                    ent.pins += 1
                    pinned.append(ent)
                    self._touch(ent)
                    ent.uses += 1
                    self.hits += 1
                    if ent.spec:
                        ent.spec = False
                        self.spec_used += 1
                    run[e] = self._ready(ent)
                for e, key, ex in misses:          # hits are pinned: never evicted here
                    ent = self._admit(key, ex, 0)
                    ent.pins = 1
                    pinned.append(ent)
                    self.misses += 1
                    run[e] = Pending(ent.future, self)
                self._flush_drops()
            except BaseException:
                for ent in pinned:
                    ent.pins -= 1
                raise
        return run

    def release(self, layer: int, used) -> None:
        with self._lock:
            for e in used:
                ent = self.entries.get((layer, int(e)))
                if ent is not None and ent.pins > 0:
                    ent.pins -= 1

    # --- reporting
    def report(self, page_cache: bool = True) -> dict:
        r = super().report(page_cache)
        p = self.plan
        hm = self.hits + self.misses
        mem = proc_memory()
        r.update({
            "budget": p.budget, "plan": p.as_dict(), "mode": self.mode,
            "policy": "lru" if self.lru else "lfu", "capacity": self.capacity,
            "expert_cache_bytes": self.used, "expert_cache_peak": self.peak_used,
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hits / hm if hm else None,
            "loads": self.loads, "loaded_bytes": self.loaded_bytes, "evictions": self.evictions,
            "stall_s": self.stall_s, "forwards": self.forwards, "tokens": self.tokens,
            "embed_rows_held": len(self._embed_rows) if self._embed_rows is not None else None,
            "embed_drops": self.embed_drops,
            "anon_growth": mem.get("RssAnon", 0) - self._mem0.get("RssAnon", 0),
        })
        if self.speculative:
            r["speculation"] = self.speculation_report()
        if self.mode == "copy":
            r.update({"frames": self.n_frames, "frame_bytes": self.frame_bytes, "o_direct": self.direct})
        return r

    def close(self) -> None:
        with self._lock:
            for ent in list(self.entries.values()):
                if ent.future is not None and not ent.future.cancel():
                    try:
                        ent.future.result()
                    except Exception:
                        pass
        self._pool.close()


# ----------------------------------------------------------------------------- choice

def make_residency(weights: ModelWeights, engine: EngineConfig, advice: Optional[int]) -> Residency:
    """The engine's residency: the free default (residency.Residency), or under
    max_resident_mb this module's budgeted expert cache -- unless the budget holds the
    whole model: then nothing is ever evicted, and the default's path (its preload into
    2 MB folios, one C call per MoE layer, the model's files left in the page cache)
    runs under the plan's KV pool and prefill chunks (issue 30: a cache that only ever
    hits cost 1.2-1.3x plain per token)."""
    plan = embed = main = None
    if engine.max_resident_mb is not None:
        main = next((f for f in weights.files if f.path.name == "model.bin"), None)
        embed = layout_of(main.sections) if main is not None else None
        plan = plan_budget(weights.cfg, engine, model_file_sizes(weights.path, weights.cfg), embed)
        if not plan.holds_whole_model:
            return BudgetResidency(weights, engine, plan, embed, main)
    res = Residency(weights, advice, plan)
    if engine.preload != "none" and engine.load_mode == "mmap":
        res.preload(MADV_POPULATE_READ if engine.preload == "populate" else MADV_WILLNEED)
    return res
