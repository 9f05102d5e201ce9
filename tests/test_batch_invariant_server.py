"""The listing audit through the HTTP server (SmolLM2 and tiny-deepseek-v4, official openai SDK):
40 saved prompts, each
run 10 times while random concurrent traffic comes and goes, at temperature 0 and at 0.8 with a
fixed seed. With `--batch-invariant` no output (text and per-token logprobs) may differ from its
prompt's first run; without it the same audit finds differences (the count is printed). With
`--batch-invariant --speculative ngram` (rewrite-style prompts, so drafts are accepted) no output
may differ from the same request's output under the flag without speculation, and /metrics
reports the accepted drafts."""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_harness import engine_for, running_server

from deepserve.engine.config import SpeculativeConfig
from deepserve.kernels.cpu import packed

MODEL = "smollm2-135m"
SUBJECTS = ["cats", "rivers", "bread", "chess", "snow", "trains", "bees", "maps", "tea", "clocks"]
PROMPTS = [
    f"{verb} {subject} in a few words."
    for verb in ("Describe", "Praise", "Explain", "Name facts about")
    for subject in SUBJECTS
]
COPY_PROMPTS = [
    f"{verb} this sentence: The {subject} by the old harbour are quiet in the morning."
    for verb in ("Repeat", "Copy exactly", "Rewrite with better words", "Say again")
    for subject in SUBJECTS
]
NOISE = [f"Write a list of {k} colours and say why each is nice." for k in range(2, 12)]
RUNS = 10
TEMPERATURES = (0.0, 0.8)


def _ask(
    client: OpenAI, model: str, prompt: str, temperature: float, seed: int | None, max_tokens: int
):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        logprobs=True,
    )
    choice = r.choices[0]
    lps = tuple(t.logprob for t in (choice.logprobs.content or [])) if choice.logprobs else ()
    return choice.message.content or "", lps


def _audit(
    client: OpenAI,
    model: str,
    temperature: float,
    seed: int | None,
    rng: random.Random,
    prompts: list[str] = PROMPTS,
    max_tokens: int = 3,
    reference: dict[str, tuple] | None = None,
) -> int:
    """Outputs that differ from their prompt's first run (or from `reference[prompt]`), over
    len(prompts) * RUNS requests."""
    first: dict[str, tuple] = dict(reference or {})
    differ = 0
    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        for _ in range(RUNS):
            order = prompts[:]
            rng.shuffle(order)
            noise = [
                pool.submit(_ask, client, model, rng.choice(NOISE), 1.0, None, rng.randint(2, 12))
                for _ in range(rng.randint(0, 10))
            ]
            futures = {
                p: pool.submit(_ask, client, model, p, temperature, seed, max_tokens) for p in order
            }
            for p, f in futures.items():
                out = f.result()
                if p not in first:
                    first[p] = out
                elif out != first[p]:
                    differ += 1
            for f in noise:
                f.result()
    return differ


def _run_audit(batch_invariant: bool, model: str = MODEL) -> dict[float, int]:
    rng = random.Random(7)
    with (
        engine_for(model, batch_invariant=batch_invariant, max_num_batched_tokens=64) as engine,
        running_server(engine, model) as srv,
    ):
        assert httpx.get(srv.base_url + "/health").json()["batch_invariant"] is batch_invariant
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        return {t: _audit(client, model, t, 1234 if t else None, rng) for t in TEMPERATURES}


@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, "tiny-deepseek-v4"])
def test_listing_audit_no_output_differs_with_the_flag(model):
    assert _run_audit(batch_invariant=True, model=model) == {0.0: 0, 0.8: 0}


@pytest.mark.slow
def test_listing_audit_without_the_flag_finds_differences(record_property, monkeypatch):
    # The default CPU linear (kernels/cpu/csrc/linear.cpp) and attention are batch invariant by
    # themselves, so SmolLM2 without the flag can pass the audit; torch's F.linear (MKL) is not,
    # which keeps this the proof that the audit can fail.
    monkeypatch.setattr(packed, "pack_linear_weight", lambda w, quantized=None, onednn=False: w)
    counts = _run_audit(batch_invariant=False)
    record_property("differing_of_400", counts)
    print(f"flag off: outputs differing from their first run, of 400 each: {counts}")
    assert sum(counts.values()) > 0


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return sum(s.value for s in samples if s.name == name)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 880 requests of 10 tokens, on a shared CPU
def test_listing_audit_with_ngram_speculation_equals_the_flag_without_it():
    """The reference is each prompt's output from a server with the flag alone, asked one at a
    time; the audit then runs on a server with the flag and n-gram speculation."""
    spec_tokens = 10
    with (
        engine_for(MODEL, batch_invariant=True) as engine,
        running_server(engine, MODEL) as srv,
    ):
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        reference = {
            t: {
                p: _ask(client, MODEL, p, t, 1234 if t else None, spec_tokens) for p in COPY_PROMPTS
            }
            for t in TEMPERATURES
        }
    rng = random.Random(7)
    with (
        engine_for(
            MODEL,
            batch_invariant=True,
            max_num_batched_tokens=64,
            speculative=SpeculativeConfig("ngram", 4),
        ) as engine,
        running_server(engine, MODEL) as srv,
    ):
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        counts = {
            t: _audit(
                client, MODEL, t, 1234 if t else None, rng, COPY_PROMPTS, spec_tokens, reference[t]
            )
            for t in TEMPERATURES
        }
        drafted = _metric(srv.base_url, "deepserve:spec_decode_num_draft_tokens_total")
        accepted = _metric(srv.base_url, "deepserve:spec_decode_num_accepted_tokens_total")
    print(f"--batch-invariant --speculative ngram: {accepted:.0f} of {drafted:.0f} drafts accepted")
    assert counts == {0.0: 0, 0.8: 0}
    assert accepted > 0
