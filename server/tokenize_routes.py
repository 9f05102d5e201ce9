"""vLLM's POST /tokenize and /detokenize: the served model's token ids for a prompt or a chat
(rendered as Chat Completions renders it, with the generation prompt), and the text of token
ids, without generating. Not here: the generating routes (server/chat_routes.py,
server/completions.py).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepserve.server.admission import check_fields
from deepserve.server.chat_routes import prompt_token_ids
from deepserve.server.errors import HTTPError
from deepserve.server.family import INLINE_PREPARE_BYTES, encode_text
from deepserve.server.protocols import CHAT
from deepserve.server.state import AppState, check_model, prepare_off_loop, read_json

# A chat body's fields that shape its prompt; the rest of a /tokenize body is not sent on.
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "thinking",
                "reasoning_effort", "chat_template_kwargs")  # fmt: skip


async def tokenize(request: Request, state: AppState) -> Response:
    body = await _body(request, state)
    ids = await prepare_off_loop(request, body, INLINE_PREPARE_BYTES, _token_ids, body, state)
    limit = state.max_model_len
    return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids})


async def detokenize(request: Request, state: AppState) -> Response:
    body = await _body(request, state)
    tokens = body.get("tokens")
    vocab = state.backend.tokenizer.get_vocab_size()
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise HTTPError(400, f"tokens must be a list of token ids below {vocab}", param="tokens")
    text = state.backend.tokenizer.decode(tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


async def _body(request: Request, state: AppState) -> dict:
    body = await read_json(request, state.config.max_body_bytes)
    body.setdefault("model", state.config.served_model_name)  # optional here, as in vLLM
    check_model(body, state.config.served_model_name)
    return body


def _token_ids(body: dict, state: AppState) -> list[int]:
    if "messages" in body:
        chat = {"model": body["model"], **{k: body[k] for k in _CHAT_FIELDS if k in body}}
        check_fields(chat, state.max_prompt_chars)
        return prompt_token_ids(CHAT, chat, state)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise HTTPError(400, "send prompt (a string) or messages (a chat)", param="prompt")
    if len(prompt) > state.max_prompt_chars:
        raise HTTPError(400, "prompt is longer than any prompt this model can take", param="prompt")
    return encode_text(state.backend.tokenizer, prompt)
