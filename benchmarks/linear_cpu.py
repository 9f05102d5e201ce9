"""CPU linear micro-benchmark: the native panel kernel (kernels/cpu/csrc/linear.cpp) beside the torch
path it replaced (a transposed-copy GEMV at one row, oneDNN's pre-packed GEMM at two rows and up),
per SmolLM2 matmul shape and row count, in one run.

Each shape cycles through enough weight copies (>= `--stream-mb`, well past the 32 MB L3) that every
call reads its weight from DRAM, as a decode step does. Reported: ms per matmul (best of
`--rounds`), the weight bytes streamed per second, and GFLOP/s.

    flock /tmp/deepserve-bench.lock .venv/bin/python benchmarks/linear_cpu.py
    .venv/bin/python benchmarks/linear_cpu.py --shapes down lm_head --rows 1 16 --dtype bfloat16
    .venv/bin/python benchmarks/linear_cpu.py --quant Q4_1 --rows 1 2 4 8 16

`--quant FMT` times the native kernel on a GGUF-quantized weight's own blocks (kernels/quant_panels.py,
gguf's quantizer on the same random matrix) instead of its float32 panels, for every row count; the
GB/s columns then count the quantized bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from deepserve.kernels.cpu import native as cpu_native

SHAPES = {  # name: (out, in), SmolLM2-135M
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def native_pack(w: torch.Tensor) -> torch.Tensor:
    from deepserve.kernels.cpu.packed import pack_panels

    return pack_panels(w)


def baseline_fn(w: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The pre-native path: `x @ W^T` through a transposed copy at one row (a bf16 GEMV for bf16
    weights), oneDNN's packed float32 layout at two rows and up."""
    if rows == 1:
        one_row = w.t().contiguous() if w.dtype == torch.float32 else w.t()
        return lambda x: torch.matmul(x.to(w.dtype), one_row)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def native_fn(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    panels, n = native_pack(w), w.shape[0]
    op = cpu_native.ops().linear
    return lambda x: op(x, panels, n)


def quant_fn(w: torch.Tensor, fmt: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """The kernel on `w` quantized to `fmt` by gguf, reading the blocks at any row count; and the
    blocks' size in bytes."""
    from gguf import GGMLQuantizationType, quants

    from deepserve.kernels.quant_panels import FORMATS, QuantizedMatrix, pack_quant_panels

    raw = quants.quantize(w.float().numpy(), GGMLQuantizationType[fmt])
    rows = torch.from_numpy(raw).view(torch.uint8).reshape(w.shape[0], -1)
    blocks, n = pack_quant_panels(QuantizedMatrix(fmt, rows, w.shape[1])), w.shape[0]
    op = cpu_native.ops().linear_quant
    return (lambda x: op(x, blocks, n, FORMATS[fmt])), blocks.numel()


def time_per_call(fns: list[Callable], x: torch.Tensor, rounds: int) -> float:
    """Seconds per call, best round; one round calls every copy once (each from DRAM)."""
    for f in fns[:2]:
        f(x)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for f in fns:
            f(x)
        best = min(best, (time.perf_counter() - start) / len(fns))
    return best


def bench_shape(name: str, args, dtype: torch.dtype) -> list[str]:
    out, inp = SHAPES[name]
    nbytes = out * inp * torch.finfo(dtype).bits // 8
    copies = max(1, -(-args.stream_mb * 2**20 // nbytes))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, inp, generator=g) * 0.05).to(dtype) for _ in range(copies)]
    if args.quant:
        natives, sizes = zip(*(quant_fn(w, args.quant) for w in weights), strict=True)
        native_bytes = sizes[0]
    else:
        natives, native_bytes = [native_fn(w) for w in weights], nbytes
    lines, baselines = [], {}
    for rows in args.rows:
        x = torch.randn(rows, inp, generator=g)
        kind = min(rows, 2)  # the oneDNN copies serve every row count from two up
        if kind not in baselines:
            baselines[kind] = [baseline_fn(w, kind) for w in weights]
        base = baselines[kind]
        t_base = time_per_call(base, x, args.rounds)
        t_nat = time_per_call(natives, x, args.rounds)
        flops = 2 * rows * out * inp
        lines.append(
            f"| {name} {out}x{inp} | {rows} | {t_base * 1e3:.3f} | {t_nat * 1e3:.3f} | "
            f"{t_base / t_nat:.2f}x | {nbytes / t_base / 1e9:.1f} | {native_bytes / t_nat / 1e9:.1f} | "
            f"{flops / t_base / 1e9:.0f} | {flops / t_nat / 1e9:.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stream-mb", type=int, default=160, help="weight bytes cycled per shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quant", choices=["Q4_0", "Q4_1", "Q8_0"], help="native reads these blocks")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_native.load():
        raise SystemExit("native kernels unavailable")
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype} weights, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
        "today = transposed GEMV at 1 row, oneDNN packed float32 at >= 2; native = "
        + (f"{args.quant} blocks" if args.quant else "panels")
    )
    print(
        "| shape | rows | today ms | native ms | speed-up | today GB/s | native GB/s "
        "| today GFLOP/s | native GFLOP/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.shapes:
        bench_shape(name, args, dtype)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
