"""One engine replica of the fleet: the Ray Serve deployment the ingress calls.

Each replica is one Engine (reserving `threads` CPUs, running that many compute threads)
behind server/backend.py's LocalBackend: the same Calls, the same expert book, the same
work functions as `colibri serve`. Its experts come from the registry (registry.py): a
sync thread long-polls the registry, writes each expert's bytes into the replica's own
watched folder (a private folder on its node) by temp file and rename, and deletes the
files of experts that left the set, so that every check, the probe and the adoption are
exactly the single-engine path (docs/HOTPLUG.md). The registry's slots reach the engine
through HotplugConfig.slots_file, written before any file.

The constructor pulls the current set and waits until the engine adopted it before it
returns, and Serve routes nothing to a replica before its constructor returned: a replica
that starts adopts the current set before it takes traffic.

Tokens carry the registry's generation (the fleet's counter), not the engine's: the
replica records, each time it settled a registry generation, the engine generation it
had then, and translates (a token computed with an engine set between two records gets
the older generation; its expert_set_id is always the engine's own).
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..experts.expertset import expert_set_id
from ..server.backend import LocalBackend
from ..files import write_atomic
from ..server.errors import from_exception
from ..server.experts import ExpertBook
from ..runtime.events import TokenEvent

log = logging.getLogger("colibri.fleet")

ADOPT_DEADLINE_S = 60.0       # a generation not adopted by then is reported as such


@dataclass
class Outcome:
    """The last item of a replica's answer: the work's result, or the error as the
    client must see it (status, OpenAI error body, headers)."""
    result: Any = None
    error: Optional[tuple] = None


class EngineReplica:
    def __init__(self, model_dir: str, engine_settings: dict, routing_stats: bool = True,
                 ready_timeout_s: float = ADOPT_DEADLINE_S):
        from ..config import EngineConfig, parse
        from ..engine import Engine
        from .registry import get_registry
        self.folder = tempfile.mkdtemp(prefix="colibri-replica-")
        os.chmod(self.folder, 0o755)
        self.slots_file = os.path.join(self.folder, ".colibri-slots.json")
        write_atomic(self.slots_file, b"{}")
        hp = dict(engine_settings.get("hotplug") or {}, slots_file=self.slots_file)
        cfg = parse(EngineConfig, {**engine_settings, "experts_dir": self.folder,
                                   "hotplug": hp, "when_full": "refuse"}, "the replica")
        book = ExpertBook(engine=None)
        with book.capture_startup_refusals():
            self.engine = Engine(model_dir, cfg)
        book.engine = self.engine
        self.backend = LocalBackend(self.engine, book, routing_stats=routing_stats)
        self.model_pairs = self.engine.model.expert_set.pairs()
        self.replica = _replica_name()
        self.registry = get_registry()
        self.written: dict[str, str] = {}         # expert name -> sha256 of its file here
        self.state = "starting"
        self.generation = -1                      # the registry generation settled last
        self.refused: list = []
        self.timing: dict = {}                    # the last generation's fetch and adoption
        self._marks: list[tuple[int, int]] = []   # (engine generation, registry generation)
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._sync_loop, name="colibri-replica-sync",
                                        daemon=True)
        self._thread.start()
        if not self._first.wait(ready_timeout_s):
            log.error("replica %s: the registry's set was not adopted within %.0f s",
                      self.replica, ready_timeout_s)
        log.info("replica %s ready: registry generation %d, expert set %s", self.replica,
                 self.generation, self.engine.expert_set_id[:12])

    # -- requests (the ingress calls these through Serve's deployment handle) ------------
    async def generate(self, p, request_id: str, timeout_s):
        """A completion's events, in lists of those ready at once (one Ray message each),
        the last list ending with its Outcome."""
        try:
            call = self.backend.generate(p, request_id, timeout_s)
        except Exception as e:  # noqa: BLE001 - answered, not raised through Ray
            yield [self._failed(e, request_id)]
            return
        ended = False
        try:
            try:
                async for batch in call.batches():
                    yield [replace(ev, expert_set_generation=self.fleet_generation(
                        ev.expert_set_generation)) if isinstance(ev, TokenEvent) else ev
                        for ev in batch]
                last = Outcome(result=call.result)
            except Exception as e:  # noqa: BLE001
                last = self._failed(e, request_id)
            ended = True
            yield [last]
        finally:
            if not ended:
                call.cancel("disconnect")     # the ingress went away (or cancelled us)

    async def score(self, raw: list, experts, request_id: str, timeout_s) -> Outcome:
        try:
            call = self.backend.score(raw, experts, request_id, timeout_s)
            async for _ in call:
                pass
        except asyncio.CancelledError:
            call.cancel("disconnect")
            raise
        except Exception as e:  # noqa: BLE001
            return self._failed(e, request_id)
        out = call.result
        for s in out["expert_sets"]:
            s["generation"] = self.fleet_generation(s["generation"])
        return Outcome(result=out)

    def _failed(self, e: BaseException, request_id: str) -> Outcome:
        err = from_exception(e, request_id, self.backend.retry_after_s())
        return Outcome(error=(err.status, err.message, err.type, err.param, err.code,
                              err.headers))

    def check_health(self) -> None:
        """Serve's health check (every 2 s): the engine and the sync thread run."""
        if self.engine._closed:
            raise RuntimeError(f"replica {self.replica}: the engine stopped")
        if not self._thread.is_alive():
            raise RuntimeError(f"replica {self.replica}: the registry sync thread stopped")

    def __del__(self):
        """Serve stops the replica (scaled down, redeployed): leave the rollouts."""
        self._stop.set()
        try:
            self.registry.leave.remote(self.replica)
        except Exception:  # noqa: BLE001 - the registry restarts: it forgets us later
            pass
        try:
            self.engine.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- the registry's set -> this replica's folder -------------------------------------
    def fleet_generation(self, engine_generation: int) -> int:
        """The registry generation of the newest record at or before this engine set."""
        i = bisect.bisect_right(self._marks, (engine_generation, 1 << 62)) - 1
        return self._marks[i][1] if i >= 0 else max(self.generation, 0)

    def report(self) -> dict:
        snap = self.backend.snapshot_now()
        return {"node": _node_ip(), "pid": os.getpid(), "state": self.state,
                "generation": self.generation, "expert_set_id": snap["expert_set_id"],
                "engine_generation": snap["expert_set_generation"], "refused": self.refused,
                "model_pairs": self.model_pairs, "time": time.time(), "timing": self.timing,
                "counters": {k: snap[k] for k in ("queue_depth", "batch_size", "adoptions",
                                                  "refusals", "routed", "requests_running",
                                                  "kv_pool", "prefix_cache")}}

    def _sync_loop(self) -> None:
        import ray
        while not self._stop.is_set():
            try:
                target = ray.get(self.registry.sync.remote(self.replica, self.report(),
                                                           self.generation, 1.0), timeout=60)
                if target is not None:
                    self._apply(target)
                    self.registry.report.remote(self.replica, self.report())
            except Exception:  # noqa: BLE001 - the registry restarts: poll again
                log.exception("replica %s: registry sync failed; retrying", self.replica)
                time.sleep(1.0)

    def _apply(self, target: dict) -> None:
        import ray
        self.state = "syncing"
        t0 = time.perf_counter()
        want = {n: e["sha256"] for n, e in target["experts"].items()}
        write_atomic(self.slots_file,
                     json.dumps(target["slots"], sort_keys=True).encode())
        for name, e in target["experts"].items():
            if self.written.get(name) == e["sha256"]:
                continue
            data = ray.get(e["ref"], timeout=120)
            if hashlib.sha256(data).hexdigest() != e["sha256"]:
                raise RuntimeError(f"expert {name}: bytes from the registry do not match "
                                   f"sha256 {e['sha256']}")
            write_atomic(self._path(name), data)
            self.written[name] = e["sha256"]
        for name in [n for n in self.written if n not in want]:
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass
            del self.written[name]
        t1 = time.perf_counter()
        expected = expert_set_id(self.model_pairs + list(want.items()))
        deadline = time.monotonic() + ADOPT_DEADLINE_S
        refused: list = []
        while time.monotonic() < deadline and not self._stop.is_set():
            sched = self.engine.scheduler
            if not (sched.running or sched.queued):
                self.engine.apply_expert_changes()   # else the scheduler does, between steps
            if self.engine.expert_set_id == expected:
                break
            refused = [r for r in self.engine.hotplug.refused()
                       if os.path.dirname(r["path"]) == self.folder
                       and r.get("sha256") == want.get(_name_of(r["path"]))]
            if refused and self.engine.hotplug.wait_idle(0):
                self.engine.apply_expert_changes()
                break
            time.sleep(0.005)
        self.timing = {"generation": target["generation"], "fetch_ms": 1000 * (t1 - t0),
                       "adopt_ms": 1000 * (time.perf_counter() - t1)}
        self._marks.append((self.engine.expert_set_generation, target["generation"]))
        self.generation = target["generation"]
        ok = self.engine.expert_set_id == expected
        self.refused = [{"time": time.time(), "path": r["path"], "reason": r["reason"],
                         "message": r["message"]} for r in refused]
        self.state = "adopted" if ok else "refused" if refused else "timeout"
        if not ok:
            log.error("replica %s: registry generation %d not adopted (%s): %s",
                      self.replica, self.generation, self.state, self.refused)
        self._first.set()

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, f"{name}.so")


def _name_of(path: str) -> str:
    return os.path.basename(path)[:-3] if path.endswith(".so") else os.path.basename(path)


def _replica_name() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (a test): the process
        return f"pid-{os.getpid()}"


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"
