"""The expert set: which experts each MoE layer can route to, and their router rows.

An `ExpertSet` is an immutable snapshot. The engine swaps in a new snapshot between two
tokens when hot-plugged experts are added, replaced or removed; a request that pins its
expert set keeps the snapshot it started with. Slots: the model's own experts are
0..num_experts-1, hot-plugged ones get stable slots from num_experts on (a vacant slot has
no expert and a router logit of -1e30, so it is never chosen).

Two names for a snapshot: its `generation`, a counter that only grows (+1 per applied
change), and its `id`, a digest of which experts it holds (`expert_set_id`), so that two
engines with the same experts report the same id whatever the load order or slots.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..files import open_regular
from ..format.modelfile import ALIGN, expert_file_name, expert_name
from ..model.weights import FFNWeights, ModelWeights

VACANT_LOGIT = -1e30   # finite, so the router's non-finite fallback is not triggered


class HotSlot:
    """A hot-plugged expert in a router slot of one layer: the Expert protocol
    (protocol.Expert) around a hotplug HotExpert."""

    file = None

    def __init__(self, hot, layer: int):
        self.hot = hot
        self.layer = layer
        self.index = hot.slot
        q4 = hot.q4
        # Embedded INT4 weights run on our own kernels; otherwise its ffn_forward is called.
        self.ffn: Optional[FFNWeights] = FFNWeights(q4.w1, q4.w3, q4.w2) if q4 is not None else None
        self.forward = hot.forward

    @property
    def name(self) -> str:
        return expert_name(self.layer, self.index)

    @property
    def address(self) -> int:
        return int(self.hot.q4.w1.data.ctypes.data) if self.hot.q4 is not None else 0

    @property
    def nbytes(self) -> int:
        q = self.hot.q4
        if q is None:
            return 0
        return sum(int(a.nbytes) for t in (q.w1, q.w3, q.w2) for a in (t.data, t.scales, t.zeros))


def model_expert_digest(w: ModelWeights, expert) -> str:
    """A stable identity of one of the model's own experts, without reading its weights.

    The sha256 config.json lists for its file (the converter writes one per file; the
    model's own content digest). A model directory without that list: sha256 over the
    file's size and its first 4 KiB (the header section: magic, section table, shapes) --
    hashing every expert's bytes would read hundreds of MB at each start."""
    info = (w.cfg.files or {}).get(expert_file_name(expert.layer, expert.index))
    if info is not None:
        return info.sha256
    path = expert.file.path if expert.file is not None else \
        Path(w.path) / expert_file_name(expert.layer, expert.index)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, ALIGN, 0)
    finally:
        os.close(fd)
    return "header:" + hashlib.sha256(b"%d\n" % size + head).hexdigest()


def expert_set_id(pairs) -> str:
    """Hex sha256 over sorted distinct (name, digest) pairs, one "name\tdigest\n" line
    each: a hot-plugged expert's digest is the sha256 of its file's bytes (computed once
    per file by the hot-plug manager), a model expert's is model_expert_digest()."""
    h = hashlib.sha256()
    for name, digest in sorted(set(pairs)):
        h.update(f"{name}\t{digest}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ExpertSet:
    version: int             # the generation (the public name); model.py and decode.py read it
    experts: dict            # layer -> tuple(expert | HotSlot | None), indexed by slot
    routers: dict            # layer -> float32 [slots, H]
    logit_bias: dict         # layer -> float32 [slots] added to the router logits, or None
    select_bias: dict        # layer -> float32 [slots] selection-only bias (DeepSeek), or None
    # model expert name -> model_expert_digest(), worked out once at load, shared by every
    # snapshot after it
    model_digests: dict = field(default_factory=dict, repr=False, compare=False)
    id: str = field(default="", compare=False)   # expert_set_id(self.pairs()), set once
    # a candidate's set (candidates.py): the live set with that candidate in its slot,
    # named by the candidate; "" for the live set and its pinned snapshots
    candidate: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", expert_set_id(self.pairs()))

    @property
    def generation(self) -> int:
        """A counter that only grows: +1 per change applied to the set."""
        return self.version

    def pairs(self) -> list[tuple[str, str]]:
        """Sorted distinct (name, digest) of every expert in the set (see expert_set_id)."""
        out = set()
        for exps in self.experts.values():
            for e in exps:
                if e is None:
                    continue
                if isinstance(e, HotSlot):
                    out.add((e.hot.name, e.hot.sha256))
                else:
                    out.add((e.name, self.model_digests.get(e.name, "")))
        return sorted(out)

    @classmethod
    def from_weights(cls, w: ModelWeights) -> "ExpertSet":
        moe = [lw for lw in w.layers if lw.kind == "moe"]
        digests = {e.name: model_expert_digest(w, e)
                   for lw in moe for e in lw.experts if e is not None}
        return cls(0, {lw.index: tuple(lw.experts) for lw in moe},
                   {lw.index: lw.router for lw in moe},
                   {lw.index: (None if lw.router_logit_bias is None else
                               np.asarray(lw.router_logit_bias, np.float32)) for lw in moe},
                   {lw.index: (None if lw.router_bias is None else np.asarray(lw.router_bias, np.float32))
                    for lw in moe}, digests)

    def slots(self, layer: int) -> int:
        return len(self.experts[layer])

    def hot_experts(self) -> list:
        """The distinct hot-plugged experts in this set."""
        seen = {}
        for exps in self.experts.values():
            for e in exps:
                if isinstance(e, HotSlot):
                    seen[id(e.hot)] = e.hot
        return list(seen.values())

    def hot_plugged_bytes(self) -> int:
        """The INT4 weights of this set's hot-plugged experts, each counted once (outside
        the memory budget: Engine.memory_report's `hot_plugged_bytes`)."""
        seen = {}
        for exps in self.experts.values():
            for e in exps:
                if isinstance(e, HotSlot):
                    seen[id(e.hot)] = e.nbytes
        return sum(seen.values())

    def with_expert(self, hot, remove: bool = False) -> "ExpertSet":
        """A new snapshot with `hot` placed in (or, with remove, taken out of) its slot in
        each of its layers."""
        experts, routers = dict(self.experts), dict(self.routers)
        lbias, sbias = dict(self.logit_bias), dict(self.select_bias)
        slot = hot.slot
        for L in hot.layers:
            exps = list(experts[L])
            n = max(len(exps), slot + 1)
            H = routers[L].shape[1]
            r = np.zeros((n, H), np.float32)
            r[:len(exps)] = routers[L]
            b = np.zeros(n, np.float32)
            if lbias[L] is not None:
                b[:len(exps)] = lbias[L]
            exps += [None] * (n - len(exps))
            b[len(self.experts[L]):] = VACANT_LOGIT           # new empty slots
            if remove:
                exps[slot] = None
                r[slot] = 0.0
                b[slot] = VACANT_LOGIT
            else:
                exps[slot] = HotSlot(hot, L)
                r[slot] = hot.router_row
                b[slot] = hot.router_bias
            if sbias[L] is not None and len(sbias[L]) < n:
                sbias[L] = np.concatenate([sbias[L], np.zeros(n - len(sbias[L]), np.float32)])
            experts[L], routers[L], lbias[L] = tuple(exps), r, b
        return ExpertSet(self.version + 1, experts, routers, lbias, sbias, self.model_digests)
