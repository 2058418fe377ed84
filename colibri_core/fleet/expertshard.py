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

A shard is a plain object here; anything with its submit / result / plug (shardactor.py's
Ray actor adapter) stands in for it.

Hot-plugged experts: a shard started with `hotplug` settings watches a private folder of
its own; the executor sends each hot-plugged expert's file to its owner shard
(hot_owner: the plan places the model's experts, slot % shards the hot-plugged ones) the
first step its set is used, with the slots the driver gave them, and waits until the
shard's engine adopted it (the single engine's checks, probe and adoption).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np

from ..errors import EngineUnavailable
from ..kernels import ffi, lib

PLUG_DEADLINE_S = 60.0        # a shard's engine adopts a sent expert within this


class ShardUnavailable(EngineUnavailable):
    """An expert shard died, is restarting or did not answer: the step cannot run (never
    a local fallback). 503 with Retry-After."""
    code = "expert_shard_unavailable"


def hot_owner(slot: int, shards: int) -> int:
    """The shard that holds a hot-plugged expert's slot (the plan covers the model's)."""
    return slot % shards


class ExpertShard:
    """Shard `index` of a plan: computes only the experts the plan gives it. Holds an
    Engine on the same model (its files are mapped; only this shard's experts are read)."""

    def __init__(self, model_dir, index: int, owners: dict, threads: int = 1,
                 hotplug: dict | None = None):
        from ..config import EngineConfig, parse
        from ..engine import Engine
        self.index = index
        self.owned = {L: np.array([index in o for o in own] + [False]) for L, own in owners.items()}
        self.folder = self.slots_file = None
        settings: dict = {"threads": threads}
        if hotplug is not None:                     # a private watched folder
            self.folder = tempfile.mkdtemp(prefix="colibri-shard-")
            self.slots_file = os.path.join(self.folder, ".colibri-slots.json")
            _write(self.slots_file, b"{}")
            settings.update(experts_dir=self.folder,
                            hotplug={**hotplug, "slots_file": self.slots_file})
        self.engine = Engine(model_dir, parse(EngineConfig, settings, f"expert shard {index}"))
        self.model_pairs = self.engine.model.expert_set.pairs()
        self.held: dict[str, str] = {}              # hot-plugged expert name -> sha256
        self.pairs = 0                              # (token, expert) pairs computed
        self._lock = threading.Lock()               # one compute at a time (one scratch)
        pipe = self.engine.model.pipeline
        self._blocks, self._token = {}, {}
        for L in pipe.layers:
            if L.moe:
                b = pipe.keep.new("ck_ffn_block *")
                b[0] = L.block[0]
                b.shared = ffi.NULL
                self._blocks[L.index] = b
        self._bind()

    def _bind(self) -> dict:
        """Point each layer's block at the engine's current expert table (once per set)."""
        tables = self.engine.model.pipeline.tables_for(self.engine.model.expert_set)
        for layer, b in self._blocks.items():
            T = tables.layers[layer]
            if self._token.get(layer) is not T.token:
                b.table, b.n_table = T.table, T.n
                self._token[layer] = T.token
        return tables.layers

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
            if self.held:
                self._bind()
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
    # adapter, fleet/shardactor.py, sends it on the shard's socket and reads the answer)
    def submit(self, layer, xn, experts, weights):
        return self.compute(layer, xn, experts, weights)

    def result(self, handle):
        return handle

    def count(self) -> int:
        return self.pairs

    def where(self) -> tuple[int, str]:
        """(process id, Ray node id or "") of this shard."""
        try:
            import ray
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        except ImportError:
            node = ""
        return os.getpid(), node

    def plug(self, want: dict) -> dict:
        """Hold exactly the hot-plugged experts `want` ({name: {"slot", "sha256",
        "layers", "data"}}; data may be None for one already held): their files into
        the private folder, the slots first, then wait for the engine's adoption.
        Returns {name: sha256} held after, or raises naming the refusal."""
        if self.folder is None:
            raise RuntimeError(f"expert shard {self.index}: started without hot-plug")
        from ..experts.expertset import expert_set_id
        with self._lock:
            _write(self.slots_file, json.dumps({n: e["slot"] for n, e in want.items()},
                                               sort_keys=True).encode())
            for name, e in want.items():
                if self.held.get(name) != e["sha256"]:
                    _write(os.path.join(self.folder, f"{name}.so"), e["data"])
            for name in [n for n in self.held if n not in want]:
                try:
                    os.unlink(os.path.join(self.folder, f"{name}.so"))
                except FileNotFoundError:
                    pass
            expected = expert_set_id(self.model_pairs + [(n, e["sha256"]) for n, e in want.items()])
            deadline = time.monotonic() + PLUG_DEADLINE_S
            eng = self.engine
            while eng.expert_set_id != expected:
                eng.apply_expert_changes()
                refused = [r for r in eng.hotplug.refused() if r.get("sha256") in
                           {e["sha256"] for e in want.values()}]
                if eng.expert_set_id == expected:
                    break
                if refused or time.monotonic() > deadline:
                    why = refused[0]["reason"] if refused else f"not within {PLUG_DEADLINE_S:.0f} s"
                    raise RuntimeError(f"expert shard {self.index}: hot-plugged experts "
                                       f"{sorted(want)} not adopted ({why})")
                time.sleep(0.005)
            self.held = {n: e["sha256"] for n, e in want.items()}
            for name, e in want.items():            # its slot in each of its layers
                for layer in e["layers"]:
                    own = self.owned.get(layer)
                    if own is not None:
                        if len(own) <= e["slot"] + 1:
                            own = self.owned[layer] = np.concatenate(
                                [own, np.zeros(e["slot"] + 2 - len(own), bool)])
                        own[e["slot"]] = True
            self._bind()
            return dict(self.held)

    def close(self) -> None:
        self.engine.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class ShardedExperts:
    """The expert executor of one pipeline over shards: install() puts it in the
    pipeline's seam, uninstall() puts the local executor back. The step's thread calls
    it (one at a time); counters are plain ints others may read."""

    def __init__(self, pipeline, owners: dict, shards: list):
        self.pipe, self.owners, self.shards = pipeline, owners, shards
        self.sent = [0] * len(shards)               # pairs sent to each shard
        self._es = None                             # the expert set the shards hold
        self._held: list[dict] = [{} for _ in shards]   # per shard: hot name -> sha256
        self._bytes: dict = {}                      # sha256 -> a hot expert's file

    def install(self) -> "ShardedExperts":
        self.pipe.experts = self
        return self

    def uninstall(self) -> None:
        self.pipe.experts = self.pipe._experts

    def owner(self, layer: int, e: int, t: int) -> int:
        own = self.owners[layer]
        if e >= len(own):
            return hot_owner(e, len(self.shards))
        return own[e][t % len(own[e])]

    def sync(self, es) -> None:
        """Every hot-plugged expert of set `es` on its owner shard (and only there)."""
        want: list[dict] = [{} for _ in self.shards]
        for hot in es.hot_experts():
            if hot.q4 is None:
                raise RuntimeError(f"expert shards: hot-plugged expert {hot.name} brings "
                                   f"its own code (no INT4 weights): not supported across "
                                   f"shards yet")
            want[hot_owner(hot.slot, len(self.shards))][hot.name] = {
                "slot": hot.slot, "sha256": hot.sha256, "layers": list(hot.layers),
                "path": hot.staged_path}
        for s, shard in enumerate(self.shards):
            if getattr(shard, "restarted", False):  # a new process: it holds nothing
                self._held[s], shard.restarted = {}, False
            have = self._held[s]
            if {n: e["sha256"] for n, e in want[s].items()} == have:
                continue
            send = {n: {**{k: v for k, v in e.items() if k != "path"},
                        "data": None if have.get(n) == e["sha256"] else self._file(e)}
                    for n, e in want[s].items()}
            self._held[s] = shard.plug(send)
        self._es = es
        live = {e["sha256"] for w in want for e in w.values()}
        self._bytes = {k: v for k, v in self._bytes.items() if k in live}

    def _file(self, e: dict) -> bytes:
        data = self._bytes.get(e["sha256"])
        if data is None:
            with open(e["path"], "rb") as f:
                data = self._bytes[e["sha256"]] = f.read()
        return data

    def __call__(self, i, L, T, n, kmax, idv, wv) -> None:
        pipe = self.pipe
        model, sc = pipe.model, pipe.scratch
        hooks = model.hooks
        if T.custom or model.residency.active or (hooks is not None and (
                hooks.expert_timing is not None or hooks.expert_prefetch is not None)):
            raise RuntimeError("expert shards: hot-plugged experts with their own code, a "
                               "memory budget and expert timing/prefetch plugins are not "
                               "supported across shards yet")
        layer = L.index
        ids = idv[:, :kmax]
        t_idx, j_idx = np.nonzero(ids >= 0)
        e_idx = ids[t_idx, j_idx]
        order = np.lexsort((j_idx, t_idx, e_idx))   # ascending expert, then token, slot
        t_idx, j_idx, e_idx = t_idx[order], j_idx[order], e_idx[order]
        owner = np.array([self.owner(layer, e, t) for e, t in zip(e_idx.tolist(), t_idx.tolist())],
                         np.int64)
        sels = [np.flatnonzero(owner == s) for s in range(len(self.shards))]
        for s, sel in enumerate(sels):              # every routed pair goes to a shard
            self.sent[s] += sel.size                # (counted even if the step then fails)
        es = pipe._last_tables.es
        if es is not self._es or any(getattr(s, "restarted", False) for s in self.shards):
            self.sync(es)
        xn, x = sc.xn[:n], sc.x[:n]
        w = wv[t_idx, j_idx]
        out = np.empty((len(e_idx), x.shape[1]), np.float32)
        calls = [(sel, shard, shard.submit(layer, xn[t_idx[sel]], e_idx[sel], w[sel]))
                 for sel, shard in zip(sels, self.shards) if sel.size]
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


def _write(path: str, data: bytes) -> None:
    from ..files import write_atomic
    write_atomic(path, data)


def _f32(a: np.ndarray):
    return ffi.cast("float *", ffi.from_buffer(a))
