"""Expert shards as Ray actors (issue 40): expertshard.ExpertShard inside an actor, and
the adapter the step's executor (expertshard.ShardedExperts) calls: submit() starts a
shard's share of a layer (an ObjectRef), result() waits for it. Every shard's submit
goes out before the first result is awaited, so the shards compute at the same time.

Ray is imported only here (the ray extra)."""
from __future__ import annotations

from .expertshard import ExpertShard


class RayShard:
    """Shard `index` of a plan as an actor with `cpus` CPUs (its compute threads);
    `options`: Ray's actor options (resources, scheduling_strategy, max_restarts ...)."""

    def __init__(self, model_dir, index: int, owners: dict, cpus: int = 1, **options):
        import ray
        self.index = index
        self._get = ray.get
        self.actor = ray.remote(ExpertShard).options(num_cpus=cpus, **options).remote(
            str(model_dir), index, owners, cpus)

    def submit(self, layer, xn, experts, weights):
        return self.actor.compute.remote(layer, xn, experts, weights)

    def result(self, ref):
        return self._get(ref)

    @property
    def pairs(self) -> int:
        """(token, expert) pairs the actor has computed."""
        return self._get(self.actor.count.remote())

    def ready(self) -> "RayShard":
        """Waits until the actor has loaded its model (raises what its start raised)."""
        self._get(self.actor.count.remote())
        return self

    def close(self) -> None:
        import ray
        ray.kill(self.actor)
