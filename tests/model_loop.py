"""Test helper (not a test): drives a `CausalLM` one sequence at a time through the real contract,
AttentionMetadata plus a paged KV cache tensor we allocate, with a scrambled block table so paging is
exercised. The engine's own batched runner is tested elsewhere."""

from __future__ import annotations

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata


class SequenceLoop:
    def __init__(self, model, max_tokens: int, block_size: int = 16, seed: int = 0) -> None:
        spec = model.kv_cache_spec
        self.model = model
        self.block_size = block_size
        nblocks = -(-max_tokens // block_size) + 2
        device = getattr(model, "device", "cpu")
        self.cache = torch.zeros(
            spec.num_layers, nblocks, block_size, spec.width, dtype=spec.dtype, device=device
        )
        gen = torch.Generator().manual_seed(seed)
        # block 0 is left unused so a wrong block-table read shows up as a mismatch
        self.blocks = (torch.randperm(nblocks - 1, generator=gen) + 1).to(torch.int32)
        self.length = 0
        self.device = device
        self.prompt_len: int | None = None  # set: the metadata's prompt_lens_cpu (row roles)

    def metadata(self, n: int) -> AttentionMetadata:
        ctx, total = self.length, self.length + n
        pos = torch.arange(ctx, total)
        slots = self.blocks[pos // self.block_size].long() * self.block_size + pos % self.block_size
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([total], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
            slot_mapping=slots.to(dev),
            block_tables=self.blocks[None, :].to(dev),
            block_size=self.block_size,
            query_lens_cpu=[n],
            seq_lens_cpu=[total],
            context_lens_cpu=[ctx],
            prompt_lens_cpu=None if self.prompt_len is None else [self.prompt_len],
        )

    @torch.inference_mode()
    def hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Feed tokens (a prefill chunk or one decode token); returns their hidden states."""
        n = len(token_ids)
        attn = self.metadata(n)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.arange(self.length, self.length + n, device=self.device)
        out = self.model.forward(ids, pos, attn, self.cache)
        self.length += n
        return out

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Feed tokens; returns the last position's logits [vocab] float32."""
        return self.model.compute_logits(self.hidden(token_ids)[-1:])[0]

    def greedy(self, prompt: list[int], n: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Up to n argmax tokens; a stop id ends it (and is included), as HF generate does."""
        out = []
        logits = self.logits(prompt)
        for _ in range(n):
            out.append(int(logits.argmax()))
            if out[-1] in stop_ids or len(out) == n:
                break
            logits = self.logits([out[-1]])
        return out


@torch.inference_mode()
def batched_step_logits(
    model, contexts: list[list[int]], new: list[list[int]], block_size: int = 16
):
    """Prefill each sequence's `contexts[i]` alone, then run ONE flattened step holding every
    sequence's `new[i]` tokens (a mix of chunks and single decodes). Returns each sequence's
    last-row logits from that step, [B, vocab]."""
    spec = model.kv_cache_spec
    device = getattr(model, "device", "cpu")
    lens = [len(c) + len(n) for c, n in zip(contexts, new, strict=True)]
    need = [-(-n // block_size) for n in lens]
    cache = torch.zeros(
        spec.num_layers, sum(need) + 1, block_size, spec.width, dtype=spec.dtype, device=device
    )
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    ids = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)) + 1
    for i, n in enumerate(need):
        tables[i, :n] = ids[sum(need[:i]) : sum(need[:i]) + n]

    def step(rows: list[int], chunks: list[list[int]], starts: list[int]):
        qlens = [len(c) for c in chunks]
        ends = [s + q for s, q in zip(starts, qlens, strict=True)]
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        owner = torch.cat([torch.full((q,), r) for r, q in zip(rows, qlens, strict=True)])
        bt = tables[rows]
        slots = tables[owner, pos // block_size].long() * block_size + pos % block_size
        attn = AttentionMetadata(
            query_start_loc=torch.tensor(
                [0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=device
            ),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            context_lens=torch.tensor(starts, dtype=torch.int32, device=device),
            slot_mapping=slots.to(device),
            block_tables=bt.to(device),
            block_size=block_size,
            query_lens_cpu=qlens,
            seq_lens_cpu=ends,
            context_lens_cpu=starts,
        )
        flat = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
        hidden = model.forward(flat, pos.to(device), attn, cache)
        last = torch.tensor(qlens).cumsum(0) - 1
        return model.compute_logits(hidden[last.to(device)])

    for i, c in enumerate(contexts):
        if c:
            step([i], [c], [0])
    return step(list(range(len(lens))), new, [len(c) for c in contexts])


def logit_gap_to_transformers(model, hf_model, prompt: list[int]) -> float:
    """Max abs difference of the last position's logits: ours (paged, one sequence) against a
    transformers model's full forward over the same prompt."""
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    return (SequenceLoop(model, len(prompt) + 1).logits(prompt) - expected).abs().max().item()


def greedy_pair(model, hf_model, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """(ours, transformers') n greedy tokens after `prompt`, no stop token."""
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return SequenceLoop(model, len(prompt) + n + 1).greedy(prompt, n), expected[
        0, len(prompt) :
    ].tolist()
