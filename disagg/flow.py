"""`GenerationFlow`: one request over the workers, colocated or split into prefill and decode.

Colocated: the whole request runs on one `mixed` worker. Disaggregated (the pool has prefill and
decode workers): a prefill worker computes the prompt's KV and the first token, writes the full
blocks to the shared tier and returns their keys; that first token is passed on at once; a decode
worker then continues from prompt + first token, finding the prompt's blocks in the shared tier
(a prefix hit) and recomputing only the partial last block. A missing block is just a miss there,
so a failed transfer costs time, never correctness.

The decode worker resumes the request after that first token (the engine's `resume_token_ids`):
the token counts as output for max/min_tokens, penalties, the grammar and the seeded noise, and
both workers sample with the same seed (one is drawn here when the client gave none), so the
stream equals a colocated run's. The same resume carries a request over a worker that dies
mid-stream: another worker of the role continues after every token already streamed, so the
client sees a pause, not an error (single-sample requests; an n > 1 request fails). Requests
with n > 1 (a first token per sample) are not split: the prefill worker only moves the KV and the
decode worker generates every token itself. If no prefill worker can take a request before its
first token, the decode worker does it all.

The flow asks a `WorkerPicker` for one worker's events by role; router/router.py's `Router` is
the one the frontend passes in (router/remote_engine.py).

Not here: picking workers, retries and aborts on one worker (router/router.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from deepserve.disagg.dataclass_json import to_json
from deepserve.disagg.errors import WorkerUnavailableError
from deepserve.disagg.protocol import GenerateRequest, StreamEvent
from deepserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def resumable(params: SamplingParams) -> bool:
    """True when a decode worker can continue after the prefill worker's first token."""
    return params.n == 1


class WorkerPicker(Protocol):
    """What the flow needs of whoever picks workers: one worker's events for a request, by role."""

    @property
    def max_attempts(self) -> int:
        """How many workers one request may try (the flow's fail-over mid-stream too)."""

    def has_role(self, role: str) -> bool:
        """Whether the pool has a worker of `role` at all (healthy or not)."""

    def stream(
        self, role: str, req: GenerateRequest, *, avoid: frozenset[str] = frozenset()
    ) -> AsyncIterator[StreamEvent]:
        """`req`'s events from one worker of `role`, tried elsewhere before the first token;
        `WorkerUnavailableError` (with `started` and the failed `worker`) when that fails.
        `avoid`: workers not to pick while another of the role is available."""

    def retried(self, role: str) -> None:
        """Count one request tried again on another worker of `role`."""


class GenerationFlow:
    def __init__(self, picker: WorkerPicker, max_model_len: int) -> None:
        self.picker = picker
        self.max_model_len = max_model_len

    @property
    def disaggregated(self) -> bool:
        return self.picker.has_role("prefill") and self.picker.has_role("decode")

    def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamEvent]:
        """The request's events. A plain function handing back the chosen path's generator: one
        async-generator layer less for every event of every request."""
        # Every worker must draw the same noise. The seed goes into the wire dict when that is
        # all that carries it: `dataclasses.replace` costs tens of microseconds a request.
        seed = secrets.randbits(63) if params.seed is None and resumable(params) else None
        if not self.disaggregated:
            role = "mixed" if self.picker.has_role("mixed") else "decode"
            sampling = to_json(params)
            if seed is not None:
                sampling["seed"] = seed
            req = GenerateRequest(request_id, prompt, sampling)
            return self._failing_over(role, req, params)
        if seed is not None:
            params = dataclasses.replace(params, seed=seed)
        split = self._split if resumable(params) else self._transfer_then_decode
        return split(request_id, prompt, params)

    # ---- first token from the prefill worker, the rest from a decode worker -----------------

    async def _split(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamEvent]:
        first_params = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
        )
        pre = GenerateRequest(request_id, prompt, to_json(first_params), "prefill")
        try:
            first = await self._prefill(pre)
        except WorkerUnavailableError as e:
            log.warning("prefill failed for %s, decoding colocated: %s", request_id, e)
            async with contextlib.aclosing(self._decode_all(request_id, prompt, params)) as evs:
                async for ev in evs:
                    yield ev
            return
        token = first.outputs[0]["token_ids"][0]
        if self._ends_after_first(first, params, len(prompt)):
            yield first
            return
        first.finished = False
        first.outputs[0]["finish_reason"] = None
        first.outputs[0]["stop_token_id"] = None
        yield first
        dec = GenerateRequest(
            request_id,
            prompt,
            to_json(params),
            "decode",
            resume_token_ids=[token],
            kv_keys=first.kv_keys,
        )
        async with contextlib.aclosing(self._failing_over("decode", dec, params)) as events:
            async for ev in events:
                yield _as_prompt_of(ev, first)

    async def _failing_over(
        self, role: str, req: GenerateRequest, params: SamplingParams
    ) -> AsyncIterator[StreamEvent]:
        """`req` on a worker of `role`; when that worker dies after streaming, another one
        resumes after every token emitted so far (n=1 only; the seed is fixed by then)."""
        emitted = list(req.resume_token_ids)
        first: StreamEvent | None = None
        failed: frozenset[str] = frozenset()  # workers that died serving this request
        for attempt in range(self.picker.max_attempts):
            if attempt:
                req = dataclasses.replace(req, resume_token_ids=list(emitted))
            try:
                async with contextlib.aclosing(
                    self.picker.stream(role, req, avoid=failed)
                ) as events:
                    async for ev in events:
                        first = first or ev
                        emitted += [t for o in ev.outputs for t in o["token_ids"]]
                        yield ev if not attempt else _as_prompt_of(ev, first)
                return
            except WorkerUnavailableError as e:
                last_try = attempt + 1 == self.picker.max_attempts
                if not (e.started and resumable(params)) or last_try:
                    raise
                if e.worker is not None:
                    failed |= {e.worker}
                log.warning(
                    "%s died mid-stream, resuming after %d tokens: %s",
                    req.request_id,
                    len(emitted),
                    e,
                )
                self.picker.retried(role)

    def _ends_after_first(self, first: StreamEvent, params: SamplingParams, n_prompt: int) -> bool:
        reason = first.outputs[0]["finish_reason"]
        return reason == "stop" or params.max_tokens == 1 or n_prompt + 1 >= self.max_model_len

    async def _prefill(self, req: GenerateRequest) -> StreamEvent:
        """Run `req` on a prefill worker; one merged event with its token, keys and cache use."""
        merged: StreamEvent | None = None
        async with contextlib.aclosing(self.picker.stream("prefill", req)) as events:
            async for ev in events:
                merged = ev if merged is None else _merge(merged, ev)
        if merged is None or not merged.outputs or not merged.outputs[0]["token_ids"]:
            raise WorkerUnavailableError(f"prefill of {req.request_id} returned no token")
        return merged

    # ---- KV transfer only, every token from the decode worker -------------------------------

    async def _transfer_then_decode(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamEvent]:
        keys: list[str] = []
        # The salt too: the prompt's blocks are hashed under it on both workers.
        sampling = {"max_tokens": 1, "temperature": 0.0, "cache_salt": params.cache_salt}
        pre = GenerateRequest(request_id, prompt, sampling, "prefill")
        try:
            keys = (await self._prefill(pre)).kv_keys
        except WorkerUnavailableError as e:
            log.warning("prefill failed for %s, decode recomputes: %s", request_id, e)
        async with contextlib.aclosing(self._decode_all(request_id, prompt, params, keys)) as evs:
            async for ev in evs:
                yield ev

    def _decode_all(
        self, request_id: str, prompt: list[int], params: SamplingParams, keys: list[str] = ()
    ) -> AsyncIterator[StreamEvent]:
        req = GenerateRequest(request_id, prompt, to_json(params), "decode", kv_keys=list(keys))
        return self.picker.stream("decode", req)


def _merge(a: StreamEvent, b: StreamEvent) -> StreamEvent:
    out = dict(a.outputs[0]) if a.outputs else {"index": 0, "token_ids": [], "logprobs": None}
    for o in b.outputs:
        out["token_ids"] = out["token_ids"] + o["token_ids"]
        if o.get("logprobs") is not None:
            out["logprobs"] = (out.get("logprobs") or []) + o["logprobs"]
        out["finish_reason"] = o.get("finish_reason") or out.get("finish_reason")
        out["stop_token_id"] = o.get("stop_token_id") or out.get("stop_token_id")
    return dataclasses.replace(
        b,
        outputs=[out],
        kv_keys=b.kv_keys or a.kv_keys,
        prompt_tokens=a.prompt_tokens or b.prompt_tokens,
        cached_tokens=a.cached_tokens,
        cached_tokens_by_tier=a.cached_tokens_by_tier,
    )


def _as_prompt_of(ev: StreamEvent, first: StreamEvent) -> StreamEvent:
    """The client's prompt is the original one; its cache use is what the prefill worker found."""
    return dataclasses.replace(
        ev,
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        cached_tokens_by_tier=dict(first.cached_tokens_by_tier),
    )
