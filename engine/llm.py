"""The offline API: `LLM(config).generate(prompts, params)` and the `deepserve generate` command.

Prompts are raw text (tokenized with the model's tokenizer, no chat template) or token id lists.
All requests are submitted at once and the synchronous engine is stepped until every one finishes,
so they batch continuously. Serving (async, streaming) is engine/async_engine.py's job.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import EngineError
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.outputs import CompletionOutput, RequestOutput
from deepserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class GeneratedSample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    """One prompt's whole result (not a delta): every sample's tokens, text and finish reason."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[GeneratedSample]
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids


class LLM:
    def __init__(self, config: EngineConfig | None = None, loaded=None) -> None:
        self.engine = LLMEngine(config or EngineConfig(), loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion, batched; results in the order of `prompts`.

        Every request is validated before any is queued, so a bad one leaves the engine idle.
        """
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        token_lists = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        admitted = [
            self.engine.admit(ids, sp) for ids, sp in zip(token_lists, params_list, strict=True)
        ]
        results: dict[str, GenerationResult] = {}
        for ids, req in zip(token_lists, admitted, strict=True):
            rid = f"llm-{next(self._ids)}"
            samples = [GeneratedSample(i) for i in range(req.params.n)]
            results[rid] = GenerationResult(rid, ids, samples)
            self.engine.add_admitted(rid, req)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    _accumulate(results[out.request_id], out)
        except BaseException:
            for rid in results:
                self.engine.abort(rid)
            raise
        if self.tokenizer is not None:  # a model built in code may come without one
            for result in results.values():
                for sample in result.samples:
                    sample.text = self.decode(sample.token_ids)
        return list(results.values())

    def close(self) -> None:
        self.engine.close()


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(
    params: SamplingParams | list[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)


def _accumulate(result: GenerationResult, out: RequestOutput) -> None:
    result.cached_tokens = out.cached_tokens
    for delta in out.outputs:
        _extend(result.samples[delta.index], delta)


def _extend(sample: GeneratedSample, delta: CompletionOutput) -> None:
    sample.token_ids += delta.token_ids
    if delta.logprobs is not None:
        sample.logprobs = (sample.logprobs or []) + delta.logprobs
    if delta.finish_reason is not None:
        sample.finish_reason = delta.finish_reason


def generate_cli(config: EngineConfig, args: argparse.Namespace) -> int:
    """`deepserve generate`: print the completion of one raw prompt (exit 2 on a bad request)."""
    try:
        llm = LLM(config)
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
        result = llm.generate(args.prompt, params)[0]
    except EngineError as e:
        print(f"deepserve generate: {e}", file=sys.stderr)
        return 2
    llm.close()
    print(args.prompt + result.text)
    return 0
