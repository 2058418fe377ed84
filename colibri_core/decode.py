"""The decode fast path: one token of one sequence through the model in a few C calls.

`Model.forward` is the general path (any batch, every hook, every weight type). A decode
step of the common case -- one sequence, one new token, int8 activations, q4/q8 weights,
fixed-point softmax routing, no hook that needs the layer's hidden state -- instead runs
here: per layer one C call for the attention block, one for the routing and one for the
FFN block (ck_decode.c), whose parallel loops run on the work-stealing pool of
ck_pool.c. Buffers are allocated once per plan, so a decode step allocates nothing
(checked with tracemalloc in tests/test_decode.py).

A plan is built per expert set (hot-plugging swaps the set between tokens). When the
model or the settings need the general path, building it raises `Unsupported`, and
`Model.decode_plan()` returns that reason instead of a plan; `Model.decode_step` then
uses `forward`.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .kernels import ffi, lib
from .quant import Q4Tensor, Q8Tensor, padded_cols
from . import ops
from .routing import _EXP2_TABLE, LayerTrace, Routing, route

_ERRORS = {1: "more than two activation group sizes in one call",
           2: "decode scratch too small", 3: "non-finite router logits"}


class Unsupported(Exception):
    """The model or settings need the general path (the message says why)."""


def _buf(keep: list, a: np.ndarray, ctype: str):
    if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
        a = np.ascontiguousarray(a)
    keep.append(a)
    return ffi.cast(ctype, ffi.from_buffer(a))


def _mat(keep: list, w, what: str):
    m = ffi.new("ck_mat *")
    if isinstance(w, Q4Tensor):
        m.kind, m.zeros = lib.CK_W_Q4, _buf(keep, w.zeros, "uint8_t *")
    elif isinstance(w, Q8Tensor):
        m.kind, m.zeros = lib.CK_W_Q8, ffi.NULL
    else:
        raise Unsupported(f"{what} is stored as {getattr(w, 'dtype', type(w).__name__)}, not q4/q8")
    m.data = _buf(keep, w.data, "void *")
    m.scales = _buf(keep, w.scales, "float *")
    m.rows, m.cols, m.group = w.rows, w.cols, w.group
    keep.append(m)
    return m


def _set_ffn(keep: list, dst, ffn, what: str) -> None:
    if ffn.act_scales:
        raise Unsupported(f"{what} has AWQ activation scales")
    for name in ("w1", "w3", "w2"):
        w = getattr(ffn, name)
        if not isinstance(w, Q4Tensor):
            raise Unsupported(f"{what}.{name} is not q4")
        src = _mat(keep, w, f"{what}.{name}")
        setattr(dst, name, src[0])


def _f32(keep: list, a) -> "ffi.CData":
    if a is None:
        return ffi.NULL
    return _buf(keep, np.asarray(a, np.float32).reshape(-1), "float *")


class ThreadControl:
    """Whether the decode path's second thread is really running, step by step.

    On a machine shared with other jobs, the CPU a second thread needs is often taken:
    measured on 2 CPUs with one busy, 2 threads decode at 14.8 ms/token against 6.5 ms on
    one. The pool (ck_pool.c) reports, per step, the chunks the other threads ran and how
    long the caller waited for them; when they did less than a quarter of the work, or the
    caller waited more than a quarter of the time, for three steps running, the next steps
    run on the caller's thread alone, and a single step on all threads probes again after
    4, 8, ... 512 steps (doubling while the probes fail). A short disturbance thus costs
    a few single-threaded steps (measured: a 16-step first backoff put 16 tokens of a
    quiet run at 1-thread speed after a 2-step hiccup)."""

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

    def read_stats(self) -> None:
        lib.ck_pool_stats(self.p_stats)

    def take_over(self, old: "ThreadControl") -> None:
        """Continue where `old` (the previous plan's) was: what it measured is about the
        machine, not about the expert set (a new plan starting over would run its first
        steps on threads that may not get a CPU)."""
        self.s.threads = old.s.threads
        self.bad, self.backoff, self.countdown = old.bad, old.backoff, old.countdown
        self.steps, self.single_steps = old.steps, old.single_steps

    def after_step(self) -> None:
        self.steps += 1
        self.read_stats()
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


class DecodePlan:
    """Everything one decode step needs, prepared for one model and one expert set."""

    def __init__(self, model, es):
        self.model = model
        self.es = es
        self.version = es.version
        self._keep: list = []                  # arrays and structs the C side points into
        self._build(model, es)

    @staticmethod
    def check_settings(model) -> Optional[str]:
        """Why the settings need the general path (None: they do not)."""
        cfg, eng = model.cfg, model.engine
        if eng.activations != "int8":
            return "float activations"
        if eng.routing != "fixed":
            return "float routing"
        if cfg.attention == "mla":
            return "MLA attention"
        if cfg.qk_norm != "none":
            return "q/k norms"
        if cfg.moe_layers and (cfg.scoring_func != "softmax" or (cfg.n_group > 1 and cfg.topk_group < cfg.n_group)):
            return "sigmoid or group-limited routing"
        if model.residency.active:
            return "memory budget (the expert cache runs in the general path)"
        return None

    def _build(self, model, es) -> None:
        why = self.check_settings(model)
        if why:
            raise Unsupported(why)
        cfg, w, keep = model.cfg, model.w, self._keep
        H, NH, NKV, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        inv_freq, factor = model._inv_freq, model._rope_factor
        if len(inv_freq) * 2 != D:
            raise Unsupported("partial rotary embedding")
        p_inv_freq = _buf(keep, np.asarray(inv_freq, np.float64), "double *")
        self.eps = float(cfg.rms_norm_eps)
        exp2 = _buf(keep, _EXP2_TABLE.astype(np.int64), "int64_t *")
        self.layers = []
        groups, hld, hcp = set(), 64, 64
        # the C calls quantize one activation vector for at most two group sizes
        attn_groups = {getattr(lw.attn, n).group for lw in w.layers for n in ("wq", "wk", "wv")
                       if hasattr(getattr(lw.attn, n), "group")}
        if len(attn_groups) > 2:
            raise Unsupported(f"q/k/v matrices with {len(attn_groups)} group sizes")
        for lw in w.layers:
            a = lw.attn
            if a.act_scales:
                raise Unsupported(f"layer {lw.index} attention has AWQ activation scales")
            al = ffi.new("ck_attn_layer *")
            keep.append(al)
            for name in ("wq", "wk", "wv", "wo"):
                m = _mat(keep, getattr(a, name), f"layer {lw.index} {name}")
                setattr(al, name, m[0])
                groups.add(m.group)
            al.bq, al.bk, al.bv = _f32(keep, a.bq), _f32(keep, a.bk), _f32(keep, a.bv)
            al.norm, al.ffn_norm = _f32(keep, lw.attn_norm), _f32(keep, lw.ffn_norm)
            al.hidden, al.nh, al.nkv, al.d = H, NH, NKV, D
            al.eps, al.inv_freq, al.rope_factor = self.eps, p_inv_freq, float(factor)
            block = ffi.new("ck_ffn_block *")
            keep.append(block)
            block.hidden = H
            entry = {"attn": al, "block": block, "index": lw.index, "moe": lw.kind == "moe"}
            ffns = []
            if lw.kind == "dense":
                table = ffi.new("ck_ffn[1]")
                _set_ffn(keep, table[0], lw.dense, f"layer {lw.index} dense FFN")
                ffns.append(lw.dense)
                entry["table"] = table
            else:
                experts = es.experts[lw.index]
                if es.select_bias[lw.index] is not None:
                    raise Unsupported(f"layer {lw.index} has a selection bias")
                table = ffi.new("ck_ffn[]", len(experts))
                custom = []
                for e, ex in enumerate(experts):
                    if ex is None:
                        continue
                    if ex.ffn is None:               # hot-plugged custom code
                        custom.append(e)
                        continue
                    _set_ffn(keep, table[e], ex.ffn, f"layer {lw.index} expert {e}")
                    ffns.append(ex.ffn)
                entry["table"] = table
                entry["custom"] = frozenset(custom)
                entry["experts"] = experts
                router = np.ascontiguousarray(es.routers[lw.index], np.float32)
                rt = ffi.new("ck_router *")
                keep.append(rt)
                rt.weight = _buf(keep, router, "float *")
                rt.bias = _f32(keep, es.logit_bias[lw.index])
                rt.e, rt.h = router.shape[0], H
                rt.norm_topk = bool(cfg.norm_topk_prob)
                rt.scaling = float(cfg.routed_scaling_factor)
                rt.exp2_q30 = exp2
                entry["router"] = rt
                entry["slots"] = router.shape[0]
                if lw.shared is not None:
                    sh = ffi.new("ck_ffn *")
                    _set_ffn(keep, sh, lw.shared, f"layer {lw.index} shared expert")
                    keep.append(sh)
                    block.shared = sh
                    ffns.append(lw.shared)
                    block.shared_gate = _f32(keep, lw.shared_gate)
            if len({f.w1.group for f in ffns}) > 2:
                raise Unsupported(f"layer {lw.index}: experts with more than two group sizes")
            for f in ffns:
                groups.update((f.w1.group, f.w2.group))
                hld = max(hld, -(-f.w1.rows // 64) * 64)
                hcp = max(hcp, padded_cols(f.w2.cols, f.w2.group))
            block.table = entry["table"]
            self.layers.append(entry)
        self.head = _mat(keep, w.lm_head, "lm_head")
        groups.add(self.head.group)
        self.final_norm = _f32(keep, w.final_norm)
        self.embed = w.embed
        self._embed_mat = (_mat(keep, w.embed, "embed")
                           if isinstance(w.embed, (Q4Tensor, Q8Tensor)) else None)
        # buffers
        cp_max = max(padded_cols(c, g) for g in groups for c in (H, NH * D))
        self.x = np.zeros(H, np.float32)
        self.xn = np.zeros(H, np.float32)
        self.logits = np.zeros(cfg.vocab_size, np.float32)
        E = max([e["slots"] for e in self.layers if e["moe"]], default=1)
        # the routing of the last step, per layer (Model.last_routing reads it on demand)
        nl = len(self.layers)
        self.router_logits = np.zeros((nl, E), np.float32)
        self.route_ids = np.zeros((nl, 256), np.int64)
        self.route_w = np.zeros((nl, 256), np.float32)
        self.last_k = 0
        self.ids = np.zeros(256, np.int64)          # custom experts taken out (_run_custom)
        max_ffns = min(E, 256) + 1
        s = ffi.new("ck_dscratch *")
        keep.append(s)
        s.xn = _buf(keep, np.zeros(H, np.float32), "float *")
        for p in ("a", "b"):
            setattr(s, p + "q", _buf(keep, np.zeros(cp_max, np.int8), "int8_t *"))
            setattr(s, p + "s", _buf(keep, np.zeros(cp_max // 64, np.float32), "float *"))
            setattr(s, p + "sum", _buf(keep, np.zeros(cp_max // 64, np.int32), "int32_t *"))
        s.cp_max = cp_max
        s.q = _buf(keep, np.zeros(NH * D, np.float32), "float *")
        s.k = _buf(keep, np.zeros(NKV * D, np.float32), "float *")
        s.v = _buf(keep, np.zeros(NKV * D, np.float32), "float *")
        s.att = _buf(keep, np.zeros(NH * D, np.float32), "float *")
        s.cos = _buf(keep, np.zeros(D // 2, np.float32), "float *")
        s.sin = _buf(keep, np.zeros(D // 2, np.float32), "float *")
        s.max_len = 0
        s.h = _buf(keep, np.zeros(max_ffns * hld, np.float32), "float *")
        s.hq = _buf(keep, np.zeros(max_ffns * hcp, np.int8), "int8_t *")
        s.hs = _buf(keep, np.zeros(max_ffns * hcp // 64, np.float32), "float *")
        s.hsum = _buf(keep, np.zeros(max_ffns * hcp // 64, np.int32), "int32_t *")
        s.max_ffns, s.hld, s.hcp = max_ffns, hld, hcp
        s.threads = 0
        self.s = s
        self.control = ThreadControl(s)
        self.nh = NH
        self.p_x = ffi.cast("float *", ffi.from_buffer(self.x))
        self.p_xn = ffi.cast("float *", ffi.from_buffer(self.xn))
        self.p_logits = ffi.cast("float *", ffi.from_buffer(self.logits))
        self.p_ids = ffi.cast("int64_t *", ffi.from_buffer(self.ids))
        # a dense layer is a table of one FFN, chosen with weight 1
        self.p_dense_ids = _buf(keep, np.zeros(1, np.int64), "int64_t *")
        self.p_dense_w = _buf(keep, np.ones(1, np.float32), "float *")
        for i, L in enumerate(self.layers):
            L["p_rl"] = ffi.cast("float *", ffi.from_buffer(self.router_logits[i]))
            L["p_ids"] = ffi.cast("int64_t *", ffi.from_buffer(self.route_ids[i]))
            L["p_w"] = ffi.cast("float *", ffi.from_buffer(self.route_w[i]))
            L["row"] = i
        self.H = H
        self._cache_ptrs: dict = {}

    def carry_over(self, old: "DecodePlan") -> None:
        """Take over what `old`, the plan this one replaces, learned: thread control, the
        attention scratch's size and the current KV cache's pointers (all independent of
        the expert set), so the first step after an expert-set change runs like the ones
        before it."""
        self.control.take_over(old.control)
        self._scores(old.s.max_len)
        self._cache_ptrs = old._cache_ptrs

    # ------------------------------------------------------------------ per step
    def _scores(self, length: int) -> None:
        """Grow the attention scores scratch to `length` positions (once per size)."""
        if self.s.max_len < length:
            n = max(length, 2 * self.s.max_len, 256)
            self.s.scores = _buf(self._keep, np.zeros(self.nh * n, np.float32), "float *")
            self.s.max_len = n

    def _layer_caches(self, cache) -> list:
        got = self._cache_ptrs.get(id(cache))
        if got is None or got[0] is not cache:
            k, v = cache.k, cache.v
            got = (cache, [(ffi.cast("float *", ffi.from_buffer(k[L])),
                            ffi.cast("float *", ffi.from_buffer(v[L]))) for L in range(k.shape[0])])
            self._cache_ptrs = {id(cache): got}      # one sequence at a time
        return got[1]

    def step(self, token: int, cache, k: int) -> np.ndarray:
        """Logits [V] of `token` appended to `cache` (the returned array is this plan's
        buffer: read it before the next step)."""
        model, s, x = self.model, self.s, self.x
        pos = cache.length
        if pos >= cache.capacity:
            from .errors import RequestError
            raise RequestError(f"sequence needs {pos + 1} positions, its cache holds {cache.capacity}")
        if self._embed_mat is not None:
            lib.ck_mat_row(self._embed_mat, int(token), self.p_x)
        else:                                     # f32 / f16 / bf16 rows: the model's own
            x[:] = model._embed(np.array([token], np.int64))[0]
        self._scores(pos + 1)
        caches = self._layer_caches(cache)
        res = model.residency
        hooks = model.hooks
        routing_hook = hooks.routing if hooks is not None else None
        for i, L in enumerate(self.layers):
            kc, vc = caches[L["index"]]
            self._check(lib.ck_decode_attention(L["attn"], self.p_x, kc, vc, pos, self.p_xn, s))
            if not L["moe"]:
                self._check(lib.ck_decode_ffn(L["block"], self.p_dense_ids, self.p_dense_w, 1,
                                              self.p_xn, self.p_x, s))
                continue
            rc = lib.ck_decode_route(L["router"], self.p_xn, k, L["p_rl"], L["p_ids"], L["p_w"])
            if rc == 3:
                self._route_nonfinite(L, k)
            else:
                self._check(rc)
            if routing_hook is not None:
                self._routing_hook(routing_hook, L, k)
            if not res.all_prefetched(L["index"]):
                res.acquire(L["index"], self.route_ids[L["row"], :k], L["experts"])
            ids = L["p_ids"]
            if L["custom"]:
                ids = self._run_custom(L, k)
            self._check(lib.ck_decode_ffn(L["block"], ids, L["p_w"], k, self.p_xn, self.p_x, s))
        self.last_k = k
        cache.length = pos + 1
        self._check(lib.ck_decode_head(self.head, self.final_norm, self.eps, self.p_x,
                                       self.p_logits, s))
        self.control.after_step()
        return self.logits

    def _route_nonfinite(self, L, k: int) -> None:
        """A NaN/Inf router logit: the general router's fallback (uniform weights over the
        first k experts), so both paths agree."""
        logits = ops.router_logits(self.xn[None, :], np.asarray(self.es.routers[L["index"]], np.float32),
                                   self.es.logit_bias[L["index"]])
        r = route(logits, np.array([k]), mode="fixed", scoring="softmax",
                  norm_topk_prob=self.model.cfg.norm_topk_prob,
                  scaling=self.model.cfg.routed_scaling_factor)
        i = L["row"]
        self.router_logits[i, :logits.shape[1]] = logits[0]
        self.route_ids[i, :k] = r.ids[0]
        self.route_w[i, :k] = r.weights[0]

    def _routing_hook(self, hook, L, k: int) -> None:
        """colibri_routing on this layer's choice, as the general path calls it (observers
        see the plan's buffers; an override, checked by the same PluginGuard.check_routing
        as there, replaces the choice; a narrower one leaves the other slots unused)."""
        i = L["row"]
        ids, w = self.route_ids[i:i + 1, :k], self.route_w[i:i + 1, :k]
        logits = self.router_logits[i:i + 1, :L["slots"]]
        p = ops.softmax(logits.astype(np.float64))
        scores = np.take_along_axis(p, ids, 1).astype(np.float32)
        override = hook(layer=L["index"], expert_ids=ids, weights=w, scores=scores, logits=logits)
        if override is not None:
            model = self.model
            new_ids, new_w = model.hooks.guard.check_routing(
                override, L["index"], 1, k, L["experts"], model.cfg.num_experts)
            n = new_ids.shape[1]
            self.route_ids[i, :n] = new_ids[0]
            self.route_w[i, :n] = new_w[0]
            self.route_ids[i, n:k] = -1
            self.route_w[i, n:k] = 0.0

    def _run_custom(self, L, k: int):
        """Hot-plugged experts without INT4 weights run their own ffn_forward (through the
        general path's wrapper, which contains failures); they are then taken out of the
        C call's choice. Returns the ids the C call runs."""
        i = L["row"]
        ids = self.ids
        ids[:k] = self.route_ids[i, :k]
        for j in range(k):
            e = int(ids[j])
            if e in L["custom"]:
                out = np.zeros((1, self.H), np.float32)
                self.model._run_expert(L["experts"][e], self.xn[None, :].copy(), out,
                                       self.route_w[i, j:j + 1])
                self.x += out[0]
                ids[j] = -1
        return self.p_ids

    def traces(self) -> list:
        """The last step's routing as the general path records it (routing.LayerTrace)."""
        out, k = [], self.last_k
        for L in self.layers:
            if not L["moe"]:
                continue
            i = L["row"]
            logits = self.router_logits[i:i + 1, :L["slots"]].copy()
            p = ops.softmax(logits.astype(np.float64))
            ids = self.route_ids[i:i + 1, :k].copy()
            scores = np.take_along_axis(p, np.maximum(ids, 0), 1).astype(np.float32)
            scores[ids < 0] = 0.0                  # slots a routing override left unused
            out.append(LayerTrace(L["index"], Routing(ids, self.route_w[i:i + 1, :k].copy(),
                                                      scores), logits))
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"colibri decode kernel: {_ERRORS.get(rc, rc)}")
