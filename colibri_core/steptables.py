"""The pipeline's C structures: the descriptors of matrices, FFNs, attention layers and
routers that ck_step.c reads, the tables that depend on the expert set, the step's scratch
buffers and the thread control of ck_pool.c's threads. pipeline.py runs the step on them.

What has no C block is said here, once (`*_in_c` return the reason, None when C runs it).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .kernels import ffi, lib
from .kvcache import check_memory
from .quant import Q4Tensor, Q6Tensor, Q8Tensor, padded_cols
from .routing import _EXP2_TABLE

_PAIRS_MAX = 512            # rows of the expert block's intermediate per piece (~6 MB)


# ----------------------------------------------------------------------------- C structs

class Keep:
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


def is_q(w) -> bool:
    return isinstance(w, (Q4Tensor, Q6Tensor, Q8Tensor))


def set_mat(keep: Keep, m, w) -> None:
    if isinstance(w, (Q4Tensor, Q6Tensor)):
        m.kind = lib.CK_W_Q4 if isinstance(w, Q4Tensor) else lib.CK_W_Q6
        m.zeros = keep.buf(w.zeros, "uint8_t *")
    else:
        m.kind, m.zeros = lib.CK_W_Q8, ffi.NULL
    m.data = keep.buf(w.data, "void *")
    m.scales = keep.buf(w.scales, "float *")
    m.rows, m.cols, m.group = w.rows, w.cols, w.group


def set_ffn(keep: Keep, dst, ffn) -> None:
    for name in ("w1", "w3", "w2"):
        set_mat(keep, getattr(dst, name), getattr(ffn, name))


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


_MLA_DEQUANT_BUDGET = 256 << 20   # bytes of float W_UK / W_UV kept for the C MLA blocks


def mla_in_c(model, lw, dequantized: int) -> Optional[str]:
    a = lw.attn
    if model.act != "int8":
        return "float activations"
    if a.act_scales:
        return "AWQ activation scales"
    names = ("wq_a", "wq_b", "wkv_a", "wo") if a.wq is None else ("wq", "wkv_a", "wo")
    if not all(is_q(getattr(a, n)) for n in names):
        return "MLA weights not stored as q4/q6/q8"
    if dequantized > _MLA_DEQUANT_BUDGET:
        return "MLA: float W_UK/W_UV over budget (the reference block dequantizes per call)"
    return None


def attention_in_c(model, lw) -> Optional[str]:
    cfg, a = model.cfg, lw.attn
    if model.act != "int8":
        return "float activations"
    if a.act_scales:
        return "AWQ activation scales"
    if not all(is_q(getattr(a, n)) for n in ("wq", "wk", "wv", "wo")):
        return "attention weights not stored as q4/q6/q8"
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

class Scratch:
    """The step's buffers, grown (never per token) to the largest step seen."""

    def __init__(self, model):
        cfg, w = model.cfg, model.w
        self.cfg = cfg
        H = cfg.hidden_size
        groups, hld, hcp, ffns = {64}, 64, 64, []
        for lw in w.layers:
            for n in ("wq", "wk", "wv", "wo"):
                m = getattr(lw.attn, n, None)
                if is_q(m):
                    groups.add(m.group)
            ffns += [f for f in (lw.dense, lw.shared) if f is not None]
            ffns += [ex.ffn for ex in lw.experts if ex.ffn is not None]
        if is_q(w.lm_head):
            groups.add(w.lm_head.group)
        for f in ffns:
            if isinstance(f.w1, Q4Tensor) and isinstance(f.w2, Q4Tensor):
                groups.update((f.w1.group, f.w2.group))
                hld = max(hld, -(-f.w1.rows // 64) * 64)
                hcp = max(hcp, padded_cols(f.w2.cols, f.w2.group))
        self.hld, self.hcp = hld, hcp
        cols = [H, cfg.num_heads * cfg.head_size]
        self.mla_per = 0
        if cfg.attention == "mla":
            NH, N, R, V, r = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                              cfg.v_head_dim, cfg.kv_lora_rank)
            q = cfg.q_lora_rank or 0
            self.mla_per = NH * (N + R) + q + r + R + 2 * NH * r + NH * V    # ck_step_mla_floats
            cols += [q, NH * V]
            for lw in w.layers:
                for n in ("wq", "wq_a", "wq_b", "wkv_a", "wo"):
                    m = getattr(lw.attn, n, None)
                    if is_q(m):
                        groups.add(m.group)
        self.cp_max = max(padded_cols(c, g) for g in groups for c in cols if c)
        self.E = max([lw.router.shape[0] for lw in w.layers if lw.kind == "moe"], default=1)
        self.nl = len(w.layers)
        self.s = ffi.new("ck_sscratch *")
        self.s.threads = 0
        self.n_max = 0
        self.kmax = 0
        self.slots = 0
        self._keep = Keep()
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
            + 2 * n * cp * 2 + pairs * (cp + 4 * self.hld + 2 * self.hcp) + (pairs + 16 * (E + 2)) * 2 * max(cp, self.hcp)
        if need > 64 << 20:
            check_memory(need, f"the forward scratch of a {n}-token step")
        k, s = Keep(), self.s
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
        s.mla_per_token = self.mla_per
        s.mla = k.buf(z(max(n * self.mla_per, 1), np.float32), "float *")
        s.pairs_max = pairs
        s.gq = k.buf(z(pairs * cp, np.int8), "int8_t *")
        s.gs = k.buf(z(pairs * cp // 64, np.float32), "float *")
        s.gsum = k.buf(z(pairs * cp // 64, np.int32), "int32_t *")
        s.h = k.buf(z(pairs * self.hld, np.float32), "float *")
        s.hq = k.buf(z(pairs * self.hcp, np.int8), "int8_t *")
        s.hs = k.buf(z(pairs * self.hcp // 64, np.float32), "float *")
        s.hsum = k.buf(z(pairs * self.hcp // 64, np.int32), "int32_t *")
        s.hld, s.hcp = self.hld, self.hcp
        # the expert block's activation panels (AVX-512 batches, ck_step_moe.c): a piece's
        # pairs, each job's rounded up to 16 tokens
        s.p_cp = max(cp, self.hcp)
        s.p_rows = pairs + 16 * (E + 2)
        s.pq = k.buf(z(s.p_rows * s.p_cp, np.uint8), "uint8_t *")
        s.ps = k.buf(z(s.p_rows * s.p_cp // 64, np.float32), "float *")
        s.counts = k.buf(z(2 * E + 1, np.int64), "int64_t *")
        s.jobs_max = E + 2
        s.jobs = k.buf(z((E + 2) * lib.ck_step_job_bytes(), np.uint8), "void *")
        self.tok = z((n, lib.CK_TOK_COLS), np.int64)      # ck.h: a token's position and KV cache
        self.kt = z(n, np.int32)
        self.kt_layer = z(n, np.int32)                     # a plugin's k for one layer
        self.logits = z((self.nl, n, E), np.float32)       # per layer: the trace's arrays
        self.dense_ids = z((n, 1), np.int64)
        self.dense_w = np.ones((n, 1), np.float32)
        self.head_x = z((n, H), np.float32)
        self.p_x = ffi.cast("float *", ffi.from_buffer(self.x))
        self.p_xn = ffi.cast("float *", ffi.from_buffer(self.xn))
        self.p_tok = ffi.cast("int64_t *", ffi.from_buffer(self.tok))
        self.p_kt = ffi.cast("int32_t *", ffi.from_buffer(self.kt))
        self.p_kt_layer = ffi.cast("int32_t *", ffi.from_buffer(self.kt_layer))
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
        n, s, k = self.n_max, self.s, Keep()
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

class SetTables:
    """What depends on the expert set: per MoE layer its router and its expert table."""

    def __init__(self, model, es):
        self.es = es
        self.generation = es.generation
        self.keep = keep = Keep()
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
            rt.scoring = (lib.CK_ROUTE_SIGMOID if cfg.scoring_func == "sigmoid" else
                          lib.CK_ROUTE_FIXED if model.engine.routing == "fixed" else lib.CK_ROUTE_FLOAT)
            rt.select_bias = keep.f32(es.select_bias[L])
            rt.n_group, rt.topk_group = cfg.n_group, cfg.topk_group
            rt.exp2_q30 = self.exp2
            table = keep.new("ck_ffn[]", max(len(experts), 1))
            custom, refs = set(), set()
            # one C call quantizes xn once per step for every expert of the layer: an
            # expert whose gate/up group differs from the layer's (a hot-plugged INT4
            # expert converted with another group size) runs the reference block
            lw_ffn = lw.shared if lw.shared is not None else next(
                (ex.ffn for ex in lw.experts if ex.ffn is not None), None)
            group = getattr(getattr(lw_ffn, "w1", None), "group", None)
            for e, ex in enumerate(experts):
                if ex is None:
                    continue
                if ex.ffn is None:                      # hot-plugged code: ffn_forward
                    custom.add(e)
                elif ffn_in_c(ex.ffn, model.act) is not None or \
                        (group is not None and ex.ffn.w1.group != group):
                    refs.add(e)                         # the reference block runs it
                else:
                    set_ffn(keep, table[e], ex.ffn)
            self.layers[L] = {"router": rt, "table": table, "n": len(experts),
                              "custom": frozenset(custom), "ref": frozenset(refs),
                              "experts": experts, "slots": router.shape[0],
                              "select_bias": es.select_bias[L],
                              # under a budget: what each table entry points at now
                              "bound": {}, "bound_keep": {},
                              "token": object()}     # which tables a layer's block holds


def _rows(a: np.ndarray, n: int, k: int) -> np.ndarray:
    """The contiguous [n, k] array at the start of buffer `a` (the C calls' layout)."""
    return a.reshape(-1)[:n * k].reshape(n, k)
