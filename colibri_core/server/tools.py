"""Tools (function calling) in the formats checkpoints' chat templates use.

A request's `tools` are rendered by the checkpoint's own template (the `tools=` variable,
as transformers passes it); the answer is read back in the format that template teaches
the model, found in the template's text:

- `hermes` (Qwen2/2.5/3, Hermes, many others): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block per call, after optional text;
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole answer is `{"name": ...,
  "parameters": {...}}` (`<|python_tag|>` first allowed), calls separated by `; `;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`tool_choice` `required`, or a named function, is enforced by constrained decoding
(runtime/constraints.py): a grammar that writes the format's wrapper around JSON that the
functions' parameter schemas allow. `auto` lets the model choose; `none` leaves the tools
out of the prompt and parses nothing. Calls reach the client as OpenAI `tool_calls`
(streamed: one delta per call with its whole arguments, as soon as its Hermes block
closes, or when the answer ends for the one-JSON-value formats) and `finish_reason:
"tool_calls"`; text before a call is content, streamed as it comes.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Optional

from ..runtime.constraints import JSON_OPTIONS, Grammar, GrammarError
from ..runtime.events import End, TokenEvent
from .errors import bad_request

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


def detect_format(source: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches, from its text; None: it renders
    no tools."""
    if not source or "tools" not in source:
        return None
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
                          "Mistral [TOOL_CALLS])", param="tools", code="unsupported_parameter")
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
    return out


# ----------------------------------------------------------------------------- output

class ToolState:
    """One choice's answer as it streams: content until the format's marker (text that
    may begin it held back), then the calls: each Hermes block as soon as it closes
    (`take_calls`), the rest when the answer ends."""

    def __init__(self, fmt: str, names: set, tokenizer):
        self.fmt = fmt
        self.names = names
        self.marker = MARKERS[fmt]
        mid = tokenizer.token_to_id(self.marker) if tokenizer is not None else None
        self.marker_id = mid if mid is not None and mid in getattr(
            tokenizer, "special_ids", ()) else None     # a special token: not in the text
        self.buf = ""
        self.calling = False
        self.started = False            # llama3: the first non-space character seen
        self.sent = 0                   # calls handed out so far (their indexes)
        self.broken = False             # a block that did not parse: the rest is content

    def push(self, ev: TokenEvent) -> str:
        """-> the content to send now."""
        text = self.marker if ev.token_id >= 0 and ev.token_id == self.marker_id else ev.text
        if self.calling:
            self.buf += text
            return ""
        self.buf += text
        if self.fmt == "llama3" and not self.started:
            s = self.buf.lstrip()
            if not s:
                return ""
            self.started = True
            if s.startswith("{") or s.startswith(self.marker):
                self.calling = True
                return ""
            if self.marker.startswith(s):
                self.started = False
                return ""
        at = self.buf.find(self.marker)
        if at >= 0:
            out, self.buf, self.calling = self.buf[:at], self.buf[at:], True
            return out
        keep = _partial_suffix(self.buf, self.marker)
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def take_calls(self) -> list:
        """Hermes blocks complete so far, parsed and taken out of the buffer (each
        call's delta can go now); [] for the other formats, whose calls are one JSON
        value read at the end."""
        out = []
        while self.calling and not self.broken and self.fmt == "hermes":
            end = self.buf.find("</tool_call>")
            if end < 0:
                break
            block = self.buf[:end + len("</tool_call>")]
            calls = parse_calls(block, self.fmt, self.names)
            if calls is None:
                self.broken = True
                break
            self.buf = self.buf[len(block):].lstrip("\n")
            out += calls
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list]:
        """-> (content still held, the remaining calls [{id, type, function: {name,
        arguments}}]). An answer whose calls do not parse is content, as written."""
        calls = self.take_calls()
        buf, self.buf = self.buf, ""
        if not self.calling or (not buf.strip() and calls):
            return ("" if calls else buf), calls
        b = buf.strip()
        if self.fmt == "hermes" and self.sent and not self.broken and "</tool_call>" not in b \
                and (b.startswith("<tool_call>") or "<tool_call>".startswith(b)):
            return "", calls        # a block cut short (max_tokens): the complete ones stand
        more = None if self.broken else parse_calls(buf, self.fmt, self.names)
        if more is None:
            return buf, calls
        self.sent += len(more)
        return "", calls + more


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_calls(text: str, fmt: str, names: set) -> Optional[list]:
    """The calls in an answer's tool-call part, or None when it is not valid calls."""
    dec = json.JSONDecoder()
    found = []
    try:
        if fmt == "hermes":
            blocks = text.split("<tool_call>")[1:]
            for i, block in enumerate(blocks):
                body, closed, _ = block.partition("</tool_call>")
                if not closed and i and i == len(blocks) - 1:
                    break            # cut short (max_tokens): the complete ones stand
                found.append(json.loads(body.strip()))
            args = "arguments"
        elif fmt == "mistral":
            s = text.split(MARKERS["mistral"], 1)[1].strip()
            found, _ = dec.raw_decode(s)
            if isinstance(found, dict):
                found = [found]
            args = "arguments"
        else:
            s = text.strip()
            if s.startswith(MARKERS["llama3"]):
                s = s[len(MARKERS["llama3"]):].strip()
            while s:
                obj, end = dec.raw_decode(s)
                found.append(obj)
                s = s[end:].strip().lstrip(";").strip()
            args = "parameters"
    except (ValueError, IndexError):
        return None
    calls = []
    for obj in found if isinstance(found, list) else []:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        a = obj.get(args, obj.get("arguments", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": a if isinstance(a, str) else json.dumps(a)}})
    return calls or None


def _finish(reason: str, calls) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def _add_calls(delta: dict, calls: list, first: int) -> None:
    if calls:
        delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]


class ToolChunker:
    """A streaming request's chunks (responses.Chunker) with each choice's tool calls
    taken out of its content and sent as `tool_calls` deltas when it ends."""

    def __init__(self, inner, req: ToolRequest, tokenizer):
        self.inner, self.req, self.tok = inner, req, tokenizer
        self.states: dict[int, ToolState] = {}

    def _state(self, choice: int) -> ToolState:
        if choice not in self.states:
            self.states[choice] = ToolState(self.req.fmt, set(self.req.by_name()), self.tok)
        return self.states[choice]

    def chunk(self, ev) -> Optional[dict]:
        if isinstance(ev, TokenEvent):
            st = self._state(ev.choice)
            text = st.push(ev)
            first = st.sent
            calls = st.take_calls()
            if not text and not calls and ev.token_id >= 0 and self.inner.ids is False \
                    and not (self.inner.logprobs and ev.logprob):
                return None
            c = self.inner.chunk(replace(ev, text=text))
            _add_calls(c["choices"][0]["delta"], calls, first)
            if calls and not text:
                del c["choices"][0]["delta"]["content"]
            return c
        if isinstance(ev, End):
            st = self._state(ev.choice)
            first = st.sent
            rest, calls = st.finish()
            c = self.inner.chunk(replace(ev, finish_reason=_finish(
                ev.finish_reason, st.sent)))
            delta = c["choices"][0]["delta"]
            if rest:
                delta["content"] = rest
            _add_calls(delta, calls, first)
            return c
        return self.inner.chunk(ev)

    def usage_chunk(self, usage: dict) -> dict:
        return self.inner.usage_chunk(usage)


def rewrite_body(body: dict, events: list, req: ToolRequest, tokenizer) -> dict:
    """A non-streaming chat body: each choice's message as content and tool_calls."""
    states: dict[int, ToolState] = {}
    texts: dict[int, list] = {}
    taken: dict[int, list] = {}
    names = set(req.by_name())
    for ev in events:
        if isinstance(ev, TokenEvent):
            st = states.setdefault(ev.choice, ToolState(req.fmt, names, tokenizer))
            texts.setdefault(ev.choice, []).append(st.push(ev))
            taken.setdefault(ev.choice, []).extend(st.take_calls())
    for ch in body["choices"]:
        st = states.get(ch["index"])
        if st is None:
            continue
        rest, more = st.finish()
        calls = taken.get(ch["index"], []) + more
        content = "".join(texts.get(ch["index"], [])) + rest
        msg = ch["message"]
        msg["content"] = content if content or not calls else None
        if calls:
            msg["tool_calls"] = calls
        ch["finish_reason"] = _finish(ch["finish_reason"], calls)
    return body
