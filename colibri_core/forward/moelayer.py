"""The pipeline's MoE layer: route a layer's tokens (ck_step_route), give plugins their
say (choose_k_token, routing, the shadow's tap, expert timing and prefetch), run the
routed experts (ck_step_experts), the memory budget's expert cache and hot-plugged code
between the C calls.

A mixin of pipeline.Pipeline, apart so that the step (pipeline.py) and the MoE layer each
stay one readable file; it shares the Pipeline's scratch, hooks and per-step state
(layer_k, layer_width, routed, _last_tables). fleet/expertshard.py replaces
`Pipeline.experts` (here `_experts`) with its sharded executor.
"""
from __future__ import annotations

import time

import numpy as np

from ..experts.expertcache import Pending as _PENDING
from ..kernels import ffi, lib
from ..model import ops
from ..model.routing import route
from ..model.weights import run_own_code
from .mixedsets import logit_rows
from .steptables import Keep, MoETables, StepLayer, set_ffn


class MoELayer:
    """Pipeline's MoE layer methods (see the module docstring)."""
    def _moe(self, i: int, L: StepLayer, T: MoETables, n: int, kmax: int) -> None:
        """Route layer L's tokens, give plugins their say, run the experts."""
        model, sc, cfg = self.model, self.scratch, self.cfg
        layer, hooks = L.index, model.hooks
        E = T.slots
        lg = sc.rows("logits", i, n, E)            # C writes [n, E] from the start
        p_logits, p_ids, p_wts = sc.p_layer[i]
        choose = hooks.choose_k_token if hooks is not None else None
        p_k = sc.p_kt
        if choose is not None:                      # the plugin's k per token, from the logits
            rc = lib.ck_step_route(T.router, sc.p_xn, n, p_k, kmax, p_logits, ffi.NULL, ffi.NULL, 0)
            got = choose(layer=layer, probs=ops.softmax(lg), default_k=sc.kt[:n].astype(np.int64)) \
                if rc == 0 else None
            if got is not None:
                k_tok = hooks.guard.check_choose_k_token(got, n, cfg.num_experts)
                kmax = max(kmax, int(k_tok.max()))
                sc.grow_k(kmax)                      # a plugin may choose more than the step's k
                p_logits, p_ids, p_wts = sc.p_layer[i]
                sc.kt_layer[:n] = k_tok
                p_k = sc.p_kt_layer
            rc = lib.ck_step_route(T.router, sc.p_xn, n, p_k, kmax, p_logits, p_ids, p_wts, 1)
        else:
            rc = lib.ck_step_route(T.router, sc.p_xn, n, p_k, kmax, p_logits, p_ids, p_wts, 0)
        idv, wv = sc.rows("ids", i, n, kmax), sc.rows("wts", i, n, kmax)
        if rc == lib.CK_E_NONFINITE:                # NaN/Inf logits: the router's fallback
            r = route(lg, sc.kt_layer[:n] if p_k is sc.p_kt_layer else sc.kt[:n],
                      mode=model.engine.routing, scoring=cfg.scoring_func,
                      norm_topk_prob=cfg.norm_topk_prob, bias=T.select_bias, jitter_eps=cfg.router_jitter_eps,
                      n_group=cfg.n_group, topk_group=cfg.topk_group,
                      scaling=cfg.routed_scaling_factor, bias_on_probs=cfg.select_bias_on_probs)
            K = r.ids.shape[1]
            idv[:, :K], wv[:, :K] = r.ids, r.weights
            idv[:, K:], wv[:, K:] = -1, 0.0
        else:
            self._check(rc)
        self.layer_k[i] = self.layer_width[i] = kmax
        tap = model.moe_tap
        if tap is not None and layer in tap.layers:  # a candidate in shadow: chosen here?
            tap(layer, sc.xn[:n], lg, sc.kt_layer[:n] if p_k is sc.p_kt_layer else sc.kt[:n],
                self._last_tables.es)
        if hooks is not None and hooks.routing is not None:
            p = ops.softmax(lg.astype(np.float64)) if cfg.scoring_func != "sigmoid" \
                else ops.sigmoid(lg.astype(np.float64))
            scores = np.take_along_axis(p, np.maximum(idv, 0), 1).astype(np.float32)
            override = hooks.routing(layer=layer, expert_ids=idv, weights=wv, scores=scores, logits=lg)
            if override is not None:                # validated here, the one place
                new_ids, new_w = hooks.guard.check_routing(override, layer, n, kmax,
                                                           T.experts, cfg.num_experts)
                m = new_ids.shape[1]
                idv[:, :m], wv[:, :m] = new_ids, new_w
                idv[:, m:], wv[:, m:] = -1, 0.0
                self.layer_width[i] = m
        if self.routed is not None:
            self._count_routed(layer, idv[:, :self.layer_width[i]])
        self.experts(i, L, T, n, kmax, idv, wv)

    def _moe_mixed(self, i: int, L: StepLayer, runs: list, mix, n: int, kmax: int) -> None:
        """Layer L's tokens of several expert sets (mixedsets.py): each run of one set
        routed with its set's router, then every (token, expert) pair in one expert call
        over the union table, a token's slots mapped to its set's entries."""
        model, sc, cfg = self.model, self.scratch, self.cfg
        layer, H = L.index, cfg.hidden_size
        M = mix.layers[layer]
        p_logits, p_ids, p_wts = sc.p_layer[i]
        idv, wv = sc.rows("ids", i, n, kmax), sc.rows("wts", i, n, kmax)
        buf = sc.logits[i]
        tap = model.moe_tap
        tap = tap if tap is not None and layer in tap.layers else None
        res = model.residency
        advise = not res.all_prefetched(layer)
        run_ids = sc.rows("run_ids", -1, n, kmax)
        for t0, t1, tables in runs:
            T, m = tables.layers[layer], t1 - t0
            rc = lib.ck_step_route(T.router, sc.p_xn + t0 * H, m, sc.p_kt + t0, kmax,
                                   p_logits + t0 * M.slots, p_ids + t0 * kmax, p_wts + t0 * kmax, 0)
            if rc == lib.CK_E_NONFINITE:            # NaN/Inf logits: the router's fallback
                r = route(logit_rows(buf, t0, t1, T.slots, M.slots), sc.kt[t0:t1],
                          mode=model.engine.routing, scoring=cfg.scoring_func,
                          norm_topk_prob=cfg.norm_topk_prob, bias=T.select_bias,
                          jitter_eps=cfg.router_jitter_eps, n_group=cfg.n_group,
                          topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                          bias_on_probs=cfg.select_bias_on_probs)
                K = r.ids.shape[1]
                idv[t0:t1, :K], wv[t0:t1, :K] = r.ids, r.weights
                idv[t0:t1, K:], wv[t0:t1, K:] = -1, 0.0
            else:
                self._check(rc)
            if tap is not None:                     # the shadow's tap: these rows of n
                tap(layer, sc.xn[t0:t1], logit_rows(buf, t0, t1, T.slots, M.slots), sc.kt[t0:t1],
                    tables.es, rows=(t0, n, self.passes))
            if advise:                              # the madvise prefetch, by its set's slots
                used = np.unique(idv[t0:t1])
                res.acquire(layer, used, T.experts)
                res.release(layer, used)
            # its slots -> the union's entries (-1, unused, maps to the map's last: -1)
            np.take(M.maps[mix.index[id(tables)]], idv[t0:t1], out=run_ids[t0:t1])
        self.layer_k[i] = self.layer_width[i] = kmax
        if self.routed is not None:
            self._count_routed(layer, idv)
        block = L.block
        if L.tables is not M.token:
            block.table, block.n_table = M.table, M.n
            L.tables = M.token
        self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_wts, kmax, sc.p_x, sc.s))

    def _count_routed(self, layer: int, ids: np.ndarray) -> None:
        counts = np.bincount(ids[ids >= 0].ravel())
        have = self.routed.get(layer)
        if have is None or have.size < counts.size:
            grown = np.zeros(max(counts.size, 8), np.int64)
            if have is not None:
                grown[:have.size] = have
            have = grown
        have[:counts.size] += counts
        self.routed[layer] = have               # (one assignment: readers see old or new)

    def _experts(self, i: int, L: StepLayer, T: MoETables, n: int, kmax: int, idv: np.ndarray,
                 wv: np.ndarray) -> None:
        model, sc = self.model, self.scratch
        layer, hooks = L.index, model.hooks
        _, p_ids, p_w = sc.p_layer[i]               # idv, wv: the start of layer i's buffers
        res = model.residency
        timing = hooks.expert_timing if hooks is not None else None
        prefetch = hooks.expert_prefetch if hooks is not None else None
        block = L.block
        if L.tables is not T.token:                 # the expert set's table, once per set
            block.table, block.n_table = T.table, T.n
            L.tables = T.token                      # (not T: that would keep the set alive)
        if not (T.custom or res.active or timing is not None or prefetch is not None
                or not res.all_prefetched(layer)):
            # the common case: the routed and the shared experts in one C call
            self._check(lib.ck_step_experts(block, sc.p_xn, n, p_ids, p_w, kmax, sc.p_x, sc.s))
            return
        run_ids = sc.rows("run_ids", -1, n, kmax)
        np.copyto(run_ids, idv)
        used = np.unique(idv[idv >= 0])
        shared, block.shared = block.shared, ffi.NULL      # the shared expert after the waves
        try:
            for wave in res.waves(used):            # one wave unless a budget forces more
                run = res.acquire(layer, wave, T.experts)   # prefetch; budget: load + pin
                try:
                    if prefetch is not None:
                        prefetch(layer=layer, experts=[(int(e), run[e].address, run[e].nbytes)
                                                       for e in wave])
                    self._run_wave(L, T, n, idv, wv, p_w, kmax, wave, used, run, timing, res.active)
                finally:
                    res.release(layer, wave)
        finally:
            block.shared = shared
        if shared != ffi.NULL:
            run_ids[...] = -1
            self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))

    def _run_wave(self, L: StepLayer, T: MoETables, n, idv, wv, p_w, kmax, wave, used, run, timing,
                  budget) -> None:
        """The routed experts `wave` (ascending ids): C experts in one call -- one call
        per expert when a load is still in flight (each computes as soon as it is read)
        or a plugin times experts --, hot-plugged code (ffn_forward) between."""
        sc = self.scratch
        layer, table, block = L.index, T.table, L.block
        x, xn = sc.x[:n], sc.xn[:n]
        run_ids = sc.rows("run_ids", -1, n, kmax)
        singles = timing is not None or any(isinstance(run[e], _PENDING) for e in wave)
        batch = []
        for e in (int(e) for e in wave):
            c0, t0 = _cycles(), time.perf_counter()
            if e in T.custom:                    # its own code, between the C calls
                rows, slot = np.nonzero(idv == e)
                out = np.zeros((len(rows), x.shape[1]), np.float32)
                w, xin = wv[rows, slot], np.ascontiguousarray(xn[rows])
                if self.cfg.routing_scales_input:            # Llama 4: expert(w x)
                    xin, w = xin * w[:, None], np.ones_like(w)
                run_own_code(run[e], xin, out, w * np.float32(self.cfg.residual_multiplier))
                x[rows] += out
            else:
                if budget and T.bound.get(e) is not run[e]:   # where the cache holds it now
                    ex = run[e]
                    keep = Keep()                   # its views, for as long as it is bound
                    set_ffn(keep, table[e], ex.ffn)
                    T.bound[e], T.bound_keep[e] = ex, keep
                if not singles:
                    batch.append(e)
                    continue
                np.copyto(run_ids, np.where(idv == e, idv, -1))
                self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))
            if timing is not None:
                timing(layer=layer, expert=e, cycles=_cycles() - c0, seconds=time.perf_counter() - t0)
        if batch:
            if len(batch) == len(wave) == len(used):    # the whole choice: no mask to make
                np.copyto(run_ids, idv)
            else:
                np.copyto(run_ids, np.where(np.isin(idv, batch), idv, -1))
            self._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax, sc.p_x, sc.s))


def _cycles() -> int:
    return int(lib.ck_rdtsc())
