"""Issue 34 items 1-3: every scored item names the one expert set that computed it, the
audit log records it, and `colibri replay` reproduces it bit for bit -- or flags exactly
the items an altered expert touched."""
from __future__ import annotations

import hashlib
import json
import shutil
import time

import numpy as np
import pytest

from colibri_core.runtime.audit import input_digest, output_digest, routing_arrays
from colibri_core.engine import Engine
from colibri_core.errors import AuditLogError, ConfigError
from colibri_core.replay import replay
from hotplug_helpers import tiny_model_expert

H = 128          # tiny_model_dir: hidden 128, MoE layers 1 and 2, 4 experts, top-2, vocab 256


def _seqs(n, seed=0, lo=4, hi=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _solo(eng, tokens, k, es, all_positions=True):
    """The independent reference: one sequence alone on a fresh cache, under `es`."""
    m = eng.model
    cache = m.new_cache(len(tokens))
    return m.forward([np.asarray(tokens, np.int64)], [cache], [k], all_logits=all_positions,
                     expert_set=es)[0]


def _lines(path):
    return [json.loads(x) for x in open(path)]


def _hot_engine(tmp_path, **kw):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    watched = tmp_path / "watched"
    watched.mkdir(mode=0o755, exist_ok=True)
    so = compile_test_expert(tmp_path / "hot.so", hidden=H, layer=1, name="hot",
                             version="1", scale=0.5)
    return watched, so


def _router_bias_hot(tmp_path, name="hot", bias=50.0, seed=3):
    """A q4 expert routed by every token of layer 1 (router bias 50)."""
    return tiny_model_expert(tmp_path, name, seed, bias)


def test_a_batch_that_straddles_a_change_names_each_items_set(tiny_model_dir, tmp_path):
    """A score call whose sequences are admitted over several steps (a small KV pool)
    while an expert goes live between two of them: each item is computed entirely under
    one set, and the set its result names is the one that reproduces its logits alone."""
    watched = tmp_path / "watched"
    watched.mkdir(mode=0o755)
    so = _router_bias_hot(tmp_path)
    seqs = _seqs(24, seed=1)
    with Engine.from_model_dir(tiny_model_dir, experts_dir=str(watched), threads=1,
                               kv_pool_tokens=40, max_step_tokens=16,
                               max_batch_tokens=16) as eng:
        base = eng.model.expert_set

        def hook(step):
            if step == 2:                         # mid-call: the expert goes live
                shutil.copyfile(so, watched / ".hot.tmp")
                (watched / ".hot.tmp").rename(watched / "hot.so")
                # wait_idle() alone can return before the watcher has even seen the file:
                # wait until the change is queued for drain() (generously: shared CPUs)
                t0 = time.monotonic()
                while not eng.hotplug._ops and time.monotonic() - t0 < 120:
                    time.sleep(0.01)
                assert eng.hotplug._ops, "the dropped expert was not queued within 120 s"
        eng.scheduler.step_hook = hook
        got = eng.score(seqs, all_positions=True)
        eng.scheduler.step_hook = None
        new = eng.model.expert_set
        assert new.generation > base.generation
        by = {base.generation: base, new.generation: new}
        named = [s.expert_set["generation"] for s in got]
        assert set(named) == {base.generation, new.generation}, named   # it straddled
        assert named == sorted(named)                                   # admitted in order
        differ = 0
        for s, tokens in zip(got, seqs):
            es = by[s.expert_set["generation"]]
            assert s.expert_set["id"] == es.id
            assert np.array_equal(s.logits, _solo(eng, tokens, s.k, es))
            other = new if es is base else base
            differ += not np.array_equal(s.logits, _solo(eng, tokens, s.k, other))
        assert differ == len(seqs)          # the two sets give other bits: a real check


def test_an_items_candidates_share_one_set(tiny_model_dir):
    """Engine.score's groups: sequences with one label are pinned to one set object."""
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        seqs = _seqs(6, seed=2)
        from colibri_core.runtime.scheduler import Request
        from colibri_core.runtime.scoring import ScoreJob
        box = [None]
        req = Request("r")
        a, b = (ScoreJob(req, seqs[0], 2, False, None, box),
                ScoreJob(req, seqs[1], 2, False, None, box))
        a.es = "first"
        b.es = "second"                      # admitted later: keeps the item's set
        assert a.es == b.es == "first"
        got = eng.score(seqs, groups=[0, 0, 1, 1, 2, 2])
        assert all(s.expert_set == got[0].expert_set for s in got)
        with pytest.raises(Exception, match="groups: 2 labels for 6 sequences"):
            eng.score(seqs, groups=[0, 1])


def test_audit_lines_hold_the_item_its_set_and_its_routing(tiny_model_dir, tmp_path):
    log = tmp_path / "audit.jsonl"
    seqs = _seqs(5, seed=3)
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        eng.start_audit(log)
        got = eng.score(seqs, experts_per_token=1, all_positions=True)
        g = eng.generate([5, 6, 7], max_new_tokens=6, temperature=0, experts_per_token=2).run()
        eng.audit.flush()
        lines = _lines(log)
        assert [d["kind"] for d in lines] == ["engine", "expert_set"] + ["score"] * 5 + \
            ["generation"]
        es = eng.model.expert_set
        assert lines[1]["id"] == es.id and lines[1]["experts"] == []
        for d, s, tokens in zip(lines[2:7], got, seqs):
            assert d["tokens"] == tokens and d["k"] == 1
            assert d["input_sha256"] == hashlib.sha256(
                np.asarray(tokens, "<i4").tobytes()).hexdigest()
            assert d["expert_set"] == {"generation": es.generation, "id": es.id}
            assert d["output"]["sha256"] == hashlib.sha256(s.logits.astype("<f4").tobytes()).hexdigest()
            # log P(next token): what /v1/score sums for a candidate
            lp = s.logits.astype(np.float64)
            lp = lp - np.log(np.exp(lp - lp.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - lp.max(1, keepdims=True)
            assert np.allclose(d["scores"], lp[np.arange(len(tokens) - 1), tokens[1:]],
                               rtol=0, atol=1e-9)
            # the routing: the pipeline's own trace of the sequence run alone
            _solo(eng, tokens, 1, es)
            logged = routing_arrays(d["routing"], 1)
            for tr in eng.model.last_routing:
                ids, wts = logged[tr.layer]
                assert np.array_equal(ids, tr.routing.ids[:, :1])
                assert np.array_equal(wts, tr.routing.weights[:, :1].astype(np.float32))
        gl = lines[7]
        assert gl["tokens"] == [5, 6, 7] and gl["output"]["n_tokens"] == len(g.token_ids)
        assert gl["output"]["tokens_sha256"] == input_digest(g.token_ids)
        assert gl["expert_set"] == g.expert_set == {"generation": es.generation, "id": es.id}
        assert sorted(gl["routing"]) == ["1", "2"]
        assert all(a.shape == (3, 2) for a, _ in routing_arrays(gl["routing"], 2).values())
        assert gl["sampling"]["temperature"] == 0.0
        with pytest.raises(Exception, match="audit log is on already"):
            eng.start_audit(log)


def test_audit_off_records_nothing_and_bad_size_is_refused(tiny_model_dir, tmp_path):
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        assert eng.audit is None and eng.model.route_sink is None
        eng.score_batch(_seqs(2))
        with pytest.raises(ConfigError, match="--audit-max-mb"):
            eng.start_audit(tmp_path / "a.jsonl", max_mb=0)


def test_rotation_keeps_every_file_replayable(tiny_model_dir, tmp_path):
    log = tmp_path / "audit.jsonl"
    seqs = _seqs(60, seed=4)
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        eng.start_audit(log, max_mb=8 / 1024)                 # 8 KiB per file
        for i in range(0, 60, 10):
            eng.score_batch(seqs[i:i + 10], all_positions=i % 20 == 0)
        eng.audit.flush()
        files = [log] + sorted(tmp_path.glob("audit.jsonl.[0-9]*"))
        assert len(files) >= 3
        items = 0
        for f in files:
            lines = _lines(f)
            assert lines[0]["kind"] == "engine" and lines[1]["kind"] == "expert_set"
            assert f.stat().st_size < 8 * 1024 + 4096          # one item past the limit at most
            items += sum(d["kind"] == "score" for d in lines)
        assert items == 60
        rep = replay(eng, files)
        assert rep.items == 60 and rep.differ == []


def _flip(path, needle: bytes, xor: int, at: int):
    data = bytearray(path.read_bytes())
    off = data.find(needle)
    assert off > 4096 and data.find(needle, off + 1) < 0
    data[off + at] ^= xor
    path.write_bytes(bytes(data))


def test_replay_flags_exactly_the_items_routed_to_a_changed_expert(tiny_model_dir, tmp_path):
    """One byte of one expert file changed (a w2 scale's exponent bit): replay flags the
    items that routed to that expert with a nonzero weight in that layer, and only them."""
    from robust_helpers import copy_model
    model = copy_model(tiny_model_dir, tmp_path / "m")
    log = tmp_path / "audit.jsonl"
    seqs = _seqs(40, seed=5, lo=2, hi=6)
    with Engine.from_model_dir(model, threads=1) as eng:
        eng.start_audit(log)
        eng.score_batch(seqs, all_positions=True)
        eng.score_batch(seqs[:10])                   # last-token outputs too
        eng.audit.flush()
        items = [d for d in _lines(log) if d["kind"] == "score"]
        assert replay(eng, [log]).differ == []       # untouched: every bit again

    def routed(d, layer, e):
        """Routed to (layer, e) with a nonzero weight at a position whose output can reach
        the item's output: any position for all-positions logits; for the last token's,
        after the model's last layer (2 here) no attention carries other positions on."""
        ids, wts = routing_arrays(d["routing"], d["k"])[layer]
        rows = list(zip(ids.tolist(), wts.tolist()))
        if not d["all_positions"] and layer == 2:
            rows = rows[-1:]
        return any(x == e and w != 0 for row, ws in rows for x, w in zip(row, ws))
    # an expert some items routed to and some did not
    pick = next((L, e) for L in (2, 1) for e in range(4)
                if 3 <= sum(routed(d, L, e) for d in items) <= len(items) - 3)
    with Engine.from_model_dir(model, threads=1) as eng:
        ex = next(x for x in eng.weights.layers[pick[0]].experts if x.index == pick[1])
        needle = ex.ffn.w2.scales[:4].tobytes()      # four rows' scales: unique in the file
        expected = {(d["request_id"], d["item"]) for d in items if routed(d, *pick)}
    _flip(model / f"expert_{pick[0]}_{pick[1]}.bin", needle, 0x80, 2)   # x2 or x0.5
    with Engine.from_model_dir(model, threads=1) as eng:
        rep = replay(eng, [log])
    flagged = {(x["request_id"], x["item"]) for x in rep.differ}
    assert rep.items == len(items) == 50
    assert flagged == expected and 0 < len(expected) < len(items)


def test_replay_finds_a_hot_expert_by_its_hash_or_names_it(tiny_model_dir, tmp_path):
    watched, so = _hot_engine(tmp_path)
    log = tmp_path / "audit.jsonl"
    seqs = _seqs(12, seed=6)
    shutil.copyfile(so, watched / "hot.so")
    with Engine.from_model_dir(tiny_model_dir, threads=1, experts_dir=str(watched)) as eng:
        assert eng.expert_set_generation == 1
        eng.start_audit(log)
        got = eng.score(seqs, all_positions=True)
        eng.generate([7, 8, 9], max_new_tokens=6, temperature=0, pin_experts=True).run()
        sid = eng.expert_set_id
    rec = next(d for d in _lines(log) if d["kind"] == "expert_set")
    sha = hashlib.sha256(so.read_bytes()).hexdigest()
    assert rec["id"] == sid and [(e["name"], e["sha256"], e["slot"]) for e in rec["experts"]] \
        == [("hot", sha, 4)]
    kept = tmp_path / "audit.jsonl.experts" / f"{sha}.so"
    assert kept.is_file()
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:      # no watched folder
        base_id, before = eng.expert_set_id, eng.score_batch(seqs[:2])
        rep = replay(eng, [log])
        assert rep.items == 12 and rep.sets == 1 and rep.generations == 1 and rep.differ == []
        # the replay engine is its own again: its set, its tables, its scores
        assert eng.expert_set_id == base_id
        assert all(np.array_equal(a, b) for a, b in zip(before, eng.score_batch(seqs[:2])))
        kept.unlink()
        with pytest.raises(AuditLogError) as e:
            replay(eng, [log])
        msg = str(e.value)
        assert "\n" not in msg and "audit.jsonl:2" in msg and "expert hot" in msg \
            and sha[:16] in msg
        rep = replay(eng, [log], experts_dir=watched)                   # found by its sha256
        assert rep.differ == []
    assert all(s.expert_set["id"] == sid for s in got)


@pytest.mark.parametrize("edit, match", [
    (lambda d: "{not json", r"audit.jsonl:3: not a JSON line"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "k"}), r"audit.jsonl:3: field 'k'"),
    (lambda d: json.dumps({**d, "tokens": d["tokens"][:-1]}), r"audit.jsonl:3: field 'input_sha256'"),
    (lambda d: json.dumps({**d, "expert_set": {"generation": 0, "id": "f" * 64}}),
     r"audit.jsonl:3: expert set ffffffffffff has no expert_set line"),
])
def test_a_bad_line_is_one_line_naming_file_line_and_field(tiny_model_dir, tmp_path, edit, match):
    log = tmp_path / "audit.jsonl"
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        eng.start_audit(log)
        eng.score_batch(_seqs(2, seed=7))
        eng.audit.flush()
        lines = open(log).read().splitlines()
        lines[2] = edit(json.loads(lines[2]))
        log.write_text("\n".join(lines) + "\n")
        with pytest.raises(AuditLogError, match=match) as e:
            replay(eng, [log])
        assert "\n" not in str(e.value)


def test_colibri_replay_command(tiny_model_dir, tmp_path, capsys):
    from colibri_core.cli import main
    log = tmp_path / "audit.jsonl"
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        eng.start_audit(log)
        eng.score_batch(_seqs(3, seed=8), all_positions=True)
    assert main(["replay", str(log), "--model", str(tiny_model_dir)]) == 0
    assert "replayed 3 scored items under 1 expert sets: 0 differ" in capsys.readouterr().out
    lines = open(log).read().splitlines()
    d = json.loads(lines[2])
    d["output"]["sha256"] = "0" * 64                 # a logged output that is not this one
    lines[2] = json.dumps(d)
    log.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(log), "--model", str(tiny_model_dir), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["items"] == 3 and [x["item"] for x in out["differ"]] == [0]
    assert main(["replay", str(tmp_path / "nope.jsonl"), "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl: cannot open the audit log" in err and err.count("\n") == 1
    assert output_digest(np.zeros(2, np.float32)) == hashlib.sha256(bytes(8)).hexdigest()


def test_replay_generates_greedy_sequences_again(tiny_model_dir, tmp_path):
    """Greedy generations (EOS masked or not, pinned) are generated again under their
    set and their tokens compared; sampled ones are counted as not replayable; a changed
    digest is flagged."""
    from colibri_core.runtime.sampler import Sampler
    log = tmp_path / "audit.jsonl"
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        eng.start_audit(log)
        eng.generate([3, 4, 5], max_new_tokens=7, temperature=0, pin_experts=True).run()

        class Masked:                       # the server's ignore_eos: EOS never sampled
            inner = Sampler(0.0)
            mask = np.array([255])

            def __call__(self, logits):
                z = np.array(logits, np.float64)
                z[self.mask] = -np.inf
                return int(np.argmax(z))
        g = eng.generate([9, 8], max_new_tokens=5, sampler=Masked(), pin_experts=True).run()
        eng.generate([1, 2], max_new_tokens=4, temperature=0.8, seed=1).run()
        eng.stop_audit()
        rep = replay(eng, [log])
        assert (rep.generations, rep.not_replayable, rep.differ) == (2, 1, [])
        lines = open(log).read().splitlines()
        i = next(n for n, x in enumerate(lines) if '"request_id":"%s"' % g.request_id in x)
        d = json.loads(lines[i])
        assert d["sampling"]["mask"] == [255]
        d["output"]["tokens_sha256"] = input_digest(g.token_ids[:-1] + [g.token_ids[-1] ^ 1])
        lines[i] = json.dumps(d)
        log.write_text("\n".join(lines) + "\n")
        rep = replay(eng, [log])
        assert [x["what"] for x in rep.differ] == ["generated tokens differ"]
        # the engine is as it was: its own set, and the same scores as before
        assert eng.expert_set_generation == 0
