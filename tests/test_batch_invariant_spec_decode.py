"""`--batch-invariant` with speculative decoding on the CPU: speculation stays on under the flag, and
every output (tokens and per-token logprobs) is bitwise the output the same request gets under the
flag without speculation, greedy and seeded at temperature 0.8, alone and among random other traffic
(chunked prefill, prefix-cache hits, preemption).

Drafters: n-gram on SmolLM2 (real weights; the prompts ask for copied text, so drafts are
accepted), MTP on tiny-deepseek and tiny-deepseek-v4 (slow to load: marked slow) (random MTP
weights: nearly every draft is rejected, and the output must still be plain decoding's), and on
tiny-deepseek a drafter (test only) that proposes the reference continuation, so every draft is
accepted and every emitted token after the first comes from a verification step. The slow audit
runs 40 prompts x 10 times among random traffic.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams

Result = tuple[tuple[int, ...], tuple[float, ...]]  # token ids, chosen-token logprobs

PARAGRAPH = (
    "Teh old lighthouse stood on the edge of the cliff, its paint peeling after years of wind "
    "and salt. Every evening the keeper climbed the stairs to light the lamp, and every morning "
    "he wrote the wether in a small leather book."
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


SMOLLM2_PROMPTS = [
    chat(f"Rewrite this paragraph fixing the typos:\n\n{PARAGRAPH}"),
    chat(f"Copy this text exactly:\n\n{PARAGRAPH}"),
    chat("List the numbers from one to twenty, separated by commas."),
    "The three primary colors are",
]
SMOLLM2_NOISE = [
    chat(f"Summarize in one line:\n\n{PARAGRAPH}"),
    "import numpy as np\nimport torch\n\nclass Model:\n    def __init__(self):",
    "List of planets in the solar system: Mercury, Venus,",
    "Water boils at",
]
TINY_PROMPTS = [[7 + i for i in range(n)] for n in (3, 11, 17, 26)]
TINY_NOISE = [[100 + 3 * i for i in range(n)] for n in (2, 9, 20, 33)]


@dataclass(frozen=True)
class Setup:
    """A model, its drafter, and the prompts to audit and to make traffic with."""

    name: str
    model: str
    spec: SpeculativeConfig
    prompts: list  # text, or token ids
    noise: list  # prompts of the other traffic
    reference_drafts: bool = False  # replace the drafter by one proposing the reference output


SETUPS = [
    Setup("smollm2-ngram", "smollm2-135m", SpeculativeConfig("ngram", 4), SMOLLM2_PROMPTS,
          SMOLLM2_NOISE),
    Setup("tiny-deepseek-mtp", "tiny-deepseek", SpeculativeConfig("mtp", 3), TINY_PROMPTS,
          TINY_NOISE),
    Setup("tiny-deepseek-accepted", "tiny-deepseek", SpeculativeConfig("ngram", 3), TINY_PROMPTS,
          TINY_NOISE, reference_drafts=True),
    pytest.param(Setup("tiny-deepseek-v4-mtp", "tiny-deepseek-v4", SpeculativeConfig("mtp", 3),
                       TINY_PROMPTS, TINY_NOISE), marks=pytest.mark.slow),
]  # fmt: skip
TEMPERATURES = [0.0, 0.8]
MAX_TOKENS = 20


def params_for(temperature: float, count: int, max_tokens: int = MAX_TOKENS):
    return [
        SamplingParams(
            temperature=temperature,
            seed=1000 + i if temperature else None,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=0,
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: s.name)
def setup(request) -> Setup:
    return request.param


@pytest.fixture(scope="module")
def load():
    """A model loaded under the flag, once per module (two setups share tiny-deepseek)."""
    from deepserve.engine.loading.loader import load_model

    @functools.cache
    def load_once(model: str):
        return load_model(EngineConfig(model=model, batch_invariant=True))

    return load_once


@pytest.fixture(scope="module")
def loaded(setup, load):
    return load(setup.model)


def make_llm(loaded, spec: SpeculativeConfig | None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    config = EngineConfig(model=loaded.info.name, batch_invariant=True, speculative=spec, **kw)
    return LLM(config, loaded)


def encode(loaded, prompts) -> list[list[int]]:
    return [p if isinstance(p, list) else loaded.tokenizer.encode(p).ids for p in prompts]


def results(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Result]:
    out = llm.generate(prompts, params)
    return [(tuple(r.token_ids), tuple(lp.logprob for lp in r.samples[0].logprobs)) for r in out]


def alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Result]:
    return [results(llm, [p], [q])[0] for p, q in zip(prompts, params, strict=True)]


class ReferenceDrafter:
    """Test only: drafts the continuation of whichever reference sequence the tokens follow, so
    every draft equals the target's sample; other sequences get none."""

    def __init__(self, prompts: list[list[int]], outputs: list[tuple[int, ...]]) -> None:
        self.full = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
        self.prompt_lens = [len(p) for p in prompts]

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        for full, n in zip(self.full, self.prompt_lens, strict=True):
            done = len(token_ids)
            if done >= n and full[:done] == list(token_ids):
                return full[done : done + num_tokens]
        return []


def speculative_llm(setup: Setup, loaded, reference, prompts, **kw) -> LLM:
    llm = make_llm(loaded, setup.spec, **kw)
    assert llm.engine.spec is not None, "speculation must stay on under --batch-invariant"
    if setup.reference_drafts:
        outputs = [tokens for tokens, _ in reference]
        llm.engine.spec.token_proposer = ReferenceDrafter(prompts, outputs)
    return llm


def check_acceptance(setup: Setup, llm: LLM) -> None:
    """Drafts were verified, and accepted where the drafter is good."""
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if setup.reference_drafts:
        assert stats.acceptance_rate == 1.0
    elif setup.spec.method == "ngram":
        assert stats.num_accepted_tokens > 0  # the copied paragraph


def among_traffic(
    llm: LLM,
    prompts: list[list[int]],
    params: list[SamplingParams],
    noise: list[list[int]],
    rng: random.Random,
    num_noise: int | None = None,
) -> list[Result]:
    """Run `prompts` while `num_noise` (default: 1-2 per prompt) unseeded requests of `noise`
    arrive and leave: every request (audited or noise) joins at a random step, noise stops after
    a random number of tokens."""
    engine = llm.engine
    arrivals = [(f"a{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    if num_noise is None:
        num_noise = len(prompts) + rng.randint(0, len(prompts))
    for j in range(num_noise):
        loud = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        arrivals.append((f"n{j}", rng.choice(noise), loud))
    rng.shuffle(arrivals)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in arrivals}
    logprobs: dict[str, list[float]] = {rid: [] for rid, _, _ in arrivals}
    while arrivals or engine.has_unfinished():
        for _ in range(min(len(arrivals), rng.randint(0, 3))):
            rid, prompt, sp = arrivals.pop()
            engine.add_request(rid, prompt, sp)
        for out in engine.step():
            for delta in out.outputs:
                tokens[out.request_id] += delta.token_ids
                logprobs[out.request_id] += [lp.logprob for lp in delta.logprobs or []]
    ids = [f"a{i}" for i in range(len(prompts))]
    return [(tuple(tokens[rid]), tuple(logprobs[rid])) for rid in ids]


@pytest.fixture(scope="module")
def references(setup, loaded) -> dict[float, list[Result]]:
    """Per temperature, each prompt's output under the flag without speculation, run alone."""
    prompts = encode(loaded, setup.prompts)
    plain = make_llm(loaded, None, enable_prefix_caching=False)
    return {t: alone(plain, prompts, params_for(t, len(prompts))) for t in TEMPERATURES}


def test_the_flag_keeps_speculation_on(setup, loaded):
    llm = make_llm(loaded, setup.spec)
    assert llm.engine.spec is not None
    assert llm.engine.spec.method == setup.spec.method


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_alone_equals_the_flag_without_speculation(setup, loaded, references, temperature):
    prompts = encode(loaded, setup.prompts)
    reference = references[temperature]
    llm = speculative_llm(setup, loaded, reference, prompts, enable_prefix_caching=False)
    assert alone(llm, prompts, params_for(temperature, len(prompts))) == reference
    check_acceptance(setup, llm)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_among_random_traffic_equals_the_flag_without_speculation(
    setup, loaded, references, temperature
):
    """Chunked prefill (32-token steps) and shared prompts (prefix-cache hits), noise that also
    speculates, requests joining at random steps."""
    prompts = encode(loaded, setup.prompts)
    reference = references[temperature]
    llm = speculative_llm(setup, loaded, reference, prompts, max_num_batched_tokens=32)
    params = params_for(temperature, len(prompts))
    got = among_traffic(llm, prompts, params, encode(loaded, setup.noise), random.Random(5))
    assert got == reference
    check_acceptance(setup, llm)


def test_preempted_and_recomputed_equals_the_flag_without_speculation(setup, loaded, references):
    """A pool of a few blocks: sequences are preempted mid-speculation and their tokens, drafts
    verified before included, recomputed as prefill."""
    prompts = encode(loaded, setup.prompts)
    reference = references[0.8]
    blocks = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts) + 2
    llm = speculative_llm(
        setup, loaded, reference, prompts, num_kv_blocks=blocks, max_num_batched_tokens=32
    )
    params = params_for(0.8, len(prompts))
    got = among_traffic(llm, prompts, params, encode(loaded, setup.noise), random.Random(6))
    assert llm.engine.scheduler.num_preemptions > 0, "the tight pool should force preemption"
    assert got == reference


@pytest.mark.slow
def test_without_the_flag_the_same_comparison_finds_differences(monkeypatch):
    """The proof that the comparison can fail: without the flag, on torch's F.linear (MKL, whose
    bits depend on the row count; the default native linear is invariant by itself), verification
    rows change the logprobs of SmolLM2's output."""
    from deepserve.engine.loading.loader import load_model
    from deepserve.kernels.cpu import packed

    monkeypatch.setattr(packed, "pack_linear_weight", lambda w, quantized=None, onednn=False: w)
    loaded = load_model(EngineConfig())
    prompts = encode(loaded, SMOLLM2_PROMPTS)
    params = params_for(0.0, len(prompts))

    def llm(spec):
        config = EngineConfig(speculative=spec, num_kv_blocks=256, enable_prefix_caching=False)
        return LLM(config, loaded)

    reference = alone(llm(None), prompts, params)
    assert alone(llm(SpeculativeConfig("ngram", 4)), prompts, params) != reference


# ---- the listing audit: 40 prompts x 10 runs among random traffic --------------------------------

SUBJECTS = ["cats", "rivers", "bread", "chess", "snow", "trains", "bees", "maps", "tea", "clocks"]
AUDIT_PROMPTS = [
    chat(f"{verb} this sentence: The {subject} by the old harbour are quiet in the morning.")
    for verb in ("Repeat", "Copy exactly", "Rewrite with better words", "Translate to French")
    for subject in SUBJECTS
]
RUNS = 10


def audit(
    llm: LLM, prompts, params, noise, reference: list[Result], rng: random.Random
) -> tuple[int, int]:
    """(outputs differing from the reference, outputs) over RUNS runs of every prompt."""
    differ = total = 0
    for _ in range(RUNS):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        audited = [prompts[i] for i in order], [params[i] for i in order]
        got = among_traffic(llm, *audited, noise, rng, num_noise=rng.randint(5, 20))
        differ += sum(g != reference[i] for g, i in zip(got, order, strict=True))
        total += len(got)
    return differ, total


TINY_AUDIT_PROMPTS = [[7 + i + 3 * k for i in range(5 + k % 17)] for k in range(40)]
# The tiny models' random weights never repeat their output, so n-gram lookup finds nothing to
# draft there: their n-gram engines draft with ReferenceDrafter instead (every draft accepted).
AUDITS = [
    ("smollm2-ngram", "smollm2-135m", SpeculativeConfig("ngram", 4), AUDIT_PROMPTS, SMOLLM2_NOISE),
    ("tiny-deepseek-mtp", "tiny-deepseek", SpeculativeConfig("mtp", 3), TINY_AUDIT_PROMPTS,
     TINY_NOISE),
    ("tiny-deepseek-reference-drafts", "tiny-deepseek", SpeculativeConfig("ngram", 4),
     TINY_AUDIT_PROMPTS, TINY_NOISE),
    ("tiny-deepseek-v4-reference-drafts", "tiny-deepseek-v4", SpeculativeConfig("ngram", 4),
     TINY_AUDIT_PROMPTS, TINY_NOISE),
    ("tiny-deepseek-v4-mtp", "tiny-deepseek-v4", SpeculativeConfig("mtp", 3), TINY_AUDIT_PROMPTS,
     TINY_NOISE),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 400 requests and their references, on a shared CPU
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("name, model, spec, texts, noise", AUDITS, ids=[a[0] for a in AUDITS])
def test_listing_audit_with_speculation_no_output_differs(
    load, name, model, spec, texts, noise, temperature
):
    """Each run puts the 40 prompts in a new order among new random traffic, on one engine (so
    later runs hit the prefix cache); every output must equal the flag's without speculation."""
    loaded = load(model)
    prompts = encode(loaded, texts)
    params = params_for(temperature, len(prompts), max_tokens=12)
    reference = alone(make_llm(loaded, None, enable_prefix_caching=False), prompts, params)
    llm = make_llm(loaded, spec, max_num_batched_tokens=64)
    if name.endswith("reference-drafts"):
        drafts = ReferenceDrafter(prompts, [tokens for tokens, _ in reference])
        llm.engine.spec.token_proposer = drafts
    differ, total = audit(llm, prompts, params, encode(loaded, noise), reference, random.Random(7))
    assert (differ, total) == (0, len(prompts) * RUNS)
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if spec.method == "ngram":  # a copy asked of real weights, or the reference's drafts
        assert stats.num_accepted_tokens > 0
