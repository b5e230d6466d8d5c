"""The tokenizer routes (vLLM's): /tokenize, /detokenize and /tokenizer_info, which lets a client such
as lm-eval (`tokenizer_backend=remote`) work with the server's tokenizer instead of a local copy."""
from __future__ import annotations

from sanic import Sanic, response

from server.body import parse_json
from server.errors import APIError, wrong_type
from server.fields import Fields, token_id_list
from server.offload import in_thread
from server.protocol import ModelInfo, check_model_name, check_text_fits, conversation_ids, encode_text


def add_tokenizer_routes(app: Sanic) -> None:
    @app.post("/tokenize")
    async def tokenize(request):
        model = request.app.ctx.model
        ids, token_strs = await in_thread(_tokenize, request.body, model)
        out = {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}
        return response.json(out if token_strs is None else {**out, "token_strs": token_strs})

    @app.post("/detokenize")
    async def detokenize(request):
        return response.json({"prompt": await in_thread(_detokenize, request.body, request.app.ctx.model)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request):
        info = request.app.ctx.model.tokenizer.info()
        if info is None:
            raise APIError(404, "this model's tokenizer does not describe itself", code="not_found")
        return response.json(info)


def _tokenize(raw: bytes, model: ModelInfo) -> tuple[list[int], list[str | None] | None]:
    """vLLM's /tokenize: a prompt's ids, or a conversation's as its chat request renders them (its tools
    too); with return_token_strs, each id's vocabulary string."""
    body = parse_json(raw, model.limits.max_json_depth)
    f = Fields(body)
    check_model_name(f, model)
    add_special = f.boolean("add_special_tokens", True)
    want_strs = f.boolean("return_token_strs", False)
    if "messages" in body:
        ids, _ = conversation_ids(body, f, model)
    elif isinstance(body.get("prompt"), str):
        check_text_fits(body["prompt"], model.max_text_chars, "prompt")
        ids = encode_text(model.tokenizer, body["prompt"], add_special)
    else:
        raise wrong_type("'prompt' (a string) or 'messages' is required", "prompt")
    return ids, model.tokenizer.convert_ids_to_tokens(ids) if want_strs else None


def _detokenize(raw: bytes, model: ModelInfo) -> str:
    body = parse_json(raw, model.limits.max_json_depth)
    check_model_name(Fields(body), model)
    return model.tokenizer.decode(token_id_list(body.get("tokens"), model.vocab_size, "tokens"))
