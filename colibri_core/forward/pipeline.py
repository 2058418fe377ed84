"""The one forward pipeline: n tokens of m sequences through the model, for prefill,
decode and scoring alike.

Per layer a fixed, small number of C calls (ck_step.c): the attention block, the router,
the expert block; then the lm_head. Between them, and only there, Python does what is not
arithmetic: the plugin hooks (free when no plugin implements them), the routing override
check, the memory budget's expert cache, hot-plugged experts that bring their own code.
Every step allocates nothing once its scratch has grown to the step's size.

Every configuration runs in these C calls: int8 or float activations, AWQ activation
scales, q4 / q6 / q8 or float-stored weights, experts of any group size; what they cannot
run is refused at load (steptables.set_ffn, check_attention). numpy is only the tests'
reference (reference.py). Every routing (fixed-point or float softmax, sigmoid
scores with the correction bias, group limits) is chosen in C; only tokens whose router
logits are not finite take routing.route's fallback.

Batch invariance: a token's logits do not depend on which other tokens share its step
(ck_step.c says how); the scheduler batches requests on it.

Shape legend: n tokens in the step, H hidden, E router slots, K the step's largest k.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ..model import ops
from ..kernels import ffi, lib
from .attnlayer import gqa_layer
from ..model.routing import LayerTrace, Routing
from .mixedsets import MixedTables, mixable, runs_of, trace_logits
from .moelayer import MoELayer
from .steptables import (_MLA_DEQUANT_BUDGET, Keep, _shape, Scratch, SetTables,
                         StepLayer, check_attention, set_ffn, set_mat)

log = logging.getLogger("colibri")

_ERRORS = {1: "more than two activation group sizes in one call",
           2: "step scratch too small", 3: "non-finite router logits",
           4: "no memory for attention scores"}


class Pipeline(MoELayer):
    """The forward of one Model (model.py): run() is every forward the engine does; the
    MoE layer's methods are moelayer.py's."""

    def __init__(self, model):
        self.model = model
        self.cfg = cfg = model.cfg
        w = model.w
        self.keep = keep = Keep()
        self.scratch = Scratch(model)
        self.eps = float(cfg.rms_norm_eps)
        inv_freq, factor = ops.rope_frequencies(cfg)
        p_inv = keep.buf(np.asarray(inv_freq, np.float64), "double *")
        # routed tokens per MoE layer and router slot, counted after the routing hook while
        # on (Engine.count_routed_tokens): a bincount per layer, no hook on the decode path
        self.routed: Optional[dict[int, np.ndarray]] = None
        self.layers: list[StepLayer] = []
        self.mla_bytes = 0                          # float W_UK / W_UV kept so far
        for lw in w.layers:
            check_attention(model, lw)
            L = StepLayer(index=lw.index, moe=lw.kind == "moe", lw=lw)
            if cfg.attention == "mla":
                L.mla = self._mla_layer(lw, p_inv, factor)
            else:
                L.attn = self._attn_layer(lw, p_inv, factor)
            block = L.block = keep.new("ck_ffn_block *")
            block.hidden, block.scale = cfg.hidden_size, cfg.residual_multiplier
            block.weight_input = lw.kind == "moe" and cfg.routing_scales_input   # Llama 4
            block.act = lib.CK_ACT_SWIGLU_CLAMPED if cfg.ffn_act == "swiglu_clamped" else lib.CK_ACT_SILU
            block.act_limit, block.act_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
            if lw.kind == "dense":
                t = keep.new("ck_ffn[1]")
                set_ffn(keep, t[0], lw.dense, f"layer {lw.index} dense FFN")
                block.table, block.n_table = t, 1
            elif lw.shared is not None:
                sh = keep.new("ck_ffn *")
                set_ffn(keep, sh, lw.shared, f"layer {lw.index} shared expert")
                block.shared = sh
                block.shared_gate = keep.f32(lw.shared_gate)
            self.layers.append(L)
        self.head = keep.new("ck_mat *")
        set_mat(keep, self.head, w.lm_head, what="lm_head")
        self.final_norm, self.final_norm_b = keep.f32(w.final_norm), keep.f32(w.final_norm_bias)
        self.head_b = keep.f32(w.lm_head_bias)      # Phi-3.5-MoE's lm_head bias, or NULL
        self.embed_mat = keep.new("ck_mat *")
        set_mat(keep, self.embed_mat, w.embed, what="embed")
        self._tables: Optional[SetTables] = None
        self._pinned: dict = {}                     # id(es) -> tables of an older, pinned set
        self._last_tables: Optional[SetTables] = None   # the last step's (the trace's)
        # several expert sets in one step (mixedsets.py): union tables per combination of
        # sets, and the last step's runs [(t0, t1, SetTables)] and union (None: one set)
        self._mixed: dict = {}
        self._runs: Optional[list] = None
        self._mix: Optional[MixedTables] = None
        self.passes = 0                             # run() calls: forward passes done
        self.mixed_passes = 0                       # of them, passes of several expert sets
        self.layers_run = 0                         # layers those passes ran
        self._cache_addr: dict = {}
        self._logits1 = None                        # the decode loop's logits buffer
        self.last_n = 0                             # tokens of the last step
        self.layer_k = [0] * len(self.layers)        # its k per layer (the arrays' layout)
        self.layer_width = [0] * len(self.layers)    # the choice's width (an override's)
        self.experts = self._experts    # the routed experts' executor (fleet/expertshard.py)

    def _attn_layer(self, lw, p_inv, factor):
        return gqa_layer(self.keep, self.cfg, lw, self.eps, p_inv, factor)

    def _mla_layer(self, lw, p_inv, factor):
        from ..model.mla import LORA_NORM_EPS, softmax_scale
        cfg, a, keep = self.cfg, lw.attn, self.keep
        m = keep.new("ck_mla_layer *")
        sc = a.act_scales
        names = ("wq", "wkv_a", "wo") if a.wq is not None else ("wq_a", "wq_b", "wkv_a", "wo")
        for n in names:
            set_mat(keep, getattr(m, n), getattr(a, n), sc.get(n), f"layer {lw.index} {n}")
        if a.wq is None:
            m.q_a_norm = keep.f32(a.q_a_norm)
            m.q_lora = cfg.q_lora_rank
        m.kv_a_norm = keep.f32(a.kv_a_norm)
        # W_UK / W_UV as float32 [nh, nope + v, r] (the act scale divided out) while they
        # fit the budget; past it the block dequantizes wkv_b's rows as it reads them
        s_b = sc.get("wkv_b")
        free = isinstance(a.wkv_b, np.ndarray) and a.wkv_b.dtype == np.float32 and s_b is None
        nbytes = 0 if free else 4 * int(np.prod(_shape(a.wkv_b)))
        if self.mla_bytes + nbytes <= _MLA_DEQUANT_BUDGET:
            self.mla_bytes += nbytes
            wkv_b = ops.float_matrix(a.wkv_b)
            m.wkv_b = keep.f32(wkv_b if s_b is None else wkv_b / np.asarray(s_b, np.float32))
        else:
            m.wkv_b = ffi.NULL
            set_mat(keep, m.wkv_b_q, a.wkv_b, s_b, f"layer {lw.index} wkv_b")
        m.norm, m.ffn_norm = keep.f32(lw.attn_norm), keep.f32(lw.ffn_norm)
        m.hidden, m.nh = cfg.hidden_size, cfg.num_heads
        m.nope, m.rope, m.v, m.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        m.eps, m.lora_eps, m.scale = self.eps, LORA_NORM_EPS, float(softmax_scale(cfg))
        m.inv_freq, m.rope_factor = p_inv, float(factor)
        m.interleave = bool(cfg.rope_interleave)
        return m

    # ------------------------------------------------------------------ expert sets
    def tables_for(self, es) -> SetTables:
        t = self._tables
        if t is not None and t.es is es:
            return t
        side = self._pinned.get(id(es))
        if side is not None and side.es is es:
            return side
        if t is not None and (es.generation < t.generation or es.candidate):
            # an older snapshot a pinned request keeps (scheduler.py), or a candidate's
            # set (experts/candidates.py): its own tables, beside the current set's,
            # until keep_pinned() lets them go
            side = self._pinned[id(es)] = SetTables(self.model, es)
            self.scratch.fit_ffns(side.ffns)
            self.scratch.grow_slots(max((v.slots for v in side.layers.values()), default=1))
            return side
        self.adopt(es, SetTables(self.model, es))
        return self._tables

    def keep_pinned(self, sets) -> None:
        """Forget the tables of older snapshots that no sequence in `sets` uses any more
        (their experts can then be released)."""
        live = {id(es) for es in sets} | {id(es) for es in self.model.kept_sets}
        for key in [k for k in self._pinned if k not in live]:
            del self._pinned[key]
        self._prune_mixed()

    def mixable(self, sets) -> bool:
        """Whether one pass can run sequences of these expert sets together
        (mixedsets.py); their tables are built here if they were not."""
        return mixable(self, [self.tables_for(es) for es in sets])

    def _mixed_for(self, tables: list) -> MixedTables:
        key = tuple(id(t) for t in tables)
        got = self._mixed.get(key)
        if got is None or any(a is not b for a, b in zip(got.tables, tables)):
            if len(self._mixed) >= 8:
                self._prune_mixed()
            got = self._mixed[key] = MixedTables(tables)
            self.scratch.grow_slots(got.entries_max)
        return got

    def _prune_mixed(self) -> None:
        """Forget the unions of tables no longer current or pinned (they keep them)."""
        live = {id(self._tables)} | {id(t) for t in self._pinned.values()}
        for key, m in list(self._mixed.items()):
            if any(id(t) not in live for t in m.tables):
                del self._mixed[key]

    def prepare(self, es) -> SetTables:
        """The tables of expert set `es`, built without installing them: on another thread
        than the one stepping (the hot-plug worker prepares the next set while tokens
        run). adopt() installs them between two steps."""
        return SetTables(self.model, es)

    def adopt(self, es, tables: SetTables):
        """Install tables made by prepare(es); returns the ones they replace (None if
        none), for the caller to free elsewhere. One set at a time: the tables keep their
        expert set (and any hot-plugged expert in it) alive."""
        if tables.es is not es:
            raise ValueError("Pipeline.adopt: the tables were made for another expert set")
        old, self._tables = self._tables, tables
        self._prune_mixed()
        self.scratch.fit_ffns(tables.ffns)
        self.scratch.grow_slots(max((v.slots for v in tables.layers.values()), default=1))
        return old

    def drop(self) -> None:
        """Forget the tables and cache pointers (they point into the mapped weights)."""
        self._tables = None
        self._pinned.clear()
        self._last_tables = None
        self._mixed.clear()
        self._mix = self._runs = None
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
            if not L.moe or t is None or n == 0:
                continue
            slots, k, width = t.layers[L.index].slots, self.layer_k[i], self.layer_width[i]
            if self._mix is not None:               # each run's rows, as wide as the largest
                logits = trace_logits(sc.logits[i], self._runs, L.index, self._mix.layers[L.index].slots)
            else:
                logits = sc.rows("logits", i, n, slots).copy()
            ids = sc.rows("ids", i, n, k)[:, :width].copy()
            if self.cfg.scoring_func != "sigmoid":
                p = ops.softmax(logits.astype(np.float64))
            else:
                p = ops.sigmoid(logits.astype(np.float64))
            scores = np.take_along_axis(p, np.maximum(ids, 0), 1).astype(np.float32)
            scores[ids < 0] = 0.0                  # slots a routing override left unused
            out.append(LayerTrace(L.index, Routing(ids, sc.rows("wts", i, n, k)[:, :width].copy(), scores), logits))
        return out

    # ------------------------------------------------------------------ the step
    def forget_cache(self, cache) -> None:
        """A KV cache was freed: drop the addresses kept for it (and the cache)."""
        got = self._cache_addr.get(id(cache))
        if got is not None and got[0] is cache:
            del self._cache_addr[id(cache)]

    def _cache_ptrs(self, cache) -> tuple:
        """(cache, then the tok row's columns 1..: k address, v address, values per layer,
        storage type, k scales address, v scales address; ck.h)."""
        got = self._cache_addr.get(id(cache))
        if got is None or got[0] is not cache:
            if len(self._cache_addr) > 256:
                self._cache_addr.clear()
            k, v = cache.k, cache.v
            q8 = getattr(cache, "dtype", "f32") == "q8"
            got = (cache, _addr(k), _addr(v), k[0].size, _KV_KIND[getattr(cache, "dtype", "f32")],
                   _addr(cache.k_scale) if q8 else 0, _addr(cache.v_scale) if q8 else 0)
            self._cache_addr[id(cache)] = got
        return got

    def run(self, ids: np.ndarray, spans: list, kt: np.ndarray, es, all_logits=False,
            reuse: bool = False, start: int = 0, x_in: np.ndarray | None = None) -> list:
        """ids [n] token ids; spans [(t0, t1, cache)] each sequence's tokens; kt [n] the
        k of each token (or one int for all); es the expert set, or one per span (the
        sets mixable(): one union per MoE layer, mixedsets.py). Returns per sequence the logits of its last
        token [V], or of all its tokens [n_i, V] where all_logits says so (one bool for
        every sequence, or one per sequence); the caches' lengths advance. reuse: the
        logits are views of a buffer the next step overwrites (the decode loop copies
        nothing). start/x_in: run layers start.. only, from x_in [n, H] (that layer's
        residual-stream input; ids unused): a shadow pass from the candidate's layer."""
        model, sc = self.model, self.scratch
        n = len(ids)
        kmax = kt if isinstance(kt, int) else (int(kt.max()) if n else 1)
        sc.ensure(n, kmax)
        self.passes += 1
        self._mix = self._runs = None
        if isinstance(es, (list, tuple)):           # a set per sequence
            per = [self.tables_for(e) for e in es]
            distinct = list({id(t): t for t in per}.values())
            if len(distinct) > 1:
                self._mix = self._mixed_for(distinct)
                self._runs = runs_of(spans, per)
                self.mixed_passes += 1
            es = per[0].es
        t = self._last_tables = self.tables_for(es)
        s = sc.s
        x = sc.prefix("x", n)
        res = model.residency
        if x_in is not None:
            np.copyto(x, x_in)
        else:
            if res.active:                          # the embedding's rows, under a budget
                res.embed_touch(ids)
            self._embed(ids, x)
            if self.cfg.embedding_multiplier != 1.0:    # Granite
                x *= np.float32(self.cfg.embedding_multiplier)
        tok = sc.tok
        for t0, t1, cache in spans:
            if t1 - t0 == 1:                        # a decode token: no views, no arrays
                (_, tok[t0, 1], tok[t0, 2], tok[t0, 3], tok[t0, 4], tok[t0, 5],
                 tok[t0, 6]) = self._cache_ptrs(cache)
                tok[t0, 0] = cache.length
                continue
            tok[t0:t1, 1:] = self._cache_ptrs(cache)[1:]
            tok[t0:t1, 0] = np.arange(cache.length, cache.length + t1 - t0)
        if isinstance(kt, int):
            sc.kt[0] = kt
            if n > 1:
                sc.kt[1:n] = kt
        else:
            sc.kt[:n] = kt
        hooks = model.hooks
        if res.active:
            res.begin_forward(n, [c for _, _, c in spans])
        tap = model.moe_tap
        keep = tap.keep_layers if tap is not None and x_in is None else ()
        for i, L in enumerate(self.layers):
            lw = L.lw
            if lw.index < start:
                continue
            self.layers_run += 1
            if lw.index in keep:                    # the shadow's from-layer input rows
                tap.keep(lw.index, x, spans)
            if hooks is not None and hooks.before_layer is not None:
                hooks.before_layer(layer=lw.index, hidden=x)
            if L.attn is not None:
                self._check(lib.ck_step_attention(L.attn, lw.index, sc.p_x, n, sc.p_tok, sc.p_xn, s))
            else:
                self._check(lib.ck_step_mla_attention(L.mla, lw.index, sc.p_x, n, sc.p_tok, sc.p_xn, s))
            if not L.moe:
                self._check(lib.ck_step_experts(L.block, sc.p_xn, n, sc.p_dense_ids,
                                                sc.p_dense_w, 1, sc.p_x, s))
            elif self._mix is not None:
                self._moe_mixed(i, L, self._runs, self._mix, n, kmax)
            else:
                self._moe(i, L, t.layers[lw.index], n, kmax)
            if res.speculative:                     # guess the next MoE layer's experts
                res.speculate(lw.index, x, es, sc.kt[:n])
            if hooks is not None and hooks.after_layer is not None:
                hooks.after_layer(layer=lw.index, hidden=x)
        self.last_n = n
        every = [all_logits] * len(spans) if isinstance(all_logits, bool) else all_logits
        if len(spans) == 1 and not every[0]:    # one sequence's last token (decode)
            np.copyto(sc.prefix("head_x", 1), x[n - 1:n] if n > 1 else x)
            logits = self._head(sc.prefix("head_x", 1), reuse)
            results = [self._logits1_row if reuse and logits is self._logits1 else logits[0]]
        else:
            rows = [(t0, t1) if a else (t1 - 1, t1) for (t0, t1, _), a in zip(spans, every)]
            hx = sc.head_x[:sum(b - a for a, b in rows)]
            j = 0
            for a, b in rows:
                hx[j:j + b - a] = x[a:b]
                j += b - a
            logits = self._head(hx, reuse)
            results, j = [], 0
            for (a, b), whole in zip(rows, every):
                results.append(logits[j:j + b - a] if whole else logits[j])
                j += b - a
        for t0, t1, cache in spans:
            cache.length += t1 - t0
        sc.control.after_step()
        return results

    def _embed(self, ids: np.ndarray, x: np.ndarray) -> None:
        if len(ids) == 1:
            lib.ck_mat_row(self.embed_mat, int(ids[0]), self.scratch.p_x)
            return
        for r, tid in enumerate(ids.tolist()):
            lib.ck_mat_row(self.embed_mat, tid, ffi.cast("float *", ffi.from_buffer(x[r])))

    def _head(self, hx: np.ndarray, reuse: bool) -> np.ndarray:
        n = hx.shape[0]
        if reuse and n == 1:
            if self._logits1 is None:
                self._logits1 = np.zeros((1, self.head.rows), np.float32)
                self._logits1_row = self._logits1[0]
                self._p_logits1 = ffi.cast("float *", ffi.from_buffer(self._logits1))
            out, p_out = self._logits1, self._p_logits1
        else:
            out = np.empty((n, self.head.rows), np.float32)
            p_out = ffi.cast("float *", ffi.from_buffer(out))
        self._check(lib.ck_step_head_b(self.head, self.final_norm, self.final_norm_b, self.head_b,
                                       self.eps, self.scratch.p_head_x, n, p_out, self.scratch.s))
        if self.cfg.logits_scaling != 1.0:          # Granite
            out /= np.float32(self.cfg.logits_scaling)
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"colibri step kernel: {_ERRORS.get(rc, rc)}")


_KV_KIND = {"f32": lib.CK_KV_F32, "f16": lib.CK_KV_F16, "q8": lib.CK_KV_Q8}


def _addr(a: np.ndarray) -> int:
    return int(ffi.cast("intptr_t", ffi.from_buffer(a)))
