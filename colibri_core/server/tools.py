"""Tools (function calling) in the formats checkpoints' chat templates use.

A request's `tools` are rendered by the checkpoint's own template (the `tools=` variable,
as transformers passes it); the answer is read back in the format that template teaches
the model, found in the template's text:

- `hermes` (Qwen2/2.5/3, Hermes, many others): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block per call, after optional text;
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole answer is `{"name": ...,
  "parameters": {...}}` (`<|python_tag|>` first allowed), calls separated by `; `;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `harmony` (gpt-oss): a message to `functions.NAME` on the commentary channel
  (harmony.py, which also reads the channels of every answer).

`tool_choice` `required`, or a named function, is enforced by constrained decoding
(runtime/constraints.py): a grammar that writes the format's wrapper around JSON that the
functions' parameter schemas allow. `auto` lets the model choose; `none` leaves the tools
out of the prompt and parses nothing. The answer is read as it streams by
toolstream.py: calls reach the client as OpenAI `tool_calls` deltas, their arguments as
the model writes them, and `finish_reason: "tool_calls"`; text before a call is content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from ..runtime.constraints import JSON_OPTIONS, Grammar, GrammarError
from . import harmony
from .errors import bad_request
from .toolstream import MARKERS

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


def detect_format(source: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches, from its text; None: it renders
    no tools."""
    if not source or "tools" not in source:
        return None
    if harmony.is_harmony(source):
        return "harmony"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source or "[AVAILABLE_TOOLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source or '"parameters"' in source:
        return "llama3"
    return None


@dataclass
class ToolRequest:
    tools: list                 # OpenAI's [{type: function, function: {name, ...}}]
    choice: str                 # "auto" | "required" | a function's name
    parallel: bool
    fmt: str

    def by_name(self) -> dict:
        return {t["function"]["name"]: t["function"] for t in self.tools}


def read(body: dict, template) -> Optional[ToolRequest]:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> a ToolRequest (None: no tools, or
    tool_choice none); every field checked, 400 naming it."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls: expected true or false, got {parallel!r:.40}",
                          param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: expected a list of up to {MAX_TOOLS} "
                          f"{{type: function, function: {{name, description, parameters}}}}",
                          param="tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise bad_request(f"tools[{i}]: expected {{type: function, function: {{name, "
                              f"description, parameters}}}}", param=f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"tools[{i}].function.name: {name!r:.70} is not a name of 1-64 "
                              f"letters, digits, _ . -", param=f"tools[{i}].function.name")
        if name in names:
            raise bad_request(f"tools[{i}].function.name: {name!r} twice",
                              param=f"tools[{i}].function.name")
        names.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters: expected a JSON schema object",
                              param=f"tools[{i}].function.parameters")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(f"tool_choice: {choice!r:.80} names no function of tools",
                              param="tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice: {choice!r:.40} is not none, auto, required or "
                          f"{{type: function, function: {{name}}}}", param="tool_choice")
    if choice == "none":
        return None
    fmt = detect_format(template.source if template is not None else None)
    if fmt is None:
        raise bad_request("tools: this model's chat template does not render tools (no "
                          "tool-call format found in it: Hermes <tool_call>, Llama 3 JSON, "
                          "Mistral [TOOL_CALLS], gpt-oss harmony)", param="tools",
                          code="unsupported_parameter")
    return ToolRequest(tools, choice, parallel, fmt)


# ----------------------------------------------------------------------------- grammar

def _call_schema(fn: dict, fmt: str) -> dict:
    args = "parameters" if fmt == "llama3" else "arguments"
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args: params},
            "required": ["name", args], "additionalProperties": False}


def grammar(req: ToolRequest, tokenizer) -> Optional[Grammar]:
    """`required` or a named function: the format's wrapper around one call (several when
    parallel_tool_calls) whose JSON the parameter schemas allow. None for `auto`."""
    if req.choice == "auto":
        return None
    if req.fmt == "harmony":            # the route checked the tokenizer has them
        return harmony.grammar(req, harmony.Harmony.of(tokenizer))
    fns = req.by_name()
    chosen = [fns[req.choice]] if req.choice in fns else list(fns.values())
    calls = [_call_schema(f, req.fmt) for f in chosen]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    many = req.parallel and req.choice == "required"
    if req.fmt == "mistral":
        schema = {"type": "array", "items": one, "minItems": 1}
        if not many:
            schema["maxItems"] = 1
        lark = f"start: {_literal(MARKERS['mistral'], tokenizer)} @calls"
        sub = [{"name": "calls", "json_schema": {**schema, "x-guidance": JSON_OPTIONS}}]
    elif req.fmt == "hermes":
        lark = ('start: call ("\\n" call)*\n' if many else "start: call\n") + \
            'call: "<tool_call>\\n" @call "\\n</tool_call>"'
        sub = [{"name": "call", "json_schema": {**one, "x-guidance": JSON_OPTIONS}}]
    else:                                                   # llama3: one call
        lark = "start: @call"
        sub = [{"name": "call", "json_schema": {**one, "x-guidance": JSON_OPTIONS}}]
    try:
        return Grammar.llguidance([{"lark_grammar": lark}] + sub)
    except GrammarError as e:
        raise bad_request(f"tools: a function's parameters are not a schema this server can "
                          f"enforce: {e}", param="tools", code="invalid_grammar") from None


def _literal(text: str, tokenizer) -> str:
    """A marker in Lark: its special token when the tokenizer has one (`<[id]>`), else
    its text."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    if tid is not None and tid in getattr(tokenizer, "special_ids", ()):
        return f"<[{tid}]>"
    return json.dumps(text)


# ----------------------------------------------------------------------------- messages

def template_message(m: dict, i: int) -> dict:
    """An assistant message's tool_calls (OpenAI's, arguments as a JSON string) as
    templates read them (arguments as an object, as transformers documents), a tool
    message's tool_call_id and name kept."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls: expected a list",
                              param=f"messages[{i}].tool_calls")
        conv = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls[{j}]: expected {{id, type: "
                                  f"function, function: {{name, arguments}}}}",
                                  param=f"messages[{i}].tool_calls[{j}]")
            args = f.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments: "
                                      f"not JSON", param=f"messages[{i}].tool_calls[{j}]."
                                      f"function.arguments") from None
            conv.append({"id": c.get("id"), "type": "function",
                         "function": {"name": f["name"], "arguments": args}})
        out["tool_calls"] = conv
    for k in ("tool_call_id", "name"):
        if isinstance(m.get(k), str):
            out[k] = m[k]
    thought = m.get("reasoning_content", m.get("reasoning"))    # vLLM's, llama-server's
    if isinstance(thought, str) and m.get("role") == "assistant":
        out["reasoning_content"] = thought          # Qwen3's templates read it so
    return out
