"""Test helper (not a test): drives a `CausalLM` one sequence at a time through the real contract,
AttentionMetadata plus a paged KV cache tensor we allocate, with a scrambled block table so paging is
exercised. The engine's own batched runner is tested elsewhere."""

from __future__ import annotations

import torch

from deepserve.engine.attention import AttentionMetadata


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

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = []
        logits = self.logits(prompt)
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = self.logits([out[-1]])
        return out
