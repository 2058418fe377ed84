"""A candidate's shadow pass from its first layer on (server/candidates.py from_layer,
Model.forward_from): from the input rows of that layer the live pass kept, layers L..end
under the candidate's set give the bits the whole second pass gives, in one forward pass
of the model's last layers only -- on the tiny mixed-stack model (candidate in its middle
layer, 1 of 0..2) and on the fraud example's model (candidate in layer 3 of 0..3)."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from colibri_core.engine import Engine
from colibri_core.server.candidates import ShadowRunner

FRAUD_DIR = Path(__file__).resolve().parent.parent / "examples" / "fraud"


def _tiny_expert(tmp_path, H: int) -> Path:
    """A candidate for layer 1 whose router bias has every token choose it."""
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    rng = np.random.default_rng(7)
    npz, I = tmp_path / "cand.npz", 64
    np.savez(npz, w1=rng.standard_normal((I, H)) / np.sqrt(H),
             w3=rng.standard_normal((I, H)) / np.sqrt(H),
             w2=rng.standard_normal((H, I)) / np.sqrt(I),
             router_row=rng.standard_normal(H).astype(np.float32) / np.sqrt(H),
             router_bias=np.float32(40.0))
    so = tmp_path / "cand.so"
    build_expert(npz, so, layer=1, name="cand", version="1", portable=True)
    return so


def _engine_with(tmp_path, so: Path, make) -> Engine:
    """make(folder): an engine watching a folder whose shadow/ holds the candidate."""
    watched = tmp_path / "watched"
    (watched / "shadow").mkdir(parents=True, mode=0o700)
    watched.chmod(0o700)
    shutil.copyfile(so, watched / "shadow" / ".cand.tmp")
    os.replace(watched / "shadow" / ".cand.tmp", watched / "shadow" / "cand.so")
    return make(str(watched))


def _entry(eng):
    t0 = time.monotonic()
    while True:
        eng.apply_expert_changes()
        got = [e for e in eng.candidates.active() if e.es is not None]
        if got:
            return got[0]
        assert time.monotonic() - t0 < 120, "the candidate never reached shadow"
        time.sleep(0.05)


def _check(eng, seqs):
    entry = _entry(eng)
    layer = min(entry.hot.layers)
    live = eng.score(seqs, all_positions=True)
    routed = [i for i, x in enumerate(live) if entry.name in x.shadow]
    assert routed, "no sequence routed to the candidate: the test checks nothing"
    assert all(set(live[i].hidden) == {layer} for i in routed)
    whole = eng.score([seqs[i] for i in routed], all_positions=True, expert_set=entry.es)
    assert any(not np.array_equal(w.logits, live[i].logits) for w, i in zip(whole, routed))
    runner = ShadowRunner(eng)
    try:
        pipe = eng.model.pipeline
        passes, layers = pipe.passes, pipe.layers_run
        part = [((i, 0, seqs[i]), live[i]) for i in routed]
        got = runner.from_layer(entry, entry.es, part, "t#shadow:cand")
        assert pipe.passes - passes == 1                        # one pass, not two
        assert pipe.layers_run - layers == eng.model_cfg.num_layers - layer
        assert runner.passes == {"from_layer": 1, "whole": 0}
    finally:
        runner.q.put(None)
    for g, w in zip(got, whole):
        assert g.shape == w.logits.shape and np.array_equal(g, w.logits)
    # rows missing (the live set's pass kept none): the whole pass, not a guess
    assert runner.from_layer(entry, entry.es, [((0, 0, seqs[routed[0]]),
                                                 type(live[0])(live[0].logits, {}, 2,
                                                               live[0].tokens))], "t") is None


def test_from_layer_equals_whole_pass_on_a_middle_layer(tiny_model_dir, tmp_path):
    so = _tiny_expert(tmp_path, 128)
    rng = np.random.default_rng(3)
    with _engine_with(tmp_path, so, make=lambda d: Engine.from_model_dir(
            tiny_model_dir, experts_dir=d, threads=1)) as eng:
        V = eng.model_cfg.vocab_size
        seqs = [rng.integers(0, V, n).tolist() for n in (5, 17, 1, 40, 9)]
        _check(eng, seqs)


def test_from_layer_equals_whole_pass_on_the_fraud_model(tmp_path):
    sys.path.insert(0, str(FRAUD_DIR))
    from fraud_common import CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER, expert_q4_clip
    from fraud_stream import FRAUD
    from run_demo import make_stream
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.model.fingerprint import fingerprint_of_dir
    so = tmp_path / "cand.so"
    build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "cand", "1", q4_clip=expert_q4_clip(),
                 base_model=fingerprint_of_dir(MODEL_DIR))
    txns = make_stream(64, 5, 0.05, 0.3)
    seqs = [tx.token_ids() + [FRAUD] for tx in txns]
    with _engine_with(tmp_path, so, make=lambda d: Engine.from_config(
            CONFIG, experts_dir=d)) as eng:
        _check(eng, seqs)
        _through_the_server(eng, [tx.token_ids() for tx in txns], FRAUD)


def _through_the_server(eng, prompts, label):
    """A /v1/score call's after_score: the routed items' shadow goes from the layer, and
    the gate's figures are those of the whole second pass, worked out here."""
    from types import SimpleNamespace
    from colibri_core.server.candidates import after_score, item_scores, runner, stop
    items = [SimpleNamespace(prompt_ids=p) for p in prompts]
    seqs = [(ii, 0, p + [label]) for ii, p in enumerate(prompts)]
    scored = eng.score([s for _, _, s in seqs], all_positions=True)
    entry = _entry(eng)
    routed = [i for i, x in enumerate(scored) if entry.name in x.shadow]
    whole = eng.score([seqs[i][2] for i in routed], all_positions=True, expert_set=entry.es)
    live = item_scores(items, seqs, [x.logits for x in scored])
    cand = item_scores(items, [seqs[i] for i in routed], [w.logits for w in whole])
    want = max(abs(cand[i][0] - live[i][0]) for i in routed)
    before = dict(runner(eng).passes)
    after_score(eng, items, seqs, scored, "srv-1", None)
    t0 = time.monotonic()
    while entry.gate.report()["pending"]:
        assert time.monotonic() - t0 < 60, "the shadow pass never finished"
        time.sleep(0.02)
    rep = entry.gate.report()
    stop(eng)                                     # the runner's thread
    assert runner(eng).passes["from_layer"] == before["from_layer"] + 1
    assert runner(eng).passes["whole"] == before["whole"]
    assert rep["routed"] == len(routed) and rep["score_delta_max"] == want
