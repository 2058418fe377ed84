"""Pieces of `colibri serve` without a server: chat templates against transformers'
apply_chat_template, the sampler's top-k and logit bias against numpy, stop strings
held back across tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_core.runtime.sampler import Sampler
from colibri_core.server.chat import ChatTemplate
from colibri_core.server.errors import ApiError
from colibri_core.runtime.stops import StopCutter

# Three templates written for this test, each using what checkpoints' templates use:
# role markers with add_generation_prompt, a system-message split with loop controls,
# raise_exception on a bad conversation, tojson with options, strftime_now, bos_token,
# namespace(), whitespace control under trim_blocks/lstrip_blocks.
TEMPLATES = {
    "markers": (
        "{% for m in messages %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "alternating": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}"
        "    {% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
        "{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}\n"
        "{% for m in rest %}\n"
        "    {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{ raise_exception('roles must alternate user/assistant') }}\n"
        "    {% endif %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "[INST] {% if loop.first and sys %}<<SYS>>{{ sys }}<</SYS>> {% endif %}"
        "{{ m['content'] }} [/INST]\n"
        "    {% else %}\n"
        " {{ m['content'] }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}"),
    "json-and-dates": (
        "{%- set ns = namespace(n=0) -%}\n"
        "Year {{ strftime_now('%Y') }}.\n"
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "{{ ns.n }}. {{ {'role': m['role'], 'text': m['content']} | tojson(sort_keys=True) }}\n"
        "{% endfor %}\n"
        "{{ messages | map(attribute='role') | list | tojson(indent=2) }}\n"
        "{%- if add_generation_prompt %}\nnext:{% endif %}"),
}

CONVERSATION = [
    {"role": "system", "content": "Be brief. Ünïcode stays: 日本"},
    {"role": "user", "content": "  What is a list? "},
    {"role": "assistant", "content": "A sequence."},
    {"role": "user", "content": "And a tuple \"quoted\"?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from colibri_core.config import builtin_model_dir
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(builtin_model_dir() / "tokenizer.json"),
        bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_renders_as_transformers(hf_tokenizer, name, gen_prompt):
    src = TEMPLATES[name]
    want = hf_tokenizer.apply_chat_template(CONVERSATION, chat_template=src, tokenize=False,
                                            add_generation_prompt=gen_prompt)
    got = ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        CONVERSATION, add_generation_prompt=gen_prompt)
    assert got == want


def test_raise_exception_is_a_400():
    t = ChatTemplate(TEMPLATES["alternating"], {"bos_token": "", "eos_token": ""})
    with pytest.raises(ApiError) as e:
        t.render([{"role": "assistant", "content": "first"}])
    assert e.value.status == 400 and "alternate" in e.value.message


def test_the_sandbox_holds():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError) as e:
        t.render([{"role": "user", "content": "x"}])
    assert e.value.status == 400


def test_template_sources(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<B>"},
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "<B>D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": ""}]) == "J1"


def test_builtin_model_has_a_template():
    from colibri_core.config import builtin_model_dir
    t = ChatTemplate.from_model_dir(builtin_model_dir())
    out = t.render([{"role": "user", "content": "What is a dict?"}])
    assert out == "user: What is a dict?\nassistant:"


def _probs(logits, temperature, top_k, bias):
    z = np.array(logits, np.float64)
    for t, b in bias.items():
        z[t] += b
    z /= temperature
    if top_k:
        kth = np.sort(z)[-top_k]
        z[z < kth] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def test_sampler_top_k_and_logit_bias_follow_the_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=16).astype(np.float32)
    bias = {3: 2.5, 7: -100.0}
    s = Sampler(temperature=0.8, top_p=1.0, seed=1, top_k=4, logit_bias=bias)
    n = 20000
    counts = np.bincount([s(logits) for _ in range(n)], minlength=16) / n
    want = _probs(logits, 0.8, 4, bias)
    assert np.count_nonzero(counts) == 4
    assert np.abs(counts - want).max() < 0.02
    greedy = Sampler(temperature=0.0, logit_bias={5: 100.0})
    assert greedy(logits) == 5
    with pytest.raises(ValueError):
        Sampler(top_k=-1)


def test_stop_strings_never_leak_across_tokens():
    c = StopCutter(["END"])
    pieces = ["ab", "cE", "N", "D", "tail"]
    out = []
    for p in pieces:
        text, hit = c.push(p)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abc" and hit
    c = StopCutter(["END"])
    out = [c.push(p)[0] for p in ["ab", "E", "Nx"]]
    assert "".join(out) == "abENx"
    assert c.finish("!") == "!"
    c = StopCutter(["xyz"])
    assert c.push("aaxy")[0] == "aa"
    assert c.finish("") == "xy"                # the end came first: held text is sent


def test_engine_errors_map_to_openai_errors():
    from colibri_core.errors import ModelFormatError, RequestError
    from colibri_core.experts.hotplug.errors import ExpertSecurityError, RollbackError
    from colibri_core.server.errors import from_exception
    cases = [(RequestError("token id 5000 out of range 0..1023"), 400, "invalid_request_error"),
             (RollbackError("expert 'x' is not active: nothing to roll back"), 404, None),
             (RollbackError("expert 'x' has no previous version to roll back to"), 409, None),
             (ExpertSecurityError("f.so: sha256 ab is not on the allowlist",
                                  reason="allowlist"), 400, None),
             (ModelFormatError("m: the model produced no finite logit"), 500, "server_error"),
             (KeyError("boom"), 500, "server_error")]
    for exc, status, kind in cases:
        err = from_exception(exc, "req-1")
        assert err.status == status, exc
        assert kind is None or err.type == kind
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    internal = from_exception(KeyError("secret detail"), "req-9")
    assert "req-9" in internal.message and "secret detail" not in internal.message
