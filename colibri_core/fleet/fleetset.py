"""The fleet's expert set, as the registry keeps it on the head node's disk.

    <state_dir>/registry.json     names -> slots and versions, the generation (atomic writes)
    <state_dir>/blobs/<sha256>.so  every version's bytes, as they were dropped or uploaded

    {"format": 1, "generation": 3, "next_slot": 10,
     "experts": {"fraud": {"slot": 8, "current": {"sha256": ..., "version": "2.0",
                                                  "source": ".../experts_so/fraud.so"} | null,
                           "history": [{...}, ...],        # older versions, newest last
                           "rolled_back": ["sha256", ...]}}}  # not taken again from the folder

One change at a time, each +1 on the generation (the fleet's monotone counter): a file's
new version (`put`), a file gone (`remove_source`), `rollback(name)`. A name keeps its slot
forever (first_slot, first_slot + 1, ... in the order names first appear), so a replica
started later, on any node, numbers every expert as the others do (it hands the slots to
its engine in HotplugConfig.slots_file). The registry reads only an expert's metadata
(hotplug/meta.py, without loading it) for its name and version; every other check, the
probe and the adoption run on each replica, exactly as on one engine.

Pure Python and the disk: no Ray here (tests/test_fleet.py runs it in the main suite).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

from ..files import write_atomic
from ..experts.hotplug.errors import HotplugError, HotplugStateError, RollbackError
from ..nesting import json_loads
from ..experts.hotplug.meta import read_expert_file

STATE_FORMAT = 1
STATE_FILE = "registry.json"
MAX_HISTORY = 8


class FleetRefusal(Exception):
    """A file or upload the registry cannot take (its metadata unreadable, ...)."""

    def __init__(self, source: str, reason: str, message: str):
        super().__init__(message)
        self.source, self.reason, self.message = source, reason, message


@dataclass(frozen=True)
class FleetChange:
    """One change of the fleet's expert set (+1 on its generation), as the registry
    records it; a replica's own, from its manager's drain(), is a hotplug ExpertChange."""

    generation: int
    kind: str              # "add" | "replace" | "remove" | "rollback"
    name: str
    sha256: Optional[str]


class FleetSet:
    def __init__(self, state_dir: str, first_slot: int, hidden_size: int,
                 moe_layers) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.blobs = os.path.join(self.state_dir, "blobs")
        os.makedirs(self.blobs, mode=0o700, exist_ok=True)
        self.first_slot = int(first_slot)
        self.hidden_size = int(hidden_size)
        self.moe_layers = frozenset(moe_layers)
        self.generation = 0
        self.next_slot = self.first_slot
        self.experts: dict[str, dict] = {}
        self._load()

    # -- reading ------------------------------------------------------------------------
    def current(self) -> dict[str, dict]:
        """name -> {slot, sha256, version} of every live expert."""
        return {n: {"slot": r["slot"], "sha256": r["current"]["sha256"],
                    "version": r["current"]["version"]}
                for n, r in sorted(self.experts.items()) if r["current"] is not None}

    def slots(self) -> dict[str, int]:
        """Every name's slot (removed names keep theirs)."""
        return {n: r["slot"] for n, r in self.experts.items()}

    def blob(self, sha: str) -> bytes:
        with open(self._blob_path(sha), "rb") as f:
            return f.read()

    def sources(self) -> dict[str, str]:
        """source path -> name, for the live experts that came from a file."""
        return {r["current"]["source"]: n for n, r in self.experts.items()
                if r["current"] is not None and r["current"]["source"]}

    def listing(self) -> list[dict]:
        rows = []
        for n, r in sorted(self.experts.items(), key=lambda kv: kv[1]["slot"]):
            cur = r["current"] or (r["history"][-1] if r["history"] else None)
            rows.append({"name": n, "slot": r["slot"],
                         "version": cur["version"] if cur else "",
                         "sha256": cur["sha256"] if cur else "",
                         "source": cur["source"] if cur else "",
                         "status": "active" if r["current"] is not None else "removed",
                         "history": [h["version"] for h in r["history"]]})
        return rows

    # -- changes ------------------------------------------------------------------------
    def put(self, data: bytes, source: str) -> Optional[FleetChange]:
        """A file's (or an upload's) bytes: a new version of the name in its metadata.
        None when that version is already live, or was rolled back from and comes from
        the folder again (the folder still holds the file the operator rolled back)."""
        sha = hashlib.sha256(data).hexdigest()
        path = self._blob_path(sha)
        if not os.path.exists(path):
            write_atomic(path, data, 0o600)
        try:
            meta = read_expert_file(path, self.hidden_size, self.moe_layers).meta
        except HotplugError as e:
            if not self._used(sha):
                os.unlink(path)
            raise FleetRefusal(source, getattr(e, "reason", "rejected"),
                               str(e).replace(path, source)) from None
        name = meta.name
        rec = self.experts.get(name)
        if rec is not None and rec["current"] is not None and rec["current"]["sha256"] == sha:
            if rec["current"]["source"] != source:
                rec["current"]["source"] = source
                self._save()
            return None
        if rec is not None and sha in rec["rolled_back"] and source.startswith("file:"):
            return None
        version = {"sha256": sha, "version": meta.version, "source": source}
        if rec is None:
            rec = self.experts[name] = {"slot": self.next_slot, "current": None,
                                        "history": [], "rolled_back": []}
            self.next_slot += 1
        kind = "add" if rec["current"] is None else "replace"
        if rec["current"] is not None:
            rec["history"] = (rec["history"] + [rec["current"]])[-MAX_HISTORY:]
        rec["current"] = version
        if sha in rec["rolled_back"]:
            rec["rolled_back"].remove(sha)      # uploaded again on purpose
        return self._changed(kind, name, sha)

    def remove_source(self, source: str) -> Optional[FleetChange]:
        """The file a live expert came from is gone: the expert leaves the set."""
        name = self.sources().get(source)
        if name is None:
            return None
        rec = self.experts[name]
        rec["history"] = (rec["history"] + [rec["current"]])[-MAX_HISTORY:]
        rec["current"] = None
        return self._changed("remove", name, None)

    def rollback(self, name: str) -> FleetChange:
        rec = self.experts.get(name)
        if rec is None or rec["current"] is None:
            raise RollbackError(f"expert {name!r} is not active: nothing to roll back "
                                f"(GET /v1/experts lists the fleet's experts)")
        if not rec["history"]:
            raise RollbackError(f"expert {name!r} has no previous version to roll back to")
        rec["rolled_back"] = (rec["rolled_back"] + [rec["current"]["sha256"]])[-MAX_HISTORY:]
        rec["current"] = rec["history"].pop()
        return self._changed("rollback", name, rec["current"]["sha256"])

    # -- the disk -----------------------------------------------------------------------
    def _changed(self, kind: str, name: str, sha: Optional[str]) -> FleetChange:
        self.generation += 1
        self._save()
        return FleetChange(self.generation, kind, name, sha)

    def _used(self, sha: str) -> bool:
        return any(v["sha256"] == sha for r in self.experts.values()
                   for v in ([r["current"]] if r["current"] else []) + r["history"])

    def _blob_path(self, sha: str) -> str:
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError(f"sha256 {sha!r:.70}: expected 64 lowercase hex digits")
        return os.path.join(self.blobs, f"{sha}.so")

    def _load(self) -> None:
        path = os.path.join(self.state_dir, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                raw = json_loads(f.read())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise HotplugStateError(f"{path}: unreadable registry state ({e}); expected "
                                    f"the JSON the registry writes: move it away to start "
                                    f"afresh", path=path) from None
        if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else raw
            raise HotplugStateError(f"{path}: registry state format {got!r:.40}, expected "
                                    f"{STATE_FORMAT}", path=path)
        self.generation = int(raw["generation"])
        self.next_slot = max(int(raw["next_slot"]), self.first_slot)
        self.experts = raw["experts"]

    def _save(self) -> None:
        doc = {"format": STATE_FORMAT, "generation": self.generation,
               "next_slot": self.next_slot, "experts": self.experts}
        write_atomic(os.path.join(self.state_dir, STATE_FILE),
                     json.dumps(doc, indent=1, sort_keys=True).encode(), 0o600)

