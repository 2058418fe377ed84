"""Resident memory under a hard budget: `EngineConfig.max_resident_mb` and the expert cache.

What the budget counts (MiB = 2**20 bytes): everything of the model that occupies memory.

- **Non-expert weights**: model.bin and routing.bin (embeddings, attention, norms, dense
  FFNs, shared experts, lm_head, routers), at their full file size. Mapped, they live in
  the page cache and in RSS once; copied in, in private memory.
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
(the "fixed overhead", measured by the benchmark), and hot-plugged experts (their INT4
bytes are reported as outside the budget).

The cache: an entry per (layer, expert), capacity in bytes. `acquire(layer, experts)` pins
the routed experts of one layer (hits), starts the loads of the others on I/O threads
(misses, evicting unpinned entries first: LRU, or LFU with exponential aging) and returns
objects whose weight views are valid until `release`. The model computes expert i while
experts i+1.. load; a pinned entry is never evicted. When a layer's experts do not all fit
(prefill), the model runs them in waves (`waves`). Optional speculation applies the next
MoE layer's router to the hidden state after this layer and loads its guesses early.

The default (no budget) is `Residency`: the madvise prefetch of EngineConfig.prefetch and
nothing else, one tuple and two method calls per MoE layer. This module plans the budget
and holds `Residency`; the cache itself (`BudgetResidency`) and the choice between the two
(`make_residency`) are in expertcache.py.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .config import EngineConfig, ModelConfig, load_model_config
from .errors import ConfigError
from .memstat import PAGE
from .modelfile import expert_file_name
from .weights import ModelWeights

log = logging.getLogger("colibri")

MiB = 1 << 20

# OS memory probes live in memstat.py; re-exported here for callers of this module.
from .memstat import resident_bytes, file_cache_bytes, drop_file_cache, proc_read_bytes, proc_memory  # noqa: E402,F401

# ----------------------------------------------------------------------------- the plan

def kv_bytes_per_position(cfg: ModelConfig, dtype: str = "f32") -> int:
    """KV-cache bytes of one position of one sequence, all layers (kvcache.KVCache in
    `dtype`: f32 4 bytes a value, f16 2, q8 1 plus a float32 scale per kv head; MLA's
    latent cache is float32 whatever the dtype)."""
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    row = {"f32": 4 * cfg.head_size, "f16": 2 * cfg.head_size, "q8": cfg.head_size + 4}[dtype]
    return 2 * cfg.num_layers * cfg.num_kv_heads * row


DEFAULT_POOL_TOKENS = 65536   # without a memory budget: positions shared by many requests


def kv_pool_tokens(cfg: ModelConfig, engine: EngineConfig) -> int:
    """The KV pool's capacity in positions: EngineConfig.kv_pool_tokens, else the older
    residency.kv_tokens; else under a memory budget one sequence at the model's full
    context (what the budget reserves), and without one 65,536 positions or the context
    if larger (the scheduler's concurrent requests share them; rows are allocated per
    sequence as it starts, so capacity alone costs no memory)."""
    got = engine.kv_pool_tokens or engine.residency.kv_tokens
    if got:
        return got
    if engine.max_resident_mb is not None:
        return cfg.max_position_embeddings
    return max(DEFAULT_POOL_TOKENS, cfg.max_position_embeddings)


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

    @property
    def capacity_experts(self) -> int:
        return self.capacity // self.expert_bytes if self.expert_bytes else 0

    def as_dict(self) -> dict:
        return asdict(self)


def model_file_sizes(path: Path, cfg: ModelConfig) -> dict[str, int]:
    if cfg.files:
        return {n: i.size for n, i in cfg.files.items()}
    return {p.name: p.stat().st_size for p in Path(path).glob("*.bin")}


def plan_budget(cfg: ModelConfig, engine: EngineConfig, sizes: dict[str, int]) -> BudgetPlan:
    """Split engine.max_resident_mb between the model's parts, or refuse it (ConfigError,
    one line, with the minimum that would work)."""
    budget = int(engine.max_resident_mb * MiB)
    expert_names = {expert_file_name(L, e) for L in cfg.moe_layers for e in range(cfg.num_experts)}
    dense = sum(n for name, n in sizes.items() if name.endswith(".bin") and name not in expert_names)
    expert_bytes = max((sizes.get(n, 0) for n in expert_names), default=0)
    ctx = cfg.max_position_embeddings
    kv_tokens = kv_pool_tokens(cfg, engine)
    kv = kv_tokens * kv_bytes_per_position(cfg, engine.kv_dtype)
    act1 = activation_bytes(cfg, 1, ctx)
    k = cfg.top_k if cfg.moe_layers else 0
    minimum = dense + kv + act1 + k * expert_bytes
    if budget < minimum:
        need = math.ceil(minimum / MiB * 10) / 10
        raise ConfigError(
            f"max_resident_mb={engine.max_resident_mb:g} is too small for this model: it needs "
            f"at least {need:.1f} MB (non-expert weights {dense / MiB:.1f} MB + KV cache "
            f"{kv / MiB:.1f} MB for {kv_tokens} positions + activations {act1 / MiB:.1f} MB "
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
    return BudgetPlan(budget, dense, kv, kv_tokens, act, chunk, expert_bytes, k, capacity, minimum,
                      n_experts=len(expert_names),
                      experts_total=sum(sizes.get(n, 0) for n in expert_names))


def check_budget(model_dir, engine: EngineConfig) -> Optional[BudgetPlan]:
    """The plan for a model directory (from config.json alone: nothing is loaded), or None
    without a budget. Raises ConfigError for a budget too small to run at all."""
    if engine.max_resident_mb is None:
        return None
    cfg = load_model_config(Path(model_dir) / "config.json")
    return plan_budget(cfg, engine, model_file_sizes(Path(model_dir), cfg))


# ----------------------------------------------------------------------------- no budget

class Residency:
    """No budget: the madvise prefetch of EngineConfig.prefetch (one call per routed
    expert, up front) and nothing else."""

    active = False
    speculative = False
    chunk_tokens: Optional[int] = None
    plan: Optional[BudgetPlan] = None

    def __init__(self, weights: ModelWeights, advice: Optional[int]):
        self.weights = weights
        self._advice = advice
        self._read0 = proc_read_bytes()
        # Files already advised. Without a budget nothing evicts them on purpose, and a
        # repeated MADV_WILLNEED on a resident 4 MB expert still costs ~60 us (the kernel
        # walks its page cache): measured as 1 ms of a 10 ms decode step.
        self._advised: set = set()
        self._to_advise = {lw.index: sum(ex.file is not None for ex in lw.experts)
                           for lw in weights.layers}

    def waves(self, used):
        return (used,)

    def preload(self, advice: int) -> None:
        """Advise every file of the model at once (EngineConfig.preload): pages that are
        not in the page cache (a cold start, or pages the kernel evicted while the model
        sat unused -- this development machine's DAMON pages out page cache idle for a
        minute) are read before, not during, the first tokens that need them."""
        for f in self.weights.files:
            f.madvise(advice)
        if self._advice is not None:                 # the per-expert prefetch is done too
            for lw in self.weights.layers:
                for ex in lw.experts:
                    if ex.file is not None:
                        self._advised.add(id(ex.file))
                self._to_advise[lw.index] = 0

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
        rb = proc_read_bytes()
        r["read_bytes"] = None if rb is None or self._read0 is None else rb - self._read0
        if page_cache:
            r["page_cache"] = self.model_cache_bytes()
        return r

    def close(self) -> None:
        pass
