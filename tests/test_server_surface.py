"""The API surface of issue 36 item 3, against a live server: model names (404
model_not_found, --served-model-name aliases, GET /v1/models/{id}), /tokenize and
/detokenize, penalties and min_p over HTTP."""
from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from server_helpers import LiveServer  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("experts")
    srv = LiveServer("--served-model-name", "my-alias", "other/name", experts_dir=d)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    from colibri_core.engine import Engine
    with Engine.from_config("builtin") as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


# ----------------------------------------------------------------------------- models

def test_models_retrieve_and_list_aliases(client):
    m = client.models.retrieve("builtin")
    assert m.id == "builtin" and m.object == "model"
    assert client.models.retrieve("other/name").id == "other/name"
    assert [x.id for x in client.models.list().data] == ["builtin", "my-alias", "other/name"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_unknown_model_is_404_and_an_alias_is_served(client, route):
    def call(model):
        if route == "completions":
            return client.completions.create(model=model, prompt="The with", max_tokens=2,
                                             temperature=0)
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            temperature=0)
    with pytest.raises(openai.NotFoundError) as e:
        call("gpt-4o")
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert call("my-alias").model == "builtin"        # answered under the served id


def test_score_checks_the_model_and_a_missing_model_is_accepted(server):
    r = httpx.post(server.url + "/v1/score", json={"model": "nope", "prompt": "a",
                                                   "candidates": ["b"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"model": 3, "prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------------------- tokenize

def test_tokenize_detokenize_round_trip(server, ref):
    text = "The import system is, héllo"
    r = httpx.post(server.url + "/tokenize", json={"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == ref.tokenizer.encode(text)
    bos = ref.model_cfg.bos_token_id
    r2 = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True,
                                                    "with_pieces": True}).json()["tokens"]
    want = ([bos] if bos is not None else []) + ids
    assert [t["id"] for t in r2] == want
    assert [t["piece"] for t in r2] == [ref.tokenizer.token_text(i) for i in want]
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()
    assert back == {"content": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
])
def test_tokenize_bad_inputs_name_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


# ----------------------------------------------------------------------------- penalties

def test_penalties_over_http_match_the_engine(client, ref):
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5)
    got = client.completions.create(model="builtin", prompt="The with statement",
                                    max_tokens=12, temperature=0, extra_body={
                                        "repetition_penalty": 1.3}, **kw)
    want = ref.generate("The with statement", max_new_tokens=12, temperature=0,
                        repetition_penalty=1.3, **kw).run()
    assert got.choices[0].text == want.text
    plain = ref.generate("The with statement", max_new_tokens=12, temperature=0).run()
    assert want.token_ids != plain.token_ids        # the penalties did something here


def test_min_p_one_over_http_is_greedy(client, ref):
    """min_p 1 keeps only the most likely token: sampling at temperature 1 is greedy."""
    got = client.completions.create(model="builtin", prompt="The", max_tokens=8, seed=5,
                                    temperature=1.0, extra_body={"min_p": 1.0})
    assert got.choices[0].text == ref.generate("The", max_new_tokens=8,
                                               temperature=0).run().text


# ----------------------------------------------------------------------------- text_offset

def _check_offsets(text, lp, ids, ref, n_echo):
    """Each token's text_offset is where its text starts in the returned text: the echo's
    tokens at the lengths of their decoded prefixes (BOS: no text), then the answer's."""
    offs = lp.text_offset
    assert len(offs) == len(lp.tokens) and offs == sorted(offs)
    for i in range(n_echo):
        assert text[:offs[i]] == ref.tokenizer.decode(ids[:i])
    assert offs[n_echo] == len(ref.tokenizer.decode(ids))


def test_text_offset_against_the_returned_text_with_echo(client, ref):
    prompt = "The import system"
    ids = ref.encode(prompt)
    assert ref.tokenizer.token_text(ids[0]) != ""       # BOS has a text of its own
    r = client.completions.create(model="builtin", prompt=prompt, max_tokens=6,
                                  temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    _check_offsets(c.text, c.logprobs, ids, ref, len(ids))
    # the answer's tokens: each offset is the returned text's length before it
    out = ref.generate(prompt, max_new_tokens=6, temperature=0).run()
    want, at = [], len(prompt)
    from colibri_core.runtime.tokenizer import StreamDecoder
    dec = StreamDecoder(ref.tokenizer)
    for t in out.token_ids:
        want.append(at)
        at += len(dec.push(t))
    assert c.logprobs.text_offset[len(ids):] == want


def test_text_offset_streamed_is_absolute(client, ref):
    prompt = "The import system"
    whole = client.completions.create(model="builtin", prompt=prompt, max_tokens=6,
                                      temperature=0, echo=True, logprobs=1)
    offs = []
    for ch in client.completions.create(model="builtin", prompt=prompt, max_tokens=6,
                                        temperature=0, echo=True, logprobs=1, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            offs += ch.choices[0].logprobs.text_offset
    assert offs == whole.choices[0].logprobs.text_offset


def test_version_flag():
    import subprocess
    import sys
    from importlib.metadata import version
    __version__ = version("colibri")
    for module in ("colibri_core", "colibri_core.cli"):      # both entry modules
        r = subprocess.run([sys.executable, "-m", module, "--version"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"colibri {__version__}", module


# ----------------------------------------------------------------------------- token ids

@pytest.fixture(scope="module")
def bare(tiny_model_dir, tmp_path_factory):
    """A model without a tokenizer: answers carry token ids."""
    srv = LiveServer("--model", str(tiny_model_dir), "--model-id", "tiny",
                     experts_dir=tmp_path_factory.mktemp("experts2"))
    yield srv
    srv.stop()


def test_a_model_without_tokenizer_returns_its_token_ids(bare, tiny_model_dir):
    import json

    from colibri_core.engine import Engine
    prompt = [5, 6, 7, 8]
    with Engine.from_model_dir(tiny_model_dir) as eng:
        want = eng.generate(prompt, max_new_tokens=6, temperature=0).run()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    r = httpx.post(bare.url + "/v1/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    assert c["token_ids"] == want.token_ids and len(want.token_ids) == 6
    assert c["prompt_token_ids"] == list(want.prompt_ids)
    ids, prompt_ids = [], None
    with httpx.stream("POST", bare.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                ids += ch.get("token_ids", [])
                prompt_ids = ch.get("prompt_token_ids", prompt_ids)
    assert ids == want.token_ids and prompt_ids == list(want.prompt_ids)
    r = httpx.post(bare.url + "/tokenize", json={"content": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"


def test_return_token_ids_on_request(client, ref):
    r = client.completions.create(model="builtin", prompt="The with", max_tokens=4,
                                  temperature=0, extra_body={"return_token_ids": True})
    want = ref.generate("The with", max_new_tokens=4, temperature=0).run()
    assert r.choices[0].token_ids == want.token_ids
    assert r.choices[0].prompt_token_ids == list(want.prompt_ids)
    plain = client.completions.create(model="builtin", prompt="The with", max_tokens=4,
                                      temperature=0)
    assert getattr(plain.choices[0], "token_ids", None) is None


# ----------------------------------------------------------------------------- --ctx-size

def test_ctx_size_bounds_each_request(bare, tiny_model_dir, tmp_path):
    srv = LiveServer("--model", str(tiny_model_dir), "--model-id", "tiny", "--ctx-size", "12",
                     experts_dir=tmp_path)
    try:
        url = srv.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": list(range(1, 14)), "max_tokens": 2}, timeout=60)
        assert r.status_code == 400
        e = r.json()["error"]
        assert e["param"] == "prompt" and e["code"] == "context_length_exceeded"
        assert "12" in e["message"]
        r = httpx.post(url, json={"prompt": list(range(1, 9)), "max_tokens": 50,
                                  "temperature": 0, "ignore_eos": True}, timeout=60).json()
        assert len(r["choices"][0]["token_ids"]) == 4          # 8 + 4 = 12
        assert r["choices"][0]["finish_reason"] == "length"
        # the same request on a server without --ctx-size goes past 12
        r = httpx.post(bare.url + "/v1/completions", json={
            "prompt": list(range(1, 9)), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}, timeout=60).json()
        assert len(r["choices"][0]["token_ids"]) == 6
        assert httpx.get(srv.url + "/v1/models/tiny").json()["max_model_len"] == 12
    finally:
        srv.stop()


def test_ctx_size_over_the_model_context_is_refused_at_start(tiny_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="--ctx-size 100000: more than the model's"):
        LiveServer("--model", str(tiny_model_dir), "--ctx-size", "100000",
                   experts_dir=tmp_path).stop()


# ----------------------------------------------------------------------------- logging

def _json_lines(srv):
    import json
    out = []
    for line in srv.lines:
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_log_format_json_access_and_engine_lines(tiny_model_dir, tmp_path):
    from server_helpers import wait_until
    srv = LiveServer("--model", str(tiny_model_dir), "--model-id", "tiny",
                     "--log-format", "json", experts_dir=tmp_path)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, headers={
            "X-Request-ID": "req-json-1"}, json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                 "temperature": 0, "no_such_field": 1})
        assert r.status_code == 200
        wait_until(lambda: any(d.get("request_id") == "req-json-1"
                               for d in _json_lines(srv)), "the access line")
        lines = _json_lines(srv)
        acc = next(d for d in lines if d.get("request_id") == "req-json-1")
        assert acc["logger"] == "colibri.server.access" and acc["level"] == "info"
        assert acc["route"] == "completions" and acc["status"] == 200
        assert acc["tokens"] == 3 and acc["prompt_tokens"] == 3 and acc["total_ms"] > 0
        assert any(d["logger"] == "colibri.server" and "no_such_field" in d["msg"]
                   for d in lines)
        assert not any(line.startswith("colibri: access:") for line in srv.lines)
    finally:
        srv.stop()


def test_log_level_warning_drops_access_lines(tiny_model_dir, tmp_path):
    srv = LiveServer("--model", str(tiny_model_dir), "--log-level", "warning",
                     experts_dir=tmp_path)
    try:
        for _ in range(2):
            assert httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "prompt": [1, 2], "max_tokens": 1}).status_code == 200
        srv.terminate()
        assert not any("access" in line for line in srv.lines)
    finally:
        srv.stop()


def test_log_options_are_checked(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "colibri_core", "serve", "--log-format", "xml"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--log-format" in r.stderr
