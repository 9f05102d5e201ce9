"""The contract every model implements, so the model runner never knows which family it drives.

KV cache layout (shared with the block manager and kvcache/): one tensor
`[num_layers, num_blocks, block_size, width]` allocated by the runner from `KVCacheSpec`. A block's
bytes on every layer are `cache[:, block_id]`, which is what kvcache/ moves between tiers. Llama
stores K and V concatenated on the last dim (width = 2 * kv_heads * head_dim); DeepSeek MLA stores
the compressed latent plus the rope key (width = kv_lora_rank + qk_rope_head_dim). MTP layers are
counted in `num_layers` so their KV is cached and restored like any other layer's.

A model whose cached KV for a token depends on whether the token was computed as a prompt row or
a generated one says so with `kv_follows_row_role = True` (DeepSeek MLA under `--batch-invariant`);
the block manager then keys blocks holding generated tokens apart. Absent means False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    width: int
    dtype: torch.dtype


class CausalLM(Protocol):
    vocab_size: int
    max_position_embeddings: int
    kv_cache_spec: KVCacheSpec
    fingerprint: str  # stable hash of config + weights identity; salts prefix-cache keys

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, num_blocks, block_size, width]
    ) -> torch.Tensor:  # hidden states [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        ...
