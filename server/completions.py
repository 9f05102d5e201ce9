"""POST /v1/completions: plain prompts (text or token ids), as benchmark tools send them.

The recipe covers the chat protocols only, so this legacy OpenAI shape is built here: the prompt
is encoded as is (no chat template), text is decoded incrementally per choice, stop strings end a
choice, and logprobs take the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`). A list of prompts is a batch: one engine request each, choice `i * n + j` the
j-th sample of prompt i (OpenAI's and vLLM's order), usage summed. Not here: chat requests
(server/chat_routes.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from deepserve.engine.admission import AdmittedRequest
from deepserve.engine.outputs import CompletionOutput, TokenLogprob
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.admission import (
    admit,
    cache_salt,
    check_fields,
    check_protocol,
    completion_options,
    pop_extras,
    sampling_params,
)
from deepserve.server.disconnect import ClientDisconnected, until_disconnect
from deepserve.server.errors import HTTPError
from deepserve.server.family import INLINE_PREPARE_BYTES, encode_text
from deepserve.server.framing import sse
from deepserve.server.state import (
    AppState,
    check_model,
    prepare_off_loop,
    read_json,
    tenant_of,
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
    "cache_salt",
}

# JSON has no -inf; OpenAI-compatible servers report an impossible token at this floor.
_LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class _Job:
    admitted: AdmittedRequest
    stops: list[str]
    echo: str  # the prompt text returned before the completion ("" without echo)


@dataclass
class _PromptUsage:
    """The prompt's usage, known once the engine's first output arrives."""

    prompt_tokens: int
    cached_tokens: int = 0


@dataclass
class _Event:
    """One choice's new output: text, its token count, and its logprobs in the legacy shape."""

    index: int
    text: str
    finish: str | None
    num_tokens: int
    logprobs: dict | None


async def handle(request: Request, state: AppState) -> Response:
    with state.backend.arriving():
        body = await read_json(request, state.config.max_body_bytes)
        check_model(body, state.config.served_model_name)
        jobs = await prepare_off_loop(
            request, body, INLINE_PREPARE_BYTES, _prepare, body, state, tenant_of(request)
        )
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    n = jobs[0].admitted.params.n
    prompts = [_PromptUsage(len(job.admitted.prompt_token_ids)) for job in jobs]
    if len(jobs) == 1:
        events = _generate(state, rid, jobs[0], prompts[0])
    else:
        events = _merged(
            [
                _generate(state, f"{rid}-{i}", j, u, i * n)
                for i, (j, u) in enumerate(zip(jobs, prompts, strict=True))
            ]
        )
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sse_events = _sse(events, rid, state, usage, prompts)
        return StreamingResponse(sse_events, media_type="text/event-stream")
    try:
        collected = _collect(events, rid, state, n * len(jobs), jobs[0].admitted.params, prompts)
        result = await until_disconnect(request.receive, collected)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result)


def _prepare(body: dict, state: AppState, tenant: str | None = None) -> list[_Job]:
    check_fields(body, state.max_prompt_chars, "completions")
    unknown = sorted(set(body) - _ALLOWED)
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
    check_protocol("completions", body)
    salt = cache_salt(body, state.config, tenant)
    encoded = _encode_prompts(body.get("prompt"), state)
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise HTTPError(400, "stop must be a string or a list of strings", param="stop")
    extras = pop_extras(body, True, ("max_tokens",))
    params = sampling_params(completion_options(body, extras), extras, cache_salt=salt)
    _check_unsupported(body, params)
    return [_job(state, text, ids, params, stops, body.get("echo")) for text, ids in encoded]


def _job(
    state: AppState,
    prompt: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: list[str],
    echo: bool | None,
) -> _Job:
    admitted = admit(state, prompt_ids, params)
    text = ""
    if echo:
        text = (
            prompt
            if prompt is not None
            else state.backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        )
    return _Job(admitted, stops, text)


def _check_unsupported(body: dict, params: SamplingParams) -> None:
    """Reject the fields whose meaning this server cannot deliver, rather than ignore them."""
    best_of = body.get("best_of")
    if best_of is not None and best_of != params.n:
        # Picking the best of several samples needs their cumulative logprobs ranked server-side.
        raise HTTPError(400, "best_of is only supported equal to n", param="best_of")
    if body.get("suffix") is not None:
        raise HTTPError(400, "suffix (insertion) is not supported", param="suffix")
    if body.get("echo") is not None and not isinstance(body["echo"], bool):
        raise HTTPError(400, "echo must be a boolean", param="echo")
    if body.get("echo") and params.logprobs is not None:
        # The legacy API then also scores the prompt; the engine computes output logprobs only.
        raise HTTPError(
            400, "echo with logprobs needs prompt logprobs, which are not supported", param="echo"
        )


def _encode_prompts(prompt, state: AppState) -> list[tuple[str | None, list[int]]]:
    """Each prompt's (text when it was given as text, token ids): a string or a list of token
    ids is one prompt, a list of them a batch."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [_encode_prompt(p, state) for p in prompt]
    return [_encode_prompt(prompt, state)]


def _encode_prompt(prompt, state: AppState) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str) and prompt:
        return prompt, encode_text(state.backend.tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return None, prompt
    raise HTTPError(
        400,
        "prompt must be a non-empty string, a list of token ids, or a list of either",
        param="prompt",
    )


@dataclass
class _Choice:
    """One choice's decoding state: its output text so far and whether it has ended."""

    decoder: DecodeStream
    echo: str
    text: str = ""  # the output only: stop strings are looked for here, not in the echo
    started: bool = False
    done: bool = False


async def _generate(
    state: AppState, rid: str, job: _Job, prompt: _PromptUsage, first_index: int = 0
) -> AsyncIterator[_Event]:
    """Yield each choice's new output as it comes (choice j as `first_index + j`); aborts the
    engine request when left early. Sets `prompt`'s cached tokens from the first output."""
    tok = state.backend.tokenizer
    params = job.admitted.params
    choices = [_Choice(DecodeStream(skip_special_tokens=True), job.echo) for _ in range(params.n)]
    timing = Timing(time.perf_counter())
    finished, reason = False, "abort"
    try:
        # Closed here, not by the loop's async-generator finalizer: that one wakes the loop from
        # another thread's path and closes in a task of its own, before the response goes out.
        async with aclosing(state.backend.generate(rid, job.admitted)) as outputs:
            async for out in outputs:
                if not timing.ready:
                    timing.ready = True
                    prompt.cached_tokens = out.cached_tokens
                    record_prompt(state.metrics, out)
                record_tokens(state.metrics, timing, out)
                for c in out.outputs:
                    choice = choices[c.index]
                    if choice.done:
                        continue
                    event = _advance(choice, c, tok, job.stops, params.logprobs)
                    choice.done = event.finish is not None
                    reason = event.finish or reason
                    event.index += first_index
                    yield event
                finished = out.finished
                if finished or all(c.done for c in choices):
                    break
    finally:
        state.metrics.e2e.observe(time.perf_counter() - timing.arrival)
        state.metrics.request_finished(reason)
        if not finished:  # last: a cut stream's cancel scope makes this await raise again
            await asyncio.shield(state.backend.abort(rid))


async def _merged(streams: list[AsyncIterator[_Event]]) -> AsyncIterator[_Event]:
    """The events of several prompts' streams as each comes; leaving early closes every stream
    (each aborts its engine request)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[_Event]) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put(event)
        except Exception as e:  # the consumer raises it
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _advance(
    choice: _Choice, c: CompletionOutput, tok: Tokenizer, stops: list[str], k: int | None
) -> _Event:
    """Decode one delta of a choice, cut at a stop string, with the logprobs of what is kept."""
    prefix = "" if choice.started else choice.echo
    choice.started = True
    before = choice.text
    base = len(choice.echo) + len(before)
    # Where each token's text starts in the returned text: the legacy `text_offset`.
    offsets, piece = [], ""
    for t in c.token_ids:
        offsets.append(base + len(piece))
        piece += choice.decoder.step(tok, t) or ""
    piece, hit = _apply_stops(before, piece, stops)
    # A stop token (EOS or a stop id) is neither output nor counted, as on the chat routes
    # (server/stream.py); tokens after it were never generated.
    stop_token = c.stop_token_id is not None and c.token_ids and c.token_ids[-1] == c.stop_token_id
    generated = len(c.token_ids) - 1 if stop_token else len(c.token_ids)
    kept = generated
    if hit:
        # Tokens that start inside the stop string are cut with it.
        kept = sum(1 for o in offsets if o < base + len(piece))
    choice.text = before + piece
    lp = None
    if k is not None and c.logprobs is not None:
        lp = _legacy_logprobs(c.logprobs[:kept], offsets[:kept], tok, k)
    finish = "stop" if hit else c.finish_reason
    return _Event(c.index, prefix + piece, finish, generated, lp)


def _legacy_logprobs(lps: list[TokenLogprob], offsets: list[int], tok: Tokenizer, k: int) -> dict:
    """The legacy shape; each top dict holds the top k and, as OpenAI promises, the sampled token
    (so k + 1 entries when it is not among them, and just the sampled token for k = 0)."""
    tokens, values, tops = [], [], []
    for lp in lps:
        token, value = _token_text(tok, lp.token_id), max(lp.logprob, _LOGPROB_FLOOR)
        top = {_token_text(tok, tid): max(v, _LOGPROB_FLOOR) for tid, v in lp.top[:k]}
        top.setdefault(token, value)
        tokens.append(token)
        values.append(value)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


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


def _usage(prompts: list[_PromptUsage], completion: int) -> dict:
    """Usage in the shape the chat routes report it (OpenAI's fields, DeepSeek's cache fields),
    summed over a batch's prompts."""
    cached = sum(p.cached_tokens for p in prompts)
    prompt_tokens = sum(p.prompt_tokens for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt_tokens - cached,
    }


async def _sse(
    events: AsyncIterator[_Event],
    rid: str,
    state: AppState,
    include_usage: bool,
    prompts: list[_PromptUsage],
) -> AsyncIterator[bytes]:
    model = state.config.served_model_name
    tokens = 0
    async with aclosing(events):
        async for ev in events:
            tokens += ev.num_tokens
            choice = {
                "index": ev.index,
                "text": ev.text,
                "logprobs": ev.logprobs,
                "finish_reason": ev.finish,
            }
            yield sse(None, json.dumps(_chunk(rid, model, [choice])))
    if include_usage:
        yield sse(None, json.dumps(_chunk(rid, model, [], _usage(prompts, tokens))))
    yield sse(None, "[DONE]")


async def _collect(
    events: AsyncIterator[_Event],
    rid: str,
    state: AppState,
    n: int,
    params: SamplingParams,
    prompts: list[_PromptUsage],
) -> dict:
    texts, finishes, tokens = [""] * n, [None] * n, 0
    logprobs = [_empty_logprobs() if params.logprobs is not None else None for _ in range(n)]
    async with aclosing(events):
        async for ev in events:
            texts[ev.index] += ev.text
            finishes[ev.index] = ev.finish or finishes[ev.index]
            tokens += ev.num_tokens
            if ev.logprobs is not None:
                for key, values in ev.logprobs.items():
                    logprobs[ev.index][key] += values
    choices = [
        {"index": i, "text": texts[i], "logprobs": logprobs[i], "finish_reason": finishes[i]}
        for i in range(n)
    ]
    return _chunk(rid, state.config.served_model_name, choices, _usage(prompts, tokens))


def _empty_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
