"""The `KernelSet`s of Triton kernels on CUDA: `fast_kernels(base)` (the default) and
`triton_kernels(base)` (`--batch-invariant`), each `base` (the reference set, passed in by
kernels/registry.py) with the ops this backend has put in. Both are graph safe: decode steps
replay from CUDA graphs (engine/cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from deepserve.kernels.errors import KernelUnavailableError
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.triton import (
    attention,
    fp8_gemv,
    fp8_matmul,
    fused_moe,
    hyper_connections,
    matmul,
    mla,
    rope,
    routing,
    rows,
    sparse_attention,
)
from deepserve.kernels.triton.decode_attention import (
    DecodeOrVarlen,
    InvariantPagedAttention,
    decode_attention,
)
from deepserve.kernels.triton.flash_prefill import flash_prefill
from deepserve.kernels.triton.lang import HAVE_TRITON


class FastPagedAttention(DecodeOrVarlen):
    """Decode-only steps through the graph-safe decode kernel, the rest (prefill, chunks mixed
    with decodes) through the varlen kernel of attention.py."""

    def __init__(self) -> None:
        # 32 query rows per program, not the invariant set's 16: V2-Lite's 2,000-token prefill
        # attention took 1.13 ms a layer against 1.21 (H200, run-kern-1)
        super().__init__(decode_attention, attention.TritonPagedAttention(block_m=32))


def _with_v4_ops(kernels: KernelSet) -> KernelSet:
    """`kernels` with DeepSeek-V4's batched ops (V4SPEC.md) where the set has their fields: a
    set without `sparse_attention` still has the per-sequence `indexer_topk` of another
    signature, which these ops must not replace."""
    if not hasattr(kernels, "sparse_attention"):
        return kernels
    ops = {
        "sparse_attention": sparse_attention.sparse_attention,
        "indexer_topk": sparse_attention.indexer_topk,
        "compress_pool": sparse_attention.compress_pool,
        # a program per token (and block of columns), streams summed in order: invariant too
        "hc_mixes": hyper_connections.hc_mixes,  # K runs fixed by the weight, summed in order
        "hc_collapse": hyper_connections.hc_collapse,
        "hc_expand": hyper_connections.hc_expand,
        "hc_head": hyper_connections.hc_head,
        "rope_interleaved": rope.rope_interleaved,  # per (token, head), bitwise torch's ops
    }
    return replace(kernels, **{name: op for name, op in ops.items() if hasattr(kernels, name)})


def fast_kernels(base: KernelSet) -> KernelSet | None:
    """cuBLAS matmuls (one row of the largest weights streamed by fp8_gemv.py), Triton norms,
    attention (MLA's long prefill chunks decompressed, on flash_prefill.py) and fused MoE,
    `base`'s softmaxes; None without Triton."""
    if not HAVE_TRITON:
        return None
    fast = replace(
        base,
        name="cuda_fast",
        # FP8 weights: tiles by M; one row of the largest plain weights streamed (fp8_gemv)
        linear=fp8_matmul.linear_or(fp8_gemv.streaming_linear_or(F.linear)),
        rms_norm=rows.rms_norm,
        bmm=torch.matmul,
        paged_attention=FastPagedAttention(),
        moe=fused_moe.fused_moe,
        mla_kv_write_=mla.kv_write_,
        rope_into_=mla.rope_into_,
        absorbed_query_=mla.absorbed_query_,
        rope_qk_write_kv_=rope.rope_qk_write_kv_,
        add_rms_norm_=rows.add_rms_norm_,  # row-per-program and elementwise: invariant too
        silu_mul=rows.silu_mul,
        moe_route=routing.route,
        graph_safe=True,
        fp8_weights=True,
        grouped_linear=fp8_matmul.grouped_linear_or_none(),
        flash_prefill=flash_prefill,
    )
    return _with_v4_ops(fast)


def triton_kernels(base: KernelSet) -> KernelSet:
    """Every reduction in a Triton kernel of one fixed tile configuration per op."""
    if not HAVE_TRITON:
        raise KernelUnavailableError("--batch-invariant on a CUDA device needs the triton package")
    invariant = replace(
        base,
        name="batch_invariant_triton",
        linear=fp8_matmul.linear_or(matmul.linear, batch_invariant=True),
        rms_norm=rows.rms_norm,
        softmax=rows.softmax,
        log_softmax=rows.log_softmax,
        bmm=matmul.bmm,
        paged_attention=InvariantPagedAttention(),  # decode steps: heads share a KV read
        sigmoid=torch.sigmoid,  # CUDA elementwise ops compute every element the same way
        moe=partial(fused_moe.fused_moe, configs=fused_moe.invariant_config),  # K steps fixed
        mla_kv_write_=mla.kv_write_,
        rope_into_=mla.rope_into_,
        absorbed_query_=mla.absorbed_query_,
        rope_qk_write_kv_=rope.rope_qk_write_kv_,  # per token, bitwise torch's ops: invariant
        add_rms_norm_=rows.add_rms_norm_,  # row-per-program and elementwise: invariant too
        silu_mul=rows.silu_mul,
        moe_route=routing.route,
        graph_safe=True,
        fp8_weights=True,
        grouped_linear=fp8_matmul.grouped_linear_or_none(batch_invariant=True),
        # MLA's prompt rows in the decompressed form at every chunk length, generated rows
        # absorbed: a row's form follows its role, so the chunking cannot change its bits
        flash_prefill=flash_prefill,
        flash_prefill_by_role=True,
    )
    return _with_v4_ops(invariant)  # fixed splits and tiles: invariant by construction
