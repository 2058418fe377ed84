"""Expert-shard tests' shared piece (tests/test_expert_shards.py in-process,
tests/test_fleet_shards_ray.py on Ray): one engine beside a second one whose routed
experts run on given shards."""
from __future__ import annotations

import contextlib

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.fleet.expertshard import ShardedExperts


@contextlib.contextmanager
def one_and_sharded(model_dir, owners: dict, shards: list):
    """(one engine, the sharded engine, its executor); the shards closed at exit."""
    try:
        with Engine(model_dir, EngineConfig(threads=1)) as one, \
                Engine(model_dir, EngineConfig(threads=1)) as drv:
            yield one, drv, ShardedExperts(drv.model.pipeline, owners, shards).install()
    finally:
        for s in shards:
            s.close()
