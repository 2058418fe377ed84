"""The server's side of candidate experts (experts/candidates.py): the shadow pass of
scored items, the routes that upload, configure, promote, drop and demote candidates and
take labelled feedback, and their rows in `/v1/experts` and `/metrics`.

The shadow pass: after a `/v1/score` call answered, the items whose routing chose a
shadowed candidate's slot (Scored.shadow) are scored again under the candidate's set, by
one thread of this module, queued (at most SHADOW_QUEUE calls wait; more are counted as
`skipped`): from the candidate's first layer on only, from the input rows of that layer
the live pass kept (Scored.hidden; Model.forward_from, run between two of the
scheduler's steps, `REQUEST_ID#shadow:NAME` in the audit log), or whole, as their own
engine request, where rows are missing (the live set changed the layers before it).
Their outputs go to the candidate's gate (gates.py) and never into an answer.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import queue
import threading

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import JSONResponse

from ..experts.candidates import CandidateError
from ..files import write_atomic
from ..model.ops import log_softmax
from ..runtime.audit import now_iso, score_lines
from .errors import ApiError, bad_request
from .limits import LIMITS, check_upload, read_body, read_json

log = logging.getLogger("colibri.server")
SHADOW_QUEUE = 64


def item_scores(items, seqs, outs) -> dict:
    """item index -> [summed log-prob of each candidate continuation] (run_score's)."""
    sums: dict = {}
    for (ii, ci, seq), logits in zip(seqs, outs):
        start = len(items[ii].prompt_ids)
        lp = log_softmax(np.asarray(logits)[start - 1:len(seq) - 1])
        tok = np.asarray(seq[start:])
        sums.setdefault(ii, []).append(float(lp[np.arange(tok.size), tok].sum()))
    return sums


class ShadowRunner:
    """One thread that scores shadowed items under their candidate's set."""

    def __init__(self, engine):
        self.engine = engine
        self.q: queue.Queue = queue.Queue(SHADOW_QUEUE)
        self.passes = {"from_layer": 0, "whole": 0}   # shadow calls each way (tests)
        self.thread = threading.Thread(target=self._run, name="colibri-shadow", daemon=True)
        self.thread.start()

    def put(self, job) -> bool:
        try:
            self.q.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            cand, es, items, part, live, rid, experts = job
            seqs = [s for s, _ in part]
            try:
                outs = self.from_layer(cand, es, part, f"{rid}#shadow:{cand.name}")
                if outs is None:
                    scored = self.engine.score([s for _, _, s in seqs], experts_per_token=experts,
                                               all_positions=True, request_id=f"{rid}#shadow:"
                                               f"{cand.name}", expert_set=es)
                    outs = [x.logits for x in scored]
                    self.passes["whole"] += 1
                got = item_scores(items, seqs, outs)
                for ii, cand_scores in got.items():
                    cand.gate.record_shadow((rid, ii), live[ii], cand_scores)
            except Exception as exc:  # noqa: BLE001 - a shadow never fails a request
                if not self.engine._closed:
                    log.warning("shadow pass of %s for %s failed: %s", cand.name, rid, exc)
                cand.gate.count("skipped", len({s[0] for s in seqs}))
            finally:
                cand.gate.count("pending", -1)


    def from_layer(self, cand, es, part, rid: str):
        """The logits of `part`'s sequences from the candidate's first layer on, from the
        live pass's input rows there, in passes of at most max_batch_tokens run between two
        scheduler steps; None where a sequence's rows are missing."""
        layer = min(cand.hot.layers)
        xs = [(x.hidden or {}).get(layer) for _, x in part]
        if any(h is None or len(h) != len(x.tokens) for h, (_, x) in zip(xs, part)):
            return None
        eng, cap = self.engine, max(1, self.engine.config.max_batch_tokens)
        groups, cur, n = [], [], 0
        for i, h in enumerate(xs):
            if cur and n + len(h) > cap:
                groups.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += len(h)
        groups.append(cur)
        outs: list = []
        for g in groups:
            got = eng.scheduler.call(lambda g=g: self._pass(layer, [xs[i] for i in g],
                                                            [part[i][1] for i in g], es, rid))
            if got is None:
                raise RuntimeError("the engine closed")
            outs += got
        self.passes["from_layer"] += 1
        return outs

    def _pass(self, layer, xs, scored, es, rid) -> list:
        """On the scheduler's thread: one Model.forward_from in caches of the KV pool
        (unpooled ones when it has no room), its audit lines."""
        eng = self.engine
        kv, model = eng.kv_pool, eng.model
        pooled = kv.free_tokens >= sum(map(len, xs)) + len(xs)
        caches = [kv.alloc(len(h)) if pooled else model.new_cache(len(h)) for h in xs]
        try:
            outs = model.forward_from(layer, xs, caches, [x.k for x in scored], es)
            sink = model.route_sink if eng.audit is not None else None
            if sink is not None:
                eng.audit.put_many(score_lines(rid, [(x.tokens, es, o, sink.take(c)) for x, o, c
                                                     in zip(scored, outs, caches)],
                                               scored[0].k, True, now_iso()))
            return outs
        finally:
            if pooled:
                for c in caches:
                    kv.free(c)


def runner(engine) -> ShadowRunner:
    c = engine.candidates
    r = getattr(c, "shadow_runner", None)
    if r is None:
        r = c.shadow_runner = ShadowRunner(engine)
    return r


def after_score(engine, items, seqs, scored, request_id: str, experts) -> None:
    """After a /v1/score call (work.run_score): each item to each candidate's gate --
    a canary's items as its own, the live set's with their live scores, and the items
    whose routing chose a candidate queued for its shadow pass."""
    cands = engine.candidates.active()
    if not cands:
        return
    live = item_scores(items, seqs, [x.logits for x in scored])
    item_set, chose = {}, {}
    for (ii, _, _), x in zip(seqs, scored):
        item_set[ii] = x.expert_set.get("candidate")
        chose.setdefault(ii, set()).update(x.shadow)
    for c in cands:
        shadow = []
        for ii, scores in live.items():
            if item_set[ii] == c.name:
                c.gate.record_canary((request_id, ii), scores)
            elif item_set[ii] is None:
                if c.name in chose[ii]:
                    shadow.append(ii)
                else:
                    c.gate.record_live((request_id, ii), scores)
        if not shadow or c.es is None:
            continue
        want = set(shadow)
        part = [(s, x) for s, x in zip(seqs, scored) if s[0] in want]
        c.gate.count("pending")
        if not runner(engine).put((c, c.es, items, part, live, request_id, experts)):
            c.gate.count("pending", -1)
            c.gate.count("skipped", len(shadow))


def stop(engine) -> None:
    r = getattr(engine.candidates, "shadow_runner", None) if engine.candidates else None
    if r is not None:
        r.q.put(None)


# ---------------------------------------------------------------------------- routes
def _cands(S):
    eng = getattr(S.backend, "engine", None)
    c = getattr(eng, "candidates", None)
    if c is None:
        raise ApiError(409, "this server has no candidates: create a shadow/ folder in the "
                            "watched experts folder and restart it", code="no_candidates")
    return c


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except CandidateError as e:
        raise ApiError(e.status, str(e), code="candidate") from None
    except OSError as e:
        raise ApiError(409, f"moving the candidate's file failed: {e}", code="candidate") \
            from None


def _number(body, key, lo, hi, kind=float):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi or (kind is int and v != int(v)):
        what = "number" if kind is float else "whole number"
        raise bad_request(f"{key}={v!r:.40}: expected a {what} {lo}..{hi}", param=key)
    return kind(v)


async def configure(S, request, rec):
    body = await read_json(request, LIMITS["small"])
    unknown = sorted(set(body) - {"fraction", "threshold", "min_positives", "auto",
                                  "precision_margin"})
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown field; expected fraction, threshold, "
                          f"min_positives, auto, precision_margin", param=unknown[0])
    auto = body.get("auto")
    if auto is not None and not isinstance(auto, bool):
        raise bad_request(f"auto={auto!r:.40}: expected true or false", param="auto")
    row = _call(_cands(S).configure, request.path_params["name"],
                fraction=_number(body, "fraction", 0.0, 1.0),
                threshold=_number(body, "threshold", 0.0, 1.0),
                min_positives=_number(body, "min_positives", 1, 10**9, int), auto=auto,
                precision_margin=_number(body, "precision_margin", 0.0, 1.0))
    return _json(row)


async def promote(S, request, rec):
    return _json(_call(_cands(S).promote, request.path_params["name"]), 202)


async def drop(S, request, rec):
    return _json(_call(_cands(S).drop, request.path_params["name"]), 202)


async def demote(S, request, rec):
    return _json(_call(_cands(S).demote, request.path_params["name"]), 202)


async def feedback(S, request, rec):
    body = await read_json(request, LIMITS["score"])
    items = body.get("items")
    if not isinstance(items, list) or not items:
        raise bad_request("items: expected a non-empty list of {request_id, item, label}",
                          param="items")
    labels = []
    for i, it in enumerate(items):
        ok = isinstance(it, dict) and isinstance(it.get("request_id"), str) and \
            isinstance(it.get("item", 0), int) and not isinstance(it.get("item", 0), bool) \
            and isinstance(it.get("label"), bool)
        if not ok:
            raise bad_request(f"items[{i}]: expected {{\"request_id\": str, \"item\": int "
                              f"(default 0), \"label\": true|false}}", param=f"items[{i}]")
        labels.append((it["request_id"], it.get("item", 0), it["label"]))
    return _json(_cands(S).feedback(labels))


async def upload(S, request, rec):
    """PUT /v1/experts/candidates/NAME: an upload (app.py's rules) into shadow/."""
    st, name = S.settings, request.path_params["name"]
    check_upload(st, name)
    c = _cands(S)
    data = await read_body(request, LIMITS["upload"])
    sha = hashlib.sha256(data).hexdigest()
    if not st.upload_allowlist or sha not in st.upload_allowlist:
        raise ApiError(403, f"sha256 {sha} is not on the server's upload allowlist",
                       type="permission_error", code="allowlist")
    final = f"{c.folder}/{name if name.endswith('.so') else name + '.so'}"
    await asyncio.to_thread(write_atomic, final, data, suffix=".upload")
    return _json({"name": name, "path": final, "sha256": sha, "status": "written",
                  "detail": "checked, probed and loaded as a candidate (in shadow); GET "
                            "/v1/experts lists it"}, 202)


def _json(obj, status: int = 200):
    return JSONResponse(obj, status_code=status)


def routes():
    """(path, route, name, methods) for app.py to mount."""
    base = "/v1/experts/candidates/{name}"
    return [(base, configure, "candidate", ("POST",)),
            (base, upload, "candidate_upload", ("PUT",)),
            (base + "/promote", promote, "candidate_promote", ("POST",)),
            (base + "/drop", drop, "candidate_drop", ("POST",)),
            (base + "/demote", demote, "candidate_demote", ("POST",)),
            ("/v1/experts/feedback", feedback, "feedback", ("POST",))]


# ---------------------------------------------------------------------------- metrics
def families(engine):
    """The candidates' series for /metrics (read at scrape time)."""
    c = getattr(engine, "candidates", None)
    if c is None:
        return []
    items = CounterMetricFamily("colibri_candidate_items", "Scored items seen per candidate:"
                                " kind items (while it was there), routed (recomputed in "
                                "shadow), changed (its decision differs), canary (answered "
                                "by it), skipped (shadow queue full)",
                                labels=["candidate", "kind"])
    agree = GaugeMetricFamily("colibri_candidate_agreement", "Share of items whose decision"
                              " the candidate would not change", labels=["candidate"])
    delta = GaugeMetricFamily("colibri_candidate_score_delta", "|candidate - live| summed "
                              "log-prob on the recomputed items", labels=["candidate", "stat"])
    frac = GaugeMetricFamily("colibri_candidate_fraction", "Canary share of request ids",
                             labels=["candidate"])
    for row in c.rows():
        g, name = row["gate"], row["name"]
        for kind in ("items", "routed", "changed", "canary", "skipped"):
            items.add_metric([name, kind], g[kind])
        agree.add_metric([name], g["agreement"] if g["agreement"] is not None else 1.0)
        delta.add_metric([name, "mean"], g["score_delta_mean"])
        delta.add_metric([name, "max"], g["score_delta_max"])
        frac.add_metric([name], row["fraction"])
    return [items, agree, delta, frac]
