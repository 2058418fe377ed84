"""Self-speculative decoding (speculative.py, decode.Decode, the scheduler's drafts):
the acceptance rule computed exactly on small distributions, the prompt-lookup draft,
the verify pass's logits bit-identical to sequential decoding, and the output of every
request path identical to plain decoding's (greedy and seeded sampling, batched,
stop strings, max_new_tokens, EOS, the context's end, the token hooks)."""
import threading

import numpy as np
import pytest

from colibri_core.config import EngineConfig, builtin_model_dir, parse
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl
from colibri_core.runtime.sampler import Sampler
from colibri_core.runtime.speculative import PromptLookup, speculative_choice
from colibri_core.model.testing import write_random_model

SPEC = dict(speculative_decoding="prompt_lookup", draft_tokens=4)


# ----------------------------------------------------------------------------- the rule

def _pieces(points):
    """Midpoints and lengths of the intervals [0, 1) is cut into at `points`."""
    cuts = np.unique(np.concatenate([[0.0, 1.0], np.clip(points, 0, 1)]))
    return (cuts[:-1] + cuts[1:]) / 2, np.diff(cuts)


def output_distribution(p, q, x):
    """P(token | draft x) under speculative_choice, integrated over u and v exactly: the
    rule is piecewise constant in u (cut at p(x)/q(x)) and in v (cut at the residual's
    cumulative sums); a grid of 1/1024 is added to both, so a rule cut elsewhere is
    still measured. The residual draw is integrated at the first and the last rejected
    u, which must agree."""
    grid = np.arange(1, 1024) / 1024
    r = np.maximum(p - q, 0)
    us, du = _pieces(np.concatenate([[p[x] / q[x]], grid]))
    vs, dv = _pieces(np.concatenate([np.cumsum(r) / max(r.sum(), 1e-300), grid]))
    out = np.zeros(len(p))
    rejected = []
    for u, wu in zip(us, du):
        tok, accepted = speculative_choice(p, q, x, u, 0.5)
        if accepted:
            assert tok == x
            out[tok] += wu
        else:
            rejected.append((u, wu))
    if rejected:
        resid = []
        for u in (rejected[0][0], rejected[-1][0]):
            d = np.zeros(len(p))
            for v, wv in zip(vs, dv):
                tok, acc = speculative_choice(p, q, x, u, v)
                assert not acc
                d[tok] += wv
            resid.append(d)
        assert np.array_equal(resid[0], resid[1])
        out += sum(w for _, w in rejected) * resid[0]
    return out


CASES = [
    ([0.5, 0.3, 0.2], [0.2, 0.3, 0.5]),
    ([0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]),          # q covers a token p excludes
    ([0.7, 0.3, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]),              # p has mass q never drafts
    ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5]),                    # q == p: always accepted
    ([0.05, 0.9, 0.05], [0.0, 0.0, 1.0]),                      # deterministic draft
]


@pytest.mark.parametrize("p,q", CASES)
def test_speculative_choice_gives_the_target_distribution_exactly(p, q):
    p, q = np.array(p), np.array(q)
    total = np.zeros(len(p))
    for x in np.flatnonzero(q):                                # the draft token x ~ q
        total += q[x] * output_distribution(p, q, x)
    np.testing.assert_allclose(total, p, atol=1e-12)
    if np.array_equal(p, q):                                   # nothing is ever rejected
        for x in np.flatnonzero(q):
            assert output_distribution(p, q, x)[x] == pytest.approx(1.0, abs=1e-12)


def test_one_hot_draft_is_sample_and_compare():
    """For a deterministic draft the rule accepts x with probability p(x) and otherwise
    draws from p without x: the distribution of "sample y ~ p, keep x iff y == x", which
    is what decode.Decode does with the request's own sampler."""
    p = np.array([0.1, 0.45, 0.05, 0.4])
    for x in range(4):
        q = np.eye(4)[x]
        got = output_distribution(p, q, x)
        np.testing.assert_allclose(got, p, atol=1e-12)                 # y ~ p
        tok, acc = speculative_choice(p, q, x, np.nextafter(p[x], 0), 0.5)
        assert acc and tok == x                                        # P(accept) = p(x)
        tok, acc = speculative_choice(p, q, x, p[x], 0.5)
        assert not acc and tok != x


def test_two_rounds_compose_to_the_joint_distribution():
    """Two draft positions from a draft model q(.|prev) verified against a target
    p(.|prev) (V = 3, explicit tables): the first two emitted tokens are distributed as
    p(a) p(b | a), enumerated exactly over the draft's tokens and the uniforms."""
    p1 = np.array([0.6, 0.3, 0.1])
    p2 = np.array([[0.2, 0.2, 0.6], [0.5, 0.25, 0.25], [0.1, 0.8, 0.1]])
    q1 = np.array([0.3, 0.3, 0.4])
    q2 = np.array([[0.6, 0.2, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]])
    joint = np.zeros((3, 3))
    for d1 in range(3):                                      # the draft's first token
        first = output_distribution(p1, q1, d1)
        for a in range(3):
            if a != d1:                                      # rejected: a plain next step
                joint[a] += q1[d1] * first[a] * p2[a]
                continue
            for d2 in range(3):                              # accepted: verify d2 | d1
                joint[a] += q1[d1] * first[a] * q2[d1, d2] * output_distribution(p2[d1], q2[d1], d2)
    np.testing.assert_allclose(joint, p1[:, None] * p2, atol=1e-12)


def test_zero_draft_probability_is_refused():
    with pytest.raises(ValueError, match="probability 0"):
        speculative_choice(np.array([0.5, 0.5]), np.array([1.0, 0.0]), 1, 0.1, 0.1)


# ------------------------------------------------------------------ the prompt lookup

def test_prompt_lookup_drafts_the_latest_longest_match():
    d = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], ngram_max=3, ngram_min=1)
    assert d.draft(2) == [9, 2]                   # (6, 7): its latest earlier occurrence
    d.push(8)                                     # ... 6 7 8: the 3-gram of the start wins
    assert d.draft(3) == [1, 6, 7]
    assert d.draft(0) == []
    assert PromptLookup([1, 2, 3, 4]).draft(4) == []          # nothing repeats
    assert PromptLookup([3]).draft(4) == []


def test_prompt_lookup_continues_a_loop_periodically():
    d = PromptLookup([4, 1, 2, 1, 2], ngram_max=2, ngram_min=2)
    assert d.draft(5) == [1, 2, 1, 2, 1]
    d = PromptLookup([9, 9, 9], ngram_max=3, ngram_min=1)
    assert d.draft(3) == [9, 9, 9]


def test_prompt_lookup_argument_check():
    with pytest.raises(ValueError, match="ngram_min"):
        PromptLookup([1], ngram_max=1, ngram_min=2)


# ------------------------------------------------------- verification is bit-identical

@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec") / "m"
    write_random_model(d, seed=3, vocab=96, context=96)
    return d


@pytest.mark.parametrize("kv_dtype", ["f32", "q8"])
@pytest.mark.parametrize("which", ["builtin", "moe"])
def test_verify_rows_equal_sequential_decoding_and_truncate_rolls_back(which, kv_dtype, moe_dir):
    d = builtin_model_dir() if which == "builtin" else moe_dir
    with Engine(d, EngineConfig(kv_dtype=kv_dtype)) as eng:
        m = eng.model
        rng = np.random.default_rng(1)
        prompt = rng.integers(1, 90, 12)
        seq = m.new_cache(64)
        m.forward([prompt], [seq])
        toks = [int(t) for t in rng.integers(1, 90, 6)]
        want = [m.decode_step(t, seq, m.cfg.top_k).copy() for t in toks]
        spec = m.new_cache(64)
        m.forward([prompt], [spec])
        # the decode token and 3 draft tokens, beside another sequence's prompt chunk
        other = m.new_cache(64)
        rows, _ = m.forward([np.array(toks[:4]), prompt], [spec, other],
                            all_logits=[True, False])
        assert rows.shape == (4, m.cfg.vocab_size)
        for i in range(4):
            assert np.array_equal(rows[i], want[i])
        spec.truncate(len(prompt) + 2)             # draft rejected after its first token
        again = m.forward([np.array(toks[2:])], [spec], all_logits=True)[0]
        for i, t in enumerate(range(2, 6)):
            assert np.array_equal(again[i], want[t])


# ------------------------------------------------------------- end to end, every path

class TokenLog:
    def __init__(self):
        self.seen = []

    @hookimpl
    def colibri_token(self, request_id, step, token_id, text, expert_set_generation,
                      expert_set_id):
        self.seen.append((request_id, step, token_id, text))


def _runs(d, prompts, settings, **gen):
    """(token ids, text, stop reason, token-hook log) of each prompt, run concurrently
    (one thread each: their decodes share steps), with and without speculation."""
    out = {}
    for mode in ("off", "prompt_lookup"):
        cfg = {**settings, **(SPEC if mode != "off" else {})}
        with Engine(d, EngineConfig(**cfg)) as eng:
            log = TokenLog()
            eng.register_plugin(log)
            gens = [eng.generate(p, request_id=f"r{i}", **gen) for i, p in enumerate(prompts)]
            ts = [threading.Thread(target=g.run) for g in gens]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out[mode] = ([(g.token_ids, g.text, g.stop_reason) for g in gens],
                         sorted(log.seen), [g.speculation for g in gens])
    return out


LOOPY = [[5, 6, 7, 8] * 4, [11, 3, 11, 3, 11, 3, 9], [20, 21, 22, 23, 24, 25], [7] * 9]


def _check(out):
    assert out["off"][0] == out["prompt_lookup"][0]
    assert out["off"][1] == out["prompt_lookup"][1]          # the hooks saw every token
    spec = out["prompt_lookup"][2]
    assert sum(s["accepted"] for s in spec) > 0               # drafts were kept ...
    assert sum(s["drafted"] - s["accepted"] for s in spec) > 0   # ... and rejected


def test_greedy_identical_batched_random_moe(moe_dir):
    _check(_runs(moe_dir, LOOPY, {}, max_new_tokens=40, temperature=0))


def test_greedy_identical_builtin_text_and_stop_strings():
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "The cat sat on the mat. The cat",
               "1, 2, 3, 4, 5, 6, 7,", "Once upon a time"]
    d = builtin_model_dir()
    _check(_runs(d, prompts, {}, max_new_tokens=48, temperature=0))
    out = _runs(d, prompts, {}, max_new_tokens=48, temperature=0, stop=["\n\n", "an"])
    assert out["off"][0] == out["prompt_lookup"][0]
    assert any(r == "stop" for _, _, r in out["off"][0][0:4])


def test_seeded_sampling_identical(moe_dir):
    """The request's own sampler is called once per emitted token, on the logits plain
    decoding has: the same seed gives the same tokens (temperature, top-p, top-k,
    logit bias)."""
    for kw in (dict(temperature=0.2, seed=3), dict(temperature=1.3, top_p=0.8, seed=11)):
        out = _runs(moe_dir, LOOPY, {}, max_new_tokens=40, **kw)
        assert out["off"][:2] == out["prompt_lookup"][:2]
        if kw["temperature"] < 1:
            _check(out)
    out = {}
    for mode in ("off", "prompt_lookup"):
        with Engine(moe_dir, EngineConfig(**(SPEC if mode != "off" else {}))) as eng:
            got = []
            for i, p in enumerate(LOOPY):
                s = Sampler(0.5, 0.9, seed=i, top_k=5, logit_bias={7: 2.0, 8: -1.5})
                got.append(eng.generate(p, max_new_tokens=30, sampler=s).run().token_ids)
            out[mode] = got
    assert out["off"] == out["prompt_lookup"]


def test_max_tokens_eos_and_context_end(moe_dir):
    for n in (1, 2, 3, 7):
        out = _runs(moe_dir, LOOPY, {}, max_new_tokens=n, temperature=0)
        assert out["off"][0] == out["prompt_lookup"][0]
        assert all(len(ids) == n for ids, _, _ in out["prompt_lookup"][0])
    # EOS decided by the sampler at its 6th call: a draft's later rows are not emitted
    out = {}
    for mode in ("off", "prompt_lookup"):
        with Engine(moe_dir, EngineConfig(**(SPEC if mode != "off" else {}))) as eng:
            eos = eng.model_cfg.eos_token_ids[0]
            calls = []

            def sample(logits):
                calls.append(1)
                return eos if len(calls) == 6 else int(np.argmax(logits))
            g = eng.generate(LOOPY[0], max_new_tokens=30, sampler=sample).run()
            out[mode] = (g.token_ids, g.stop_reason, len(calls))
    assert out["off"] == out["prompt_lookup"] and out["off"][1] == "eos"
    assert len(out["off"][0]) == 5 and out["off"][2] == 6
    # the context's end (96 positions): a draft never runs past it
    long = (LOOPY[0] * 6)[:86]
    no_eos = Sampler(0.0, logit_bias={95: -1e30})             # greedy, EOS (95) never
    out = _runs(moe_dir, [long], {}, max_new_tokens=50, sampler=no_eos)
    assert out["off"][0] == out["prompt_lookup"][0]
    assert out["off"][0][0][2] == "context"


def test_small_step_budget_and_kv_follow_the_tokens(moe_dir):
    """max_step_tokens smaller than the drafts: each sequence drafts what the step has
    left; between steps every stream's cache holds its prompt and all its emitted tokens
    but the last (rejected drafts cut away)."""
    out = _runs(moe_dir, LOOPY, {"max_step_tokens": 5}, max_new_tokens=30, temperature=0)
    assert out["off"][0] == out["prompt_lookup"][0]
    with Engine(moe_dir, EngineConfig(**SPEC)) as eng:
        bad = []

        def check(step):
            for j in eng.scheduler._running:
                if j.cache is not None and j.fed >= len(j.tokens) and j.step:
                    if j.cache.length != len(j.tokens) + j.step - 1:
                        bad.append((step, j.cache.length, len(j.tokens), j.step))
        eng.scheduler.step_hook = check
        gens = [eng.generate(p, max_new_tokens=30, temperature=0) for p in LOOPY]
        ts = [threading.Thread(target=g.run) for g in gens]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not bad
        assert sum(g.speculation["accepted"] for g in gens) > 0


def test_async_streaming(moe_dir):
    """Streaming (async iteration) with speculation gives the tokens of plain decoding."""
    import asyncio

    async def stream(eng):
        return [ev.token_id async for ev in eng.generate(LOOPY[1], max_new_tokens=25,
                                                         temperature=0)]
    got = {}
    for mode in ("off", "prompt_lookup"):
        with Engine(moe_dir, EngineConfig(**(SPEC if mode != "off" else {}))) as eng:
            got[mode] = asyncio.run(stream(eng))
    assert got["off"] == got["prompt_lookup"] and len(got["off"]) == 25


def test_server_with_speculative_decoding(tmp_path):
    """`colibri serve --speculative-decoding prompt_lookup`: completions (two prompts
    batched, log-probs) equal the plain engine's in this process."""
    import httpx
    from server_helpers import LiveServer
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "The cat sat on the mat. The cat"]
    srv = LiveServer("--speculative-decoding", "prompt_lookup", "--draft-tokens", "3",
                     experts_dir=tmp_path)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "builtin", "prompt": prompts, "max_tokens": 24, "temperature": 0,
            "logprobs": 2}).json()
    finally:
        srv.stop()
    with Engine.from_config("builtin") as eng:
        for c, p in zip(r["choices"], prompts):
            g = eng.generate(p, max_new_tokens=24, temperature=0).run()
            assert c["text"] == g.text
            assert len(c["logprobs"]["tokens"]) == 24


def test_settings():
    cfg = parse(EngineConfig, {"speculative_decoding": "prompt_lookup", "draft_tokens": 6},
                "test")
    assert cfg.speculative_decoding == "prompt_lookup" and cfg.residency.speculative is False
    with pytest.raises(ConfigError, match="speculative_decoding"):
        parse(EngineConfig, {"speculative_decoding": "yes"}, "x.yaml")
    with pytest.raises(ConfigError, match="draft_ngram_min=4 exceeds"):
        parse(EngineConfig, {"draft_ngram_min": 4, "draft_ngram_max": 2}, "x.yaml")
    assert EngineConfig().speculative_decoding == "off"
