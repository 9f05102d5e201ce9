"""Causal self-attention over one sequence's own tokens (no KV cache read), through torch's SDPA.

MLA runs fresh prompts in this form (engine/models/deepseek_v3.py): keys and values decompressed per
head, ordinary causal multi-head attention with query/key head dim 192 and value head dim 128 on the
V2/V3 shapes. SDPA's flash kernels (CUDA and CPU) take it only with one head dim for q, k and v
(else SDPA falls back to its math path, which builds the whole [T, T] score matrix), so the values
are zero-padded to the key width and the output sliced back: the padded columns add nothing to the
kept ones. On CUDA, `covers` says which shapes reach the flash kernel, and the model keeps its
absorbed paged path for the rest; the CPU's flash kernel takes float32 and bfloat16 at any head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# FlashAttention-2 (torch's flash backend) limits
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class CausalAttention:
    """`attn(q, k, v, scale)`: q, k `[T, H, Dqk]`, v `[T, H, Dv]` (strided views are fine) ->
    `[T, H, Dv]`, row t attending to rows 0..t."""

    flash: bool  # CUDA: take only the shapes and dtypes its flash kernel does

    def covers(self, qk_dim: int, v_dim: int, dtype: torch.dtype) -> bool:
        if not self.flash:
            return True
        return dtype in _FLASH_DTYPES and v_dim <= qk_dim <= _FLASH_MAX_HEAD_DIM and qk_dim % 8 == 0

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        v_dim = v.shape[-1]
        if v_dim < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        # SDPA's fused kernels take [B, H, T, D]; these are views, no copies
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale,
        )  # fmt: skip
        return out[0, ..., :v_dim].transpose(0, 1)


CPU = CausalAttention(flash=False)
CUDA = CausalAttention(flash=True)
