"""Expert placement for expert parallelism (issue 40, docs/SCALE.md "A model larger than
one machine"): which of N shards holds each MoE layer's routed experts.

The plan is data, a JSON file `colibri experts place` writes:

    {"format": 1, "shards": N, "num_experts": E, "model_experts_sha256": "...",
     "owners": {"<layer>": [[shard, ...] per expert, ascending id]},
     "bytes": [per shard], "load": [per shard] | null}

An expert's first owner is its primary; a replicated (hot) expert has more, and the step
splits its tokens between them (any owner computes the same bits). Attention, routers,
shared experts and dense layers stay on the driver, which runs the step.

Balance: memory first -- per layer no shard holds more than ceil(experts / N) of them
(replicas counted), so the shards' bytes stay even; within that, experts by descending
cost (measured load when routing statistics are given, else bytes) go to the shard with
the least cost so far in that layer (a layer waits for its slowest shard), ties to the
shard holding the fewest bytes overall (so E % N leftovers rotate between shards).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from ..errors import ColibriError

PLAN_FORMAT = 1


class PlanError(ColibriError, ValueError):
    """A placement plan that does not fit its model, or bad input to make one."""


def model_experts(model_dir) -> tuple[dict[int, list[int]], str]:
    """({MoE layer: bytes of each routed expert}, sha256 over the experts' file digests),
    from the model's config.json alone (no weights are read)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read the model's config ({e})") from None
    files, E = cfg.get("files", {}), int(cfg.get("num_experts") or 0)
    out, digest = {}, hashlib.sha256()
    for L, kind in enumerate(cfg.get("layer_types", [])):
        if kind != "moe":
            continue
        sizes = []
        for e in range(E):
            info = files.get(f"expert_{L}_{e}.bin")
            if info is None:
                raise PlanError(f"{path}: files: expert_{L}_{e}.bin missing")
            sizes.append(int(info["size"]))
            digest.update(f"{L}/{e}:{info['sha256']};".encode())
        out[L] = sizes
    if not out:
        raise PlanError(f"{path}: the model has no MoE layer; nothing to place")
    return out, digest.hexdigest()


def read_load(path) -> dict[int, list[float]]:
    """Routing statistics: {"<layer>": [routed tokens per expert]}, or the same under
    "routed_tokens" (Engine.routed_tokens() written as JSON)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read routing statistics ({e})") from None
    raw = raw.get("routed_tokens", raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected {{\"<layer>\": [tokens per expert]}}")
    out = {}
    for k, v in raw.items():
        if not (str(k).isdigit() and isinstance(v, list)
                and all(isinstance(c, (int, float)) and c >= 0 for c in v)):
            raise PlanError(f"{path}: layer {k!r}: expected a list of non-negative counts")
        out[int(k)] = [float(c) for c in v]
    return out


def place(model_dir, shards: int, load: Optional[dict] = None, replicate: int = 0) -> dict:
    """The plan for `shards` shards (see the module's docstring); `replicate` hottest
    experts per layer (by load; needs it) get a second owner."""
    if shards < 1:
        raise PlanError(f"shards: {shards}; expected at least 1")
    if replicate and not load:
        raise PlanError("replicate: needs routing statistics (which experts are hot)")
    if replicate and shards < 2:
        raise PlanError("replicate: needs at least 2 shards")
    sizes, digest = model_experts(model_dir)
    E = len(next(iter(sizes.values())))
    total_bytes, total_load = [0] * shards, [0.0] * shards
    owners = {}
    for L, b in sizes.items():
        counts = (load or {}).get(L)
        if load and (counts is None or len(counts) < E):
            raise PlanError(f"routing statistics: layer {L}: expected {E} counts, "
                            f"got {0 if counts is None else len(counts)}")
        cost = counts[:E] if load else [float(x) for x in b]
        layer_cost = [0.0] * shards
        own: list[list[int]] = [[] for _ in range(E)]
        hot = set(sorted(range(E), key=lambda e: (-cost[e], e))[:replicate]) if replicate else set()
        cap = -(-(E + len(hot)) // shards)         # memory first: at most cap per shard
        held = [0] * shards
        for e in sorted(range(E), key=lambda e: (-cost[e], e)):
            n_own = 2 if e in hot else 1
            picks = sorted((s for s in range(shards) if held[s] < cap),
                           key=lambda s: (layer_cost[s], total_bytes[s], s))[:n_own]
            for s in picks:
                own[e].append(s)
                held[s] += 1
                layer_cost[s] += cost[e] / n_own
                total_bytes[s] += b[e]
                if load:
                    total_load[s] += cost[e] / n_own
        owners[str(L)] = own
    return {"format": PLAN_FORMAT, "shards": shards, "num_experts": E,
            "model_experts_sha256": digest, "owners": owners, "bytes": total_bytes,
            "load": total_load if load else None}


def check_plan(plan, model_dir, where: str = "plan") -> dict:
    """The plan, checked against the model: {layer: [owners per expert]} (ints), or a
    one-line PlanError naming the field."""
    if not isinstance(plan, dict):
        raise PlanError(f"{where}: expected a JSON object")
    if plan.get("format") != PLAN_FORMAT:
        raise PlanError(f"{where}: format: {plan.get('format')!r}; expected {PLAN_FORMAT}")
    N = plan.get("shards")
    if not isinstance(N, int) or isinstance(N, bool) or N < 1:
        raise PlanError(f"{where}: shards: {N!r}; expected an integer >= 1")
    sizes, digest = model_experts(model_dir)
    if plan.get("model_experts_sha256") != digest:
        raise PlanError(f"{where}: model_experts_sha256: made for other experts than "
                        f"{model_dir}'s; run `colibri experts place` again")
    owners = plan.get("owners")
    if not isinstance(owners, dict):
        raise PlanError(f"{where}: owners: expected {{\"<layer>\": [[shard, ...] per expert]}}")
    extra = sorted(set(owners) - {str(L) for L in sizes})
    if extra:
        raise PlanError(f"{where}: owners.{extra[0]}: not a MoE layer of the model "
                        f"(its MoE layers: {sorted(sizes)})")
    out = {}
    for L, b in sizes.items():
        own = owners.get(str(L))
        if not isinstance(own, list) or len(own) != len(b):
            got = len(own) if isinstance(own, list) else "none"
            raise PlanError(f"{where}: owners.{L}: {got} experts; the model's layer {L} "
                            f"has {len(b)}")
        for e, o in enumerate(own):
            if not (isinstance(o, list) and o and len(set(o)) == len(o) and all(
                    isinstance(s, int) and not isinstance(s, bool) and 0 <= s < N for s in o)):
                raise PlanError(f"{where}: owners.{L}[{e}]: {o!r}; expected distinct shard "
                                f"ids in 0..{N - 1}, at least one")
        out[L] = [list(o) for o in own]
    return out


def load_plan(path, model_dir) -> tuple[int, dict]:
    """(shards, {layer: owners per expert}) from a plan file, checked against the model."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read the plan ({e})") from None
    owners = check_plan(plan, model_dir, str(path))
    return plan["shards"], owners
