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

def _read(fmt: str, pieces, names=("f", "g")):
    """(content, [(name, arguments text)]) of an answer read piece by piece."""
    from colibri_core.runtime.events import TokenEvent
    from colibri_core.server.toolstream import CallReader
    rd = CallReader(fmt, set(names), None)
    outs = [rd.push(TokenEvent(i, i, p, 0, "x")) for i, p in enumerate(pieces)]
    outs.append(rd.finish())
    calls: dict = {}
    for o in outs:
        for d in o.calls:
            c = calls.setdefault(d["index"], ["", ""])
            c[0] += d["function"].get("name", "")
            c[1] += d["function"]["arguments"]
    return "".join(o.content for o in outs), [tuple(calls[i]) for i in sorted(calls)]


def test_tool_call_parsers():
    h = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert _read("hermes", ["x" + h]) == ("x", [("f", '{"a": 1}'), ("g", "{}")])
    cut = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    assert _read("hermes", [cut]) == ("", [("f", "{}")])
    ll = '<|python_tag|>{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}'
    assert _read("llama3", [ll]) == ("", [("f", '{"a": 2}'), ("g", "{}")])
    m = '[TOOL_CALLS][{"name": "g", "arguments": {"b": "x"}}]'
    assert _read("mistral", [m]) == ("", [("g", '{"b": "x"}')])
    bad = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert _read("hermes", [bad]) == (bad, [])
    assert _read("mistral", ["[TOOL_CALLS] not json"]) == ("[TOOL_CALLS] not json", [])
    # arguments first: read whole when the object closes
    assert _read("hermes", ['<tool_call>{"arguments": {"z": [1]}, "name": "g"}</tool_call>']) \
        == ("", [("g", '{"z": [1]}')])


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


def test_call_arguments_stream_as_they_are_written():
    """Every format: a call's first delta (index, id, name) as soon as its name and the
    start of its arguments are read, then its arguments fragment by fragment as the pieces arrive (never more than was
    written); text before is content; a second call cut short at the end keeps what was
    sent of it."""
    from colibri_core.runtime.events import TokenEvent
    from colibri_core.server.toolstream import CallReader
    args = '{"city": "Paris", "n": [1, {"x": "}"}]}'
    whole = {"hermes": f'Sure. <tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
                       f'\n<tool_call>\n{{"name": "g", "arguments": {{"k": 1',
             "llama3": f'{{"name": "f", "parameters": {args}}}; {{"name": "g", "parameters": '
                       f'{{"k": 1',
             "mistral": f'Sure. [TOOL_CALLS][{{"name": "f", "arguments": {args}}}, {{"name": "g", '
                        f'"arguments": {{"k": 1'}
    for fmt, text in whole.items():
        rd = CallReader(fmt, {"f", "g"}, None)
        sent, first_at = {0: "", 1: ""}, {}
        content = ""
        for i in range(len(text)):                     # one character a token
            o = rd.push(TokenEvent(i, i, text[i], 0, "x"))
            content += o.content
            for d in o.calls:
                if "id" in d:
                    first_at[d["index"]] = i
                    assert d["function"]["name"] in "fg" and d["id"].startswith("call_")
                sent[d["index"]] += d["function"]["arguments"]
            # what was sent of the first call is always a prefix of its arguments, and
            # it is all of them, written so far, once the call is past them
            assert args.startswith(sent[0])
        assert rd.finish().content == ""
        assert content == ("" if fmt == "llama3" else "Sure. ")
        assert sent == {0: args, 1: '{"k": 1'}, fmt
        assert text.index('"name": "f"') < first_at[0] < text.index(args) + 1
        assert rd.called


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
