"""The training job's pieces against the engine (issue 35 item 4): the features the child
captures (batched attention) equal the reference forward's own loop bit for bit, and the
recipe's view of the last layer -- softmax top-k over the old experts, plus the new one
when given -- gives the label logits the engine computes, without the new expert and with
the fraud example's card-testing expert hot-plugged."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
FRAUD_DIR = Path(__file__).resolve().parent.parent / "examples" / "fraud"
sys.path.insert(0, str(FRAUD_DIR))
from fraud_common import CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER, expert_q4_clip  # noqa: E402
from fraud_stream import FRAUD  # noqa: E402
from run_demo import make_stream  # noqa: E402

from colibri_core.engine import Engine  # noqa: E402
from colibri_core.experts.hotplug.authoring import recipe  # noqa: E402
from colibri_core.format.quant import dequantize_q4, quantize_q4  # noqa: E402
from colibri_core.model.ops import log_softmax  # noqa: E402
from colibri_core.model.weights import load_model  # noqa: E402
from colibri_core.server import trainchild  # noqa: E402
# the engine as the recipe computes: float activations, float softmax routing
FLOAT = {"activations": "float", "routing": "float"}


@pytest.fixture(scope="module")
def data():
    txns = make_stream(120, 31, 0.05, 0.10)
    ex = [{"prompt": tx.token_ids(), "target": 0, "route": False} for tx in txns]
    ex[3]["prompt"] = ex[3]["prompt"][:9]            # another length: the fallback path
    w = load_model(MODEL_DIR)
    try:
        f = trainchild.features(w, ex, NEW_EXPERT_LAYER, batch=50)
        head = trainchild.head_of(w)
    finally:
        w.close()
    return ex, f, head


def test_batched_features_equal_the_reference_loop(data, monkeypatch):
    ex, f, _ = data
    monkeypatch.setattr(trainchild._Capture, "_attention",
                        lambda self, *a: trainchild.ReferenceModel._attention(self, *a))
    w = load_model(MODEL_DIR)
    try:
        g = trainchild.features(w, ex, NEW_EXPERT_LAYER, batch=50)
    finally:
        w.close()
    for k in vars(f):
        assert np.array_equal(getattr(f, k), getattr(g, k)), k


def engine_logprob(eng, ex) -> np.ndarray:
    got = eng.score([e["prompt"] + [FRAUD] for e in ex], all_positions=True)
    return np.array([float(log_softmax(np.asarray(s.logits)[-2:-1])[0, FRAUD]) for s in got])


def recipe_logprob(f, head, new=None) -> np.ndarray:
    T = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in vars(f).items()}
    lg = recipe.label_logits(T, head, torch.from_numpy(head.final_norm),
                             torch.from_numpy(head.lm_head), torch.arange(len(f.xn)), new)
    return torch.log_softmax(lg.double(), -1)[:, FRAUD].numpy()


def test_recipe_head_matches_the_engine(data, tmp_path):
    ex, f, head = data
    with Engine.from_config(CONFIG, **FLOAT) as eng:
        base = engine_logprob(eng, ex)
    mine = recipe_logprob(f, head)
    assert np.abs(mine - base).max() < 1e-3
    z = np.load(EXPERT_NPZ)
    clip = expert_q4_clip()
    rq = lambda a: dequantize_q4(quantize_q4(a, clip=clip)).astype(np.float32)  # noqa: E731
    new = (torch.from_numpy(np.concatenate([rq(z["w1"]), rq(z["w3"])])),
           torch.from_numpy(rq(z["w2"])), torch.from_numpy(z["router_row"].astype(np.float32)),
           torch.tensor(float(z["router_bias"])))
    folder = tmp_path / "experts"
    folder.mkdir(mode=0o700)
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.model.fingerprint import fingerprint_of_dir
    so = tmp_path / "card_testing.so"
    build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "card_testing", "1", q4_clip=clip,
                 base_model=fingerprint_of_dir(MODEL_DIR))
    shutil.copyfile(so, folder / so.name)
    with Engine.from_config(CONFIG, experts_dir=str(folder), **FLOAT) as eng:
        live = engine_logprob(eng, ex)
    with_new = recipe_logprob(f, head, new)
    assert np.abs(live - base).max() > 0.5            # the expert changes the scores ...
    assert np.abs(with_new - live).max() < 1e-3       # ... as the recipe computes them
