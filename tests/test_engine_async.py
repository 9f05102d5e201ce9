"""AsyncEngine: streaming deltas, validation before queueing, abort, an idle thread that sleeps,
an event loop that stays free while the model runs, and a clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deepserve.engine.async_engine import AsyncEngine, EngineDeadError
from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import InvalidRequestError, ModelNotFoundError
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea,"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig())


@pytest.fixture
async def engine(loaded):
    eng = AsyncEngine(EngineConfig(num_kv_blocks=128), loaded)
    yield eng
    await eng.shutdown()


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    tokens, outs = [], []
    async for out in engine.generate(rid, engine.admit(prompt, params)):
        outs.append(out)
        for delta in out.outputs:
            tokens += delta.token_ids
    return tokens, outs


async def test_stream_of_deltas_equals_offline_generate(loaded, engine):
    prompt = engine.tokenizer.encode(PROMPT).ids
    offline = LLM(EngineConfig(num_kv_blocks=64), loaded).generate([prompt], GREEDY)[0]
    tokens, outs = await collect(engine, "a", prompt, GREEDY)
    assert tokens == offline.token_ids
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"
    assert all(not o.finished for o in outs[:-1]) and len(outs) > 1


async def test_concurrent_streams_on_one_loop(engine):
    prompt = engine.tokenizer.encode(PROMPT).ids
    results = await asyncio.gather(*(collect(engine, f"r{i}", prompt, GREEDY) for i in range(4)))
    assert len({tuple(tokens) for tokens, _ in results}) == 1
    assert engine.load().kv_usage == 0.0


async def test_bad_request_raises_before_queueing(engine):
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.admit([1] * 10, SamplingParams(max_tokens=10**6))
    with pytest.raises(InvalidRequestError, match="empty"):
        await collect(engine, "bad", [], GREEDY)
    assert engine.load().waiting == 0 and engine.load().running == 0


async def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    prompt = engine.tokenizer.encode(PROMPT).ids
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    async for _ in engine.generate("long", engine.admit(prompt, params)):
        break
    await asyncio.sleep(0)
    deadline = time.monotonic() + 5
    while engine.load().kv_usage > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.load().kv_usage == 0.0 and engine.load().running == 0


async def test_event_loop_stays_responsive_while_model_runs(engine):
    prompt = engine.tokenizer.encode(PROMPT).ids
    gaps = []

    async def ticker():
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await collect(engine, "t", prompt, SamplingParams(temperature=0, max_tokens=24))
    task.cancel()
    assert len(gaps) > 10 and max(gaps) < 0.5  # a step on the loop would block it for a whole step


async def test_idle_engine_thread_sleeps(engine):
    await asyncio.sleep(0.1)
    start = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - start < 0.1


def waiting_at_first_step(engine: AsyncEngine) -> list[int]:
    """Filled with the number of requests waiting when the engine runs its first step."""
    first_step: list[int] = []
    step = engine.engine.step

    def spy(**kwargs):
        if not first_step:
            first_step.append(engine.engine.scheduler.num_waiting)
        return step(**kwargs)

    engine.engine.step = spy
    return first_step


async def test_idle_engine_gathers_a_burst_of_arrivals_into_its_first_step(engine, monkeypatch):
    # Requests trickling in (as HTTP delivers a burst) start together instead of in one small
    # step each; the gaps are far inside the quiet window so a slow CI box cannot split them.
    import deepserve.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "BURST_QUIET_S", 0.2)
    monkeypatch.setattr(async_engine, "BURST_MAX_S", 2.0)
    first_step = waiting_at_first_step(engine)
    prompt = engine.tokenizer.encode(PROMPT).ids
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(collect(engine, f"b{i}", prompt, GREEDY)))
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert first_step == [4]
    assert len({tuple(tokens) for tokens, _ in results}) == 1


async def test_a_request_still_being_prepared_joins_the_idle_engines_first_step(
    engine, monkeypatch
):
    # The second request is prepared for longer than the quiet gap (a slow tokenization, a
    # loaded event loop); while it is `arriving`, the first one waits for it.
    import deepserve.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "BURST_QUIET_S", 0.02)
    monkeypatch.setattr(async_engine, "BURST_MAX_S", 5.0)
    first_step = waiting_at_first_step(engine)
    prompt = engine.tokenizer.encode(PROMPT).ids

    async def slow_arrival() -> tuple:
        with engine.arriving():
            await asyncio.sleep(0.5)
        return await collect(engine, "slow", prompt, GREEDY)

    second = asyncio.create_task(slow_arrival())
    await asyncio.sleep(0)  # it is arriving before the first one is added
    first = asyncio.create_task(collect(engine, "first", prompt, GREEDY))
    await asyncio.gather(first, second)
    assert first_step == [2]


async def test_shutdown_stops_the_thread_and_refuses_new_work(loaded):
    eng = AsyncEngine(EngineConfig(num_kv_blocks=16), loaded)
    await eng.shutdown()
    assert not any(t.name == "deepserve-engine" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(EngineDeadError):
        await collect(eng, "late", [1, 2, 3], GREEDY)


def test_load_error_raises_in_the_caller_and_leaves_no_thread():
    with pytest.raises(ModelNotFoundError):
        AsyncEngine(EngineConfig(model="no-such-model"))
    assert not any(t.name == "deepserve-engine" and t.is_alive() for t in threading.enumerate())


async def test_structured_request_compiles_off_loop_and_matches_its_regex(engine):
    from deepserve.engine.sampling_params import StructuredOutput

    prompt = engine.tokenizer.encode("The year the first moon landing happened:").ids
    params = SamplingParams(
        temperature=0, max_tokens=10, structured=StructuredOutput("regex", "[0-9]{4}")
    )
    tokens, outs = await collect(engine, "year", prompt, params)
    assert outs[-1].outputs[-1].finish_reason == "stop"
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(text) == 4 and text.isdigit()


async def test_bad_grammar_raises_before_queueing(engine):
    from deepserve.engine.sampling_params import StructuredOutput

    params = SamplingParams(structured=StructuredOutput("json_schema", "{oops"))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        await collect(engine, "bad-schema", [1, 2, 3], params)
    assert engine.load().waiting == 0
