"""Presence, frequency and repetition penalties and min-p (sampler.py) against a numpy
reference of vLLM's semantics, and through the engine: greedy with penalties is the
arg-max of the penalized logits at every step, the same alone and batched."""
import threading

import numpy as np
import pytest

from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.model.ops import softmax
from colibri_core.runtime.sampler import Sampler


def ref_penalize(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0):
    """vLLM: repetition on prompt+output tokens (divide positive, multiply negative),
    then frequency x count and presence once, on output tokens only."""
    x = np.array(logits, np.float64)
    seen = sorted(set(prompt) | set(out))
    for t in seen:
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def ref_probs(x, temperature, min_p):
    p = softmax((x - x.max()) / temperature)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


PEN = [dict(presence=1.5), dict(frequency=0.7), dict(repetition=1.8),
       dict(presence=-1.0, frequency=-0.5, repetition=0.6),
       dict(presence=0.4, frequency=0.9, repetition=1.3)]


def _kw(pen):
    return dict(presence_penalty=pen.get("presence", 0.0),
                frequency_penalty=pen.get("frequency", 0.0),
                repetition_penalty=pen.get("repetition", 1.0))


@pytest.mark.parametrize("pen", PEN)
def test_greedy_penalties_match_reference(pen):
    rng = np.random.default_rng(0)
    V = 64
    prompt = [3, 5, 5, 7]
    s = Sampler(0.0, **_kw(pen))
    s.penalties.start(prompt)
    out = []
    changed = 0
    for _ in range(40):
        # few logits close to each other so the penalties decide often
        logits = rng.normal(0, 1.0, V).astype(np.float32)
        tok = s(logits)
        want = int(np.argmax(ref_penalize(logits, prompt, out, **pen)))
        assert tok == want
        changed += want != int(np.argmax(logits))
        out.append(tok)
        s.penalties.push(tok)
    assert changed > 0                     # the penalties did change some choices


@pytest.mark.parametrize("pen", PEN)
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_sampled_penalties_and_min_p_match_reference(pen, min_p):
    rng = np.random.default_rng(1)
    V = 50
    prompt = [1, 2, 2, 40]
    s = Sampler(0.9, seed=11, min_p=min_p, **_kw(pen))
    s.penalties.start(prompt)
    ref_rng = np.random.default_rng(11)
    out = []
    for _ in range(30):
        logits = rng.normal(0, 2.0, V).astype(np.float32)
        tok = s(logits)
        p = ref_probs(ref_penalize(logits, prompt, out, **pen), 0.9, min_p)
        assert tok == int(ref_rng.choice(V, p=p))
        assert p[tok] > 0
        out.append(tok)
        s.penalties.push(tok)


def test_min_p_cuts_unlikely_tokens():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    s = Sampler(1.0, seed=0, min_p=0.25)            # keep p >= 0.125: tokens 0 and 1
    got = {s(logits) for _ in range(300)}
    assert got == {0, 1}
    assert Sampler(1.0, seed=0).penalties is None    # off: nothing counted per token


def test_no_penalties_no_state():
    s = Sampler(0.0, min_p=0.5)
    assert s.penalties is None
    x = np.array([0.1, 2.0, 1.0], np.float32)
    assert s(x) == 1


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                dict(repetition_penalty=0), dict(repetition_penalty=11),
                                dict(min_p=-0.1), dict(min_p=float("nan"))])
def test_bad_values_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Sampler(1.0, **kw)


# ----------------------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def eng(tiny_model_dir):
    e = Engine.from_model_dir(tiny_model_dir)
    yield e
    e.close()


@pytest.mark.parametrize("pen", PEN)
def test_engine_greedy_with_penalties_is_reference_argmax(eng, pen):
    prompt = [4, 5, 6, 4, 5]
    g = eng.generate(prompt, max_new_tokens=10, temperature=0, **_kw(pen)).run()
    ids, out = list(prompt), []
    for t in g.token_ids:
        logits = eng.next_token_logits(ids)
        assert t == int(np.argmax(ref_penalize(logits, prompt, out, **pen)))
        ids.append(t)
        out.append(t)
    plain = eng.generate(prompt, max_new_tokens=10, temperature=0).run().token_ids
    if pen.get("repetition", 1.0) > 1.5 or pen.get("presence", 0) > 1:
        assert g.token_ids != plain        # strong penalties change a greedy run here


def test_engine_refuses_bad_penalty(eng):
    with pytest.raises(RequestError, match="repetition_penalty"):
        eng.generate([1, 2], max_new_tokens=2, repetition_penalty=-1)


def test_penalties_alone_equal_batched(eng):
    """Penalties are per sequence: four requests run together get their solo tokens."""
    specs = [dict(prompt=[7, 8, 9], temperature=0, **_kw(p)) for p in PEN[:3]] + \
        [dict(prompt=[7, 8, 9], temperature=0.8, seed=3, min_p=0.1, **_kw(PEN[4]))]
    alone = [eng.generate(max_new_tokens=12, **s).run().token_ids for s in specs]
    got = [None] * len(specs)
    barrier = threading.Barrier(len(specs))

    def run(i):
        barrier.wait()
        got[i] = eng.generate(max_new_tokens=12, **specs[i]).run().token_ids
    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == alone
    assert len({tuple(a) for a in alone}) > 1
