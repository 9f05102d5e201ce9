"""Disaggregated (1 prefill + 1 decode worker, KV through a real redis-server) gives the same
tokens and the same logprobs as colocated (1 mixed worker), in batch-invariant mode, for both
models: plain, streamed, seeded sampling, and a multi-turn conversation; and so does a decode
worker that speculates (n-gram on SmolLM2, MTP on tiny-deepseek) behind the same prefill worker.
Real processes on loopback, driven with the official openai SDK."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest
import router_cluster as rc
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

QUESTIONS = ["Name three colours.", "Which of them is the warmest?", "Say it in French."]


SPECULATIVE = {"smollm2-135m": "ngram", "tiny-deepseek": "mtp"}


@dataclass
class Stacks:
    model: str
    pd: openai.OpenAI  # frontend over the prefill and decode workers
    colo: openai.OpenAI  # frontend over the mixed worker
    pd_spec: openai.OpenAI  # frontend over the prefill and the speculating decode worker
    prefill: rc.Proc
    decode: rc.Proc
    spec_decode: rc.Proc
    frontends: tuple[rc.Proc, ...]


@pytest.fixture(scope="module", params=["smollm2-135m", "tiny-deepseek"])
def stacks(request, make_redis_server):
    model = request.param
    redis = make_redis_server()
    flags = ("--batch-invariant",)
    prefill = rc.worker("prefill", model, redis.url, *flags)
    decode = rc.worker("decode", model, redis.url, *flags)
    spec_decode = rc.worker("decode", model, redis.url, *flags, "--speculative", SPECULATIVE[model])
    mixed = rc.worker("mixed", model, None, *flags)
    rc.start_all(prefill, decode, spec_decode, mixed)
    pd = rc.frontend(model, prefill=[prefill], decode=[decode], redis_url=redis.url)
    pd_spec = rc.frontend(model, prefill=[prefill], decode=[spec_decode], redis_url=redis.url)
    colo = rc.frontend(model, workers=[mixed])
    rc.start_all(pd, pd_spec, colo)
    yield Stacks(
        model, client(pd), client(colo), client(pd_spec), prefill, decode, spec_decode,
        (pd, pd_spec, colo),
    )  # fmt: skip
    rc.stop_all(pd, pd_spec, colo, prefill, decode, spec_decode, mixed)


def client(p: rc.Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def options(model: str) -> dict:
    # DeepSeek's thinking mode ignores temperature (it samples); greedy needs it off.
    return {"extra_body": {"thinking": {"type": "disabled"}}} if "deepseek" in model else {}


def chat(c: openai.OpenAI, model: str, messages: list[dict], **kw):
    kw.setdefault("temperature", 0.0)
    kw.update(options(model))
    return c.chat.completions.create(
        model=model, messages=messages, max_tokens=10, logprobs=True, **kw
    )


def answer(reply) -> tuple[str, list[tuple[str, float]]]:
    choice = reply.choices[0]
    text = (getattr(choice.message, "reasoning_content", None) or "") + (
        choice.message.content or ""
    )
    return text, token_logprobs(choice.logprobs)


def token_logprobs(logprobs) -> list[tuple[str, float]]:
    """(token, logprob) of every output token, reasoning first (DeepSeek thinks before it answers)."""
    extra = logprobs.model_extra or {}
    reasoning = extra.get("reasoning_content") or []
    return [(t["token"], t["logprob"]) for t in reasoning] + [
        (t.token, t.logprob) for t in logprobs.content or []
    ]


def streamed(c: openai.OpenAI, model: str, messages: list[dict]) -> tuple[str, list]:
    text, logprobs = "", []
    stream = c.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0.0,
        logprobs=True,
        stream=True,
        **options(model),
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            text += (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
            if choice.logprobs:
                logprobs += token_logprobs(choice.logprobs)
    return text, logprobs


def test_disaggregated_equals_colocated(stacks):
    model, pd, colo = stacks.model, stacks.pd, stacks.colo
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    got, want = answer(chat(pd, model, messages)), answer(chat(colo, model, messages))
    assert got == want and len(want[1]) > 1
    assert rc.load(stacks.prefill)["prompt_tokens"] > 0
    assert rc.load(stacks.decode)["prompt_tokens"] > 0


def test_frontends_report_the_batch_invariance_their_workers_run(stacks):
    for frontend in stacks.frontends:
        assert httpx.get(frontend.url + "/health", timeout=5).json()["batch_invariant"] is True


def test_disaggregated_streaming_equals_colocated(stacks):
    model, pd, colo = stacks.model, stacks.pd, stacks.colo
    messages = [{"role": "user", "content": "Count to five."}]
    assert streamed(pd, model, messages) == streamed(colo, model, messages)
    assert streamed(pd, model, messages) == answer(chat(colo, model, messages))


def test_disaggregated_seeded_sampling_equals_colocated(stacks):
    model, pd, colo = stacks.model, stacks.pd, stacks.colo
    messages = [{"role": "user", "content": "Invent a word."}]
    kw = {"temperature": 0.9, "seed": 1234}
    assert answer(chat(pd, model, messages, **kw)) == answer(chat(colo, model, messages, **kw))


def generated_tokens(w: rc.Proc) -> float:
    text = httpx.get(w.url + "/metrics", headers=w.headers, timeout=5).text
    family = next(
        f for f in text_string_to_metric_families(text) if f.name.endswith("generation_tokens")
    )
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_sampled_request_with_penalties_streams_the_prefill_workers_first_token(stacks):
    model, pd, colo, decode = stacks.model, stacks.pd, stacks.colo, stacks.decode
    messages = [{"role": "user", "content": "Invent a word."}]
    kw = {"temperature": 0.9, "seed": 99, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    before = generated_tokens(decode)
    got = chat(pd, model, messages, **kw)
    assert answer(got) == answer(chat(colo, model, messages, **kw))
    # the decode worker resumed after the prefill worker's token instead of generating it again
    # (the engine also counts the EOS that ends a "stop"; usage does not)
    eos = 1 if got.choices[0].finish_reason == "stop" else 0
    assert generated_tokens(decode) - before == got.usage.completion_tokens - 1 + eos


def test_multi_turn_conversation_matches_and_later_turns_hit_the_cache(stacks):
    model, pd, colo = stacks.model, stacks.pd, stacks.colo
    history: list[dict] = []
    for i, question in enumerate(QUESTIONS):
        history.append({"role": "user", "content": question})
        got_reply, want_reply = chat(pd, model, history), chat(colo, model, history)
        assert answer(got_reply) == answer(want_reply), f"turn {i}"
        if i > 0:
            assert got_reply.usage.prompt_tokens_details.cached_tokens > 0
        history.append({"role": "assistant", "content": want_reply.choices[0].message.content})


def spec_counts(w: rc.Proc) -> tuple[float, float]:
    """(draft tokens, accepted tokens) the worker's /metrics counted."""
    text = httpx.get(w.url + "/metrics", headers=w.headers, timeout=5).text
    totals = {"num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for name in totals:
            if family.name.endswith(f"spec_decode_{name}"):
                totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["num_draft_tokens"], totals["num_accepted_tokens"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_speculating_decode_worker_gives_the_colocated_tokens(stacks, temperature):
    """Prompts whose answers repeat them, so n-gram drafts are made and accepted."""
    model, colo, pd_spec = stacks.model, stacks.colo, stacks.pd_spec
    drafted = spec_counts(stacks.spec_decode)[0]
    kw = {"temperature": temperature, "seed": 7}
    for sentence in ("The red fox runs by the quiet river.", "Our train leaves at nine."):
        messages = [{"role": "user", "content": f"Repeat this sentence: {sentence} {sentence}"}]
        want = answer(chat(colo, model, messages, **kw))
        assert answer(chat(pd_spec, model, messages, **kw)) == want
    assert spec_counts(stacks.spec_decode)[0] > drafted
