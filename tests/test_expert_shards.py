"""Expert parallelism (issue 40): the placement plan (fleet/expertplan.py) and the step
over expert shards as plain in-process objects (fleet/expertshard.py): bit for bit the
single-engine pipeline. The Ray actors come on top of the same `compute`."""
import json

import numpy as np
import pytest

from colibri_core.hookspecs import hookimpl
from colibri_core.fleet.expertplan import PlanError, check_plan, load_plan, place, read_load
from colibri_core.fleet.expertshard import ExpertShard
from shard_helpers import one_and_sharded

BUILTIN = "colibri_core/models/builtin"


def _model_dir():
    from pathlib import Path
    import colibri_core
    return Path(colibri_core.__file__).parent / "models" / "builtin"


# -- placement ------------------------------------------------------------------------

def test_place_by_bytes_every_expert_once_and_even():
    m = _model_dir()
    for n in (1, 2, 3, 8):
        plan = place(m, n)
        owners = check_plan(plan, m)
        assert sorted(owners) == [1, 2, 3]
        for own in owners.values():
            assert all(len(o) == 1 for o in own)
            held = np.bincount([o[0] for o in own], minlength=n)
            assert held.max() - held.min() <= 1            # 8 experts: even to within one
        # bytes per shard: what the plan says is what the owners add up to
        cfg = json.loads((m / "config.json").read_text())
        want = [0] * n
        for L, own in owners.items():
            for e, o in enumerate(own):
                want[o[0]] += cfg["files"][f"expert_{L}_{e}.bin"]["size"]
        assert plan["bytes"] == want
        assert max(want) - min(want) <= max(cfg["files"]["expert_1_0.bin"]["size"], 1) * 3


def test_place_by_load_balances_hot_experts_and_replicates():
    m = _model_dir()
    load = {1: [100, 1, 1, 1, 1, 1, 1, 90], 2: [1] * 8, 3: [5, 4, 3, 2, 1, 0, 0, 9]}
    plan = place(m, 2, load)
    own = check_plan(plan, m)[1]
    assert own[0] != own[7]                         # the two hot experts apart
    loads = [sum(load[1][e] for e in range(8) if own[e] == [s]) for s in (0, 1)]
    assert max(loads) <= 100 + 3 and min(loads) >= 90
    rep = check_plan(place(m, 3, load, replicate=1), m)
    assert len(rep[1][0]) == 2 and len(rep[3][7]) == 2     # each layer's hottest twice
    assert sum(len(o) for o in rep[1]) == 9
    with pytest.raises(PlanError, match="replicate: needs routing statistics"):
        place(m, 2, replicate=1)
    with pytest.raises(PlanError, match="layer 2: expected 8 counts, got 3"):
        place(m, 2, {1: [1] * 8, 2: [1, 2, 3], 3: [1] * 8})


def test_plan_errors_name_the_field(tmp_path):
    m = _model_dir()
    good = place(m, 2)

    def err(mutate):
        plan = json.loads(json.dumps(good))
        mutate(plan)
        p = tmp_path / "plan.json"
        p.write_text(json.dumps(plan))
        with pytest.raises(PlanError) as e:
            load_plan(p, m)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "format: 2" in err(lambda p: p.update(format=2))
    assert "shards: 0" in err(lambda p: p.update(shards=0))
    assert "model_experts_sha256" in err(lambda p: p.update(model_experts_sha256="x"))
    assert "owners.1: 7 experts; the model's layer 1 has 8" in err(lambda p: p["owners"]["1"].pop())
    assert "owners.2[3]: [2]" in err(lambda p: p["owners"]["2"].__setitem__(3, [2]))
    assert "owners.2[0]: []" in err(lambda p: p["owners"]["2"].__setitem__(0, []))
    assert "owners.0: not a MoE layer" in err(lambda p: p["owners"].__setitem__("0", []))
    assert "owners.3: none experts" in err(lambda p: p["owners"].pop("3"))
    assert load_plan(_write(tmp_path / "ok.json", good), m)[0] == 2
    bad = _write(tmp_path / "load.json", {"routed_tokens": {"1": [1, -2]}})
    with pytest.raises(PlanError, match="layer '1': expected a list of non-negative counts"):
        read_load(bad)
    assert read_load(_write(tmp_path / "l2.json", {"1": [3, 4]})) == {1: [3.0, 4.0]}


def _write(p, obj):
    p.write_text(json.dumps(obj))
    return p


def test_experts_place_command(tmp_path, capsys):
    from colibri_core.cli import main
    out = tmp_path / "plan.json"
    assert main(["experts", "place", "builtin", "--shards", "3", "-o", str(out)]) == 0
    assert check_plan(json.loads(out.read_text()), _model_dir())[1]
    assert "3 MoE layers x 8 experts on 3 shards" in capsys.readouterr().out


# -- the step over shards ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded():
    """The built-in model, its experts split over 3 in-process shards (a replicated
    expert among them), and the same model as one engine."""
    m = _model_dir()
    load = {L: [8, 1, 2, 3, 4, 5, 6, 7] for L in (1, 2, 3)}
    owners = check_plan(place(m, 3, load, replicate=1), m)
    with one_and_sharded(m, owners, [ExpertShard(m, s, owners) for s in range(3)]) as got:
        yield got


def test_shard_step_bit_identical_logits(sharded):
    one, drv, ex = sharded
    rng = np.random.default_rng(0)
    # short and long sequences in one call: tiles and (AVX-512) panels alike, k 1..4
    seqs = [rng.integers(1, 1000, size=n).tolist() for n in (1, 3, 17, 40)]
    for k in (1, 2, 4):
        want = one.score_batch(seqs, experts_per_token=k, all_positions=True)
        got = drv.score_batch(seqs, experts_per_token=k, all_positions=True)
        for w, g in zip(want, got):
            assert np.array_equal(w.view(np.uint32), g.view(np.uint32)), k
    assert all(s.pairs > 0 for s in ex.shards)      # every shard computed
    assert sum(s.pairs for s in ex.shards) == sum(ex.sent)


def test_shard_step_same_tokens_greedy_and_seeded(sharded):
    one, drv, ex = sharded
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 3}, {"temperature": 1.2, "seed": 11}):
        want = one.generate([5, 6, 7, 300], max_new_tokens=16, **kw).run().token_ids
        got = drv.generate([5, 6, 7, 300], max_new_tokens=16, **kw).run().token_ids
        assert got == want, kw


def test_shard_step_driver_computes_no_routed_expert(sharded, monkeypatch):
    one, drv, ex = sharded
    calls = []
    real = drv.model.pipeline._experts
    monkeypatch.setattr(drv.model.pipeline, "_experts", lambda *a: calls.append(a) or real(*a))
    before = list(ex.sent)
    drv.score_batch([[1, 2, 3, 4]])
    assert calls == [] and sum(ex.sent) > sum(before)


class OddRouting:
    """Rows the router never makes: unused slots first, between and everywhere, an expert
    twice in one token, ids not ascending; distinct weights (the add order shows)."""

    @hookimpl
    def colibri_routing(self, layer, expert_ids, weights, scores, logits):
        ids = np.array(expert_ids, np.int64)
        w = np.array(weights, np.float32) * np.float32(1.37)
        for t in range(len(ids)):
            kind = (t + layer) % 4
            if kind == 0:
                ids[t, 1:] = -1                     # k 1
            elif kind == 1 and ids.shape[1] > 1:
                ids[t, 0], ids[t, 1] = -1, ids[t, -1]   # unused first, then a repeat
            elif kind == 2:
                ids[t] = ids[t, ::-1]               # descending
            else:
                ids[t] = -1                         # no routed expert at all
        return ids, w


def test_shard_step_odd_routing_bit_identical():
    """Tokens with k 0..4 in one step, a repeated expert, unused slots first: the same
    bits as one engine, on 2 shards (a step where one shard gets no pair among them)."""
    m = _model_dir()
    owners = check_plan(place(m, 2), m)
    with one_and_sharded(m, owners, [ExpertShard(m, s, owners) for s in range(2)]) as (one, drv, ex):
        for eng in (one, drv):
            eng.register_plugin(OddRouting())
        rng = np.random.default_rng(1)
        seqs = [rng.integers(1, 1000, size=n).tolist() for n in (1, 2, 5, 23)]
        for k in (1, 2, 4):
            want = one.score_batch(seqs, experts_per_token=k, all_positions=True)
            got = drv.score_batch(seqs, experts_per_token=k, all_positions=True)
            for w, g in zip(want, got):
                assert np.array_equal(w.view(np.uint32), g.view(np.uint32)), k
        for n in (1, 3):                            # decode: one token a step
            want = one.generate(seqs[3][:n], max_new_tokens=12, temperature=0).run().token_ids
            assert drv.generate(seqs[3][:n], max_new_tokens=12, temperature=0).run().token_ids == want


def test_shard_refuses_an_expert_it_does_not_hold(sharded):
    _, _, ex = sharded
    s0 = ex.shards[0]
    e = next(e for e, o in enumerate(ex.owners[1]) if 0 not in o)
    with pytest.raises(ValueError, match=f"layer 1 expert {e} is not placed here"):
        s0.compute(1, np.zeros((1, 128), np.float32), np.array([e]), np.array([1.0]))
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        s0.compute(0, np.zeros((1, 128), np.float32), np.array([0]), np.array([1.0]))


def test_serve_expert_shards_bad_options_one_line(tmp_path, capsys):
    """Refused before any Ray or engine start, one line naming the option."""
    from colibri_core.cli import main
    plan = place(_model_dir(), 2)
    plan["owners"]["1"][0] = [5]
    bad = _write(tmp_path / "plan.json", plan)
    for args, want in (
            (["--expert-shards", "0"], "--expert-shards 0: expected at least 1"),
            (["--expert-plan", str(tmp_path / "none.json")],
             f"--expert-plan {tmp_path / 'none.json'}: cannot read the plan"),
            (["--expert-plan", str(bad)], "owners.1[0]: [5]; expected distinct shard ids in 0..1"),
            (["--expert-shards", "2", "--replicas", "2"], "--replicas and --autoscale are for "
                                                          "whole-model replicas"),
            (["--expert-shards", "2", "--shard-deadline-ms", "0"], "expected a time > 0")):
        assert main(["serve", "--ray", "--port", "0", *args]) != 0
        err = capsys.readouterr().err.strip()
        assert want in err and "\n" not in err and "Traceback" not in err, (args, err)
