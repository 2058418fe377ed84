"""A chat answer read as it streams: content, reasoning and tool calls, the calls' arguments
passed on as the model writes them (OpenAI's shape: a call's first delta has its `index`,
`id`, `type` and name with empty arguments, the next ones fragments of its arguments).

One reader per choice turns each token event into an `Out` (the content, reasoning and
call deltas it adds); the streaming route sends each Out as a chunk (`Chunker`), the
non-streaming one adds them up (`rewrite_body`), so both give the same answer.
`CallReader` reads the JSON formats (tools.py: hermes, llama3, mistral), harmony.py's
`HarmonyReader` gpt-oss's channels.

A JSON call is taken as a call once `{"name": "NAME", "arguments": ` (or "parameters") is
read with NAME one of the request's tools and an object after it: from then on the
arguments stream, and the call stands even if the model breaks the JSON later (what was
sent cannot be taken back; the answer ends `tool_calls`). A call written another way (its
arguments first, a string of JSON) is read whole when its object closes. Text that does
not become a call (an unknown name, no object) is content, as written.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import replace
from typing import Optional

from ..runtime.events import End, TokenEvent

HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                  r'\s*:\s*')
# what may stand between calls (and around them), by format; anything else ends the calls
SEPARATORS = {"hermes": ("<tool_call>", "</tool_call>"),
              "mistral": ("[TOOL_CALLS]", "[", ",", "]"),
              "llama3": ("<|python_tag|>", ";")}
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Out:
    """What one event adds to a choice's answer."""
    __slots__ = ("content", "reasoning", "calls")

    def __init__(self):
        self.content = ""
        self.reasoning = ""
        self.calls: list = []        # OpenAI tool_calls delta entries

    def call(self, index: int, name: str) -> None:
        self.calls.append({"index": index, "id": new_call_id(), "type": "function",
                           "function": {"name": name, "arguments": ""}})

    def args(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1]["index"] == index:
            self.calls[-1]["function"]["arguments"] += text
        else:
            self.calls.append({"index": index, "function": {"arguments": text}})

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


def special_text(ev: TokenEvent, specials: dict) -> str:
    """The event's text, a special token (which decoding leaves out) as its own text."""
    return specials.get(ev.token_id, ev.text) if ev.token_id >= 0 else ev.text


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallReader:
    """One choice of a JSON tool-call format: content until the format's marker (text
    that may begin it held back), then the calls, their arguments as they come."""

    def __init__(self, fmt: str, names: set, tokenizer):
        self.fmt, self.names = fmt, names
        self.marker = MARKERS[fmt]
        self.seps = SEPARATORS[fmt]
        mid = tokenizer.token_to_id(self.marker) if tokenizer is not None else None
        special = mid is not None and mid in getattr(tokenizer, "special_ids", ())
        self.specials = {mid: self.marker} if special else {}   # not in the decoded text
        self.buf = ""                  # text not read yet
        self.calling = False           # past the marker
        self.started = False           # llama3: the first non-space character seen
        self.n = 0                     # calls begun (the next one's index)
        self.held = ""                 # text since the last whole call: content if none
        self.obj: Optional[str] = None  # the call object being read, from its '{'
        self.rest = ""                 # text that starts the object being read
        self.depth = self.pos = 0      # the scan of obj: nesting depth, characters read
        self.in_str = self.esc = False
        self.index: Optional[int] = None   # the streaming call's index
        self.args_at = self.args_end = self.sent = -1
        self.broken = False            # the rest is content
        self.over = False              # text after the calls: dropped

    def push(self, ev: TokenEvent) -> Out:
        out = Out()
        text = special_text(ev, self.specials)
        if self.broken:
            out.content = text
        elif self.over:
            pass
        elif self.calling:
            self.buf += text
            self.held += text
            self._calls(out)
        else:
            self._text(text, out)
        if self.broken and self.buf:           # what was held is content after all
            out.content += self.buf
            self.buf = ""
        return out

    def finish(self) -> Out:
        out = Out()
        if self.broken:
            out.content, self.buf = self.buf, ""
        elif not self.calling:
            out.content, self.buf = self.buf, ""
        elif self.obj is not None and self.index is None and not self.n:
            out.content = self.held             # never a call: as written
        elif self.obj is not None and self.index is None:
            pass                                # cut short (max_tokens): the whole ones stand
        elif self.n == 0 and self.held.strip():
            out.content = self.held
        return out

    @property
    def called(self) -> bool:
        return self.n > 0

    # -- content, until the marker ---------------------------------------------------------
    def _text(self, text: str, out: Out) -> None:
        self.buf += text
        if self.fmt == "llama3" and not self.started:
            s = self.buf.lstrip()
            if not s:
                return
            self.started = True
            if s.startswith("{") or s.startswith(self.marker):
                return self._enter(s, out)
            if self.marker.startswith(s):
                self.started = False
                return
        at = self.buf.find(self.marker)
        if at >= 0:
            out.content = self.buf[:at]
            return self._enter(self.buf[at:], out)
        keep = _partial_suffix(self.buf, self.marker)
        out.content = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]

    def _enter(self, region: str, out: Out) -> None:
        self.calling, self.buf, self.held = True, region, region
        self._calls(out)

    # -- the calls ------------------------------------------------------------------------
    def _calls(self, out: Out) -> None:
        while not self.broken and not self.over:
            if self.obj is None:
                if not self._between():
                    return
            if not self._read_object(out):
                return

    def _between(self) -> bool:
        """Separators skipped; True when an object starts."""
        while True:
            s = self.buf.lstrip()
            if not s:
                self.buf = ""
                return False
            if s[0] == "{":
                self.buf, self.obj = "", ""
                self.depth = self.pos = 0
                self.in_str = self.esc = False
                self.index, self.args_at, self.args_end, self.sent = None, -1, -1, -1
                self.rest = s
                return True
            sep = next((x for x in self.seps if s.startswith(x)), None)
            if sep is not None:
                self.buf = s[len(sep):]
                continue
            if any(x.startswith(s) for x in self.seps):
                self.buf = s                     # may be a separator: wait
                return False
            if self.n:
                self.over = True                 # text after the calls
            else:
                self._break()
            return False

    def _break(self) -> None:
        self.broken = True
        self.buf = self.held

    def _read_object(self, out: Out) -> bool:
        """Reads `self.rest` into the object; True when it closed (more may follow)."""
        text, self.rest = self.rest, ""
        text = self.buf + text
        self.buf = ""
        start = len(self.obj)
        self.obj += text
        if self.index is None and self.args_at < 0:
            m = HEAD.match(self.obj)
            if m and m.end() < len(self.obj):
                name = json.loads('"' + m.group(1) + '"')
                if name not in self.names:
                    self._break()
                    return False
                if self.obj[m.end()] == "{":     # arguments as an object: streamed
                    self.index, self.n = self.n, self.n + 1
                    self.args_at = self.sent = m.end()
                    out.call(self.index, name)
                else:
                    self.args_at = len(self.obj) + (1 << 40)    # read whole at the end
        end = self._scan(start)
        if self.index is not None:
            stop = self.args_end if self.args_end >= 0 else self.pos
            out.args(self.index, self.obj[self.sent:stop])
            self.sent = max(self.sent, stop)
        if end < 0:
            return False
        obj, self.rest = self.obj[:end], self.obj[end:]
        self.obj = None
        if self.index is None:                   # read whole
            call = _whole_call(obj, self.names)
            if call is None:
                self._break()
                return False
            out.call(self.n, call[0])
            out.args(self.n, call[1])
            self.n += 1
        self.held = self.buf = self.rest
        self.rest = ""
        return True

    def _scan(self, start: int) -> int:
        """Scans obj from `start`: the position after the object's closing brace, or -1."""
        obj = self.obj
        for i in range(start, len(obj)):
            c = obj[i]
            self.pos = i + 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_end < 0 and 0 <= self.args_at < i:
                    self.args_end = i + 1
                if self.depth == 0:
                    return i + 1
        return -1


def _whole_call(obj: str, names: set) -> Optional[tuple]:
    try:
        d = json.loads(obj)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("name") not in names:
        return None
    a = d.get("arguments", d.get("parameters", {}))
    return d["name"], (a if isinstance(a, str) else json.dumps(a, ensure_ascii=False))


# ----------------------------------------------------------------------------- responses

def _finish(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def _delta(delta: dict, out: Out) -> None:
    if out.content:
        delta["content"] = out.content
    elif out.reasoning or out.calls:
        delta.pop("content", None)
    if out.reasoning:
        delta["reasoning_content"] = out.reasoning
    if out.calls:
        delta["tool_calls"] = out.calls


class Chunker:
    """A streaming chat request's chunks (responses.Chunker) with each choice's answer
    read by its reader (`make()`: one per choice): content, reasoning_content and
    tool_calls deltas as they come."""

    def __init__(self, inner, make):
        self.inner, self.make = inner, make
        self.readers: dict = {}

    def _reader(self, choice: int):
        if choice not in self.readers:
            self.readers[choice] = self.make()
        return self.readers[choice]

    def chunk(self, ev) -> Optional[dict]:
        if isinstance(ev, TokenEvent):
            out = self._reader(ev.choice).push(ev)
            if not out and ev.token_id >= 0 and self.inner.ids is False \
                    and not (self.inner.logprobs and ev.logprob):
                return None
            c = self.inner.chunk(replace(ev, text=out.content))
            _delta(c["choices"][0]["delta"], out)
            return c
        if isinstance(ev, End):
            rd = self._reader(ev.choice)
            out = rd.finish()
            c = self.inner.chunk(replace(ev, finish_reason=_finish(ev.finish_reason,
                                                                    rd.called)))
            _delta(c["choices"][0]["delta"], out)
            return c
        return self.inner.chunk(ev)

    def usage_chunk(self, usage: dict) -> dict:
        return self.inner.usage_chunk(usage)


def rewrite_body(body: dict, events: list, make) -> dict:
    """A non-streaming chat body: each choice's message as its reader reads the events
    (content, reasoning_content, tool_calls), as the stream would give it."""
    readers: dict = {}
    outs: dict = {}
    for ev in events:
        if isinstance(ev, TokenEvent):
            rd = readers.get(ev.choice)
            if rd is None:
                rd = readers[ev.choice] = make()
            outs.setdefault(ev.choice, []).append(rd.push(ev))
    for ch in body["choices"]:
        rd = readers.get(ch["index"])
        if rd is None:
            continue
        parts = outs.get(ch["index"], []) + [rd.finish()]
        content = "".join(o.content for o in parts)
        reasoning = "".join(o.reasoning for o in parts)
        calls: dict = {}
        for o in parts:
            for d in o.calls:
                c = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                c["function"]["name"] += d["function"].get("name", "")
                c["function"]["arguments"] += d["function"].get("arguments", "")
        msg = ch["message"]
        msg["content"] = content if content or not calls else None
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        ch["finish_reason"] = _finish(ch["finish_reason"], rd.called)
    return body
