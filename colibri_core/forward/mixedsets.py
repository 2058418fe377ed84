"""Several expert sets in one step: the per-sequence expert table.

A step's sequences may each carry their own expert set (a pinned snapshot, a canary's
set, the live one). Attention and dense layers do not depend on the set; an MoE layer
does in two places: the router (a set may have other rows in hot-plugged slots) and the
expert each slot runs. So the pipeline routes each run of same-set tokens with its set's
router, then runs all of the layer's (token, expert) pairs in one ck_step_experts call
over a union table: per slot, the distinct implementations the step's sets hold there
(one entry when they hold the same bytes, so tokens of different sets that chose the same
expert share its weight pass), and per set a map from its slots to union entries.

Why it is bit-identical to running a sequence alone: the union lists slot 0's entries,
then slot 1's, ... so each set's map is increasing, and the expert block adds a token's
outputs in ascending table index -- the same order as its own slots; every other value a
token gets is computed per token (batch invariance, pipeline.py).

What cannot mix (mixable() says False; Model.forward then runs one pass per set, as
before): plugins that see or change the routing or time experts, hot-plugged experts that
bring only their own code (ffn_forward), the memory budget's expert cache, and an
experts executor other than the pipeline's own (fleet/expertshard.py).
"""
from __future__ import annotations

import numpy as np

from ..experts.expertset import VACANT_LOGIT
from ..kernels import ffi
from .steptables import Keep, SetTables


class MixedTables:
    """The union tables of distinct expert sets' SetTables (kept alive here: the union
    entries point into their Keeps). Per MoE layer: `table` (ck_ffn[] of `n` entries),
    `maps[g]` (int64 [slots + 1]: set g's slot -> union entry, -1 for a vacant slot; the
    last entry -1, so that an unused pair's -1 maps to itself), `slots` (the largest
    router of the sets: the layout of the step's logits) and `token` (what
    StepLayer.tables records)."""

    def __init__(self, tables: list[SetTables]):
        self.tables = tables
        self.index = {id(t): g for g, t in enumerate(tables)}
        self.keep = keep = Keep()
        self.layers: dict[int, _MixedLayer] = {}
        size = ffi.sizeof("ck_ffn")
        for L in tables[0].layers:
            per = [t.layers[L] for t in tables]
            width = max(max(T.n, T.slots) for T in per)
            maps = [np.full(width + 1, -1, np.int64) for _ in per]
            entries: list = []
            for s in range(width):
                seen: dict = {}
                for g, T in enumerate(per):
                    if s >= T.n or T.table[s].w1.data == ffi.NULL:
                        continue                    # vacant here (or past its slots)
                    key = bytes(ffi.buffer(ffi.addressof(T.table, s), size))
                    u = seen.get(key)
                    if u is None:                   # the same descriptor: the same bytes
                        u = seen[key] = len(entries)
                        entries.append((T, s))
                    maps[g][s] = u
            table = keep.new("ck_ffn[]", max(len(entries), 1))
            for u, (T, s) in enumerate(entries):
                table[u] = T.table[s]
            self.layers[L] = _MixedLayer(table, len(entries), maps,
                                         max(T.slots for T in per), object())

    @property
    def entries_max(self) -> int:
        """The largest union table (the scratch's per-expert arrays must hold it)."""
        return max((m.n for m in self.layers.values()), default=1)

    def shared_entries(self) -> int:
        """Slots (all MoE layers) where two or more of the sets run the same expert: what
        one step saves against a pass per set (tests, the benchmark)."""
        out = 0
        for m in self.layers.values():
            cols = np.stack([mp[:-1] for mp in m.maps])
            for s in range(cols.shape[1]):
                got = cols[:, s][cols[:, s] >= 0]
                out += len(got) > len(np.unique(got))
        return out


class _MixedLayer:
    __slots__ = ("table", "n", "maps", "slots", "token")

    def __init__(self, table, n, maps, slots, token):
        self.table, self.n, self.maps, self.slots, self.token = table, n, maps, slots, token


def mixable(pipe, tables: list[SetTables]) -> bool:
    """Whether one pass can run these sets' sequences together (see the module
    docstring for what cannot)."""
    model = pipe.model
    hooks, res = model.hooks, model.residency
    if hooks is not None and (hooks.choose_k_token is not None or hooks.routing is not None
                              or hooks.expert_timing is not None
                              or hooks.expert_prefetch is not None):
        return False
    if res.active or res.speculative:
        return False
    if getattr(pipe.experts, "__func__", None) is not type(pipe)._experts:
        return False                                # a sharded executor (fleet)
    return not any(T.custom for t in tables for T in t.layers.values())


def runs_of(spans: list, tables: list) -> list:
    """[(t0, t1, SetTables)]: the step's tokens in runs of one set (adjacent sequences of
    the same set merged), in token order."""
    out: list = []
    for (t0, t1, _), t in zip(spans, tables):
        if out and out[-1][2] is t and out[-1][1] == t0:
            out[-1] = (out[-1][0], t1, t)
        else:
            out.append((t0, t1, t))
    return out


def logit_rows(buf: np.ndarray, t0: int, t1: int, slots: int, width: int) -> np.ndarray:
    """Run [t0, t1)'s router logits [t1 - t0, slots] in a mixed step's layout: each run's
    rows start at t0 * width of the layer's buffer (`width`: the step's largest router)."""
    flat = buf.reshape(-1)
    return flat[t0 * width:t0 * width + (t1 - t0) * slots].reshape(t1 - t0, slots)


def trace_logits(buf: np.ndarray, runs: list, layer: int, width: int) -> np.ndarray:
    """A mixed step's logits of one layer as [n, width] (a copy; a narrower router's
    missing slots at VACANT_LOGIT: never chosen, probability 0)."""
    n = runs[-1][1]
    out = np.full((n, width), VACANT_LOGIT, np.float32)
    for t0, t1, t in runs:
        slots = t.layers[layer].slots
        out[t0:t1, :slots] = logit_rows(buf, t0, t1, slots, width)
    return out
