"""`--batch-invariant` on a host whose load changes: SmolLM2 runs all native under the flag, so the
engine's thread count follows the load (engine/threads.py) and the outputs do not change with it;
a model whose flag path runs torch ops keeps the count it first ran them at."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.threads import ThreadPolicy
from deepserve.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")

# lengths over a few KV blocks and a prefill chunk, so attention takes several key blocks
PROMPTS = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate((150, 37, 90, 5))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def smollm2(request):
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(model="smollm2-135m", batch_invariant=True, dtype=request.param))


def _llm(loaded, **kw) -> LLM:
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    config = EngineConfig(
        model=loaded.info.name, batch_invariant=True, dtype=dtype, num_kv_blocks=128,
        max_num_batched_tokens=64, **kw,
    )  # fmt: skip
    return LLM(config, loaded)


def _results(llm: LLM, params: SamplingParams):
    out = llm.generate(PROMPTS, params)
    return [
        (
            tuple(s.token_ids),
            tuple((lp.logprob, tuple(lp.top)) for lp in s.logprobs or []),
        )
        for r in out
        for s in r.samples
    ]


class SwingingHost:
    """A host whose other work comes and goes at every reading: the count flips each step."""

    def __init__(self) -> None:
        self.readings, self.now, self.counts = 0, 0.0, []

    def policy(self, calls) -> ThreadPolicy:
        policy = ThreadPolicy(
            cores=2, read_runnable=self.read, read_own=lambda: 1, clock=self.clock
        )
        policy.adapt_until_torch(calls)
        return policy

    def read(self) -> int:
        self.readings += 1
        self.counts.append(torch.get_num_threads())
        return 1 if self.readings % 2 else 4

    def clock(self) -> float:
        self.now += 60.0  # every reading due, and weighed fully against the last
        return self.now


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
def test_outputs_at_one_and_two_threads_are_bitwise_equal(smollm2, params):
    one = _results(_llm(smollm2, num_threads=1), params)
    two = _results(_llm(smollm2, num_threads=2), params)
    assert one == two


def test_outputs_are_bitwise_equal_when_the_count_changes_between_steps(smollm2):
    fixed = _results(_llm(smollm2, num_threads=1), PARAMS)
    llm = _llm(smollm2)
    host = SwingingHost()
    llm.engine.threads = host.policy(smollm2.kernels.torch_calls)
    llm.engine.threads.start()
    assert _results(llm, PARAMS) == fixed
    assert set(host.counts) == {1, 2}


def test_the_count_follows_the_load_for_an_all_native_model(smollm2):
    llm = _llm(smollm2)
    llm.generate(PROMPTS[:1], PARAMS)
    assert smollm2.kernels.torch_calls.ops == []
    assert llm.engine.threads.adapting


def test_the_count_is_kept_for_a_model_whose_flag_path_runs_torch_ops():
    llm = LLM(EngineConfig(model="tiny-deepseek", batch_invariant=True, num_kv_blocks=64))
    llm.generate(PROMPTS[:1], PARAMS)
    assert not llm.engine.threads.adapting
