"""The reference forward: the model's math in numpy over the reference ops (ops.py, mla.py,
routing.py), one block at a time. It calls no C: its matrix products are ops.matmul (the
kernels' int8 or float products in numpy), its attention ops.attention.

It is not the engine's runtime path -- that is pipeline.py's one pipeline -- but:
  - the tests' reference model (a C entry point of the pipeline is checked against the
    block of the same name here);
  - the converter's calibration forward (convert/awq.py attaches an `observer` that sees
    every linear's input, which the fused C calls cannot offer);

Shape legend: T tokens in the batch, H hidden, NH / NKV query / key-value heads, D head
dim, E experts, K experts per token, V vocab, S cached positions of one sequence.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..model import mla, ops
from ..model.kvcache import KVCache, new_cache
from ..config import EngineConfig, ModelConfig
from ..errors import RequestError
from ..experts.expertset import ExpertSet
from ..model.routing import LayerTrace, route
from ..model.weights import FFNWeights, LayerWeights, ModelWeights, run_own_code


class ReferenceModel:
    """The forward of numpy blocks (see the module docstring). No hooks, no memory
    budget, no hot-plug bookkeeping: those are the pipeline's."""

    def __init__(self, weights: ModelWeights, engine: EngineConfig = EngineConfig()):
        self.w = weights
        self.cfg = weights.cfg
        self.engine = engine
        self.act = engine.activations
        self.routing_mode = engine.routing
        self._inv_freq, self._rope_factor = ops.rope_frequencies(self.cfg)   # [D/2], cos/sin factor
        self.observer = None                 # callable(weight, x) seeing every linear's input
                                             # (converter calibration); None in normal use
        self.last_routing: list[LayerTrace] = []
        self.expert_set = ExpertSet.from_weights(weights)

    # ------------------------------------------------------------------ small blocks
    def new_cache(self, capacity: int, dtype: Optional[str] = None) -> KVCache:
        return new_cache(self.cfg, capacity, dtype or self.engine.kv_dtype)

    def _rmsnorm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return ops.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def _norm(self, x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        """The layer norms: RMSNorm, or LayerNorm where there is a bias (norm_type "layer")."""
        if b is None:
            return self._rmsnorm(x, w)
        x64 = x.astype(np.float64)
        c = x64 - x64.mean(axis=-1, keepdims=True)
        y = c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        return (y * w + b).astype(np.float32)

    def linear(self, w, x: np.ndarray, act_scale: Optional[np.ndarray] = None) -> np.ndarray:
        """x [T, in] @ w^T -> [T, out] float32, whatever the stored number type.

        act_scale [in] (AWQ, optional): the stored matrix is W * act_scale (per column), so
        the activations are divided by it first."""
        if self.observer is not None:
            self.observer(w, x)
        if act_scale is not None:
            x = x / act_scale
        return ops.matmul(w, x, self.act)

    def _ffn(self, ffn: FFNWeights, x: np.ndarray, out: np.ndarray,
             row_weights: Optional[np.ndarray] = None, accumulate: bool = False) -> None:
        sc = ffn.act_scales
        g = self.linear(ffn.w1, x, sc.get("w1"))
        u = self.linear(ffn.w3, x, sc.get("w3"))
        b = ffn.biases
        if b:                                          # gpt-oss's expert biases
            g, u = g + b["w1"], u + b["w3"]
        y = self.linear(ffn.w2, ops.gated_act(g, u, self.cfg), sc.get("w2"))
        if b:
            y += b["w2"]
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
        L = lw.index
        nope = L in cfg.nope_layers                                     # Llama 4's NoPE layers
        if not nope:
            q = ops.apply_rope(q, pos, self._inv_freq, self._rope_factor)    # rotate-half layout
            k = ops.apply_rope(k, pos, self._inv_freq, self._rope_factor)
            if cfg.qk_norm == "l2":
                ones = np.ones(D, np.float32)
                q, k = self._rmsnorm(q, ones), self._rmsnorm(k, ones)
        elif cfg.attn_temperature_floor:
            f = np.log1p(np.floor((pos + 1.0) / cfg.attn_temperature_floor)) \
                * cfg.attn_temperature_scale + 1.0
            q = q * f.astype(np.float32)[:, None, None]
        out = np.empty((T, NH, D), dtype=np.float32)
        scale = cfg.attention_multiplier or 1.0 / math.sqrt(D)
        window, chunk = cfg.attention_span(L)
        for t0, t1, cache in spans:
            s0 = cache.length
            n = t1 - t0
            cache.write(L, s0, k[t0:t1], v[t0:t1])         # in the cache's storage type
            kc, vc = cache.read(L, s0 + n)                   # float32 rows (dequantized)
            out[t0:t1] = ops.attention(q[t0:t1], kc, vc, scale, s0, window, chunk, a.sinks)
        o = self.linear(a.wo, out.reshape(T, NH * D), acts.get("wo"))
        if a.bo is not None:
            o += a.bo
        return o * np.float32(cfg.residual_multiplier)              # Granite

    # ------------------------------------------------------------------ MoE
    def _moe(self, lw: LayerWeights, xn: np.ndarray, k_tok: np.ndarray, es: ExpertSet) -> np.ndarray:
        cfg, L = self.cfg, lw.index
        # [T, slots]; the logit bias: hot experts' bias, vacant slots
        logits = ops.router_logits(xn, es.routers[L], es.logit_bias[L])
        r = route(logits, k_tok, mode=self.routing_mode, scoring=cfg.scoring_func,
                  norm_topk_prob=cfg.norm_topk_prob, bias=es.select_bias[L],
                  n_group=cfg.n_group, topk_group=cfg.topk_group,
                  scaling=cfg.routed_scaling_factor, bias_on_probs=cfg.select_bias_on_probs,
                  jitter_eps=cfg.router_jitter_eps)
        self.last_routing.append(LayerTrace(L, r, logits))
        experts = es.experts[L]
        out = np.zeros_like(xn)
        T = xn.shape[0]
        for e in np.unique(r.ids[r.ids >= 0]):     # ascending id, as the pipeline
            rows, slot = np.nonzero(r.ids == e)
            buf = np.zeros((len(rows), xn.shape[1]), dtype=np.float32)
            xe, w = np.ascontiguousarray(xn[rows]), r.weights[rows, slot]
            if cfg.routing_scales_input:                 # Llama 4: expert(w x)
                xe, w = xe * w[:, None], np.ones_like(w)
            self._run_expert(experts[e], xe, buf, w)
            out[rows] += buf
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
        run_own_code(ex, x, out, rw)               # hot-plugged custom code: ffn_forward

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
        self.last_routing = []
        x = self._embed(ids)                                              # [T, H]
        for lw in self.w.layers:
            x = x + self._attention(lw, self._norm(x, lw.attn_norm, lw.attn_norm_bias), pos, spans)
            xn = self._norm(x, lw.ffn_norm, lw.ffn_norm_bias)
            if lw.kind == "dense":
                y = np.empty_like(xn)
                self._ffn(lw.dense, xn, y)
            else:
                y = self._moe(lw, xn, kt, es)
            x = x + y * np.float32(self.cfg.residual_multiplier)
        results = []
        for t0, t1, cache in spans:
            cache.length += t1 - t0
            rows = x[t0:t1] if all_logits else x[t1 - 1:t1]
            logits = self.linear(self.w.lm_head, self._norm(rows, self.w.final_norm, self.w.final_norm_bias))
            logits /= np.float32(cfg.logits_scaling)
            if self.w.lm_head_bias is not None:
                logits += self.w.lm_head_bias
            results.append(logits if all_logits else logits[0])
        return results

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        return ops.embedding(self.w.embed, ids) * np.float32(self.cfg.embedding_multiplier)

