"""The `--batch-invariant` KernelSet on a CPU with the native kernels built: deepserve's native
ops (kernels/csrc/) for every call they can take, the torch ops of kernels/batch_invariant.py for
the rest.

The native ops are batch invariant by construction: the linear computes each output as one FMA
chain over `in` in order whatever the row count (float32, bfloat16 and quantized panels alike),
attention walks a sequence's keys block by block from position 0 whatever else is in the step,
and norms and activations reduce each row on its own. What this module adds is that the choice
between a native op and its torch fallback depends only on the model (dtypes, head sizes,
whether a weight is packed), never on the batch: an op that would take a native kernel only for
contiguous inputs is given contiguous inputs, because the contiguity of a slice can change with
the number of rows (a one-row slice is always contiguous), and the fallback rounds differently.

The torch set (kernels/batch_invariant.py) stays the oracle the tests compare these ops with, and
the whole flag's set where the native kernels are unavailable. What does not live here: the
kernels (kernels/csrc/), their default-mode wrappers (kernels/cpu_ops.py).
"""

from __future__ import annotations

import torch

from deepserve.kernels import cpu_native, cpu_ops, reference
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.kernel_set import KernelSet

Tensor = torch.Tensor


def _float32(*xs: Tensor) -> bool:
    return all(x.dtype == torch.float32 for x in xs) and cpu_ops.native(xs[0])


class NativeInvariantOps:
    """Each op: the native kernel where the model's tensors allow it, else `torch_set`'s op."""

    def __init__(self, torch_set: KernelSet) -> None:
        self.torch_set = torch_set

    def linear(self, x: Tensor, w: Tensor | reference.PackedWeight) -> Tensor:
        if isinstance(w, reference.PackedWeight):
            return reference.linear(x, w)
        return self.torch_set.linear(x, w)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not _float32(x, weight):
            return self.torch_set.rms_norm(x, weight, eps)
        return cpu_native.op("rms_norm")(x.contiguous(), weight.contiguous(), eps)

    @staticmethod
    def add_rms_norm_(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor | None:
        # None (h not contiguous, so not updatable in place) sends the caller to `h + delta` then
        # `rms_norm`: the same additions and the same native norm, so the same bits.
        if not _float32(h, delta, weight):
            return None
        return cpu_ops.add_rms_norm_(h, delta, weight.contiguous(), eps)

    @staticmethod
    def silu_mul(gate_up: Tensor) -> Tensor | None:
        if not _float32(gate_up):
            return None
        return cpu_native.op("silu_mul")(gate_up.contiguous())

    @staticmethod
    def rope_qk_write_kv_(
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        num_heads: int,
    ) -> bool:
        if not qkv.is_contiguous():  # rotated in place: the models hand a fresh linear output
            return False
        return cpu_ops.rope_qk_write_kv_(
            qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping, num_heads
        )

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata, scale: float
    ) -> Tensor:
        if cpu_ops.native_attention_covers(q, k_cache, v_cache, attn.block_size):
            return cpu_ops.native_paged_attention(q, k_cache, v_cache, attn, scale)
        return self.torch_set.paged_attention(q, k_cache, v_cache, attn, scale)


def native_kernels() -> KernelSet:
    """The flag's CPU set over the native kernels; call `cpu_native.load()` first."""
    from deepserve.kernels import batch_invariant

    torch_set = batch_invariant.cpu_kernels()
    ops = NativeInvariantOps(torch_set)
    return KernelSet(
        name="batch_invariant_cpu_native",
        linear=ops.linear,
        rms_norm=ops.rms_norm,
        softmax=torch_set.softmax,
        log_softmax=torch_set.log_softmax,
        bmm=torch_set.bmm,
        paged_attention=ops.paged_attention,
        sigmoid=torch_set.sigmoid,
        add_rms_norm_=ops.add_rms_norm_,
        silu_mul=ops.silu_mul,
        rope_qk_write_kv_=ops.rope_qk_write_kv_,
        packed_weights=True,
    )
