"""HTTP framing of recipe protocol chunks: SSE for streams, accumulated JSON otherwise.

With n > 1 (Chat Completions only) each choice has its own StreamProcessor, whose chunks all say
`index: 0`; here they get their real index, and usage is summed over the choices. A Chat
Completions stream carries usage only in a final `choices: []` chunk, when
`stream_options.include_usage` asks for it.
Not here: producing the chunks (server/stream.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from deepserve.engine.errors import InvalidRequestError
from deepserve.server.errors import anthropic_error, openai_error
from deepserve.server.protocols import CHAT, MESSAGES, ProtocolSpec
from deepserve.server.stream import GenerationJob

log = logging.getLogger(__name__)
_FINAL_EVENTS = ("response.completed", "response.incomplete")  # the whole response, once


@dataclass
class FrameInfo:
    spec: ProtocolSpec
    request_id: str
    model: str
    n: int
    include_usage: bool  # Chat Completions stream_options.include_usage (the usage chunk)
    job: GenerationJob  # its prompt counts are known once the first chunk arrived
    # Responses: called with the finished response object (to store it for previous_response_id)
    on_response: Callable[[dict], Awaitable[None]] | None = None


def sse(event: str | None, data: str) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


async def sse_body(
    chunks: AsyncIterator[tuple[int, list]], info: FrameInfo
) -> AsyncIterator[bytes]:
    usage: dict[int, dict] = {}
    cls = info.spec.response_cls
    async with aclosing(chunks):
        try:
            async for index, items in chunks:
                for ch in items:
                    if info.spec is CHAT:
                        yield _chat_event(ch.to_json(), index, info.n, usage)
                        continue
                    name = cls.sse_event_name(ch)
                    yield sse(name, ch.to_json())
                    if name in _FINAL_EVENTS and info.on_response is not None:
                        await info.on_response(json.loads(ch.to_json())["response"])
                    if name == "response.incomplete":
                        yield _completed_after_incomplete(ch.to_json())
        except Exception as e:  # a failure after headers went out: tell the client in-band
            log.exception("stream %s failed", info.request_id)
            status = 400 if isinstance(e, InvalidRequestError) else 500  # whose fault it was
            yield _error_event(info, status, str(e) or type(e).__name__)
            return
    if info.spec is CHAT and info.include_usage:
        yield sse(None, json.dumps(_usage_chunk(info, usage)))
    done = cls.sse_done_data()
    if done:
        yield sse(None, done)


def _chat_event(data: str, index: int, n: int, usage: dict[int, dict]) -> bytes:
    """One Chat Completions chunk, usage held back for the final `choices: []` chunk.

    OpenAI sends usage only when `stream_options.include_usage` asks, and then in a chunk of
    its own after the last choice chunk; the recipe puts it on the last choice chunk. Only a
    chunk that carries usage (or a choice to re-index) is parsed.
    """
    if n == 1 and '"usage":null' in data:
        return sse(None, data)
    return sse(None, json.dumps(_reindex(data, index, usage)))


def _completed_after_incomplete(event_json: str) -> bytes:
    """A `response.completed` event repeating the incomplete response (status stays incomplete).

    The recipe ends a length-capped Responses stream with `response.incomplete`, as OpenAI's API
    does; the openai SDK's `get_final_response()` (and vLLM-style clients) wait for
    `response.completed`, so both are sent.
    """
    event = json.loads(event_json)
    event["type"] = "response.completed"
    if isinstance(event.get("sequence_number"), int):
        event["sequence_number"] += 1
    return sse("response.completed", json.dumps(event))


def _reindex(chunk_json: str, index: int, usage: dict[int, dict]) -> dict:
    chunk = json.loads(chunk_json)
    for choice in chunk.get("choices", []):
        choice["index"] = index
    if chunk.get("usage"):
        usage[index] = chunk["usage"]
    chunk["usage"] = None
    return chunk


def _usage_chunk(info: FrameInfo, usage: dict[int, dict]) -> dict:
    return {
        "id": info.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": info.model,
        "choices": [],
        "usage": _sum_usage(list(usage.values())),
    }


def _sum_usage(usages: list[dict]) -> dict | None:
    if not usages:
        return None
    total = dict(usages[0])
    total["completion_tokens"] = sum(u.get("completion_tokens", 0) for u in usages)
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]
    return total


def _error_event(info: FrameInfo, status: int, message: str) -> bytes:
    if info.spec is MESSAGES:
        return sse("error", json.dumps(anthropic_error(status, message)))
    return sse(None, json.dumps(openai_error(status, message)))


async def collect(chunks: AsyncIterator[tuple[int, list]], info: FrameInfo) -> dict:
    """Accumulate every chunk into the protocol's response object(s); one JSON body."""
    responses: list = []
    async with aclosing(chunks):
        async for index, items in chunks:
            if not responses:
                responses = [_new_response(info) for _ in range(info.n)]
            for ch in items:
                responses[index].accumulate(ch)
    bodies = [json.loads(r.to_json()) for r in responses]
    return bodies[0] if info.n == 1 else _merge_choices(bodies)


def _new_response(info: FrameInfo):
    return info.spec.response_cls(
        info.request_id,
        info.model,
        int(time.time()),
        info.job.prompt_tokens,
        info.job.cached_tokens,
    )


def _merge_choices(bodies: list[dict]) -> dict:
    merged = dict(bodies[0])
    merged["choices"] = []
    for i, body in enumerate(bodies):
        for choice in body.get("choices", []):
            merged["choices"].append({**choice, "index": i})
    merged["usage"] = _sum_usage([b["usage"] for b in bodies if b.get("usage")])
    return merged
