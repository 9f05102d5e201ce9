"""DeepSeek MTP drafting: the checkpoint's multi-token-prediction layer proposes the next tokens.

The MTP row at position p combines the target's hidden state at p-1 with the embedding of the token at
p and predicts the token at p+1. Its attention KV lives in the model's MTP slot of the paged cache at
position p, so the KV of a position depends only on the tokens up to it and is cached, shared and
restored with the block like any other layer's.

Per sequence and step the proposer runs two kinds of rows in one batched MTP forward:
- catch-up rows, for positions whose token is now known and verified, using the target's true hidden
  states (prefill chunks, accepted drafts); the last of them (the newest token) heads the draft chain;
- chained rows: draft j+1 comes from the MTP's own output hidden at draft j and draft j's embedding.
Drafts are greedy (argmax), so the verifier treats them as a point mass and the output equals plain
decoding exactly. Where the target's previous hidden is unknown (position 0, the first token after a
prefix-cache hit) a zero vector stands in: that only lowers draft quality, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepserve.engine.host_tensors import host_tensor
from deepserve.kernels.attention_metadata import AttentionMetadata


class MtpModel(Protocol):
    def forward_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor: ...

    def compute_mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class MtpRows:
    """One sequence's MTP work for a step."""

    block_table: list[int]
    start: int  # position of the first catch-up row
    token_ids: list[int]  # tokens at positions start .. start + m - 1 (m >= 1)
    prev_hidden: torch.Tensor  # [m, hidden]: target hidden at positions start-1 .. start+m-2
    num_drafts: int  # drafts wanted after the last catch-up row (0: only write the MTP KV)


class MtpProposer:
    """Stateless: the runner hands it rows and the KV cache; it returns greedy drafts."""

    def __init__(self, model: MtpModel, block_size: int) -> None:
        self.model = model
        self.block_size = block_size

    def propose(self, work: list[MtpRows], kv_cache: torch.Tensor) -> list[list[int]]:
        """Write MTP KV for every catch-up row and return up to `num_drafts` drafts per sequence."""
        drafts: list[list[int]] = [[] for _ in work]
        if not work:
            return drafts
        hidden = self._forward_catch_up(work, kv_cache)
        active = [i for i, w in enumerate(work) if w.num_drafts > 0]
        if not active:
            return drafts
        last_rows = [n - 1 for n in _cumsum([len(w.token_ids) for w in work])]
        (rows,) = to_device([[last_rows[i] for i in active]], torch.long, hidden.device)
        hidden = hidden[rows]
        for step in range(max(work[i].num_drafts for i in active)):
            tokens = self.model.compute_mtp_logits(hidden).argmax(dim=-1).tolist()
            for i, tok in zip(active, tokens, strict=True):
                drafts[i].append(tok)
            keep = [j for j, i in enumerate(active) if len(drafts[i]) < work[i].num_drafts]
            if not keep:
                break
            active = [active[j] for j in keep]
            chained = [(work[i], step + 1, drafts[i][-1]) for i in active]
            hidden = self._forward_chained(chained, hidden[keep], kv_cache)
        return drafts

    def _forward_catch_up(self, work: list[MtpRows], kv_cache: torch.Tensor) -> torch.Tensor:
        device = kv_cache.device
        ids = [t for w in work for t in w.token_ids]
        positions = [p for w in work for p in range(w.start, w.start + len(w.token_ids))]
        ids_t, positions_t = to_device([ids, positions], torch.long, device)
        spans = [(w.block_table, w.start, len(w.token_ids)) for w in work]
        prev = torch.cat([w.prev_hidden for w in work]).to(device)
        attn = build_metadata(spans, self.block_size, device)
        return self.model.forward_mtp(ids_t, positions_t, prev, attn, kv_cache)

    def _forward_chained(
        self, rows: list[tuple[MtpRows, int, int]], prev: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """One row per sequence: draft `token` at position last catch-up position + `offset`."""
        device = kv_cache.device
        spans = [(w.block_table, w.start + len(w.token_ids) - 1 + off, 1) for w, off, _ in rows]
        ids, positions = to_device(
            [[tok for _, _, tok in rows], [s[1] for s in spans]], torch.long, device
        )
        attn = build_metadata(spans, self.block_size, device)
        return self.model.forward_mtp(ids, positions, prev, attn, kv_cache)


def build_metadata(
    spans: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Attention metadata for query rows (block_table, first position, count), one per sequence."""
    query_lens = [n for _, _, n in spans]
    context_lens = [start for _, start, _ in spans]
    seq_lens = [start + n for _, start, n in spans]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, start, n in spans
        for p in range(start, start + n)
    ]
    width = max(len(table) for table, _, _ in spans)
    tables = [t for table, _, _ in spans for t in table + [0] * (width - len(table))]
    query_start, seq_lens_t, context_lens_t, tables_t = to_device(
        [[0, *_cumsum(query_lens)], seq_lens, context_lens, tables], torch.int32, device
    )
    (slot_mapping,) = to_device([slots], torch.int64, device)
    return AttentionMetadata(
        query_start_loc=query_start,
        seq_lens=seq_lens_t,
        context_lens=context_lens_t,
        slot_mapping=slot_mapping,
        block_tables=tables_t.view(len(spans), width),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=context_lens,
    )


def to_device(
    parts: list[list[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """`parts` as tensors on `device` through one host-to-device copy that the host does not wait
    for (pinned memory on a GPU): each eager MTP forward needs about ten small index tensors,
    and a blocking copy apiece cost more than the layer's kernels on small models."""
    host = host_tensor([v for part in parts for v in part], dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return list(flat.split([len(part) for part in parts]))


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
