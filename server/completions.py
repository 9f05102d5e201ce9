"""POST /v1/completions: plain prompts (text or token ids), as benchmark tools send them.

The recipe covers the chat protocols only, so this legacy OpenAI shape is built here: the prompt
is encoded as is (no chat template), text is decoded incrementally per choice, and stop strings
end a choice. Not here: chat requests (server/chat_routes.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers.decoders import DecodeStream

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.errors import HTTPError
from deepserve.server.framing import sse
from deepserve.server.state import (
    AppState,
    ClientDisconnected,
    check_model,
    read_json,
    until_disconnect,
)
from deepserve.server.stream import Timing, record_prompt, record_tokens

_ALLOWED = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "user",
    "echo",
    "best_of",
    "suffix",
}


async def handle(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config.max_body_bytes)
    check_model(body, state.config.served_model_name)
    prompt_ids, params, stops = await asyncio.to_thread(_prepare, body, state)
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    events = _generate(state, rid, prompt_ids, params, stops)
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sse_events = _sse(events, rid, state, usage, len(prompt_ids))
        return StreamingResponse(sse_events, media_type="text/event-stream")
    try:
        collected = _collect(events, rid, state, params.n, len(prompt_ids))
        result = await until_disconnect(request, collected)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result)


def _prepare(body: dict, state: AppState) -> tuple[list[int], SamplingParams, list[str]]:
    unknown = sorted(set(body) - _ALLOWED)
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
    prompt_ids = _encode_prompt(body.get("prompt"), state)
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise HTTPError(400, "stop must be a string or a list of strings", param="stop")
    params = _params(body)
    state.backend.check_request(prompt_ids, params)
    return prompt_ids, params, stops


def _encode_prompt(prompt, state: AppState) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return state.backend.tokenizer.encode(prompt, add_special_tokens=False).ids
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise HTTPError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")


def _params(body: dict) -> SamplingParams:
    def num(name: str, default):
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{name} must be a number")
        return value

    logprobs = body.get("logprobs")
    return SamplingParams(
        n=int(num("n", 1)),
        temperature=float(num("temperature", 1.0)),
        top_p=float(num("top_p", 1.0)),
        top_k=max(int(num("top_k", 0)), 0),
        min_p=float(num("min_p", 0.0)),
        presence_penalty=float(num("presence_penalty", 0.0)),
        frequency_penalty=float(num("frequency_penalty", 0.0)),
        repetition_penalty=float(num("repetition_penalty", 1.0)),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        max_tokens=int(num("max_tokens", 16)),
        min_tokens=int(num("min_tokens", 0)),
        stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=int(logprobs)
        if isinstance(logprobs, int) and not isinstance(logprobs, bool)
        else None,
        logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()} or None,
    )


async def _generate(
    state: AppState, rid: str, prompt_ids: list[int], params: SamplingParams, stops: list[str]
) -> AsyncIterator[tuple[int, str, str | None, int]]:
    """Yield (choice index, new text, finish reason, new token count); aborts when left early."""
    tok = state.backend.tokenizer
    decoders = [DecodeStream(skip_special_tokens=True) for _ in range(params.n)]
    texts = [""] * params.n
    done = [False] * params.n
    timing = Timing(time.perf_counter())
    finished, reason = False, "abort"
    try:
        async for out in state.backend.generate(rid, prompt_ids, params):
            if not timing.ready:
                timing.ready = True
                record_prompt(state.metrics, out)
            record_tokens(state.metrics, timing, out)
            for c in out.outputs:
                if done[c.index]:
                    continue
                piece = "".join(s for t in c.token_ids if (s := decoders[c.index].step(tok, t)))
                piece, hit = _apply_stops(texts[c.index], piece, stops)
                texts[c.index] += piece
                finish = "stop" if hit else c.finish_reason
                done[c.index] = finish is not None
                reason = finish or reason
                yield c.index, piece, finish, len(c.token_ids)
            finished = out.finished
            if finished or all(done):
                break
    finally:
        if not finished:
            await asyncio.shield(state.backend.abort(rid))
        state.metrics.e2e.observe(time.perf_counter() - timing.arrival)
        state.metrics.request_finished(reason)


def _apply_stops(before: str, piece: str, stops: list[str]) -> tuple[str, bool]:
    """Cut `piece` at the first stop string completed by it (stop text is not returned)."""
    if not stops:
        return piece, False
    text = before + piece
    cuts = [i for s in stops if (i := text.find(s, max(0, len(before) - len(s) + 1))) >= 0]
    if not cuts:
        return piece, False
    return text[: min(cuts)][len(before) :], True


def _chunk(rid: str, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _sse(
    events, rid: str, state: AppState, include_usage: bool, n_prompt: int
) -> AsyncIterator[bytes]:
    model = state.config.served_model_name
    tokens = 0
    async with aclosing(events):
        async for index, text, finish, n in events:
            tokens += n
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            yield sse(None, json.dumps(_chunk(rid, model, [choice])))
    if include_usage:
        yield sse(None, json.dumps(_chunk(rid, model, [], _usage(n_prompt, tokens))))
    yield sse(None, "[DONE]")


async def _collect(events, rid: str, state: AppState, n: int, n_prompt: int) -> dict:
    texts, finishes, tokens = [""] * n, [None] * n, 0
    async with aclosing(events):
        async for index, text, finish, count in events:
            texts[index] += text
            finishes[index] = finish or finishes[index]
            tokens += count
    choices = [
        {"index": i, "text": texts[i], "logprobs": None, "finish_reason": finishes[i]}
        for i in range(n)
    ]
    return _chunk(rid, state.config.served_model_name, choices, _usage(n_prompt, tokens))
