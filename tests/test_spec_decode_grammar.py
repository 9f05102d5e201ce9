"""Drafts under a grammar: each verified row gets the mask after the drafts before it, the matcher
ends where it started, and drafts are cut at the first token the grammar forbids. Checked with a
real xgrammar matcher over a 7-token vocabulary."""

from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from deepserve.engine.spec_decode.decoder import fill_draft_bitmasks, grammar_prefix
from deepserve.engine.structured import CompiledGrammar, GrammarMatcherState, allocate_bitmask

VOCAB = ["<eos>", "{", "}", '"a"', ":", "1", " "]
EOS, OPEN, CLOSE, KEY, COLON, ONE, SPACE = range(7)


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return CompiledGrammar(xgr.GrammarCompiler(info).compile_builtin_json_grammar(), "json", 0.0)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(len(VOCAB)) if (int(bitmask[row, 0]) >> t) & 1}


def reference_masks(compiled, prefix: list[int], drafts: list[int]) -> list[set[int]]:
    """Masks a fresh matcher gives after prefix + drafts[:j], for each j."""
    masks = []
    for j in range(len(drafts) + 1):
        m = GrammarMatcherState(compiled)
        for t in prefix + drafts[:j]:
            assert m.accept(t)
        bm = allocate_bitmask(1, len(VOCAB))
        m.fill_bitmask(bm, 0)
        masks.append(allowed(bm, 0))
    return masks


def test_each_row_gets_the_mask_after_the_drafts_before_it(compiled):
    matcher = GrammarMatcherState(compiled)
    matcher.accept(OPEN)
    drafts = [KEY, COLON, ONE]
    seq = SimpleNamespace(matcher=matcher, spec_token_ids=drafts)
    bitmask = allocate_bitmask(5, len(VOCAB))
    fill_draft_bitmasks(seq, bitmask, first_row=1)
    got = [allowed(bitmask, r) for r in range(1, 5)]
    assert got == reference_masks(compiled, [OPEN], drafts)
    assert allowed(bitmask, 0) == set(range(len(VOCAB)))  # other rows untouched
    assert matcher.accept(KEY)  # rolled back to just after "{"


def test_rows_after_an_accepted_stop_token_are_left_alone(compiled):
    matcher = GrammarMatcherState(compiled)
    for t in (OPEN, CLOSE):
        matcher.accept(t)
    seq = SimpleNamespace(matcher=matcher, spec_token_ids=[EOS, SPACE])
    bitmask = allocate_bitmask(3, len(VOCAB))
    fill_draft_bitmasks(seq, bitmask, first_row=0)
    assert EOS in allowed(bitmask, 0)
    assert not matcher.is_terminated()


def test_drafts_are_cut_at_the_first_forbidden_token(compiled):
    matcher = GrammarMatcherState(compiled)
    matcher.accept(OPEN)
    seq = SimpleNamespace(matcher=matcher)
    assert grammar_prefix(seq, [KEY, COLON, CLOSE, ONE]) == [KEY, COLON]
    assert grammar_prefix(seq, [CLOSE, EOS, SPACE]) == [CLOSE, EOS]  # nothing after the end
    assert matcher.accept(KEY)  # state unchanged by the checks
