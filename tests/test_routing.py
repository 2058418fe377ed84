"""The router: top-k on logits, fixed-point softmax weights, non-finite fallback."""
import numpy as np
import pytest

from colibri_core.model.ops import softmax
from colibri_core.model.routing import fixed_point_softmax_weights, route


@pytest.mark.parametrize("E,scale", [(4, 0.1), (8, 1.0), (60, 3.0), (64, 10.0)])
def test_fixed_point_weights_within_0_003_of_float(E, scale):
    rng = np.random.default_rng(E)
    logits = (rng.standard_normal((2000, E)) * scale).astype(np.float32)
    sel = np.argsort(-logits, axis=1)[:, :min(8, E)]
    exact = np.take_along_axis(softmax(logits.astype(np.float64)), sel, 1)
    for norm in (False, True):
        got = fixed_point_softmax_weights(logits, sel, normalize_selected=norm)
        ref = exact / exact.sum(1, keepdims=True) if norm else exact
        err = np.abs(got - ref).max()
        assert err <= 0.003, err
        print(f"E={E} scale={scale} norm={norm}: max |fixed - float| = {err:.2e}")


def test_selection_is_top_k_of_logits_any_k():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    for k in (1, 2, 5, 16):
        r = route(logits, np.full(50, k))
        ref = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        assert (r.ids == ref).all()
        assert np.allclose(r.weights.sum(1), 1.0, atol=1e-3)   # norm_topk_prob default


def test_norm_topk_prob_off_gives_softmax_probabilities():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    r = route(logits, np.array([2]), mode="float", norm_topk_prob=False)
    p = softmax(logits.astype(np.float64))[0]
    assert np.allclose(r.weights[0], p[:2], atol=1e-6)
    assert np.allclose(r.scores[0], p[:2], atol=1e-6)


def test_per_token_k_masks_extra_slots():
    logits = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    r = route(logits, np.array([1, 3, 2]))
    assert (r.ids[0, 1:] == -1).all() and (r.ids[1] >= 0).all() and r.ids[2, 2] == -1
    assert (r.weights[r.ids < 0] == 0).all()


def test_non_finite_logits_fall_back_to_uniform():
    logits = np.array([[np.nan, 1, 2, 3], [0.0, 1.0, np.inf, 2.0], [1, 2, 3, 4]], np.float32)
    r = route(logits, np.array([2, 2, 2]))
    assert np.isfinite(r.weights).all()
    assert np.allclose(r.weights[:2], 0.5)
    assert list(r.ids[2]) == [3, 2]


def test_sigmoid_group_limited_routing():
    # 8 experts in 4 groups of 2; only the best 2 groups may be chosen.
    logits = np.array([[5.0, -5, 4, 4, -5, -5, 0, 0]], np.float32)
    r = route(logits, np.array([3]), scoring="sigmoid", n_group=4, topk_group=2,
              norm_topk_prob=True, scaling=2.0)
    assert set(r.ids[0]) <= {0, 1, 2, 3}
    assert set(r.ids[0]) == {0, 2, 3}
    assert np.isclose(r.weights.sum(), 2.0, atol=1e-5)
