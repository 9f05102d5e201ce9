"""deepserve's native CPU ops (kernels/cpu/csrc/) as Python calls, each with the check of
whether it covers a call: an op returns None (False for an in-place write) where it does not, and
the KernelSet that uses it (kernels/cpu/kernelset.py) then runs its fallback set's op (GPU
tensors, dtypes or shapes a kernel does not take, a machine where the native build is
unavailable).

Each op keeps its reference's contract and numerics (float32 within ~1e-5, accumulation in
float32; bfloat16 rows with the reference's roundings to bfloat16, float32 math in between), and
computes every row from that row's own inputs alone, so a token's result never depends on the
rest of the batch. What does not live here: the kernels themselves
(kernels/cpu/csrc/), the build (native.py), the packed linear (packed.py), and the torch oracles
(kernels/reference/).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu.packed import ONEDNN_MIN_ROWS, QUANT_MAX_ROWS, PackedWeight

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native(x: torch.Tensor) -> bool:
    """True when `x` lives on the CPU and the native kernels are loaded."""
    return x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES and cpu_native.load()


def native_attention_covers(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int
) -> bool:
    """Whether the native attention takes these tensors: a question of the model and its cache
    (dtypes, head sizes, layout), never of the batch."""
    return (
        native(q)
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in _NATIVE_DTYPES
        and k_cache.shape[-1] % 8 == 0
        and v_cache.shape[-1] % 8 == 0
        and k_cache.stride(-1) == v_cache.stride(-1) == 1
        and block_size <= 64
    )


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """kernels/reference/attention.py's `paged_attention`, natively (kernels/cpu/csrc/attention.cpp)
    for float32/bfloat16 caches with head sizes a multiple of 8 (decode, prefill and mixed batches
    alike); call only where `native_attention_covers` holds."""
    return cpu_native.op("paged_attention")(
        q, k_cache, v_cache, attn.query_start_loc, attn.seq_lens, attn.block_tables, scale
    )


def _rows(*xs: torch.Tensor) -> bool:
    """Contiguous float32 rows, or contiguous bfloat16 rows, all of one dtype, natively."""
    dtype = xs[0].dtype
    for x in xs:  # a plain loop: this runs several hundred times per decode step
        if x.dtype != dtype or not x.is_contiguous():
            return False
    return native(xs[0])


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of 2-D logits (the first maximum, NaN counting as the maximum),
    natively for float32 CPU rows: torch's CPU argmax is scalar, ~9x slower on a vocabulary."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[1] and native(x):
        return cpu_native.op("argmax_rows")(x)
    return x.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of float32 or bfloat16 rows (and a weight of their dtype) natively, or None when
    the caller should use torch's."""
    if not _rows(x, weight):
        return None
    return cpu_native.op("rms_norm")(x, weight, eps)


def add_rms_norm_(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """`h += delta` in place and RMSNorm of the result in one pass, or None (h untouched) when
    the caller should use torch's ops."""
    if not (_rows(h, weight) and delta.dtype == h.dtype and delta.shape == h.shape):
        return None
    return cpu_native.op("add_rms_norm_")(h, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor | None:
    """silu(gate) * up for `gate_up = [gate | up]`, or None for torch's ops (also for a clamped
    SwiGLU's `limit`, which the native op does not apply)."""
    if limit or not _rows(gate_up):
        return None
    return cpu_native.op("silu_mul")(gate_up)


def rope_qk_write_kv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> bool:
    """Rotate the q and k heads of `qkv [T, (Hq + 2 Hkv) * D]` in place (cos/sin `[T, 1, D/2]`)
    and store k and v at `slot_mapping` in the caches `[blocks, block_size, Hkv, D]` (float32, or
    bfloat16 with bfloat16 tables and caches); False (and nothing done) when the caller should
    use torch's ops."""
    ok = (
        _rows(qkv, cos, sin)
        and k_cache.dtype == v_cache.dtype == qkv.dtype
        and k_cache.stride(-1) == v_cache.stride(-1) == 1
    )
    if ok:
        tokens, hkv = qkv.shape[0], k_cache.shape[2]
        cos, sin = cos.view(tokens, -1), sin.view(tokens, -1)
        cpu_native.op("rope_qk_write_kv_")(
            qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, hkv
        )
    return ok


@dataclass(frozen=True)
class FusedLayer:
    """A llama layer's four matmuls as `llama_layer_` takes them."""

    weights: list[torch.Tensor]  # panels and quantized blocks (or empty), matmul by matmul
    formats: list[int]
    out_features: list[int]
    max_rows: int  # steps of more rows run op by op (their linears take oneDNN's copies)


def pack_llama_layer(matmuls: list) -> FusedLayer | None:
    """A llama layer's qkv, o, gate_up and down `PackedWeight`s as `llama_layer_`'s flat
    arguments, or None when one of them is not packed, or their panels are not all float32 or
    all bfloat16 (the layer then runs op by op)."""
    if not all(isinstance(w, PackedWeight) for w in matmuls):
        return None
    dtypes = {w.panels.dtype for w in matmuls}
    if dtypes not in ({torch.float32}, {torch.bfloat16}):
        return None
    none = torch.empty(0, dtype=torch.uint8)
    weights = [t for w in matmuls for t in (w.panels, none if w.quant is None else w.quant)]
    vendor = any(w.onednn is not None for w in matmuls)
    if any(w.onednn_chunk for w in matmuls):
        max_rows = 0  # every call of these weights goes through oneDNN (the invariant set's)
    else:
        max_rows = ONEDNN_MIN_ROWS - 1 if vendor else sys.maxsize
    return FusedLayer(
        weights, [w.quant_format for w in matmuls], [w.out_features for w in matmuls], max_rows
    )


def llama_layer_(
    packed: FusedLayer,
    h: torch.Tensor,
    x: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    attn: AttentionMetadata,
    num_heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor | None:
    """A whole llama decoder layer in one native call (kernels/cpu/csrc/llama_layer.cpp): the same
    ops in the same order as engine/models/llama.py runs them one by one, so the same bits. `h`
    is updated in place; returns the next layer's normed input, or None (nothing done) when
    one of the ops would not run natively, or the step has more rows than the layer's
    `max_rows`."""
    k_cache, v_cache = caches
    usable = (
        x.shape[0] <= packed.max_rows
        and _rows(h, x, norms[0], norms[1], rope[0], rope[1])
        and packed.weights[0].dtype == k_cache.dtype == v_cache.dtype == h.dtype
        and k_cache.shape[-1] % 8 == 0
        and k_cache.stride(-1) == v_cache.stride(-1) == 1
        and attn.block_size <= 64
    )
    if not usable:
        return None
    tokens = x.shape[0]
    cos, sin = rope[0].view(tokens, -1), rope[1].view(tokens, -1)
    return cpu_native.op("llama_layer_")(
        h, x, packed.weights, packed.formats, packed.out_features, norms[0], norms[1], cos, sin,
        k_cache, v_cache,
        attn.slot_mapping, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        num_heads, k_cache.shape[2], eps, scale, QUANT_MAX_ROWS,
    )  # fmt: skip
