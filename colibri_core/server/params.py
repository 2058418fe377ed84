"""Reading OpenAI request bodies: every field checked, with a 400 that names it.

Fields are sorted into: implemented; documented by OpenAI but not implemented (a 400
naming the field when set to anything but its default); and unknown (ignored and logged,
or a 400 with --strict-params). Colibri's own fields: `experts_per_token` (experts per
token for this request; a `MODE:kN|` prompt prefix works too), `ignore_eos`, and `top_k`
(the sampling top-k, as llama-server and vLLM read it; 0 or -1: off); vLLM's
`repetition_penalty` and `min_p` (sampler.py). Structured output: OpenAI's
`response_format`, llama-server's `grammar` (GBNF) and `json_schema`, one of them, into
SamplingParams.grammar (runtime/constraints.py); tools: server/tools.py.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Optional

from .errors import bad_request
from ..runtime.sampler import SamplingParams
from .work import GenParams

log = logging.getLogger("colibri.server")

MAX_N = 16
MAX_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_STOPS = 4
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024            # entries: checked one by one on the event loop

COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
          "stream_options", "logit_bias", "user", "top_k", "experts_per_token", "ignore_eos",
          "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
          "return_token_ids", "response_format", "grammar", "json_schema", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar"}
COMPLETIONS = COMMON | {"prompt", "logprobs", "echo"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                 "parallel_tool_calls", "tools", "tool_choice"}


def _none_or(*ok):
    return lambda v: v is None or v in ok


def _unset(v) -> bool:
    return v is None or v == [] or v == {}


# field -> predicate "is this the default (harmless) value?"
NOT_IMPLEMENTED = {
    "completions": {"best_of": _none_or(1), "suffix": _unset},
    "chat": {"functions": _unset, "function_call": _none_or("none"), "audio": _unset,
             "modalities": lambda v: v is None or v == ["text"],
             "prediction": _unset, "web_search_options": _unset, "reasoning_effort": _unset,
             "verbosity": _unset},
}


def check_fields(body: dict, route: str, strict: bool, request_id: str) -> None:
    known = COMPLETIONS if route == "completions" else CHAT
    missing = NOT_IMPLEMENTED[route]
    unknown = []
    for name, value in body.items():
        if name in known:
            continue
        if name in missing:
            if not missing[name](value):
                raise bad_request(f"{name}: not implemented by Colibri (got {value!r:.60}); "
                                  f"leave it out or at its default", param=name,
                                  code="unsupported_parameter")
            continue
        if strict:
            raise bad_request(f"{name[:64]!r}: unknown field (the server runs with "
                              f"--strict-params)", param=name[:64], code="unknown_parameter")
        unknown.append(name)
    if unknown:       # one line per request, however many fields (a body may hold 100,000)
        names = ", ".join(repr(n[:64]) for n in unknown[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        log.info("request %s: unknown field(s) %s%s ignored", request_id, names, more)


# ----------------------------------------------------------------------------- values

def integer(body, name, default=None, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad_request(f"{name}: expected an integer, got {v!r:.40}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise bad_request(f"{name}: {v} is out of range (allowed {rng})", param=name)
    return v


def _num(body, name, default, lo=None, hi=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{name}: expected a number, got {v!r:.40}", param=name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        left = "(" if lo_open else "["
        raise bad_request(f"{name}: {v} is out of range (allowed {left}{lo}, {hi}])",
                          param=name)
    return float(v)


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name}: expected true or false, got {v!r:.40}", param=name)
    return v


def _stop(body):
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) \
            or len(v) > MAX_STOPS:
        raise bad_request(f"stop: expected a non-empty string or a list of up to {MAX_STOPS} "
                          f"of them", param="stop")
    long = max(map(len, v), default=0)
    if long > MAX_STOP_CHARS:
        raise bad_request(f"stop: a stop string of {long:,} characters, at most "
                          f"{MAX_STOP_CHARS:,}", param="stop")
    return v


def _logit_bias(body, vocab: int):
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request("logit_bias: expected an object {token id: bias}", param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: {len(v):,} entries, at most {MAX_LOGIT_BIAS:,}",
                          param="logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias: key {k!r:.30} is not a token id",
                              param="logit_bias") from None
        if not 0 <= t < vocab:
            raise bad_request(f"logit_bias: token id {t} out of range 0..{vocab - 1}",
                              param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_request(f"logit_bias[{k}]: {b!r:.30} is not a number in -100..100",
                              param="logit_bias")
        out[t] = float(b)
    return out


def _prompts(body) -> list:
    p = body.get("prompt")
    if p is None:
        raise bad_request("prompt: missing (text, a list of texts, token ids, or a list of "
                          "token-id lists)", param="prompt", code="missing")
    if isinstance(p, str):
        out = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in p):
        out = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        out = p
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        for i, x in enumerate(p):
            if not x or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
                raise bad_request(f"prompt[{i}]: expected a non-empty list of token ids",
                                  param="prompt")
        out = p
    else:
        raise bad_request("prompt: expected text, a list of texts, token ids, or a list of "
                          "token-id lists", param="prompt")
    if len(out) > MAX_PROMPTS:
        raise bad_request(f"prompt: {len(out)} prompts, at most {MAX_PROMPTS} per request",
                          param="prompt")
    for i, x in enumerate(out):
        if isinstance(x, str) and not x:
            raise bad_request(f"prompt[{i}]: empty text", param="prompt")
    return out


def sampling(body: dict, engine, route: str) -> GenParams:
    """The fields both routes share -> GenParams (prompts filled in by the caller)."""
    V = engine.model_cfg.vocab_size
    E = engine.num_experts
    max_tokens = integer(body, "max_tokens", None, lo=0)
    if route == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = integer(body, "max_completion_tokens", None, lo=0)
    if route == "completions" and "max_tokens" not in body:
        max_tokens = 16                                   # OpenAI's default for completions
    top_k = integer(body, "top_k", 0, lo=-1)
    seed = integer(body, "seed", None)
    if seed is not None and seed < 0:
        seed &= (1 << 64) - 1                           # numpy's generator takes seeds >= 0
    n = integer(body, "n", 1, lo=1, hi=MAX_N)
    sampling = dict(   # checked in the order the fields were always checked
        temperature=_num(body, "temperature", 1.0, lo=0.0, hi=100.0),
        top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(top_k, 0), seed=seed)
    stop = _stop(body)
    sampling.update(logit_bias=_logit_bias(body, V), ignore_eos=_bool(body, "ignore_eos"))
    k = integer(body, "experts_per_token", None, lo=1, hi=E)
    sampling.update(
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, lo=0.0, hi=10.0,
                                lo_open=True),
        min_p=_num(body, "min_p", 0.0, lo=0.0, hi=1.0))
    # a model without a tokenizer has no text to return: its ids always
    ids = _bool(body, "return_token_ids") or engine.tokenizer is None
    logprobs, echo = None, False
    if route == "completions":
        if body.get("logprobs") is not None:
            logprobs = integer(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo = _bool(body, "echo")
    elif _bool(body, "logprobs"):
        logprobs = integer(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs")
    grammar = structured(body)
    if grammar is not None and sampling["ignore_eos"]:
        raise bad_request("ignore_eos: not with a grammar or response_format (the grammar "
                          "decides where the answer ends)", param="ignore_eos")
    return GenParams(prompts=[], n=n, max_tokens=max_tokens, stop=stop,
                     sampling=SamplingParams(**sampling, logprobs=logprobs, grammar=grammar),
                     experts_per_token=k, echo=echo, return_token_ids=ids)


GRAMMAR_FIELDS = ("response_format", "grammar", "json_schema", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar")


async def sampling_off_loop(body: dict, engine, route: str) -> GenParams:
    """sampling(), in a thread when the body asks for a grammar: compiling and checking
    a large one takes 0.1-0.2 s (a 2,000-property schema, a 3,000-rule GBNF), which the
    event loop's streams must not wait for."""
    if any(body.get(f) is not None for f in GRAMMAR_FIELDS):
        import asyncio
        return await asyncio.to_thread(sampling, body, engine, route)
    return sampling(body, engine, route)


def structured(body: dict):
    """`response_format` (OpenAI: text, json_object, json_schema), `grammar` (GBNF, as
    llama-server reads it), `json_schema` (llama-server's bare schema) or vLLM's
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: at most one -> a
    checked constraints.Grammar, or None."""
    from ..runtime.constraints import Grammar, GrammarError
    rf = body.get("response_format")
    if rf is not None and rf == {"type": "text"}:
        rf = None
    given = [f for f, v in (("response_format", rf), *((f, body.get(f)) for f in (
        "grammar", "json_schema", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar"))) if v is not None]
    if len(given) > 1:
        raise bad_request(f"{', '.join(given)}: give one of them (each is a grammar for the "
                          f"whole answer)", param=given[1])
    if not given:
        return None
    field, param = given[0], given[0]
    try:
        if field == "grammar":
            if not isinstance(body["grammar"], str):
                raise bad_request("grammar: expected GBNF text (llama.cpp's grammar format)",
                                  param="grammar")
            return Grammar.gbnf(body["grammar"])
        if field in ("json_schema", "guided_json"):
            v = body[field]
            if field == "guided_json" and isinstance(v, str):     # vLLM takes it as text too
                v = _json_text(v, field)
            return Grammar.json_schema(v)
        if field in ("guided_regex", "guided_grammar"):
            if not isinstance(body[field], str):
                raise bad_request(f"{field}: expected text", param=field)
            return Grammar.regex(body[field]) if field == "guided_regex" \
                else Grammar.gbnf(body[field])                # GBNF or Lark
        if field == "guided_choice":
            v = body[field]
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise bad_request("guided_choice: expected a non-empty list of non-empty "
                                  "strings", param=field)
            return Grammar.lark("start: " + " | ".join(json.dumps(c) for c in v))
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            return Grammar.json_object()
        if kind != "json_schema":
            raise bad_request(f"response_format.type: {kind!r:.40} is not supported (text, "
                              f"json_object, json_schema)", param="response_format")
        js = rf.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise bad_request("response_format.json_schema: expected {name, schema, strict}",
                              param=param)
        param = "response_format.json_schema.schema"
        return Grammar.json_schema(js.get("schema", {}))
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param=param, code="invalid_grammar") from None


def _json_text(v: str, field: str):
    try:
        return json.loads(v)
    except ValueError:
        raise bad_request(f"{field}: not JSON", param=field) from None


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options: only allowed with stream: true",
                          param="stream_options")
    if not isinstance(so, dict):
        raise bad_request("stream_options: expected an object", param="stream_options")
    return stream, _bool(so, "include_usage")


def completion_prompts(body: dict) -> list:
    return _prompts(body)


def chat_messages(body: dict) -> tuple[list, Optional[int]]:
    """messages -> plain [{role, content: str}] for the template, and a MODE:kN| k found
    at the start of the last user message (stripped)."""
    from ..runtime.kselect import split_mode_prefix
    from ..errors import RequestError
    from .tools import template_message
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: expected a non-empty list of {role, content}",
                          param="messages", code="missing" if msgs is None else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]: expected an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role: {role!r:.30} is not supported (system, "
                              f"developer, user, assistant, tool)",
                              param=f"messages[{i}].role")
        for f in ("function_call", "audio"):
            if not _unset(m.get(f)):
                raise bad_request(f"messages[{i}].{f}: not implemented by Colibri",
                                  param=f"messages[{i}].{f}", code="unsupported_parameter")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}].type: {kind!r:.30} is not "
                                      f"supported (text only: no images, audio or files)",
                                      param=f"messages[{i}].content[{j}].type",
                                      code="unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content: expected text or a list of text parts",
                              param=f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content,
                    **template_message(m, i)})      # tool calls, tool results (tools.py)
    k = None
    for m in reversed(out):
        if m["role"] == "user":
            try:
                k, m["content"] = split_mode_prefix(m["content"])
            except RequestError as e:
                raise bad_request(str(e), param="messages") from None
            break
    return out, k


# ----------------------------------------------------------------------------- /v1/score

def _ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def score_request(body: dict, engine) -> tuple[list, Optional[int]]:
    """/v1/score's body -> (items [{prompt, candidates}], experts_per_token), every
    field's type checked and every length bound checked before anything is tokenized."""
    from ..errors import RequestTooLarge
    from .limits import MAX_SCORE_CHARS, MAX_SCORE_SEQUENCES, text_bound
    experts = integer(body, "experts_per_token", None, lo=1, hi=engine.num_experts)
    raw, single = body.get("items"), False
    if raw is None:
        raw, single = [{"prompt": body.get("prompt"), "candidates": body.get("candidates")}], True
    if not isinstance(raw, list) or not raw:
        raise bad_request("items: expected a non-empty list of {prompt, candidates}",
                          param="items")
    ctx = engine.model_cfg.max_position_embeddings
    max_chars = text_bound(engine)
    max_tokens = getattr(engine, "max_call_tokens", None)
    n_seq = chars = ids = 0
    for i, x in enumerate(raw):
        at = "" if single else f"items[{i}]."
        if not isinstance(x, dict):
            raise bad_request(f"items[{i}]: expected an object {{prompt, candidates}}, got "
                              f"{type(x).__name__}", param="items")
        prompt, cands = x.get("prompt"), x.get("candidates")
        if isinstance(prompt, str) and prompt:
            size, unit = len(prompt), max_chars
        elif _ids(prompt):
            size, unit = len(prompt), ctx
        else:
            raise bad_request(f"{at}prompt: expected non-empty text or a non-empty list of "
                              f"token ids, got {type(prompt).__name__}", param=f"{at}prompt")
        if not isinstance(cands, list) or not cands:
            raise bad_request(f"{at}candidates: expected a non-empty list of texts or "
                              f"token-id lists, got {type(cands).__name__}",
                              param=f"{at}candidates")
        n_seq += len(cands)
        if n_seq > MAX_SCORE_SEQUENCES:
            raise bad_request(f"more than {MAX_SCORE_SEQUENCES} candidates in one request",
                              param="items")
        text = isinstance(prompt, str)
        chars += size if text else 0
        for j, c in enumerate(cands):
            where = f"{at}candidates[{j}]"
            if isinstance(c, str) and c:
                if not text:
                    raise bad_request(f"{where}: a text candidate needs a text prompt",
                                      param=where)
                chars += size + len(c)
                total = size + len(c)
            elif _ids(c):
                total = (size if not text else 0) + len(c)
                ids += total
            else:
                raise bad_request(f"{where}: expected non-empty text or a non-empty list of "
                                  f"token ids, got {type(c).__name__}", param=where)
            if total > unit:
                what = "characters" if text else "tokens"
                raise bad_request(f"{where}: {total:,} {what} with its prompt, more than the "
                                  f"model's context of {ctx} tokens can hold (at most "
                                  f"{unit:,} {what})", param=where)
        if max_tokens is not None and ids > max_tokens:
            raise RequestTooLarge(f"items: over {max_tokens:,} token ids in one request "
                                  f"(each candidate's with its prompt's): the engine's "
                                  f"max_call_tokens; split the request")
        if chars > MAX_SCORE_CHARS:
            raise RequestTooLarge(f"items: over {MAX_SCORE_CHARS:,} characters to tokenize "
                                  f"in one request (each text candidate is tokenized after "
                                  f"its prompt): the server's limit; split the request")
    return raw, experts
