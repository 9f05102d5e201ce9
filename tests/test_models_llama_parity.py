"""SmolLM2-135M (real GGUF weights) against HuggingFace transformers loading the same GGUF: tokenizer,
last-position logits for 1/17/300-token prompts, 32-token greedy generations, and batch composition."""

from __future__ import annotations

import pytest
import torch
from model_loop import SequenceLoop, batched_step_logits

from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.builtin_models import resolve_model
from deepserve.engine.loading.loader import load_model

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a screw press adapted from winemaking. Within "
    "fifty years, presses operated in more than two hundred cities across Europe, and the price of "
    "books fell so quickly that reading spread from monasteries and universities to merchants, "
    "artisans and eventually farmers. Scholars argue about how much the new technology caused the "
    "Reformation, the Scientific Revolution and the rise of national languages, but few doubt that "
    "it changed how ideas moved. Pamphlets could be printed overnight; errors in a manuscript were "
    "no longer copied by hand into every new version; and for the first time, two readers in "
    "different countries could discuss the same page number of the same edition. In 1605 the first "
    "newspaper appeared in Strasbourg, 1,234 copies at a time. Today, historians count more than "
    "twenty million volumes printed before 1501, a staggering number for a continent of perhaps "
    "eighty million people. The press also created new professions: typesetters, proofreaders, "
    "booksellers and censors, each with guilds, rules and quarrels of their own. What follows is "
    "a brief account of how those trades grew, how they fought, and what they left behind. We "
    "start in Mainz, move down the Rhine to Cologne and Basel, cross the Alps to Venice, where Aldus "
    "Manutius printed pocket editions of the classics, and end in London with William Caxton, who "
    "chose which English dialect would become the standard simply by choosing what to print."
)


@pytest.fixture(scope="module")
def ours():
    torch.set_num_threads(1)
    return load_model(EngineConfig(model="smollm2-135m"))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


@pytest.fixture(scope="module")
def long_ids(hf):
    ids = hf[1].encode(LONG_TEXT)
    assert len(ids) >= 300
    return ids[:300]


@pytest.mark.parametrize(
    "text",
    [
        LONG_TEXT,
        "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, tabs\tand\nnewlines\n\n  ",
        "Ünïcödé — naïve café 日本語 🤖 emoji",
        "def f(x):\n    return x**2  # comment",
    ],
)
def test_tokenizer_encodes_like_transformers(ours, hf, text):
    assert ours.tokenizer.encode(text).ids == hf[1].encode(text)


def test_model_info_describes_smollm2(ours):
    info = ours.info
    assert (info.family, info.vocab_size, info.num_mtp_layers) == ("llama", 49152, 0)
    assert info.eos_token_ids == [ours.tokenizer.token_to_id("<|im_end|>")]
    assert info.bos_token_id == ours.tokenizer.token_to_id("<|im_start|>")
    assert "<|im_start|>" in info.chat_template
    assert info.max_model_len == 8192
    assert len(info.fingerprint) == 32 and int(info.fingerprint, 16) >= 0
    spec = ours.model.kv_cache_spec
    assert (spec.num_layers, spec.width) == (30, 2 * 3 * 64)


@pytest.mark.parametrize("length", [1, 17, 300])
def test_last_position_logits_match_transformers(ours, hf, long_ids, length):
    prompt = long_ids[:length]
    with torch.inference_mode():
        expected = hf[0](torch.tensor([prompt])).logits[0, -1]
    got = SequenceLoop(ours.model, length + 1).logits(prompt)
    diff = (got - expected).abs().max().item()
    print(f"smollm2 float32 {length}-token prompt: max abs logit diff {diff:.2e}")
    assert diff < 2e-3


@pytest.mark.parametrize("prompt", ["Once upon a time", "The capital of France is"])
def test_greedy_generation_matches_transformers(ours, hf, prompt):
    ids = hf[1].encode(prompt)
    expected = hf[0].generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    got = SequenceLoop(ours.model, len(ids) + 33).greedy(ids, 32, tuple(ours.info.eos_token_ids))
    assert got == expected[0, len(ids) :].tolist()
    assert len(got) > 8  # a prompt that ends at once would prove little


def test_mixed_batch_step_matches_each_sequence_alone(ours, long_ids):
    """One step holding a prefill, a chunk after cached context and two decodes gives each sequence
    the logits it gets alone (paged varlen path and all)."""
    contexts = [[], long_ids[:40], long_ids[50:90], long_ids[100:117]]
    new = [long_ids[200:223], long_ids[40:52], [long_ids[90]], [long_ids[117]]]
    batched = batched_step_logits(ours.model, contexts, new)
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        alone = SequenceLoop(ours.model, len(c) + len(n) + 1).logits(c + n)
        assert (batched[i] - alone).abs().max().item() < 1e-3


def test_decode_batch_matches_each_sequence_alone(ours, long_ids):
    contexts = [long_ids[:5], long_ids[10:47], long_ids[60:61]]
    new = [[long_ids[5]], [long_ids[47]], [long_ids[61]]]
    batched = batched_step_logits(ours.model, contexts, new)
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        alone = SequenceLoop(ours.model, len(c) + 2).logits(c + n)
        assert (batched[i] - alone).abs().max().item() < 1e-3
