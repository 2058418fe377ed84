"""The fleet's one expert registry: a detached Ray actor on the head node.

    registry = start_registry(model_dir, experts_dir, state_dir)   # or the running one
    ray.get(registry.sync.remote(replica_id, report, known_generation, wait_s))

It owns the fleet's expert set (fleetset.py: on the head's disk, so a restarted registry,
`max_restarts=-1`, carries on where it stopped) and its generation, the fleet's monotone
counter. Changes come from the head's watched folder (the hot-plug watch of one engine,
hotplug/watcher.py: a file arrived by rename or closed after writing is read at once, any
other once it settled), from uploads and rollbacks through the ingress's API.

Replicas pull: each replica's sync thread calls `sync()` with its report and the
generation it has; the call returns at once when the registry is ahead, else when the
next change comes or after `wait_s` (a long poll: a change reaches every replica within
one call's round trip, and the registry needs no handle on any replica). The answer names
every live expert with its slot, sha256 and an ObjectRef of its bytes (`ray.put` once per
version: a replica on another node pulls them through Ray's object stores, from the head
or from any node that already has a copy). Each report says which generation and
expert_set_id the replica serves; the registry derives each generation's rollout (which
replicas adopted it, which refused it and why, which did not answer) for GET /v1/experts.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

from ..config import load_model_config
from ..experts.expertset import expert_set_id
from ..experts.hotplug.errors import HotplugError
from ..experts.hotplug.staging import FileSig, check_file, check_folder, open_source
from ..experts.hotplug.watcher import FolderWatcher, is_expert_name
from .fleetset import FleetRefusal, FleetSet

log = logging.getLogger("colibri.fleet")

REGISTRY_NAME = "colibri-expert-registry"
NAMESPACE = "colibri"
HEAD_RESOURCE = "node:__internal_head__"     # Ray's resource of the head node
LOST_S = 6.0            # a replica not heard from for this long is not counted in rollouts
FORGET_S = 120.0        # ... and is dropped from the listing after this long
SETTLE_S = 0.2          # a file written in place is read once unchanged this long
MAX_FILE = 64 * 1024 * 1024


class ExpertRegistry:
    """The actor's body (start_registry() makes it a detached Ray actor)."""

    def __init__(self, model_dir: str, experts_dir: Optional[str], state_dir: str):
        cfg = load_model_config(Path(model_dir) / "config.json")
        self.experts_dir = os.path.abspath(experts_dir) if experts_dir else None
        self.set = FleetSet(state_dir, cfg.num_experts, cfg.hidden_size, cfg.moe_layers)
        self._lock = threading.Lock()
        self.refusals: deque = deque(maxlen=50)
        self.replicas: dict[str, dict] = {}
        self.model_pairs: Optional[list] = None
        self._refs: dict[str, object] = {}          # sha256 -> ObjectRef of its bytes
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._changed: Optional[asyncio.Event] = None
        self._paths: queue.Queue = queue.Queue()
        self._watcher = None
        if self.experts_dir is not None:
            check_folder(self.experts_dir)
            threading.Thread(target=self._work, name="colibri-registry-folder",
                             daemon=True).start()
            self._watcher = FolderWatcher(self.experts_dir,
                                          lambda p, arrived: self._paths.put((p, arrived)),
                                          on_overflow=self.rescan)
            self._watcher.start()
            self.rescan()

    # -- the head's folder (its own thread) ----------------------------------------------
    def rescan(self) -> None:
        """Every expert file of the folder, and every live expert's vanished file."""
        for n in sorted(os.listdir(self.experts_dir)):
            if is_expert_name(n):
                self._paths.put((os.path.join(self.experts_dir, n), True))
        with self._lock:
            gone = [s[5:] for s in self.set.sources() if s.startswith("file:")
                    and not os.path.lexists(s[5:])]
        for p in gone:
            self._paths.put((p, True))

    def _work(self) -> None:
        while True:
            path, arrived = self._paths.get()
            try:
                self._settle(path, arrived)
                self._take(path)
            except Exception:  # noqa: BLE001 - one file must not stop the folder
                log.exception("registry: reading %s failed", path)

    def _settle(self, path: str, arrived: bool) -> None:
        if arrived:
            return
        last = None
        while True:
            try:
                sig = FileSig.of(os.lstat(path))
            except FileNotFoundError:
                return
            if sig == last:
                return
            last = sig
            time.sleep(SETTLE_S)

    def _take(self, path: str) -> None:
        source = "file:" + path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            with self._lock:
                change = self.set.remove_source(source)
            self._announce(change)
            return
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                raise FleetRefusal(path, "bundle", f"{path}: a bundle folder; the fleet's "
                                   f"registry carries .so files with their metadata symbol "
                                   f"(docs/SCALE.md)")
            check_file(path, st)
            if st.st_size > MAX_FILE:
                raise FleetRefusal(path, "too_large", f"{path}: {st.st_size} bytes, over the "
                                   f"registry's limit of {MAX_FILE}")
            fd = open_source(path)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_FILE + 1)
            with self._lock:
                change = self.set.put(data, source)
        except FileNotFoundError:
            return                                  # gone meanwhile: its event follows
        except HotplugError as e:
            self._refuse(path, getattr(e, "reason", "rejected"), str(e))
            return
        except FleetRefusal as e:
            self._refuse(e.source.removeprefix("file:"), e.reason, e.message)
            return
        self._announce(change)

    def _refuse(self, path: str, reason: str, message: str) -> None:
        log.warning("registry: refused %s (%s): %s", path, reason, message)
        with self._lock:
            self.refusals.append({"time": time.time(), "path": path, "reason": reason,
                                  "message": message, "where": "registry"})

    def _announce(self, change) -> None:
        if change is None:
            return
        log.info("registry: generation %d: %s %s", change.generation, change.kind, change.name)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- replicas -------------------------------------------------------------------------
    async def sync(self, replica: str, report: dict, known: int, wait_s: float = 1.0):
        """A replica's long poll: its report in, the target set out when it differs from
        the generation `known` (else None after `wait_s`)."""
        self._here()
        self._record(replica, report)
        if self.set.generation == known:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        if self.set.generation == known:
            return None
        return self.target()

    async def report(self, replica: str, report: dict) -> None:
        """A report between two polls (a replica that just adopted a generation)."""
        self._record(replica, report)

    async def leave(self, replica: str) -> None:
        """A replica Serve stopped: no longer part of any rollout."""
        self.replicas.pop(replica, None)

    def target(self) -> dict:
        import ray
        with self._lock:
            cur = self.set.current()
            out = {"generation": self.set.generation, "slots": self.set.slots(),
                   "experts": {}}
            for name, e in cur.items():
                ref = self._refs.get(e["sha256"])
                if ref is None:
                    ref = self._refs[e["sha256"]] = ray.put(self.set.blob(e["sha256"]))
                out["experts"][name] = {**e, "ref": ref}
        live = {e["sha256"] for e in cur.values()}
        for sha in [s for s in self._refs if s not in live]:
            del self._refs[sha]                 # an old version: its object can go
        return out

    def _record(self, replica: str, report: dict) -> None:
        if self.model_pairs is None and report.get("model_pairs"):
            self.model_pairs = [tuple(p) for p in report["model_pairs"]]
        row = {k: v for k, v in report.items() if k != "model_pairs"}
        row["last_seen"] = time.time()
        self.replicas[replica] = row
        now = time.time()
        for r in [r for r, v in self.replicas.items() if now - v["last_seen"] > FORGET_S]:
            del self.replicas[r]

    def _here(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()

    # -- the API's expert routes (through the ingress) ----------------------------------
    def where(self) -> tuple:
        """(the watched folder, the state folder): a deploy checks it joins its own."""
        return self.experts_dir, self.set.state_dir

    def expected_id(self) -> str:
        """The expert_set_id of the registry's set (the model's experts + the live ones)."""
        if self.model_pairs is None:
            return ""
        with self._lock:
            hot = [(n, e["sha256"]) for n, e in self.set.current().items()]
        return expert_set_id(self.model_pairs + hot)

    async def upload(self, name: str, data: bytes) -> dict:
        self._here()
        try:
            with self._lock:
                change = self.set.put(data, f"upload:{name}")
        except FleetRefusal as e:
            return {"error": [400, e.message, e.reason]}
        self._wake()
        return {"generation": self.set.generation, "changed": change is not None}

    async def rollback(self, name: str) -> dict:
        self._here()
        try:
            with self._lock:
                change = self.set.rollback(name)
        except HotplugError as e:
            status = 404 if "not active" in str(e) else 409
            return {"error": [status, str(e), e.reason]}
        self._wake()
        return {"generation": change.generation, "sha256": change.sha256}

    def rollout(self) -> dict:
        """The current generation on each replica heard from within LOST_S."""
        gen, want = self.set.generation, self.expected_id()
        now = time.time()
        adopted, pending, failed, lost = [], [], [], []
        for rid, r in sorted(self.replicas.items()):
            if now - r["last_seen"] > LOST_S:
                lost.append(rid)
            elif r.get("generation") == gen and r.get("expert_set_id") == want:
                adopted.append(rid)
            elif r.get("generation") == gen:
                failed.append({"replica": rid, "refused": r.get("refused", []),
                               "state": r.get("state")})
            else:
                pending.append(rid)
        return {"generation": gen, "expert_set_id": want, "replicas": len(adopted) +
                len(pending) + len(failed), "complete": bool(adopted) and not pending
                and not failed, "adopted": adopted, "pending": pending, "failed": failed,
                "lost": lost}

    async def listing(self) -> dict:
        """GET /v1/experts for the fleet: the set, each replica's state, the refusals."""
        now = time.time()
        with self._lock:
            rows = self.set.listing()
            refusals = list(self.refusals)
        for rid, r in self.replicas.items():
            for x in r.get("refused", []):
                refusals.append({**x, "where": rid})
        refusals.sort(key=lambda x: -x.get("time", 0))
        model_rows = []
        for name, digest in sorted(self.model_pairs or []):
            layer, slot = (int(v) for v in name.split("_")[1:3])
            model_rows.append({"name": name, "version": "", "slot": slot, "layers": [layer],
                               "origin": "model file", "sha256": digest, "status": "active"})
        for row in rows:
            row["origin"] = "hot-plugged"
        replicas = [{"replica": rid, **{k: v for k, v in r.items() if k != "counters"},
                     "last_seen_s": round(now - r["last_seen"], 2),
                     "live": now - r["last_seen"] <= LOST_S}
                    for rid, r in sorted(self.replicas.items())]
        return {"object": "list", "expert_set_generation": self.set.generation,
                "expert_set_id": self.expected_id(), "watched_folder": self.experts_dir,
                "data": model_rows + rows, "refusals": refusals[:50],
                "adoptions": sum(r.get("counters", {}).get("adoptions", 0)
                                 for r in self.replicas.values()),
                "rollout": self.rollout(), "replicas": replicas}

    async def snapshot(self) -> dict:
        """The live replicas' counters (their last reports), for /metrics."""
        now = time.time()
        live = {rid: r for rid, r in self.replicas.items() if now - r["last_seen"] <= LOST_S}
        return {"generation": self.set.generation, "expert_set_id": self.expected_id(),
                "replicas": {rid: {"generation": r.get("generation"),
                                   "expert_set_id": r.get("expert_set_id"),
                                   "counters": r.get("counters", {})}
                             for rid, r in sorted(live.items())},
                "rollout": self.rollout()}


def start_registry(model_dir, experts_dir: Optional[str], state_dir: str,
                   runtime_env: Optional[dict] = None):
    """The registry actor: the running one of this cluster, else a new detached one on the
    head node (no CPU reserved; restarted by Ray whenever it dies, from its state on the
    head's disk)."""
    import ray
    actor = ray.remote(ExpertRegistry).options(
        name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=1000,
        resources={HEAD_RESOURCE: 0.001}, runtime_env=runtime_env or None)
    handle = actor.remote(str(model_dir), None if experts_dir is None else str(experts_dir),
                          str(state_dir))
    got = tuple(ray.get(handle.where.remote()))   # constructed (or its error, raised here)
    want = (None if experts_dir is None else os.path.abspath(experts_dir),
            os.path.abspath(state_dir))
    if got != want:
        from ..errors import ConfigError
        raise ConfigError(f"this cluster's expert registry watches {got[0]} (state {got[1]}), "
                          f"not {want[0]} (state {want[1]}): stop that fleet first (its "
                          f"`colibri serve --ray` exits with it), or give the same folders")
    return handle


def stop_registry() -> None:
    """The registry of a fleet that stops: its actor goes (its state stays on disk)."""
    import ray
    try:
        ray.kill(get_registry(), no_restart=True)
    except ValueError:
        pass                                      # none running


def get_registry():
    import ray
    return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
