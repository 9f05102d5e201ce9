"""SSE streams of tool calls for chat-template models: each protocol's stream from the recipe,
its text parsed as it comes (server/tool_calls.py's `ToolCallParser`) and sent as that protocol's
calls: Chat Completions `delta.tool_calls`, Anthropic `tool_use` blocks with `input_json_delta`
pieces, Responses `function_call` items with argument deltas. Not here: the plans, the parser and
the rewrites of collected bodies (server/tool_calls.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from deepserve.server.tool_calls import ToolCallParser, ToolPlan, finish_reason, protocol_id


async def rewrite_stream(body: AsyncIterator[bytes], plan: ToolPlan) -> AsyncIterator[bytes]:
    """The SSE events of a Chat Completions stream with content deltas turned into tool calls."""
    parsers: dict[int, ToolCallParser] = {}
    async with aclosing(body):  # a client that leaves must still abort the engine request now
        async for event in body:
            head, sep, data = event.decode().partition("data: ")
            try:
                chunk = json.loads(data)
            except ValueError:  # [DONE]
                yield event
                continue
            if not isinstance(chunk, dict) or not chunk.get("choices"):
                yield event
                continue
            for choice in chunk["choices"]:
                parser = parsers.setdefault(choice.get("index", 0), ToolCallParser(plan))
                _rewrite_choice(choice, parser)
            yield f"{head}{sep}{json.dumps(chunk, ensure_ascii=False)}\n\n".encode()


def _rewrite_choice(choice: dict, parser: ToolCallParser) -> None:
    delta = choice.setdefault("delta", {})
    content, deltas = parser.feed(delta.get("content") or "")
    reason = choice.get("finish_reason")
    if reason is not None:
        rest, more = parser.finish(reason)
        content, deltas = content + rest, deltas + more
        choice["finish_reason"] = finish_reason(reason, parser)
    if "content" in delta or content:
        delta["content"] = content
    if deltas:
        delta["tool_calls"] = deltas


async def rewrite_message_stream(
    body: AsyncIterator[bytes], plan: ToolPlan
) -> AsyncIterator[bytes]:
    """The SSE events of an Anthropic Messages stream with the text's calls as `tool_use`
    blocks (`input_json_delta` pieces), the blocks renumbered, and `stop_reason` "tool_use"."""
    blocks = _MessageBlocks(ToolCallParser(plan))
    async with aclosing(_rewritten(body, blocks.rewrite)) as events:
        async for out in events:
            yield out if isinstance(out, bytes) else _named_sse(out)


class _MessageBlocks:
    """The content blocks a Messages stream sends once its text is parsed for calls: a text
    block opens when text is shown, a call's block when the call starts, each closing the one
    before it."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.index = -1  # the block open now (or the last one sent)
        self.open: str | None = None  # "text" | "tool_use" | "other" | None
        self.text_source: int | None = None  # the incoming text block's index

    def rewrite(self, payload: dict) -> list[dict]:
        kind = payload.get("type")
        if kind == "content_block_start" and payload["content_block"]["type"] == "text":
            self.text_source = payload["index"]
            return []  # opened when text is shown
        if kind == "content_block_delta" and payload["index"] == self.text_source:
            return self._emit(*self.parser.feed(payload["delta"].get("text") or ""))
        if kind == "content_block_stop" and payload["index"] == self.text_source:
            self.text_source = None
            return [*self._emit(*self.parser.finish(None)), *self._close()]
        if kind in ("content_block_start", "content_block_delta", "content_block_stop"):
            return self._passthrough(payload)
        if kind == "message_delta":
            delta = payload.get("delta") or {}
            if self.parser.calls and delta.get("stop_reason") == "end_turn":
                delta["stop_reason"] = "tool_use"
            return [*self._close(), payload]
        return [payload]

    def _emit(self, text: str, deltas: list[dict]) -> list[dict]:
        out = []
        if text:
            if self.open != "text":
                out += [*self._close(), *self._start({"type": "text", "text": ""}, "text")]
            out.append(self._delta({"type": "text_delta", "text": text}))
        for d in deltas:
            fn = d.get("function") or {}
            if "id" in d:  # a new call
                block = {
                    "type": "tool_use",
                    "id": protocol_id(d["id"], "toolu_"),
                    "name": fn["name"],
                }
                out += [*self._close(), *self._start({**block, "input": {}}, "tool_use")]
            if fn.get("arguments"):
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                )
        return out

    def _start(self, block: dict, kind: str) -> list[dict]:
        self.index += 1
        self.open = kind
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _passthrough(self, payload: dict) -> list[dict]:
        """A block of another kind (thinking): its own index after the blocks sent so far."""
        if payload["type"] == "content_block_start":
            out = self._close()
            self.index += 1
            self.open = "other"
            return [*out, {**payload, "index": self.index}]
        if payload["type"] == "content_block_stop":
            self.open = None
        return [{**payload, "index": self.index}]


_RESPONSE_FINAL = ("response.completed", "response.incomplete")


async def rewrite_response_stream(
    body: AsyncIterator[bytes],
    plan: ToolPlan,
    on_response: Callable[[dict], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of a Responses stream with the message text's calls as `function_call`
    items (`function_call_arguments` deltas), the items and sequence numbers renumbered; the
    final response carries the rewritten output, and is the one `on_response` stores."""
    items = _ResponseItems(ToolCallParser(plan))
    stored = False
    async with aclosing(_rewritten(body, items.rewrite)) as events:
        async for out in events:
            if isinstance(out, bytes):
                yield out
                continue
            if out["type"] in _RESPONSE_FINAL and on_response is not None and not stored:
                stored = True
                await on_response(out["response"])
            yield _named_sse(out)


async def _rewritten(
    body: AsyncIterator[bytes], rewrite: Callable[[dict], list[dict]]
) -> AsyncIterator[dict | bytes]:
    """Each event's payload through `rewrite` (the payloads to send for it); an event that is
    not JSON as it came."""
    async with aclosing(body):  # a client that leaves must still abort the engine request now
        async for event in body:
            _, _, data = event.decode().partition("data: ")
            try:
                payload = json.loads(data)
            except ValueError:
                yield event
                continue
            for out in rewrite(payload):
                yield out


def _named_sse(payload: dict) -> bytes:
    """An event named by its payload's type, as Anthropic's and Responses streams send them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class _ResponseItems:
    """The output items a Responses stream sends once its message text is parsed for calls: a
    message opens when text is shown, a call's item when the call starts, each closing the one
    before it; every event numbered anew."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.sequence = 0
        self.output: list[dict] = []  # the items sent, as they stand
        self.open: dict | None = None
        self.message: dict | None = None  # the incoming message item (its id, role, phase)

    def rewrite(self, payload: dict) -> list[dict]:
        kind = payload.get("type")
        item = payload.get("item") or {}
        if kind == "response.output_item.added" and item.get("type") == "message":
            self.message = item
            return []
        if kind == "response.output_text.delta":
            return self._number(self._emit(*self.parser.feed(payload.get("delta") or "")))
        if kind == "response.output_text.done":
            return self._number(self._emit(*self.parser.finish(None)))
        if kind == "response.output_item.done" and item.get("type") == "message":
            return self._number(self._close(item.get("status") or "completed"))
        if kind in ("response.content_part.added", "response.content_part.done"):
            return []
        if kind in _RESPONSE_FINAL:
            payload["response"]["output"] = [dict(i) for i in self.output]
        return self._number([payload])

    def _number(self, events: list[dict]) -> list[dict]:
        for e in events:
            e["sequence_number"] = self.sequence
            self.sequence += 1
        return events

    def _emit(self, text: str, deltas: list[dict]) -> list[dict]:
        out = []
        if text:
            if self.open is None or self.open["type"] != "message":
                out += [*self._close("completed"), *self._open_message()]
            self.open["content"][0]["text"] += text
            out.append(self._at("response.output_text.delta", content_index=0, delta=text,
                                logprobs=[]))  # fmt: skip
        for d in deltas:
            fn = d.get("function") or {}
            if "id" in d:  # a new call
                call = {"type": "function_call", "id": protocol_id(d["id"], "fc_"), "call_id": d["id"],
                        "name": fn["name"], "arguments": "", "status": "in_progress"}  # fmt: skip
                out += [*self._close("completed"), *self._add(call)]
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                out.append(
                    self._at("response.function_call_arguments.delta", delta=fn["arguments"])
                )
        return out

    def _open_message(self) -> list[dict]:
        source = self.message or {"id": "msg_" + uuid.uuid4().hex[:24], "role": "assistant"}
        count = sum(1 for i in self.output if i["type"] == "message")
        item = {**source, "id": source["id"] + (f"_{count}" if count else ""),
                "status": "in_progress", "content": []}  # fmt: skip
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        out = self._add(item)
        item["content"].append(part)
        return [*out, self._at("response.content_part.added", content_index=0, part=dict(part))]

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [{"type": "response.output_item.added", "item": added,
                 "output_index": len(self.output) - 1}]  # fmt: skip

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._at("response.output_text.done", content_index=0, text=part["text"],
                             logprobs=[], at=item),
                    self._at("response.content_part.done", content_index=0, part=dict(part),
                             at=item)]  # fmt: skip
            item["status"] = status
        else:
            out.append(self._at("response.function_call_arguments.done",
                                arguments=item["arguments"], at=item))  # fmt: skip
            item["status"] = "completed"
        index = self.output.index(item)
        return [
            *out,
            {"type": "response.output_item.done", "item": dict(item), "output_index": index},
        ]

    def _at(self, kind: str, at: dict | None = None, **fields) -> dict:
        item = at or self.open
        return {"type": kind, "item_id": item["id"], "output_index": self.output.index(item),
                **fields}  # fmt: skip
