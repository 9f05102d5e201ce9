"""The KernelSets of the native CPU ops (kernels/cpu/csrc/), each over a fallback set whose ops
run the calls a native op does not take (kernels/registry.py passes the fallbacks in, so this
backend imports no other):

- `native_kernels(fallback)`: the default CPU set, over the reference set.
- `native_invariant_kernels(torch_set)`: the `--batch-invariant` CPU set, over the torch
  invariant set (kernels/reference/invariant.py, the oracle these ops are tested against, and
  the whole flag's set where the native kernels are unavailable).

The native ops are batch invariant by construction: the linear computes each output as one FMA
chain over `in` in order whatever the row count (float32, bfloat16 and quantized panels alike),
attention walks a sequence's keys block by block from position 0 whatever else is in the step,
and norms and activations reduce each row on its own. What the invariant set adds is that the
choice between a native op and its torch fallback depends only on the model (dtypes, head sizes,
whether a weight is packed), never on the batch: an op that would take a native kernel only for
contiguous inputs is given contiguous inputs, because the contiguity of a slice can change with
the number of rows (a one-row slice is always contiguous), and the fallback rounds differently.
What does not live here: the kernels (kernels/cpu/csrc/) and their Python calls (ops.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu import ops as cpu_ops
from deepserve.kernels.cpu import packed
from deepserve.kernels.kernel_set import KernelSet

Tensor = torch.Tensor


class NativeOps:
    """The default set's ops: the native op where it covers the call, else `fallback`'s op."""

    def __init__(self, fallback: KernelSet) -> None:
        self.fallback = fallback

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = cpu_ops.rms_norm(x, weight, eps)
        return out if out is not None else self.fallback.rms_norm(x, weight, eps)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata, scale: float
    ) -> Tensor:
        if cpu_ops.native_attention_covers(q, k_cache, v_cache, attn.block_size):
            return cpu_ops.native_paged_attention(q, k_cache, v_cache, attn, scale)
        return self.fallback.paged_attention(q, k_cache, v_cache, attn, scale)


def native_kernels(fallback: KernelSet) -> KernelSet:
    """The default CPU set: native ops where they cover a call (each op checks, per call, that
    the tensors are on the CPU and the library loaded), `fallback`'s elsewhere."""
    ops = NativeOps(fallback)
    return replace(
        fallback,
        name="cpu_native",
        linear=packed.linear,
        rms_norm=ops.rms_norm,
        paged_attention=ops.paged_attention,
        argmax=cpu_ops.argmax,
        add_rms_norm_=cpu_ops.add_rms_norm_,
        silu_mul=cpu_ops.silu_mul,
        rope_qk_write_kv_=cpu_ops.rope_qk_write_kv_,
        pack_weight=packed.pack_linear_weight,
        pack_llama_layer=cpu_ops.pack_llama_layer,
        llama_layer_=cpu_ops.llama_layer_,
    )


def _native_dtype(*xs: Tensor) -> bool:
    """All float32 or all bfloat16 (the native elementwise ops' dtypes), on the CPU."""
    dtype = xs[0].dtype
    return all(x.dtype == dtype for x in xs) and cpu_ops.native(xs[0])


class NativeInvariantOps:
    """Each op: the native kernel where the model's tensors allow it, else `torch_set`'s op."""

    def __init__(self, torch_set: KernelSet) -> None:
        self.torch_set = torch_set

    def linear(self, x: Tensor, w: Tensor | packed.PackedWeight) -> Tensor:
        if isinstance(w, packed.PackedWeight):
            return packed.linear(x, w)
        return self.torch_set.linear(x, w)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not _native_dtype(x, weight):
            return self.torch_set.rms_norm(x, weight, eps)
        return cpu_native.op("rms_norm")(x.contiguous(), weight.contiguous(), eps)

    @staticmethod
    def add_rms_norm_(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor | None:
        # None (h not contiguous, so not updatable in place) sends the caller to `h + delta` then
        # `rms_norm`: the same additions and the same native norm, so the same bits.
        if not _native_dtype(h, delta, weight):
            return None
        return cpu_ops.add_rms_norm_(h, delta, weight.contiguous(), eps)

    @staticmethod
    def silu_mul(gate_up: Tensor, limit: float | None = None) -> Tensor | None:
        if limit or not _native_dtype(gate_up):  # the native op has no clamp
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


def native_invariant_kernels(torch_set: KernelSet) -> KernelSet:
    """The flag's CPU set over the native kernels, `torch_set`'s ops for the calls they do not
    take; call `cpu_native.load()` first."""
    ops = NativeInvariantOps(torch_set)
    return replace(
        torch_set,
        name="batch_invariant_cpu_native",
        linear=ops.linear,
        rms_norm=ops.rms_norm,
        paged_attention=ops.paged_attention,
        argmax=cpu_ops.argmax,  # each row's first maximum, whatever the batch
        add_rms_norm_=ops.add_rms_norm_,
        silu_mul=ops.silu_mul,
        rope_qk_write_kv_=ops.rope_qk_write_kv_,
        pack_weight=packed.pack_linear_weight,
        pack_llama_layer=cpu_ops.pack_llama_layer,
        llama_layer_=cpu_ops.llama_layer_,
    )
