"""gpt-oss's chat format (harmony) against a live `colibri serve` (issue 36): a tiny random
gpt-oss built by transformers, with harmony's special tokens and the checkpoint's own
chat template (tests/harmony_model.py), converted and served.

- the prompt: the server's token ids equal transformers' `apply_chat_template` with the
  checkpoint's template (tools, reasoning_effort, a past call with its reasoning, its
  result, several calls in one message), and hold the harmony messages written out here;
- the answer, read by its channels: `analysis` -> reasoning_content, `final` -> content,
  a message to `functions.NAME` -> a tool call, streamed and not (the same answer);
- `tool_choice` required / named: the call's arguments validate, the answer ends at
  `<|call|>` (not emitted), its arguments stream in fragments (the `openai` helper);
- an agent loop with plain `openai` calls.

openai-harmony (the reference renderer) needs the o200k_harmony vocabulary downloaded at
first use, which neither this machine nor CI can: the references are the checkpoint's
template through transformers and the harmony strings written below."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from harmony_model import TEMPLATE, build, special_id  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The forecast of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gptoss"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = LiveServer("--model", str(model), "--model-id", "m",
                     experts_dir=tmp_path_factory.mktemp("experts"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def hf(model):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model / "tokenizer.json"), bos_token="<|startoftext|>",
        eos_token="<|return|>", pad_token="<|endoftext|>")


def byte_bias(client_tok, text: str, value: float) -> dict:
    return {str(client_tok.convert_tokens_to_ids(client_tok.tokenize(text))[0]): value}


def valid(name: str, args: dict) -> bool:
    s = {"get_weather": WEATHER, "add": ADD}[name]
    if set(args) != set(s["required"]):
        return False
    for k, v in args.items():
        p = s["properties"][k]
        if "enum" in p and v not in p["enum"]:
            return False
        if p["type"] == "integer" and not (isinstance(v, int) and
                                           p["minimum"] <= v <= p["maximum"]):
            return False
    return True


# ----------------------------------------------------------------------------- the prompt

def test_prompt_is_the_checkpoint_templates(client, hf):
    """A conversation with a system message, a past call (its arguments as OpenAI's JSON
    string), its result, an answer, two calls in one message (with their reasoning, as
    vLLM's `reasoning`) and their results: the ids the server built are those of
    transformers' rendering of the template given what it reads (thinking, arguments as
    objects, one call a message); the template drops the reasoning of a call that a final
    answer follows."""
    conv = [{"role": "system", "content": "Be brief."}] + MSG + [
        {"role": "assistant", "content": "", "reasoning_content": "Dropped: a final follows.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "Clear."},
        {"role": "user", "content": "And 2 + 3, 4 + 5?"},
        {"role": "assistant", "content": "", "reasoning": "Two sums.", "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "call_3", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
        {"role": "tool", "tool_call_id": "call_3", "content": "9"}]
    r = client.chat.completions.create(model="m", messages=conv, tools=TOOLS, max_tokens=1,
                                       temperature=0, reasoning_effort="high",
                                       extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["prompt_token_ids"]
    call = lambda n, a: {"role": "assistant", "content": "", "tool_calls": [  # noqa: E731
        {"type": "function", "function": {"name": n, "arguments": a}}]}
    ref = [conv[0], conv[1],
           {"role": "assistant", "content": "", "thinking": "Dropped: a final follows.",
            "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
           conv[3], conv[4], conv[5],
           {**call("add", {"a": 2, "b": 3}), "thinking": "Two sums."},
           call("add", {"a": 4, "b": 5}), conv[7], conv[8]]
    want = hf.apply_chat_template(ref, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                  add_generation_prompt=True, reasoning_effort="high")
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    # the harmony messages, as the format writes them
    for part in ["<|start|>system<|message|>You are ChatGPT",
                 "Reasoning: high\n\n# Valid channels: analysis, commentary, final.",
                 "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
                 "## functions\n\nnamespace functions {\n\n// The forecast of a city\n"
                 "type get_weather = (_: {\ncity: \"Paris\" | \"Oslo\" | \"Lima\",\n"
                 "days: number,\n}) => any;",
                 "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
                 "<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>"
                 "<|start|>functions.get_weather to=assistant<|channel|>commentary"
                 "<|message|>\"{\\\"sky\\\": \\\"clear\\\"}\"<|end|>",
                 "<|start|>assistant<|channel|>final<|message|>Clear.<|end|>",
                 "<|start|>assistant<|channel|>analysis<|message|>Two sums.<|end|>"
                 "<|start|>assistant to=functions.add<|channel|>commentary json"
                 "<|message|>{\"a\": 2, \"b\": 3}<|call|><|start|>assistant to=functions.add"
                 "<|channel|>commentary json<|message|>{\"a\": 4, \"b\": 5}<|call|>"
                 "<|start|>functions.add to=assistant<|channel|>commentary<|message|>\"5\""
                 "<|end|><|start|>functions.add to=assistant<|channel|>commentary<|message|>"
                 "\"9\"<|end|><|start|>assistant"]:
        assert part in want, part
    assert want.endswith("<|end|><|start|>assistant") and "Dropped" not in want


def test_reasoning_effort(server, client):
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=1,
                                       reasoning_effort="low",
                                       extra_body={"return_token_ids": True})
    low = r.choices[0].model_extra["prompt_token_ids"]
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=1,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] != low      # the default: medium
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": MSG, "max_tokens": 1, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


# ----------------------------------------------------------------------------- answers

FORCED = ('start: <[{c}]> "analysis" <[{m}]> "Paris is in France." <[{e}]> <[{s}]> '
          '"assistant" <[{c}]> "final" <[{m}]> "It is sunny." <[{r}]>')


def _forced():
    return FORCED.format(c=special_id("<|channel|>"), m=special_id("<|message|>"),
                         e=special_id("<|end|>"), s=special_id("<|start|>"),
                         r=special_id("<|return|>"))


def test_channels_reasoning_and_content(client):
    """An answer written in harmony (forced by a Lark grammar through vLLM's
    guided_grammar): the analysis message is reasoning_content, the final one content,
    streamed as deltas that add up to the same."""
    kw = dict(model="m", messages=MSG, max_tokens=80, temperature=0,
              extra_body={"guided_grammar": _forced()})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert msg.model_extra["reasoning_content"] == "Paris is in France."
    content = reasoning = ""
    n = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            n += 1
    assert (content, reasoning) == ("It is sunny.", "Paris is in France.") and n > 10


def test_required_call_validates_and_ends_at_call(client, hf):
    """tool_choice required at temperature 1 (the commentary channel made likely with a
    logit bias on its first letter, so that the random model reaches the call): one call
    whose arguments validate, the answer ending at <|call|>, which is not emitted."""
    bias = byte_bias(hf, "c", 30)
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="m", messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_completion_tokens=200, logit_bias=bias,
            extra_body={"return_token_ids": True})
        ch = r.choices[0]
        calls = ch.message.tool_calls
        assert len(calls) == 1 and ch.finish_reason == "tool_calls"
        assert valid(calls[0].function.name, json.loads(calls[0].function.arguments))
        assert ch.message.content is None
        ids = ch.model_extra["token_ids"]
        assert special_id("<|call|>") not in ids and len(ids) < 200


def test_named_function_and_streamed_fragments(client, hf):
    kw = dict(model="m", messages=MSG, tools=TOOLS, temperature=0, max_completion_tokens=200,
              tool_choice={"type": "function", "function": {"name": "add"}},
              logit_bias=byte_bias(hf, "c", 30))
    whole = client.chat.completions.create(**kw).choices[0].message
    assert [c.function.name for c in whole.tool_calls] == ["add"]
    assert valid("add", json.loads(whole.tool_calls[0].function.arguments))
    pieces = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    assert len(pieces) >= 3 and "".join(pieces) == whole.tool_calls[0].function.arguments
    assert final.message.tool_calls[0].function.name == "add"
    assert final.finish_reason == "tool_calls"


def test_agent_loop(client, hf):
    """Call (required), run the function, send the result back as role tool, then ask
    again with tool_choice auto: the second prompt holds the call and its result."""
    messages = list(MSG)
    r = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=0.7,
        seed=5, max_completion_tokens=200, logit_bias=byte_bias(hf, "c", 30))
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(args)}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                       temperature=0, max_completion_tokens=8,
                                       extra_body={"return_token_ids": True})
    text = hf.decode(r.choices[0].model_extra["prompt_token_ids"])
    assert f"<|start|>assistant to=functions.{call.function.name}<|channel|>commentary json" \
           f"<|message|>{json.dumps(args)}<|call|>" in text
    assert f"<|start|>functions.{call.function.name} to=assistant<|channel|>commentary" \
           f"<|message|>{json.dumps(json.dumps(args))}<|end|><|start|>assistant" in text


def test_reader_headers_and_fallbacks():
    """The reader on token events (special tokens by id, the rest as text, a character a
    token): the recipient before or after <|channel|>, a commentary preamble to the user
    (content), a call to a tool not offered (content), and text that is not harmony."""
    from colibri_core.runtime.events import TokenEvent
    from colibri_core.server.harmony import TOKENS, Harmony, HarmonyReader
    h = Harmony({t: 900 + i for i, t in enumerate(TOKENS)})

    def read(text: str, names=("add",)):
        rd = HarmonyReader(h, set(names))
        outs, i = [], 0
        while i < len(text):
            sp = next((t for t in TOKENS if text.startswith(t, i)), None)
            ev = TokenEvent(i, h.ids[sp], "", 0, "x") if sp else TokenEvent(i, 1, text[i], 0, "x")
            outs.append(rd.push(ev))
            i += len(sp) if sp else 1
        outs.append(rd.finish())
        calls = [(d["function"].get("name"), d["function"]["arguments"]) for o in outs
                 for d in o.calls]
        return ("".join(o.content for o in outs), "".join(o.reasoning for o in outs), calls,
                rd.called)
    args = '{"a": 1, "b": 2}'
    assert read(f"<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>"
                f"commentary to=functions.add <|constrain|>json<|message|>{args}") == \
        ("", "Hm.", [("add", "")] + [(None, c) for c in args], True)
    assert read(f" to=functions.add<|channel|>commentary json<|message|>{args}<|call|>")[2][0] \
        == ("add", "")
    assert read("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
                "<|channel|>final<|message|>Done.<|return|>") == ("Checking.Done.", "", [], False)
    assert read(f"<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{args}")[:3] \
        == (args, "", [])
    assert read("plain words, no header") == ("plain words, no header", "", [], False)


def test_response_format_is_the_final_message(client, hf):
    """A JSON schema on gpt-oss: the model keeps its channels (the grammar is the final
    message's body, after an optional analysis: made unlikely here with a bias on the
    'f' of final), the content validates, streamed the same."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1,
                                                        "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    kw = dict(model="m", messages=MSG, max_tokens=120, temperature=0,
              logit_bias=byte_bias(hf, "f", 30), extra_body={"return_token_ids": True},
              response_format={"type": "json_schema",
                               "json_schema": {"name": "w", "schema": schema}})
    r = client.chat.completions.create(**kw)
    got = json.loads(r.choices[0].message.content)
    assert got["city"] in ("Paris", "Oslo") and 1 <= got["days"] <= 7
    assert r.choices[0].finish_reason == "stop"
    text = hf.decode(r.choices[0].model_extra["token_ids"])
    assert text.startswith("<|channel|>final<|message|>{")
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_harmony_template_without_the_tokens(tmp_path):
    """gpt-oss's template on a model whose tokenizer lacks harmony's tokens (the built-in
    model's): tools are a 400 naming tools, not a misread answer; a plain chat works."""
    from tool_templates import model_with_template
    d = model_with_template(tmp_path / "m", TEMPLATE)
    (tmp_path / "ex").mkdir()
    srv = LiveServer("--model", str(d), "--model-id", "m", experts_dir=tmp_path / "ex")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": MSG, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "<|channel|>" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": MSG, "max_tokens": 4})
        assert r.status_code == 200 and isinstance(
            r.json()["choices"][0]["message"]["content"], str)
    finally:
        srv.stop()
