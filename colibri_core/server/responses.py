"""Engine events (runtime/events.py) -> OpenAI response bodies and stream chunks."""
from __future__ import annotations

import json
from typing import Optional

from ..runtime.events import End, Start, TokenEvent


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _completion_lp(entries: list, offsets: list) -> dict:
    """OpenAI completions log-probs: tokens, token_logprobs, top_logprobs, text_offset
    (each token's start in the choice's returned text, echo included: `offsets`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
    for tok, lp, top in entries:
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {t: v for t, v in top})
    return out


def _chat_lp(entries: list) -> dict:
    def item(t, v):
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in top or []]}
                        for tok, lp, top in entries]}


class Collector:
    """Builds the non-streaming body of one request from its events."""

    def __init__(self, chat: bool, logprobs: bool, ids: bool = False):
        self.chat = chat
        self.logprobs = logprobs
        self.ids = ids                    # token_ids / prompt_token_ids on each choice
        self.choices: dict[int, dict] = {}
        self.sets: list = []              # distinct (generation, id), in order of use

    def add(self, ev) -> None:
        c = self.choices.setdefault(ev.choice, {"text": [], "lp": [], "echo": "",
                                                "echo_lp": None, "finish": None, "set": None,
                                                "off": [], "chars": 0, "ids": [],
                                                "prompt_ids": []})
        if isinstance(ev, Start):
            c["prompt_ids"] = ev.prompt_ids
            c["echo"] = ev.echo_text
            c["echo_lp"] = ev.echo_logprobs
            c["off"] = list(ev.echo_offsets or [])
            c["chars"] = len(ev.echo_text)
        elif isinstance(ev, TokenEvent):
            c["text"].append(ev.text)
            if ev.token_id >= 0:          # -1: held-back text, no token of its own
                c["ids"].append(ev.token_id)
            if ev.logprob is not None:
                c["lp"].append(ev.logprob)
                c["off"].append(c["chars"])
            c["chars"] += len(ev.text)
            if not self.sets or self.sets[-1][0] != ev.expert_set_generation:
                self.sets.append((ev.expert_set_generation, ev.expert_set_id))
            if c["set"] is None:      # a choice is pinned: its tokens' one set
                c["set"] = ev.expert_set
        elif isinstance(ev, End):
            c["finish"] = ev.finish_reason

    def body(self, rid: str, created: int, model: str, usage: dict, fallback_set) -> dict:
        sets = self.sets or [fallback_set]
        choices = []
        for i in sorted(self.choices):
            c = self.choices[i]
            text = "".join(c["text"])
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": _chat_lp(c["lp"]) if self.logprobs else None,
                                "finish_reason": c["finish"], "expert_set": c["set"]})
                self._ids(choices[-1], c)
            else:
                lp = None
                if self.logprobs:
                    entries = (c["echo_lp"] or []) + c["lp"]
                    lp = _completion_lp(entries, c["off"])
                choices.append({"index": i, "text": c["echo"] + text, "logprobs": lp,
                                "finish_reason": c["finish"], "expert_set": c["set"]})
                self._ids(choices[-1], c)
        # expert_sets with expert_set_generation / _id: deprecated for one release (each
        # choice's expert_set names its set)
        return {"id": rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": created, "model": model, "choices": choices, "usage": usage,
                "expert_sets": [{"expert_set_generation": g, "expert_set_id": s}
                                for g, s in sets]}


    def _ids(self, choice: dict, c: dict) -> None:
        if self.ids:
            choice["prompt_token_ids"] = [int(t) for t in c["prompt_ids"]]
            choice["token_ids"] = c["ids"]


class Chunker:
    """Builds the SSE chunks of one streaming request from its events."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, logprobs: bool,
                 include_usage: bool, ids: bool = False):
        self.base = {"id": rid, "object": "chat.completion.chunk" if chat else
                     "text_completion", "created": created, "model": model}
        self.chat = chat
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.last_set: Optional[tuple] = None
        self.chars: dict[int, int] = {}   # choice -> characters sent (text_offset)
        self.ids = ids                    # token_ids per chunk, prompt_token_ids first

    def _chunk(self, choice: dict, ev=None) -> dict:
        d = {**self.base, "choices": [choice]}
        if ev is not None and isinstance(ev, TokenEvent) and \
                (ev.expert_set_generation, ev.expert_set_id) != self.last_set:
            self.last_set = (ev.expert_set_generation, ev.expert_set_id)
            d["expert_set"] = ev.expert_set
            # the two old fields: deprecated, kept one release
            d["expert_set_generation"], d["expert_set_id"] = self.last_set
        if self.include_usage:
            d["usage"] = None
        return d

    def chunk(self, ev) -> Optional[dict]:
        out = self._chunk_of(ev)
        if out is not None and self.ids:          # vLLM's return_token_ids, per chunk
            ch = out["choices"][0]
            if isinstance(ev, Start):
                ch["prompt_token_ids"] = [int(t) for t in ev.prompt_ids]
            elif isinstance(ev, TokenEvent):
                ch["token_ids"] = [ev.token_id] if ev.token_id >= 0 else []
        return out

    def _chunk_of(self, ev) -> Optional[dict]:
        if isinstance(ev, Start):
            if self.chat:
                return self._chunk({"index": ev.choice, "delta": {"role": "assistant",
                                                                  "content": ""},
                                    "logprobs": None, "finish_reason": None})
            self.chars[ev.choice] = len(ev.echo_text)
            if ev.echo_text or ev.echo_logprobs or self.ids:
                lp = _completion_lp(ev.echo_logprobs, ev.echo_offsets) if self.logprobs and \
                    ev.echo_logprobs else None
                return self._chunk({"index": ev.choice, "text": ev.echo_text, "logprobs": lp,
                                    "finish_reason": None})
            return None
        if isinstance(ev, TokenEvent):
            if self.chat:
                lp = _chat_lp([ev.logprob]) if self.logprobs and ev.logprob else None
                return self._chunk({"index": ev.choice, "delta": {"content": ev.text},
                                    "logprobs": lp, "finish_reason": None}, ev)
            off = self.chars.get(ev.choice, 0)
            self.chars[ev.choice] = off + len(ev.text)
            lp = _completion_lp([ev.logprob], [off]) if self.logprobs and ev.logprob else None
            return self._chunk({"index": ev.choice, "text": ev.text, "logprobs": lp,
                                "finish_reason": None}, ev)
        if isinstance(ev, End):
            if self.chat:
                return self._chunk({"index": ev.choice, "delta": {}, "logprobs": None,
                                    "finish_reason": ev.finish_reason})
            return self._chunk({"index": ev.choice, "text": "", "logprobs": None,
                                "finish_reason": ev.finish_reason})
        return None

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.base, "choices": [], "usage": usage}
