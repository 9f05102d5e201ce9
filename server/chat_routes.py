"""POST /v1/chat/completions, /v1/responses and /v1/messages: one request path for all three
(and Anthropic's /v1/messages/count_tokens, which stops after rendering the prompt).

Read the body, check the model name, then off the event loop: check the shared sampling fields,
convert with the recipe, render and encode the prompt (model family), and admit the request
(server/admission.py: SamplingParams, the engine's validation, max_tokens and grammar), so every
bad request fails with 4xx before work is queued. Then stream or collect the protocol chunks
(server/stream.py, server/framing.py); for chat-template models with tools, the output is rewritten
into each protocol's tool calls (server/tool_calls.py, server/tool_call_streams.py).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepserve.server.admission import (
    BodyExtras,
    admit,
    cache_salt,
    check_fields,
    check_protocol,
    pop_extras,
    recipe_options,
    sampling_params,
)
from deepserve.server.disconnect import ClientDisconnected, until_disconnect
from deepserve.server.errors import HTTPError
from deepserve.server.framing import FrameInfo, collect, sse_body
from deepserve.server.protocols import CHAT, MESSAGES, RESPONSES, ProtocolSpec, parse_request
from deepserve.server.response_store import expand, input_items, keep
from deepserve.server.state import (
    AppState,
    check_model,
    prepare_off_loop,
    read_json,
    tenant_of,
)
from deepserve.server.stream import GenerationJob, stream_chunks
from deepserve.server.tool_call_streams import (
    rewrite_message_stream,
    rewrite_response_stream,
    rewrite_stream,
)
from deepserve.server.tool_calls import (
    ToolPlan,
    rewrite_message,
    rewrite_response,
    rewrite_result,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# A collected body's text rewritten into the protocol's tool calls (chat-template models)
_REWRITES = {
    CHAT.name: rewrite_result,
    MESSAGES.name: rewrite_message,
    RESPONSES.name: rewrite_response,
}


@dataclass
class Prepared:
    job: GenerationJob
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # tool calls to parse out of the text (ChatML family)


async def handle(request: Request, spec: ProtocolSpec, state: AppState) -> Response:
    with state.backend.arriving():
        body = await read_json(request, state.config.max_body_bytes)
        check_model(body, state.config.served_model_name)
        stored = await _conversation(spec, body, state) if spec is RESPONSES else None
        prepared = await prepare_off_loop(
            request,
            body,
            state.family.inline_prepare_bytes,
            prepare,
            spec,
            body,
            state,
            tenant_of(request),
        )
    job = prepared.job
    chunks = stream_chunks(state.backend, job, state.family.recipe_tokenizer, state.metrics)
    info = FrameInfo(
        spec,
        job.request_id,
        state.config.served_model_name,
        job.params.n,
        prepared.include_usage,
        job,
        None if stored is None else partial(keep, state.responses, stored),
    )
    if prepared.stream:
        return StreamingResponse(
            _sse(chunks, info, prepared), media_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        result = await until_disconnect(request.receive, collect(chunks, info))
    except ClientDisconnected:
        return Response(status_code=499)
    if job.logprob_feed is not None:
        _set_logprobs(result, job.logprob_feed)
    if prepared.tools is not None:
        _REWRITES[spec.name](result, prepared.tools)
    if info.on_response is not None:
        await info.on_response(result)
    return JSONResponse(result)


def _sse(
    chunks: AsyncIterator[tuple[int, list]], info: FrameInfo, prepared: Prepared
) -> AsyncIterator[bytes]:
    """The stream's SSE events, with logprobs and tool calls put in where the protocol needs
    them (a Responses stream's calls before the response is stored)."""
    tools, spec = prepared.tools, info.spec
    store = info.on_response
    if tools is not None and spec is RESPONSES:
        info = replace(info, on_response=None)
    body = sse_body(chunks, info)
    if prepared.job.logprob_feed is not None:
        body = _stream_with_logprobs(body, prepared.job.logprob_feed)
    if tools is None:
        return body
    if spec is RESPONSES:
        return rewrite_response_stream(body, tools, store)
    return (rewrite_message_stream if spec is MESSAGES else rewrite_stream)(body, tools)


async def _conversation(spec: ProtocolSpec, body: dict, state: AppState) -> list[dict] | None:
    """Responses: put a previous response's conversation in front of the input; return the
    input to store with the answer (None with `store: false`)."""
    await expand(body, state.responses)
    return None if body.get("store") is False else input_items(body)


async def count_tokens(request: Request, state: AppState) -> Response:
    """Anthropic's POST /v1/messages/count_tokens: the prompt a Messages body would render to."""
    body = await read_json(request, state.config.max_body_bytes)
    check_model(body, state.config.served_model_name)
    n = await prepare_off_loop(
        request, body, state.family.inline_prepare_bytes, _count_tokens, body, state
    )
    return JSONResponse({"input_tokens": n})


def _count_tokens(body: dict, state: AppState) -> int:
    check_fields(body, state.max_prompt_chars)
    check_protocol("count_tokens", body)
    return len(prompt_token_ids(MESSAGES, body, state))


def prompt_token_ids(spec: ProtocolSpec, body: dict, state: AppState) -> list[int]:
    """The prompt a checked `spec` body renders to, as token ids (nothing admitted)."""
    extras = pop_extras(body, spec.allows_n, spec.max_tokens_fields)
    parsed = parse_request(
        spec, body, state.family.conversion_options, state.config.served_model_name
    )
    prompt = state.family.prepare(parsed.conversation, extras.parallel_tool_calls, extras.tools)
    return prompt.token_ids


def prepare(spec: ProtocolSpec, body: dict, state: AppState, tenant: str | None = None) -> Prepared:
    """Everything before queueing; runs on a worker thread. Raises HTTPError/InvalidRequestError."""
    check_fields(body, state.max_prompt_chars)
    salt = cache_salt(body, state.config, tenant)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    check_protocol(spec.name, body)
    extras = pop_extras(body, spec.allows_n, spec.max_tokens_fields)
    parsed = parse_request(
        spec, body, state.family.conversion_options, state.config.served_model_name
    )
    conv = parsed.conversation
    prompt = state.family.prepare(conv, extras.parallel_tool_calls, extras.tools)
    _check_tool_constraint(prompt.tools, extras)
    options = recipe_options(conv.inference_options, extras)
    params = sampling_params(options, extras, prompt.structured, salt)
    answer = state.family.answer_constraint(prompt.parsing, params.structured)
    if answer is not params.structured:
        params = replace(params, structured=answer)
    admitted = admit(state, prompt.token_ids, params)
    job = GenerationJob(parsed.request_id, admitted, prompt.parsing, parsed.make_generator)
    if prompt.push_text:
        job.text_tokenizer = state.backend.tokenizer
        if params.logprobs is not None:
            job.logprob_feed = _logprob_feed(spec)
    return Prepared(job, conv.stream, include_usage, prompt.tools)


def _check_tool_constraint(plan: ToolPlan | None, extras: BodyExtras) -> None:
    """A named or required tool_choice is a constraint of its own; a second one cannot hold too."""
    if plan is None or plan.constraint() is None:
        return
    if extras.structured or extras.schema or extras.json_object:
        raise HTTPError(
            400,
            f"tool_choice {plan.mode!r} constrains the output to tool calls; it cannot be "
            "combined with response_format or structured_outputs",
        )


def _logprob_feed(spec: ProtocolSpec) -> deque:
    """Logprobs for a request pushed as text (DeepSeek tools) are set here, outside the recipe.

    Only Chat Completions has a place for them that does not depend on how the recipe split the
    output into items; elsewhere they would be dropped, so the request is refused instead.
    """
    if spec is not CHAT:
        raise HTTPError(400, f"logprobs are not supported with tools on the {spec.name} endpoint")
    return deque()


async def _stream_with_logprobs(
    body: AsyncIterator[bytes], feed: deque[tuple[int, list[dict]]]
) -> AsyncIterator[bytes]:
    """Put each chunk's logprob entries on its SSE event.

    sse_body writes one event per recipe chunk in the order stream_chunks yields them, and the
    feed holds one entry per such chunk, so the head of the feed belongs to the next event; the
    events after the chunks (usage, [DONE], an error) find the feed empty.
    """
    async with aclosing(body):  # a client that leaves must still abort the engine request now
        async for event in body:
            if feed:
                _, entries = feed.popleft()
                if entries:
                    event = _with_entries(event, entries)
            yield event


def _with_entries(event: bytes, entries: list[dict]) -> bytes:
    head, sep, data = event.decode().partition("data: ")
    chunk = json.loads(data)
    for choice in chunk.get("choices") or []:
        choice["logprobs"] = {"content": entries, "refusal": None}
    return f"{head}{sep}{json.dumps(chunk, ensure_ascii=False)}\n\n".encode()


def _set_logprobs(result: dict, feed: deque[tuple[int, list[dict]]]) -> None:
    content: dict[int, list[dict]] = {}
    for index, entries in feed:
        content.setdefault(index, []).extend(entries)
    for i, choice in enumerate(result.get("choices") or []):
        choice["logprobs"] = {"content": content.get(i, []), "refusal": None}
