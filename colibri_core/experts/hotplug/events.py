"""The recent history of expert changes, and the one log line each.

The engine records every hot-plug event here on its own thread, right after the change
went live (expertchanges.ChangeApplier.apply), so that each entry carries the expert-set
generation and id it went live with; the server serves the history (`GET
/v1/experts/events`, the status page). Kinds:

    adopt     a new name became routable           (manager event "loaded", kind add)
    replace   a new version took a name's slot     ("loaded", kind replace)
    rollback  the previous version was put back    ("loaded" with rollback)
    remove    its file was deleted / renamed, or its isolated helper crashed ("unloaded")
    refuse    a file was refused                   ("rejected"; logged by the manager at
              WARNING already, REFUSED_LOG: recorded here, not logged twice)

Each of the first four is one INFO line on the `colibri.hotplug` logger:
    hot-plug adopt: card_testing 1 slot 8 layers [3] sha256 3f2a9c01d4e7 bound generation 1
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("colibri.hotplug")
EVENT_LOG = "hot-plug %s: %s %s slot %s layers %s sha256 %s %s generation %d%s"
MAX_EVENTS = 200


def event_kind(kind: str, info: dict) -> str:
    """The history's kind of a manager event (see the module docstring)."""
    if kind == "loaded":
        return "rollback" if info.get("rollback") else \
            "replace" if info.get("kind") == "replace" else "adopt"
    return {"unloaded": "remove", "rejected": "refuse"}.get(kind, kind)


class ExpertEvents:
    """A bounded, thread-safe history of expert changes, oldest first, numbered from 1."""

    def __init__(self, maxlen: int = MAX_EVENTS):
        self._lock = threading.Lock()
        self._events: deque = deque(maxlen=maxlen)
        self._seq = 0

    def record(self, kind: str, info: dict, generation: int, set_id: str) -> dict:
        """Record manager event `kind` (loaded | unloaded | rejected) with its `info`, as of
        expert set (`generation`, `set_id`); log it (not a refusal: logged already)."""
        what = event_kind(kind, info)
        entry = {"time": round(time.time(), 3), "event": what,
                 "name": info.get("name"), "version": info.get("version"),
                 "previous_version": info.get("previous_version"),
                 "slot": info.get("slot"), "layers": list(info.get("layers") or []),
                 "sha256": info.get("sha256"), "binding": info.get("binding"),
                 "path": info.get("path"), "reason": info.get("reason"),
                 "message": info.get("message") or None,
                 "generation": int(generation), "expert_set_id": set_id}
        with self._lock:
            self._seq += 1
            entry["seq"] = self._seq
            self._events.append(entry)
        if what != "refuse":
            tail = f" (from {entry['previous_version']})" if what in ("replace", "rollback") \
                else f" ({entry['reason']})" if what == "remove" else ""
            log.info(EVENT_LOG, what, entry["name"], entry["version"], entry["slot"],
                     entry["layers"], (entry["sha256"] or "")[:12], entry["binding"] or "-",
                     entry["generation"], tail)
        return entry

    def recent(self, since: int = 0, limit: int = MAX_EVENTS) -> list[dict]:
        """Events with seq > `since`, oldest first, at most the last `limit` of them."""
        with self._lock:
            out = [dict(e) for e in self._events if e["seq"] > since]
        return out[-limit:] if limit > 0 else []

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq
