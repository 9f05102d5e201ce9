"""Engine outputs to protocol chunks: one recipe `StreamProcessor` per choice.

`stream_chunks` feeds the backend's `RequestOutput` deltas (token ids + logprobs) into the
processors and yields `(choice index, [protocol chunk, ...])`. It owns the engine request: when a
stop string ends every choice early, or the consumer goes away, it aborts it (freeing its KV).
Latency and token metrics are recorded here, where the timings are seen. Not here: HTTP framing
(server/framing.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import deepseek_recipe as dr
from tokenizers import Tokenizer

from deepserve.engine.admission import AdmittedRequest
from deepserve.engine.contract import EngineClient
from deepserve.engine.outputs import CompletionOutput, RequestOutput
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.metrics import ServerMetrics
from deepserve.server.protocols import GeneratorFactory

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


@dataclass
class GenerationJob:
    request_id: str
    admitted: AdmittedRequest
    parsing: dr.ParsingOptions
    make_generator: GeneratorFactory
    # Set for DeepSeek tool-call grammars: xgrammar may spell a DSML marker from plain tokens,
    # which the recipe parses only as text, so those requests are pushed as decoded text.
    text_tokenizer: Tokenizer | None = None
    # Set when a text-pushed Chat Completions request asks for logprobs: (choice index, entries)
    # for every chunk stream_chunks yields, in order, to be put on the chunk by the HTTP layer.
    logprob_feed: deque[tuple[int, list[dict]]] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0  # set when the engine's first output arrives
    cached_tokens: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.admitted.params


@dataclass
class Timing:
    arrival: float
    last: float | None = None
    tokens: int = 0
    ready: bool = False


async def stream_chunks(
    backend: EngineClient,
    job: GenerationJob,
    tokenizer: dr.Tokenizer,
    metrics: ServerMetrics,
) -> AsyncIterator[tuple[int, list]]:
    processors = [
        _ChoiceProcessor(
            dr.StreamProcessor(job.make_generator(), job.parsing, tokenizer),
            job,
            tokenizer,
            backend.tokenizer,
        )
        for _ in range(job.params.n)
    ]
    timing = Timing(job.arrival)
    engine_done = False
    reason = "abort"
    try:
        # Closed here, not by the loop's async-generator finalizer (a cross-thread wake-up and a
        # task of its own, before the response goes out).
        outputs = backend.generate(job.request_id, job.admitted)
        async with aclosing(outputs):
            async for out in outputs:
                if not timing.ready:
                    timing.ready = True
                    job.prompt_tokens, job.cached_tokens = out.prompt_tokens, out.cached_tokens
                    record_prompt(metrics, out)
                    ready = _ready(out)
                    for i, p in enumerate(processors):
                        yield i, p.feed(i, p.sp.push(ready))
                record_tokens(metrics, timing, out)
                for c in out.outputs:
                    p = processors[c.index]
                    if not p.finished:
                        yield c.index, p.feed(c.index, p.push(c))
                    reason = c.finish_reason or reason
                engine_done = out.finished
                if engine_done or all(p.finished for p in processors):
                    reason = reason if engine_done else "stop"
                    break
    finally:
        for p in processors:
            p.close()
        metrics.e2e.observe(time.perf_counter() - timing.arrival)
        metrics.request_finished(reason)
        # Last: when the client cut the stream, the server's cancel scope makes every await
        # here raise again, and anything after it would be skipped.
        if not engine_done:
            await asyncio.shield(backend.abort(job.request_id))


def _ready(out: RequestOutput) -> dr.InferenceChunk:
    usage = dr.PromptUsage(
        prompt_tokens=out.prompt_tokens, prompt_cache_hit_tokens=out.cached_tokens
    )
    return dr.InferenceChunk.ready(prompt_usage=usage)


class _ChoiceProcessor:
    """One choice's StreamProcessor, fed token ids (or decoded text, see GenerationJob)."""

    def __init__(
        self,
        sp: dr.StreamProcessor,
        job: GenerationJob,
        tokenizer: dr.Tokenizer,
        decoder: Tokenizer,
    ) -> None:
        self.sp = sp
        self.tokenizer = job.text_tokenizer
        self.decoder = decoder
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already pushed
        self.held: list[int] = []  # tokens the recipe holds: their text ends inside a character
        self.job = job
        self.shadow = (
            _LogprobShadow(job, tokenizer, decoder) if job.logprob_feed is not None else None
        )

    @property
    def finished(self) -> bool:
        return self.sp.finished

    def feed(self, index: int, chunks: list) -> list:
        """Queue the logprob entries seen so far for the first of `chunks`, nothing for the rest."""
        if self.shadow is not None:
            for i, _ in enumerate(chunks):
                self.job.logprob_feed.append((index, self.shadow.take() if i == 0 else []))
        return chunks

    def close(self) -> None:
        if not self.sp.finished:
            self.sp.close()
        if self.shadow is not None:
            self.shadow.close()

    def push(self, c: CompletionOutput) -> list:
        """Push one choice's delta; the stop token (EOS or a stop id) is not output text."""
        ids, logprobs = list(c.token_ids), c.logprobs
        if c.stop_token_id is not None and ids and ids[-1] == c.stop_token_id:
            ids.pop()
            logprobs = logprobs[: len(ids)] if logprobs is not None else None
        final = c.finish_reason is not None
        if self.shadow is not None:
            self.shadow.push(ids, logprobs, final=False)
        chunks = []
        # Text chunks are never held back, so only the token path follows the recipe's hold.
        held = self.held if self.tokenizer is None else None
        for a, b in utf8_pieces(self.decoder, ids, held):
            lp = logprobs[a:b] if logprobs is not None else None
            chunks += self.sp.push(self._chunk(ids[a:b], lp, final))
        if c.finish_reason is not None and not self.sp.finished:
            if self.held:
                # The recipe drops held tokens unsent and uncounted; usage counts every
                # generated token (as vLLM's does), so an empty text chunk accounts for them.
                chunks += self.sp.push(dr.InferenceChunk.text("", len(self.held)))
            reason = _FINISH.get(c.finish_reason, _FINISH["stop"])
            chunks += self.sp.push(dr.InferenceChunk.finish(reason))
        if self.sp.finished or c.finish_reason is not None:
            chunks += self.sp.finish()
            if self.shadow is not None:
                self.shadow.push([], None, True)
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


class _LogprobShadow:
    """Logprob entries for a choice pushed as text, formatted by the recipe.

    Text chunks carry no logprobs, and the recipe puts none on tool-call deltas even from token
    chunks, while vLLM reports one entry per generated token whatever the parser made of it. A
    second processor with markup parsing off sees the same tokens as plain content, so its
    `logprobs.content` covers every token, in the recipe's own format (token, bytes, top).
    """

    def __init__(self, job: GenerationJob, tokenizer: dr.Tokenizer, decoder: Tokenizer) -> None:
        self.decoder = decoder
        options = dr.ParsingOptions(
            parse_tool_calls=False, stop_sequences=job.parsing.stop_sequences
        )
        self.sp = dr.StreamProcessor(job.make_generator(), options, tokenizer)
        self.sp.push(dr.InferenceChunk.ready())
        self.pending: list[dict] = []
        self.done = False

    def push(self, ids: list[int], logprobs, final: bool) -> None:
        if self.done:
            return
        chunks = []
        for a, b in utf8_pieces(self.decoder, ids):
            lp = [(t.logprob, [(tid, v) for tid, v in t.top]) for t in (logprobs or [])[a:b]]
            chunks += self.sp.push(dr.InferenceChunk.tokens(ids[a:b], lp))
        if final and not self.sp.finished:
            chunks += self.sp.push(dr.InferenceChunk.finish(_FINISH["stop"]))
        if final or self.sp.finished:
            chunks += self.sp.finish()
            self.done = True
        for ch in chunks:
            for choice in json.loads(ch.to_json()).get("choices", []):
                self.pending += (choice.get("logprobs") or {}).get("content") or []

    def take(self) -> list[dict]:
        entries, self.pending = self.pending, []
        return entries

    def close(self) -> None:
        if not self.done:
            self.sp.close()


def utf8_pieces(
    decoder: Tokenizer, ids: list[int], held: list[int] | None = None
) -> list[tuple[int, int]]:
    """`ids` as (start, end) pieces to push one after another: one piece, or two when the delta's
    text ends inside a UTF-8 sequence after some complete text.

    The recipe holds a token chunk back while its text ends inside a character and drops what it
    holds when the request finishes, so a delta of complete tokens plus the first bytes of a
    character cut by max_tokens would lose the complete ones too. Deltas hold several tokens only
    when the consumer lags (or speculation), so the text a client gets would depend on timing.
    `held`, when given, is what the recipe holds before `ids` (it decodes that with what follows)
    and is updated in place to what it holds after them. One decode unless the text ends inside a
    character (none for a single token without `held`).
    """
    if not ids:
        return []
    if held is None and len(ids) == 1:  # nothing to split, nothing to follow
        return [(0, 1)]
    before = held or []
    pieces, after = [(0, len(ids))], []
    if _ends_inside_a_character(decoder, before + ids):
        after = before + ids
        for k in range(len(ids) - 1, 0, -1):
            if not _ends_inside_a_character(decoder, before + ids[:k]):
                pieces, after = [(0, k), (k, len(ids))], ids[k:]
                break
    if held is not None:
        held[:] = after
    return pieces


def _ends_inside_a_character(decoder: Tokenizer, ids: list[int]) -> bool:
    return decoder.decode(ids, skip_special_tokens=False).endswith("\ufffd")


def record_prompt(metrics: ServerMetrics, out: RequestOutput) -> None:
    metrics.prompt_tokens.inc(out.prompt_tokens)
    metrics.cached_tokens.inc(out.cached_tokens)
    metrics.cached_prompt_tokens(out.cached_tokens_by_tier)
    if out.queue_time is not None:
        metrics.queue_time.observe(out.queue_time)


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
