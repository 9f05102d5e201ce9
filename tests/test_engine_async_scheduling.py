"""Async scheduling (engine/async_scheduling.py) changes when the host learns a step's ids, never
what they are: the same requests give the same tokens, logprobs, finish reasons and usage with it
on and off. On the CPU the forward is synchronous, so this checks the bookkeeping: placeholders,
the ids fed to the next step, dropped rows, fallbacks and aborts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams

MODEL = "tiny-deepseek"
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31, 32]]


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(model=MODEL, num_threads=1))


def make_engine(loaded, on: bool) -> LLMEngine:
    config = EngineConfig(model=MODEL, num_kv_blocks=128, num_threads=1, async_scheduling=on)
    return LLMEngine(config, loaded)


@dataclass
class Seen:
    """Everything a caller receives for one request."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    stop_token_id: int | None = None
    prompt_tokens: int = 0


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], **events) -> dict:
    """Step `engine` until idle. `arrive`: {step: [(prompt, params)]} added before that step;
    `abort_after`: {request index: tokens received before aborting it}."""
    arrive, abort_after = events.get("arrive", {}), events.get("abort_after", {})
    seen: dict[str, Seen] = {}
    pending = [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
    step = 0
    while pending or engine.has_unfinished() or step <= max(arrive, default=-1):
        pending += [
            (f"a{step}-{j}", p, params) for j, (p, params) in enumerate(arrive.get(step, []))
        ]
        for rid, prompt, params in pending:
            seen[rid] = Seen()
            engine.add_request(rid, prompt, params)
        pending = []
        outputs = engine.step()
        for i, limit in abort_after.items():
            rid = f"r{i}"
            if rid in engine.requests and len(_seen_after(seen[rid], outputs, rid)) >= limit:
                outputs.append(engine.abort(rid))
        for out in outputs:
            s = seen[out.request_id]
            s.prompt_tokens = out.prompt_tokens
            for c in out.outputs:
                s.tokens += c.token_ids
                s.logprobs += c.logprobs or []
                s.finish = c.finish_reason or s.finish
                s.stop_token_id = c.stop_token_id
        step += 1
    return seen


def _seen_after(seen: Seen, outputs: list, rid: str) -> list[int]:
    return seen.tokens + [
        t for o in outputs if o.request_id == rid for c in o.outputs for t in c.token_ids
    ]


def both(loaded, requests, **events) -> tuple[dict, dict, LLMEngine]:
    off = run(make_engine(loaded, False), requests, **events)
    engine = make_engine(loaded, True)
    return off, run(engine, requests, **events), engine


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_batch_is_identical_and_runs_ahead(loaded):
    off, on, engine = both(loaded, [(p, greedy(12)) for p in PROMPTS])
    assert on == off
    assert engine.overlap.ahead >= 8


def test_seeded_sampling_is_identical(loaded):
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=12, top_k=50, top_p=0.9, min_p=0.01)
        for s in range(len(PROMPTS))
    ]
    off, on, engine = both(loaded, list(zip(PROMPTS, params, strict=True)))
    assert on == off
    assert engine.overlap.ahead > 0


def test_logprobs_are_identical(loaded):
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=8, logprobs=3), greedy(8)]
    params += [SamplingParams(temperature=0, max_tokens=8, logprobs=0)] * 2
    off, on, _ = both(loaded, list(zip(PROMPTS, params, strict=True)))
    assert on == off
    assert len(on["r0"].logprobs) == 8 and len(on["r0"].logprobs[0].top) == 3


def test_eos_after_min_tokens_stops_mid_batch_identically(loaded):
    eos = loaded.info.eos_token_ids[0]
    # EOS is banned until min_tokens, then the bias makes it certain: a stop on a known step.
    stopping = SamplingParams(temperature=0, max_tokens=20, min_tokens=4, logit_bias={eos: 100.0})
    requests = [(PROMPTS[0], greedy(12)), (PROMPTS[1], stopping), (PROMPTS[2], greedy(12))]
    off, on, engine = both(loaded, requests)
    assert on == off
    assert on["r1"].finish == "stop" and on["r1"].stop_token_id == eos
    assert len(on["r1"].tokens) == 5 and eos not in on["r1"].tokens[:4]
    assert engine.overlap.wasted_rows == 1  # its row run ahead of the stop was dropped


def test_stop_token_ids_stop_mid_batch_identically(loaded):
    plain = run(make_engine(loaded, False), [(PROMPTS[3], greedy(12))])["r0"].tokens
    stop = plain[5]
    requests = [(PROMPTS[0], greedy(12)), (PROMPTS[3], greedy(12, stop_token_ids=[stop]))]
    off, on, _ = both(loaded, requests)
    assert on == off
    assert on["r1"].finish == "stop" and on["r1"].tokens[-1] == stop


def test_different_max_tokens_end_at_their_lengths_without_wasted_rows(loaded):
    requests = [(p, greedy(n)) for p, n in zip(PROMPTS, [3, 7, 12, 1], strict=True)]
    off, on, engine = both(loaded, requests)
    assert on == off
    assert [len(on[f"r{i}"].tokens) for i in range(4)] == [3, 7, 12, 1]
    assert engine.overlap.wasted_rows == 0  # a row sure to stop is not run ahead


def test_requests_arriving_while_others_decode_are_identical(loaded):
    arrive = {3: [(PROMPTS[2], greedy(6))], 6: [(PROMPTS[3], greedy(5)), (PROMPTS[1], greedy(4))]}
    off, on, engine = both(loaded, [(PROMPTS[0], greedy(14))], arrive=arrive)
    assert on == off
    assert engine.overlap.fallbacks >= 2  # each arrival's step waited for the ids


def test_abort_mid_run_delivers_the_same_tokens_and_no_placeholder(loaded):
    requests = [(p, greedy(12)) for p in PROMPTS[:3]]
    off, on, _ = both(loaded, requests, abort_after={1: 4})
    assert on == off
    assert on["r1"].finish == "abort" and len(on["r1"].tokens) == 4
    assert all(t >= 0 for s in on.values() for t in s.tokens)


def test_abort_of_a_running_ahead_request_frees_its_blocks(loaded):
    engine = make_engine(loaded, True)
    engine.add_request("a", PROMPTS[0], greedy(50))
    while engine.overlap.ahead == 0:
        engine.step()
    final = engine.abort("a")
    assert final.finished and all(t >= 0 for c in final.outputs for t in c.token_ids)
    assert engine.step() == [] and not engine.has_unfinished()
    assert engine.load().num_free_blocks == engine.load().num_blocks


def test_penalties_fall_back_to_the_synchronous_step(loaded):
    penal = SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5, ignore_eos=True)
    off, on, engine = both(loaded, [(p, penal) for p in PROMPTS[:2]])
    assert on == off
    assert engine.overlap.ahead == 0


def test_mixed_penalty_and_plain_requests_are_identical(loaded):
    penal = SamplingParams(temperature=0.7, seed=4, max_tokens=8, frequency_penalty=0.3)
    requests = [(PROMPTS[0], greedy(8)), (PROMPTS[1], penal), (PROMPTS[2], greedy(10))]
    off, on, _ = both(loaded, requests)
    assert on == off


def test_n_samples_fork_identically(loaded):
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=6, n=3, ignore_eos=True)
    off, on, engine = both(loaded, [(PROMPTS[0], params), (PROMPTS[1], greedy(6))])
    assert on == off
    assert engine.overlap.ahead > 0


def test_stats_report_the_steps_run_ahead_only_when_on(loaded):
    _, _, engine = both(loaded, [(p, greedy(8)) for p in PROMPTS])
    assert engine.stats().async_scheduling.ahead == engine.overlap.ahead > 0
    assert make_engine(loaded, False).stats().async_scheduling is None


def test_off_by_default_on_the_cpu(loaded):
    engine = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=64, num_threads=1), loaded)
    assert engine.async_scheduling is False


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_runs_ahead_while_drafting_is_paused_with_identical_output(loaded, method):
    """Random MTP weights (and n-gram over random output) miss, so the draft throttle pauses
    drafting and those steps run ahead; output and drafting are those of the synchronous engine
    (the throttle follows each sequence's own history) and of plain decoding."""
    requests = [(p, greedy(48)) for p in PROMPTS]
    requests[1] = (PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=48))

    def engine(on: bool, spec: SpeculativeConfig | None) -> LLMEngine:
        config = EngineConfig(
            model=MODEL, num_kv_blocks=128, num_threads=1, async_scheduling=on, speculative=spec
        )
        return LLMEngine(config, loaded)

    spec = SpeculativeConfig(method, 3)
    plain = run(engine(False, None), requests)
    sync_engine, async_engine = engine(False, spec), engine(True, spec)
    sync = run(sync_engine, requests)
    on = run(async_engine, requests)
    assert on == sync == plain
    assert async_engine.overlap.ahead > 0
    assert async_engine.spec.stats == sync_engine.spec.stats
    if method == "mtp":
        assert sync_engine.spec.stats.num_draft_tokens > 0


def test_a_step_run_ahead_while_mtp_drafting_is_paused_keeps_no_hidden_states(loaded):
    """No MTP forward reads a step run ahead (its sequences skip drafting), so the runner copies
    no hidden states out of it: a paused step costs what a plain decode step does."""
    config = EngineConfig(
        model=MODEL,
        num_kv_blocks=128,
        num_threads=1,
        async_scheduling=True,
        speculative=SpeculativeConfig("mtp", 3),
    )
    engine = LLMEngine(config, loaded)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(48))
    in_flight = []  # the hidden states each step left in flight kept
    while engine.has_unfinished():
        engine.step()
        if engine._in_flight is not None:
            in_flight.append(engine._in_flight.hidden)
    assert engine.overlap.ahead > 0 and in_flight
    assert all(hidden is None for hidden in in_flight)
