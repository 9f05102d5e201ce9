"""`EngineClient`: the one contract between the serving layers and an engine. Torch-free.

Implemented by the in-process `AsyncEngine` (engine/async_engine.py) and by the frontend's
`RemoteEngine` over workers (router/remote_engine.py); server/ speaks only this. A worker
(server/worker.py) serves one `EngineClient` behind the internal API.

```python
engine.card                      # ModelCard: ModelInfo, EngineLimits, batch_invariant, block_size
engine.tokenizer                 # tokenizers.Tokenizer
admitted = engine.admit(prompt_token_ids, params, resume_token_ids=())   # InvalidRequestError
with engine.arriving(): ...      # around reading and preparing a request (an idle engine waits)
async for out in engine.generate(request_id, admitted): ...              # RequestOutput deltas
await engine.abort(request_id)
engine.load() -> EngineLoad
await engine.shutdown()
# the worker's side, `WorkerEngine` (an in-process engine only):
engine.take_block_events()       # BlockStored / BlockRemoved since the last call
await engine.hand_off_prompt(prompt_token_ids, timeout, cache_salt)  # KVHandOff (None: no shared tier):
                                                          # the prompt's blocks for a decode worker
engine.stats() -> EngineStats    # counters for Prometheus
```

Not here: the checks `admit` runs (engine/admission.py), the wire format (disagg/protocol.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from deepserve.engine.admission import AdmittedRequest, EngineLimits
from deepserve.engine.outputs import EngineLoad, RequestOutput
from deepserve.engine.sampling_params import SamplingParams

__all__ = [
    "AdmittedRequest",
    "EngineClient",
    "EngineLimits",
    "EngineStats",
    "KVHandOff",
    "ModelCard",
    "ModelInfo",
    "WorkerEngine",
]


@dataclass(frozen=True)
class ModelInfo:
    """What the loader found in the checkpoint."""

    name: str
    family: str  # "llama" | "deepseek_v3"
    architecture: str
    path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None
    fingerprint: str
    num_mtp_layers: int


@dataclass(frozen=True)
class ModelCard:
    """What a serving layer knows of an engine: the model, its admission limits and how it runs.
    A worker publishes it on /internal/model, so a frontend reports what its workers run."""

    info: ModelInfo
    limits: EngineLimits
    batch_invariant: bool
    block_size: int
    kv_block_bytes: int  # one KV block on every layer, as the tiers store it
    kernels: str = "torch"  # "native" when the C++ CPU kernels run (kernels/cpu/native.py)
    kv_cache_dtype: str = (
        ""  # the device KV cache's element dtype, e.g. "bfloat16", "float8_e4m3fn"
    )


@dataclass(frozen=True)
class KVHandOff:
    """A prefill worker's result: whether the prompt's full blocks reached the shared tier, their
    keys (empty when not), and how many blocks that was."""

    flushed: bool
    keys: list[str]
    num_blocks: int
    seconds: float


@dataclass(frozen=True)
class EngineStats:
    """Counters read at scrape time (server/component_metrics.py)."""

    num_preemptions: int
    spec_decode: Any | None  # engine/spec_decode/stats.py SpecDecodeStats; None when off
    kv_registry: Any | None  # the KV tiers' prometheus CollectorRegistry; None without tiers
    async_scheduling: Any | None = None  # engine/async_scheduling.py OverlapStats; None when off


class EngineClient(Protocol):
    card: ModelCard
    tokenizer: Any  # tokenizers.Tokenizer

    def admit(
        self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids=()
    ) -> AdmittedRequest:
        """Validate, resolve max_tokens, compile the output constraint: InvalidRequestError
        before any work is queued. `generate` trusts what this returns."""

    def generate(self, request_id: str, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; leaving the iteration early aborts it."""

    def arriving(self) -> AbstractContextManager[None]:
        """Held while a request is read and prepared for `generate`: an idle engine holds its
        first step while more requests are on their way (a burst reaches it one by one)."""

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def unavailable(self) -> str | None:
        """None while requests can be served; else why not (/health and /ready answer 503)."""

    async def shutdown(self) -> None: ...


class WorkerEngine(EngineClient, Protocol):
    """An engine a worker serves (server/worker.py): an in-process one, which also reports its
    block events and counters and hands a prompt's KV over to decode workers."""

    def take_block_events(self) -> list:
        """`BlockStored` / `BlockRemoved` (engine/block_manager.py) since the last call."""

    async def hand_off_prompt(
        self, prompt_token_ids: list[int], timeout: float, cache_salt: str | None = None
    ) -> KVHandOff | None:
        """Wait until the prompt's full blocks are in the shared tier, writing again any the store
        lost (flushed or restarted) from the device pool; None without a shared tier."""

    def stats(self) -> EngineStats: ...
