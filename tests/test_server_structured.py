"""Structured output against a live `colibri serve` (issue 36 item 1) with the `openai`
client: `chat.completions.parse` with a pydantic model, json_schema and json_object
response formats, llama-server's `grammar` and `json_schema`, with streaming, `n`, stop
strings and concurrent requests; bad schemas are a 400 naming the field. The built-in
model writes prose: every answer parsing and validating is the grammar's doing."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
from pydantic import BaseModel, Field  # noqa: E402

from server_helpers import LiveServer  # noqa: E402


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    active: bool


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                          "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LiveServer(experts_dir=tmp_path_factory.mktemp("experts"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


MSG = [{"role": "user", "content": "Describe a person."}]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_parse_with_a_pydantic_model(client, temperature, seed):
    r = client.chat.completions.parse(model="builtin", messages=MSG, response_format=Person,
                                      max_completion_tokens=200, temperature=temperature,
                                      seed=seed)
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert isinstance(ch.message.parsed, Person)
    assert Person.model_validate_json(ch.message.content) == ch.message.parsed


def test_json_schema_streamed_with_n(client):
    stream = client.chat.completions.create(
        model="builtin", messages=MSG, n=3, temperature=0.9, seed=5, stream=True,
        max_completion_tokens=100, response_format={"type": "json_schema", "json_schema": {
            "name": "trip", "schema": SCHEMA, "strict": True}})
    texts, finish = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    for t in texts.values():
        obj = json.loads(t)
        assert set(obj) == {"city", "days"} and 1 <= obj["days"] <= 9
        assert len(obj["city"]) <= 16


def test_json_object(client):
    """Any JSON object; a bias on the quote and brace tokens keeps the built-in model's
    strings short (the grammar still decides what may come)."""
    tok = httpx.post(client.base_url.join("/tokenize").__str__().replace("/v1/", "/"),
                     json={"content": '"}'}).json()["tokens"]
    r = client.chat.completions.create(
        model="builtin", messages=MSG, response_format={"type": "json_object"},
        max_completion_tokens=200, temperature=0.7, seed=3,
        logit_bias={str(t): 8 for t in tok})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_stop_string_cuts_inside_the_grammar(client):
    """A stop string applies to the constrained answer as to any: cut before it."""
    r = client.chat.completions.create(
        model="builtin", messages=MSG, max_completion_tokens=100, temperature=0,
        stop=['"days"'], response_format={"type": "json_schema", "json_schema": {
            "name": "trip", "schema": SCHEMA}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert text.startswith('{"city": "') and text.endswith(", ") and '"days"' not in text


def test_llama_server_grammar_and_json_schema_on_completions(server):
    gb = 'root ::= ("yes" | "no") ", " [0-9] [0-9]? "."'
    for seed in range(3):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "Is it?", "max_tokens": 20, "temperature": 1.0, "seed": seed,
            "grammar": gb}).json()
        assert re.fullmatch(r"(yes|no), [0-9][0-9]?\.", r["choices"][0]["text"]), r
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Trip:", "max_tokens": 60, "temperature": 0, "json_schema": SCHEMA}).json()
    assert set(json.loads(r["choices"][0]["text"])) == {"city", "days"}


def test_vllm_guided_fields(server):
    url = server.url + "/v1/completions"
    choices = ["café au lait", 'say "hi"', "plain tea"]
    seen = set()
    for seed in range(6):
        r = httpx.post(url, timeout=60, json={"prompt": "Pick:", "max_tokens": 20, "seed": seed,
                                              "guided_choice": choices}).json()
        seen.add(r["choices"][0]["text"])
    assert seen <= set(choices) and len(seen) > 1
    r = httpx.post(url, timeout=60, json={"prompt": "Code:", "max_tokens": 20, "seed": 1,
                                          "guided_regex": "[A-Z]{3}-[0-9]{2}"}).json()
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r["choices"][0]["text"])
    r = httpx.post(url, timeout=60, json={"prompt": "Trip:", "max_tokens": 60, "temperature": 0,
                                          "guided_json": json.dumps(SCHEMA)}).json()
    assert set(json.loads(r["choices"][0]["text"])) == {"city", "days"}
    r = httpx.post(url, timeout=60, json={"prompt": "Is it?", "max_tokens": 8, "seed": 2,
                                          "guided_grammar": 'start: "yes" | "no"'}).json()
    assert r["choices"][0]["text"] in ("yes", "no")


def test_concurrent_constrained_and_free_requests(client):
    """Batched with free requests in the same steps: each constrained answer parses,
    each free one is as it is alone (greedy)."""
    free_alone = client.completions.create(model="builtin", prompt="The list", max_tokens=24,
                                           temperature=0).choices[0].text

    def constrained(i):
        return client.chat.completions.parse(model="builtin", messages=MSG,
                                             response_format=Person, temperature=1.0, seed=i,
                                             max_completion_tokens=200)

    def free(_):
        return client.completions.create(model="builtin", prompt="The list", max_tokens=24,
                                         temperature=0).choices[0].text
    with ThreadPoolExecutor(6) as ex:
        cs = [ex.submit(constrained, i) for i in range(4)]
        fs = [ex.submit(free, i) for i in range(2)]
        for f in cs:
            assert isinstance(f.result().choices[0].message.parsed, Person)
        assert [f.result() for f in fs] == [free_alone] * 2


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"grammar": 5}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_structured_fields_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and "Traceback" not in r.text
