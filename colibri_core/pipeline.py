"""The one forward pipeline: n tokens of m sequences through the model, for prefill,
decode and scoring alike.

Per layer a fixed, small number of C calls (ck_step.c): the attention block, the router,
the expert block; then the lm_head. Between them, and only there, Python does what is not
arithmetic: the plugin hooks (free when no plugin implements them), the routing override
check, the memory budget's expert cache, hot-plugged experts that bring their own code.
Every step allocates nothing once its scratch has grown to the step's size.

Blocks without a C kernel yet run the reference block of reference.py inside the same
loop (`Pipeline.blocks` lists them with the reason): MLA attention, float activations,
AWQ activation scales, weights stored as floats. A routing that is not the fixed-point
softmax (float routing, sigmoid scores, group limits, a selection bias) takes its logits
from C and its choice from routing.route.

Batch invariance: a token's logits do not depend on which other tokens share its step
(ck_step.c says how); the scheduler batches requests on it.

Shape legend: n tokens in the step, H hidden, E router slots, K the step's largest k.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from . import ops
from .kernels import ffi, lib
from .kvcache import check_memory
from .quant import Q4Tensor, Q8Tensor, padded_cols
from .expertcache import Pending as _PENDING
from .routing import _EXP2_TABLE, LayerTrace, Routing, route

log = logging.getLogger("colibri")

_ERRORS = {1: "more than two activation group sizes in one call",
           2: "step scratch too small", 3: "non-finite router logits",
           4: "no memory for attention scores"}
_PAIRS_MAX = 512            # rows of the expert block's intermediate per piece (~6 MB)


# ----------------------------------------------------------------------------- C structs

class _Keep:
    """Arrays and structs the C side points into, kept alive with their owner."""

    def __init__(self):
        self.refs: list = []

    def buf(self, a: np.ndarray, ctype: str):
        if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
            a = np.ascontiguousarray(a)
        self.refs.append(a)
        return ffi.cast(ctype, ffi.from_buffer(a))

    def f32(self, a):
        return ffi.NULL if a is None else self.buf(np.asarray(a, np.float32).reshape(-1), "float *")

    def new(self, ctype: str, *args):
        obj = ffi.new(ctype, *args)
        self.refs.append(obj)
        return obj


def _is_q(w) -> bool:
    return isinstance(w, (Q4Tensor, Q8Tensor))


def _set_mat(keep: _Keep, m, w) -> None:
    if isinstance(w, Q4Tensor):
        m.kind, m.zeros = lib.CK_W_Q4, keep.buf(w.zeros, "uint8_t *")
    else:
        m.kind, m.zeros = lib.CK_W_Q8, ffi.NULL
    m.data = keep.buf(w.data, "void *")
    m.scales = keep.buf(w.scales, "float *")
    m.rows, m.cols, m.group = w.rows, w.cols, w.group


def _set_ffn(keep: _Keep, dst, ffn) -> None:
    for name in ("w1", "w3", "w2"):
        _set_mat(keep, getattr(dst, name), getattr(ffn, name))


def _clear_ffn(dst) -> None:
    for name in ("w1", "w3", "w2"):
        getattr(dst, name).data = ffi.NULL


def ffn_in_c(ffn, act: str) -> Optional[str]:
    """Why this FFN has no C block (None: it has)."""
    if act != "int8":
        return "float activations"
    if ffn.act_scales:
        return "AWQ activation scales"
    if not all(isinstance(getattr(ffn, n), Q4Tensor) for n in ("w1", "w3", "w2")):
        return "an FFN not stored as q4"
    if ffn.w1.group != ffn.w3.group:
        return "gate and up with different groups"
    return None


def attention_in_c(model, lw) -> Optional[str]:
    cfg, a = model.cfg, lw.attn
    if cfg.attention == "mla":
        return "MLA attention"
    if model.act != "int8":
        return "float activations"
    if a.act_scales:
        return "AWQ activation scales"
    if not all(_is_q(getattr(a, n)) for n in ("wq", "wk", "wv", "wo")):
        return "attention weights not stored as q4/q8"
    if len(model.ref._inv_freq) * 2 != cfg.head_size:
        return "partial rotary embedding"
    if len({getattr(a, n).group for n in ("wq", "wk", "wv")}) > 2:
        return "q/k/v with more than two group sizes"
    return None


# ----------------------------------------------------------------------------- threads

class ThreadControl:
    """Whether the pool's second thread is really running, step by step.

    On a machine shared with other jobs, the CPU a second thread needs is often taken:
    measured on 2 CPUs with one busy, 2 threads decode at 14.8 ms/token against 6.5 ms on
    one. The pool (ck_pool.c) reports, per step, the chunks the other threads ran and how
    long the caller waited for them; when they did less than a quarter of the work, or the
    caller waited more than a quarter of the time, for three steps running, the next steps
    run on the caller's thread alone, and a single step on all threads probes again after
    4, 8, ... 512 steps (doubling while the probes fail)."""

    UNHEALTHY_SHARE = 0.25
    BAD_STEPS = 3
    FIRST_BACKOFF = 4
    MAX_BACKOFF = 512

    def __init__(self, scratch):
        self.s = scratch
        self.stats = np.zeros(4, np.int64)
        self.p_stats = ffi.cast("int64_t *", ffi.from_buffer(self.stats))
        self.bad = 0
        self.backoff = self.FIRST_BACKOFF
        self.countdown = 0
        self.steps = self.single_steps = 0

    def after_step(self) -> None:
        self.steps += 1
        lib.ck_pool_stats(self.p_stats)
        if self.s.threads == 1:                      # running alone: probe when due
            self.single_steps += 1
            self.countdown -= 1
            if self.countdown <= 0:
                self.s.threads = 0
                self.bad = self.BAD_STEPS - 1        # one bad probe step is enough
            return
        mine, others, loop, wait = self.stats
        if mine + others == 0:                       # too small to run in parallel
            return
        if others < self.UNHEALTHY_SHARE * (mine + others) or wait > self.UNHEALTHY_SHARE * loop:
            self.bad += 1
            if self.bad >= self.BAD_STEPS:
                self.s.threads = 1
                self.countdown = self.backoff
                self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
                self.bad = 0
        else:
            self.bad = 0
            self.backoff = self.FIRST_BACKOFF


# ----------------------------------------------------------------------------- scratch

class _Scratch:
    """The step's buffers, grown (never per token) to the largest step seen."""

    def __init__(self, model):
        cfg, w = model.cfg, model.w
        self.cfg = cfg
        H = cfg.hidden_size
        groups, hld, hcp, ffns = {64}, 64, 64, []
        for lw in w.layers:
            for n in ("wq", "wk", "wv", "wo"):
                m = getattr(lw.attn, n, None)
                if _is_q(m):
                    groups.add(m.group)
            ffns += [f for f in (lw.dense, lw.shared) if f is not None]
            ffns += [ex.ffn for ex in lw.experts if ex.ffn is not None]
        if _is_q(w.lm_head):
            groups.add(w.lm_head.group)
        for f in ffns:
            if isinstance(f.w1, Q4Tensor) and isinstance(f.w2, Q4Tensor):
                groups.update((f.w1.group, f.w2.group))
                hld = max(hld, -(-f.w1.rows // 64) * 64)
                hcp = max(hcp, padded_cols(f.w2.cols, f.w2.group))
        self.hld, self.hcp = hld, hcp
        self.cp_max = max(padded_cols(c, g) for g in groups
                          for c in (H, cfg.num_heads * cfg.head_size))
        self.E = max([lw.router.shape[0] for lw in w.layers if lw.kind == "moe"], default=1)
        self.nl = len(w.layers)
        self.s = ffi.new("ck_sscratch *")
        self.s.threads = 0
        self.n_max = 0
        self.kmax = 0
        self.slots = 0
        self._keep = _Keep()
        self.control = ThreadControl(self.s)

    def grow_slots(self, slots: int) -> None:
        """The expert block's per-layer tables of `slots` router slots (hot-plugging adds
        slots)."""
        if slots > self.slots:
            self.slots = max(slots, self.E)
            self._alloc(self.n_max, self.kmax)

    def ensure(self, n: int, kmax: int) -> None:
        if n > self.n_max or kmax > self.kmax:
            self._alloc(max(n, self.n_max, 1), max(kmax, self.kmax, 1))

    def _alloc(self, n: int, kmax: int) -> None:
        cfg, cp, H = self.cfg, self.cp_max, self.cfg.hidden_size
        NH, NKV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        E = max(self.E, self.slots)
        pairs = min(_PAIRS_MAX, n * (kmax + 1))
        need = 4 * n * (4 * H + 2 * NH * D + 2 * NKV * D + E * self.nl + 4 * kmax * self.nl) \
            + 2 * n * cp * 2 + pairs * (cp + 4 * self.hld + 2 * self.hcp)
        if need > 64 << 20:
            check_memory(need, f"the forward scratch of a {n}-token step")
        k, s = _Keep(), self.s
        z = np.zeros
        s.n_max = n
        self.x = z((n, H), np.float32)
        self.xn = z((n, H), np.float32)
        s.xn = k.buf(z(n * H, np.float32), "float *")
        for p in ("a", "b"):
            setattr(s, p + "q", k.buf(z(n * cp, np.int8), "int8_t *"))
            setattr(s, p + "s", k.buf(z(n * cp // 64, np.float32), "float *"))
            setattr(s, p + "sum", k.buf(z(n * cp // 64, np.int32), "int32_t *"))
        s.cp_max = cp
        s.q = k.buf(z(n * NH * D, np.float32), "float *")
        s.k = k.buf(z(n * NKV * D, np.float32), "float *")
        s.v = k.buf(z(n * NKV * D, np.float32), "float *")
        s.att = k.buf(z(n * NH * D, np.float32), "float *")
        s.pairs_max = pairs
        s.gq = k.buf(z(pairs * cp, np.int8), "int8_t *")
        s.gs = k.buf(z(pairs * cp // 64, np.float32), "float *")
        s.gsum = k.buf(z(pairs * cp // 64, np.int32), "int32_t *")
        s.h = k.buf(z(pairs * self.hld, np.float32), "float *")
        s.hq = k.buf(z(pairs * self.hcp, np.int8), "int8_t *")
        s.hs = k.buf(z(pairs * self.hcp // 64, np.float32), "float *")
        s.hsum = k.buf(z(pairs * self.hcp // 64, np.int32), "int32_t *")
        s.hld, s.hcp = self.hld, self.hcp
        s.counts = k.buf(z(2 * E + 1, np.int64), "int64_t *")
        s.jobs_max = E + 2
        s.jobs = k.buf(z((E + 2) * lib.ck_step_job_bytes(), np.uint8), "void *")
        self.tok = z((n, 4), np.int64)
        self.kt = z(n, np.int32)
        self.logits = z((self.nl, n, E), np.float32)       # per layer: the trace's arrays
        self.dense_ids = z((n, 1), np.int64)
        self.dense_w = np.ones((n, 1), np.float32)
        self.head_x = z((n, H), np.float32)
        self.p_x = ffi.cast("float *", ffi.from_buffer(self.x))
        self.p_xn = ffi.cast("float *", ffi.from_buffer(self.xn))
        self.p_tok = ffi.cast("int64_t *", ffi.from_buffer(self.tok))
        self.p_kt = ffi.cast("int32_t *", ffi.from_buffer(self.kt))
        self.p_dense_ids = ffi.cast("int64_t *", ffi.from_buffer(self.dense_ids))
        self.p_dense_w = ffi.cast("float *", ffi.from_buffer(self.dense_w))
        self.p_head_x = ffi.cast("float *", ffi.from_buffer(self.head_x))
        self.n_max, self.kmax = n, 0
        self._keep = k
        self.grow_k(kmax)

    def grow_k(self, kmax: int) -> None:
        """The buffers whose size follows the step's k (a plugin's choose_k_token may
        raise it inside a step: what earlier layers recorded is kept)."""
        if kmax <= self.kmax:
            return
        n, s, k = self.n_max, self.s, _Keep()
        total = n * (kmax + 1)
        s.pairs_total_max = total
        s.pair_tok = k.buf(np.zeros(total, np.int64), "int64_t *")
        s.pair_w = k.buf(np.zeros(total, np.float32), "float *")
        ids, wts = np.full((self.nl, n, kmax), -1, np.int64), np.zeros((self.nl, n, kmax), np.float32)
        if self.kmax:                       # each layer's [n, k] rows sit at its start
            m = n * self.kmax
            ids.reshape(self.nl, -1)[:, :m] = self.ids.reshape(self.nl, -1)
            wts.reshape(self.nl, -1)[:, :m] = self.wts.reshape(self.nl, -1)
        self.ids, self.wts = ids, wts
        self.run_ids = np.zeros((n, kmax), np.int64)       # the C call's choice
        self.p_run_ids = ffi.cast("int64_t *", ffi.from_buffer(self.run_ids))
        self.kmax = kmax
        self._keep_k = k
        self._views: dict = {}
        self.p_layer = [(ffi.cast("float *", ffi.from_buffer(self.logits[i])),
                         ffi.cast("int64_t *", ffi.from_buffer(self.ids[i])),
                         ffi.cast("float *", ffi.from_buffer(self.wts[i]))) for i in range(self.nl)]

    def prefix(self, name: str, n: int) -> np.ndarray:
        """Rows [:n] of buffer `name`, cached like rows()."""
        key = (name, n)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = getattr(self, name)[:n]
        return v

    def rows(self, name: str, i: int, n: int, k: int) -> np.ndarray:
        """The contiguous [n, k] array at the start of layer i's buffer `name` (the C
        calls' layout); cached, so that a decode step makes no new view objects."""
        key = (name, i, n, k)
        v = self._views.get(key)
        if v is None:
            buf = getattr(self, name)
            v = _rows(buf if i < 0 else buf[i], n, k)
            if len(self._views) > 4096:
                self._views.clear()
            self._views[key] = v
        return v


# ----------------------------------------------------------------------------- layers

class _SetTables:
    """What depends on the expert set: per MoE layer its router and its expert table."""

    def __init__(self, model, es):
        self.es = es
        self.generation = es.generation
        self.keep = keep = _Keep()
        cfg = model.cfg
        self.exp2 = keep.buf(_EXP2_TABLE.astype(np.int64), "int64_t *")
        self.layers: dict = {}
        for lw in model.w.layers:
            if lw.kind != "moe":
                continue
            L = lw.index
            experts = es.experts[L]
            router = np.ascontiguousarray(es.routers[L], np.float32)
            rt = keep.new("ck_router *")
            rt.weight = keep.buf(router, "float *")
            rt.bias = keep.f32(es.logit_bias[L])
            rt.e, rt.h = router.shape[0], cfg.hidden_size
            rt.norm_topk = bool(cfg.norm_topk_prob)
            rt.scaling = float(cfg.routed_scaling_factor)
            rt.exp2_q30 = self.exp2
            table = keep.new("ck_ffn[]", max(len(experts), 1))
            custom, refs = set(), set()
            for e, ex in enumerate(experts):
                if ex is None:
                    continue
                if ex.ffn is None:                      # hot-plugged code: ffn_forward
                    custom.add(e)
                elif ffn_in_c(ex.ffn, model.act) is not None:
                    refs.add(e)                         # the reference block runs it
                else:
                    _set_ffn(keep, table[e], ex.ffn)
            self.layers[L] = {"router": rt, "table": table, "n": len(experts),
                              "custom": frozenset(custom), "ref": frozenset(refs),
                              "experts": experts, "slots": router.shape[0],
                              "select_bias": es.select_bias[L]}


class Pipeline:
    """The forward of one Model (model.py): run() is every forward the engine does."""

    def __init__(self, model):
        self.model = model
        self.cfg = cfg = model.cfg
        w = model.w
        self.keep = keep = _Keep()
        self.scratch = _Scratch(model)
        self.eps = float(cfg.rms_norm_eps)
        routing_c = (model.engine.routing == "fixed" and cfg.scoring_func == "softmax"
                     and not (cfg.n_group > 1 and cfg.topk_group < cfg.n_group))
        self.routing_c = routing_c
        inv_freq, factor = model.ref._inv_freq, model.ref._rope_factor
        p_inv = keep.buf(np.asarray(inv_freq, np.float64), "double *")
        self.blocks: dict[str, str] = {}            # block -> why it runs the reference
        self.layers = []
        for lw in w.layers:
            L = {"index": lw.index, "moe": lw.kind == "moe", "lw": lw}
            why = attention_in_c(model, lw)
            if why is None:
                a = lw.attn
                al = keep.new("ck_attn_layer *")
                for n in ("wq", "wk", "wv", "wo"):
                    _set_mat(keep, getattr(al, n), getattr(a, n))
                al.bq, al.bk, al.bv = keep.f32(a.bq), keep.f32(a.bk), keep.f32(a.bv)
                al.qk_norm = {"none": 0, "per_head": 1, "full": 2}[cfg.qk_norm]
                al.q_norm, al.k_norm = keep.f32(a.q_norm), keep.f32(a.k_norm)
                al.norm, al.ffn_norm = keep.f32(lw.attn_norm), keep.f32(lw.ffn_norm)
                al.hidden, al.nh, al.nkv, al.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
                al.eps, al.scale = self.eps, float(1.0 / np.sqrt(cfg.head_size))
                al.inv_freq, al.rope_factor = p_inv, float(factor)
                L["attn"] = al
            else:
                L["attn"] = None
                self.blocks.setdefault("attention", why)
            block = keep.new("ck_ffn_block *")
            block.hidden = cfg.hidden_size
            L["block"] = block
            if lw.kind == "dense":
                why = ffn_in_c(lw.dense, model.act)
                if why is None:
                    t = keep.new("ck_ffn[1]")
                    _set_ffn(keep, t[0], lw.dense)
                    block.table, block.n_table = t, 1
                    L["dense_c"] = True
                else:
                    L["dense_c"] = False
                    self.blocks.setdefault("dense FFN", why)
            elif lw.shared is not None:
                why = ffn_in_c(lw.shared, model.act)
                if why is None:
                    sh = keep.new("ck_ffn *")
                    _set_ffn(keep, sh, lw.shared)
                    block.shared = sh
                    block.shared_gate = keep.f32(lw.shared_gate)
                    L["shared_c"] = True
                else:
                    L["shared_c"] = False
                    self.blocks.setdefault("shared expert", why)
            self.layers.append(L)
        why = None if (_is_q(w.lm_head) and model.act == "int8") else \
            ("float activations" if model.act != "int8" else "lm_head not stored as q4/q8")
        self.head = None
        if why is None:
            self.head = keep.new("ck_mat *")
            _set_mat(keep, self.head, w.lm_head)
        else:
            self.blocks["lm_head"] = why
        self.final_norm = keep.f32(w.final_norm)
        self.embed_mat = None
        if _is_q(w.embed):
            self.embed_mat = keep.new("ck_mat *")
            _set_mat(keep, self.embed_mat, w.embed)
        if not routing_c:
            self.blocks["routing"] = (f"{model.engine.routing} routing, {cfg.scoring_func} scores"
                                      + (", group-limited" if cfg.n_group > 1 and cfg.topk_group < cfg.n_group else ""))
        self._tables: Optional[_SetTables] = None
        self._pinned: dict = {}                     # id(es) -> tables of an older, pinned set
        self._last_tables: Optional[_SetTables] = None   # the last step's (the trace's)
        self._cache_addr: dict = {}
        self._logits1 = None                        # the decode loop's logits buffer
        self.last_n = 0                             # tokens of the last step
        self.layer_k = [0] * len(self.layers)        # its k per layer (the arrays' layout)
        self.layer_width = [0] * len(self.layers)    # the choice's width (an override's)

    # ------------------------------------------------------------------ expert sets
    def tables_for(self, es) -> _SetTables:
        t = self._tables
        if t is not None and t.es is es:
            return t
        side = self._pinned.get(id(es))
        if side is not None and side.es is es:
            return side
        if t is not None and es.generation < t.generation:
            # an older snapshot a pinned request keeps (scheduler.py): its own tables,
            # beside the current set's, until keep_pinned() lets them go
            side = self._pinned[id(es)] = _SetTables(self.model, es)
            self.scratch.grow_slots(max((v["slots"] for v in side.layers.values()), default=1))
            return side
        self.adopt(es, _SetTables(self.model, es))
        return self._tables

    def keep_pinned(self, sets) -> None:
        """Forget the tables of older snapshots that no sequence in `sets` uses any more
        (their experts can then be released)."""
        live = {id(es) for es in sets}
        for key in [k for k in self._pinned if k not in live]:
            del self._pinned[key]

    def prepare(self, es) -> _SetTables:
        """The tables of expert set `es`, built without installing them: on another thread
        than the one stepping (the hot-plug worker prepares the next set while tokens
        run). adopt() installs them between two steps."""
        return _SetTables(self.model, es)

    def adopt(self, es, tables: _SetTables):
        """Install tables made by prepare(es); returns the ones they replace (None if
        none), for the caller to free elsewhere. One set at a time: the tables keep their
        expert set (and any hot-plugged expert in it) alive."""
        if tables.es is not es:
            raise ValueError("Pipeline.adopt: the tables were made for another expert set")
        old, self._tables = self._tables, tables
        self.scratch.grow_slots(max((v["slots"] for v in tables.layers.values()), default=1))
        return old

    def drop(self) -> None:
        """Forget the tables and cache pointers (they point into the mapped weights)."""
        self._tables = None
        self._pinned.clear()
        self._last_tables = None
        self._cache_addr.clear()

    def close(self) -> None:
        """Let go of everything that points into the mapped weights (Engine.close, before
        the files are unmapped); the pipeline cannot run after this."""
        self.drop()
        self.layers, self.head, self.embed_mat, self.final_norm = [], None, None, None
        self.keep = None

    # ------------------------------------------------------------------ the trace
    def routing_trace(self) -> list:
        """The last step's routing per MoE layer (routing.LayerTrace; copies)."""
        out, n = [], self.last_n
        sc = self.scratch
        t = self._last_tables
        for i, L in enumerate(self.layers):
            if not L["moe"] or t is None or n == 0:
                continue
            slots, k, width = t.layers[L["index"]]["slots"], self.layer_k[i], self.layer_width[i]
            logits = sc.rows("logits", i, n, slots).copy()
            ids = sc.rows("ids", i, n, k)[:, :width].copy()
            if self.cfg.scoring_func == "softmax":
                p = ops.softmax(logits.astype(np.float64))
            else:
                p = ops.sigmoid(logits.astype(np.float64))
            scores = np.take_along_axis(p, np.maximum(ids, 0), 1).astype(np.float32)
            scores[ids < 0] = 0.0                  # slots a routing override left unused
            out.append(LayerTrace(L["index"], Routing(ids, sc.rows("wts", i, n, k)[:, :width].copy(), scores), logits))
        return out

    # ------------------------------------------------------------------ the step
    def forget_cache(self, cache) -> None:
        """A KV cache was freed: drop the addresses kept for it (and the cache)."""
        got = self._cache_addr.get(id(cache))
        if got is not None and got[0] is cache:
            del self._cache_addr[id(cache)]

    def _cache_ptrs(self, cache) -> tuple:
        got = self._cache_addr.get(id(cache))
        if got is None or got[0] is not cache:
            if len(self._cache_addr) > 256:
                self._cache_addr.clear()
            k, v = cache.k, cache.v
            got = (cache, int(ffi.cast("intptr_t", ffi.from_buffer(k))),
                   int(ffi.cast("intptr_t", ffi.from_buffer(v))), k.shape[1] * k.shape[2] * k.shape[3])
            self._cache_addr[id(cache)] = got
        return got

    def run(self, ids: np.ndarray, spans: list, kt: np.ndarray, es, all_logits: bool = False,
            reuse: bool = False) -> list:
        """ids [n] token ids; spans [(t0, t1, cache)] each sequence's tokens; kt [n] the
        k of each token (or one int for all). Returns per sequence the logits of its last token [V] (all its
        tokens [n_i, V] when all_logits); the caches' lengths advance. reuse: the logits
        are views of a buffer the next step overwrites (the decode loop copies nothing)."""
        model, sc = self.model, self.scratch
        n = len(ids)
        kmax = kt if isinstance(kt, int) else (int(kt.max()) if n else 1)
        sc.ensure(n, kmax)
        t = self._last_tables = self.tables_for(es)
        s = sc.s
        x = sc.prefix("x", n)
        self._embed(ids, x)
        tok = sc.tok
        mla = self.cfg.attention == "mla"
        for t0, t1, cache in spans:
            if t1 - t0 == 1:                        # a decode token: no views, no arrays
                if not mla:
                    _, tok[t0, 1], tok[t0, 2], tok[t0, 3] = self._cache_ptrs(cache)
                tok[t0, 0] = cache.length
                continue
            if not mla:
                _, ka, va, stride = self._cache_ptrs(cache)
                tok[t0:t1, 1], tok[t0:t1, 2], tok[t0:t1, 3] = ka, va, stride
            tok[t0:t1, 0] = np.arange(cache.length, cache.length + t1 - t0)
        if isinstance(kt, int):
            sc.kt[0] = kt
            if n > 1:
                sc.kt[1:n] = kt
        else:
            sc.kt[:n] = kt
        hooks = model.hooks
        res = model.residency
        if res.active:
            res.begin_forward(n, [c for _, _, c in spans])
        xn = sc.prefix("xn", n)
        for i, L in enumerate(self.layers):
            lw = L["lw"]
            if hooks is not None and hooks.before_layer is not None:
                hooks.before_layer(layer=lw.index, hidden=x)
            if L["attn"] is not None:
                self._check(lib.ck_step_attention(L["attn"], lw.index, sc.p_x, n, sc.p_tok, sc.p_xn, s))
            else:                                   # the reference block (reference.py)
                ref = model.ref
                x += ref._attention(lw, ref._rmsnorm(x, lw.attn_norm), tok[:n, 0], spans)
                xn[...] = ref._rmsnorm(x, lw.ffn_norm)
            if not L["moe"]:
                if L["dense_c"]:
                    self._check(lib.ck_step_experts(L["block"], sc.p_xn, n, sc.p_dense_ids,
                                                    sc.p_dense_w, 1, sc.p_x, s))
                else:
                    y = np.empty_like(xn)
                    model.ref._ffn(lw.dense, np.ascontiguousarray(xn), y)
                    x += y
            else:
                self._moe(i, L, t.layers[lw.index], n, kmax)
            if res.speculative:                     # guess the next MoE layer's experts
                res.speculate(lw.index, x, es, sc.kt[:n])
            if hooks is not None and hooks.after_layer is not None:
                hooks.after_layer(layer=lw.index, hidden=x)
        self.last_n = n
        if len(spans) == 1 and not all_logits:   # one sequence's last token (decode)
            np.copyto(sc.prefix("head_x", 1), x[n - 1:n] if n > 1 else x)
            logits = self._head(sc.prefix("head_x", 1), reuse)
            results = [self._logits1_row if reuse and logits is self._logits1 else logits[0]]
        else:
            rows = [(t0, t1) if all_logits else (t1 - 1, t1) for t0, t1, _ in spans]
            hx = sc.head_x[:sum(b - a for a, b in rows)]
            j = 0
            for a, b in rows:
                hx[j:j + b - a] = x[a:b]
                j += b - a
            logits = self._head(hx, reuse)
            results, j = [], 0
            for a, b in rows:
                results.append(logits[j:j + b - a] if all_logits else logits[j])
                j += b - a
        for t0, t1, cache in spans:
            cache.length += t1 - t0
        sc.control.after_step()
        return results

    def _embed(self, ids: np.ndarray, x: np.ndarray) -> None:
        if self.embed_mat is not None:
            if len(ids) == 1:
                lib.ck_mat_row(self.embed_mat, int(ids[0]), self.scratch.p_x)
                return
            for r, tid in enumerate(ids.tolist()):
                lib.ck_mat_row(self.embed_mat, tid, ffi.cast("float *", ffi.from_buffer(x[r])))
        else:                                       # f32 / f16 / bf16 rows
            x[...] = self.model.ref._embed(ids)

    def _head(self, hx: np.ndarray, reuse: bool) -> np.ndarray:
        n = hx.shape[0]
        if self.head is None:
            ref = self.model.ref
            return ref.linear(self.model.w.lm_head, ref._rmsnorm(hx, self.model.w.final_norm))
        if reuse and n == 1:
            if self._logits1 is None:
                self._logits1 = np.zeros((1, self.head.rows), np.float32)
                self._logits1_row = self._logits1[0]
                self._p_logits1 = ffi.cast("float *", ffi.from_buffer(self._logits1))
            out, p_out = self._logits1, self._p_logits1
        else:
            out = np.empty((n, self.head.rows), np.float32)
            p_out = ffi.cast("float *", ffi.from_buffer(out))
        self._check(lib.ck_step_head(self.head, self.final_norm, self.eps, self.scratch.p_head_x,
                                     n, p_out, self.scratch.s))
        return out

    # ------------------------------------------------------------------ MoE layer
    def _moe(self, i: int, L: dict, T: dict, n: int, kmax: int) -> None:
        """Route layer L's tokens, give plugins their say, run the experts."""
        model, sc, cfg = self.model, self.scratch, self.cfg
        layer, hooks = L["index"], model.hooks
        E = T["slots"]
        lg = sc.rows("logits", i, n, E)            # C writes [n, E] from the start
        p_logits, p_ids, p_wts = sc.p_layer[i]
        choose = hooks.choose_k_token if hooks is not None else None
        fixed = self.routing_c and T["select_bias"] is None and choose is None
        if fixed:
            rc = lib.ck_step_route(T["router"], sc.p_xn, n, sc.p_kt, kmax, p_logits, p_ids, p_wts)
            fixed = rc != lib.CK_E_NONFINITE       # else: the router's NaN fallback below
            if fixed:
                self._check(rc)
        else:
            rc = lib.ck_step_route(T["router"], sc.p_xn, n, sc.p_kt, kmax, p_logits, ffi.NULL, ffi.NULL)
            if rc != lib.CK_E_NONFINITE:
                self._check(rc)
        if not fixed:
            k_tok = sc.kt[:n]
            if choose is not None:
                got = choose(layer=layer, probs=ops.softmax(lg), default_k=k_tok.astype(np.int64))
                if got is not None:
                    k_tok = hooks.guard.check_choose_k_token(got, n, cfg.num_experts)
            r = route(lg, k_tok, mode=model.engine.routing, scoring=cfg.scoring_func,
                      norm_topk_prob=cfg.norm_topk_prob, bias=T["select_bias"],
                      n_group=cfg.n_group, topk_group=cfg.topk_group,
                      scaling=cfg.routed_scaling_factor)
            kmax = max(kmax, r.ids.shape[1])
            sc.grow_k(kmax)                          # a plugin may choose more than the step's k
            idv, wv = sc.rows("ids", i, n, kmax), sc.rows("wts", i, n, kmax)
            K = r.ids.shape[1]
            idv[:, :K], wv[:, :K] = r.ids, r.weights
            idv[:, K:], wv[:, K:] = -1, 0.0
        else:
            idv, wv = sc.rows("ids", i, n, kmax), sc.rows("wts", i, n, kmax)
        self.layer_k[i] = self.layer_width[i] = kmax
        if hooks is not None and hooks.routing is not None:
            p = ops.softmax(lg.astype(np.float64)) if cfg.scoring_func == "softmax" \
                else ops.sigmoid(lg.astype(np.float64))
            scores = np.take_along_axis(p, np.maximum(idv, 0), 1).astype(np.float32)
            override = hooks.routing(layer=layer, expert_ids=idv, weights=wv, scores=scores, logits=lg)
            if override is not None:                # validated here, the one place
                new_ids, new_w = hooks.guard.check_routing(override, layer, n, kmax,
                                                           T["experts"], cfg.num_experts)
                m = new_ids.shape[1]
                idv[:, :m], wv[:, :m] = new_ids, new_w
                idv[:, m:], wv[:, m:] = -1, 0.0
                self.layer_width[i] = m
        self._experts(i, L, T, n, kmax, idv, wv)

    def _experts(self, i, L, T, n: int, kmax: int, idv: np.ndarray, wv: np.ndarray) -> None:
        model, sc = self.model, self.scratch
        layer, hooks = L["index"], model.hooks
        run_ids = sc.rows("run_ids", -1, n, kmax)
        np.copyto(run_ids, idv)
        p_w = sc.p_layer[i][2]                      # wv is the start of layer i's buffer
        res = model.residency
        timing = hooks.expert_timing if hooks is not None else None
        prefetch = hooks.expert_prefetch if hooks is not None else None
        block = L["block"]
        block.table, block.n_table = T["table"], T["n"]
        if not (T["custom"] or T["ref"] or res.active or timing is not None or prefetch is not None
                or not res.all_prefetched(layer)):
            # the common case: the routed and the shared experts in one C call
            self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))
            self._shared_ref(L, n)
            return
        used = np.unique(idv[idv >= 0])
        shared, block.shared = block.shared, ffi.NULL      # the shared expert after the waves
        try:
            for wave in res.waves(used):            # one wave unless a budget forces more
                run = res.acquire(layer, wave, T["experts"])   # prefetch; budget: load + pin
                try:
                    if prefetch is not None:
                        prefetch(layer=layer, experts=[(int(e), run[e].address, run[e].nbytes)
                                                       for e in wave])
                    self._run_wave(L, T, n, idv, wv, p_w, kmax, wave, run, timing, res.active)
                finally:
                    res.release(layer, wave)
        finally:
            block.shared = shared
        if shared != ffi.NULL:
            run_ids[...] = -1
            self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))
        self._shared_ref(L, n)

    def _run_wave(self, L, T, n, idv, wv, p_w, kmax, wave, run, timing, budget) -> None:
        """The routed experts `wave` (ascending ids): C experts in one call -- one call
        per expert when a load is still in flight (each computes as soon as it is read)
        or a plugin times experts --, custom and reference ones between."""
        model, sc = self.model, self.scratch
        layer, table, block = L["index"], T["table"], L["block"]
        x, xn = sc.x[:n], sc.xn[:n]
        run_ids = sc.rows("run_ids", -1, n, kmax)
        keep = _Keep()                              # the cache's frames, until the calls end
        singles = timing is not None or any(isinstance(run[e], _PENDING) for e in wave)
        batch = []
        for e in (int(e) for e in wave):
            c0, t0 = _cycles(), time.perf_counter()
            if e in T["custom"] or e in T["ref"]:
                rows, slot = np.nonzero(idv == e)
                out = np.zeros((len(rows), x.shape[1]), np.float32)
                model.ref._run_expert(run[e], np.ascontiguousarray(xn[rows]), out, wv[rows, slot])
                x[rows] += out
            else:
                if budget:                          # where the cache holds it now
                    _set_ffn(keep, table[e], run[e].ffn)
                if not singles:
                    batch.append(e)
                    continue
                np.copyto(run_ids, np.where(idv == e, idv, -1))
                self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))
            if timing is not None:
                timing(layer=layer, expert=e, cycles=_cycles() - c0, seconds=time.perf_counter() - t0)
        if batch:
            np.copyto(run_ids, np.where(np.isin(idv, batch), idv, -1))
            self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))

    def _shared_ref(self, L, n: int) -> None:
        lw = L["lw"]
        if lw.shared is None or L.get("shared_c", True):
            return
        sc = self.scratch
        xn = np.ascontiguousarray(sc.xn[:n])
        sh = np.empty_like(xn)
        self.model.ref._ffn(lw.shared, xn, sh)
        if lw.shared_gate is not None:
            sh *= ops.sigmoid(xn @ np.asarray(lw.shared_gate, np.float32).T)
        sc.x[:n] += sh

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"colibri step kernel: {_ERRORS.get(rc, rc)}")


def _cycles() -> int:
    return int(lib.ck_rdtsc())


def _rows(a: np.ndarray, n: int, k: int) -> np.ndarray:
    """The contiguous [n, k] array at the start of buffer `a` (the C calls' layout)."""
    return a.reshape(-1)[:n * k].reshape(n, k)
