"""What the engine streams back per request: token deltas, logprobs, finish reason, cache use."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    """One sample's new tokens since the previous output (a delta, not the whole text)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None: running
    stop_token_id: int | None = None  # the token that ended it, when it was a stop/EOS token


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from any cache tier
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # "device", "host", "store"
    finished: bool = False
    queue_time: float | None = None  # seconds from arrival to its first scheduled step
    error: str | None = None  # set on the last output of a request that failed in the engine


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (a consumer that fell behind takes what is
    queued in one go): token ids and logprobs concatenated per sample, the later state kept."""
    merged = {c.index: c for c in first.outputs}
    for c in later.outputs:
        prev = merged.get(c.index)
        if prev is None:
            merged[c.index] = c
            continue
        logprobs = None
        if prev.logprobs is not None or c.logprobs is not None:
            logprobs = (prev.logprobs or []) + (c.logprobs or [])
        merged[c.index] = CompletionOutput(
            c.index, prev.token_ids + c.token_ids, logprobs, c.finish_reason, c.stop_token_id
        )
    return RequestOutput(
        request_id=later.request_id,
        outputs=sorted(merged.values(), key=lambda c: c.index),
        prompt_tokens=later.prompt_tokens,
        cached_tokens=later.cached_tokens,
        cached_tokens_by_tier=later.cached_tokens_by_tier,
        finished=later.finished,
        queue_time=first.queue_time if first.queue_time is not None else later.queue_time,
        error=later.error,
    )


@dataclass
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float  # fraction of device KV blocks in use by requests (cached-free blocks excluded)
    num_blocks: int
    num_free_blocks: int
