"""Expert shards as Ray actors (issue 40): expertshard.ExpertShard inside an actor, and
the adapter the step's executor (expertshard.ShardedExperts) calls: submit() starts a
shard's share of a layer (an ObjectRef), result() waits for it. Every shard's submit
goes out before the first result is awaited, so the shards compute at the same time.

Faults: an actor that dies fails the step with ShardUnavailable (a 503 with Retry-After
for the requests in it; never a local fallback). Ray restarts it (max_restarts) with its
plan's experts; until it answers a ping again, every step fails at once with the same
503, then the executor sends it its hot-plugged experts again (`restarted`). A result
not back within `deadline_s` counts as slow (`slow`, per shard in /metrics); one not
back within `timeout_s` fails the step like a dead shard.

Ray is imported only here (the ray extra)."""
from __future__ import annotations

import threading
import time

from .expertshard import ExpertShard, ShardUnavailable

DEADLINE_S = 1.0              # a layer's result later than this: the shard was slow
TIMEOUT_S = 60.0              # later than this: the shard is taken as failed
PLUG_TIMEOUT_S = 120.0
# after a failure a shard counts as down at least this long: the scheduler retries a
# failed batch one sequence at a time at once, and those in flight must fail (a 503),
# not find a shard Ray restarted meanwhile
DOWN_MIN_S = 1.0


class RayShard:
    """Shard `index` of a plan as an actor with `cpus` CPUs (its compute threads; 0: one
    thread, no CPU reserved);
    `hotplug`: the engine's hot-plug settings (a private watched folder on the shard);
    `options`: Ray's actor options (resources, scheduling_strategy, max_restarts ...)."""

    def __init__(self, model_dir, index: int, owners: dict, cpus: int = 1,
                 hotplug: dict | None = None, deadline_s: float = DEADLINE_S,
                 timeout_s: float = TIMEOUT_S, **options):
        import ray
        self.index = index
        self._ray = ray
        self.deadline_s, self.timeout_s = deadline_s, timeout_s
        self.slow = 0                 # results later than deadline_s
        self.failures = 0             # steps failed by this shard (died, timed out)
        self.restarts = 0             # times it came back after a failure
        self.restarted = False        # back from a failure: holds no hot-plugged expert
        self.node, self.pid = "", 0   # where its actor runs now
        self._ping = None             # while down: a call that answers once it is back
        self._down_until = 0.0
        self._why = ""
        self._lock = threading.Lock()     # the step's thread and /metrics' both poll
        self.actor = ray.remote(ExpertShard).options(num_cpus=cpus, **options).remote(
            str(model_dir), index, owners, max(cpus, 1), hotplug)

    # -- the executor's protocol --------------------------------------------------------
    def submit(self, layer, xn, experts, weights):
        if self._ping is not None:
            self._check_back()
        return self.actor.compute.remote(layer, xn, experts, weights)

    def result(self, ref):
        ray = self._ray
        try:
            ready, _ = ray.wait([ref], timeout=self.deadline_s)
            if not ready:
                self.slow += 1
                ready, _ = ray.wait([ref], timeout=max(self.timeout_s - self.deadline_s, 0))
                if not ready:
                    self._down(f"no answer within {self.timeout_s:g} s")
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._down(f"its actor died ({type(e).__name__})")

    def plug(self, want: dict) -> dict:
        if self._ping is not None:
            self._check_back()
        try:
            return self._ray.get(self.actor.plug.remote(want), timeout=PLUG_TIMEOUT_S)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError) as e:
            self._down(f"hot-plug failed ({type(e).__name__})")

    # -- faults -------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._ping is None

    def _down(self, why: str):
        with self._lock:
            self.failures += 1
            self._why = why
            self._down_until = time.monotonic() + DOWN_MIN_S
            self._ping = self.actor.where.remote()  # queued until Ray restarted it
        raise ShardUnavailable(f"expert shard {self.index} failed: {why}; Ray restarts it "
                               f"with its experts: retry in a few seconds")

    def poll(self) -> bool:
        """Up? While down, True (and `restarted`) once its actor answers again."""
        ray = self._ray
        with self._lock:
            if self._ping is None:
                return True
            if time.monotonic() < self._down_until:
                return False
            ready, _ = ray.wait([self._ping], timeout=0)
            if not ready:
                return False
            try:
                self.pid, self.node = ray.get(self._ping)
            except ray.exceptions.RayActorError:
                self._ping = self.actor.where.remote()
                return False
            self._ping, self.restarted = None, True
            self.restarts += 1
            return True

    def _check_back(self) -> None:
        if self.poll():
            return
        raise ShardUnavailable(f"expert shard {self.index} is restarting (it failed: "
                               f"{self._why}): retry in a few seconds")

    # -- what /metrics reads ------------------------------------------------------------
    @property
    def pairs(self) -> int:
        """(token, expert) pairs the actor has computed (since it last started)."""
        return self._ray.get(self.actor.count.remote())

    def ready(self, timeout_s: float = 300.0) -> "RayShard":
        """Waits until the actor has loaded its model (raises what its start raised)."""
        self.pid, self.node = self._ray.get(self.actor.where.remote(), timeout=timeout_s)
        return self

    def close(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


def wait_all(shards: list, timeout_s: float = 300.0) -> list:
    """Every shard ready (its model loaded), or the first one's start error."""
    end = time.monotonic() + timeout_s
    return [s.ready(max(end - time.monotonic(), 1.0)) for s in shards]
