"""The expert set: which experts each MoE layer can route to, and their router rows.

An `ExpertSet` is an immutable snapshot. The engine swaps in a new snapshot between two
tokens when hot-plugged experts are added, replaced or removed; a request that pins its
expert set keeps the snapshot it started with. Slots: the model's own experts are
0..num_experts-1, hot-plugged ones get stable slots from num_experts on (a vacant slot has
no expert and a router logit of -1e30, so it is never chosen).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .modelfile import expert_name
from .weights import FFNWeights, ModelWeights

VACANT_LOGIT = -1e30   # finite, so the router's non-finite fallback is not triggered


class HotSlot:
    """A hot-plugged expert in a router slot of one layer: the Expert protocol
    (weights.Expert) around a hotplug HotExpert."""

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


@dataclass(frozen=True)
class ExpertSet:
    version: int
    experts: dict            # layer -> tuple(expert | HotSlot | None), indexed by slot
    routers: dict            # layer -> float32 [slots, H]
    logit_bias: dict         # layer -> float32 [slots] added to the router logits, or None
    select_bias: dict        # layer -> float32 [slots] selection-only bias (DeepSeek), or None

    @classmethod
    def from_weights(cls, w: ModelWeights) -> "ExpertSet":
        moe = [lw for lw in w.layers if lw.kind == "moe"]
        return cls(0, {lw.index: tuple(lw.experts) for lw in moe},
                   {lw.index: lw.router for lw in moe}, {lw.index: None for lw in moe},
                   {lw.index: (None if lw.router_bias is None else np.asarray(lw.router_bias, np.float32))
                    for lw in moe})

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
        return ExpertSet(self.version + 1, experts, routers, lbias, sbias)
