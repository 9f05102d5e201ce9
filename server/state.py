"""`AppState`: the objects every route needs, built once by the app factory and passed explicitly.

Also the request-level helpers every route shares: reading a JSON body within the size limit and
preparing a request off the event loop when it is large. Not here: the disconnect watcher
(server/disconnect.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from deepserve.engine.contract import EngineClient
from deepserve.server.config import ServerConfig
from deepserve.server.errors import HTTPError
from deepserve.server.family import ModelFamily
from deepserve.server.metrics import ServerMetrics
from deepserve.server.response_store import ResponseStore, ResponseStoreConfig

T = TypeVar("T")


@dataclass
class AppState:
    backend: EngineClient
    family: ModelFamily
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(ResponseStoreConfig()))
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # More characters of text than this cannot fit the context as tokens, so a body holding more
    # is refused before the slow tokenization (computed at start-up, from the vocabulary).
    max_prompt_chars: int = field(init=False)

    def __post_init__(self) -> None:
        longest = longest_token_chars(self.backend.tokenizer)
        # The body's other strings (keys, names, a schema) are not prompt text: room for them.
        self.max_prompt_chars = self.max_model_len * longest + 2**17

    @property
    def max_model_len(self) -> int:
        return self.backend.card.limits.max_model_len


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token spans: its longest vocabulary entry (byte-level
    entries spell one character per byte, so they bound the decoded text too)."""
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)))


def tenant_of(request: Request) -> str | None:
    """Who sent the request, as the front middleware recorded it (None without API keys)."""
    return request.scope.get("state", {}).get("tenant")


# Fields that make preparing a request compile a grammar: even a short regex or schema can take
# seconds, so such requests are always prepared on a thread.
_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "tools",
    "text",
)


async def prepare_off_loop(
    request: Request, body: dict, inline_bytes: int, fn: Callable[..., T], *args: Any
) -> T:
    """`fn(*args)` inline for a request `body` of at most `inline_bytes` without an output
    constraint (the family's `inline_prepare_bytes`), else on a worker thread."""
    size = request.headers.get("content-length")
    small = size is not None and size.isdigit() and int(size) <= inline_bytes
    if small and not any(k in body for k in _CONSTRAINT_FIELDS):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object. Read chunk by chunk with a running count, so a body over the
    limit (chunked ones have no Content-Length to refuse them by) is a 413 as soon as it passes
    the limit, never buffered whole."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPError(413, f"request body exceeds the limit of {max_bytes} bytes")
    try:
        return json_object(body)
    except ValueError as e:
        raise HTTPError(400, str(e)) from e


def json_object(raw: bytes) -> dict:
    """A body that must be one JSON object (ValueError naming what is wrong); the worker's
    internal API reads its bodies with it too."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError included
        raise ValueError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def _no_constant(name: str) -> float:
    # json.loads takes NaN and Infinity, which are not JSON; a NaN top_k crashed sampling.
    raise ValueError(f"{name} is not a JSON number")


def check_model(body: dict, served_name: str) -> None:
    model = body.get("model")
    if model is None:
        raise HTTPError(400, "the request names no model", param="model")
    if model != served_name:
        raise HTTPError(
            404,
            f"the model {model!r} does not exist; this server serves {served_name!r}",
            param="model",
        )
