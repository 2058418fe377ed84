"""The model at run time: token ids of a batch of sequences in, logits out. No I/O, no
sampling.

`Model.forward` checks a call's arguments (the one place: token ids, k, cache room) and
hands the batch to the one pipeline (pipeline.py), flattened into n tokens of m
sequences, each with its own positions and KV cache, so every weight matrix is read once
per layer for the whole batch. `decode_step` is the same pipeline for one token of one
sequence, with nothing copied.

Shape legend: T tokens in the batch, H hidden, V vocab.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

from ..model import kvcache
from ..config import EngineConfig
from ..errors import RequestError
from ..experts.expertcache import make_residency
from ..experts.expertset import ExpertSet
from ..model.kvcache import KVCache
from ..kernels.mapguard import FileCheck
from ..memstat import MADV_POPULATE_READ, MADV_WILLNEED
from .pipeline import Pipeline
from .reference import ReferenceModel
from ..model.routing import LayerTrace
from ..model.weights import ModelWeights

log = logging.getLogger("colibri")

check_memory = kvcache.check_memory


class Model:
    def __init__(self, weights: ModelWeights, engine: EngineConfig = EngineConfig(), hooks=None):
        self.w = weights
        self.cfg = weights.cfg
        self.engine = engine
        self.hooks = hooks                   # plugins.HookRelay or None
        self.act = engine.activations
        prefetch = {"none": None, "willneed": MADV_WILLNEED,
                    "populate": MADV_POPULATE_READ}[engine.prefetch]
        # What stays resident: the madvise prefetch alone, or the memory budget's expert
        # cache (expertcache.py); the pipeline acquires a layer's routed experts through it.
        # A model file truncated while mapped (mapguard.py): checked before and after each
        # step, one integer read each; raises ModelFileDamaged.
        self.file_check = FileCheck(weights.files)
        self.residency = make_residency(weights, engine, prefetch)
        # The current expert set (the engine swaps it between tokens for hot-plugging).
        self.expert_set = ExpertSet.from_weights(weights)
        self.pipeline = Pipeline(self)
        # The audit log's routing recorder (audit.RouteSink), called after every forward
        # while the log is on; None (one test per forward) while it is off.
        self.route_sink = None
        # Candidates (experts/candidates.py): the sets whose pipeline tables stay built
        # while no sequence runs with them, and the shadow's routing tap (called in each
        # MoE layer it lists with the layer's input rows and router logits; then done())
        self.kept_sets: tuple = ()
        self.moe_tap = None

    @property
    def ref(self) -> ReferenceModel:
        """The numpy reference model of these weights (reference.py), made on first use:
        the tests' reference, never the runtime path."""
        got = self.__dict__.get("_ref")
        if got is None:
            got = self._ref = ReferenceModel(self.w, self.engine)
        return got

    @property
    def last_routing(self) -> list[LayerTrace]:
        """What the router did in each MoE layer of the last step (copies)."""
        return self.pipeline.routing_trace()

    # ------------------------------------------------------------------ caches
    def cache_bytes(self, capacity: int, dtype: Optional[str] = None) -> int:
        """What new_cache(capacity, dtype) allocates (keys and values, every layer)."""
        return kvcache.cache_bytes(self.cfg, capacity, dtype or self.engine.kv_dtype)

    def new_cache(self, capacity: int, dtype: Optional[str] = None) -> KVCache:
        """An unpooled cache (tests, tools; the engine takes its caches from its KVPool),
        stored as `dtype` (default EngineConfig.kv_dtype)."""
        return kvcache.new_cache(self.cfg, capacity, dtype or self.engine.kv_dtype)

    # ------------------------------------------------------------------ expert sets
    def prepare_tables(self, es: ExpertSet):
        """The pipeline's tables for expert set `es`, built on another thread than the
        one stepping (the hot-plug worker builds the next set's while tokens run);
        adopt_tables() installs them."""
        return self.pipeline.prepare(es)

    def adopt_tables(self, es: ExpertSet, tables):
        """Install tables made by prepare_tables(es) (between two steps); returns the ones
        they replace (None if none), for the caller to free elsewhere."""
        return self.pipeline.adopt(es, tables)

    def drop_tables(self) -> None:
        """Forget the pipeline's expert-set tables (they point into the mapped weights;
        rebuilt on the next step)."""
        self.pipeline.drop()

    def close(self) -> None:
        """Drop every reference into the mapped weights (before they are unmapped)."""
        self.pipeline.close()
        self.expert_set = None
        if self.__dict__.get("_ref") is not None:
            self._ref.expert_set = None

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: Sequence[np.ndarray], caches: Sequence[KVCache],
                ks: Sequence[int] | None = None, all_logits: bool | Sequence[bool] = False,
                expert_set: Optional[ExpertSet] | Sequence[ExpertSet] = None) -> list[np.ndarray]:
        """Run a batch: tokens[i] (int ids) continue sequence i whose KV cache is caches[i].

        ks[i] is the top-k for sequence i (default: the model's). Returns per sequence the
        logits [V] of its last token, or [n_i, V] for all its tokens when all_logits (one
        bool for the batch, or one per sequence: a speculative decode's verification
        beside prompt chunks). `expert_set` pins a snapshot (default: the current one), or
        one per sequence: sequences of several sets in one pass (forward/mixedsets.py),
        or one pass per set where they cannot mix (plugins that see the routing, a memory
        budget); either way each sequence's logits are those it gets alone.
        """
        cfg = self.cfg
        es = expert_set or self.expert_set
        if len(tokens) != len(caches):
            raise RequestError(f"{len(tokens)} token lists but {len(caches)} caches")
        if isinstance(es, (list, tuple)):
            if len(es) != len(tokens):
                raise RequestError(f"{len(tokens)} token lists but {len(es)} expert sets")
            distinct = list({id(e): e for e in es}.values())
            if len(distinct) == 1:
                es = distinct[0]
            elif not self.pipeline.mixable(distinct):
                return self._forward_per_set(tokens, caches, ks, all_logits, es)
            else:
                es = list(es)
        if len({id(c) for c in caches}) != len(caches):
            raise RequestError("the same KV cache appears twice in one batch")
        ks = list(ks) if ks is not None else [cfg.top_k] * len(tokens)
        if not isinstance(all_logits, bool):
            all_logits = [bool(a) for a in all_logits]
            if len(all_logits) != len(tokens):
                raise RequestError(f"{len(tokens)} token lists but {len(all_logits)} "
                                   f"all_logits flags")
        toks = []
        for t, cache, k in zip(tokens, caches, ks):
            t = np.asarray(t, dtype=np.int64).reshape(-1)
            if len(t) == 0:
                raise RequestError("empty token list in batch")
            if cache.k is None:
                cache.check_usable()
            if cache.length + len(t) > cache.capacity:
                raise RequestError(f"sequence needs {cache.length + len(t)} positions, its "
                                   f"cache holds {cache.capacity}")
            self._check_k(k)
            bad = (t < 0) | (t >= cfg.vocab_size)
            if bad.any():
                raise RequestError(f"token id {int(t[bad][0])} out of range 0..{cfg.vocab_size - 1}")
            toks.append(t)
        chunk = self.residency.chunk_tokens
        if chunk is not None and sum(len(t) for t in toks) > chunk:
            return self._forward_chunked(toks, caches, ks, all_logits, es, chunk)
        return self._run(toks, caches, ks, all_logits, es)

    def _forward_per_set(self, tokens, caches, ks, all_logits, sets) -> list:
        """forward() once per expert set among `sets` (one per sequence), in order of
        first appearance; the results in the sequences' order."""
        groups: dict = {}
        for i, e in enumerate(sets):
            groups.setdefault(id(e), (e, []))[1].append(i)
        every = [all_logits] * len(tokens) if isinstance(all_logits, bool) else list(all_logits)
        ks = list(ks) if ks is not None else [self.cfg.top_k] * len(tokens)
        outs: list = [None] * len(tokens)
        for e, idx in groups.values():
            got = self.forward([tokens[i] for i in idx], [caches[i] for i in idx],
                               [ks[i] for i in idx], [every[i] for i in idx], expert_set=e)
            for i, o in zip(idx, got):
                outs[i] = o
        return outs

    def _check_k(self, k: int) -> None:
        cfg = self.cfg
        if cfg.moe_layers and not 1 <= k <= min(cfg.num_experts, 256):
            raise RequestError(f"top_k={k} out of range 1..{min(cfg.num_experts, 256)}")

    def _run(self, toks: list, caches, ks, all_logits, es, reuse: bool = False) -> list:
        spans, t = [], 0
        for tk, cache in zip(toks, caches):
            spans.append((t, t + len(tk), cache))
            t += len(tk)
        ids = toks[0] if len(toks) == 1 else np.concatenate(toks)
        kt = np.repeat(np.asarray(ks, np.int32), [len(tk) for tk in toks]) if len(toks) > 1 \
            else int(ks[0])
        self.file_check.check()                  # a damaged model computes nothing more
        out = self.pipeline.run(ids, spans, kt, es, all_logits, reuse)
        self.residency.step_done()               # the preload waits for the first step
        self.file_check.check()                  # a fault during this step: not a result
        if self.route_sink is not None:
            self.route_sink(spans)
        if self.moe_tap is not None:
            self.moe_tap.done(spans)
        return out

    def forward_from(self, layer: int, xs: Sequence[np.ndarray], caches, ks, es) -> list:
        """Layers layer.. only, of new sequences from their residual-stream input at that
        layer (xs[i] [n_i, H], kept by a live pass: experts/candidates.py's tap): all their
        logits, the bits the whole pass under `es` gives where the layers before `layer`
        compute the same under both sets (a candidate's shadow pass). Their caches hold
        K/V of layers layer.. only."""
        spans, t = [], 0
        for x, cache in zip(xs, caches):
            if cache.length + len(x) > cache.capacity:
                raise RequestError(f"sequence needs {cache.length + len(x)} positions, its "
                                   f"cache holds {cache.capacity}")
            spans.append((t, t + len(x), cache))
            t += len(x)
        for k in ks:
            self._check_k(k)
        kt = np.repeat(np.asarray(ks, np.int32), [len(x) for x in xs])
        self.file_check.check()
        out = self.pipeline.run(np.zeros(t, np.int64), spans, kt, es, True, start=layer,
                                x_in=np.concatenate(xs).astype(np.float32, copy=False))
        self.residency.step_done()
        self.file_check.check()
        if self.route_sink is not None:
            self.route_sink(spans)
        return out

    def decode_step(self, token: int, cache, k: int, expert_set: Optional[ExpertSet] = None) -> np.ndarray:
        """Logits [V] of one new token of one sequence: a buffer the next step overwrites
        (copy it to keep it)."""
        cfg = self.cfg
        if not 0 <= token < cfg.vocab_size:
            raise RequestError(f"token id {token} out of range 0..{cfg.vocab_size - 1}")
        if cache.k is None:
            cache.check_usable()
        if cache.length + 1 > cache.capacity:
            raise RequestError(f"sequence needs {cache.length + 1} positions, its cache "
                               f"holds {cache.capacity}")
        self._check_k(k)
        return self._run([np.array([token], np.int64)], [cache], [k], False,
                         expert_set or self.expert_set, reuse=True)[0]

    def _forward_chunked(self, toks: list, caches, ks, all_logits, es, chunk: int) -> list:
        """forward() in pieces of at most `chunk` tokens (the memory budget's activation
        share): a sequence's tokens go in order, each piece continuing its KV cache."""
        batches, cur, seen, n = [], [], set(), 0
        for i, t in enumerate(toks):
            for s in range(0, max(len(t), 1), chunk):
                piece = t[s:s + chunk]
                if cur and (n + len(piece) > chunk or i in seen):
                    batches.append(cur)
                    cur, seen, n = [], set(), 0
                cur.append((i, piece))
                seen.add(i)
                n += len(piece)
        batches.append(cur)
        every = [all_logits] * len(toks) if isinstance(all_logits, bool) else all_logits
        outs: list[list] = [[] for _ in toks]
        for b in batches:
            got = self._run([p for _, p in b], [caches[i] for i, _ in b], [ks[i] for i, _ in b],
                            [every[i] for i, _ in b],
                            [es[i] for i, _ in b] if isinstance(es, list) else es)
            for (i, _), o in zip(b, got):
                outs[i].append(o)
        return [np.concatenate(o, axis=0) if a else o[-1] for o, a in zip(outs, every)]
