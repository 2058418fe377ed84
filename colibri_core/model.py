"""The forward pass: token ids of a batch of sequences in, logits out. No I/O, no sampling.

One path serves a prompt's prefill, a decode step and the scoring of many short sequences:
the batch's tokens are flattened into one [T, H] activation matrix so every weight matrix
is read once per layer for the whole batch; only attention is per sequence, each with its
own positions and KV cache.

Shape legend: T tokens in the batch, H hidden, NH / NKV query / key-value heads, D head
dim, E experts, K experts per token, V vocab, S cached positions of one sequence.
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import numpy as np

from . import kernels, memstat, mla, ops
from .config import EngineConfig, ModelConfig
from .decode import DecodePlan, Unsupported
from .errors import ExpertError, InsufficientMemoryError, RequestError
from .expertcache import make_residency
from .expertset import ExpertSet
from .mapguard import FileCheck
from .memstat import MADV_POPULATE_READ, MADV_WILLNEED
from .quant import Q4Tensor, Q8Tensor
from .routing import LayerTrace, Routing, route
from .weights import FFNWeights, LayerWeights, ModelWeights

log = logging.getLogger("colibri")


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


class Model:
    def __init__(self, weights: ModelWeights, engine: EngineConfig = EngineConfig(), hooks=None):
        self.w = weights
        self.cfg = weights.cfg
        self.engine = engine
        self.hooks = hooks                   # plugins.HookRelay or None
        self.act = engine.activations
        self.routing_mode = engine.routing
        self._inv_freq, self._rope_factor = ops.rope_frequencies(self.cfg)   # [D/2], cos/sin factor
        self.observer = None                 # callable(weight, x) seeing every linear's input
                                             # (converter calibration); None in normal use
        self._prefetch = {"none": None, "willneed": MADV_WILLNEED,
                          "populate": MADV_POPULATE_READ}[engine.prefetch]
        self._last_routing: list[LayerTrace] = []
        self._fast_trace = None              # the DecodePlan whose last step is the latest
        # What stays resident: the madvise prefetch alone, or the memory budget's expert
        # cache (expertcache.py); Model._moe acquires a layer's routed experts through it.
        # A model file truncated while mapped (mapguard.py): checked before and after each
        # forward and decode step, one integer read each; raises ModelFileDamaged.
        self.file_check = FileCheck(weights.files)
        self.residency = make_residency(weights, engine, self._prefetch)
        # The current expert set (the engine swaps it between tokens for hot-plugging).
        self.expert_set = ExpertSet.from_weights(weights)
        self._warned: set = set()
        self._plans: dict = {}               # expert set version -> DecodePlan | reason (one)

    @property
    def last_routing(self) -> list[LayerTrace]:
        """What the router did in each MoE layer of the last forward or decode step."""
        if self._fast_trace is not None:               # built on demand: no per-token cost
            self._last_routing, self._fast_trace = self._fast_trace.traces(), None
        return self._last_routing

    @last_routing.setter
    def last_routing(self, value: list) -> None:
        self._last_routing, self._fast_trace = value, None

    # ------------------------------------------------------------------ small blocks
    def cache_bytes(self, capacity: int) -> int:
        """What new_cache(capacity) allocates (keys and values, every layer)."""
        c = self.cfg
        per_pos = c.kv_lora_rank + c.qk_rope_head_dim if c.attention == "mla" \
            else 2 * c.num_kv_heads * c.head_size
        return 4 * c.num_layers * int(capacity) * per_pos

    def new_cache(self, capacity: int) -> KVCache:
        check_memory(self.cache_bytes(capacity), f"a KV cache of {capacity} positions")
        if self.cfg.attention == "mla":
            return mla.MLACache(self.cfg, capacity)
        return KVCache(self.cfg, capacity)

    def _rmsnorm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return ops.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def linear(self, w, x: np.ndarray, act_scale: Optional[np.ndarray] = None) -> np.ndarray:
        """x [T, in] @ w^T -> [T, out] float32, whatever the stored number type.

        act_scale [in] (AWQ, optional): the stored matrix is W * act_scale (per column), so
        the activations are divided by it first."""
        if self.observer is not None:
            self.observer(w, x)
        if act_scale is not None:
            x = x / act_scale
        if isinstance(w, Q4Tensor):
            out = np.empty((x.shape[0], w.rows), dtype=np.float32)
            kernels.q4_matmul(w, np.ascontiguousarray(x, np.float32), out, act=self.act)
            return out
        if isinstance(w, Q8Tensor):
            out = np.empty((x.shape[0], w.rows), dtype=np.float32)
            kernels.q8_matmul(w, np.ascontiguousarray(x, np.float32), out, act=self.act)
            return out
        return (x @ ops.float_matrix(w).T).astype(np.float32, copy=False)

    def _ffn(self, ffn: FFNWeights, x: np.ndarray, out: np.ndarray,
             row_weights: Optional[np.ndarray] = None, accumulate: bool = False) -> None:
        sc = ffn.act_scales
        if (isinstance(ffn.w1, Q4Tensor) and isinstance(ffn.w2, Q4Tensor) and "w2" not in sc
                and self.observer is None and sc.get("w1") is sc.get("w3")):
            if "w1" in sc:                       # AWQ: w1 and w3 share one input scale
                x = np.ascontiguousarray(x / sc["w1"], np.float32)
            kernels.expert_ffn(ffn.w1, ffn.w3, ffn.w2, x, out, act=self.act,
                               row_weights=row_weights, accumulate=accumulate)
            return
        g = self.linear(ffn.w1, x, sc.get("w1"))
        u = self.linear(ffn.w3, x, sc.get("w3"))
        y = self.linear(ffn.w2, ops.silu(g) * u, sc.get("w2"))
        if row_weights is not None:
            y *= row_weights[:, None]
        if accumulate:
            out += y
        else:
            out[...] = y

    # ------------------------------------------------------------------ attention
    def _attention(self, lw: LayerWeights, xn: np.ndarray, pos: np.ndarray,
                   spans: list[tuple[int, int, KVCache]]) -> np.ndarray:
        cfg, a = self.cfg, lw.attn
        if cfg.attention == "mla":
            return mla.attention(self, lw, xn, pos, spans)
        T, D, NH, NKV = xn.shape[0], cfg.head_size, cfg.num_heads, cfg.num_kv_heads
        acts = a.act_scales
        q, k, v = (self.linear(a.wq, xn, acts.get("wq")), self.linear(a.wk, xn, acts.get("wk")),
                   self.linear(a.wv, xn, acts.get("wv")))
        if a.bq is not None:
            q += a.bq
            k += a.bk
            v += a.bv
        if cfg.qk_norm == "full":                                      # over the projection
            q, k = self._rmsnorm(q, a.q_norm), self._rmsnorm(k, a.k_norm)
        q, k, v = q.reshape(T, NH, D), k.reshape(T, NKV, D), v.reshape(T, NKV, D)
        if cfg.qk_norm == "per_head":
            q, k = self._rmsnorm(q, a.q_norm), self._rmsnorm(k, a.k_norm)
        q = ops.apply_rope(q, pos, self._inv_freq, self._rope_factor)    # rotate-half layout
        k = ops.apply_rope(k, pos, self._inv_freq, self._rope_factor)
        out = np.empty((T, NH, D), dtype=np.float32)
        scale = 1.0 / math.sqrt(D)
        L = lw.index
        for t0, t1, cache in spans:
            s0 = cache.length
            n = t1 - t0
            cache.k[L, s0:s0 + n] = k[t0:t1]
            cache.v[L, s0:s0 + n] = v[t0:t1]
            if n == 1:                    # decode step: the C kernel over the KV cache
                kernels.attention_decode(np.ascontiguousarray(q[t0]), cache.k[L], cache.v[L],
                                         s0 + 1, out[t0], scale=scale)
                continue
            out[t0:t1] = ops.attention(q[t0:t1], cache.k[L, :s0 + n], cache.v[L, :s0 + n],
                                       scale, s0)
        return self.linear(a.wo, out.reshape(T, NH * D), acts.get("wo"))

    # ------------------------------------------------------------------ MoE
    def _moe(self, lw: LayerWeights, xn: np.ndarray, k_tok: np.ndarray, es: ExpertSet) -> np.ndarray:
        cfg, L = self.cfg, lw.index
        # [T, slots]; the logit bias: hot experts' bias, vacant slots
        logits = ops.router_logits(xn, es.routers[L], es.logit_bias[L])
        r = route(logits, k_tok, mode=self.routing_mode, scoring=cfg.scoring_func,
                  norm_topk_prob=cfg.norm_topk_prob, bias=es.select_bias[L],
                  n_group=cfg.n_group, topk_group=cfg.topk_group,
                  scaling=cfg.routed_scaling_factor)
        hooks = self.hooks
        if hooks is not None and hooks.routing is not None:
            override = hooks.routing(layer=L, expert_ids=r.ids, weights=r.weights,
                                     scores=r.scores, logits=logits)
            if override is not None:             # checked as on the decode fast path
                ids, w = hooks.guard.check_routing(override, L, r.ids.shape[0], r.ids.shape[1],
                                                   es.experts[L], cfg.num_experts)
                r = Routing(ids, w, r.scores)
        self.last_routing.append(LayerTrace(L, r, logits))
        experts = es.experts[L]
        out = np.zeros_like(xn)
        used = np.unique(r.ids[r.ids >= 0])
        # the caller itself, not a flag: a plugin disabled mid-layer leaves it callable
        timing = hooks.expert_timing if hooks is not None else None
        T = xn.shape[0]
        res = self.residency
        for wave in res.waves(used):               # one wave unless a budget forces more
            run = res.acquire(L, wave, experts)    # prefetch; budget: load + pin
            try:
                if hooks is not None and hooks.expert_prefetch is not None:
                    hooks.expert_prefetch(layer=L, experts=[(int(e), run[e].address, run[e].nbytes)
                                                            for e in wave])
                for e in wave:
                    rows, slot = np.nonzero(r.ids == e)
                    ex = run[e]
                    if timing is not None:
                        c0, t0 = kernels.rdtsc(), _perf()
                    if T == 1:
                        self._run_expert(ex, xn, out, r.weights[0, slot])
                    else:
                        buf = np.zeros((len(rows), xn.shape[1]), dtype=np.float32)
                        self._run_expert(ex, np.ascontiguousarray(xn[rows]), buf, r.weights[rows, slot])
                        out[rows] += buf
                    if timing is not None:
                        timing(layer=L, expert=int(e), cycles=kernels.rdtsc() - c0,
                               seconds=_perf() - t0)
            finally:
                res.release(L, wave)               # views of `run` end here
        if lw.shared is not None:
            sh = np.empty_like(xn)
            self._ffn(lw.shared, xn, sh)
            if lw.shared_gate is not None:
                g = xn @ np.asarray(lw.shared_gate, np.float32).T               # [T, 1]
                sh *= ops.sigmoid(g)
            out += sh
        return out

    def _run_expert(self, ex, x: np.ndarray, out: np.ndarray, row_weights: np.ndarray) -> None:
        rw = np.ascontiguousarray(row_weights, np.float32)
        if ex.ffn is not None:
            self._ffn(ex.ffn, x, out, row_weights=rw, accumulate=True)
            return
        y = np.empty_like(x)                       # hot-plugged custom code: ffn_forward
        try:
            ex.forward(x, y)
        except ExpertError as e:
            # A failing hot expert contributes nothing to this token; the hot-plug manager
            # removes it at the next token boundary. The engine goes on.
            if ex.name not in self._warned:
                self._warned.add(ex.name)
                log.warning("%s failed (%s); it contributes nothing until it is removed", ex.name, e)
            return
        out += y * rw[:, None]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: Sequence[np.ndarray], caches: Sequence[KVCache],
                ks: Sequence[int] | None = None, all_logits: bool = False,
                expert_set: Optional[ExpertSet] = None) -> list[np.ndarray]:
        """Run a batch: tokens[i] (int ids) continue sequence i whose KV cache is caches[i].

        ks[i] is the top-k for sequence i (default: the model's). Returns per sequence the
        logits [V] of its last token, or [n_i, V] for all its tokens when all_logits.
        `expert_set` pins a snapshot (default: the current one).
        """
        cfg = self.cfg
        es = expert_set or self.expert_set
        if len(tokens) != len(caches):
            raise RequestError(f"{len(tokens)} token lists but {len(caches)} caches")
        res = self.residency
        if res.chunk_tokens is not None and sum(np.size(t) for t in tokens) > res.chunk_tokens:
            return self._forward_chunked(tokens, caches, ks, all_logits, es, res.chunk_tokens)
        ks = list(ks) if ks is not None else [cfg.top_k] * len(tokens)
        ids, pos, kt, spans = [], [], [], []
        t = 0
        for toks, cache, k in zip(tokens, caches, ks):
            toks = np.asarray(toks, dtype=np.int64).reshape(-1)
            n = len(toks)
            if n == 0:
                raise RequestError("empty token list in batch")
            if cache.length + n > cache.capacity:
                raise RequestError(f"sequence needs {cache.length + n} positions, its cache "
                                   f"holds {cache.capacity}")
            if cfg.moe_layers and not 1 <= k <= cfg.num_experts:
                raise RequestError(f"top_k={k} out of range 1..{cfg.num_experts}")
            bad = (toks < 0) | (toks >= cfg.vocab_size)
            if bad.any():
                raise RequestError(f"token id {int(toks[bad][0])} out of range 0..{cfg.vocab_size - 1}")
            ids.append(toks)
            pos.append(np.arange(cache.length, cache.length + n))
            kt.append(np.full(n, k))
            spans.append((t, t + n, cache))
            t += n
        ids, pos, kt = np.concatenate(ids), np.concatenate(pos), np.concatenate(kt)
        self.file_check.check()                  # a damaged model computes nothing more
        if res.active:
            res.begin_forward(len(ids), caches)
        self.last_routing = []
        x = self._embed(ids)                                              # [T, H]
        hooks = self.hooks
        for lw in self.w.layers:
            if hooks is not None and hooks.before_layer is not None:
                hooks.before_layer(layer=lw.index, hidden=x)
            x = x + self._attention(lw, self._rmsnorm(x, lw.attn_norm), pos, spans)
            xn = self._rmsnorm(x, lw.ffn_norm)
            if lw.kind == "dense":
                y = np.empty_like(xn)
                self._ffn(lw.dense, xn, y)
            else:
                kk = kt
                if hooks is not None and hooks.choose_k_token is not None:
                    probs = ops.softmax(ops.router_logits(xn, es.routers[lw.index]))
                    got = hooks.choose_k_token(layer=lw.index, probs=probs, default_k=kt)
                    if got is not None:
                        kk = hooks.guard.check_choose_k_token(got, len(kt), cfg.num_experts)
                y = self._moe(lw, xn, kk, es)
            x = x + y
            if res.speculative:                    # guess the next MoE layer's experts
                res.speculate(lw.index, x, es, kt)
            if hooks is not None and hooks.after_layer is not None:
                hooks.after_layer(layer=lw.index, hidden=x)
        results = []
        for t0, t1, cache in spans:
            cache.length += t1 - t0
            rows = x[t0:t1] if all_logits else x[t1 - 1:t1]
            logits = self.linear(self.w.lm_head, self._rmsnorm(rows, self.w.final_norm))
            results.append(logits if all_logits else logits[0])
        self.file_check.check()                  # a fault during this step: not a result
        return results

    # ------------------------------------------------------------------ decode
    def decode_plan(self, es: Optional[ExpertSet] = None):
        """The decode fast path's plan for expert set `es` (decode.py), or the reason
        (a string) why this step needs the general path."""
        es = es or self.expert_set
        if not self.engine.fast_decode:
            return "fast_decode is off"
        if self.observer is not None:
            return "an observer is attached"
        h = self.hooks
        if h is not None and (h.before_layer is not None or h.after_layer is not None
                              or h.choose_k_token is not None
                              or h.expert_timing is not None or h.expert_prefetch is not None):
            return "a plugin implements a per-layer hook"
        plan = self._plans.get(es.version)
        if plan is None:
            try:
                plan = DecodePlan(self, es)
            except Unsupported as e:
                plan = str(e)
            self._install_plan(es, plan)
        return plan

    def prepare_decode_plan(self, es: ExpertSet):
        """Build the decode plan of expert set `es` without installing it: on another
        thread than the one stepping (the hot-plug worker builds the next set's plan while
        tokens run). A DecodePlan, or the reason (a string) the fast path does not apply
        to `es`. adopt_decode_plan() installs it."""
        try:
            plan = DecodePlan(self, es)
        except Unsupported as e:
            return str(e)
        cur = next(iter(self._plans.values()), None)
        if isinstance(cur, DecodePlan):
            plan._scores(cur.s.max_len)          # grown like the current one (a benign race)
        return plan

    def adopt_decode_plan(self, es: ExpertSet, plan):
        """Install a plan made by prepare_decode_plan(es) (between two steps); return the
        plan it replaces (None if none), for the caller to free elsewhere."""
        if isinstance(plan, DecodePlan) and plan.es is not es:
            raise ValueError("adopt_decode_plan: the plan was made for another expert set")
        return self._install_plan(es, plan)

    def _install_plan(self, es: ExpertSet, plan):
        # One plan at a time: a plan keeps its expert set (and so any hot-plugged expert
        # in it) alive, and a removed expert must be let go of promptly. What the previous
        # plan learned about the machine (thread control, grown scratch) carries over.
        old = next(iter(self._plans.values()), None)
        if isinstance(plan, DecodePlan) and isinstance(old, DecodePlan):
            plan.carry_over(old)
        self._plans.clear()
        self._plans[es.version] = plan
        return old

    def drop_decode_plans(self) -> None:
        """Forget the decode plans (they point into the mapped weights)."""
        self._plans.clear()
        self._fast_trace = None

    def decode_step(self, token: int, cache, k: int, expert_set: Optional[ExpertSet] = None) -> np.ndarray:
        """Logits [V] of one new token of one sequence. Through the fast path when it
        applies (the result is then a buffer the next step overwrites: copy it to keep
        it), else through forward()."""
        es = expert_set or self.expert_set
        plan = self.decode_plan(es)
        if isinstance(plan, str) or k > 256:
            return self.forward([np.asarray([token])], [cache], [k], expert_set=es)[0]
        cfg = self.cfg
        if not 0 <= token < cfg.vocab_size:
            raise RequestError(f"token id {token} out of range 0..{cfg.vocab_size - 1}")
        if cfg.moe_layers and not 1 <= k <= min(cfg.num_experts, 256):
            raise RequestError(f"top_k={k} out of range 1..{cfg.num_experts}")
        self.file_check.check()
        self._last_routing = []
        logits = plan.step(token, cache, k)
        self._fast_trace = plan
        self.file_check.check()                  # a fault during this step: not a result
        return logits

    def _forward_chunked(self, tokens, caches, ks, all_logits: bool, es, chunk: int) -> list:
        """forward() in pieces of at most `chunk` tokens (the memory budget's activation
        share): a sequence's tokens go in order, each piece continuing its KV cache."""
        toks = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens]
        for t, cache in zip(toks, caches):
            if cache.length + len(t) > cache.capacity:
                raise RequestError(f"sequence needs {cache.length + len(t)} positions, its "
                                   f"cache holds {cache.capacity}")
        ks = list(ks) if ks is not None else [self.cfg.top_k] * len(toks)
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
        outs: list[list] = [[] for _ in toks]
        for b in batches:
            got = self.forward([p for _, p in b], [caches[i] for i, _ in b], [ks[i] for i, _ in b],
                               all_logits=all_logits, expert_set=es)
            for (i, _), o in zip(b, got):
                outs[i].append(o)
        return [np.concatenate(o, axis=0) if all_logits else o[-1] for o in outs]

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        return ops.embedding(self.w.embed, ids)


def _perf() -> float:
    import time
    return time.perf_counter()
