"""Tensor and expert parallelism on the CPU (engine/parallel/, docs/parallel.md): 2 and 4 gloo rank
processes give one process's greedy tokens and last-position logits within 1e-4 (float32) on
SmolLM2 and tiny-deepseek, with tensor parallelism alone and with expert parallelism; and
`deepserve serve --tensor-parallel-size 2` answers over HTTP with one process's greedy text.
Every rank runs one torch thread (the CI host has two cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from server_harness import free_port, running_server

from deepserve.engine.config import EngineConfig, KVTierConfig, SpeculativeConfig
from deepserve.engine.llm import LLM
from deepserve.engine.loading.loader import load_model
from deepserve.engine.parallel.plan import ShardPlan, llama_heads
from deepserve.engine.sampling_params import SamplingParams
from deepserve.kernels.attention_metadata import AttentionMetadata

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 6
BLOCK = 16
CASES = [
    ("smollm2-135m", 2, False),
    ("smollm2-135m", 4, False),
    ("tiny-deepseek", 2, False),
    ("tiny-deepseek", 4, False),
    ("tiny-deepseek", 2, True),
    ("tiny-deepseek", 4, True),
]


@dataclass
class Run:
    tokens: list[list[int]]  # greedy tokens per prompt
    logits: list[torch.Tensor]  # last prompt position's logits per prompt


def _config(model: str, size: int = 1, expert_parallel: bool = False) -> EngineConfig:
    return EngineConfig(
        model=model,
        num_threads=1,
        tensor_parallel_size=size,
        enable_expert_parallel=expert_parallel,
        kv_cache_bytes=8 * 2**20,
        max_num_seqs=4,
    )


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """One prompt's prefill through `model.forward` (every rank's, under TP) -> last logits."""
    spec, n = model.kv_cache_spec, len(ids)
    blocks = -(-n // BLOCK)
    cache = torch.zeros(spec.num_layers, blocks, BLOCK, spec.width, dtype=spec.dtype)
    attn = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        block_size=BLOCK,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        context_lens_cpu=[0],
    )
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), torch.arange(n), attn, cache)
        return model.compute_logits(hidden[-1:])[0]


def _run(config: EngineConfig) -> Run:
    loaded = load_model(config)
    prompts = [loaded.tokenizer.encode(p).ids for p in PROMPTS]
    llm = LLM(config, loaded=loaded)  # closes the ranks with the engine
    try:
        logits = [_prefill_logits(loaded.model, ids) for ids in prompts]
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    finally:
        llm.close()
    return Run([r.token_ids for r in results], logits)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_single: dict[str, Run] = {}


def _one_process(model: str) -> Run:
    if model not in _single:
        _single[model] = _run(_config(model))
    return _single[model]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{m}-tp{n}{'-ep' if ep else ''}" for m, n, ep in CASES]
)
def ranks(request) -> tuple[Run, Run]:
    """(the N-process run, the one-process run) of one case."""
    model, size, ep = request.param
    return _run(_config(model, size, ep)), _one_process(model)


def test_greedy_tokens_equal_one_process(ranks) -> None:
    parallel, single = ranks
    assert parallel.tokens == single.tokens
    assert all(len(t) == MAX_TOKENS for t in parallel.tokens)


def test_last_logits_within_1e_4_of_one_process(ranks) -> None:
    parallel, single = ranks
    for got, want in zip(parallel.logits, single.logits, strict=True):
        assert (got - want).abs().max().item() < 1e-4


# ---- the head plan ---------------------------------------------------------------------------


def test_llama_ranks_take_whole_kv_groups_while_there_are_enough() -> None:
    # SmolLM2: 9 query heads in 3 GQA groups
    assert llama_heads(9, 3, ShardPlan(0, 2)).heads == range(0, 6)
    assert llama_heads(9, 3, ShardPlan(0, 2)).kv_heads == (0, 1)
    assert llama_heads(9, 3, ShardPlan(1, 2)).heads == range(6, 9)
    assert llama_heads(9, 3, ShardPlan(1, 2)).kv_heads == (2,)


def test_llama_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    plans = [llama_heads(9, 3, ShardPlan(r, 4)) for r in range(4)]
    assert [p.heads for p in plans] == [range(0, 3), range(3, 5), range(5, 7), range(7, 9)]
    assert [p.kv_heads for p in plans] == [(0,), (1, 1), (1, 2), (2, 2)]


def test_ranks_refuse_speculative_decoding_and_kv_tiers() -> None:
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig("mtp"))
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, kv_tiers=KVTierConfig(host_bytes=2**20))


# ---- over HTTP ----------------------------------------------------------------------------------


def _greedy_chat(base_url: str) -> str:
    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Name a color."}],
        temperature=0.0,
        max_tokens=8,
    )
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def tp2_server() -> Iterator[str]:
    """`deepserve serve --tensor-parallel-size 2` as a real process on a free port."""
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("deepserve")), "serve",
        "--model", "smollm2-135m", "--port", str(port), "--num-threads", "1",
        "--tensor-parallel-size", "2", "--kv-cache-bytes", str(8 * 2**20),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while not _healthy(url):
            assert proc.poll() is None, f"deepserve serve exited with {proc.returncode}"
            assert time.time() < deadline, "deepserve serve did not become healthy"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_with_two_ranks_answers_with_one_process_greedy_text(
    tp2_server, smollm_engine
) -> None:
    with running_server(smollm_engine, "smollm2-135m") as one:
        want = _greedy_chat(one.base_url)
    got = _greedy_chat(tp2_server)
    assert got and got == want


# ---- batch invariance across ranks ------------------------------------------------------------


def _chosen_logprobs(llm: LLM, prompts: list[str]) -> list[tuple[float, ...]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    return [
        tuple(lp.logprob for lp in r.samples[0].logprobs) for r in llm.generate(prompts, params)
    ]


def test_batch_invariant_ranks_give_a_row_the_same_bits_in_any_batch() -> None:
    # 4 ranks: the backend's all-reduce would order the sum by the tensor's size; the fixed
    # rank order must not
    config = replace(_config("tiny-deepseek", 4, True), batch_invariant=True)
    llm = LLM(config)
    try:
        alone = _chosen_logprobs(llm, PROMPTS[:1])[0]
        batched = _chosen_logprobs(llm, ["Once upon a time, in a land far away", *PROMPTS])[1]
    finally:
        llm.close()
    assert alone == batched
