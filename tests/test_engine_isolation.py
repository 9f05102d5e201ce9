"""One request cannot take the engine down: a top_k past int64 is clamped to the vocabulary, a
request whose step raises fails alone while the requests batched with it finish unchanged, and a
stopped engine says so (`unavailable`)."""

from __future__ import annotations

import asyncio

import pytest

from deepserve.engine.async_engine import AsyncEngine
from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import RequestFailedError
from deepserve.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(num_threads=1))


@pytest.fixture
async def engine(loaded):
    eng = AsyncEngine(EngineConfig(num_kv_blocks=128, num_threads=1), loaded)
    yield eng
    await eng.shutdown()


async def tokens_of(engine: AsyncEngine, rid: str, prompt: list[int], params) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(rid, engine.admit(prompt, params)):
        out += [t for c in delta.outputs for t in c.token_ids]
    return out


@pytest.mark.parametrize("top_k", [2**63, 2**64 - 1])
async def test_top_k_past_int64_samples_as_if_unset(engine, top_k):
    prompt = engine.tokenizer.encode(PROMPT).ids
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    huge = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, top_k=top_k)
    unset = await tokens_of(engine, "u", prompt, seeded)
    assert await tokens_of(engine, "k", prompt, huge) == unset
    assert engine.unavailable() is None


async def test_request_whose_sampling_raises_fails_alone_and_batchmates_finish(engine):
    prompt = engine.tokenizer.encode(PROMPT).ids
    alone = await tokens_of(engine, "alone", prompt, GREEDY)
    # A value the sampler cannot turn into a tensor: only this request's step can raise.
    bad = SamplingParams(temperature=0.7, max_tokens=8, logit_bias={5: "not a number"})
    results = await asyncio.gather(
        tokens_of(engine, "good-1", prompt, GREEDY),
        tokens_of(engine, "bad", prompt, bad),
        tokens_of(engine, "good-2", prompt, GREEDY),
        return_exceptions=True,
    )
    assert isinstance(results[1], RequestFailedError), results[1]
    assert results[0] == alone and results[2] == alone
    assert engine.unavailable() is None
    assert await tokens_of(engine, "after", prompt, GREEDY) == alone
    assert engine.load().running == 0 and engine.load().kv_usage == 0.0


async def test_stopped_engine_reports_itself_unavailable(loaded):
    eng = AsyncEngine(EngineConfig(num_kv_blocks=16, num_threads=1), loaded)
    assert eng.unavailable() is None
    await eng.shutdown()
    assert "not running" in eng.unavailable()
