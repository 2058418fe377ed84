"""The server's limits, and reading request bodies within them.

Every limit is checked before the work it bounds, so that no request can stall the
others or hold memory the next one needs (docs/ROBUSTNESS.md, "The server's limits"):

    body size per route         LIMITS (413 before the body is read, from Content-Length,
                                or as soon as the bytes read pass it)
    headers, body arrival       HEADER_TIMEOUT_S (protocol.py), BODY_IDLE_S / BODY_TIMEOUT_S
                                (408 and the connection closed)
    JSON nesting                the parser's own limit (nesting.json_loads): a 400
    text to tokenize            `text_bound()`: characters a context can hold, checked
                                before tokenizing (a tokenizer holds the GIL)
    answer size                 MAX_ANSWER_UNITS tokens, each counting 1 + its log-prob
                                alternatives (`check_answer`: 413 naming the limit)
"""
from __future__ import annotations

import asyncio
import re

from starlette.requests import ClientDisconnect, Request

from ..errors import RequestTooLarge
from ..nesting import TooDeep, json_loads
from .errors import ApiError, bad_request

KiB, MiB = 1024, 1024 * 1024
LIMITS = {"generate": 4 * MiB, "score": 16 * MiB, "upload": 64 * MiB, "small": 64 * KiB}
MAX_SCORE_SEQUENCES = 4096
# Characters one /v1/score request may have tokenized (each candidate's text is
# tokenized after its prompt's): the same figure as its body limit.
MAX_SCORE_CHARS = 16 * MiB
# Tokens one answer may carry, each counting 1 + its log-prob alternatives (about
# 300 bytes of server memory and 40 of JSON each): an answer stays under ~80 MiB.
MAX_ANSWER_UNITS = 1 << 18
HEADER_TIMEOUT_S = 10.0       # from a connection's (or a next request's) first byte
BODY_IDLE_S = 10.0            # the longest pause between two pieces of a body
BODY_TIMEOUT_S = 60.0         # the whole body


class ClientGone(Exception):
    """The client closed its connection before its request's body was read."""


def text_bound(engine, spare: int = 0) -> int:
    """Characters beyond which a text is sure to be longer than the model's context
    (+ `spare` tokens): no token stands for more than `max_token_chars` characters."""
    tok = engine.tokenizer
    per = tok.max_token_chars if tok is not None else 1
    return (engine.model_cfg.max_position_embeddings + spare) * per


def check_answer(units: int, what: str) -> None:
    """413 before any work when an answer would carry more than MAX_ANSWER_UNITS."""
    if units > MAX_ANSWER_UNITS:
        raise RequestTooLarge(
            f"{what}: the answer would carry {units:,} tokens and log-prob alternatives, over "
            f"the server's limit of {MAX_ANSWER_UNITS:,} (max_tokens x n x prompts, times "
            f"1 + logprobs); ask for fewer tokens, choices or alternatives")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, within `limit` bytes, with no pause over the server's client timeout
    (the app's state; BODY_IDLE_S by default) and all of it within 6 times that."""
    idle_s = float(getattr(request.app.state, "client_timeout_s", BODY_IDLE_S))
    total_s = idle_s * (BODY_TIMEOUT_S / BODY_IDLE_S)
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"request body of {int(cl)} bytes is over this route's limit of "
                            f"{limit} bytes", code="body_too_large")
    loop = asyncio.get_running_loop()
    end = loop.time() + total_s
    chunks, size = [], 0
    pieces = request.stream().__aiter__()
    while True:
        wait = min(idle_s, end - loop.time())
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                chunk = await pieces.__anext__()
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive in time (at most "
                                f"{idle_s:g} s between two pieces, {total_s:g} s in all)",
                           code="body_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientGone() from None
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over this route's limit of {limit} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> dict:
    raw = await read_body(request, limit)
    try:
        body = json_loads(raw)
    except TooDeep:
        raise bad_request("request body: JSON nested too deeply (the parser's limit is "
                          "about 1000 levels)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body: expected a JSON object", code="invalid_json")
    return body


# an expert's name in the upload routes (the live folder's and the candidates'), training
EXPERT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_upload(settings, name: str) -> None:
    """An upload route's two checks before its body is read: uploads on, a valid name."""
    if not settings.allow_expert_upload:
        raise ApiError(403, "expert upload is off: start the server with "
                            "--allow-expert-upload (an upload runs native code)",
                       type="permission_error", code="upload_disabled")
    if not EXPERT_NAME_RE.fullmatch(name):
        raise bad_request(f"expert name {name!r:.70}: expected letters, digits, '_', '.', "
                          f"'-' (1-64, not starting with '.')", param="name")
