"""gpt-oss's chat format (OpenAI's harmony): what the server does beyond rendering the
checkpoint's template.

A harmony template (its text has `<|start|>`, `<|channel|>` and `<|message|>`) renders the
conversation itself, tools included (a TypeScript `namespace functions` in a developer
message). The server:
- gives the template what it reads: an assistant message's reasoning (`reasoning_content`
  or `reasoning`, OpenAI-compatible servers' names) as `thinking`, and an assistant
  message with several tool calls as one message per call (the template renders the first
  call of a message only; harmony writes each call as its own message);
- ends an answer at `<|call|>` as at `<|return|>` (the checkpoints' config.json names
  `<|return|>` alone; their generation_config.json both);
- reads the answer's messages by their headers (`HarmonyReader`): the `analysis` channel
  is `reasoning_content`, `final` (and `commentary` to no one) `content`, a message to
  `functions.NAME` (`to=` before or after `<|channel|>`) a tool call whose arguments are
  its body, streamed as written;
- enforces `tool_choice` `required` or a named function with a grammar (`grammar`): an
  optional analysis message, then `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{arguments}<|call|>` with the arguments in the function's
  schema;
- puts a request's own grammar (`response_format`, `grammar`, ...) in the final message
  (`final_answer`): an optional analysis message, then `<|channel|>final<|message|>` and
  what the grammar allows.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from ..runtime.constraints import JSON_OPTIONS, Grammar, GrammarError
from ..runtime.events import TokenEvent
from .errors import bad_request
from .toolstream import Out

TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
          "<|return|>", "<|call|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
MAX_HEADER = 512                       # characters: a longer header is not one


def is_harmony(source: Optional[str]) -> bool:
    return bool(source) and all(t in source for t in ("<|start|>", "<|channel|>",
                                                      "<|message|>"))


class Harmony:
    """The tokenizer's harmony tokens (`of()`: None when it lacks one)."""

    def __init__(self, ids: dict):
        self.ids = ids
        self.text = {i: t for t, i in ids.items()}

    @classmethod
    def of(cls, tokenizer) -> Optional["Harmony"]:
        if tokenizer is None:
            return None
        ids = {t: tokenizer.token_to_id(t) for t in TOKENS}
        return None if None in ids.values() else cls(ids)

    def stop_ids(self) -> tuple:
        return self.ids["<|call|>"], self.ids["<|return|>"]

    def lark(self, token: str) -> str:
        return f"<[{self.ids[token]}]>"


def template_messages(messages: list) -> list:
    """Messages as the harmony template reads them: reasoning as `thinking`, one tool call
    per assistant message (the reasoning and content with the first)."""
    out = []
    for m in messages:
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = dict(m)
        if "reasoning_content" in m:
            m["thinking"] = m.pop("reasoning_content")
        calls = m.get("tool_calls") or []
        out.append({**m, "tool_calls": calls[:1]} if calls else m)
        for c in calls[1:]:
            out.append({"role": "assistant", "content": "", "tool_calls": [c]})
    return out


class HarmonyReader:
    """One choice's answer, message by message (the prompt ends with `<|start|>assistant`,
    so the first header follows at once). Text outside any message (a model that does not
    write harmony) is content, as written."""

    def __init__(self, h: Harmony, names: set):
        self.h, self.names = h, names
        self.state = "header"           # header | body | between
        self.header = ""
        self.route: object = "content"  # "content" | "reasoning" | a call's index
        self.n = 0

    @property
    def called(self) -> bool:
        return self.n > 0

    def push(self, ev: TokenEvent) -> Out:
        out = Out()
        sp = self.h.text.get(ev.token_id) if ev.token_id >= 0 else None
        if sp is None:
            self._text(ev.text, out)
        elif sp == "<|start|>":
            self._flush_header(out)
            self.state, self.header = "header", ""
        elif self.state == "header" and sp == "<|message|>":
            self._open(out)
        elif self.state == "header" and sp in ("<|channel|>", "<|constrain|>"):
            self.header += sp
        elif self.state == "body" and sp in ("<|end|>", "<|call|>", "<|return|>"):
            self.state = "between"
        return out

    def finish(self) -> Out:
        out = Out()
        self._flush_header(out)
        return out

    def _text(self, text: str, out: Out) -> None:
        if self.state == "body":
            if self.route == "content":
                out.content += text
            elif self.route == "reasoning":
                out.reasoning += text
            else:
                out.args(self.route, text)
        elif self.state == "header":
            self.header += text
            if len(self.header) > MAX_HEADER:            # not a header: content
                self._flush_header(out)
                self.state = "between"
        else:
            out.content += text

    def _flush_header(self, out: Out) -> None:
        """A header that never reached `<|message|>`: its text is content."""
        if self.state == "header" and self.header:
            out.content += re.sub(r"<\|[a-z]+\|>", "", self.header)
        self.header = ""

    def _open(self, out: Out) -> None:
        r = RECIPIENT.search(self.header)
        ch = CHANNEL.search(self.header)
        to = r.group(1) if r else None
        channel = ch.group(1) if ch else None
        if to is not None and to.startswith("functions.") and to[10:] in self.names:
            out.call(self.n, to[10:])
            self.route, self.n = self.n, self.n + 1
        elif to is None and channel == "analysis":
            self.route = "reasoning"
        else:                   # final, commentary to the user, a tool not offered
            self.route = "content"
        self.state, self.header = "body", ""


def _analysis(h: Harmony) -> list:
    return [f'analysis: {h.lark("<|channel|>")} "analysis" {h.lark("<|message|>")} '
            f'THOUGHT {h.lark("<|end|>")} {h.lark("<|start|>")} "assistant"',
            r"THOUGHT: /(.|\n)*/"]


def final_answer(inner: Grammar, h: Harmony) -> Grammar:
    """A request's own grammar (response_format, grammar, ...) as the final message's
    body, after an optional analysis message: the model keeps its channels, the answer
    (content) is what the grammar allows. A grammar that names harmony's tokens writes
    the channels itself: it is used as it is."""
    if any(t in inner.text or f"<[{i}]>" in inner.text for t, i in h.ids.items()):
        return inner                            # it writes the channels itself
    try:
        subs = json.loads(inner.compiled())["grammars"]
        subs[0] = {**subs[0], "name": "colibri_answer"}
        top = ["start: analysis? final",
               f'final: {h.lark("<|channel|>")} "final" {h.lark("<|message|>")} '
               f"@colibri_answer", *_analysis(h)]
        return Grammar.llguidance([{"lark_grammar": "\n".join(top)}] + subs)
    except (GrammarError, KeyError, ValueError, IndexError) as e:
        raise bad_request(f"response_format: this grammar cannot be the final message of "
                          f"a gpt-oss answer: {e}", param="response_format",
                          code="invalid_grammar") from None


def grammar(req, h: Harmony) -> Grammar:
    """`required` or a named function: an optional analysis message, then one call (the
    answer ends at its `<|call|>`) whose arguments the function's schema allows."""
    fns = req.by_name()
    chosen = [fns[req.choice]] if req.choice in fns else list(fns.values())
    lines = ["start: analysis? call", *_analysis(h),
             "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))]
    subs = []
    for i, f in enumerate(chosen):
        head = json.dumps(f"commentary to=functions.{f['name']} ")
        lines.append(f'call{i}: {h.lark("<|channel|>")} {head} {h.lark("<|constrain|>")} '
                     f'"json" {h.lark("<|message|>")} @args{i} {h.lark("<|call|>")}')
        schema = f.get("parameters") or {"type": "object"}
        subs.append({"name": f"args{i}", "json_schema": {**schema,
                                                          "x-guidance": JSON_OPTIONS}})
    try:
        return Grammar.llguidance([{"lark_grammar": "\n".join(lines)}] + subs)
    except GrammarError as e:
        raise bad_request(f"tools: a function's parameters are not a schema this server can "
                          f"enforce: {e}", param="tools", code="invalid_grammar") from None
