"""Deltas queued behind a slow consumer are merged into one (engine/outputs.merge_deltas and the
AsyncEngine's drain): tokens and logprobs concatenate in order, the later state wins, and an
error queued behind them is kept for the next read, not lost."""

from __future__ import annotations

import asyncio

from deepserve.engine.async_engine import _drain
from deepserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob, merge_deltas


def _out(tokens: list[int], finished: bool = False, reason: str | None = None, lp: bool = False):
    lps = [TokenLogprob(t, -0.5) for t in tokens] if lp else None
    return RequestOutput("r", [CompletionOutput(0, tokens, lps, reason)], 5, 0, finished=finished)


def test_merge_concatenates_and_keeps_the_later_state():
    first = _out([1, 2], lp=True)
    first.queue_time = 0.25
    merged = merge_deltas(first, _out([3], finished=True, reason="length", lp=True))
    (c,) = merged.outputs
    assert c.token_ids == [1, 2, 3] and [lp.token_id for lp in c.logprobs] == [1, 2, 3]
    assert c.finish_reason == "length" and merged.finished and merged.queue_time == 0.25


def test_drain_merges_queued_deltas_and_holds_an_error_back():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for item in (_out([2]), _out([3]), RuntimeError("boom"), _out([9])):
            q.put_nowait(item)
        item, held = _drain(q, _out([1]))
        return item, held, q.qsize()

    item, held, left = asyncio.run(run())
    assert item.outputs[0].token_ids == [1, 2, 3]
    assert isinstance(held, RuntimeError) and left == 1


def test_drain_stops_at_the_finished_delta():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(_out([2], finished=True, reason="stop"))
        return _drain(q, _out([1]))

    item, held = asyncio.run(run())
    assert item.finished and item.outputs[0].token_ids == [1, 2] and held is None
