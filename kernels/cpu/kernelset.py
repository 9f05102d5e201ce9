"""The KernelSets of the native CPU ops (kernels/cpu/csrc/), each over a fallback set whose ops
run the calls a native op does not take (kernels/registry.py passes the fallbacks in, so this
backend imports no other):

- `native_kernels(fallback)`: the default CPU set, over the reference set; on CPUs with AMX its
  bfloat16 linears take oneDNN's GEMM from a few rows up (kernels/cpu/packed.py) and long bf16
  query runs torch's SDPA (kernels/cpu/sdpa_prefill.py).
- `native_invariant_kernels(torch_set)`: the `--batch-invariant` CPU set, over the torch
  invariant set (kernels/reference/invariant.py, the oracle these ops are tested against, and
  the whole flag's set where the native kernels are unavailable). On CPUs with AMX its bf16
  linears run oneDNN's GEMM in calls of at most 32 rows, where a probe of each weight finds
  every such call gives a row its one-row bits (kernels/cpu/packed.py).

The native ops are batch invariant by construction: the linear computes each output as one FMA
chain over `in` in order whatever the row count (float32, bfloat16 and quantized panels alike),
attention walks a sequence's keys block by block from position 0 whatever else is in the step,
and norms and activations reduce each row on its own. What the invariant set adds is that the
choice between a native op and its torch fallback depends only on the model (dtypes, head sizes,
whether a weight is packed), never on the batch: an op that would take a native kernel only for
contiguous inputs is given contiguous inputs, because the contiguity of a slice can change with
the number of rows (a one-row slice is always contiguous), and the fallback rounds differently.
The invariant set records each call it hands to torch, its own ops' and those it takes as they
are from the torch set (`KernelSet.torch_calls`): native ops give the same bits on any thread
count, torch's only at the one count they are checked at, so the engine may change the count
between steps only while nothing is recorded (engine/threads.py).
What does not live here: the kernels (kernels/cpu/csrc/) and their Python calls (ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu import ops as cpu_ops
from deepserve.kernels.cpu import packed, sdpa_prefill
from deepserve.kernels.kernel_set import KernelSet, TorchCalls

Tensor = torch.Tensor


class NativeOps:
    """The default set's ops: the native op where it covers the call, else `fallback`'s op;
    with `vendor` (a CPU with AMX), bf16 prefill runs through torch's SDPA (sdpa_prefill.py)."""

    def __init__(self, fallback: KernelSet, vendor: bool) -> None:
        self.fallback = fallback
        self.vendor = vendor

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = cpu_ops.rms_norm(x, weight, eps)
        return out if out is not None else self.fallback.rms_norm(x, weight, eps)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata, scale: float
    ) -> Tensor:
        if not cpu_ops.native_attention_covers(q, k_cache, v_cache, attn.block_size):
            return self.fallback.paged_attention(q, k_cache, v_cache, attn, scale)
        if self.vendor and sdpa_prefill.covers(q, k_cache, v_cache):
            native = cpu_ops.native_paged_attention
            return sdpa_prefill.paged_attention(q, k_cache, v_cache, attn, scale, native)
        return cpu_ops.native_paged_attention(q, k_cache, v_cache, attn, scale)


def native_kernels(fallback: KernelSet) -> KernelSet:
    """The default CPU set: native ops where they cover a call (each op checks, per call, that
    the tensors are on the CPU and the library loaded), `fallback`'s elsewhere."""
    # where oneDNN's bf16 GEMM and torch's SDPA are faster (AMX), bf16 prefill takes them
    vendor = packed.vendor_gemm_faster()
    ops = NativeOps(fallback, vendor)
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
        pack_weight=partial(packed.pack_linear_weight, onednn=vendor),
        pack_llama_layer=cpu_ops.pack_llama_layer,
        llama_layer_=cpu_ops.llama_layer_,
    )


def _native_dtype(*xs: Tensor) -> bool:
    """All float32 or all bfloat16 (the native elementwise ops' dtypes), on the CPU."""
    dtype = xs[0].dtype
    return all(x.dtype == dtype for x in xs) and cpu_ops.native(xs[0])


class NativeInvariantOps:
    """Each op: the native kernel where the model's tensors allow it, else `torch_set`'s op, the
    call recorded in `calls` (a None or False return, which sends the caller to torch, too)."""

    def __init__(self, torch_set: KernelSet) -> None:
        self.torch_set = torch_set
        self.calls = TorchCalls()

    def _torch(self, op: str) -> Callable:
        self.calls.record(op)
        return getattr(self.torch_set, op)

    def linear(self, x: Tensor, w: Tensor | packed.PackedWeight) -> Tensor:
        if isinstance(w, packed.PackedWeight):  # oneDNN's calls too: probed at every count
            return packed.linear(x, w)
        return self._torch("linear")(x, w)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not _native_dtype(x, weight):
            return self._torch("rms_norm")(x, weight, eps)
        return cpu_native.op("rms_norm")(x.contiguous(), weight.contiguous(), eps)

    def add_rms_norm_(self, h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor | None:
        # None (h not contiguous, so not updatable in place) sends the caller to `h + delta` then
        # `rms_norm`: the same additions and the same native norm, so the same bits.
        if not _native_dtype(h, delta, weight):
            self.calls.record("add_rms_norm_")
            return None
        return cpu_ops.add_rms_norm_(h, delta, weight.contiguous(), eps)

    def silu_mul(self, gate_up: Tensor, limit: float | None = None) -> Tensor | None:
        if limit or not _native_dtype(gate_up):  # the native op has no clamp
            self.calls.record("silu_mul")
            return None
        return cpu_native.op("silu_mul")(gate_up.contiguous())

    def rope_qk_write_kv_(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        num_heads: int,
    ) -> bool:
        # rotated in place: the models hand a fresh linear output, so a contiguous one
        done = qkv.is_contiguous() and cpu_ops.rope_qk_write_kv_(
            qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping, num_heads
        )
        if not done:
            self.calls.record("rope_qk_write_kv_")
        return done

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata, scale: float
    ) -> Tensor:
        if cpu_ops.native_attention_covers(q, k_cache, v_cache, attn.block_size):
            return cpu_ops.native_paged_attention(q, k_cache, v_cache, attn, scale)
        return self._torch("paged_attention")(q, k_cache, v_cache, attn, scale)

    def recorded(self, op: str) -> Callable:
        """`torch_set`'s op, each call recorded."""

        def call(*args, **kwargs):
            return self._torch(op)(*args, **kwargs)

        return call


def native_invariant_kernels(torch_set: KernelSet) -> KernelSet:
    """The flag's CPU set over the native kernels, `torch_set`'s ops (recorded) for the calls they
    do not take; call `cpu_native.load()` first."""
    ops = NativeInvariantOps(torch_set)
    native = dict(
        linear=ops.linear,
        rms_norm=ops.rms_norm,
        paged_attention=ops.paged_attention,
        argmax=cpu_ops.argmax,  # each row's first maximum, whatever the batch
        add_rms_norm_=ops.add_rms_norm_,
        silu_mul=ops.silu_mul,
        rope_qk_write_kv_=ops.rope_qk_write_kv_,
        # on AMX, bf16 weights keep oneDNN's copy where its small calls are row invariant
        pack_weight=partial(
            packed.pack_linear_weight,
            onednn=packed.vendor_gemm_faster(),
            onednn_chunk=packed.ONEDNN_INVARIANT_ROWS,
        ),
        pack_llama_layer=cpu_ops.pack_llama_layer,
        llama_layer_=cpu_ops.llama_layer_,  # None: the layer runs op by op, through the above
    )
    torch_ops = {
        f.name: ops.recorded(f.name)
        for f in fields(torch_set)
        if f.name not in native and callable(getattr(torch_set, f.name))
    }
    return replace(
        torch_set,
        name="batch_invariant_cpu_native",
        torch_calls=ops.calls,
        **native,
        **torch_ops,
    )
