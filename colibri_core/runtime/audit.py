"""The audit log: one JSON line per scored item and per generated sequence, naming the
expert set that computed it (docs/SERVE.md "Audit log", docs/HOTPLUG.md section 10).

Opt-in (`Engine.start_audit(path)`, `colibri serve --audit-log PATH`). A line holds the
request id, the time, the input (its token ids and their sha256), the expert set's id
and generation, k, the output (the sha256 of the logits' float32 bytes and the next
tokens' log-probs for a scored item; the sha256 of the generated token ids for a
sequence), and per MoE layer the routed experts and their weights for every input token.
A set's first use in a file writes an `expert_set` line listing its hot-plugged experts,
and their staged files are kept (hard link or copy) in `PATH.experts/<sha256>.so`, so
that `colibri replay` (replay.py) finds the exact set by id later, whatever the hot-plug
folder became.

Cost when off: one attribute test per forward (`Model.route_sink is None`). When on: a
copy of each MoE layer's routed ids and weights per forward, and a dict per item handed
to a writer thread, which serializes, writes and rotates (`max_mb` per file: the full
file becomes PATH.1, PATH.1 becomes PATH.2, ...; none is deleted).
"""
from __future__ import annotations

import array
import base64
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import ConfigError

log = logging.getLogger("colibri")

FORMAT = 1                  # the "v" of every line
_LITTLE = sys.byteorder == "little" and array.array("i").itemsize == 4
DEFAULT_MAX_MB = 1024


def set_name(es) -> dict:
    """The one name of an expert set wherever one is reported: {generation, id}, and
    `candidate` (its name) for a candidate's set (experts/candidates.py)."""
    if es.candidate:
        return {"generation": int(es.generation), "id": es.id, "candidate": es.candidate}
    return {"generation": int(es.generation), "id": es.id}


def input_digest(tokens) -> str:
    """sha256 of the token ids as little-endian int32 (what `input_sha256` holds)."""
    if _LITTLE and isinstance(tokens, list):
        return hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()
    return hashlib.sha256(np.asarray(tokens, "<i4").tobytes()).hexdigest()


def output_digest(logits: np.ndarray) -> str:
    """sha256 of the logits' float32 little-endian bytes: equal iff every bit is."""
    return hashlib.sha256(np.ascontiguousarray(logits, "<f4").tobytes()).hexdigest()


def tokens_digest(tokens) -> str:
    return input_digest(tokens)


def next_token_logprobs(logits: np.ndarray, tokens) -> list[float]:
    """Per position t < n-1 of an all-positions score, log P(tokens[t+1]) (float64
    log-softmax): a scored continuation's log-prob is a sum of these."""
    x = np.asarray(logits, np.float64)[:-1]
    if x.shape[0] == 0:
        return []
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    nxt = np.asarray(tokens[1:], np.int64)
    return (x[np.arange(len(nxt)), nxt] - lse).tolist()


class RouteSink:
    """`Model.route_sink` while the audit is on: after each forward, each MoE layer's
    routed slots and weights as bytes (one conversion per layer and forward, none per
    sequence), kept per KV cache with its rows until its job takes them (take())."""

    def __init__(self, pipeline):
        self.pipe = pipeline
        self._rows: dict = {}          # id(cache) -> (weakref to the cache, [part, ...])

    def __call__(self, spans) -> None:
        pipe, n = self.pipe, self.pipe.last_n
        sc = pipe.scratch
        layers = []
        for i, L in enumerate(pipe.layers):
            if L.moe:
                k, w = pipe.layer_k[i], pipe.layer_width[i]
                layers.append((L.index, w, sc.rows("ids", i, n, k)[:, :w].astype("<i2").tobytes(),
                               sc.rows("wts", i, n, k)[:, :w].astype("<f4").tobytes()))
        rows = self._rows
        if len(rows) > 2 * len(spans) + 256:       # entries of caches nobody took: gone
            for key in [k for k, (r, _) in rows.items() if r() is None or r().freed]:
                del rows[key]
        for t0, t1, cache in spans:
            got = rows.get(id(cache))
            if got is None or got[0]() is not cache:
                rows[id(cache)] = (weakref.ref(cache), [(layers, t0, t1)])
            else:
                got[1].append((layers, t0, t1))

    def take(self, cache) -> list:
        """The parts recorded for `cache` since the last take() (each: (layers, t0, t1)
        of one forward, its rows t0..t1), and forget them."""
        got = self._rows.pop(id(cache), None)
        return got[1] if got is not None and got[0]() is cache else []


def merge_routes(parts: list, k: int) -> dict:
    """{layer: (ids int16 [n, k], weights float32 [n, k])} from take()'s parts in order
    (columns past k dropped, missing ones -1 / 0: a step's width is its largest k)."""
    out: dict = {}
    for layers, t0, t1 in parts:
        for layer, w, ib, wb in layers:
            ids = np.frombuffer(ib, "<i2").reshape(-1, w)[t0:t1]
            wts = np.frombuffer(wb, "<f4").reshape(-1, w)[t0:t1]
            if w < k:
                ids = np.pad(ids, ((0, 0), (0, k - w)), constant_values=-1)
                wts = np.pad(wts, ((0, 0), (0, k - w)))
            out.setdefault(layer, []).append((ids[:, :k], wts[:, :k]))
    return {layer: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v]))
            for layer, v in out.items()}


def routing_json(routes: dict) -> dict:
    """{"layer": {"experts": hex, "weights": base64}}: per MoE layer, the routed slots of
    every input token, k per token in order, as int16 little-endian (-1: none), and
    their weights as float32 little-endian -- exact, and cheap to write (a list of
    floats costs ~60 us a line to serialize, 10 % of a fraud transaction's scoring).
    routing_arrays() reads them back."""
    return {str(layer): {"experts": np.ascontiguousarray(ids, "<i2").tobytes().hex(),
                         "weights": base64.b64encode(np.ascontiguousarray(wts, "<f4").tobytes()
                                                     ).decode("ascii")}
            for layer, (ids, wts) in sorted(routes.items())}


def routing_of(parts: list, k: int) -> dict:
    """routing_json(merge_routes(parts, k)), straight from the bytes when the sequence ran
    in one forward whose width is its k (a scored transaction: the common case)."""
    if len(parts) != 1 or any(w != k for _, w, _, _ in parts[0][0]):
        return routing_json(merge_routes(parts, k))
    layers, t0, t1 = parts[0]
    b64 = base64.b64encode
    return {str(layer): {"experts": ib[t0 * k * 2:t1 * k * 2].hex(),
                         "weights": b64(wb[t0 * k * 4:t1 * k * 4]).decode("ascii")}
            for layer, _, ib, wb in sorted(layers, key=lambda x: x[0])}


def routing_arrays(routing: dict, k: int) -> dict:
    """An audit line's `routing` back as {layer: (ids int16 [n, k], weights float32 [n, k])}."""
    out = {}
    for layer, r in routing.items():
        ids = np.frombuffer(bytes.fromhex(r["experts"]), "<i2").reshape(-1, k)
        wts = np.frombuffer(base64.b64decode(r["weights"]), "<f4").reshape(-1, k)
        out[int(layer)] = (ids, wts)
    return out


def hot_experts_json(es) -> list[dict]:
    """The hot-plugged experts of a set: what replay needs to rebuild it."""
    out = []
    for h in sorted(es.hot_experts(), key=lambda h: h.slot):
        out.append({"name": h.name, "version": h.version, "sha256": h.sha256,
                    "slot": int(h.slot), "layers": [int(x) for x in h.layers],
                    "staged": h.staged_path})
    return out


class AuditLog:
    """The writer: put() from any thread (a dict, no I/O), a thread of its own writes."""

    def __init__(self, path, max_mb: float = DEFAULT_MAX_MB, engine_info: Optional[dict] = None):
        if not max_mb > 0:
            raise ConfigError(f"audit log max_mb={max_mb!r} (--audit-max-mb): expected a size "
                              f"in MB > 0")
        self.path = Path(path)
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.keep_dir = Path(str(self.path) + ".experts")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._size = self._f.tell()
        self._sets_here: set = set()           # set ids with an expert_set line in this file
        # what else decides the bits (model, activations, KV storage, routing): the
        # first line of every file
        self.engine_info = {"v": FORMAT, "kind": "engine", **(engine_info or {})}
        self._head_written = False
        self._kept: set = set()                # sha256 of experts kept in keep_dir
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.lines = 0
        self.errors = 0
        self._t = threading.Thread(target=self._loop, name="colibri-audit", daemon=True)
        self._t.start()

    # -- any thread ----------------------------------------------------------------------
    def put(self, record, es) -> None:
        """Queue one item's line; `es` the expert set that computed it, or a list of
        them (their expert_set lines and kept files are written first when this file has
        none yet)."""
        with self._cv:       # (a callable: the line, rendered on the writer's thread)
            self._q.append((record, es if isinstance(es, list) else [es]))
            self._cv.notify()

    def put_many(self, lines: list) -> None:
        """put() of [(line, es)], under one lock."""
        with self._cv:
            self._q.extend((line, [es]) for line, es in lines)
            self._cv.notify()

    def flush(self, timeout: float = 30.0) -> None:
        """Until every queued line is written and flushed to the file."""
        end = time.monotonic() + timeout
        with self._cv:
            while (self._q or self._busy) and time.monotonic() < end:
                self._cv.wait(0.05)

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._t.join(10)
        self._f.close()

    # -- the writer thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q and self._closed:
                    return
                batch = list(self._q)
                self._q.clear()
                self._busy = True
            try:
                for record, es in batch:
                    self._write(record, es)
                self._f.flush()
            except Exception:  # noqa: BLE001 - an audit failure must not stop serving
                self.errors += 1
                log.exception("audit log %s: writing failed", self.path)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, record: dict, sets: list) -> None:
        if self._size >= self.max_bytes:
            self._rotate()
        if not self._head_written:
            self._line(self.engine_info)
            self._head_written = True
        for es in sets:
            if es.id in self._sets_here:
                continue
            experts = hot_experts_json(es)
            for e in experts:
                e["file"] = self._keep(e)
            self._line({"v": FORMAT, "kind": "expert_set", **set_name(es),
                        "experts": experts})
            self._sets_here.add(es.id)
        self._line(record() if callable(record) else record)
        self.lines += 1

    def _line(self, d) -> None:
        s = (d if isinstance(d, str) else json.dumps(d, separators=(",", ":"))) + "\n"
        self._f.write(s)
        self._size += len(s.encode("utf-8")) if not s.isascii() else len(s)

    def _rotate(self) -> None:
        self._f.close()
        n = 1
        while Path(f"{self.path}.{n}").exists():
            n += 1
        for i in range(n - 1, 0, -1):                  # PATH.1 -> PATH.2, ...
            os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._f = open(self.path, "a", encoding="utf-8")
        self._size = 0
        self._sets_here = set()
        self._head_written = False

    def _keep(self, e: dict) -> Optional[str]:
        """Keep the staged copy of a hot-plugged expert by its sha256 in keep_dir (a
        hard link where the file system allows; a copy otherwise; a bundle's folder
        copied): the name replay looks for. -> that name, relative to keep_dir."""
        src = Path(e.pop("staged"))
        bundle = src.parent.name.endswith(".expert")
        name = e["sha256"] + (".expert" if bundle else ".so")
        rel = f"{name}/{src.name}" if bundle else name
        dst = self.keep_dir / name
        if e["sha256"] in self._kept or dst.exists():
            self._kept.add(e["sha256"])
            return rel
        self.keep_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.keep_dir / f".{name}.tmp"
        if bundle:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src.parent, tmp)
        else:
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        self._kept.add(e["sha256"])
        return rel


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def score_lines(request_id: str, items, k: int, all_positions: bool, when: str) -> list:
    """The lines of one score call's sequences (score_batch / Engine.score, /v1/score):
    `items` [(tokens, expert set, logits, RouteSink parts)] -> [(line, expert set)].
    Rendered here, the same JSON json.dumps would write at a third of its cost (every
    value but the request id is a number, a digest, hex or base64), what is common to
    the call's items once."""
    head = f'{{"v":{FORMAT},"kind":"score","request_id":{json.dumps(request_id)},"item":'
    mid = f',"time":"{when}","input_sha256":"'
    tail_k = f',"k":{int(k)},"all_positions":{"true" if all_positions else "false"},' \
        f'"output":{{"sha256":"'
    sets: dict = {}
    b64 = base64.b64encode
    out = []
    for i, (tokens, es, logits, parts) in enumerate(items):
        name = sets.get(id(es))
        if name is None:
            name = sets[id(es)] = f'"expert_set":{{"generation":{int(es.generation)},' \
                                  f'"id":"{es.id}"}}'
        shape = ",".join(map(str, logits.shape))
        # (no argmax for last-token logits: 1.5 us an item, a tenth of the log's cost)
        scores = json.dumps(next_token_logprobs(logits, tokens)) if all_positions else "[]"
        if len(parts) == 1 and all(w == k for _, w, _, _ in parts[0][0]):
            layers, t0, t1 = parts[0]        # one forward of width k: straight from bytes
            a, b = t0 * k, t1 * k
            rt = ",".join(f'"{layer}":{{"experts":"{ib[2 * a:2 * b].hex()}","weights":'
                          f'"{b64(wb[4 * a:4 * b]).decode()}"}}' for layer, _, ib, wb in layers)
        else:
            rt = ",".join(f'"{layer}":{{"experts":"{r["experts"]}","weights":"{r["weights"]}"}}'
                          for layer, r in routing_of(parts, k).items())
        out.append((f'{head}{i}{mid}{input_digest(tokens)}","tokens":[{",".join(map(str, tokens))}],'
                    f'{name}{tail_k}{output_digest(logits)}","shape":[{shape}]}},'
                    f'"scores":{scores},"routing":{{{rt}}}}}', es))
    return out


def generation_record(request_id: str, prompt, sets: list, k: int, out_tokens: list,
                      stop_reason, routing: dict, sampling: Optional[dict]) -> dict:
    """The line of one generated sequence: `sets` [(first token index, es)], one entry
    unless the sequence was not pinned and a change came between two of its tokens."""
    d = {"v": FORMAT, "kind": "generation", "request_id": request_id, "time": now_iso(),
         "input_sha256": input_digest(prompt), "tokens": [int(t) for t in prompt],
         "expert_set": set_name(sets[0][1]) if sets else None, "k": int(k),
         "output": {"tokens_sha256": tokens_digest(out_tokens), "n_tokens": len(out_tokens),
                    "stop_reason": stop_reason},
         "routing": routing}
    if len(sets) > 1:
        d["expert_sets"] = [{"from_token": i, **set_name(es)} for i, es in sets]
    if sampling is not None:
        d["sampling"] = sampling
    return d
