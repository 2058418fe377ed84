"""Expert shards as Ray actors (issue 40): expertshard.ExpertShard inside an actor, and
the adapter the step's executor (expertshard.ShardedExperts) calls: submit() sends a
shard its share of a layer, result() reads the answer. Every shard's submit goes out
before the first result is read, so the shards compute at the same time.

The per-layer data goes over the shard's own socket (shardchannel.py: a Unix socket on
the driver's host, else TCP), not through Ray calls: a plain actor call costs about
1.3 ms a hop here, the socket about 0.1 ms (docs/SCALE.md "Measured here"). Ray places
the actor, restarts it and carries the rest (its address, hot-plug, counts, pings).

Faults: an actor that dies, or whose socket closes, resets or does not answer, fails
the step with ShardUnavailable (a 503 with Retry-After for the requests in it; never a
local fallback). Ray restarts it (max_restarts) with its plan's experts; until it
answers a ping again, every step fails at once with the same 503, then the driver
connects to its new socket and the executor sends it its hot-plugged experts again
(`restarted`). A result not back within `deadline_s` counts as slow (`slow`, per shard
in /metrics); one not back within `timeout_s` fails the step like a dead shard.

Ray is imported only here (the ray extra)."""
from __future__ import annotations

import threading
import time

from .expertshard import ExpertShard, ShardUnavailable
from .shardchannel import TRANSPORTS, Channel, ChannelClosed, ChannelServer

DEADLINE_S = 1.0              # a layer's result later than this: the shard was slow
TIMEOUT_S = 60.0              # later than this: the shard is taken as failed
PLUG_TIMEOUT_S = 120.0
# after a failure a shard counts as down at least this long: the scheduler retries a
# failed batch one sequence at a time at once, and those in flight must fail (a 503),
# not find a shard Ray restarted meanwhile
DOWN_MIN_S = 1.0


class ShardActor(ExpertShard):
    """The actor: an ExpertShard that serves its compute on a socket of its own."""

    def __init__(self, *args):
        import ray
        super().__init__(*args)
        self._server = ChannelServer(self.compute, ray.util.get_node_ip_address())

    def hello(self) -> tuple:
        """(process id, Ray node id, its socket's address)."""
        return (*self.where(), self._server.address)


class RayShard:
    """Shard `index` of a plan as an actor with `cpus` CPUs (its compute threads; 0: one
    thread, no CPU reserved);
    `hotplug`: the engine's hot-plug settings (a private watched folder on the shard);
    `transport`: "auto" (its Unix socket when on this host, else TCP) or "tcp";
    `options`: Ray's actor options (resources, scheduling_strategy, max_restarts ...)."""

    def __init__(self, model_dir, index: int, owners: dict, cpus: int = 1,
                 hotplug: dict | None = None, deadline_s: float = DEADLINE_S,
                 timeout_s: float = TIMEOUT_S, transport: str = "auto", **options):
        import ray
        if transport not in TRANSPORTS:
            raise ValueError(f"expert shard transport {transport!r}: expected one of {TRANSPORTS}")
        self.index = index
        self._ray = ray
        self.transport = transport
        self._addr = None             # its socket's address (from its last hello)
        self._chan = None             # the driver's connection to it
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
        self.actor = ray.remote(ShardActor).options(num_cpus=cpus, **options).remote(
            str(model_dir), index, owners, max(cpus, 1), hotplug)

    # -- the executor's protocol --------------------------------------------------------
    def submit(self, layer, xn, experts, weights):
        if self._ping is not None:
            self._check_back()
        try:
            if self._chan is None:                  # back after a failure: its new socket
                self._chan = Channel(self._addr, self.transport, self.timeout_s)
            return self._chan.send(layer, xn, experts, weights)
        except ChannelClosed as e:
            self._down(str(e))

    def result(self, handle):
        """The shard's outputs, in a buffer valid until its next result."""
        try:
            out, slow = self._chan.recv(handle, self.deadline_s, self.timeout_s)
        except ChannelClosed as e:
            self._down(str(e))
        self.slow += slow
        return out

    @property
    def channel(self) -> str:
        """"unix" or "tcp" while connected, else ""."""
        return self._chan.kind if self._chan is not None else ""

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
            if self._chan is not None:
                self._chan.close()
                self._chan = None
            self._ping = self.actor.hello.remote()  # queued until Ray restarted it
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
                self.pid, self.node, self._addr = ray.get(self._ping)
            except ray.exceptions.RayActorError:
                self._ping = self.actor.hello.remote()
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
        """Waits until the actor has loaded its model (raises what its start raised),
        then connects to its socket."""
        self.pid, self.node, self._addr = self._ray.get(self.actor.hello.remote(),
                                                        timeout=timeout_s)
        self._chan = Channel(self._addr, self.transport, self.timeout_s)
        return self

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        self._ray.kill(self.actor, no_restart=True)


def wait_all(shards: list, timeout_s: float = 300.0) -> list:
    """Every shard ready (its model loaded), or the first one's start error."""
    end = time.monotonic() + timeout_s
    return [s.ready(max(end - time.monotonic(), 1.0)) for s in shards]
