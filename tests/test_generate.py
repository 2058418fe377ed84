"""Generation: sampling, stop reasons, dynamic k and its precedence, request errors."""
import logging

import numpy as np
import pytest

from colibri_core.config import EngineConfig, LengthRule
from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.runtime.kselect import split_mode_prefix


@pytest.fixture()
def eng(tiny_model_dir):
    e = Engine.from_model_dir(tiny_model_dir)
    yield e
    e.close()


def test_same_seed_same_tokens(eng):
    a = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7).run()
    b = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7).run()
    c = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=8).run()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.token_ids != c.token_ids


def test_greedy_equals_argmax_of_logits(eng):
    g = eng.generate([4, 5, 6], max_new_tokens=4, temperature=0).run()
    ids = [4, 5, 6]
    for t in g.token_ids:
        assert t == int(np.argmax(eng.next_token_logits(ids)))
        ids.append(t)
    assert g.stop_reason == "length"


def test_eos_stops(eng):
    first = eng.generate([9, 9], max_new_tokens=1, temperature=0).run().token_ids[0]
    e2 = Engine(eng.model_dir, EngineConfig())
    object.__setattr__(e2.model_cfg, "eos_token_ids", [first])   # make the greedy token EOS
    g = e2.generate([9, 9], max_new_tokens=5, temperature=0).run()
    assert g.stop_reason == "eos" and g.token_ids == []
    e2.close()


def test_context_full_stop_and_prompt_truncation(eng, caplog):
    ctx = eng.model_cfg.max_position_embeddings
    g = eng.generate(list(range(1, ctx - 3)), max_new_tokens=50, temperature=0).run()
    # 4 free positions: 4 fed tokens, plus the one sampled from the last position
    assert g.stop_reason == "context" and len(g.token_ids) == 5
    with caplog.at_level(logging.WARNING, logger="colibri"):
        g = eng.generate([3] * (ctx + 40), max_new_tokens=2, temperature=0)
    assert g.truncated_from == ctx + 40 and len(g.prompt_ids) == ctx - 1
    assert "exceeds the context" in caplog.text
    g = eng.generate([3] * (ctx + 40), max_new_tokens=5, temperature=0).run()
    assert len(g.token_ids) == 2 and g.stop_reason == "context"


def test_request_errors(eng):
    with pytest.raises(RequestError, match="empty prompt"):
        eng.generate([])
    with pytest.raises(RequestError, match=r"token id 256 out of range 0..255"):
        eng.generate([1, 256])
    with pytest.raises(RequestError, match=r"experts_per_token=5 from the experts_per_token argument is out of range.*1..4"):
        eng.generate([1], experts_per_token=5)
    with pytest.raises(RequestError, match=r"experts_per_token=0"):
        eng.generate([1], experts_per_token=0)


def test_mode_prefix_parser():
    assert split_mode_prefix("MODE:k2|hello") == (2, "hello")
    assert split_mode_prefix("hello MODE:k2|") == (None, "hello MODE:k2|")
    for bad in ("MODE:k|x", "MODE:kx|x", "MODE:k2x", "MODE:2|x", "MODE:"):
        with pytest.raises(RequestError, match="malformed MODE: prefix"):
            split_mode_prefix(bad)
    with pytest.raises(RequestError, match="at least 1"):
        split_mode_prefix("MODE:k0|x")


def test_k_precedence(tiny_model_dir):
    policy = [LengthRule(max_tokens=3, k=1), LengthRule(min_tokens=10, k=3)]
    with Engine(tiny_model_dir, EngineConfig(length_policy=policy)) as e:
        assert e.choose_k(2, None, None, {}) == (1, "policy")
        assert e.choose_k(5, None, None, {}) == (2, "model")
        assert e.choose_k(12, None, None, {}) == (3, "policy")
        assert e.choose_k(2, None, 4, {}) == (4, "prefix")
        assert e.choose_k(2, 3, 4, {}) == (3, "argument")
        # the chosen k really changes the experts used
        e.generate([1, 2], max_new_tokens=1).run()
        assert e.model.last_routing[0].routing.ids.shape[1] == 1
        e.generate([1, 2], max_new_tokens=1, experts_per_token=4).run()
        assert e.model.last_routing[0].routing.ids.shape[1] == 4


def test_copy_mode_gives_identical_logits(tiny_model_dir):
    with Engine(tiny_model_dir, EngineConfig(load_mode="mmap")) as a, \
            Engine(tiny_model_dir, EngineConfig(load_mode="copy")) as b:
        assert (a.next_token_logits([5, 6, 7]) == b.next_token_logits([5, 6, 7])).all()
