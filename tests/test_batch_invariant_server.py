"""The listing audit through the HTTP server (SmolLM2 and tiny-deepseek-v4, official openai SDK):
40 saved prompts, each
run 10 times while random concurrent traffic comes and goes, at temperature 0 and at 0.8 with a
fixed seed. With `--batch-invariant` no output (text and per-token logprobs) may differ from its
prompt's first run; without it the same audit finds differences (the count is printed)."""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest
from openai import OpenAI
from server_harness import engine_for, running_server

from deepserve.kernels.cpu import packed

MODEL = "smollm2-135m"
SUBJECTS = ["cats", "rivers", "bread", "chess", "snow", "trains", "bees", "maps", "tea", "clocks"]
PROMPTS = [
    f"{verb} {subject} in a few words."
    for verb in ("Describe", "Praise", "Explain", "Name facts about")
    for subject in SUBJECTS
]
NOISE = [f"Write a list of {k} colours and say why each is nice." for k in range(2, 12)]
RUNS = 10


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
    client: OpenAI, model: str, temperature: float, seed: int | None, rng: random.Random
) -> int:
    """Outputs that differ from their prompt's first run, over len(PROMPTS) * RUNS requests."""
    first: dict[str, tuple] = {}
    differ = 0
    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        for _ in range(RUNS):
            order = PROMPTS[:]
            rng.shuffle(order)
            noise = [
                pool.submit(_ask, client, model, rng.choice(NOISE), 1.0, None, rng.randint(2, 12))
                for _ in range(rng.randint(0, 10))
            ]
            futures = {p: pool.submit(_ask, client, model, p, temperature, seed, 3) for p in order}
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
        return {t: _audit(client, model, t, 1234 if t else None, rng) for t in (0.0, 0.8)}


@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, "tiny-deepseek-v4"])
def test_listing_audit_no_output_differs_with_the_flag(model):
    assert _run_audit(batch_invariant=True, model=model) == {0.0: 0, 0.8: 0}


@pytest.mark.slow
def test_listing_audit_without_the_flag_finds_differences(record_property, monkeypatch):
    # The default CPU linear (kernels/cpu/csrc/linear.cpp) and attention are batch invariant by
    # themselves, so SmolLM2 without the flag can pass the audit; torch's F.linear (MKL) is not,
    # which keeps this the proof that the audit can fail.
    monkeypatch.setattr(packed, "pack_linear_weight", lambda w, quantized=None: w)
    counts = _run_audit(batch_invariant=False)
    record_property("differing_of_400", counts)
    print(f"flag off: outputs differing from their first run, of 400 each: {counts}")
    assert sum(counts.values()) > 0
