"""n-gram (prompt lookup) speculation on SmolLM2's real weights: the output with speculation is
token for token the output without it, alone, in a busy batch and under a json_schema constraint.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput

NGRAM = SpeculativeConfig("ngram", 4)
PARAGRAPH = (
    "Teh old lighthouse stood on the edge of the cliff, its paint peeling after years of wind "
    "and salt. Every evening the keeper climbed the stairs to light the lamp, and every morning "
    "he wrote the wether in a small leather book."
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


REWRITE = chat(f"Rewrite this paragraph fixing the typos:\n\n{PARAGRAPH}")


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    torch.set_num_threads(1)
    return load_model(EngineConfig())


def make_llm(loaded, spec, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(EngineConfig(speculative=spec, **kw), loaded)


def outputs(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[s.token_ids for s in r.samples] for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(loaded) -> LLM:
    return make_llm(loaded, None)


def test_ngram_greedy_alone_matches_plain_and_accepts_copied_text(loaded, plain):
    params = SamplingParams(temperature=0, max_tokens=40)
    spec = make_llm(loaded, NGRAM)
    assert outputs(spec, [REWRITE], params) == outputs(plain, [REWRITE], params)
    stats = spec.engine.spec.stats
    assert stats.acceptance_rate > 0.5  # the answer copies the paragraph
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_ngram_busy_batch_matches_plain(loaded, plain):
    """Greedy, seeded sampling, n=2, a stop token and short max_tokens in one batch, with 24-token
    prefill chunks and prompts sharing a prefix (cache hits); each request compared with the same
    batch run without speculation."""
    prompts = [
        REWRITE,
        chat(f"Copy this text exactly:\n\n{PARAGRAPH}"),
        chat("List the numbers from one to twenty, separated by commas."),
        REWRITE,
        chat(f"Summarize in one line:\n\n{PARAGRAPH}"),
    ]
    period = plain.encode(".")[0]
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.7, seed=7, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(period,)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    kw = dict(max_num_batched_tokens=24)
    spec_llm = make_llm(loaded, NGRAM, **kw)
    expected = outputs(make_llm(loaded, None, **kw), prompts, params)
    assert outputs(spec_llm, prompts, params) == expected
    assert spec_llm.engine.spec.stats.num_accepted_tokens > 0
    assert [len(s) for s in expected[4]] == [5]
    bm = spec_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_ngram_json_schema_greedy_matches_plain_and_validates(loaded, plain):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "city": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
        },
        "required": ["name", "city", "age"],
        "additionalProperties": False,
    }
    prompt = chat(
        'Return JSON with the fields name, city and age for: name "Ada Lovelace", city '
        '"London", age 36. Example: {"name": "Ada Lovelace", "city": "London", "age": 36}'
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=48,
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )
    spec = make_llm(loaded, NGRAM)
    got = spec.generate([prompt], params)[0]
    assert got.token_ids == outputs(plain, [prompt], params)[0][0]
    jsonschema.validate(json.loads(got.text), schema)
    assert spec.engine.spec.stats.num_accepted_tokens > 0
