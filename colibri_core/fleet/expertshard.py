"""Expert parallelism's step (issue 40, docs/SCALE.md "A model larger than one machine"):
the routed experts of every MoE layer computed on expert shards, the rest on the driver.

    ExpertShard     holds a share of the routed experts (a placement plan's, expertplan.py);
                    given a layer's (token row, expert, weight) pairs it returns each pair's
                    weighted output, unsummed
    ShardedExperts  the driver's expert executor (Pipeline.experts): sends each shard the
                    pairs of its experts, runs the shared expert itself meanwhile, then adds
                    what came back in ascending expert id and the shared expert's output

Bit-exactness: ck_step_experts adds, per token, x + y_e * w_e over its experts in
ascending id and then the shared expert, every product rounded to float32 before the add
(no contraction: kernels/build.py). A shard computes each pair as its own row (row p =
the pair's token's xn), so it returns round(y_e * w_e) -- a row's result does not depend
on the other rows (the pipeline is batch-invariant) -- and the driver's float32 adds in
the same order give the single-machine pipeline's bits; so does the shared expert
computed into zeros and added last. The executor's per-layer work is a fixed number of
numpy calls (no per-pair Python): a token's pairs sorted by expert id within its row,
owners by one lookup in a per-layer table, then kmax adds of [n, H] (rank r of every
token at once).

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
        p = len(experts)
        xn = np.ascontiguousarray(xn, np.float32)
        out = np.zeros((p, xn.shape[1]), np.float32)
        if p == 0:
            return out
        # an id past the table clips to its last entry, always False
        if experts.min() < 0 or not own.take(experts, mode="clip").all():
            bad = experts[(experts < 0) | ~own.take(experts, mode="clip")]
            raise ValueError(f"expert shard {self.index}: layer {layer} expert {int(bad[0])} "
                             f"is not placed here")
        w = np.ascontiguousarray(weights, np.float32)
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
        self._tabs: dict = {}                       # layer -> _owner_table's arrays
        self._tok: tuple = (None, None)             # _tokens' last (n, kmax), answer
        self._out = np.empty(0, np.float32)         # the pairs' outputs, grown as needed

    def install(self) -> "ShardedExperts":
        self.pipe.experts = self
        return self

    def uninstall(self) -> None:
        self.pipe.experts = self.pipe._experts

    def _owner_table(self, layer: int, top: int) -> tuple:
        """(primary [E'], owners [E', R], replicas [E'] or None when none is replicated)
        of a layer's expert ids < E' (>= top): the plan's, hot-plugged slots hot_owner's."""
        tab = self._tabs.get(layer)
        if tab is None or len(tab[0]) < top:
            own = self.owners[layer]
            size = max(len(own), top)
            reps = np.array([len(o) for o in own] + [1] * (size - len(own)), np.int64)
            table = np.zeros((size, int(reps.max())), np.int64)
            for e, o in enumerate(own):
                table[e, :len(o)] = o
            table[len(own):, 0] = hot_owner(np.arange(len(own), size), len(self.shards))
            tab = self._tabs[layer] = (np.ascontiguousarray(table[:, 0]), table,
                                       reps if table.shape[1] > 1 else None)
        return tab

    def owner_of(self, layer: int, e: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The shard of each pair (expert e >= 0, token t): the expert's primary, or a
        replicated expert's owners in turn by token (t % replicas)."""
        prim, table, reps = self._owner_table(layer, 0)
        try:
            return prim[e] if reps is None else table[e, t % reps[e]]
        except IndexError:                          # a hot-plugged slot beyond the table
            prim, table, reps = self._owner_table(layer, int(e.max()) + 1)
            return prim[e] if reps is None else table[e, t % reps[e]]

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
        # a token's pairs in ascending expert id, a repeated expert in slot order: the
        # order ck_step_experts adds them in (pairs flat, token-major: n * kmax)
        tok, base = self._tokens(n, kmax)
        if kmax > 1:
            order = idv.argsort(axis=1, kind="stable")
            order += base
            order = order.reshape(-1)
            ids, wts = idv.reshape(-1)[order], wv.reshape(-1)[order]
        else:
            ids, wts = idv.reshape(-1), wv.reshape(-1)
        valid = ids >= 0                            # -1: no expert (they sort first)
        full = valid.all()
        pos = None if full else valid.nonzero()[0]
        e_p, t_p, w_p = (ids, tok, wts) if full else (ids[pos], tok[pos], wts[pos])
        owner = self.owner_of(layer, e_p, t_p)
        sels = [(owner == s).nonzero()[0] for s in range(len(self.shards))]
        for s, sel in enumerate(sels):              # every routed pair goes to a shard
            self.sent[s] += sel.size                # (counted even if the step then fails)
        es = pipe._last_tables.es
        if es is not self._es or any(getattr(s, "restarted", False) for s in self.shards):
            self.sync(es)
        xn, x = sc.prefix("xn", n), sc.prefix("x", n)
        H = x.shape[1]
        if self._out.size < n * kmax * H:
            self._out = np.empty(n * kmax * H, np.float32)
        out = self._out[:n * kmax * H].reshape(n * kmax, H)
        calls = [(sel, shard, shard.submit(layer, xn[t_p[sel]], e_p[sel], w_p[sel]))
                 for sel, shard in zip(sels, self.shards) if sel.size]
        block = L.block
        shared = None
        if block.shared != ffi.NULL:                # while the shards compute: the shared
            shared = np.zeros((n, H), np.float32)   # expert into rows of its own, added last
            run_ids = sc.rows("run_ids", -1, n, kmax)
            run_ids[...] = -1
            _, _, p_w = sc.p_layer[i]
            pipe._check(lib.ck_step_experts(block, sc.p_xn, n, sc.p_run_ids, p_w, kmax,
                                            _f32(shared), sc.s))
        for sel, shard, h in calls:
            out[sel if full else pos[sel]] = shard.result(h)
        # x + c per pair, a token's in the order above: rank r of every token at once
        out = out.reshape(n, kmax, H)
        if full:
            for r in range(kmax):
                x += out[:, r]
        else:
            valid = valid.reshape(n, kmax)
            for r in range(kmax):
                m = valid[:, r]
                x[m] += out[m, r]
        if shared is not None:
            x += shared

    def _tokens(self, n: int, kmax: int) -> tuple:
        """([n * kmax] each flat pair's token row, [n, 1] each row's first flat pair),
        cached for the last step size."""
        if self._tok[0] != (n, kmax):
            rows = np.arange(n, dtype=np.int64)
            self._tok = ((n, kmax), (np.repeat(rows, kmax), rows[:, None] * kmax))
        return self._tok[1]


def _write(path: str, data: bytes) -> None:
    from ..files import write_atomic
    write_atomic(path, data)


def _f32(a: np.ndarray):
    return ffi.cast("float *", ffi.from_buffer(a))
