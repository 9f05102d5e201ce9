"""Scheduler: token budget, chunked prefill mixed with decodes, FCFS, preemption, forks, abort,
the prefill group limit."""

from __future__ import annotations

from deepserve.engine.block_manager import BlockManager
from deepserve.engine.config import EngineConfig
from deepserve.engine.llm_engine import PREFILL_GROUP_TOKENS_CPU, prefill_group_tokens
from deepserve.engine.request import Request, Sequence, SequenceStatus
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.scheduler import Scheduler, SchedulerOutput

BS = 4
_ids = iter(range(10**6))


def make_request(prompt_len: int, n: int = 1, start: int = 0) -> Request:
    tokens = list(range(start, start + prompt_len))
    rid = next(_ids)
    req = Request(str(rid), tokens, SamplingParams(n=n), seed=0, max_tokens=8, arrival=0.0)
    for i in range(n):
        req.sequences.append(Sequence(rid * 100 + i, req, i, i, list(tokens), prompt_len))
    return req


def apply(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the forward: advance progress, append sampled tokens."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.register_computed(s.seq)
        if s.sample:
            s.seq.token_ids.append(token)
    for fork in out.forks:
        for child in fork.children:
            child.token_ids.append(token)


def test_long_prompt_is_chunked_under_budget_and_decodes_ride_along():
    sched = Scheduler(BlockManager(64, BS, "fp"), 8, 10)
    a, b = make_request(3), make_request(25, start=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        (a, 3, True),
        (b, 7, False),
    ]
    apply(sched, out)
    out = sched.schedule()
    assert [(s.num_new_tokens, s.sample) for s in out.scheduled] == [(1, True), (9, False)]
    apply(sched, out)
    out = sched.schedule()
    assert [(s.num_new_tokens, s.sample) for s in out.scheduled] == [(1, True), (9, True)]


def test_waiting_admitted_fcfs_up_to_max_num_seqs():
    sched = Scheduler(BlockManager(64, BS, "fp"), 2, 100)
    reqs = [make_request(3, start=10 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.seq.request for s in out.scheduled] == reqs[:2]
    assert list(sched.waiting) == [reqs[2].sequences[0]]


def test_newest_running_is_preempted_when_blocks_run_out():
    sched = Scheduler(BlockManager(4, BS, "fp"), 8, 100)
    old, new = make_request(4), make_request(4, start=50)
    sched.add(old)
    sched.add(new)
    apply(sched, sched.schedule())  # each holds 1 full block + needs a second for the decode
    apply(sched, sched.schedule())  # each now 6 tokens, 2 blocks: pool full
    for seq in (old.sequences[0], new.sequences[0]):
        seq.token_ids += [1, 1, 1]  # pretend more decoding: both need a third block
        seq.num_computed_tokens = seq.num_tokens - 1
    out = sched.schedule()
    assert out.preempted == [new.sequences[0]]
    assert [s.seq for s in out.scheduled] == [old.sequences[0]]
    assert sched.waiting[0] is new.sequences[0]
    assert new.sequences[0].block_table == [] and new.sequences[0].num_computed_tokens == 0


def test_preempted_sequence_resumes_with_its_generated_tokens():
    sched = Scheduler(BlockManager(3, BS, "fp"), 8, 100)
    a, b = make_request(4), make_request(4, start=50)
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        apply(sched, sched.schedule())
    assert sched.num_preemptions >= 1
    while sched.running or sched.waiting:
        out = sched.schedule()
        apply(sched, out)
        for s in list(sched.running):
            if s.num_output_tokens >= 6:
                sched.finish(s, "length")
    assert all(s.num_output_tokens == 6 for s in (a.sequences[0], b.sequences[0]))
    assert sched.block_manager.num_free_blocks == 3


def test_n_samples_forked_when_prompt_completes_sharing_full_blocks():
    bm = BlockManager(16, BS, "fp")
    sched = Scheduler(bm, 8, 100)
    req = make_request(6, n=3)
    sched.add(req)
    out = sched.schedule()
    parent = req.sequences[0]
    assert len(out.scheduled) == 1 and out.forks[0].children == req.sequences[1:]
    assert len(out.block_copies) == 2
    for child in req.sequences[1:]:
        assert child.block_table[0] == parent.block_table[0]
        assert child.block_table[1] != parent.block_table[1]
    assert bm.blocks[parent.block_table[0]].ref_count == 3
    apply(sched, out)
    out = sched.schedule()
    assert sorted(s.seq.index for s in out.scheduled) == [0, 1, 2]


def test_finish_frees_blocks_at_once_from_waiting_or_running():
    bm = BlockManager(16, BS, "fp")
    sched = Scheduler(bm, 1, 100)
    a, b = make_request(9), make_request(9, start=40)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a.sequences[0], "abort")
    sched.finish(b.sequences[0], "abort")
    assert bm.num_free_blocks == 16 and not sched.has_work()
    assert a.sequences[0].status is SequenceStatus.FINISHED


def test_prefix_hit_skips_cached_tokens_and_is_reported():
    bm = BlockManager(16, BS, "fp")
    sched = Scheduler(bm, 8, 100)
    a = make_request(10)
    sched.add(a)
    apply(sched, sched.schedule())
    b = make_request(10)
    sched.add(b)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1, 2]
    assert b.num_cached_tokens == 8


def _decoding(sched: Scheduler, n: int) -> list[Request]:
    """`n` requests admitted and past their prompts: the next step is decode-only."""
    reqs = [make_request(3, start=10 * i) for i in range(n)]
    for r in reqs:
        sched.add(r)
    apply(sched, sched.schedule())
    return reqs


def test_arrivals_wait_out_a_burst_during_decode_only_steps():
    now = [0.0]
    sched = Scheduler(
        BlockManager(64, BS, "fp"), 4, 100, prefill_gather_s=0.03, clock=lambda: now[0]
    )
    _decoding(sched, 2)
    late = make_request(3, start=500)
    sched.add(late)
    out = sched.schedule()  # just arrived, one slot still free: held, the decodes run alone
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1]
    apply(sched, out)
    now[0] = 0.05  # the gather window has passed: it joins
    out = sched.schedule()
    assert [s.seq.request for s in out.scheduled][-1] is late


def test_arrivals_join_at_once_when_they_fill_the_free_slots():
    now = [0.0]
    sched = Scheduler(
        BlockManager(64, BS, "fp"), 4, 100, prefill_gather_s=0.03, clock=lambda: now[0]
    )
    _decoding(sched, 2)
    late = [make_request(3, start=500 + 10 * i) for i in range(2)]
    for r in late:
        sched.add(r)
    out = sched.schedule()
    assert [s.seq.request for s in out.scheduled][2:] == late


def test_arrivals_ride_along_when_the_step_is_eager_anyway():
    sched = Scheduler(BlockManager(64, BS, "fp"), 4, 8, prefill_gather_s=10.0, clock=lambda: 0.0)
    long = make_request(12)
    sched.add(long)
    apply(sched, sched.schedule())  # 8 of its 12 prompt tokens: the next step is a prefill chunk
    late = make_request(3, start=500)
    sched.add(late)
    out = sched.schedule()
    assert [s.seq.request for s in out.scheduled] == [long, late]


def test_a_second_long_prompt_waits_for_the_next_step_under_the_prefill_group_limit():
    sched = Scheduler(BlockManager(64, BS, "fp"), 8, 100, prefill_group_tokens=16)
    first, second = make_request(12), make_request(12, start=100)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [(s.seq.request, s.num_new_tokens) for s in out.scheduled] == [(first, 12)]
    apply(sched, out)
    out = sched.schedule()
    assert [(s.seq.request, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 12)]


def test_short_prompts_share_a_step_up_to_the_prefill_group_limit():
    sched = Scheduler(BlockManager(64, BS, "fp"), 8, 100, prefill_group_tokens=16)
    reqs = [make_request(5, start=10 * i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.seq.request for s in out.scheduled] == reqs[:3]


def test_a_prompt_longer_than_the_prefill_group_limit_still_fills_the_budget():
    sched = Scheduler(BlockManager(64, BS, "fp"), 8, 20, prefill_group_tokens=8)
    long = make_request(50)
    sched.add(long)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [20]


def test_without_a_prefill_group_limit_a_second_prompt_fills_the_rest_of_the_budget():
    sched = Scheduler(BlockManager(64, BS, "fp"), 8, 20)
    first, second = make_request(12), make_request(12, start=100)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [12, 8]


def test_the_prefill_group_limit_is_on_by_default_only_on_the_cpu():
    assert prefill_group_tokens(EngineConfig(device="cpu")) == PREFILL_GROUP_TOKENS_CPU
    assert prefill_group_tokens(EngineConfig(device="cuda")) is None
    assert prefill_group_tokens(EngineConfig(device="cpu", prefill_group_tokens=0)) is None
    assert prefill_group_tokens(EngineConfig(device="cuda", prefill_group_tokens=300)) == 300
