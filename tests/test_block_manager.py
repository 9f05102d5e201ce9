"""Block manager: allocation, prefix-cache hits keyed by token ids, LRU eviction, forks, events."""

from __future__ import annotations

import pytest

from deepserve.engine.block_manager import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    block_key,
    prompt_block_keys,
    root_key,
)
from deepserve.engine.request import Request, Sequence
from deepserve.engine.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0, salt: str | None = None) -> Sequence:
    params = SamplingParams(cache_salt=salt)
    req = Request(str(seq_id), list(tokens), params, seed=0, max_tokens=8, arrival=0.0)
    seq = Sequence(seq_id, req, 0, 0, list(tokens), len(tokens))
    req.sequences.append(seq)
    return seq


def compute(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does after a forward pass covered the whole sequence."""
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    match = bm.match_prefix(seq)
    cached = match.num_blocks() * BS
    assert bm.allocate(seq, seq.num_tokens - cached, match)
    compute(bm, seq)
    return cached


def test_allocate_gives_enough_blocks_and_free_returns_them():
    bm = BlockManager(8, BS, "fp")
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocate_fails_without_side_effects_when_pool_too_small():
    bm = BlockManager(2, BS, "fp")
    seq = make_seq(list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_second_sequence_hits_full_blocks_of_shared_prefix():
    bm = BlockManager(16, BS, "fp")
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    run_prefill(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42], 1)
    assert run_prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_whole_prompt_never_hits_last_token_is_computed():
    bm = BlockManager(16, BS, "fp")
    tokens = list(range(8))
    run_prefill(bm, make_seq(tokens, 0))
    assert run_prefill(bm, make_seq(tokens, 1)) == 4


def test_hit_requires_same_chain_not_same_block_content():
    bm = BlockManager(16, BS, "fp")
    run_prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0], 0))
    # Block 2's tokens match, block 1's do not: the chained key differs, so nothing hits.
    assert run_prefill(bm, make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0], 1)) == 0


def test_fingerprint_salts_keys():
    assert block_key(b"a", [1, 2]) != block_key(b"b", [1, 2])
    a = BlockManager(4, BS, "model-a")
    b = BlockManager(4, BS, "model-b")
    sa, sb = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 5])
    a.update_hashes(sa)
    b.update_hashes(sb)
    assert sa.block_hashes != sb.block_hashes


def test_blocks_of_different_salts_never_match():
    bm = BlockManager(16, BS, "fp")
    prompt = list(range(10))
    run_prefill(bm, make_seq(prompt, 0, salt="tenant-a"))
    assert run_prefill(bm, make_seq(prompt, 1, salt="tenant-b")) == 0
    assert run_prefill(bm, make_seq(prompt, 2)) == 0
    assert run_prefill(bm, make_seq(prompt, 3, salt="tenant-a")) == 8


def test_a_salted_first_block_names_its_salted_root_as_parent():
    bm = BlockManager(8, BS, "fp")
    run_prefill(bm, make_seq(list(range(5)), salt="s"))
    (event,) = bm.take_events()
    assert event.parent_key == root_key("fp", "s") != root_key("fp")


def test_a_prefill_workers_hand_off_keys_are_the_salted_block_keys():
    bm = BlockManager(8, BS, "fp")
    seq = make_seq(list(range(9)), salt="s")
    bm.update_hashes(seq)
    assert prompt_block_keys("fp", list(range(9)), BS, "s") == [k.hex() for k in seq.block_hashes]


def test_freed_cached_blocks_still_hit_until_evicted():
    bm = BlockManager(4, BS, "fp")
    a = make_seq(list(range(9)), 0)
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert run_prefill(bm, make_seq(list(range(9)), 1)) == 8


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(2, BS, "fp")
    a = make_seq(list(range(5)), 0)  # one full (cached) block + one partial (uncached)
    run_prefill(bm, a)
    cached_block, partial_block = a.block_table
    bm.free(a)
    b = make_seq([100, 101], 1)
    assert bm.allocate(b, 2)
    assert b.block_table == [partial_block]
    assert bm.blocks[cached_block].key is not None


def test_cached_blocks_evicted_lru_with_hook_and_event():
    evicted = []

    class Tier:
        name = "test"

        def on_evict(self, key, block_id):
            evicted.append((key, block_id))

        def on_store(self, key, block_id):
            pass

        def lookup(self, keys):
            return 0

    bm = BlockManager(2, BS, "fp", tier=Tier())
    a = make_seq([1, 2, 3, 4, 0], 0)
    run_prefill(bm, a)
    first_block, first_key = a.block_table[0], a.block_hashes[0]
    bm.free(a)
    bm.take_events()
    b = make_seq(list(range(20, 28)), 1)
    assert bm.allocate(b, 8)
    assert evicted == [(first_key, first_block)]
    assert BlockRemoved(first_key, first_block) in bm.take_events()


def test_stored_events_carry_parent_key_and_tokens():
    bm = BlockManager(8, BS, "fp")
    seq = make_seq(list(range(9)))
    run_prefill(bm, seq)
    events = bm.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert events[0].parent_key is None and events[1].parent_key == events[0].key
    assert events[1].token_ids == (4, 5, 6, 7)
    assert bm.take_events() == []


def test_tier_lookup_allocates_blocks_to_load():
    class Tier:
        name = "host"

        def on_evict(self, key, block_id):
            pass

        def on_store(self, key, block_id):
            pass

        def lookup(self, keys):
            return len(keys)

    bm = BlockManager(8, BS, "fp", tier=Tier())
    seq = make_seq(list(range(10)))
    match = bm.match_prefix(seq)
    assert len(match.tier_keys) == 2
    assert bm.allocate(seq, 2, match)
    assert seq.num_computed_tokens == 8
    assert [b for _, b in bm.take_pending_loads()] == seq.block_table[:2]


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(8, BS, "fp")
    parent = make_seq(list(range(6)), 0)
    assert bm.allocate(parent, 6)
    child = make_seq([], 1)
    src, dst = bm.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0]
    assert src == parent.block_table[1] and dst == child.block_table[1] and src != dst
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_double_free_is_caught():
    bm = BlockManager(4, BS, "fp")
    seq = make_seq([1, 2])
    bm.allocate(seq, 2)
    block = seq.block_table[0]
    bm.free(seq)
    with pytest.raises(AssertionError):
        bm._release(block)


def test_stats_count_lookups_hits_and_evictions():
    bm = BlockManager(3, BS, "fp")
    a = make_seq(list(range(9)), 0)
    run_prefill(bm, a)
    bm.free(a)
    run_prefill(bm, make_seq(list(range(9)), 1))
    assert (bm.stats.queries, bm.stats.hits) == (18, 8)
    assert bm.stats.hit_rate == 8 / 18


def _generate(bm: BlockManager, seq: Sequence, tokens: list[int]) -> None:
    """Decode steps appending `tokens` to a prefilled sequence."""
    for t in tokens:
        seq.token_ids.append(t)
        assert bm.allocate(seq, 1)
        compute(bm, seq)


def test_role_keys_keep_blocks_of_generated_tokens_from_prompts_of_the_same_tokens():
    """Under role keys a block holding generated tokens is keyed apart: a later prompt made of
    the same tokens (a chat's next turn) matches only the blocks its first prompt filled."""
    bm = BlockManager(16, BS, "fp", role_keys=True)
    first = make_seq(list(range(6)), 0)
    run_prefill(bm, first)
    _generate(bm, first, [40, 41, 42, 43, 44, 45])
    second = make_seq([*range(6), 40, 41, 42, 43, 44, 45, 7], 1)
    assert run_prefill(bm, second) == 4  # block 0 only: block 1 held prompt and generated rows


def test_without_role_keys_a_next_turn_reuses_the_generated_blocks():
    bm = BlockManager(16, BS, "fp")
    first = make_seq(list(range(6)), 0)
    run_prefill(bm, first)
    _generate(bm, first, [40, 41, 42, 43, 44, 45])
    assert run_prefill(bm, make_seq([*range(6), 40, 41, 42, 43, 44, 45, 7], 1)) == 12


def test_role_keys_leave_a_prompts_own_blocks_and_hand_off_keys_unchanged():
    plain, roles = BlockManager(8, BS, "fp"), BlockManager(8, BS, "fp", role_keys=True)
    a, b = make_seq(list(range(9)), 0), make_seq(list(range(9)), 1)
    plain.update_hashes(a)
    roles.update_hashes(b)
    assert a.block_hashes == b.block_hashes
    assert prompt_block_keys("fp", list(range(9)), BS) == [k.hex() for k in b.block_hashes]


def test_role_keys_let_a_sequence_recomputed_after_preemption_find_its_own_blocks():
    bm = BlockManager(16, BS, "fp", role_keys=True)
    seq = make_seq(list(range(6)), 0)
    run_prefill(bm, seq)
    _generate(bm, seq, [40, 41, 42, 43, 44, 45])
    bm.free(seq)
    seq.num_computed_tokens, seq.block_hashes, seq.num_registered_blocks = 0, [], 0
    assert run_prefill(bm, seq) == 8  # (12 - 1) // 4 full blocks: its last token is recomputed
