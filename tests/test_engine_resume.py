"""Resuming a request from output tokens produced elsewhere (prefill/decode disaggregation): the
continuation equals a colocated run's for seeded sampling, penalties and grammars; resumed tokens
count toward max_tokens and are never emitted again; bad resumes are refused before queueing."""

from __future__ import annotations

import pytest

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput

PROMPT = "Once upon a time, in a small village by the sea, there lived"
SEEDED = SamplingParams(
    temperature=0.9,
    top_p=0.95,
    seed=1234,
    max_tokens=16,
    ignore_eos=True,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.2,
)


@pytest.fixture(scope="module")
def engine():
    from deepserve.engine.loading.loader import load_model

    config = EngineConfig(num_kv_blocks=128, num_threads=1)
    eng = LLMEngine(config, load_model(config))
    yield eng
    eng.close()


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, resume=()):
    engine.add_request(rid, prompt, params, resume_token_ids=resume)
    tokens, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids if out.outputs else []
            last = out
    return tokens, last


def prompt_ids(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode(PROMPT).ids


def test_seeded_sampling_with_penalties_continues_like_colocated(engine):
    ids = prompt_ids(engine)
    colocated, _ = run(engine, "whole", ids, SEEDED)
    rest, _ = run(engine, "resumed", ids, SEEDED, resume=colocated[:3])
    assert rest == colocated[3:]


def test_constrained_request_continues_inside_its_grammar(engine):
    params = SamplingParams(
        temperature=0.8, seed=7, max_tokens=40, structured=StructuredOutput("regex", "[a-z ]{5,30}")
    )
    ids = prompt_ids(engine)
    colocated, whole = run(engine, "g-whole", ids, params)
    rest, last = run(engine, "g-resumed", ids, params, resume=colocated[:2])
    assert rest == colocated[2:]
    assert last.outputs[0].finish_reason == whole.outputs[0].finish_reason


def test_resumed_tokens_count_toward_max_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = prompt_ids(engine)
    colocated, _ = run(engine, "m-whole", ids, params)
    rest, last = run(engine, "m-resumed", ids, params, resume=colocated[:2])
    assert rest == colocated[2:] and len(rest) == 3
    assert last.outputs[0].finish_reason == "length"


def test_cached_tokens_never_exceed_the_prompt(engine):
    ids = prompt_ids(engine)[:16]  # one full block: the resumed token starts the next
    first, _ = run(engine, "c-whole", ids, SamplingParams(temperature=0, max_tokens=4))
    _, last = run(engine, "c-resumed", ids, SamplingParams(temperature=0, max_tokens=4), first[:2])
    assert last.cached_tokens <= last.prompt_tokens == len(ids)


def test_resume_of_a_multi_sample_request_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="n=1"):
        engine.add_request("n2", prompt_ids(engine), SamplingParams(n=2), resume_token_ids=[42])


def test_resume_using_all_of_max_tokens_is_refused(engine):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="nothing of max_tokens"):
        engine.add_request("full", prompt_ids(engine), params, resume_token_ids=[42, 43])


def test_resumed_token_outside_the_grammar_is_refused(engine):
    params = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))
    letter = engine.tokenizer.encode("hello").ids[:1]
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.add_request("bad", prompt_ids(engine), params, resume_token_ids=letter)
    assert not engine.has_unfinished()
