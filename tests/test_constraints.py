"""Constrained decoding without a server (runtime/constraints.py, the Sampler's hook):
the mask against the vocabulary read in Python, greedy and sampled output that parses,
no work at all for a sampler without a grammar, and the tool-call parsers."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")

from colibri_core.runtime.constraints import Grammar, GrammarError  # noqa: E402
from colibri_core.runtime.sampler import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def eng():
    from colibri_core.engine import Engine
    with Engine.from_config("builtin") as e:
        yield e


def _sampler(eng, **kw):
    return SamplingParams(**kw).sampler(eng.model_cfg.eos_token_ids, eng.tokenizer,
                                        eng.model_cfg.vocab_size)


def test_first_mask_is_the_vocabulary_read_in_python(eng):
    """`root ::= "yes" | "no"`: the first token may be any token whose text starts one of
    the two words (read from the vocabulary here, token by token)."""
    s = _sampler(eng, temperature=0.0, grammar=Grammar.gbnf('root ::= "yes" | "no"'))
    V = eng.model_cfg.vocab_size
    masked = s.constraint.masked(np.zeros(V, np.float32))
    got = set(np.flatnonzero(np.isfinite(masked)).tolist())
    want = set()
    for t in range(V):
        text = eng.tokenizer._tok.decode([t], skip_special_tokens=False)
        if text and t not in eng.tokenizer.special_ids and \
                ("yes".startswith(text) or "no".startswith(text)):
            want.add(t)
    assert want and got == want


def test_masked_logits_keep_the_allowed_values_exactly(eng):
    s = _sampler(eng, grammar=Grammar.regex("[0-9]{2,4}"))
    x = np.random.default_rng(0).standard_normal(eng.model_cfg.vocab_size).astype(np.float32)
    m = s.constraint.masked(x)
    keep = np.isfinite(m)
    assert 0 < keep.sum() < x.size
    assert np.array_equal(m[keep], x[keep]) and np.all(m[~keep] == -np.inf)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generation_matches_a_schema(eng, temperature):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
        "required": ["name", "n", "kind", "ok"], "additionalProperties": False}
    for seed in range(3):
        g = eng.generate("A record:", max_new_tokens=120, sampling=SamplingParams(
            temperature=temperature, seed=seed, grammar=Grammar.json_schema(schema)))
        g.run()
        obj = json.loads(g.text)
        assert g.stop_reason == "eos" and set(obj) == {"name", "n", "kind", "ok"}
        assert len(obj["name"]) <= 10 and 0 <= obj["n"] <= 999 and obj["kind"] in "ab"


def test_without_grammar_the_text_does_not_parse(eng):
    """The same prompt free: the built-in model writes prose (what the grammar prevents)."""
    g = eng.generate("A record:", max_new_tokens=40, sampling=SamplingParams(temperature=0.0))
    g.run()
    with pytest.raises(ValueError):
        json.loads(g.text)


def test_gbnf_output_matches_its_regex(eng):
    gb = 'root ::= ("yes" | "no") " " [0-9] [0-9]? "!"'
    for seed in range(4):
        g = eng.generate("Answer:", max_new_tokens=20, sampling=SamplingParams(
            temperature=1.0, seed=seed, grammar=Grammar.gbnf(gb)))
        g.run()
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?!", g.text), g.text


def test_greedy_with_grammar_is_the_masked_argmax(eng):
    """Greedy under a grammar = arg-max over the allowed tokens (numpy), token by token."""
    gram = Grammar.regex("[a-z ]{1,30}\\.")
    s = _sampler(eng, temperature=0.0, grammar=gram)
    ref = _sampler(eng, temperature=0.0, grammar=gram)
    rng = np.random.default_rng(1)
    for _ in range(12):
        x = rng.standard_normal(eng.model_cfg.vocab_size).astype(np.float32)
        allowed = np.isfinite(ref.constraint.masked(x))
        want = int(np.flatnonzero(allowed)[np.argmax(x[allowed])])
        got = s(x)
        assert got == want
        ref.constraint.advance(got)


def test_no_grammar_no_constraint(eng):
    s = _sampler(eng, temperature=0.0)
    assert s.constraint is None


@pytest.mark.parametrize("make, arg", [
    (Grammar.json_schema, {"type": "string", "format": "no-such-format"}),
    (Grammar.gbnf, "root ::= missing"),
    (Grammar.json_schema, [1, 2]),
    (Grammar.regex, "(unclosed"),
])
def test_bad_grammars_are_one_line_errors(make, arg):
    with pytest.raises(GrammarError) as e:
        make(arg)
    assert "\n" not in str(e.value) and str(e.value)


def test_ignore_eos_with_a_grammar_is_refused(eng):
    with pytest.raises(ValueError, match="ignore_eos"):
        _sampler(eng, ignore_eos=True, grammar=Grammar.json_object())


# ----------------------------------------------------------------------------- tool calls

def test_tool_call_parsers():
    from colibri_core.server.tools import parse_calls
    names = {"f", "g"}
    h = 'x<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    calls = parse_calls(h[1:], "hermes", names)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"a": 1}), ("g", {})]
    cut = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    assert len(parse_calls(cut, "hermes", names)) == 1
    ll = '<|python_tag|>{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}'
    assert [c["function"]["name"] for c in parse_calls(ll, "llama3", names)] == ["f", "g"]
    m = '[TOOL_CALLS][{"name": "g", "arguments": {"b": "x"}}]'
    assert json.loads(parse_calls(m, "mistral", names)[0]["function"]["arguments"]) == {"b": "x"}
    assert parse_calls('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                       "hermes", names) is None
    assert parse_calls("[TOOL_CALLS] not json", "mistral", names) is None


def test_speculative_decoding_under_a_grammar_gives_the_same_tokens(eng):
    """Draft tokens (prompt lookup) are sampled row by row through the same matcher: the
    greedy answer is the plain one, with drafts accepted."""
    from colibri_core.engine import Engine
    spec = Engine(eng.model_dir, eng.config.model_copy(
        update={"speculative_decoding": "prompt_lookup"}))
    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"enum": ["alpha", "beta"]},
                                         "id": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["name", "id"], "additionalProperties": False}}
    prompt = 'Records: [{"name": "alpha", "id": 1}, {"name": "beta", "id": 2}]. Again:'
    try:
        outs = []
        for e in (eng, spec):
            g = e.generate(prompt, max_new_tokens=150, sampling=SamplingParams(
                temperature=0, grammar=Grammar.json_schema(schema)))
            g.run()
            outs.append((g.token_ids, g.speculation["accepted"]))
        assert outs[0][0] == outs[1][0] and len(json.loads(g.text)) == 6
        assert outs[1][1] > 0
    finally:
        spec.close()


def test_hermes_calls_stream_as_each_block_closes():
    """Each <tool_call> block is handed out when its closing tag arrives, with running
    indexes; text before is content; a block cut short at the end is dropped."""
    from colibri_core.runtime.events import TokenEvent
    from colibri_core.server.tools import ToolState
    st = ToolState("hermes", {"f", "g"}, None)
    pieces = ['Sure. <tool', '_call>\n{"name": "f", "argu', 'ments": {}}\n</tool_call>',
              '\n<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>\n<tool_ca',
              'll>\n{"name": "f"']
    content, got = "", []
    for i, p in enumerate(pieces):
        content += st.push(TokenEvent(i, i, p, 0, "x"))
        got.append([c["function"]["name"] for c in st.take_calls()])
    rest, last = st.finish()
    assert content == "Sure. " and got == [[], [], ["f"], ["g"], []]
    assert rest == "" and last == [] and st.sent == 2


def test_a_sample_plugin_stays_within_the_grammar():
    """A colibri_sample plugin that always answers one token: where the grammar allows it,
    it is taken (and the matcher advances on it); where it does not, the sampler picks
    among the grammar's tokens, and the output still matches."""
    from colibri_core.engine import Engine
    from colibri_core.hookspecs import hookimpl
    with Engine.from_config("builtin") as e:
        seven = e.tokenizer.encode("7")[-1]

        class AlwaysSeven:
            @hookimpl
            def colibri_sample(self, logits, request):
                return seven
        e.register_plugin(AlwaysSeven())
        g = e.generate("n:", max_new_tokens=12, sampling=SamplingParams(
            temperature=0.0, grammar=Grammar.regex("[0-9]{3}x")))
        g.run()
        assert g.text == "777x" and g.stop_reason == "eos"
