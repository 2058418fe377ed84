"""The hot-plug state file: which expert names own which slots, and their versions.

`<state_dir>/hotplug_state.json`, written atomically (files.write_atomic: temp file, fsync,
rename, fsync of the folder). It is what makes the set of hot-plugged experts survive a
restart with the same slot indices, and what rollback() reads. Layout:

    {"format": 1,
     "next_slot": 66,
     "experts": {
       "fraud_v1": {"slot": 64,
                    "current": {"sha256": "...", "staged": "...", "source": "...",
                                "version": "2.0", "isolation": "inprocess"} | null,
                    "history": [ {...}, ... ],      # older adopted versions, newest last
                    "rolled_back": ["sha256", ...], # versions rolled back from: not re-adopted
                    "disabled": ["sha256", ...],    # versions whose helper crashed
                    "last": {...} | null}}}         # latest adopted version, kept after removal

A name keeps its slot forever once assigned (a removed expert that comes back gets its old
slot), so traces and router rows never change meaning across restarts.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ...files import write_atomic
from ...nesting import json_loads
from .errors import HotplugStateError

STATE_FORMAT = 1
STATE_FILE = "hotplug_state.json"
MAX_HISTORY = 8


@dataclass(frozen=True)
class VersionRecord:
    sha256: str
    staged: str
    source: str
    version: str
    isolation: str
    layers: tuple[int, ...] = ()
    binding: str = ""                  # bound | portable | unbound; "": not recorded


@dataclass
class NameRecord:
    slot: int
    current: VersionRecord | None = None
    history: list[VersionRecord] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    last: VersionRecord | None = None      # most recent adopted version, kept after removal

    def known_shas(self) -> set[str]:
        return {r.sha256 for r in ([self.current] if self.current else []) + self.history}

    def push_history(self, rec: VersionRecord) -> None:
        self.history.append(rec)
        del self.history[:-MAX_HISTORY]


def load_state(state_dir: str) -> tuple[int | None, dict[str, NameRecord]]:
    """(next_slot or None, records); empty when there is no state file yet."""
    path = os.path.join(state_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json_loads(f.read())
    except FileNotFoundError:
        return None, {}
    except (OSError, ValueError) as e:
        raise HotplugStateError(f"{path}: unreadable hot-plug state ({e}); expected the JSON"
                                " written by Colibri: move it away to start afresh",
                                path=path) from None
    if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
        raise HotplugStateError(f"{path}: state format {raw.get('format')!r}, expected"
                                f" {STATE_FORMAT}", path=path)
    try:
        records = {}
        for name, r in raw["experts"].items():
            records[name] = NameRecord(
                slot=int(r["slot"]),
                current=VersionRecord(**r["current"]) if r.get("current") else None,
                history=[VersionRecord(**h) for h in r.get("history", [])],
                rolled_back=list(r.get("rolled_back", [])),
                disabled=list(r.get("disabled", [])),
                last=VersionRecord(**r["last"]) if r.get("last") else None)
        return int(raw["next_slot"]), records
    except (KeyError, TypeError, ValueError) as e:
        raise HotplugStateError(f"{path}: malformed hot-plug state ({e!r})",
                                path=path) from None


def save_state(state_dir: str, next_slot: int, records: dict[str, NameRecord]) -> None:
    path = os.path.join(state_dir, STATE_FILE)
    doc = {"format": STATE_FORMAT, "next_slot": next_slot,
           "experts": {name: asdict(rec) for name, rec in sorted(records.items())}}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True))


LOCK_FILE = "hotplug.lock"


def lock_state_dir(state_dir: str) -> int:
    """Hold an exclusive flock on the state folder: one manager per state folder."""
    import fcntl

    path = os.path.join(state_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HotplugStateError(f"{state_dir}: hot-plug state folder is in use by another"
                                " manager (another engine?): expected one manager per state"
                                " folder", path=state_dir) from None
    return fd


def state_dir_in_use(state_dir: str) -> bool:
    """Whether a manager holds `state_dir` now (its flock taken), tested without taking it
    for more than an instant and without creating anything."""
    import fcntl

    try:
        fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False                        # no lock file: no manager ever ran there
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                        # (closing drops a shared lock we got)
    return False
