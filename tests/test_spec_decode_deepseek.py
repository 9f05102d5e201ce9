"""Speculative decoding on tiny-deepseek: MTP drafting through the real MTP layer, stub drafters
(defined here, in the test only) that force every draft to be accepted or rejected, and the sampled
distribution with speculation against the one without.

The reference is always the same engine with speculation off: the verifier is exact, so greedy and
seeded outputs must match token for token, and after the load every KV block is free again.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams

MODEL = "tiny-deepseek"


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    torch.set_num_threads(1)
    return load_model(EngineConfig(model=MODEL))


def make_llm(loaded, spec: SpeculativeConfig | None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(EngineConfig(model=MODEL, speculative=spec, **kw), loaded)


def outputs(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[s.token_ids for s in r.samples] for r in llm.generate(prompts, params)]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


PROMPTS = [[7 + i for i in range(n)] for n in (3, 6, 11, 17, 26)]
MTP3 = SpeculativeConfig("mtp", 3)
# Drafting every step whatever the acceptance (no throttle, spec_decode/throttle.py): the tests of
# bookkeeping over many rejected rounds and of the MTP KV at every position need it.
MTP3_FIXED = SpeculativeConfig("mtp", 3, adaptive=False)


def test_mtp_greedy_alone_matches_plain(loaded):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(loaded, None)
    spec = make_llm(loaded, MTP3)
    for prompt in PROMPTS[:3]:
        assert outputs(spec, [prompt], params) == outputs(plain, [prompt], params)
    stats = spec.engine.spec.stats
    assert stats.num_draft_tokens > 0
    assert_no_leak(spec)


def test_mtp_drafts_never_accepted_cost_one_mtp_forward_per_verified_draft(loaded, monkeypatch):
    """Random MTP weights: nothing is accepted. Each MTP forward is then one draft that gets
    verified: the first round drafts one token, not k (no chained forwards), and a step whose
    drafting is paused runs no MTP forward."""
    calls = []
    forward_mtp = loaded.model.forward_mtp
    monkeypatch.setattr(
        loaded.model, "forward_mtp", lambda *a, **kw: calls.append(1) or forward_mtp(*a, **kw)
    )
    llm = make_llm(loaded, MTP3)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate([PROMPTS[3]], params)
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens == 0
    assert stats.num_draft_tokens == stats.num_drafts == len(calls)
    assert len(calls) < 48 // 4  # paused for most of the steps


def cold_mtp_llm(loaded, monkeypatch, **kw) -> tuple[LLM, list]:
    """An MTP engine run until its recent rounds are cold (random MTP weights), and the list
    its MTP forwards are counted in from then on."""
    llm = make_llm(loaded, MTP3, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    while not llm.engine.spec.recent.cold:
        llm.generate([PROMPTS[3]], params)
    calls = []
    forward_mtp = loaded.model.forward_mtp
    monkeypatch.setattr(
        loaded.model, "forward_mtp", lambda *a, **kw: calls.append(1) or forward_mtp(*a, **kw)
    )
    return llm, calls


def test_after_mtp_is_refused_everywhere_a_new_request_starts_paused(loaded, monkeypatch):
    """Random MTP weights: once the engine's last rounds accepted nothing, a new request runs
    no MTP forward until its first probe, the longest pause in (and its output stays plain)."""
    from deepserve.engine.spec_decode.throttle import MAX_PAUSE

    llm, calls = cold_mtp_llm(loaded, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=MAX_PAUSE // 2, ignore_eos=True)
    got = outputs(llm, [PROMPTS[4]], params)
    assert calls == []
    assert got == outputs(make_llm(loaded, None), [PROMPTS[4]], params)
    assert_no_leak(llm)


def test_while_mtp_is_refused_everywhere_a_batch_probes_once_per_cold_window_of_steps(
    loaded, monkeypatch
):
    """Eight cold sequences all reach their probe in one run: the engine grants one MTP round
    (one probe per `COLD_PROBE_STEPS` steps, whichever sequence asks), the rest pause again."""
    from deepserve.engine.spec_decode.throttle import COLD_PROBE_STEPS, MAX_PAUSE

    llm, calls = cold_mtp_llm(loaded, monkeypatch, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_PAUSE + 8, ignore_eos=True)
    assert MAX_PAUSE + 8 < COLD_PROBE_STEPS
    prompts = [PROMPTS[i % len(PROMPTS)] + [7 + i] for i in range(8)]
    got = outputs(llm, prompts, params)
    assert len(calls) == 1
    assert got == outputs(make_llm(loaded, None, num_kv_blocks=512), prompts, params)
    assert_no_leak(llm)


def test_mtp_logprobs_match_plain(loaded):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    plain = make_llm(loaded, None).generate([PROMPTS[1]], params)[0].samples[0]
    spec = make_llm(loaded, MTP3).generate([PROMPTS[1]], params)[0].samples[0]
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def busy_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=18, stop_token_ids=(stop_token,)),
        SamplingParams(temperature=1.0, seed=5, max_tokens=13, n=2, top_p=0.9, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=12,
            frequency_penalty=1.5,
            repetition_penalty=1.3,
            min_tokens=6,
            stop_token_ids=(stop_token,),
        ),
    ]


def test_mtp_busy_batch_with_chunking_prefix_cache_and_preemption_matches_plain(loaded):
    """Different draft lengths in one batch (max_tokens cuts drafts short), prompts that share a
    prefix, 8-token chunks and a pool small enough to preempt."""
    shared = [100 + i for i in range(12)]
    prompts = [shared + p for p in PROMPTS] + [PROMPTS[0]]
    first = outputs(
        make_llm(loaded, None), [prompts[3]], SamplingParams(temperature=0, max_tokens=30)
    )
    params = busy_params(stop_token=first[0][0][6])
    kw = dict(num_kv_blocks=14, max_num_batched_tokens=8)
    plain_llm, spec_llm = make_llm(loaded, None, **kw), make_llm(loaded, MTP3, **kw)
    plain = outputs(plain_llm, prompts, params)
    spec = outputs(spec_llm, prompts, params)
    assert spec == plain
    assert len(spec[3][0]) == 7  # stopped at the stop token, even inside an accepted run
    assert [len(s) for s in spec[2]] == [9, 9]
    assert spec_llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(spec_llm)


def test_mtp_json_schema_greedy_matches_plain(loaded):
    from deepserve.engine.sampling_params import StructuredOutput

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    params = SamplingParams(
        temperature=0, max_tokens=24, structured=StructuredOutput("json_schema", schema)
    )
    plain = outputs(make_llm(loaded, None), PROMPTS[:2], params)
    spec_llm = make_llm(loaded, MTP3)
    assert outputs(spec_llm, PROMPTS[:2], params) == plain
    assert_no_leak(spec_llm)


def test_abort_mid_speculation_frees_every_block(loaded):
    llm = make_llm(loaded, MTP3_FIXED)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert any(s.spec_token_ids for s in engine.scheduler.running)
    engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(llm)


# ---- stub drafters (test only): force every draft accepted, or every draft rejected -------------


class ScriptedProposer:
    """Proposes `continuation[len(done):][:k]` shifted by `offset` (0: the true greedy tokens)."""

    def __init__(self, prompt: list[int], continuation: list[int], offset: int, vocab: int):
        self.prompt, self.continuation, self.offset, self.vocab = (
            prompt,
            continuation,
            offset,
            vocab,
        )

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        future = self.continuation[done : done + num_tokens]
        return [(t + self.offset) % self.vocab for t in future]


def run_with_invariants(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Step by hand, checking after each step that only verified tokens count as computed and
    that no block beyond the sequence's tokens is held."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            assert seq.num_computed_tokens == seq.num_tokens - 1
            # blocks for the computed KV (maybe the newest token's slot), none for rejected drafts
            held = len(seq.block_table)
            assert -(-seq.num_computed_tokens // 4) <= held <= -(-seq.num_tokens // 4)
    return tokens


@pytest.mark.parametrize("offset, rate", [(0, 1.0), (1, 0.0)])
def test_stub_drafter_all_accepted_or_all_rejected_keeps_output_and_bookkeeping(
    loaded, offset, rate
):
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    reference = outputs(make_llm(loaded, None), [prompt], params)[0][0]
    llm = make_llm(loaded, SpeculativeConfig("ngram", 4, adaptive=False))
    llm.engine.spec.token_proposer = ScriptedProposer(prompt, reference, offset, 129281)
    tokens = run_with_invariants(llm, prompt, params)
    assert tokens == reference
    stats = llm.engine.spec.stats
    assert stats.acceptance_rate == rate
    assert stats.num_draft_tokens == (17 if rate else 78)  # 4+4+4+4+1, or 4 * 18 + 3 + 2 + 1
    expected_rounds = 5 if rate else 21  # 22 tokens after the prefill's: 5+5+5+5+2, or 1 each
    assert stats.num_drafts == expected_rounds
    registered = {b.token_ids for b in llm.engine.block_manager.blocks if b.key is not None}
    full = prompt + reference
    for tokens_in_block in registered:  # never a block with unverified (rejected) tokens
        assert any(tuple(full[i : i + 4]) == tokens_in_block for i in range(0, len(full) - 3, 4))
    assert_no_leak(llm)


# ---- distribution preserved ----------------------------------------------------------------


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-squared(df), Wilson-Hilferty approximation (z = 3.09)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def two_sample_chi2(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Homogeneity chi-squared of two samples over their cells (rare cells pooled into one)."""
    cells = set(a) | set(b)
    big = [c for c in cells if a[c] + b[c] >= min_count]
    rows = [(a[c], b[c]) for c in big]
    rest = (sum(a[c] for c in cells - set(big)), sum(b[c] for c in cells - set(big)))
    if sum(rest):
        rows.append(rest)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(rows) - 1


@pytest.mark.slow
def test_sampled_distribution_with_speculation_matches_plain(loaded):
    """First two sampled tokens of one prompt over 400 seeds with speculation and 400 other seeds
    without: a two-sample chi-squared homogeneity test at the 0.001 level.

    The drafter proposes the target's greedy continuation, which at temperature 0.6 is accepted
    about half the time; a verifier that accepted it always would put all the mass of the second
    token on it (checked below to be far from what we see), and one that resampled wrongly after a
    rejection would move mass between the other cells: both push the statistic past the bound.
    Same seeds with and without speculation give identical tokens (the verifier is exact).
    """
    prompt, n = [3, 141, 59, 26], 400
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    firsts = _likely_first_tokens(loaded, prompt)
    plain_llm = make_llm(loaded, None, max_num_seqs=64, num_kv_blocks=200)
    table = {t: outputs(plain_llm, [prompt + [t]], greedy)[0][0] for t in firsts}
    spec_llm = make_llm(loaded, SpeculativeConfig("ngram", 2), max_num_seqs=64, num_kv_blocks=200)
    spec_llm.engine.spec.token_proposer = GreedyTable(len(prompt), table)

    def pairs(llm: LLM, seeds) -> list[tuple[int, int]]:
        params = [
            SamplingParams(temperature=0.6, seed=s, max_tokens=3, ignore_eos=True) for s in seeds
        ]
        return [tuple(o[0][:2]) for o in outputs(llm, [prompt] * len(seeds), params)]

    plain = pairs(plain_llm, range(n))
    spec = pairs(spec_llm, range(n, 2 * n))
    stat, df = two_sample_chi2(Counter(plain), Counter(spec))
    assert stat < chi2_critical(df), (stat, df)
    accepted = spec_llm.engine.spec.stats
    assert 0.2 < accepted.acceptance_rate_by_position()[0] < 0.9  # the test has power
    hits = sum(1 for t1, t2 in spec if table.get(t1, [None])[0] == t2) / n
    assert hits < 0.9  # an always-accept verifier would give 1.0
    assert pairs(spec_llm, range(50)) == plain[:50]  # same seeds: identical tokens


class GreedyTable:
    """Drafts the target's greedy continuation after the first sampled token (test only)."""

    def __init__(self, prompt_len: int, table: dict[int, list[int]]):
        self.prompt_len, self.table = prompt_len, table

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        if len(token_ids) != self.prompt_len + 1:
            return []
        return self.table.get(token_ids[-1], [])[:num_tokens]


def _likely_first_tokens(loaded, prompt: list[int]) -> list[int]:
    llm = make_llm(loaded, None)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=12)
    top = llm.generate([prompt], params)[0].samples[0].logprobs[0].top
    return [t for t, _ in top]


def test_spec_decode_counters_are_exported_for_prometheus(loaded):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from deepserve.server.component_metrics import EngineCollector

    llm = make_llm(loaded, MTP3_FIXED)  # every round drafts k: a counter per position
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.engine.stats, {"model_name": "m", "role": "mixed"}))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, s.labels.get("position"))] = s.value
    stats = llm.engine.spec.stats
    assert samples[("deepserve:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    for pos in range(3):
        drafted = samples[("deepserve:spec_decode_num_draft_tokens_per_pos_total", str(pos))]
        accepted = samples[("deepserve:spec_decode_num_accepted_tokens_per_pos_total", str(pos))]
        assert (drafted, accepted) == (
            stats.drafted_per_position[pos],
            stats.accepted_per_position[pos],
        )
    assert sum(stats.drafted_per_position) == stats.num_draft_tokens > 0


@torch.inference_mode()
def reference_mtp_drafts(model, tokens: list[int], k: int) -> list[int]:
    """Drafts recomputed from scratch: the target over all tokens, the MTP layer over every position
    (row p = target hidden at p-1, zero at p = 0, with token p), then k-1 chained rows."""
    from deepserve.engine.spec_decode.mtp import build_metadata

    spec = model.kv_cache_spec
    n, bs = len(tokens), 4
    table = list(range(-(-(n + k) // bs)))
    cache = torch.zeros(spec.num_layers, len(table), bs, spec.width, dtype=spec.dtype)
    ids, pos = torch.tensor(tokens), torch.arange(n)
    hidden = model.forward(ids, pos, build_metadata([(table, 0, n)], bs, ids.device), cache)
    prev = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
    mtp = model.forward_mtp(ids, pos, prev, build_metadata([(table, 0, n)], bs, ids.device), cache)
    last, drafts = mtp[-1:], []
    for j in range(k):
        drafts.append(int(model.compute_mtp_logits(last).argmax(-1)))
        if j + 1 < k:
            attn = build_metadata([(table, n + j, 1)], bs, ids.device)
            last = model.forward_mtp(
                torch.tensor(drafts[-1:]), torch.tensor([n + j]), last, attn, cache
            )
    return drafts


@pytest.mark.parametrize("accept_all", [False, True])
def test_mtp_drafts_equal_a_from_scratch_recomputation(loaded, accept_all):
    """The MTP KV built step by step (prefill in 5-token chunks, then catch-up rows each step)
    gives the same drafts as recomputing every position at once, for both forked samples (n=2:
    the second redoes the MTP rows of its copied partial block).

    Random MTP weights get every draft rejected (one catch-up row per step); with `accept_all` the
    verifier is replaced (test only) by one that takes every draft, so each step's catch-up covers
    several accepted positions, as with a trained MTP layer. The tokens then differ from plain
    decoding, which is not what this test checks."""
    llm = make_llm(loaded, MTP3_FIXED, max_num_batched_tokens=5)
    engine = llm.engine
    if accept_all:
        engine.spec.verify = lambda seq, sampled: [*seq.spec_token_ids, sampled[-1]]
    engine.add_request(
        "r", PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    )
    seen = []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.spec_token_ids:
                seen.append((list(seq.token_ids), list(seq.spec_token_ids)))
    assert len(seen) >= 5
    for tokens, drafts in seen:
        assert drafts == reference_mtp_drafts(loaded.model, tokens, len(drafts)), len(tokens)
