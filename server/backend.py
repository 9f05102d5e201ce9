"""`Backend`: what the frontend needs from whatever runs the model.

`AsyncEngine` (engine/async_engine.py) satisfies it directly in `deepserve serve`; `RemoteEngine`
(disagg/remote_engine.py) stands behind the same face for remote workers. The frontend never
imports the engine's internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from deepserve.engine.admission import AdmittedRequest, EngineLimits
from deepserve.engine.outputs import EngineLoad, RequestOutput
from deepserve.engine.sampling_params import SamplingParams


class Backend(Protocol):
    tokenizer: object  # tokenizers.Tokenizer
    model_info: object  # engine.loader.ModelInfo: vocab_size, max_model_len, eos ids, family...
    limits: EngineLimits

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> AdmittedRequest:
        """Validate, resolve max_tokens, compile the grammar; InvalidRequestError before any
        work is queued."""

    def generate(self, request_id: str, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        """Stream an admitted request's deltas; leaving early aborts it."""

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def unavailable(self) -> str | None:
        """None while requests can be served; else why not (/health and /ready answer 503)."""
