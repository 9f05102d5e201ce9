"""`RemoteEngine`: the frontend's generation backend when the engines run in worker processes.

It implements the `EngineClient` contract (engine/contract.py) that `AsyncEngine` implements in
process, so the same FastAPI app serves from an in-process engine or from remote workers. Requests
go through the prefill/decode flow (`GenerationFlow`, disagg/flow.py) with a `Router` as the flow's
`WorkerPicker`. The model card (`ModelCard` and the tokenizer) comes from the workers themselves, so frontend
and workers can never disagree on the vocabulary, and the frontend never loads weights.

Not here: picking workers (router/router.py), the prefill/decode sequence (disagg/flow.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from tokenizers import Tokenizer

from deepserve.disagg.dataclass_json import from_json
from deepserve.disagg.errors import NoWorkerError, WorkerRejectedError, WorkerUnavailableError
from deepserve.disagg.flow import GenerationFlow
from deepserve.engine.admission import AdmittedRequest, check_request
from deepserve.engine.contract import ModelCard
from deepserve.engine.outputs import EngineLoad, RequestOutput
from deepserve.engine.sampling_params import SamplingParams
from deepserve.router.router import Router


async def fetch_model_card(router: Router, timeout: float) -> tuple[ModelCard, Tokenizer]:
    """The first model card any worker returns, waiting up to `timeout` for one to come up."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        for w in router.pool.workers():
            try:
                card = await w.client.model_card()
                return from_json(ModelCard, card["card"]), Tokenizer.from_str(card["tokenizer"])
            except (WorkerUnavailableError, WorkerRejectedError) as e:
                last = e
        await asyncio.sleep(0.5)
    raise NoWorkerError(f"no worker returned its model card within {timeout:.0f}s: {last}")


class RemoteEngine:
    def __init__(self, router: Router, card: ModelCard, tokenizer: Tokenizer) -> None:
        self.router = router
        self.card = card
        self.tokenizer = tokenizer
        self.flow = GenerationFlow(router, card.limits.max_model_len)

    def admit(
        self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids=()
    ) -> AdmittedRequest:
        """The engine's own admission against the workers' limits; a worker compiles the
        output constraint (a bad one is its 400)."""
        max_tokens = check_request(self.card.limits, prompt_token_ids, params, resume_token_ids)
        return AdmittedRequest(list(prompt_token_ids), params, max_tokens, list(resume_token_ids))

    async def generate(
        self, request_id: str, admitted: AdmittedRequest
    ) -> AsyncIterator[RequestOutput]:
        events = self.flow.stream(request_id, admitted.prompt_token_ids, admitted.params)
        async with contextlib.aclosing(events) as stream:
            async for ev in stream:
                yield ev.to_output()

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # each worker's engine gathers its own bursts

    async def abort(self, request_id: str) -> None:
        self.router.abort(request_id)

    def load(self) -> EngineLoad:
        workers = [w for w in self.router.pool.workers() if w.healthy]
        loads = [w.load for w in workers if w.load is not None]
        return EngineLoad(
            running=sum(max(w.inflight, w.load.running if w.load else 0) for w in workers),
            waiting=sum(ld.waiting for ld in loads),
            kv_usage=sum(ld.kv_usage for ld in loads) / len(loads) if loads else 0.0,
            num_blocks=sum(ld.num_blocks for ld in loads),
            num_free_blocks=sum(ld.num_free_blocks for ld in loads),
        )

    def unavailable(self) -> str | None:
        """Why no request can be served now, or None. A mixed or a decode worker can run a
        whole request (the decode worker does the prefill when no prefill worker is left)."""
        pool = self.router.pool
        if pool.available("mixed") or pool.available("decode"):
            return None
        return "no healthy mixed or decode worker"

    async def shutdown(self) -> None:
        await self.router.close()
