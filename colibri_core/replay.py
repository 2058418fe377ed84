"""`colibri replay AUDIT.jsonl --model DIR [--experts-dir DIR]`: every scored item of an
audit log (audit.py) computed again under the expert set its line names, and every item
whose output differs in any bit reported.

The expert set is rebuilt by id: the model's own experts from --model, each hot-plugged
expert from the file the audit log kept by its sha256 (`AUDIT.jsonl.experts/`), else
from --experts-dir (its staging folder, or any expert there with that sha256). A missing
or changed file is refused with one line naming the expert. The rebuilt set's id must be
the logged one. Items are scored in batches straight through the one pipeline
(Model.forward with that set): the batch-invariant pipeline and the fixed-point router
make an item's bits independent of its batch, so a replay reproduces them exactly --
unless a weight changed, which is what it is for.

Generation lines are replayed when they can be: greedy (temperature 0, no logit bias),
under one expert set (pinned: every server choice is); the sequence is generated again
for as many tokens as it had, with the end-of-sequence token masked if it was, and the
digest of its tokens compared. Others are counted as not replayable. Exit status: 0 every
item reproduced, 1 some differ, 2 the log or a set could not be read.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .runtime.audit import RouteSink, input_digest, output_digest, routing_of
from .errors import AuditLogError, ColibriError
from .nesting import TooDeep, json_loads

BATCH_TOKENS = 2048         # tokens per forward of the replay


@dataclass
class Item:
    where: str               # FILE:LINE
    d: dict


@dataclass
class Report:
    items: int = 0
    sets: int = 0
    generations: int = 0        # generation lines replayed
    not_replayable: int = 0     # sampled, biased, or computed under two sets
    differ: list = field(default_factory=list)      # one dict per differing item

    def lines(self) -> list[str]:
        out = [f"replayed {self.items} scored items" + (
            f" and {self.generations} generated sequences" if self.generations else "") +
            f" under {self.sets} expert sets: {len(self.differ)} differ" + (
            f" ({self.not_replayable} generation lines not replayable: sampled or "
            f"straddling)" if self.not_replayable else "")]
        for x in self.differ:
            out.append(f"{x['where']}: request {x['request_id']} item {x['item']} (expert set "
                       f"{x['expert_set']['generation']}, {x['expert_set']['id'][:12]}): "
                       f"{x['what']}")
        return out


def _need(d: dict, key: str, kind, where: str):
    v = d.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise AuditLogError(f"{where}: field {key!r} missing or not a {getattr(kind, '__name__', kind)}"
                            f" (got {v!r:.40})")
    return v


def read_log(paths: list) -> tuple[dict, list, dict, int]:
    """-> (expert_set lines by id, score items, the engine line, generation items)."""
    sets, items, engine, gens = {}, [], {}, []
    for p in paths:
        try:
            f = open(p, encoding="utf-8")
        except OSError as e:
            raise AuditLogError(f"{p}: cannot open the audit log: {e.strerror}") from None
        with f:
            for n, line in enumerate(f, 1):
                where = f"{p}:{n}"
                if not line.strip():
                    continue
                try:
                    d = json_loads(line)
                except json.JSONDecodeError as e:
                    raise AuditLogError(f"{where}: not a JSON line ({e.msg} at column "
                                        f"{e.colno})") from None
                except TooDeep as e:
                    raise AuditLogError(f"{where}: not an audit line: {e}") from None
                if not isinstance(d, dict):
                    raise AuditLogError(f"{where}: expected a JSON object")
                kind = _need(d, "kind", str, where)
                if kind == "expert_set":
                    _need(d, "id", str, where)
                    _need(d, "generation", int, where)
                    for e in _need(d, "experts", list, where):
                        for key, t in (("name", str), ("sha256", str), ("slot", int),
                                       ("file", str)):
                            _need(e, key, t, where + " experts[]")
                    d["where"] = where
                    d["log"] = str(p)
                    sets[d["id"]] = d
                elif kind == "score":
                    es = _need(d, "expert_set", dict, where)
                    _need(es, "id", str, where + " expert_set")
                    toks = _need(d, "tokens", list, where)
                    _need(d, "k", int, where)
                    _need(d, "all_positions", bool, where)
                    out = _need(d, "output", dict, where)
                    _need(out, "sha256", str, where + " output")
                    if not toks or not all(isinstance(t, int) for t in toks):
                        raise AuditLogError(f"{where}: field 'tokens' must be a non-empty "
                                            f"list of token ids")
                    if input_digest(toks) != d.get("input_sha256"):
                        raise AuditLogError(f"{where}: field 'input_sha256' does not match "
                                            f"its tokens (the line was changed)")
                    if es["id"] not in sets:
                        raise AuditLogError(f"{where}: expert set {es['id'][:12]} has no "
                                            f"expert_set line before it in {p}")
                    items.append(Item(where, d))
                elif kind == "generation":
                    _need(d, "tokens", list, where)
                    _need(d, "k", int, where)
                    out = _need(d, "output", dict, where)
                    _need(out, "tokens_sha256", str, where + " output")
                    _need(out, "n_tokens", int, where + " output")
                    es = d.get("expert_set")
                    if isinstance(es, dict) and es.get("id") not in sets:
                        raise AuditLogError(f"{where}: expert set {str(es.get('id'))[:12]} has "
                                            f"no expert_set line before it in {p}")
                    gens.append(Item(where, d))
                elif kind == "engine":
                    engine = d
                else:
                    raise AuditLogError(f"{where}: field 'kind': unknown value {kind!r}")
    return sets, items, engine, gens


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def _find_expert(e: dict, rec: dict, experts_dir: Optional[Path]) -> Path:
    """The file of hot-plugged expert `e` of expert_set line `rec`: kept by the audit
    log, or in --experts-dir with the same sha256; else one line naming it."""
    from .experts.hotplug.bundle import bundle_identity
    sha = e["sha256"]
    tried = [Path(rec["log"] + ".experts") / e["file"]]
    if experts_dir is not None:
        staging = experts_dir / ".colibri-state" / "staging"
        tried.append(staging / f"{sha}.so")
        tried += sorted(experts_dir.glob("*.so"))
    for p in tried:
        if not p.is_file():
            continue
        bundle = p.parent.name.endswith(".expert")
        got = bundle_identity(p.parent) if bundle else _sha256_file(p)
        if got == sha:
            return p
        if p == tried[0]:
            raise AuditLogError(f"{rec['where']}: expert {e['name']} of expert set "
                                f"{rec['id'][:12]}: kept file {p} has sha256 {got[:16]}..., "
                                f"the log names {sha[:16]}... (the file was changed)")
    where = f" or in --experts-dir {experts_dir}" if experts_dir is not None else \
        " (pass --experts-dir DIR where it is)"
    raise AuditLogError(f"{rec['where']}: expert set {rec['id'][:12]} needs expert "
                        f"{e['name']} {e.get('version', '')} (sha256 {sha[:16]}...): not "
                        f"found at {tried[0]}{where}")


def build_set(eng, rec: dict, experts_dir: Optional[Path], loaded: list, base=None):
    """The expert set of expert_set line `rec`, on `base` (default: `eng`'s current set,
    which must hold the model's experts only)."""
    from .experts.hotplug.bundle import read_staged
    from .experts.hotplug.expert import LoadedExpert
    es = base if base is not None else eng.model.expert_set
    H = eng.model_cfg.hidden_size
    for e in sorted(rec["experts"], key=lambda e: e["slot"]):
        path = _find_expert(e, rec, experts_dir)
        try:
            info = read_staged(str(path), H, set(eng.model_cfg.moe_layers))
            prep = LoadedExpert(info, e["sha256"], str(path), str(path), "inprocess",
                                call_timeout_s=5.0, capacity=64)
        except ColibriError as err:
            raise AuditLogError(f"{rec['where']}: expert {e['name']} ({path}): {err}") from None
        loaded.append(prep)
        es = es.with_expert(prep.materialize(e["slot"]))
    if es.id != rec["id"]:
        raise AuditLogError(f"{rec['where']}: the rebuilt expert set's id is {es.id[:12]}, "
                            f"the log names {rec['id'][:12]}: the model directory's experts "
                            f"are not the logged run's (config.json's sha256 list)")
    return es


def replay(eng, paths: list, experts_dir: Optional[Path] = None,
           batch_tokens: int = BATCH_TOKENS) -> Report:
    """Replay every scored item of the audit files `paths` on engine `eng`."""
    sets, items, _, gens = read_log([Path(p) for p in paths])
    rep = Report(items=len(items))
    by_set: dict = {}
    for it in items:
        by_set.setdefault(it.d["expert_set"]["id"], []).append(it)
    gen_by_set: dict = {}
    for it in gens:
        s = it.d.get("sampling") or {}
        if it.d.get("expert_sets") or not isinstance(it.d.get("expert_set"), dict) or \
                s.get("temperature") != 0 or s.get("logit_bias") or s.get("grammar") or \
                any(k.endswith("_penalty") for k in s):     # penalties: not replayed
            rep.not_replayable += 1
        else:
            gen_by_set.setdefault(it.d["expert_set"]["id"], []).append(it)
            by_set.setdefault(it.d["expert_set"]["id"], [])
    model = eng.model
    sink = RouteSink(model.pipeline)
    model.route_sink = sink
    loaded: list = []
    base = model.expert_set
    try:
        for sid, group in by_set.items():
            es = build_set(eng, sets[sid], experts_dir, loaded, base)
            rep.sets += 1
            if gen_by_set.get(sid):
                _check_generations(eng, es, gen_by_set[sid], rep)
            i = 0
            while i < len(group):
                batch, n = [], 0
                while i < len(group) and (not batch or n + len(group[i].d["tokens"]) <= batch_tokens):
                    batch.append(group[i])
                    n += len(group[i].d["tokens"])
                    i += 1
                _check_batch(model, es, batch, sink, rep)
    finally:
        model.route_sink = None
        if model.expert_set is not base:          # generations replayed: put it back
            eng.queue_expert_change(lambda _: base)
            eng.apply_expert_changes()
        # the base set's tables current again, the rebuilt sets' dropped, before their
        # experts are unloaded
        model.pipeline.adopt(base, model.pipeline.prepare(base))
        model.pipeline.keep_pinned([])
        for p in loaded:
            p.discard()
    return rep


def _check_generations(eng, es, items: list, rep: Report) -> None:
    """Greedy sequences generated again under `es` (made the engine's current set:
    generate() runs on the current one), their tokens' digest compared."""
    eng.queue_expert_change(lambda _: es)
    eng.apply_expert_changes()
    for it in items:
        d = it.d
        mask = np.asarray((d.get("sampling") or {}).get("mask") or [], np.int64)

        def greedy(logits, mask=mask):
            if mask.size:
                logits = np.array(logits, np.float64)
                logits[mask] = -np.inf
            return int(np.argmax(logits))
        n = d["output"]["n_tokens"]
        g = eng.generate(d["tokens"], max_new_tokens=n, experts_per_token=d["k"], sampler=greedy,
                         pin_experts=True).run()
        rep.generations += 1
        if input_digest(g.token_ids[:n]) != d["output"]["tokens_sha256"]:
            rep.differ.append({"where": it.where, "request_id": d.get("request_id"),
                               "item": None, "expert_set": d["expert_set"],
                               "what": "generated tokens differ"})


def _check_batch(model, es, batch: list, sink, rep: Report) -> None:
    caches = [model.new_cache(len(it.d["tokens"])) for it in batch]
    outs = model.forward([np.asarray(it.d["tokens"], np.int64) for it in batch], caches,
                         [it.d["k"] for it in batch], all_logits=[it.d["all_positions"]
                                                                  for it in batch],
                         expert_set=es)
    for it, out, cache in zip(batch, outs, caches):
        d = it.d
        routes = routing_of(sink.take(cache), d["k"])
        what = []
        if output_digest(out) != d["output"]["sha256"]:
            what.append("output differs")
            if d["all_positions"] and d.get("scores"):
                from .runtime.audit import next_token_logprobs
                got = np.asarray(next_token_logprobs(out, d["tokens"]))
                want = np.asarray(d["scores"], np.float64)
                if got.shape == want.shape:
                    what.append(f"max |d logprob| {np.abs(got - want).max():.3g}")
        if "routing" in d and routes != d["routing"]:
            bad = [L for L in routes if routes[L] != d["routing"].get(L)]
            what.append(f"routing differs at MoE layer {', '.join(bad)}")
        if what:
            rep.differ.append({"where": it.where, "request_id": d.get("request_id"),
                               "item": d.get("item"), "expert_set": d["expert_set"],
                               "what": "; ".join(what)})


def add_arguments(p) -> None:
    p.add_argument("audit", nargs="+", help="audit log files (rotated ones too: AUDIT.jsonl.1 ...)")
    p.add_argument("--model", required=True, help="the model directory the log was written with")
    p.add_argument("--experts-dir", dest="experts_dir",
                   help="where hot-plugged experts the log did not keep may be found "
                        "(its staging folder and its .so files, by sha256)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")


def main(args, out=None) -> int:
    from .engine import Engine
    out = out or sys.stdout
    try:
        _, _, engine_line, _ = read_log([Path(p) for p in args.audit])
        settings = {k: engine_line[k] for k in ("activations", "kv_dtype", "routing")
                    if k in engine_line}
        if args.threads is not None:
            settings["threads"] = args.threads
        eng = Engine.from_model_dir(args.model, **settings)
        try:
            rep = replay(eng, args.audit, Path(args.experts_dir) if args.experts_dir else None)
        finally:
            eng.close()
    except ColibriError as e:
        print(f"colibri replay: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"items": rep.items, "sets": rep.sets, "generations": rep.generations,
                          "not_replayable": rep.not_replayable,
                          "differ": rep.differ}), file=out)
    else:
        print("\n".join(rep.lines()), file=out)
    return 1 if rep.differ else 0
