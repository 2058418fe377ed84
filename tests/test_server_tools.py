"""Tools against a live `colibri serve` (issue 36 items 2 and 5), one server per tool-call
format (the built-in model with a Hermes/Qwen, a Llama 3.1 or a Mistral template,
tests/tool_templates.py): tools rendered as transformers renders them, `required` and a
named function enforced (the arguments validate against the function's schema), calls
streamed as `tool_calls` deltas equal to the non-streamed ones, role `tool` messages
round-trip into the next prompt, and an agent loop written with plain `openai` calls."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from server_helpers import LiveServer  # noqa: E402
from tool_templates import TEMPLATES, model_with_template  # noqa: E402

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
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def run_tool(name: str, args: dict) -> str:
    if name == "add":
        return str(args["a"] + args["b"])
    return json.dumps({"city": args["city"], "forecast": ["sun"] * args["days"]})


def valid(name: str, args: dict) -> bool:
    """The arguments against the function's schema, checked here field by field."""
    s = SCHEMAS[name]
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


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def server(request, tmp_path_factory):
    d = model_with_template(tmp_path_factory.mktemp("model") / request.param,
                            TEMPLATES[request.param])
    srv = LiveServer("--model", str(d), "--model-id", "m",
                     experts_dir=tmp_path_factory.mktemp("experts"))
    srv.fmt = request.param
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _calls(message) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_calls_validate(client, seed):
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS,
                                       tool_choice="required", temperature=1.0, seed=seed,
                                       max_completion_tokens=120)
    ch = r.choices[0]
    calls = _calls(ch.message)
    assert calls and all(valid(n, a) for n, a in calls)
    assert ch.finish_reason in ("tool_calls", "length") and ch.message.content is None
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in ch.message.tool_calls)


def test_named_function_is_called_once(client):
    r = client.chat.completions.create(
        model="m", messages=MSG, tools=TOOLS, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_completion_tokens=80)
    calls = _calls(r.choices[0].message)
    assert len(calls) == 1 and calls[0][0] == "add" and valid(*calls[0])
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_equal_the_answer(client):
    kw = dict(model="m", messages=MSG, tools=TOOLS, tool_choice="required", temperature=0,
              max_completion_tokens=120, parallel_tool_calls=False)
    whole = _calls(client.chat.completions.create(**kw).choices[0].message)
    acc: dict = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                e = acc.setdefault(d.index, {"name": "", "arguments": ""})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(acc.items())] == whole
    assert len(whole) == 1 and finish == "tool_calls"


def test_n_choices_each_call_streamed_and_not(client):
    kw = dict(model="m", messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0,
              seed=7, n=2, max_completion_tokens=60, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    assert len(whole.choices) == 2
    for ch in whole.choices:
        calls = _calls(ch.message)
        assert len(calls) == 1 and valid(*calls[0])
    acc: dict = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                e = acc.setdefault((c.index, d.index), ["", ""])
                e[0] += d.function.name or ""
                e[1] += d.function.arguments or ""
    assert sorted(acc) == [(0, 0), (1, 0)]
    assert [(acc[i, 0][0], json.loads(acc[i, 0][1])) for i in (0, 1)] == \
        [_calls(ch.message)[0] for ch in whole.choices]


def test_arguments_stream_in_fragments_with_the_openai_helper(client):
    """The `openai` client's stream helper (its own accumulator): the call's arguments
    arrive in several `tool_calls.function.arguments.delta` events, each the next piece
    of what was written, and the final message equals the non-streamed answer."""
    kw = dict(model="m", messages=MSG, tools=TOOLS, tool_choice="required", temperature=0,
              max_completion_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message
    pieces = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                assert event.arguments == "".join(pieces) + event.arguments_delta
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    assert len(pieces) >= 3 and "".join(pieces) == whole.tool_calls[0].function.arguments
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert final.finish_reason == "tool_calls"


def test_auto_without_a_call_is_content(client):
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, temperature=0,
                                       max_completion_tokens=16)
    ch = r.choices[0]
    assert ch.message.tool_calls is None and isinstance(ch.message.content, str)


def test_tools_are_rendered_as_transformers_renders_them(server, client):
    """The prompt the server built (its ids, decoded) against transformers'
    apply_chat_template with the same tools and conversation, tool call and tool result
    included: they round-trip."""
    transformers = pytest.importorskip("transformers")
    from colibri_core.config import builtin_model_dir
    conv = MSG + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    r = client.chat.completions.create(model="m", messages=conv, tools=TOOLS, max_tokens=1,
                                       temperature=0, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["prompt_token_ids"]
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(builtin_model_dir() / "tokenizer.json"),
        bos_token="<|endoftext|>", eos_token="<|endoftext|>")      # tokenizer_config's
    ref_conv = json.loads(json.dumps(conv))
    ref_conv[1]["tool_calls"][0]["function"]["arguments"] = {"a": 3, "b": 4}
    want = hf.apply_chat_template(ref_conv, tools=TOOLS, chat_template=TEMPLATES[server.fmt],
                                  tokenize=False, add_generation_prompt=True)
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    assert "7" in want and '"a": 3' in want
    # Mistral's templates list the tools before the last user message only
    assert ("get_weather" in want) == (server.fmt != "mistral")


def test_agent_loop(client):
    """A LangChain-style loop in plain openai calls: call tools while the model asks for
    them (required on the first turn), feed the results back as role tool, stop at an
    answer without calls or after 4 turns."""
    messages = list(MSG)
    turns, ran = 0, []
    while turns < 4:
        r = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0.8, seed=turns,
            tool_choice="required" if turns == 0 else "auto", max_completion_tokens=60)
        msg = r.choices[0].message
        turns += 1
        if not msg.tool_calls:
            assert isinstance(msg.content, str)
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            assert valid(call.function.name, args)
            out = run_tool(call.function.name, args)
            ran.append(out)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    assert ran, "the first turn's required call ran"
    assert messages[1]["role"] == "assistant" and messages[2]["role"] == "tool"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
