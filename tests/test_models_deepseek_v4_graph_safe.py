"""A tiny-deepseek-v4 decode step is graph-safe in the sense the CPU can check: with the step's
metadata as a CUDA-graph capture builds it (engine/cuda_graphs.py: upper-bound host lengths, a
padding row in a reserved block), the forward gives the logits and the KV rows that the exact
lengths give, step after step across window, CSA-group and HCA-group boundaries. So nothing in the
step reads a host value that changes between decode steps."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.cuda_graphs import DecodeGraphs
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4
from deepserve.kernels.attention_metadata import AttentionMetadata

BLOCK = 16
PROMPT_LENS = (45, 130, 63)  # decoding crosses CSA (4) and HCA (16) group ends and the window
STEPS = 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny-deepseek-v4"), seed=0)


def _metadata(slots, tables, lens, qlens, ctx) -> AttentionMetadata:
    dev = slots.device
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
        slot_mapping=slots,
        block_tables=tables,
        block_size=BLOCK,
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
        context_lens_cpu=ctx,
    )


@torch.inference_mode()
def _decode_both_ways(model, prompts: list[list[int]]):
    """Prefill each prompt, then decode STEPS greedy steps twice from the same state: with exact
    host lengths and with the capture's. Yields (exact, bound) logits and caches per step."""
    spec = model.kv_cache_spec
    width = -(-(max(map(len, prompts)) + STEPS) // BLOCK) + 1
    blocks = len(prompts) * width + 1
    cache = torch.zeros(spec.num_layers, blocks, BLOCK, spec.width, dtype=spec.dtype)
    graphs = DecodeGraphs(model, cache, BLOCK, 4, width, pad_block=blocks - 1)
    order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(0))
    tables = order.view(len(prompts), width).to(torch.int32)  # block `blocks - 1`: the padding's
    tokens = []
    for i, p in enumerate(prompts):
        pos = torch.arange(len(p))
        attn = _metadata(_slots(tables[i], pos), tables[i : i + 1], [len(p)], [len(p)], [0])
        hidden = model.forward(torch.tensor(p), pos, attn, cache)
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    caches = {"exact": cache, "bound": cache.clone()}
    lens = [len(p) for p in prompts]
    rows, bucket = len(prompts), next(b for b in graphs.buckets if b >= len(prompts))
    for _ in range(STEPS):
        graphs.input_ids[:rows] = torch.tensor(tokens)
        graphs.positions[:rows] = torch.tensor(lens)
        graphs.slots[:rows] = torch.stack(
            [_slots(tables[i], torch.tensor(n)) for i, n in enumerate(lens)]
        )
        graphs.seq_lens[:rows] = torch.tensor(lens) + 1
        graphs.context_lens[:rows] = torch.tensor(lens)
        graphs.block_tables[:rows] = tables
        graphs._pad_rows(rows, bucket)
        pad = bucket - rows
        exact = _metadata(
            graphs.slots[:bucket], graphs.block_tables[:bucket], [n + 1 for n in lens] + [1] * pad,
            [1] * bucket, lens + [0] * pad,
        )  # fmt: skip
        step = {}
        for name, attn in (("exact", exact), ("bound", graphs._metadata(bucket))):
            ids, pos = graphs.input_ids[:bucket], graphs.positions[:bucket]
            hidden = model.forward(ids, pos, attn, caches[name])
            step[name] = model.compute_logits(hidden)[:rows]
        yield step["exact"], step["bound"], caches["exact"], caches["bound"]
        tokens = step["exact"].argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def _slots(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return table[pos // BLOCK].long() * BLOCK + pos % BLOCK


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_decode_with_capture_metadata_is_bitwise_exact_under_batch_invariant(tiny_dir):
    torch.set_num_threads(1)
    model = load_model(EngineConfig(model=str(tiny_dir), batch_invariant=True)).model
    for exact, bound, exact_cache, bound_cache in _decode_both_ways(model, _prompts()):
        assert torch.equal(exact, bound)
        assert torch.equal(exact_cache, bound_cache)


def test_decode_with_capture_metadata_matches_exact_lengths(tiny_dir):
    torch.set_num_threads(1)
    model = load_model(EngineConfig(model=str(tiny_dir))).model
    assert model.graph_safe
    for exact, bound, _, _ in _decode_both_ways(model, _prompts()):
        assert torch.allclose(exact, bound, atol=1e-5, rtol=0)
