"""The pipeline's C structures: the descriptors of matrices, FFNs, attention layers and
routers that ck_step.c reads, the tables that depend on the expert set, the step's scratch
buffers and the thread control of ck_pool.c's threads. pipeline.py runs the step on them.

Every block runs in C; what the C blocks cannot run is refused at load (ConfigError,
naming the field): see set_ffn and check_attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError
from ..kernels import ffi, lib
from ..model.kvcache import check_memory
from ..format.mxfp4 import MX_GROUP, MXFP4Tensor
from ..format.q5 import Q5Tensor
from ..format.quant import Q4Tensor, Q6Tensor, Q8Tensor, padded_cols
from ..model.routing import _EXP2_TABLE

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
    return isinstance(w, (Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor, MXFP4Tensor))


_FLOAT_KINDS = {np.dtype(np.float32): lib.CK_W_F32, np.dtype(np.float16): lib.CK_W_F16,
                np.dtype(np.uint16): lib.CK_W_BF16}     # bf16 stored as uint16 (ops.float_matrix)


def _shape(w) -> tuple:
    return (w.rows, w.cols) if is_q(w) else np.shape(w)


def set_mat(keep: Keep, m, w, act_scale=None, what: str = "matrix") -> None:
    """ck_mat m describes w (q4 / q6 / q8, or a float32 / float16 / bf16 array), with its
    AWQ activation scale (the input is divided by it) or none."""
    if isinstance(w, MXFP4Tensor):             # exponents in the zero points' place (ck.h)
        m.kind, m.scales = lib.CK_W_MXFP4, ffi.NULL
        m.data, m.zeros = keep.buf(w.data, "void *"), keep.buf(w.exps, "uint8_t *")
        m.rows, m.cols, m.group = w.rows, w.cols, MX_GROUP
        m.act_scale = keep.f32(act_scale)
        return
    if isinstance(w, Q5Tensor) and (what == "embed" or what.endswith("wkv_b")):
        raise ConfigError(f"{what}: q5 runs in matrix products only (FFNs, attention, lm_head); "
                          f"the rows read one at a time need q4, q6, q8 or floats (re-convert)")
    if isinstance(w, (Q4Tensor, Q5Tensor, Q6Tensor)):
        m.kind = {Q4Tensor: lib.CK_W_Q4, Q5Tensor: lib.CK_W_Q5}.get(type(w), lib.CK_W_Q6)
        m.zeros = keep.buf(w.zeros, "uint8_t *")
    elif isinstance(w, Q8Tensor):
        m.kind, m.zeros = lib.CK_W_Q8, ffi.NULL
    else:
        a = np.asarray(w)
        kind = _FLOAT_KINDS.get(a.dtype)
        if kind is None or a.ndim != 2:
            raise ConfigError(f"{what}: weights of type {a.dtype} {list(a.shape)} are not "
                              f"supported (q4, q6, q8, f32, f16 or bf16 matrices)")
        m.kind, m.zeros, m.scales = kind, ffi.NULL, ffi.NULL
        m.data = keep.buf(a, "void *")
        m.rows, m.cols = a.shape
        m.group = 64
        m.act_scale = keep.f32(act_scale)
        return
    m.data = keep.buf(w.data, "void *")
    m.scales = keep.buf(w.scales, "float *")
    m.rows, m.cols, m.group = w.rows, w.cols, w.group
    m.act_scale = keep.f32(act_scale)


def set_ffn(keep: Keep, dst, ffn, what: str = "FFN") -> None:
    """ck_ffn dst describes ffn. Gate and up read one input in the expert block: an FFN
    whose gate and up inputs differ (AWQ scales, or floats beside quantized weights) is
    refused."""
    sc = ffn.act_scales
    s1, s3 = sc.get("w1"), sc.get("w3")
    if s1 is not s3 and (s1 is None or s3 is None or not np.array_equal(s1, s3)):
        raise ConfigError(f"{what}: act_scales w1 and w3 differ (gate and up must share "
                          f"their input scale)")
    if is_q(ffn.w1) != is_q(ffn.w3) or (is_q(ffn.w1) and ffn.w1.group != ffn.w3.group):
        raise ConfigError(f"{what}: w1 and w3 differ in number type or group size "
                          f"(gate and up must share their input)")
    set_mat(keep, dst.w1, ffn.w1, s1, what + ".w1")
    set_mat(keep, dst.w3, ffn.w3, None, what + ".w3")
    dst.w3.act_scale = dst.w1.act_scale                 # one pointer: one input
    set_mat(keep, dst.w2, ffn.w2, sc.get("w2"), what + ".w2")
    b = ffn.biases
    dst.b1, dst.b3, dst.b2 = (keep.f32(b.get(m)) for m in ("w1", "w3", "w2"))


_MLA_DEQUANT_BUDGET = 256 << 20   # bytes of float W_UK / W_UV kept for the C MLA blocks;
                                  # past it, the blocks read wkv_b's quantized rows


def check_attention(model, lw) -> None:
    """Refuse, naming the field, what the attention block cannot run."""
    cfg, a = model.cfg, lw.attn
    if cfg.attention == "mla" and cfg.norm_type != "rms":
        raise ConfigError(f"config.json: norm_type {cfg.norm_type!r} with attention 'mla': the "
                          f"MLA block runs RMSNorms only")
    if cfg.attention != "mla":
        if cfg.head_size % 2:
            raise ConfigError(f"head_size {cfg.head_size} is odd: the rotate-half rope needs "
                              f"an even head size")
        f32 = model.act != "int8"
        keys = {(64 if f32 or not is_q(m) else m.group, id(a.act_scales.get(n)))
                for n, m in (("wq", a.wq), ("wk", a.wk), ("wv", a.wv))
                if is_q(m) or f32 or a.act_scales.get(n) is not None}
        if len(keys) > 2:
            raise ConfigError(f"layer {lw.index}: wq, wk, wv need more than two kinds of "
                              f"input (group sizes / act_scales); at most two are supported")


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
        self.cfg_act_f32 = model.act != "int8"
        H = cfg.hidden_size
        groups, ffns = {64, 128, 256}, []     # (and hot-plugged experts' usual groups)
        self.float_rows = model.act != "int8"  # af / bf / gf: float rows are needed
        for lw in w.layers:
            self.float_rows |= bool(getattr(lw.attn, "act_scales", None))   # AWQ: divided rows
            for n in ("wq", "wk", "wv", "wo"):
                m = getattr(lw.attn, n, None)
                if is_q(m):
                    groups.add(m.group)
            ffns += [f for f in (lw.dense, lw.shared) if f is not None]
            ffns += [ex.ffn for ex in lw.experts if ex.ffn is not None]
        if is_q(w.lm_head):
            groups.add(w.lm_head.group)
        self.hld = self.hcp = 64
        if cfg.moe_layers:                      # copy-in experts are read later: the config's
            I = cfg.expert_intermediate         # size, any of the usual groups
            self.hld, self.hcp = -(-I // 64) * 64, max(padded_cols(I, g) for g in groups)
        self._ffn_sizes(ffns)
        for f in ffns:
            groups.update(m.group for m in (f.w1, f.w2) if is_q(m))
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

    def _ffn_sizes(self, ffns) -> bool:
        """Grow hld / hcp / cp_max (and float_rows) to what `ffns` need (before cp_max is
        set: hld, hcp and float_rows only); True if anything grew."""
        hld, hcp, fr, cp = self.hld, self.hcp, self.float_rows, getattr(self, "cp_max", None)
        for f in ffns:
            hld = max(hld, -(-_shape(f.w1)[0] // 64) * 64)
            hcp = max(hcp, padded_cols(_shape(f.w2)[1], f.w2.group if is_q(f.w2) else 64))
            fr |= bool(f.act_scales) or not (is_q(f.w1) and is_q(f.w2))
            if cp is not None and is_q(f.w1):       # its input quantized with its own group
                cp = max(cp, padded_cols(self.cfg.hidden_size, f.w1.group))
        grew = (hld, hcp, fr, cp) != (self.hld, self.hcp, self.float_rows, getattr(self, "cp_max", None))
        self.hld, self.hcp, self.float_rows = hld, hcp, fr
        if cp is not None:
            self.cp_max = cp
        return grew

    def fit_ffns(self, ffns) -> None:
        """Room for these FFNs too (a new expert set's), reallocating if they need more."""
        if self._ffn_sizes(ffns) and self.n_max:
            self._alloc(self.n_max, self.kmax)

    def grow_slots(self, slots: int) -> None:
        """The expert block's per-layer tables of `slots` router slots (hot-plugging adds
        slots)."""
        if slots > self.slots:
            self.slots = max(slots, self.E)
            self._alloc(self.n_max, self.kmax)

    def ensure(self, n: int, kmax: int) -> None:
        if n > self.n_max or kmax > self.kmax:
            self._alloc(max(n, self.n_max, 1), max(kmax, self.kmax, 1))

    def shrink(self, n: int = 64) -> bool:
        """Give back the buffers of steps larger than `n` tokens (they grow to the
        largest step and would stay: about 5 KiB per token on the built-in model); the
        next larger step grows them again. Between two steps only (Engine.trim_memory).
        True when anything was released."""
        if self.n_max <= n:
            return False
        self._alloc(n, max(self.kmax, 1))
        return True

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
        s.act_f32 = self.cfg_act_f32
        fz = (lambda m: k.buf(z(m, np.float32), "float *")) if self.float_rows else (lambda m: ffi.NULL)
        s.af, s.bf = fz(n * cp), fz(n * cp)
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
        s.gf = fz(pairs * cp)
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

@dataclass(slots=True, eq=False)
class StepLayer:
    """One layer of the pipeline, built once per model: its C descriptors (cffi pointers
    kept alive by the pipeline's Keep)."""

    index: int
    moe: bool
    lw: Any                        # weights.LayerWeights
    attn: Any = None               # ck_attn_layer *, or None for an MLA layer
    mla: Any = None                # ck_mla_layer *, or None
    block: Any = None              # ck_ffn_block *: the expert block (a dense layer's FFN)
    tables: Optional[object] = None  # the MoETables.token whose table `block` points at


@dataclass(slots=True, eq=False)
class MoETables:
    """What one MoE layer's step needs of an expert set (SetTables.layers[layer])."""

    router: Any                    # ck_router *
    table: Any                     # ck_ffn[] by expert id
    n: int                         # entries of `table`
    custom: frozenset              # ids of hot-plugged experts that bring only ffn_forward
    experts: list                  # the set's experts of this layer, by id
    slots: int                     # router slots (E)
    select_bias: Optional[np.ndarray]
    # under a budget: what each table entry points at now, and the Keep of its views
    bound: dict = field(default_factory=dict)
    bound_keep: dict = field(default_factory=dict)
    # which tables a layer's block holds (StepLayer.tables; not the tables themselves,
    # which would keep the set alive)
    token: object = field(default_factory=object)


class SetTables:
    """What depends on the expert set: per MoE layer its router and its expert table."""

    def __init__(self, model, es):
        self.es = es
        self.generation = es.generation
        self.keep = keep = Keep()
        cfg = model.cfg
        self.exp2 = keep.buf(_EXP2_TABLE.astype(np.int64), "int64_t *")
        self.layers: dict[int, MoETables] = {}
        self.ffns: list = []                            # the scratch must hold them
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
            rt.bias_on_probs = bool(cfg.select_bias_on_probs)
            rt.scoring = (lib.CK_ROUTE_SIGMOID if cfg.scoring_func == "sigmoid" else
                          lib.CK_ROUTE_SPARSEMIXER if cfg.scoring_func == "sparsemixer" else
                          lib.CK_ROUTE_FIXED if model.engine.routing == "fixed" else lib.CK_ROUTE_FLOAT)
            rt.jitter_eps = float(cfg.router_jitter_eps)
            rt.select_bias = keep.f32(es.select_bias[L])
            rt.n_group, rt.topk_group = cfg.n_group, cfg.topk_group
            rt.exp2_q30 = self.exp2
            table = keep.new("ck_ffn[]", max(len(experts), 1))
            custom = set()
            for e, ex in enumerate(experts):
                if ex is None:
                    continue
                if ex.ffn is not None:
                    set_ffn(keep, table[e], ex.ffn, f"expert {L}/{e}")
                elif hasattr(ex, "forward"):            # hot-plugged code: ffn_forward
                    custom.add(e)
                # else a copy-in expert (load_mode "copy"): bound to its frame when loaded
            self.ffns += [ex.ffn for ex in experts if ex is not None and ex.ffn is not None]
            self.layers[L] = MoETables(router=rt, table=table, n=len(experts),
                                       custom=frozenset(custom), experts=experts,
                                       slots=router.shape[0], select_bias=es.select_bias[L])


def _rows(a: np.ndarray, n: int, k: int) -> np.ndarray:
    """The contiguous [n, k] array at the start of buffer `a` (the C calls' layout)."""
    return a.reshape(-1)[:n * k].reshape(n, k)
