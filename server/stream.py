"""Engine outputs to protocol chunks: one recipe `StreamProcessor` per choice.

`stream_chunks` feeds the backend's `RequestOutput` deltas (token ids + logprobs) into the
processors and yields `(choice index, [protocol chunk, ...])`. It owns the engine request: when a
stop string ends every choice early, or the consumer goes away, it aborts it (freeing its KV).
Latency and token metrics are recorded here, where the timings are seen. Not here: HTTP framing
(server/framing.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import deepseek_recipe as dr
from tokenizers import Tokenizer

from deepserve.engine.outputs import CompletionOutput, RequestOutput
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.backend import Backend
from deepserve.server.metrics import ServerMetrics
from deepserve.server.protocols import GeneratorFactory

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


@dataclass
class GenerationJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    parsing: dr.ParsingOptions
    make_generator: GeneratorFactory
    # Set for DeepSeek tool-call grammars: xgrammar may spell a DSML marker from plain tokens,
    # which the recipe parses only as text, so those requests are pushed as decoded text.
    text_tokenizer: Tokenizer | None = None
    arrival: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0  # set when the engine's first output arrives
    cached_tokens: int = 0


@dataclass
class Timing:
    arrival: float
    last: float | None = None
    tokens: int = 0
    ready: bool = False


async def stream_chunks(
    backend: Backend,
    job: GenerationJob,
    tokenizer: dr.Tokenizer,
    metrics: ServerMetrics,
) -> AsyncIterator[tuple[int, list]]:
    processors = [
        _ChoiceProcessor(dr.StreamProcessor(job.make_generator(), job.parsing, tokenizer), job)
        for _ in range(job.params.n)
    ]
    timing = Timing(job.arrival)
    engine_done = False
    reason = "abort"
    try:
        outputs = backend.generate(job.request_id, job.prompt_ids, job.params)
        async for out in outputs:
            if not timing.ready:
                timing.ready = True
                job.prompt_tokens, job.cached_tokens = out.prompt_tokens, out.cached_tokens
                record_prompt(metrics, out)
                ready = _ready(out)
                for i, p in enumerate(processors):
                    yield i, p.sp.push(ready)
            record_tokens(metrics, timing, out)
            for c in out.outputs:
                p = processors[c.index]
                if not p.finished:
                    yield c.index, p.push(c)
                reason = c.finish_reason or reason
            engine_done = out.finished
            if engine_done or all(p.finished for p in processors):
                reason = reason if engine_done else "stop"
                break
    finally:
        if not engine_done:
            await asyncio.shield(backend.abort(job.request_id))
        for p in processors:
            if not p.finished:
                p.sp.close()
        metrics.e2e.observe(time.perf_counter() - timing.arrival)
        metrics.request_finished(reason)


def _ready(out: RequestOutput) -> dr.InferenceChunk:
    usage = dr.PromptUsage(
        prompt_tokens=out.prompt_tokens, prompt_cache_hit_tokens=out.cached_tokens
    )
    return dr.InferenceChunk.ready(prompt_usage=usage)


class _ChoiceProcessor:
    """One choice's StreamProcessor, fed token ids (or decoded text, see GenerationJob)."""

    def __init__(self, sp: dr.StreamProcessor, job: GenerationJob) -> None:
        self.sp = sp
        self.tokenizer = job.text_tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already pushed

    @property
    def finished(self) -> bool:
        return self.sp.finished

    def push(self, c: CompletionOutput) -> list:
        """Push one choice's delta; the stop token (EOS or a stop id) is not output text."""
        ids, logprobs = list(c.token_ids), c.logprobs
        if c.stop_token_id is not None and ids and ids[-1] == c.stop_token_id:
            ids.pop()
            logprobs = logprobs[: len(ids)] if logprobs is not None else None
        final = c.finish_reason is not None
        chunks = self.sp.push(self._chunk(ids, logprobs, final)) if ids else []
        if c.finish_reason is not None and not self.sp.finished:
            reason = _FINISH.get(c.finish_reason, _FINISH["stop"])
            chunks += self.sp.push(dr.InferenceChunk.finish(reason))
        if self.sp.finished or c.finish_reason is not None:
            chunks += self.sp.finish()
        return chunks

    def _chunk(self, ids: list[int], logprobs, final: bool) -> dr.InferenceChunk:
        if self.tokenizer is not None:
            return dr.InferenceChunk.text(self._decode_more(ids, final), len(ids))
        lp = None
        if logprobs is not None:
            lp = [(t.logprob, [(tid, v) for tid, v in t.top]) for t in logprobs]
        return dr.InferenceChunk.tokens(ids, lp)

    def _decode_more(self, ids: list[int], final: bool) -> str:
        """New text of the whole decode; held back while it ends inside a UTF-8 sequence."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd") and not final:
            return ""
        piece, self.sent = text[self.sent :], len(text)
        return piece


def record_prompt(metrics: ServerMetrics, out: RequestOutput) -> None:
    metrics.prompt_tokens.inc(out.prompt_tokens)
    metrics.cached_tokens.inc(out.cached_tokens)
    metrics.cached_prompt_tokens(out.cached_tokens_by_tier)
    queue_time = getattr(out, "queue_time", None)
    if queue_time is not None:
        metrics.queue_time.observe(queue_time)


def record_tokens(metrics: ServerMetrics, timing: Timing, out: RequestOutput) -> None:
    n = sum(len(c.token_ids) for c in out.outputs)
    if n == 0:
        return
    now = time.perf_counter()
    if timing.tokens == 0:
        metrics.ttft.observe(now - timing.arrival)
    elif timing.last is not None:
        metrics.itl.observe((now - timing.last) / n)
    timing.last = now
    timing.tokens += n
    metrics.generation_tokens.inc(n)
