"""Expert parallelism's step (issue 40, docs/SCALE.md "A model larger than one machine"):
the routed experts of every MoE layer computed on expert shards, the rest on the driver.

    ExpertShard     holds a share of the routed experts (a placement plan's, expertplan.py);
                    given a layer's (token row, expert, weight) pairs it returns each pair's
                    weighted output, unsummed
    ShardedExperts  the driver's expert executor (Pipeline.experts): sends each shard the
                    pairs of its experts, adds what comes back in ascending expert id, then
                    runs the shared expert itself

Bit-exactness: ck_step_experts adds, per token, x + y_e * w_e over its experts in
ascending id and then the shared expert, every product rounded to float32 before the add
(no contraction: kernels/build.py). A shard computes each pair as its own row (row p =
the pair's token's xn), so it returns round(y_e * w_e) -- a row's result does not depend
on the other rows (the pipeline is batch-invariant) -- and the driver's float32 adds in
the same order give the single-machine pipeline's bits.

A shard is a plain object here; anything with its submit / result (shardactor.py's Ray
actor adapter) stands in for it.
"""
from __future__ import annotations

import threading

import numpy as np

from ..kernels import ffi, lib


class ExpertShard:
    """Shard `index` of a plan: computes only the experts the plan gives it. Holds an
    Engine on the same model (its files are mapped; only this shard's experts are read)."""

    def __init__(self, model_dir, index: int, owners: dict, threads: int = 1):
        from ..config import EngineConfig
        from ..engine import Engine
        self.index = index
        self.owned = {L: np.array([index in o for o in own] + [False]) for L, own in owners.items()}
        self.engine = Engine(model_dir, EngineConfig(threads=threads))
        self.pairs = 0                              # (token, expert) pairs computed
        self._lock = threading.Lock()               # one compute at a time (one scratch)
        pipe = self.engine.model.pipeline
        tables = pipe.tables_for(self.engine.model.expert_set)
        self._blocks = {}
        for L in pipe.layers:
            if L.moe:
                T = tables.layers[L.index]
                b = pipe.keep.new("ck_ffn_block *")
                b[0] = L.block[0]
                b.shared, b.table, b.n_table = ffi.NULL, T.table, T.n
                self._blocks[L.index] = b

    def compute(self, layer: int, xn: np.ndarray, experts: np.ndarray,
                weights: np.ndarray) -> np.ndarray:
        """xn [p, H] float32: each pair's token row; experts [p], weights [p]: its expert
        and routing weight. Returns [p, H] float32: each pair's weighted output."""
        own = self.owned.get(layer)
        if own is None:
            raise ValueError(f"expert shard {self.index}: layer {layer} is not a MoE layer")
        experts = np.ascontiguousarray(experts, np.int64)
        bad = experts[~own[np.clip(experts, -1, len(own) - 1)] | (experts < 0)]
        if bad.size:
            raise ValueError(f"expert shard {self.index}: layer {layer} expert {int(bad[0])} "
                             f"is not placed here")
        p = len(experts)
        xn = np.ascontiguousarray(xn, np.float32)
        w = np.ascontiguousarray(weights, np.float32)
        out = np.zeros((p, xn.shape[1]), np.float32)
        if p == 0:
            return out
        with self._lock:
            sc = self.engine.model.pipeline.scratch
            sc.ensure(p, 1)
            rc = lib.ck_step_experts(self._blocks[layer], _f32(xn), p,
                                     ffi.cast("int64_t *", ffi.from_buffer(experts)), _f32(w), 1,
                                     _f32(out), sc.s)
            self.pairs += p
        if rc != 0:
            raise RuntimeError(f"expert shard {self.index}: step kernel error {rc}")
        return out

    # the executor's protocol: start every shard's work, then collect (a Ray actor's
    # adapter, fleet/shardactor.py, returns an ObjectRef and gets it)
    def submit(self, layer, xn, experts, weights):
        return self.compute(layer, xn, experts, weights)

    def result(self, handle):
        return handle

    def count(self) -> int:
        return self.pairs

    def close(self) -> None:
        self.engine.close()


class ShardedExperts:
    """The expert executor of one pipeline over shards: install() puts it in the
    pipeline's seam, uninstall() puts the local executor back."""

    def __init__(self, pipeline, owners: dict, shards: list):
        self.pipe, self.owners, self.shards = pipeline, owners, shards
        self.sent = [0] * len(shards)               # pairs sent to each shard

    def install(self) -> "ShardedExperts":
        self.pipe.experts = self
        return self

    def uninstall(self) -> None:
        self.pipe.experts = self.pipe._experts

    def __call__(self, i, L, T, n, kmax, idv, wv) -> None:
        pipe = self.pipe
        model, sc = pipe.model, pipe.scratch
        hooks = model.hooks
        if T.custom or model.residency.active or (hooks is not None and (
                hooks.expert_timing is not None or hooks.expert_prefetch is not None)):
            raise RuntimeError("expert shards: hot-plugged experts with their own code, a "
                               "memory budget and expert timing/prefetch plugins are not "
                               "supported across shards yet")
        layer, own = L.index, self.owners[L.index]
        E = len(own)
        ids = idv[:, :kmax]
        t_idx, j_idx = np.nonzero(ids >= 0)
        e_idx = ids[t_idx, j_idx]
        if e_idx.size and int(e_idx.max()) >= E:
            raise RuntimeError(f"expert shards: layer {layer} slot {int(e_idx.max())} is not "
                               f"in the placement plan (a hot-plugged expert)")
        order = np.lexsort((j_idx, t_idx, e_idx))   # ascending expert, then token, slot
        t_idx, j_idx, e_idx = t_idx[order], j_idx[order], e_idx[order]
        owner = np.array([own[e][t % len(own[e])] for e, t in zip(e_idx.tolist(), t_idx.tolist())],
                         np.int64)
        xn, x = sc.xn[:n], sc.x[:n]
        w = wv[t_idx, j_idx]
        out = np.empty((len(e_idx), x.shape[1]), np.float32)
        calls = []
        for s, shard in enumerate(self.shards):
            sel = np.flatnonzero(owner == s)
            if sel.size:
                self.sent[s] += sel.size
                calls.append((sel, shard, shard.submit(layer, xn[t_idx[sel]], e_idx[sel], w[sel])))
        for sel, shard, h in calls:
            out[sel] = shard.result(h)
        # x + c per pair in ascending expert id: a token appears at most once per expert
        # and slot, so one expert's adds touch distinct rows unless a slot repeats it
        for e in np.unique(e_idx):
            rows = np.flatnonzero(e_idx == e)
            np.add.at(x, t_idx[rows], out[rows])
        block = L.block
        if block.shared != ffi.NULL:                # the shared expert, after the routed
            run_ids = sc.rows("run_ids", -1, n, kmax)
            run_ids[...] = -1
            _, _, p_w = sc.p_layer[i]
            pipe._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax,
                                            sc.p_x, sc.s))


def _f32(a: np.ndarray):
    return ffi.cast("float *", ffi.from_buffer(a))
