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


@dataclass
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float  # fraction of device KV blocks in use by requests (cached-free blocks excluded)
    num_blocks: int
    num_free_blocks: int
