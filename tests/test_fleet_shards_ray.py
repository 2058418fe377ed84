"""Expert parallelism on a real local multi-node Ray cluster (issue 40): the built-in
model's routed experts split over two shard actors, each on its own node of Ray's test
cluster (ray.cluster_utils.Cluster: 1 CPU, a 200 MB object store, the loopback address
per node); the driver runs attention, routers and the shared expert. Logits and tokens
bit for bit one engine's. `pytest -m ray` (.ci/run's second stage)."""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster
    # the loopback address for the driver too: ray.init otherwise swaps 127.0.0.1 for
    # the machine's own address, which the test nodes do not listen on
    loopback, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    node = dict(num_cpus=1, object_store_memory=200 * 2**20, node_ip_address="127.0.0.1",
                include_dashboard=False)
    c = Cluster(initialize_head=True, head_node_args=node)
    try:
        for i in range(2):
            c.add_node(**node, resources={f"shard{i}": 1})
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = loopback


@pytest.fixture(scope="module")
def sharded(cluster):
    import colibri_core
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.fleet.expertplan import check_plan, place
    from colibri_core.fleet.expertshard import ShardedExperts
    from colibri_core.fleet.shardactor import RayShard
    m = os.path.join(os.path.dirname(colibri_core.__file__), "models", "builtin")
    owners = check_plan(place(m, 2), m)
    shards = [RayShard(m, s, owners, cpus=1, resources={f"shard{s}": 1}).ready() for s in range(2)]
    with Engine(m, EngineConfig(threads=1)) as one, Engine(m, EngineConfig(threads=1)) as drv:
        ex = ShardedExperts(drv.model.pipeline, owners, shards).install()
        try:
            yield one, drv, ex
        finally:
            for s in shards:
                s.close()


def test_shard_actors_on_two_nodes(cluster, sharded):
    import ray
    _, _, ex = sharded
    nodes = {ray.get(s.actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
             for s in ex.shards}
    assert len(nodes) == 2


def test_shard_actors_bit_identical_logits(sharded):
    one, drv, ex = sharded
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 1000, size=n).tolist() for n in (1, 5, 20)]
    want = one.score_batch(seqs, experts_per_token=3, all_positions=True)
    got = drv.score_batch(seqs, experts_per_token=3, all_positions=True)
    for w, g in zip(want, got):
        assert np.array_equal(w.view(np.uint32), g.view(np.uint32))


def test_shard_actors_same_tokens_greedy_and_seeded(sharded, monkeypatch):
    one, drv, ex = sharded
    local = []
    real = drv.model.pipeline._experts
    monkeypatch.setattr(drv.model.pipeline, "_experts", lambda *a: local.append(a) or real(*a))
    before = [s.pairs for s in ex.shards]
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
        want = one.generate([9, 8, 7, 6], max_new_tokens=12, **kw).run().token_ids
        got = drv.generate([9, 8, 7, 6], max_new_tokens=12, **kw).run().token_ids
        assert got == want, kw
    after = [s.pairs for s in ex.shards]
    assert all(a > b for a, b in zip(after, before))   # every shard computed
    assert local == []                                 # the driver computed no routed expert
