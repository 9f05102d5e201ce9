"""R1-style reasoning through HTTP with the official openai SDK: an R1-Distill-shaped model (Qwen2,
R1's chat template opening `<think>\\n`, `<think>` / `</think>` single tokens) whose weights are set
so greedy decoding writes `t10 t11 </think> t12` then EOS whatever the question; the text before
`</think>` must arrive as reasoning (Chat Completions `reasoning_content`, Responses reasoning
items), the rest as the answer, streamed and not. Plus where parsing starts (server/reasoning.py) and where an output constraint starts to hold."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file, save_file
from server_harness import engine_for, running_server
from tokenizers import Tokenizer

from deepserve.engine.sampling_params import StructuredOutput
from deepserve.engine.testmodels.model_shapes import (
    R1_CHAT_TEMPLATE,
    R1_SPECIAL_TOKENS,
    write_shaped_model,
)
from deepserve.server.family import make_family
from deepserve.server.reasoning import opens_think_block

MODEL = "r1-distill-tiny"
THINK, END_THINK = R1_SPECIAL_TOKENS["<think>"], R1_SPECIAL_TOKENS["</think>"]
EOS = R1_SPECIAL_TOKENS["<｜end▁of▁sentence｜>"]
# each token -> the one greedy decoding writes after it
CHAIN = {THINK: 10, 10: 11, 11: END_THINK, END_THINK: 12, 12: EOS}
ASK = [{"role": "user", "content": "t5 t6 t7"}]
JSON = StructuredOutput("json_object")


def _force_chain(folder) -> None:
    """Attention and MLP outputs zeroed, so the last hidden state is the normed embedding of the
    last token; each chain token's embedding is a basis vector that the head maps to its
    successor's row."""
    path = folder / "model.safetensors"
    w = load_file(str(path))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    for j, (token, successor) in enumerate(CHAIN.items()):
        w["model.embed_tokens.weight"][token] = 0
        w["model.embed_tokens.weight"][token, j] = 1
        w["lm_head.weight"][successor] = 0
        w["lm_head.weight"][successor, j] = 10
    save_file(w, str(path))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r1")
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    write_shaped_model("r1-distill-qwen-1.5b", folder, overrides=small)
    _force_chain(folder)
    with engine_for(str(folder), dtype="float32") as engine, running_server(engine, MODEL) as srv:
        yield OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_completion_puts_the_think_block_in_reasoning_content(client):
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20).choices[0]
    assert message.finish_reason == "stop"
    assert message.message.reasoning_content == "t10t11"
    assert message.message.content == "t12"


def test_streamed_chat_completion_splits_reasoning_from_content(client):
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, stream=True
    ):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("t10t11", "t12")


def test_unclosed_think_block_is_all_reasoning(client):
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0]
    assert message.finish_reason == "length"
    assert message.message.reasoning_content == "t10t11"
    assert not message.message.content


def test_response_has_a_reasoning_item_then_the_answer(client):
    response = client.responses.create(model=MODEL, input="t5 t6 t7", max_output_tokens=20)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == "t10t11"
    assert response.output_text == "t12"


def test_streamed_response_sends_reasoning_deltas_before_the_answer(client):
    events = list(
        client.responses.create(model=MODEL, input="t5 t6 t7", max_output_tokens=20, stream=True)
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, answer) == ("t10t11", "t12")
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


@pytest.mark.parametrize(
    "prompt, opens",
    [
        ("<｜User｜>hi<｜Assistant｜><think>\n", True),
        ("<｜User｜>hi<｜Assistant｜><think>", True),
        ("<｜User｜>hi<｜Assistant｜>", False),
        ("<｜User｜>hi<｜Assistant｜><think>x</think>\n", False),
    ],
)
def test_a_prompt_opens_a_think_block_when_it_ends_with_think(prompt, opens):
    assert opens_think_block(prompt) is opens


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def r1_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r1-tokenizer")
    write_shaped_model("r1-distill-qwen-1.5b", folder, overrides={"num_hidden_layers": 0})
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _prepared(tokenizer: Tokenizer, template: str):
    family = make_family("qwen2", tokenizer, "m", template)
    body = {"model": "m", "messages": ASK}
    return family, family.prepare(dr.ChatCompletionRequest(body).convert(family.conversion_options))


def test_a_chatml_template_without_think_parses_plain_text(r1_tokenizer):
    """SmolLM2-style templates keep their output all content, constraints from the first token."""
    family, prompt = _prepared(r1_tokenizer, CHATML)
    assert prompt.parsing.thinking_initial_stage is None
    assert family.answer_constraint(prompt.parsing, JSON).kind == "json_object"


def test_r1_output_constraint_holds_only_after_the_think_block(r1_tokenizer):
    family, prompt = _prepared(r1_tokenizer, R1_CHAT_TEMPLATE)
    assert prompt.parsing.thinking_initial_stage.starts_in_reasoning()
    constraint = family.answer_constraint(prompt.parsing, JSON)
    assert constraint.kind == "after_reasoning"
    assert json.loads(constraint.spec)["end"] == "</think>"


def test_deepseek_v2_is_served_with_its_own_chat_template(r1_tokenizer):
    """V2-Lite-Chat's template (no think block): rendered as the checkpoint says, not with the
    V4 encoding the recipe families use, and its output parsed as plain content."""
    v2_chat = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ 'User: ' + m['content'] + '\\n\\n' }}{% endif %}{% endfor %}Assistant:"
    )
    family = make_family("deepseek_v2", r1_tokenizer, "m", v2_chat)
    request = dr.ChatCompletionRequest({"model": "m", "messages": ASK})
    conversation = request.convert(family.conversion_options)
    assert family.render(conversation.conversation) == "User: t5 t6 t7\n\nAssistant:"
    assert family.prepare(conversation).parsing.thinking_initial_stage is None
