"""POST /v1/completions on SmolLM2 with the official openai SDK: legacy logprobs, stop strings,
echo, and the fields the server refuses rather than ignores."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from server_harness import client, server, smollm_engine

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


def complete(client: OpenAI, **kwargs):
    args = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 8, **kwargs}
    return client.completions.create(**args)


def test_completion_logprobs_equal_chat_logprobs_for_the_same_tokens(server, client):
    # The chat template rendered as the family does, so both endpoints run the same prompt tokens.
    template = server.app.state.deepserve.family.template
    prompt = template.render(messages=CAPITAL, add_generation_prompt=True)
    lp = complete(client, prompt=prompt, max_tokens=6, logprobs=2).choices[0].logprobs
    chat = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert lp.tokens == [i.token for i in content]
    assert lp.token_logprobs == pytest.approx([i.logprob for i in content], abs=1e-4)


def test_completion_top_logprobs_have_n_entries_led_by_the_greedy_token(client):
    lp = complete(client, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert value == pytest.approx(max(top.values()), abs=1e-5) and top[token] == value


def test_completion_logprobs_zero_reports_only_the_sampled_token(client):
    lp = complete(client, logprobs=0, max_tokens=4).choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_completion_text_offsets_point_at_each_token(client):
    choice = complete(client, logprobs=1).choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token


def test_streamed_completion_logprobs_equal_non_stream(client):
    whole = complete(client, logprobs=2).choices[0].logprobs
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in complete(client, logprobs=2, stream=True):
        for c in chunk.choices:
            for key, values in parts.items():
                values += getattr(c.logprobs, key)
    assert parts["tokens"] == whole.tokens
    # A prefix-cache hit may take another reduction order: equal to float noise.
    assert parts["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-4)
    assert parts["text_offset"] == whole.text_offset
    assert [set(t) for t in parts["top_logprobs"]] == [set(t) for t in whole.top_logprobs]


def test_stop_string_cuts_completion_logprobs(client):
    full = complete(client, logprobs=1).choices[0]
    stop = full.text.split()[1]  # a word the greedy completion is known to contain
    cut = complete(client, logprobs=1, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    kept = len(cut.logprobs.tokens)
    assert 0 < kept < len(full.logprobs.tokens)
    assert cut.logprobs.tokens == full.logprobs.tokens[:kept]
    assert all(offset < len(cut.text) for offset in cut.logprobs.text_offset)
    assert "".join(cut.logprobs.tokens).startswith(cut.text)


def test_echo_prepends_the_prompt(client):
    plain = complete(client).choices[0].text
    assert complete(client, echo=True).choices[0].text == PROMPT + plain


def test_streamed_echo_sends_the_prompt_first(client):
    texts = [c.text for chunk in complete(client, echo=True, stream=True) for c in chunk.choices]
    assert texts[0].startswith(PROMPT)
    assert "".join(texts) == PROMPT + complete(client).choices[0].text


def test_echo_with_logprobs_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
        complete(client, echo=True, logprobs=1)


def test_best_of_other_than_n_is_rejected(client):
    assert complete(client, best_of=1, max_tokens=2).choices[0].text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(client, best_of=2, max_tokens=2)


def test_suffix_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="suffix"):
        complete(client, suffix=" and that is all.", max_tokens=2)


@pytest.mark.parametrize("field", ["logprobs", "seed"])
def test_non_integer_logprobs_or_seed_is_rejected(client, field):
    with pytest.raises(openai.BadRequestError, match=field):
        complete(client, max_tokens=2, extra_body={field: "3"})


def test_completion_tokens_equal_chat_for_the_same_generation(server, client):
    # An answer that ends on EOS: neither route counts the stop token (docs/server.md).
    template = server.app.state.deepserve.family.template
    prompt = template.render(messages=CAPITAL, add_generation_prompt=True)
    legacy = complete(client, prompt=prompt, max_tokens=24)
    chat = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24
    )
    assert legacy.choices[0].finish_reason == chat.choices[0].finish_reason == "stop"
    assert legacy.choices[0].text == chat.choices[0].message.content
    assert legacy.usage.completion_tokens == chat.usage.completion_tokens > 0
    assert legacy.usage.prompt_tokens == chat.usage.prompt_tokens


def test_streamed_completion_usage_equals_non_stream(client):
    whole = complete(client, max_tokens=24)
    chunks = list(
        complete(client, max_tokens=24, stream=True, stream_options={"include_usage": True})
    )
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert (
        usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens_details.cached_tokens
    )


def test_repeated_completion_prompt_reports_cached_tokens(client):
    prompt = "Here is a list of the planets of the solar system, from the Sun outwards:"
    first = complete(client, prompt=prompt, max_tokens=2)
    second = complete(client, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16
    assert second.usage.model_extra["prompt_cache_hit_tokens"] == cached


BATCH = ["The capital of France is", "Once upon a time"]


def test_a_list_of_prompts_answers_each_as_alone_in_prompt_order(client):
    batch = complete(client, prompt=BATCH)
    alone = [complete(client, prompt=p).choices[0] for p in BATCH]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [c.text for c in alone]
    prompt_tokens = [complete(client, prompt=p, max_tokens=1).usage.prompt_tokens for p in BATCH]
    assert batch.usage.prompt_tokens == sum(prompt_tokens)
    assert batch.usage.completion_tokens == 2 * 8


def test_a_batch_with_n_numbers_choices_prompt_major(client):
    ids = [504, 3575]  # a prompt given as token ids
    batch = complete(client, prompt=[BATCH[0], ids], n=2)
    alone = [complete(client, prompt=p).choices[0].text for p in (BATCH[0], ids)]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]


def test_a_streamed_batch_equals_the_unstreamed_one(client):
    whole = complete(client, prompt=BATCH)
    texts, usage = {}, None
    for chunk in complete(
        client, prompt=BATCH, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_an_empty_prompt_in_a_batch_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        complete(client, prompt=[BATCH[0], ""])
