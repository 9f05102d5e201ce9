"""server/tool_call_streams.py without a model: a Messages and a Responses stream whose text holds
a `<tool_call>` block, rewritten into each protocol's blocks / items, as the SDKs assemble them."""

from __future__ import annotations

import asyncio
import json

from deepserve.server.tool_call_streams import rewrite_message_stream, rewrite_response_stream
from deepserve.server.tool_calls import Tool, ToolPlan

AUTO = ToolPlan("auto", (Tool("f", None, {"type": "object"}),))
PIECES = ["Let me check. <tool", '_call>[{"name": "f", ', '"arguments": {"x": 1}}]</tool_call>']


def sse(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def run(stream) -> list[dict]:
    async def collect():
        return [json.loads(e.decode().partition("data: ")[2]) async for e in stream]

    return asyncio.run(collect())


async def events(payloads: list[dict]):
    for p in payloads:
        yield sse(p)


def message_stream() -> list[dict]:
    text = [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
        for t in PIECES
    ]
    return [
        {"type": "message_start", "message": {"content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *text,
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}},
        {"type": "message_stop"},
    ]


def test_a_messages_stream_sends_the_text_then_a_tool_use_block():
    out = run(rewrite_message_stream(events(message_stream()), AUTO))
    starts = [
        (e["index"], e["content_block"]["type"]) for e in out if e["type"] == "content_block_start"
    ]
    assert starts == [(0, "text"), (1, "tool_use")]
    text = "".join(e["delta"].get("text", "") for e in out if e["type"] == "content_block_delta")
    args = "".join(e["delta"].get("partial_json", "") for e in out if e.get("index") == 1
                   and e["type"] == "content_block_delta")  # fmt: skip
    assert text == "Let me check. " and json.loads(args) == {"x": 1}
    stops = [e["index"] for e in out if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    (delta,) = [e for e in out if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"


def response_stream() -> list[dict]:
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress"}
    part = {"type": "output_text", "text": "", "annotations": []}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    deltas = [{"type": "response.output_text.delta", **at, "delta": t} for t in PIECES]
    final = {"id": "resp_1", "status": "completed", "output": [{**item, "content": [part]}]}
    return [
        {"type": "response.created", "response": {**final, "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.content_part.added", **at, "part": part},
        *deltas,
        {"type": "response.output_text.done", **at, "text": "".join(PIECES)},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": {**item, "status": "completed"}},
        {"type": "response.completed", "response": final},
    ]  # fmt: skip


def test_a_responses_stream_sends_the_message_then_a_function_call_item_and_stores_both():
    stored = []

    async def keep(response: dict) -> None:
        stored.append(response)

    out = run(rewrite_response_stream(events(response_stream()), AUTO, keep))
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = [(e["output_index"], e["item"]["type"]) for e in out
             if e["type"] == "response.output_item.added"]  # fmt: skip
    assert added == [(0, "message"), (1, "function_call")]
    args = "".join(e["delta"] for e in out if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"x": 1}
    (final,) = [e["response"] for e in out if e["type"] == "response.completed"]
    message, call = final["output"]
    assert message["content"][0]["text"] == "Let me check. " and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "f",
        {"x": 1},
        "completed",
    )
    assert call["call_id"].startswith("call_") and stored == [final]
