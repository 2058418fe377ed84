"""The server's view of the experts: the expert-set identity stamped on tokens, the
listing of live experts, refusals and adoptions, and routed-token counts per expert.

expert_set_generation is the engine's expert-set counter (it only grows; +1 per applied
change); expert_set_id is the set's digest (expertset.expert_set_id: sha256 over its sorted
(name, sha256) pairs, model experts included), so two servers with the same experts report
the same id.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable

import numpy as np

from ..experts.hotplug.errors import REFUSED_LOG
from ..format.modelfile import expert_name
from .errors import bad_request

log = logging.getLogger("colibri.server")


class ExpertBook:
    """The current expert set's generation and id, adoptions/refusals, routed tokens;
    thread-safe.

    Routed tokens come from the engine's own counter (Engine.count_routed_tokens);
    `on_event` is chained into the hot-plug manager's event callback.
    """

    def __init__(self, engine, max_refusals: int = 50):
        self.engine = engine          # may be set later (see serve.run_server)
        self._lock = threading.Lock()
        self.refusals: deque = deque(maxlen=max_refusals)
        self.adoptions = 0
        self._refused: dict[str, int] = {}          # reason -> count since start
        self.listeners: list[Callable[[str, dict], None]] = []
        self._slot_names: dict[int, str] = {}
        show_hotplug_log()             # made before the engine: its startup changes too

    # -- versions -----------------------------------------------------------------------
    def stamp(self) -> tuple[int, str]:
        """(generation, id) of the engine's current set (a token carries its own)."""
        es = self.engine.model.expert_set
        return es.generation, es.id

    # -- hot-plug events ----------------------------------------------------------------
    def attach(self, manager) -> None:
        """Chain into the manager's event callback (refusals carry their reason code)."""
        previous = manager.on_event

        def on_event(kind: str, info: dict) -> None:
            if previous is not None:
                previous(kind, info)
            self.on_event(kind, info)
        manager.on_event = on_event

    def on_event(self, kind: str, info: dict) -> None:
        if kind == "rejected":
            self.add_refusal(str(info.get("path", "")), str(info.get("reason", "rejected")),
                             str(info.get("message", "")))
        elif kind == "loaded":
            with self._lock:
                self.adoptions += 1
        for fn in self.listeners:
            try:
                fn(kind, info)
            except Exception:  # noqa: BLE001 - a listener must not stop hot-plugging
                log.exception("expert event listener failed")

    def add_refusal(self, path: str, reason: str, message: str) -> None:
        with self._lock:
            self.refusals.append({"time": time.time(), "path": path, "reason": reason,
                                  "message": message})
            self._refused[reason] = self._refused.get(reason, 0) + 1

    def refusal_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refused)

    @contextmanager
    def capture_startup_refusals(self):
        """While the engine starts (before attach() is possible), take refusals from the
        manager's log records, which carry the typed error."""
        book = self

        class Handler(logging.Handler):
            def emit(self, record):
                # the manager's one refusal line: REFUSED_LOG % (path, rule, error)
                args = record.args if isinstance(record.args, tuple) else ()
                if record.msg == REFUSED_LOG and len(args) == 3:
                    book.add_refusal(str(args[0]), str(args[1]), str(args[2]))
        h = Handler()
        logger = logging.getLogger("colibri.hotplug")
        logger.addHandler(h)
        try:
            yield
        finally:
            logger.removeHandler(h)

    # -- routed tokens ------------------------------------------------------------------
    @property
    def routed(self) -> dict[int, np.ndarray]:
        """layer -> int64 routed tokens per slot (the engine's counter)."""
        return self.engine.routed_tokens()

    def slot_name(self, layer: int, slot: int) -> str:
        if slot < self.engine.model_cfg.num_experts:
            return expert_name(layer, slot)
        name = self._slot_names.get(slot)
        if name is None and self.engine.hotplug is not None:
            self._slot_names = {r["slot"]: r["name"] for r in self.engine.hotplug.list()}
            name = self._slot_names.get(slot)
        return name or f"slot_{slot}"

    def routed_by_name(self) -> dict[str, int]:
        """Routed tokens per expert name, summed over layers (a hot expert spans layers)."""
        out: dict[str, int] = {}
        for layer, counts in list(self.routed.items()):
            for slot in np.flatnonzero(counts):
                name = self.slot_name(layer, int(slot))
                out[name] = out.get(name, 0) + int(counts[slot])
        return out

    # -- listing ------------------------------------------------------------------------
    def listing(self) -> dict:
        eng = self.engine
        cfg = eng.model_cfg
        generation, sid = self.stamp()
        rows = []
        for L in cfg.moe_layers:
            for e in eng.weights.layers[L].experts:
                info = (cfg.files or {}).get(f"{e.name}.bin")
                rows.append({"name": e.name, "version": "", "slot": e.index, "layers": [L],
                             "origin": "model file", "sha256": getattr(info, "sha256", ""),
                             "isolation": "inprocess", "status": "active"})
        if eng.hotplug is not None:
            for r in eng.hotplug.list():
                rows.append({"name": r["name"], "version": r["version"], "slot": r["slot"],
                             "layers": r["layers"], "origin": r["origin"],
                             "sha256": r["sha256"], "isolation": r["isolation"],
                             "status": r["status"], "refused": r.get("refused"),
                             "binding": r.get("binding"), "file": r.get("file")})
        with self._lock:
            refusals = list(self.refusals)[::-1]
            adoptions = self.adoptions
        return {"object": "list", "expert_set_generation": generation, "expert_set_id": sid,
                "watched_folder": eng.hotplug.experts_dir if eng.hotplug is not None else None,
                "data": rows, "refusals": refusals, "adoptions": adoptions,
                "events": self.events(limit=EVENTS_IN_LISTING),
                "candidates": eng.candidates.rows() if eng.candidates is not None else [],
                "candidates_folder": eng.candidates.folder if eng.candidates is not None
                else None}

    def events(self, since: int = 0, limit: int = 200) -> list[dict]:
        """The recent expert changes (hotplug/events.py), oldest first."""
        return self.engine.expert_events.recent(since, limit)


def show_hotplug_log() -> None:
    """Expert changes are one INFO line each on `colibri.hotplug` (hotplug/events.py), and
    refusals one WARNING line: a server prints them on stderr, unless the application
    configured logging itself (a handler on the root logger)."""
    lg = logging.getLogger("colibri.hotplug")
    if lg.getEffectiveLevel() > logging.INFO:
        lg.setLevel(logging.INFO)
    if not lg.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("colibri: %(message)s"))
        lg.addHandler(h)


EVENTS_IN_LISTING = 20     # GET /v1/experts and the status page; the events route: more


def events_answer(backend, query) -> dict:
    """GET /v1/experts/events[?since=SEQ][&limit=N]: the history of adoptions,
    replacements, rollbacks, removals and refusals, oldest first, each with the expert set
    (generation, id) it went live in; `since`: only events after that `seq` (a poller
    passes the last one it saw)."""
    args = {}
    for key, default, hi in (("since", 0, 2**62), ("limit", 200, 200)):
        raw = query.get(key)
        try:
            args[key] = default if raw is None else int(raw)
        except ValueError:
            args[key] = -1
        if not 0 <= args[key] <= hi:
            raise bad_request(f"{key}={raw!r:.40}: expected an integer 0..{hi}", param=key)
    book = getattr(backend, "book", None)
    if book is None:                  # a fleet: its registry's listing carries no history
        return {"object": "list", "data": [], "last_seq": 0}
    data = book.events(args["since"], args["limit"])
    return {"object": "list", "data": data,
            "last_seq": book.engine.expert_events.last_seq}
