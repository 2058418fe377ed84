"""The API surface a llama-server or vLLM client expects beside completions: the model
names a request may give (404 `model_not_found` for any other), `GET /v1/models/{id}`,
and llama-server's `/tokenize` and `/detokenize` (docs/SERVE.md)."""
from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from .errors import ApiError, bad_request
from .limits import LIMITS, read_json


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
            "max_model_len": eng.model_cfg.max_position_embeddings,
            "num_experts": eng.num_experts, "top_k": eng.model_cfg.top_k}


def _tokenizer(eng):
    if eng.tokenizer is None:
        raise bad_request(f"this model ({eng.model_dir}) has no tokenizer.json: requests "
                          f"take and return token ids", code="no_tokenizer")
    return eng.tokenizer


def routes(server):
    """(path, handler, name, methods) for app.py to mount."""
    eng, st = server.backend, server.settings

    async def model(request, rec):
        name = request.path_params["model_id"]
        if name not in model_names(st):
            raise not_found(name)
        return JSONResponse(model_card(server, name))

    async def tokenize(request, rec):
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

    async def detokenize(request, rec):
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

    return [("/v1/models/{model_id:path}", model, "model", ("GET",)),
            ("/tokenize", tokenize, "tokenize", ("POST",)),
            ("/detokenize", detokenize, "detokenize", ("POST",))]
