"""Expert parallelism on a real local multi-node Ray cluster (issue 40): the built-in
model's routed experts split over two shard actors, each on its own node of Ray's test
cluster (ray.cluster_utils.Cluster: 1 CPU, a 200 MB object store, the loopback address
per node); the driver runs attention, routers and the shared expert. Logits and tokens
bit for bit one engine's, through each shard's Unix socket and through TCP
(fleet/shardchannel.py). A shard killed mid-step (its socket closes with the layer's
request in it) fails that step with ShardUnavailable; after Ray restarted it the driver
connects to its new socket and the tokens are one engine's again. `pytest -m ray`
(.ci/run's second stage)."""
import os
import signal

import numpy as np
import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from colibri_core.fleet.localcluster import local_cluster
    with local_cluster(nodes=2, cpus=1, object_store_mb=200) as c:
        yield c


def _model_and_owners():
    import colibri_core
    from colibri_core.fleet.expertplan import check_plan, place
    m = os.path.join(os.path.dirname(colibri_core.__file__), "models", "builtin")
    return m, check_plan(place(m, 2), m)


@pytest.fixture(scope="module", params=["auto", "tcp"])
def sharded(cluster, request):
    from colibri_core.fleet.shardactor import RayShard
    from shard_helpers import one_and_sharded
    m, owners = _model_and_owners()
    shards = [RayShard(m, s, owners, cpus=1, transport=request.param,
                       resources={f"shard{s}": 0.5}).ready() for s in range(2)]
    with one_and_sharded(m, owners, shards) as got:
        yield got


def test_shard_actors_on_two_nodes(cluster, sharded):
    _, _, ex = sharded
    assert len({s.node for s in ex.shards}) == 2 and all(s.node for s in ex.shards)
    # one machine: "auto" takes the Unix socket
    assert [s.channel for s in ex.shards] == ["tcp" if ex.shards[0].transport == "tcp"
                                              else "unix"] * 2


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


def test_shard_killed_mid_step_fails_it_then_serves_after_restart(cluster):
    """The shard is stopped, gets its layer's request, then killed: only its socket's
    EOF can end that step (a stopped process answers nothing)."""
    from colibri_core.fleet.expertshard import ShardUnavailable
    from colibri_core.fleet.shardactor import RayShard
    from server_helpers import wait_until
    from shard_helpers import one_and_sharded
    m, owners = _model_and_owners()
    # beside `sharded`'s actors (each node has 1 CPU and shard<i> 1)
    shards = [RayShard(m, s, owners, cpus=0, max_restarts=-1, max_task_retries=0,
                       resources={f"shard{s}": 0.5}).ready() for s in range(2)]
    victim, other = shards
    with one_and_sharded(m, owners, shards) as (one, drv, ex):
        prompt = [9, 8, 7, 6]
        want = one.generate(prompt, max_new_tokens=12, temperature=0).run().token_ids
        assert drv.generate(prompt, max_new_tokens=12, temperature=0).run().token_ids == want
        pid, other_pid, calls = victim.pid, other.pid, []
        real = victim.submit

        def submit_then_kill(*a):
            calls.append(1)
            if len(calls) != 5:
                return real(*a)
            os.kill(pid, signal.SIGSTOP)
            h = real(*a)
            os.kill(pid, signal.SIGKILL)
            return h
        victim.submit = submit_then_kill
        with pytest.raises(ShardUnavailable, match="expert shard 0 failed: its socket"):
            drv.generate(prompt, max_new_tokens=12, temperature=0).run()
        assert victim.failures == 1 and not victim.up and victim.channel == ""
        with pytest.raises(ShardUnavailable, match="expert shard 0 is restarting"):
            drv.generate(prompt, max_new_tokens=2, temperature=0).run()
        wait_until(victim.poll, "Ray restarted shard 0", timeout=90, period=0.2)
        assert victim.pid != pid and victim.restarts == 1
        assert drv.generate(prompt, max_new_tokens=12, temperature=0).run().token_ids == want
        assert victim.channel == "unix" and other.pid == other_pid and other.failures == 0
