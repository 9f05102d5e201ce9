"""`--batch-invariant` end to end on the CPU, for SmolLM2 (real weights), tiny-deepseek and
tiny-deepseek-v4.

A set of prompts is run alone (cold, one request in the engine), then inside batches of different
sizes with different neighbours, with chunked prefill at two chunk sizes, and after a
prefix-cache hit. With the flag on, every token and every logprob must be bitwise equal to the run
alone; with it off, the same procedure must find a difference somewhere (so the check can fail).
Seeded sampling at temperature > 0 must also match, with n > 1 and under preemption."""

from __future__ import annotations

import pytest

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams

MODELS = ["smollm2-135m", "tiny-deepseek", "tiny-deepseek-v4"]
SHARED = "You are a careful assistant. Answer in one short sentence, plainly and politely. "
PROMPTS = [
    SHARED + "What is the capital of France?",
    SHARED + "Name a prime number larger than ten.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    SHARED + "Why is the sky blue?",
]
NOISE = [
    "import numpy as np\nimport torch\n\nclass Model:\n    def __init__(self):",
    "Water boils at",
    "List of planets in the solar system: Mercury, Venus,",
    "SELECT name, age FROM users WHERE",
]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)

Result = tuple[tuple[int, ...], tuple[float, ...]]


def _loaded(model: str, batch_invariant: bool):
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(model=model, batch_invariant=batch_invariant))


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded_on(model):
    return _loaded(model, True)


@pytest.fixture(scope="module")
def loaded_off(model):
    # The default CPU linear (kernels/cpu/csrc/linear.cpp) is batch invariant by itself, so SmolLM2
    # without the flag can pass the check; torch's F.linear (MKL) is not, which keeps this the
    # proof that the check can fail.
    from deepserve.kernels.cpu import packed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed, "pack_linear_weight", lambda w, quantized=None, onednn=False: w)
        return _loaded(model, False)


def _llm(loaded, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("dtype", str(loaded.model.dtype).removeprefix("torch."))
    config = EngineConfig(model=loaded.info.name, batch_invariant=True, **kw)
    return LLM(config, loaded)


def _results(llm: LLM, prompts: list[list[int]], params) -> list[list[Result]]:
    """Per prompt, per sample: (token ids, chosen-token logprobs)."""
    out = llm.generate(prompts, params)
    return [
        [(tuple(s.token_ids), tuple(lp.logprob for lp in s.logprobs or [])) for s in r.samples]
        for r in out
    ]


def _alone(loaded, prompts, params) -> list[list[Result]]:
    llm = _llm(loaded, enable_prefix_caching=False)
    return [_results(llm, [p], params)[0] for p in prompts]


def _variants(loaded, prompts, noise, params):
    """(name, the prompts' results) in every setting that must not change them, lazily."""
    n = len(prompts)
    yield "one batch with neighbours", _results(_llm(loaded), prompts + noise, params)[:n]
    mixed = _results(_llm(loaded), noise[:2] + prompts[::-1], params)
    yield "reversed after other traffic", mixed[2:][::-1]
    for chunk in (7, 33):
        llm = _llm(loaded, max_num_batched_tokens=chunk, enable_prefix_caching=False)
        yield f"chunked prefill {chunk}", _results(llm, noise + prompts, params)[len(noise) :]
    warm = _llm(loaded)
    _results(warm, prompts[:1] + noise, params)  # the shared prefix is now cached
    hit = warm.generate(prompts, params)
    assert all(r.cached_tokens > 0 for r in hit[:2]), "expected a prefix-cache hit"
    yield "after a prefix-cache hit", _results(warm, prompts, params)


def _differences(reference, runs, first_only: bool = False) -> list[str]:
    found = []
    for name, results in runs:
        found += [
            f"{name}: prompt {i}"
            for i, (got, want) in enumerate(zip(results, reference, strict=True))
            if got != want
        ]
        if found and first_only:
            break
    return found


def _encode(loaded, texts: list[str]) -> list[list[int]]:
    return [loaded.tokenizer.encode(t).ids for t in texts]


@pytest.mark.slow
def test_greedy_tokens_and_logprobs_bitwise_equal_in_any_batch(loaded_on):
    prompts, noise = _encode(loaded_on, PROMPTS), _encode(loaded_on, NOISE)
    reference = _alone(loaded_on, prompts, GREEDY)
    assert _differences(reference, _variants(loaded_on, prompts, noise, GREEDY)) == []


@pytest.mark.slow
def test_without_the_flag_the_same_check_finds_differences(loaded_off):
    prompts, noise = _encode(loaded_off, PROMPTS), _encode(loaded_off, NOISE)
    reference = _alone(loaded_off, prompts, GREEDY)
    assert _differences(reference, _variants(loaded_off, prompts, noise, GREEDY), True) != []


@pytest.mark.slow
def test_seeded_sampling_equal_in_batches_with_n_and_preemption(loaded_on):
    prompts, noise = _encode(loaded_on, PROMPTS[:4]), _encode(loaded_on, NOISE)
    params = [
        SamplingParams(
            temperature=0.8, seed=1000 + i, n=2, max_tokens=6, ignore_eos=True, logprobs=0
        )
        for i in range(len(prompts))
    ]
    loud = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    reference = [
        _results(_llm(loaded_on, enable_prefix_caching=False), [p], q)[0]
        for p, q in zip(prompts, params, strict=True)
    ]
    busy = _results(_llm(loaded_on), prompts + noise, params + [loud] * len(noise))
    # a pool of a few blocks: requests are preempted and recomputed
    tight = _llm(loaded_on, num_kv_blocks=6, max_num_batched_tokens=32)
    preempted = _results(tight, prompts + noise, params + [loud] * len(noise))
    assert tight.engine.scheduler.num_preemptions > 0, "the tight pool should force preemption"
    runs = [("busy batch", busy[: len(prompts)]), ("preemption", preempted[: len(prompts)])]
    assert _differences(reference, runs) == []
    assert any(r[0] != r[1] for r in reference), "n=2 samples should not all be equal"


@pytest.mark.slow
def test_bfloat16_smollm2_greedy_tokens_and_logprobs_bitwise_equal_in_any_batch():
    """A bfloat16 model runs the native bf16 norms, RoPE + KV write, SwiGLU and bf16-output
    linear in prefill and decode alike."""
    loaded = _loaded_dtype("smollm2-135m", "bfloat16")
    prompts, noise = _encode(loaded, PROMPTS), _encode(loaded, NOISE)
    reference = _alone(loaded, prompts, GREEDY)
    assert _differences(reference, _variants(loaded, prompts, noise, GREEDY)) == []


def _loaded_dtype(model: str, dtype: str):
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(model=model, batch_invariant=True, dtype=dtype))
