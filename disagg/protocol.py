"""The worker's internal API as plain data: what the router sends a worker and what comes back.

Token ids in; streamed token deltas, logprobs, finish reason and cached-token counts out. Every
message is a dataclass deriving `WireMessage`, whose `to_json()` / `from_json()` follow its fields
(disagg/dataclass_json.py, which also carries SamplingParams and CompletionOutput inside them), so
both ends agree on one shape. HTTP routes and the shared-secret header live here too, because they
are part of the contract.

Not here: the HTTP client (disagg/client.py), the worker app (server/worker.py), routing (router/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepserve.disagg.dataclass_json import from_json, to_json
from deepserve.engine.outputs import CompletionOutput, RequestOutput

GENERATE_PATH = "/internal/generate"
ABORT_PATH = "/internal/abort"
LOAD_PATH = "/internal/load"
HEALTH_PATH = "/internal/health"
MODEL_PATH = "/internal/model"  # the model card: ModelInfo fields + the tokenizer's JSON
METRICS_PATH = "/metrics"
AUTH_HEADER = "authorization"
KV_EVENTS_CHANNEL = "deepserve:kv-events"  # Redis pub/sub channel of EventBatch messages

# How a worker runs one request. "full": prefill and decode on this worker (colocated).
# "prefill": compute the prompt's KV and one token, write the full blocks to the shared tier,
# return their keys. "decode": continue after `resume_token_ids` (the prefill worker's output),
# loading the prompt's blocks from the shared tier as a prefix hit.
MODES = ("full", "prefill", "decode")


def bearer(token: str) -> dict[str, str]:
    return {AUTH_HEADER: f"Bearer {token}"}


class WireMessage:
    """JSON by the dataclass's own fields (disagg/dataclass_json.py): unknown keys are ignored,
    missing ones default."""

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]):
        return from_json(cls, d)


@dataclass
class GenerateRequest(WireMessage):
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams as to_json makes it
    mode: str = "full"
    resume_token_ids: list[int] = field(default_factory=list)  # decode: tokens already emitted
    resume_logprobs: list[float] = field(default_factory=list)
    kv_keys: list[str] = field(default_factory=list)  # decode: blocks the prefill worker stored

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerateRequest:
        if d.get("mode", "full") not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        return super().from_json(d)


@dataclass
class StreamEvent(WireMessage):
    """One line of a generate stream: a RequestOutput delta, or an error that ends the stream."""

    request_id: str
    outputs: list[dict[str, Any]]  # CompletionOutput as JSON
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    kv_keys: list[str] = field(default_factory=list)  # prefill mode: keys of the stored blocks
    error: str | None = None  # set only on the last event of a stream that failed
    rejected: bool = False  # with error: the request's own fault, not to be tried elsewhere

    @classmethod
    def from_output(cls, out: RequestOutput, kv_keys: list[str] | None = None) -> StreamEvent:
        return cls(
            request_id=out.request_id,
            outputs=[to_json(c) for c in out.outputs],
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            cached_tokens_by_tier=dict(out.cached_tokens_by_tier),
            finished=out.finished,
            kv_keys=kv_keys or [],
        )

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            outputs=[from_json(CompletionOutput, c) for c in self.outputs],
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cached_tokens_by_tier=dict(self.cached_tokens_by_tier),
            finished=self.finished,
        )


@dataclass
class WorkerLoad(WireMessage):
    """What a worker reports on /internal/load; the router's least-load and health input."""

    role: str
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int = 0
    num_free_blocks: int = 0
    cache_hit_tokens: int = 0  # prompt tokens served from any cache tier since start
    prompt_tokens: int = 0  # prompt tokens seen since start


@dataclass
class WorkerHealth(WireMessage):
    status: str  # "ok"
    role: str
    model: str
    worker_id: str  # what the worker calls itself in the KV events it publishes
    block_size: int = 16


@dataclass
class BlockEvent(WireMessage):
    """A KV block a worker's device cache gained ("stored") or lost ("removed").

    Carries the block's token ids and its parent's key so the router can rebuild the prefix tree
    without knowing how keys are hashed. parent None: the first block of a sequence.
    """

    kind: str  # "stored" | "removed" | "cleared" (the worker's whole cache is gone)
    key: str = ""
    parent: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class EventBatch(WireMessage):
    """One pub/sub message: a worker's block events, in order (the one nested message)."""

    worker_id: str
    events: list[BlockEvent]
