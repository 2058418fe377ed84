"""The API surface a llama-server or vLLM client expects beside completions: the model
names a request may give (404 `model_not_found` for any other), `GET /v1/models/{id}`,
and llama-server's `/tokenize` and `/detokenize` (docs/SERVE.md)."""
from __future__ import annotations

import argparse
import asyncio

from starlette.responses import JSONResponse

from .errors import ApiError, bad_request
from .limits import LIMITS, read_json


class VersionAction(argparse.Action):
    """`colibri --version`: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("colibri")
        except PackageNotFoundError:          # run from a checkout that is not installed
            v = "unknown (not installed)"
        print(f"colibri {v}")                 # stdout, as `python --version`
        parser.exit(0)


def model_names(settings) -> list[str]:
    """The served model's id first, then its --served-model-name aliases."""
    return list(dict.fromkeys([settings.model_id, *settings.aliases]))


def check_model(body: dict, settings) -> None:
    """A request naming a model this server does not serve is a 404, as OpenAI and vLLM
    answer it (a silent answer from another model is worse); no `model` is accepted."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise bad_request(f"model: expected a string, got {type(name).__name__}",
                          param="model")
    if name not in model_names(settings):
        raise not_found(name)


def not_found(name: str) -> ApiError:
    return ApiError(404, f"the model {name[:200]!r} does not exist on this server (served: "
                         f"the names GET /v1/models lists; --served-model-name adds aliases)",
                    param="model", code="model_not_found")


def model_card(server, name: str) -> dict:
    eng, st = server.backend, server.settings
    return {"id": name, "object": "model", "created": int(server.started_at),
            "owned_by": "colibri", "root": st.model_id,
            "max_model_len": st.ctx_size or eng.model_cfg.max_position_embeddings,
            "num_experts": eng.num_experts,
            "experts_per_token": eng.model_cfg.top_k}      # the model's default k


def echo_offsets(eng, ids: list, text: str) -> list:
    """Where each prompt token starts in the echoed text: the tokens decoded as a stream
    (tokenizer.StreamDecoder), so a special token (BOS) that the text leaves out, or a
    token's own text that differs from its piece of the whole ("▁The"), adds nothing
    wrong; clipped to the text (a text that tokenizes and decodes back differently)."""
    from ..runtime.tokenizer import StreamDecoder
    out, off = [], 0
    if eng.tokenizer is None:
        return [0] * len(ids)
    dec = StreamDecoder(eng.tokenizer)
    for t in ids:
        out.append(min(off, len(text)))
        off += len(dec.push(t))
    return out


def echo_text(eng, prompt, ids) -> str:
    if isinstance(prompt, str):
        from ..runtime.kselect import split_mode_prefix
        return split_mode_prefix(prompt)[1]
    return eng.tokenizer.decode(ids) if eng.tokenizer is not None else ""


def fit_context(gen, ctx_size) -> None:
    """--ctx-size: a prompt over it is a 400; the answer stops ("length") where prompt and
    answer fill it. Before the generation starts: its KV reservation follows."""
    if not ctx_size:
        return
    n = len(gen.prompt_ids)
    if n > ctx_size:
        raise bad_request(f"prompt: {n} tokens, more than the server's per-request context "
                          f"of {ctx_size} tokens (--ctx-size)", param="prompt",
                          code="context_length_exceeded")
    gen.max_new_tokens = min(gen.max_new_tokens, ctx_size - n)


def _tokenizer(eng):
    if eng.tokenizer is None:
        raise bad_request(f"this model ({eng.model_dir}) has no tokenizer.json: requests "
                          f"take and return token ids", code="no_tokenizer")
    return eng.tokenizer


async def model(server, request, rec):
    st = server.settings
    name = request.path_params["model_id"]
    if name not in model_names(st):
        raise not_found(name)
    return JSONResponse(model_card(server, name))


async def tokenize(server, request, rec):
    eng, st = server.backend, server.settings
    body = await read_json(request, LIMITS["generate"])
    check_model(body, st)
    text = body.get("content")
    if not isinstance(text, str):
        raise bad_request("content: expected text", param="content")
    flags = {}
    for f in ("add_special", "with_pieces"):
        v = body.get(f, False)
        if not isinstance(v, bool):
            raise bad_request(f"{f}: expected true or false, got {v!r:.40}", param=f)
        flags[f] = v
    tok = _tokenizer(eng)
    ids = await asyncio.to_thread(tok.encode, text)
    bos = eng.model_cfg.bos_token_id
    if flags["add_special"] and bos is not None:
        ids = [bos] + ids
    if flags["with_pieces"]:
        pieces = await asyncio.to_thread(lambda: [tok.token_text(i) for i in ids])
        return JSONResponse({"tokens": [{"id": i, "piece": s}
                                        for i, s in zip(ids, pieces)]})
    return JSONResponse({"tokens": ids})


async def detokenize(server, request, rec):
    eng, st = server.backend, server.settings
    body = await read_json(request, LIMITS["generate"])
    check_model(body, st)
    ids = body.get("tokens")
    V = eng.model_cfg.vocab_size
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("tokens: expected a list of token ids", param="tokens")
    bad = next((t for t in ids if not 0 <= t < V), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} out of range 0..{V - 1}",
                          param="tokens")
    tok = _tokenizer(eng)
    return JSONResponse({"content": await asyncio.to_thread(tok.decode, ids)})


def routes():
    """(path, route, name, methods) for app.py to mount: module-level functions of (the
    Server, the request, its Record), as app.py's."""
    return [("/v1/models/{model_id:path}", model, "model", ("GET",)),
            ("/tokenize", tokenize, "tokenize", ("POST",)),
            ("/detokenize", detokenize, "detokenize", ("POST",))]
