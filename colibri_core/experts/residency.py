"""Resident memory under a hard budget: `EngineConfig.max_resident_mb` and the expert cache.

What the budget counts (MiB = 2**20 bytes): everything of the model that occupies memory.

- **Non-expert weights**: model.bin and routing.bin (attention, norms, dense FFNs, shared
  experts, lm_head, routers), at their full file size. Mapped, they live in the page cache
  and in RSS once; copied in, in private memory.
- **The embedding** (mapped, not tied to lm_head): by the rows a forward can touch, not its
  size -- `kv_pool_tokens` rows, each the pages its parts span (`EmbeddingLayout`). The
  expert cache maps model.bin with MADV_RANDOM (a fault reads its page, not a read-around
  window of read_ahead_kb into the embedding), reads the other sections with
  MADV_WILLNEED at start, and drops the embedding's pages (MADV_DONTNEED, then
  POSIX_FADV_DONTNEED) before a forward whose ids would take the distinct rows since the
  last drop past that many. Copied in, or tied (lm_head reads every row per token), it
  counts at its full size.
- **KV cache**: the engine's KV pool (kvcache.KVPool): `kv_pool_tokens` positions (default
  under a budget: one sequence at the full context) in the pool's storage type `kv_dtype` (f16 halves
  the f32 bytes, q8 about quarters them); a batch asking for more is refused.
- **Activations** of one forward of `chunk_tokens` tokens (an estimate with headroom); a
  longer prompt is prefilled in chunks of that many tokens.
- **Routed experts**: what the expert cache holds. With mmap a *file-backed* page counts
  whether it is mapped (RSS) or only in the page cache: `MADV_DONTNEED` on a file mapping
  lowers RSS but leaves the page cached, so eviction is `MADV_DONTNEED` on the range and
  then `posix_fadvise(POSIX_FADV_DONTNEED)` on the file (a fresh descriptor: ContainerFile
  closes its own after mapping). In copy-in mode the cache is a fixed pool of frames
  (preallocated, filled with `os.preadv`, O_DIRECT where the file system allows, so the
  page cache is not filled on the side).

Not counted: the interpreter, numpy and the kernels' code and heap before the engine
(the "fixed overhead"), and hot-plugged experts (their INT4 bytes are reported as outside
the budget). `EngineConfig.process_limit_mb` covers the overhead too: the engine measures
it at start (`process_overhead_bytes`: VmRSS when the engine is created, plus a reserve
for the engine's own objects) and runs with max_resident_mb = limit - overhead
(`derive_budget`), refusing a limit below overhead + the model's minimum.

The cache: an entry per (layer, expert), capacity in bytes. `acquire(layer, experts)` pins
the routed experts of one layer (hits), starts the loads of the others on I/O threads
(misses, evicting unpinned entries first: LRU, or LFU with exponential aging) and returns
objects whose weight views are valid until `release`. The model computes expert i while
experts i+1.. load; a pinned entry is never evicted. When a layer's experts do not all fit
(prefill), the model runs them in waves (`waves`). Optional speculation applies the next
MoE layer's router to the hidden state after this layer and loads its guesses early.

The default (no budget) is `Residency`: the madvise prefetch of EngineConfig.prefetch and
nothing else, one tuple and two method calls per MoE layer. A budget that holds the whole
model (`BudgetPlan.holds_whole_model`: every file, the embedding at its full size) runs it
too, under the plan's KV pool and prefill chunks: nothing would ever be evicted. This module plans the budget
and holds `Residency`; the cache itself (`BudgetResidency`) and the choice between the two
(`make_residency`) are in expertcache.py.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import EngineConfig, ModelConfig, load_model_config
from ..errors import ConfigError
from ..memstat import (MADV_DONTNEED, MADV_POPULATE_READ, MADV_WILLNEED, PAGE, available_bytes,
                       file_pmd_mapped, madvise)
from ..format.modelfile import HUGE_PAGE, MADV_HUGEPAGE, expert_file_name
from ..model.weights import ModelWeights
from ..model.kvcache import kv_bytes_per_position, kv_pool_tokens, model_bytes  # noqa: F401 (re-exported)

log = logging.getLogger("colibri")

MiB = 1 << 20

from ..memstat import (resident_bytes, file_cache_bytes, drop_file_cache, proc_read_bytes,
                       proc_memory)  # noqa: E402,F401 (re-exported)

# ----------------------------------------------------------------------------- the plan

def preload_files(files, available: Optional[int] = None) -> list:
    """The files a preload reads: the longest prefix of `files` (model.bin, routing.bin,
    then the experts layer by layer) that fits in the memory available less an eighth
    (at least 512 MiB): a model larger than memory is not read only to evict itself."""
    avail = available_bytes() if available is None else available
    if avail is None:
        return list(files)
    room, out = avail - max(512 * MiB, avail // 8), []
    for f in files:
        room -= f.size
        if room < 0:
            break
        out.append(f)
    return out


@dataclass(frozen=True)
class EmbeddingLayout:
    """The embedding section of model.bin: its parts' byte ranges in the file and the most
    pages one row can span (a row of a part at an offset inside a page may cross into the
    next one)."""
    parts: tuple[tuple[int, int], ...]     # (file offset, nbytes) per part
    row_pages: int                         # pages one row touches at most, all parts

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.parts)


def _row_pages(row_bytes: int) -> int:
    """Pages a row of `row_bytes` spans at most, rows packed from a page boundary."""
    if row_bytes <= 0:
        return 0
    if PAGE % row_bytes == 0 or row_bytes % PAGE == 0:
        return -(-row_bytes // PAGE)
    return row_bytes // PAGE + 2


def layout_of(sections: dict) -> Optional[EmbeddingLayout]:
    """The embedding's layout from model.bin's sections (ContainerFile.sections)."""
    s = sections.get("embed")
    if s is None or not s.shape:
        return None
    rows = s.shape[0]
    parts = tuple(s.parts.values())
    return EmbeddingLayout(parts, sum(_row_pages(n // rows) for _, n in parts))


def embedding_layout(model_dir) -> Optional[EmbeddingLayout]:
    """The embedding's layout from model.bin's section table (the header alone is read),
    or None (no model.bin, no embed section)."""
    from ..format.modelfile import ContainerFile
    path = Path(model_dir) / "model.bin"
    if not path.is_file():
        return None
    f = ContainerFile(path, "header")
    try:
        return layout_of(f.sections)
    finally:
        f.close()


def activation_bytes(cfg: ModelConfig, tokens: int, context: int) -> int:
    """Upper estimate of the temporaries of one forward over `tokens` tokens attending to
    `context` positions: the [T, H] residual stream and its copies, q/k/v, the expert's
    [T, I] gate/up, the router logits, the attention scores of one layer (with the mask and
    exp copies), MLA's decompressed keys and values, one row of logits."""
    H, NH, D = cfg.hidden_size, cfg.num_heads, cfg.head_size
    inter = max(cfg.intermediate_size if "dense" in cfg.layer_types else 0,
                cfg.expert_intermediate if cfg.moe_layers else 0,
                cfg.shared_expert_intermediate_size)
    E = max(cfg.num_experts, 1)
    per_token = 4 * (24 * H + 4 * NH * D + 6 * inter + 4 * E)
    scores = 4 * 4 * NH * tokens * context
    mla = 4 * 2 * context * NH * D if cfg.attention == "mla" else 0
    return tokens * per_token + scores + mla + 8 * cfg.vocab_size + MiB


@dataclass(frozen=True)
class BudgetPlan:
    """How a budget is split (bytes). `capacity` is what the expert cache may hold."""
    budget: int
    dense: int             # model.bin + routing.bin
    kv: int                # KV cache reserve
    kv_tokens: int
    act: int               # activations of one chunk
    chunk_tokens: int      # tokens per forward (prefill chunk)
    expert_bytes: int      # one routed expert (its file)
    top_k: int
    capacity: int          # expert cache
    minimum: int           # the smallest budget that runs this model
    n_experts: int = 0     # routed experts in the model (all MoE layers)
    experts_total: int = 0  # their files' bytes together
    embed_total: int = 0   # the embedding's bytes in model.bin
    embed_reserve: int = 0  # what `dense` counts for it (< embed_total: counted by rows)
    embed_rows: int = 0    # distinct rows held before its pages are dropped (0: all)
    overhead: int = 0      # process_limit_mb: the fixed overhead measured at start
    process_limit: int = 0  # process_limit_mb in bytes (0: not set)

    @property
    def capacity_experts(self) -> int:
        return self.capacity // self.expert_bytes if self.expert_bytes else 0

    @property
    def holds_whole_model(self) -> bool:
        """Every file fits: the expert cache takes every expert file and the embedding
        fits at its full size (what `dense` does not count of it comes out of the cache)."""
        return self.capacity - (self.embed_total - self.embed_reserve) >= self.experts_total

    def as_dict(self) -> dict:
        return asdict(self)


def model_file_sizes(path: Path, cfg: ModelConfig) -> dict[str, int]:
    if cfg.files:
        return {n: i.size for n, i in cfg.files.items()}
    return {p.name: p.stat().st_size for p in Path(path).glob("*.bin")}


def embed_by_rows(cfg: ModelConfig, engine: EngineConfig,
                  embed: Optional[EmbeddingLayout]) -> bool:
    """Whether the budget counts the embedding by rows (mapped, untied, layout known)."""
    return (embed is not None and engine.load_mode == "mmap" and not cfg.tie_word_embeddings
            and embed.row_pages > 0)


def plan_budget(cfg: ModelConfig, engine: EngineConfig, sizes: dict[str, int],
                embed: Optional[EmbeddingLayout] = None) -> BudgetPlan:
    """Split engine.max_resident_mb between the model's parts, or refuse it (ConfigError,
    one line, with the minimum that would work). `embed`: the embedding's layout
    (embedding_layout), to count it by rows; without it, at its size in model.bin."""
    budget = int(engine.max_resident_mb * MiB)
    expert_names = {expert_file_name(L, e) for L in cfg.moe_layers for e in range(cfg.num_experts)}
    dense = sum(n for name, n in sizes.items() if name.endswith(".bin") and name not in expert_names)
    expert_bytes = max((sizes.get(n, 0) for n in expert_names), default=0)
    kv_tokens = kv_pool_tokens(cfg, engine)
    # a sequence attends to at most the pool's positions: its cache comes from the pool
    ctx = min(cfg.max_position_embeddings, kv_tokens)
    # with the prefix cache's cap: kept rows (runtime/prefixcache.py)
    kv = kv_tokens * kv_bytes_per_position(cfg, engine.kv_dtype) + int(engine.prefix_cache_mb * MiB)
    embed_total = embed.nbytes if embed is not None else 0
    embed_reserve, embed_rows = embed_total, 0
    if embed_by_rows(cfg, engine, embed) and kv_tokens * embed.row_pages * PAGE < embed_total:
        embed_rows = kv_tokens
        embed_reserve = kv_tokens * embed.row_pages * PAGE
        dense += embed_reserve - embed_total
    act1 = activation_bytes(cfg, 1, ctx)
    k = cfg.top_k if cfg.moe_layers else 0
    minimum = dense + kv + act1 + k * expert_bytes
    if budget < minimum:
        need = math.ceil(minimum / MiB * 10) / 10
        raise ConfigError(
            f"max_resident_mb={engine.max_resident_mb:g} is too small for this model: it needs "
            f"at least {need:.1f} MB (non-expert weights {dense / MiB:.1f} MB + KV cache "
            f"{kv / MiB:.1f} MB for {kv_tokens} positions"
            f"{' and the prefix cache' if engine.prefix_cache_mb else ''} + activations {act1 / MiB:.1f} MB "
            f"+ {k} routed expert(s) x {expert_bytes / MiB:.2f} MB); set max_resident_mb "
            f">= {need:.1f}")
    # Activations take at most a fifth of what is left over the minimum: the rest caches
    # experts. Chunk = the most tokens whose activations fit that share (>= 1).
    share = (budget - minimum) // 5
    chunk = 1
    while chunk < ctx and activation_bytes(cfg, min(2 * chunk, ctx), ctx) - act1 <= share:
        chunk = min(2 * chunk, ctx)
    act = activation_bytes(cfg, chunk, ctx)
    capacity = budget - dense - kv - act if cfg.moe_layers else 0
    limit = int((engine.process_limit_mb or 0) * MiB)     # derive_budget: budget = limit - overhead
    return BudgetPlan(budget, dense, kv, kv_tokens, act, chunk, expert_bytes, k, capacity, minimum,
                      n_experts=len(expert_names),
                      experts_total=sum(sizes.get(n, 0) for n in expert_names),
                      embed_total=embed_total, embed_reserve=embed_reserve,
                      embed_rows=embed_rows, overhead=max(0, limit - budget) if limit else 0,
                      process_limit=limit)


def check_budget(model_dir, engine: EngineConfig) -> Optional[BudgetPlan]:
    """The plan for a model directory (from config.json and model.bin's section table:
    no weights are read), or None without a budget. Raises ConfigError for a budget too
    small to run at all."""
    if engine.max_resident_mb is None:
        return None
    cfg = load_model_config(Path(model_dir) / "config.json")
    return plan_budget(cfg, engine, model_file_sizes(Path(model_dir), cfg),
                       embedding_layout(model_dir))


# ----------------------------------------------------------------------------- a process limit

# The engine's own objects beyond what the plan counts (weight views, pipeline tables, I/O
# and compute threads, allocator slack): measured on the 64-expert benchmark model as
# 1-3 MB of RSS growth outside the plan (docs/BENCHMARKS.md, "An x86 host under a 256 MB
# limit"); reserved with headroom, plus a little per expert file.
ENGINE_RESERVE = 6 * MiB
ENGINE_RESERVE_PER_EXPERT = 16 << 10


def process_overhead_bytes(n_expert_files: int = 0) -> int:
    """The fixed overhead a process limit must cover besides the model: this process's
    RSS now (interpreter, numpy, the kernels, whatever the caller holds: VmRSS), plus
    ENGINE_RESERVE (+ ENGINE_RESERVE_PER_EXPERT per routed expert file)."""
    rss = proc_memory().get("VmRSS", 0)
    return rss + ENGINE_RESERVE + n_expert_files * ENGINE_RESERVE_PER_EXPERT


def derive_budget(model_dir, engine: EngineConfig,
                  overhead: Optional[int] = None) -> tuple[EngineConfig, BudgetPlan]:
    """engine.process_limit_mb -> (the engine config with max_resident_mb = limit - the
    fixed overhead, its plan). The overhead is measured now (process_overhead_bytes) unless
    given (bytes). Raises ConfigError, one line naming both figures, when the limit does
    not cover the overhead plus the smallest budget that runs the model."""
    cfg = load_model_config(Path(model_dir) / "config.json")
    sizes = model_file_sizes(Path(model_dir), cfg)
    if overhead is None:
        overhead = process_overhead_bytes(len(cfg.moe_layers) * cfg.num_experts)
    limit = engine.process_limit_mb
    embed = embedding_layout(model_dir)
    probe = engine.model_copy(update={"max_resident_mb": float(1 << 30), "process_limit_mb": None})
    minimum = plan_budget(cfg, probe, sizes, embed).minimum
    if limit * MiB < overhead + minimum:
        need = math.ceil((overhead + minimum) / MiB)
        raise ConfigError(
            f"process_limit_mb={limit} is too small for this model: the process's fixed "
            f"overhead is {overhead / MiB:.1f} MB (RSS at start + engine reserve) and the model "
            f"needs at least {minimum / MiB:.1f} MB under a budget; set process_limit_mb "
            f">= {need}")
    derived = engine.model_copy(update={"max_resident_mb": limit - overhead / MiB})
    return derived, plan_budget(cfg, derived, sizes, embed)


# ----------------------------------------------------------------------------- no budget

class Residency:
    """No budget, or a budget that holds the whole model (`plan`: its plan; nothing to
    evict, so nothing to count per step): the madvise prefetch of EngineConfig.prefetch
    (one call per routed expert, up front) and nothing else."""

    active = False
    speculative = False

    def __init__(self, weights: ModelWeights, advice: Optional[int],
                 plan: Optional[BudgetPlan] = None):
        self.weights = weights
        self._advice = advice
        self.plan = plan
        # under a budget: its prefill chunks (activations) and its expert cache's size
        self.chunk_tokens = plan.chunk_tokens if plan is not None else None
        self.capacity = plan.capacity if plan is not None else 0
        self._read0 = proc_read_bytes()
        # Files already advised: a repeated MADV_WILLNEED on a resident 4 MB expert costs
        # ~60 us (the kernel walks its page cache), 1 ms of a 10 ms decode step.
        self._advised: set = set()
        self._to_advise = {lw.index: sum(ex.file is not None for ex in lw.experts)
                           for lw in weights.layers}
        self._preloader: Optional[threading.Thread] = None
        self._stop_preload = threading.Event()
        self._first_step_done = threading.Event()   # the background preload waits for it
        self.reread_files = 0      # files re-read to get them in 2 MB folios (preload)
        self._preload: list = []   # the files preload() reads (preload_files)

    def waves(self, used):
        return (used,)

    def preload(self, advice: int) -> None:
        """Advise every file of the model at once (EngineConfig.preload): pages that are
        not in the page cache (a cold start, or pages the kernel evicted while the model
        sat unused -- this development machine's DAMON pages out page cache idle for a
        minute) are read before, not during, the first tokens that need them.

        The mappings get MADV_HUGEPAGE first (modelfile.py: pages not cached yet are
        read in 2 MB folios, mapped whole), and MADV_WILLNEED ("willneed") is done by a
        thread that faults the files in through their mappings instead
        (MADV_POPULATE_READ, one file after another): the kernel's WILLNEED readahead
        would fill the page cache in small folios. That thread starts its work once the
        first forward step is done (step_done): the first token faults in only what it
        reads, and shares the CPUs with no preload (on 2 CPUs, populating Qwen3-30B-A3B's
        6,146 files beside the first forward made that forward the largest part of a warm
        load). Not under a memory budget that does not hold the whole model: its faults
        must read no more than they need."""
        for f in self.weights.files:
            f.madvise(MADV_HUGEPAGE)
        self._preload = preload_files(self.weights.files)
        if len(self._preload) < len(self.weights.files):
            log.info("preload: %d of %d model files, the ones that fit in the memory "
                     "available", len(self._preload), len(self.weights.files))
        if advice == MADV_WILLNEED:
            self._preloader = threading.Thread(target=self._populate_files, daemon=True,
                                               name="colibri-preload")
            self._preloader.start()
        elif advice == MADV_POPULATE_READ:
            for f in self._preload:
                f.populate()
            self._reread_small_folios()
        else:
            for f in self._preload:
                f.madvise(advice)
        if self._advice is not None:      # the per-expert prefetch is done too (if read)
            read = {id(f) for f in self._preload}
            for lw in self.weights.layers:
                for ex in lw.experts:
                    if ex.file is not None and id(ex.file) in read:
                        self._advised.add(id(ex.file))
                        self._to_advise[lw.index] -= 1

    def all_prefetched(self, layer: int) -> bool:
        """True once every expert file of `layer` has had its madvise: acquire() has
        nothing left to do there (the pipeline then skips it)."""
        return self._advice is None or self._to_advise.get(layer, 0) <= 0

    def acquire(self, layer: int, used, experts):
        """-> an object indexed by expert slot giving what to run (here: `experts`)."""
        a = self._advice
        if a is not None:
            advised = self._advised
            for e in used:                         # one madvise per routed expert, up front
                if e < 0:
                    continue
                f = experts[e].file
                if f is not None and id(f) not in advised:
                    f.madvise(a)
                    advised.add(id(f))
                    self._to_advise[layer] = self._to_advise.get(layer, 0) - 1
        return experts

    def release(self, layer: int, used) -> None:
        pass

    def begin_forward(self, ntokens: int, caches) -> None:
        pass

    def speculate(self, after_layer: int, x: np.ndarray, es, k) -> None:
        pass

    def model_cache_bytes(self) -> dict:
        """Page-cache residency of the model's files (mincore): expert files, the rest."""
        experts = dense = 0
        for f in self.weights.files:
            if f.buf is not None and f._mm is not None:
                n = resident_bytes(f.base_address, f.size)
            else:
                n = file_cache_bytes(f.path)
            if f.path.name.startswith("expert_"):
                experts += n
            else:
                dense += n
        return {"expert_files": experts, "other_files": dense}

    def report(self, page_cache: bool = True) -> dict:
        """Memory and I/O figures (bytes). page_cache: also measure the model files'
        page-cache residency (one mincore per file)."""
        r = {"budget": None, **proc_memory()}
        p = self.plan
        if p is not None and not self.active:   # the whole model held: nothing loaded since
            r.update(budget=p.budget, plan=p.as_dict(), capacity=p.capacity, whole_model=True,
                     expert_cache_bytes=p.experts_total, expert_cache_peak=p.experts_total,
                     hits=0, misses=0, hit_rate=None, loads=0, loaded_bytes=0, evictions=0,
                     stall_s=0.0)
        rb = proc_read_bytes()
        r["read_bytes"] = None if rb is None or self._read0 is None else rb - self._read0
        if page_cache:
            r["page_cache"] = self.model_cache_bytes()
        return r

    def step_done(self) -> None:
        """A forward step has ended: the preload may start (idempotent, cheap)."""
        self._first_step_done.set()

    def _populate_files(self) -> None:
        self._first_step_done.wait()
        for f in self._preload:
            if self._stop_preload.is_set():
                return
            f.populate()   # an error (a file truncated under its mapping: EFAULT) is the
            #                kernels' to meet when they read it (mapguard.py)
        self._reread_small_folios()

    def _reread_small_folios(self) -> None:
        """Files the page cache already held in small folios (read by `cp`, a checksum, a
        conversion before write_container dropped its pages) stay mapped in 4 KB pages,
        whatever MADV_HUGEPAGE says: decode then walks a page table per 4 KB (about 6% of
        a token on the benchmark model). Such a file is dropped from the page cache and
        read again, in 2 MB folios. The first one re-read is the probe: if it still maps
        no 2 MB page (a file system without large folios, THP off, or another process
        holding the pages), the others are left as they are."""
        big = [f for f in self._preload if f.buf is not None and f.size >= 2 * HUGE_PAGE]
        if not big:
            return
        pmd = file_pmd_mapped()
        if not pmd:
            return
        small = [f for f in big if pmd.get(f.base_address, 0) * 2 < f.size // HUGE_PAGE * HUGE_PAGE]
        for i, f in enumerate(small):
            if self._stop_preload.is_set():
                return
            n = -(-f.size // PAGE) * PAGE
            madvise(f.base_address, n, MADV_DONTNEED)       # our page-table entries
            drop_file_cache(f.path)                         # then the cached small folios
            f.populate()
            self.reread_files += 1
            if i == 0 and file_pmd_mapped().get(f.base_address, 0) == 0:
                return

    def wait_preload(self) -> None:
        """Return once the background preload (if any) has read every file (starting it
        now if no step has run yet)."""
        self._first_step_done.set()
        if self._preloader is not None:
            self._preloader.join()

    def close(self) -> None:
        """Stop the preload between two files and wait for it: the files are unmapped
        next (engine.close)."""
        self._stop_preload.set()
        self.wait_preload()
