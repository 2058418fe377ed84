"""`colibri serve` against a live server (subprocess on 127.0.0.1, port 0): the official
`openai` client for the OpenAI routes, httpx for the rest. The built-in model is the
reference: greedy text from the server must equal Engine.generate in this process, and
log-probs equal a float64 log-softmax of the engine's own logits."""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from server_helpers import LiveServer, metric, stream_completion, wait_until  # noqa: E402

PROMPTS = ["The assert statement", "The import system", "A class definition",
           "Exceptions are", "The with statement", "Lists and tuples", "Integer literals",
           "The global namespace"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("experts")
    srv = LiveServer(experts_dir=d)
    srv.experts_dir = d
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


def solo(ref, prompt, n, **kw):
    return ref.generate(prompt, max_new_tokens=n, temperature=0.0, **kw).run()


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- completions

def test_completion_greedy_equals_engine(client, ref):
    r = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=20,
                                  temperature=0)
    g = solo(ref, PROMPTS[0], 20)
    assert r.choices[0].text == g.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(g.prompt_ids)
    assert r.usage.completion_tokens == len(g.token_ids) == 20
    assert r.model_extra["expert_sets"][0]["expert_set_generation"] >= 0


def test_completion_token_id_prompts_and_batch(client, ref):
    ids = ref.encode(PROMPTS[1])
    r = client.completions.create(model="builtin", prompt=[ids, ref.encode(PROMPTS[2])],
                                  max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == solo(ref, ids, 8).text
    assert r.choices[1].text == solo(ref, PROMPTS[2], 8).text


def test_streaming_equals_non_streaming(client, ref):
    chunks = list(client.completions.create(model="builtin", prompt=PROMPTS[3], max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == solo(ref, PROMPTS[3], 16).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[0].model_extra["expert_set_generation"] >= 0   # versions on the first chunk


def test_chat_uses_the_models_template(client, ref, server):
    from colibri_core.server.chat import ChatTemplate
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does the assert statement do?"}]
    r = client.chat.completions.create(model="builtin", messages=msgs, max_tokens=12,
                                       temperature=0)
    text = ChatTemplate.from_model_dir(ref.model_dir).render(msgs)
    ids = ref.tokenizer.encode(text)
    assert r.choices[0].message.content == solo(ref, ids, 12).text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="builtin", messages=msgs, max_tokens=12,
                                            temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_n_choices_seeded_sampling_reproducible(client):
    kw = dict(model="builtin", prompt=PROMPTS[4], max_tokens=10, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1        # each choice its own seed
    assert a.usage.completion_tokens == sum(1 for _ in range(3)) * 10


def test_completion_logprobs_match_engine_logits(client, ref):
    r = client.completions.create(model="builtin", prompt=PROMPTS[5], max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    g = solo(ref, PROMPTS[5], 6)
    ids = g.prompt_ids + g.token_ids
    want = log_softmax(ref.next_token_logits(ids, all_positions=True))
    P = len(g.prompt_ids)
    for i, t in enumerate(g.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(want[P - 1 + i, t], abs=0.05)
        assert len(lp.top_logprobs[i]) == 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])  # greedy


def test_echo_logprobs_for_scoring_harnesses(client, ref):
    ids = ref.encode(PROMPTS[6])
    r = client.completions.create(model="builtin", prompt=ids, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    want = log_softmax(ref.next_token_logits(ids, all_positions=True))
    assert c.text == ref.tokenizer.decode(ids)
    assert c.logprobs.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert c.logprobs.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]], abs=1e-6)
    assert r.usage.completion_tokens == 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="builtin", messages=[{"role": "user",
                                       "content": "Hello"}], max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(x.token for x in content) == r.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == pytest.approx(x.logprob)
               for x in content)


def test_sampling_controls(client, ref):
    greedy = solo(ref, PROMPTS[0], 8).text
    top1 = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8,
                                     temperature=1.5, seed=3, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy            # top-k 1 is greedy at any temperature
    tok = ref.encode(" the")[-1]
    biased = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=5,
                                       temperature=0, logit_bias={str(tok): 100})
    assert biased.choices[0].text == ref.tokenizer.decode([tok] * 5)
    g = solo(ref, PROMPTS[0], 30)
    cut = g.text[5:9]
    stopped = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=30,
                                        temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == g.text[:g.text.find(cut)]


def test_ignore_eos_and_experts_per_token(client, ref):
    eos = ref.model_cfg.eos_token_ids[0]
    ended = client.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=5,
                                      temperature=0, logit_bias={str(eos): 100})
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 0
    forced = client.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=5,
                                       temperature=0, logit_bias={str(eos): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 5 and forced.choices[0].finish_reason == "length"
    k1 = solo(ref, PROMPTS[1], 20, experts_per_token=1).text
    assert k1 != solo(ref, PROMPTS[1], 20).text
    by_field = client.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=20,
                                         temperature=0, extra_body={"experts_per_token": 1})
    by_prefix = client.completions.create(model="builtin", prompt="MODE:k1|" + PROMPTS[1],
                                          max_tokens=20, temperature=0)
    assert by_field.choices[0].text == by_prefix.choices[0].text == k1


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(n=1000), "n"),
    (dict(extra_body={"best_of": 3}), "best_of"),
    (dict(extra_body={"suffix": "x"}), "suffix"),
    (dict(extra_body={"experts_per_token": 99}), "experts_per_token"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
])
def test_completion_bad_inputs_name_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="builtin", prompt="x", max_tokens=2, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert param in e.value.body["message"]


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_chat_unimplemented_fields_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="builtin", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}], **kw)
    assert e.value.body["param"] == param


def test_chat_image_parts_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="builtin", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[1].type"


def test_http_errors_are_openai_json(server):
    u = server.url
    cases = [
        httpx.post(u + "/v1/completions", content=b"{not json"),
        httpx.post(u + "/v1/completions", json=[1, 2]),
        httpx.post(u + "/v1/completions", json={"prompt": [1, -5]}),
        httpx.post(u + "/v1/completions", json={"prompt": ""}),
        httpx.post(u + "/v1/completions", json={"max_tokens": 3}),
        httpx.post(u + "/v1/completions", content=b"x" * (5 * 2**20),
                   headers={"content-type": "application/json"}),
        httpx.get(u + "/v1/nothing-here"),
        httpx.get(u + "/v1/completions"),
        httpx.put(u + "/v1/experts/x", content=b"\x7fELF"),
    ]
    assert [r.status_code for r in cases] == [400, 400, 400, 400, 400, 413, 404, 405, 403]
    for r in cases:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert "Traceback" not in r.text
    assert cases[4].json()["error"]["param"] == "prompt"
    assert cases[8].json()["error"]["code"] == "upload_disabled"


def test_unknown_fields_ignored_request_id_echoed(server):
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-ID": "my-req-42"},
                   json={"prompt": "The", "max_tokens": 2, "temperature": 0, "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-req-42"
    assert r.headers["x-colibri-expert-set-generation"].isdigit()
    assert len(r.headers["x-colibri-expert-set-id"]) == 64
    r2 = httpx.get(server.url + "/health")
    assert r2.headers["x-request-id"].startswith("req-")
    deadline = time.monotonic() + 10
    while "my-req-42 completions 200" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "my-req-42 completions 200" in server.log()       # the access-log line
    assert "'frobnicate' ignored" in server.log()


# ----------------------------------------------------------------------------- other routes

def test_models_health_ready_metrics(server):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://ops.example"})
    assert r.json()["data"][0]["id"] == "builtin"
    assert "access-control-allow-origin" not in r.headers       # CORS off by default
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["ready"] is True
    httpx.post(server.url + "/v1/completions", json={"prompt": "The", "max_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "colibri_requests_total", 'route="completions",status="200"') >= 1
    assert metric(text, "colibri_tokens_total", 'kind="completion"') >= 3
    assert "colibri_first_token_seconds_bucket" in text
    assert "colibri_token_seconds_count" in text
    assert metric(text, "colibri_queue_depth") == 0
    assert 'colibri_routed_tokens_total{expert="expert_1_0"}' in text or \
        "colibri_routed_tokens_total{" in text


def test_score_matches_engine_logprobs(server, ref):
    prompt = "The assert statement"
    cands = [" is", " raises an exception", " was"]
    r = httpx.post(server.url + "/v1/score", json={"prompt": prompt, "candidates": cands})
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]["candidates"]
    P = ref.encode(prompt)
    sums = []
    for c, got in zip(cands, res):
        full = ref.encode(prompt + c)
        cont = full[len(P):]
        lp = log_softmax(ref.next_token_logits(full, all_positions=True))
        want = [lp[len(P) - 1 + j, t] for j, t in enumerate(cont)]
        assert got["tokens"] == cont and got["n_tokens"] == len(cont)
        assert got["token_logprobs"] == pytest.approx(want, abs=1e-6)
        assert got["logprob"] == pytest.approx(sum(want), abs=1e-6)
        sums.append(sum(want))
    p = np.exp(np.array(sums) - max(sums))
    p /= p.sum()
    assert [x["probability"] for x in res] == pytest.approx(list(p), abs=1e-9)
    ids = httpx.post(server.url + "/v1/score", json={"items": [
        {"prompt": P, "candidates": [ref.encode(prompt + " is")[len(P):]]}]}).json()
    assert ids["results"][0]["candidates"][0]["logprob"] == pytest.approx(sums[0], abs=1e-6)
    bad = httpx.post(server.url + "/v1/score", json={"prompt": "x", "candidates": []})
    assert bad.status_code == 400


def lm_eval_parse(choice, ctxlen, tail=-1):
    """lm-eval-harness's LocalCompletionsAPI.parse_logprobs for one choice: the sum of
    token_logprobs[ctxlen:-1] and is_greedy (each token's log-prob is the max of its
    top_logprobs). tail=None: the slice of a max_tokens 0 request, no generated token."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:tail]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:tail]
    return sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))


def test_lm_eval_harness_loglikelihood_payload(server, ref):
    """The request lm-eval-harness's local-completions sends for loglikelihood: token-id
    prompts (context + continuation) in a batch, echo, max_tokens 1, logprobs 1, read by
    its own parse (lm_eval_parse); and the same with max_tokens 0. The summed continuation
    log-prob equals a float64 log-softmax of the engine's logits, and is_greedy equals
    "every continuation token is the argmax" (the third continuation is the greedy one;
    one of the others is not)."""
    ctx = ref.encode("The assert statement")
    conts = [ref.encode("The assert statement is used")[len(ctx):],
             ref.encode("The assert statement was")[len(ctx):],
             solo(ref, ctx, 3).token_ids]
    wants = []
    for cont in conts:
        lp = log_softmax(ref.next_token_logits(ctx + cont, all_positions=True))
        rows = [lp[len(ctx) - 1 + j] for j in range(len(cont))]
        wants.append((float(sum(r[t] for r, t in zip(rows, cont))),
                      all(t == int(np.argmax(r)) for r, t in zip(rows, cont))))
    assert {g for _, g in wants} == {False, True}          # both answers are checked
    for max_tokens, tail in ((1, -1), (0, None)):
        body = {"model": "builtin", "prompt": [ctx + c for c in conts], "temperature": 0,
                "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        choices = sorted(out["choices"], key=lambda c: c["index"])
        for choice, cont, (want_sum, want_greedy) in zip(choices, conts, wants):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + max_tokens
            got_sum, got_greedy = lm_eval_parse(choice, len(ctx), tail)
            assert got_sum == pytest.approx(want_sum, abs=1e-5)
            assert got_greedy == want_greedy


# ----------------------------------------------------------------------------- experts live
# From here on the module's server has hot-plugged experts: the tests above compare with
# an engine without them, so they must stay above (pytest runs a file in order).

def _experts(server):
    return httpx.get(server.url + "/v1/experts").json()


def test_concurrent_streams_get_solo_tokens_while_an_expert_goes_live(server, ref):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    base_gen = _experts(server)["expert_set_generation"]
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    N = 24
    before = {p: solo(ref, p, N).text for p in set(prompts)}

    so = compile_test_expert(server.experts_dir.parent / "srv_live.so", hidden=128,
                             layer=2, name="srv_live", version="1.0", scale=0.5)

    async def load():
        """Waves of 32 concurrent streams; the expert is dropped during the first, and
        waves go on until one stream has run with the new set (deadline 60 s)."""
        done, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            tasks = [asyncio.create_task(stream_completion(server.url, p, N)) for p in prompts]
            if not done:
                await asyncio.sleep(0.2)        # streams are running: drop the expert
                so.rename(server.experts_dir / "srv_live.so")
            done += list(zip(prompts, await asyncio.gather(*tasks)))
            if any(g[-1] > base_gen for _, (_, g) in done):
                return done
        raise AssertionError("no stream ran with the dropped expert within 60 s")
    results = asyncio.run(load())
    listing = wait_until(lambda: (lambda x: x if any(e["name"] == "srv_live" and
                                                 e["status"] == "active"
                                                 for e in x["data"]) else None)(
        _experts(server)), "the dropped expert is adopted")
    new_gen = listing["expert_set_generation"]
    assert new_gen > base_gen
    row = next(e for e in listing["data"] if e["name"] == "srv_live")
    assert row["layers"] == [2] and row["version"] == "1.0" and len(row["sha256"]) == 64
    after = {p: httpx.post(server.url + "/v1/completions", json={
        "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True},
        timeout=60).json()["choices"][0]["text"] for p in set(prompts)}
    for p, (pieces, gens) in results:
        assert gens == sorted(gens), "generations go up within a stream"
        text = "".join(pieces)
        if gens[-1] == base_gen:
            assert text == before[p]
        elif gens[0] == new_gen:
            assert text == after[p]
        else:                       # the switch came mid-stream: the old set's part is solo
            j = gens.index(gens[-1])
            assert before[p].startswith("".join(pieces[:j]))
    metrics = httpx.get(server.url + "/metrics").text
    assert metric(metrics, "colibri_expert_adoptions_total") >= 1
    assert metric(metrics, "colibri_expert_set_generation") == new_gen


def test_rollback_and_refusals(server):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    d = server.experts_dir
    compile_test_expert(d / "srv_rb.so", hidden=128, layer=3, name="srv_rb", version="1.0")
    wait_until(lambda: any(e["name"] == "srv_rb" and e["version"] == "1.0" and e["status"] ==
                      "active" for e in _experts(server)["data"]), "v1 adopted")
    r = httpx.post(server.url + "/v1/experts/srv_rb/rollback")
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollback"
    compile_test_expert(d / "srv_rb.so", hidden=128, layer=3, name="srv_rb", version="2.0",
                        scale=2.0)
    wait_until(lambda: any(e["name"] == "srv_rb" and e["version"] == "2.0"
                      for e in _experts(server)["data"]), "v2 adopted")
    assert httpx.post(server.url + "/v1/experts/srv_rb/rollback").status_code == 202
    wait_until(lambda: any(e["name"] == "srv_rb" and e["version"] == "1.0" and e["status"] ==
                      "active" for e in _experts(server)["data"]), "rolled back to v1")
    assert httpx.post(server.url + "/v1/experts/nope/rollback").status_code == 404
    compile_test_expert(d / "srv_bad.so", hidden=64, layer=1, name="srv_bad")
    ref = wait_until(lambda: [x for x in _experts(server)["refusals"]
                         if x["path"].endswith("srv_bad.so")], "the wrong-size expert refused")
    assert ref[0]["reason"] and "64" in ref[0]["message"]
    text = httpx.get(server.url + "/metrics").text
    assert "colibri_expert_refusals_total{" in text

