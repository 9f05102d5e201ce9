"""The native CPU linear's weights: `PackedWeight` (a `[out, in]` matrix packed once into the
kernel's panels, with a GGUF checkpoint's own quantized blocks where it has them),
`pack_linear_weight` (the CPU sets' `pack_weight`) and `linear` (their `linear`: the native
kernel for a packed weight, F.linear for a plain one).

What does not live here: the kernel (kernels/cpu/csrc/linear.cpp), the GGUF block layout
(kernels/quant_panels.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import native
from deepserve.kernels.quant_panels import FORMATS, QuantizedMatrix, pack_quant_panels

PANEL = 16  # output columns per panel of the native CPU linear (kernels/cpu/csrc/linear.cpp)
# Rows up to which a quantized weight's own blocks beat its float32 panels (benchmarks/linear_cpu.py
# --quant: faster at 1-4 rows, even around 5-8, slower beyond)
QUANT_MAX_ROWS = 4
# Rows from which a bfloat16 call takes oneDNN's GEMM where the weight keeps oneDNN's copy
# (`PackedWeight.onednn`). On a 2-core Xeon with AMX (benchmarks/prefill_linear_cpu.py, 1 thread,
# CPU time, SmolLM2's 576->1536) oneDNN's packed bf16 GEMM ran 191 GFLOP/s at 8 rows against the
# native kernel's best path's 134, 713 vs 126 at 64, 1,108 vs 134 at 256; level at 4 rows, 31
# vs 48 at one: decode stays native.
ONEDNN_MIN_ROWS = 8
# Under `--batch-invariant`: the most rows of a oneDNN bf16 call whose kernel gives a row the bits
# it gets alone. On the AMX Xeon every call of 1 to 32 rows did, from ~40 rows on the blocking
# changes (RESULTS.md, session 21); `pack_linear_weight` probes each weight before relying on it.
ONEDNN_INVARIANT_ROWS = 32


@dataclass(frozen=True)
class PackedWeight:
    """A CPU linear weight `[out, in]` packed once for the native kernel (kernels/cpu/csrc/linear.cpp):
    panels of 16 output columns, `[ceil(out / 16), in, 16]`, in the weight's own dtype (bfloat16
    widens to float32 in registers). One copy serves every row count, in the same memory as the
    plain weight.

    Measured on this 2-core AVX2 EPYC, weights streamed from DRAM (benchmarks/linear_cpu.py),
    against the layouts it replaced (a transposed copy for one row, oneDNN's packed copy for two
    and up): one row streams at 30-40 GB/s vs 13-20; 16 rows run at 90-115 GFLOP/s vs 60-90;
    up to 256 rows it is as fast or faster, at 512 rows (long prefills) oneDNN is ~10-15% ahead.
    Each output is one FMA chain over `in` in order whatever the row count, so a row's result is
    bitwise the same alone, in any batch, in prefill or in decode.

    A GGUF-quantized weight also keeps its blocks regrouped into panels (`quant`,
    kernels/quant_panels.py) for calls of at most `QUANT_MAX_ROWS` rows: the same values
    dequantized in registers, 6-8x fewer bytes to stream, which is what a decode step of a few
    rows waits on. More rows are bound by multiply-adds, where dequantizing again for every
    call costs more than it saves, so they read the float32 panels.

    A bfloat16 weight on a CPU with AMX tiles may also keep oneDNN's packed copy (`onednn`,
    the default set's choice: `vendor_gemm_faster`) for calls of `ONEDNN_MIN_ROWS` rows and up,
    where AMX runs several times the native kernel's rate; twice the weight's memory, and those
    rows' bits then depend on the row count (oneDNN picks kernels by shape). The
    `--batch-invariant` set keeps one only where every call of at most `onednn_chunk` rows gives
    a row its one-row bits (probed per weight), and then sends every bf16 call through it in
    calls of at most that many rows, the native kernel never (its bits are another function's)."""

    panels: torch.Tensor
    out_features: int
    quant: torch.Tensor | None = None  # uint8 [panels, in / 32, block bytes]
    quant_format: int = -1  # kernels/quant_panels.py's FORMATS value, with `quant`
    onednn: torch.Tensor | None = None  # oneDNN's packed bf16 copy (mkldnn reorder)
    # > 0: every bf16 call goes through `onednn`, in calls of at most this many rows
    onednn_chunk: int = 0

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x[..., in] @ w[out, in].T; `w` may come from `pack_linear_weight`."""
    if not isinstance(w, PackedWeight):
        return F.linear(x, w)
    if x.dim() == 2 and x.dtype == torch.float32:  # the models' flattened rows, as they are
        return _packed_linear(x, w)
    # bfloat16 rows widen exactly to float32 (in the kernel, which on AVX512-BF16 multiplies
    # them as they are against bfloat16 panels) and round once at the end, like a bf16 GEMM
    # that accumulates in float32: in the kernel too (`linear_bf16`), which on AVX512-BF16 then
    # writes no float32 output at all.
    rows = x.reshape(-1, x.shape[-1])
    onednn = w.onednn is not None and rows.dtype == torch.bfloat16
    if onednn and (w.onednn_chunk or rows.shape[0] >= ONEDNN_MIN_ROWS):
        y = _onednn_in_chunks(rows, w.onednn, w.onednn_chunk)
        return y.view(*x.shape[:-1], w.out_features)
    if rows.dtype == torch.bfloat16 and w.quant is None:
        y = native.op("linear_bf16")(rows, w.panels, w.out_features)
        return y.view(*x.shape[:-1], w.out_features)
    if rows.dtype != torch.float32:
        rows = rows.float()
    y = _packed_linear(rows, w)
    y = y.view(*x.shape[:-1], w.out_features)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _onednn_linear(rows: torch.Tensor, onednn: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), onednn, None, "none", [], "")


def _onednn_in_chunks(rows: torch.Tensor, onednn: torch.Tensor, chunk: int) -> torch.Tensor:
    """Calls of at most `chunk` rows (0: one call)."""
    if not chunk or rows.shape[0] <= chunk:
        return _onednn_linear(rows, onednn)
    return torch.cat([_onednn_linear(part, onednn) for part in rows.split(chunk)])


def onednn_rows_invariant(w: torch.Tensor, onednn: torch.Tensor, chunk: int) -> bool:
    """Whether every oneDNN call of at most `chunk` rows against this bf16 weight gives each row
    the bits of its one-row call: several counts and positions, on one thread and on every core
    the process owns (the engine changes the count with the host's load, engine/threads.py)."""
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(chunk + 3, w.shape[1], generator=gen).to(torch.bfloat16)
    alone = torch.cat([_onednn_linear(x[i : i + 1], onednn) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in dict.fromkeys((threads, 1, len(os.sched_getaffinity(0)))):
            torch.set_num_threads(count)
            for start, rows in ((0, chunk), (3, chunk), (1, 2), (2, 5), (5, chunk // 2 + 1)):
                got = _onednn_linear(x[start : start + rows], onednn)
                if not torch.equal(got, alone[start : start + rows]):
                    return False
    finally:
        torch.set_num_threads(threads)
    return True


def _packed_linear(rows: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if w.quant is not None and rows.shape[0] <= QUANT_MAX_ROWS:
        return native.op("linear_quant")(rows, w.quant, w.out_features, w.quant_format)
    return native.op("linear")(rows, w.panels, w.out_features)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """`w[out, in]` as the native linear's panels `[ceil(out / 16), in, 16]`, same dtype; the last
    panel's missing columns are zeros."""
    out, inp = w.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, inp, dtype=w.dtype)
    padded[:out] = w
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


def vendor_gemm_faster() -> bool:
    """True where oneDNN's bfloat16 GEMM beats the native kernel from `ONEDNN_MIN_ROWS` rows:
    CPUs with AMX tiles (on AVX512-BF16 without AMX, a Zen 5 EPYC, they ran level: RESULTS.md,
    issue 32)."""
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    return torch.backends.mkldnn.is_available() and bool(capabilities.get("amx_bf16"))


def pack_linear_weight(
    w: torch.Tensor,
    quantized: QuantizedMatrix | None = None,
    onednn: bool = False,
    onednn_chunk: int = 0,
) -> torch.Tensor | PackedWeight:
    """`w` as a `PackedWeight` where the native kernel applies (a CPU float32 or bfloat16 matrix
    and the kernels built, see kernels/cpu/native.py), else `w` itself (F.linear then).
    `quantized` is the checkpoint's own blocks for `w` (its exact dequantization): a float32 `w`
    keeps them too, for few-row calls. Lower precisions round the dequantized values, so they
    use `w` alone. `onednn`: a bfloat16 `w` also keeps oneDNN's packed copy (`PackedWeight`);
    with `onednn_chunk`, only where `onednn_rows_invariant` holds for it, used for every call."""
    usable = w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.float32, torch.bfloat16)
    if not usable or not native.load():
        return w
    packed = PackedWeight(panels=pack_panels(w), out_features=w.shape[0])
    if onednn and w.dtype == torch.bfloat16:
        copy = torch.ops.mkldnn._reorder_linear_weight(w, None)
        if not onednn_chunk or onednn_rows_invariant(w, copy, onednn_chunk):
            packed = replace(packed, onednn=copy, onednn_chunk=onednn_chunk)
    if quantized is None or w.dtype != torch.float32:
        return packed
    if (quantized.out_features, quantized.in_features) != tuple(w.shape):
        raise ValueError(f"quantized blocks {quantized.rows.shape} for a {tuple(w.shape)} weight")
    return replace(
        packed, quant=pack_quant_panels(quantized), quant_format=FORMATS[quantized.format]
    )
