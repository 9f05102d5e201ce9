"""A paged KV cache with scattered blocks and step metadata, for attention kernel tests (CPU and
Triton): `PagedCase(layout, device)` gives the cache, per-sequence queries, and `run(kernels, seqs)`."""

from __future__ import annotations

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata

BLOCK = 16
LAYOUTS = {"gqa": dict(hq=9, hkv=3, dk=64, dv=64), "mla": dict(hq=4, hkv=1, dk=80, dv=64)}


class Cache:
    """A paged KV cache with one sequence per block-table row, blocks scattered at random."""

    def __init__(
        self,
        lengths,
        hkv,
        dk,
        dv,
        mla=False,
        seed=0,
        device="cpu",
        dtype=torch.float32,
        block=BLOCK,
    ):
        g = torch.Generator().manual_seed(seed)
        self.block = block
        nblocks = sum(-(-n // block) for n in lengths) + 3
        perm = torch.randperm(nblocks, generator=g).tolist()
        self.tables, used = [], 0
        for n in lengths:
            nb = -(-n // block)
            self.tables.append(perm[used : used + nb])
            used += nb
        if mla:
            self.k = torch.randn(nblocks, block, 1, dk, generator=g)
        else:
            self.k = torch.randn(nblocks, block, hkv, dk, generator=g)
            self.v = torch.randn(nblocks, block, hkv, dv, generator=g)
        # what no step wrote yet: poison, so reading past a sequence shows up
        self.k[perm[used:]] = float("nan")
        self.k = self.k.to(device, dtype)
        self.v = self.k[..., :dv] if mla else self.v.to(device, dtype)
        self.device = device

    def meta(self, seqs: list[tuple[int, int, int]]) -> AttentionMetadata:
        """seqs: (sequence index, context length, query count)."""
        width = max(len(t) for t in self.tables)
        tables = [self.tables[i] + [0] * (width - len(self.tables[i])) for i, _, _ in seqs]
        qlens = [n for _, _, n in seqs]
        ctx = [c for _, c, _ in seqs]
        lens = [c + n for _, c, n in seqs]
        loc = [0]
        for n in qlens:
            loc.append(loc[-1] + n)

        def t(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return AttentionMetadata(
            query_start_loc=t(loc),
            seq_lens=t(lens),
            context_lens=t(ctx),
            slot_mapping=t([0] * sum(qlens), torch.int64),
            block_tables=t(tables),
            block_size=self.block,
            query_lens_cpu=qlens,
            seq_lens_cpu=lens,
            context_lens_cpu=ctx,
        )


class PagedCase:
    """Sequences of `lengths` tokens in a paged cache, with random queries for every position."""

    def __init__(
        self, layout: str, lengths: list[int], device="cpu", dtype=torch.float32, block=BLOCK
    ):
        shape = LAYOUTS[layout]
        self.lengths = lengths
        self.cache = Cache(
            lengths,
            shape["hkv"],
            shape["dk"],
            shape["dv"],
            layout == "mla",
            0,
            device,
            dtype,
            block,
        )
        self.queries = [
            torch.randn(
                n, shape["hq"], shape["dk"], generator=torch.Generator().manual_seed(20 + i)
            ).to(device, dtype)
            for i, n in enumerate(lengths)
        ]

    def run(self, kernels, seqs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Attention for `seqs` [(seq, ctx, n)] in one batch -> that step's rows, per sequence."""
        q = torch.cat([self.queries[i][c : c + n] for i, c, n in seqs])
        out = kernels.paged_attention(q, self.cache.k, self.cache.v, self.cache.meta(seqs), 0.125)
        return list(out.split([n for _, _, n in seqs]))
