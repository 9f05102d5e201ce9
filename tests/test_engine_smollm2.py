"""The engine end to end on SmolLM2's real weights: batching, chunking, prefix cache, forks,
preemption, abort, seeded sampling and bad input, each checked against running requests alone."""

from __future__ import annotations

import json

import pytest

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import InvalidRequestError, ModelNotFoundError
from deepserve.engine.llm import LLM
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "import numpy as np\nimport torch\n\nclass Model:\n    def __init__(self):",
    "Water boils at",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
    "In 1969, the first humans",
    "The quick brown fox",
    "List of planets in the solar system: Mercury, Venus,",
    "Photosynthesis is the process by which plants",
    "SELECT name, age FROM users WHERE",
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig())


def make_llm(loaded, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    return LLM(EngineConfig(**kw), loaded)


@pytest.fixture(scope="module")
def llm(loaded):
    return make_llm(loaded)


def alone(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def greedy_alone(llm) -> list[list[int]]:
    """Each of TEXTS run by itself: the reference for every batching test."""
    return alone(llm, [llm.encode(t) for t in TEXTS], GREEDY)


def test_concurrent_mixed_lengths_with_small_chunks_match_alone(loaded, llm, greedy_alone):
    prompts = [llm.encode(t) for t in TEXTS]
    chunked = make_llm(loaded, max_num_batched_tokens=16)
    assert [r.token_ids for r in chunked.generate(prompts, GREEDY)] == greedy_alone


def test_shared_prefix_is_served_from_cache_with_cold_output(loaded, llm):
    prefix = llm.encode(" ".join(TEXTS * 2))[:200]
    assert len(prefix) == 200
    warm = make_llm(loaded)
    warm.generate([prefix + llm.encode(" Summary:")], GREEDY)
    second = prefix + llm.encode(" In short,")
    hit = warm.generate([second], GREEDY)[0]
    cold = make_llm(loaded).generate([second], GREEDY)[0]
    assert hit.cached_tokens >= 192 and cold.cached_tokens == 0
    assert hit.token_ids == cold.token_ids


def test_n_samples_share_the_prompt_blocks(loaded, llm):
    engine = make_llm(loaded).engine
    prompt = llm.encode(TEXTS[2])  # 18 tokens: one full block + a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    request = engine.add_request("fork", prompt, params)
    engine.step()
    tables = [s.block_table for s in request.sequences]
    assert all(t[0] == tables[0][0] for t in tables)
    assert len({t[1] for t in tables}) == 4
    assert engine.block_manager.blocks[tables[0][0]].ref_count == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 5


def test_n_samples_are_seeded_per_index(llm):
    prompt = llm.encode(TEXTS[0])
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    samples = llm.generate([prompt], params)[0].samples
    single = llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    )
    assert samples[0].token_ids == single[0].token_ids
    assert len({tuple(s.token_ids) for s in samples}) == 3


def test_tiny_pool_preempts_and_every_request_matches_alone(loaded, llm, greedy_alone):
    prompts = [llm.encode(t) for t in TEXTS + TEXTS[:4]]  # 16 requests, at most 3 blocks each
    small = make_llm(loaded, num_kv_blocks=6, enable_prefix_caching=False)
    got = [r.token_ids for r in small.generate(prompts, GREEDY)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == greedy_alone + greedy_alone[:4]
    assert small.engine.block_manager.usage == 0.0


def test_abort_frees_every_block(loaded, llm):
    engine = make_llm(loaded).engine
    for i, text in enumerate(TEXTS[:6]):
        engine.add_request(str(i), llm.encode(text), SamplingParams(n=2, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.load().kv_usage > 0
    for i in range(6):
        engine.abort(str(i))
    load = engine.load()
    assert (load.running, load.waiting, load.kv_usage) == (0, 0, 0.0)
    assert load.num_free_blocks == load.num_blocks and not engine.has_unfinished()


def test_seeded_sampling_alone_equals_inside_busy_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12)
    prompt = llm.encode(TEXTS[6])
    solo = llm.generate([prompt], params)[0].token_ids
    busy = [llm.encode(t) for t in TEXTS[:6]] + [prompt]
    noise = [SamplingParams(temperature=1.0, max_tokens=20)] * 6
    assert llm.generate(busy, noise + [params])[-1].token_ids == solo


def test_stop_token_ends_with_stop_reason(llm):
    prompt = llm.encode(TEXTS[0])
    first = llm.generate([prompt], GREEDY)[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(first[2],))
    sample = llm.generate([prompt], params)[0].samples[0]
    assert sample.token_ids == first[:3] and sample.finish_reason == "stop"


def test_logprobs_report_chosen_and_top_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    sample = llm.generate([llm.encode(TEXTS[0])], params)[0].samples[0]
    assert len(sample.logprobs) == 3
    for token, lp in zip(sample.token_ids, sample.logprobs, strict=True):
        assert lp.token_id == token and lp.top[0][0] == token and lp.logprob <= 0


def test_bad_input_raises_before_queueing_and_engine_keeps_serving(loaded, llm):
    engine: LLMEngine = make_llm(loaded, max_model_len=64).engine
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.add_request("long", [1] * 64, GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("much", [1] * 10, SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("oov", [10**6], GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("neg", [1], SamplingParams(temperature=-1))
    assert not engine.has_unfinished() and engine.load().waiting == 0
    engine.add_request("ok", llm.encode(TEXTS[0]), GREEDY)
    while engine.has_unfinished():
        engine.step()


def test_unknown_model_name_raises_model_not_found():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(EngineConfig(model="no-such-model"))


@pytest.mark.slow
def test_greedy_32_tokens_equal_transformers_generate(llm):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from deepserve.engine.loading.builtin_models import resolve_model

    path = resolve_model("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = llm.encode(TEXTS[4])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert llm.generate([prompt], params)[0].token_ids == ref[0, len(prompt) :].tolist()


def test_json_schema_output_validates_and_ends_with_stop(llm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    chat = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=60,
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )
    results = llm.generate([llm.encode(chat)] * 2, [params, SamplingParams(max_tokens=4)])
    sample = results[0].samples[0]
    assert sample.finish_reason == "stop"
    jsonschema.validate(json.loads(sample.text), schema)


def test_bad_grammar_raises_before_queueing(llm):
    params = SamplingParams(structured=StructuredOutput("json_schema", "{not json"))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        llm.engine.add_request("bad-grammar", [1, 2, 3], params)
    assert not llm.engine.has_unfinished()
