"""Expert parallelism on a real local multi-node Ray cluster (issue 40): the built-in
model's routed experts split over two shard actors, each on its own node of Ray's test
cluster (ray.cluster_utils.Cluster: 1 CPU, a 200 MB object store, the loopback address
per node); the driver runs attention, routers and the shared expert. Logits and tokens
bit for bit one engine's. `pytest -m ray` (.ci/run's second stage)."""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from colibri_core.fleet.localcluster import local_cluster
    with local_cluster(nodes=2, cpus=1, object_store_mb=200) as c:
        yield c


@pytest.fixture(scope="module")
def sharded(cluster):
    import colibri_core
    from colibri_core.fleet.expertplan import check_plan, place
    from colibri_core.fleet.shardactor import RayShard
    from shard_helpers import one_and_sharded
    m = os.path.join(os.path.dirname(colibri_core.__file__), "models", "builtin")
    owners = check_plan(place(m, 2), m)
    shards = [RayShard(m, s, owners, cpus=1, resources={f"shard{s}": 1}).ready() for s in range(2)]
    with one_and_sharded(m, owners, shards) as got:
        yield got


def test_shard_actors_on_two_nodes(cluster, sharded):
    _, _, ex = sharded
    assert len({s.node for s in ex.shards}) == 2 and all(s.node for s in ex.shards)


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
