"""`Backend`: what the frontend needs from whatever runs the model.

`AsyncEngine` (engine/async_engine.py) satisfies it directly in `deepserve serve`; a router over
remote workers can stand behind the same face. The frontend never imports the engine's internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from deepserve.engine.outputs import EngineLoad, RequestOutput
from deepserve.engine.sampling_params import SamplingParams


class Backend(Protocol):
    tokenizer: object  # tokenizers.Tokenizer
    model_info: object  # engine.loader.ModelInfo: vocab_size, max_model_len, eos ids, family...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError before any work is queued."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...
