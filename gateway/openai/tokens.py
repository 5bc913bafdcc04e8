"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, so clients
can count a prompt's tokens against ``max_model_len`` before sending it.

    /tokenize    {"prompt": "..."} or {"messages": [...]}  ->  {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [...]}                          ->  {"prompt": "..."}

``messages`` are rendered with the model's chat template (with the
generation prompt, as a chat completion would be), so ``count`` is what a
chat request would cost.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stallfree.gateway.edge.auth import request_key, tenant_of
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.inputs.protocol import ProtocolError, messages_field
from stallfree.gateway.openai.api import error_response, read_json

MAX_TOKENS = 1 << 20  # ids per detokenize call


async def tokenize(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    try:
        body = await read_json(request, client.settings.max_body_bytes, client.settings.body_timeout_s)
        _only(body, {"model", "prompt", "messages"})
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise ProtocolError("invalid_request", "give exactly one of messages or prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise ProtocolError("invalid_request", "prompt must be a string", param="prompt")
        chat = messages_field(messages) if messages is not None else None
        tok = client.tokenizer

        def encode() -> list[int]:
            return tok.encode(tok.render_chat(chat) if chat is not None else prompt or "")

        ids = await client.admission.tokenize(
            encode, tenant_of(request_key(request.headers), client.settings.api_keys, client.settings.admin_keys) or ""
        )
    except ProtocolError as exc:
        return error_response(exc.code, exc.message, param=exc.param)
    except Exception as exc:  # a template that fails on these messages is the caller's input
        return error_response("invalid_request", f"chat template failed: {exc}", param="messages")
    doc = {"count": len(ids), "max_model_len": client.snapshot.config.max_model_len, "tokens": ids, "token_strs": None}
    return JSONResponse(doc)


async def detokenize(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    try:
        body = await read_json(request, client.settings.max_body_bytes, client.settings.body_timeout_s)
        _only(body, {"model", "tokens"})
        ids = body.get("tokens")
        vocab = client.snapshot.vocab_size
        if (
            not isinstance(ids, list)
            or len(ids) > MAX_TOKENS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)
        ):
            raise ProtocolError(
                "invalid_request", f"tokens must be a list of token ids in [0, {vocab})", param="tokens"
            )
    except ProtocolError as exc:
        return error_response(exc.code, exc.message, param=exc.param)
    try:
        text = await client.admission.tokenize(lambda: client.tokenizer.decode(ids))
    except ProtocolError as exc:
        return error_response(exc.code, exc.message, param=exc.param)
    return JSONResponse({"prompt": text})


def _only(body: dict[str, object], allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise ProtocolError("invalid_request", f"{name}: unknown field", param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("invalid_request", "model must be a string", param="model")
