"""Prefill-sized CPU linears side by side (issue 32): torch's own GEMM (`F.linear`: MKL for
float32, oneDNN for bfloat16), oneDNN's pre-packed float32 GEMM, and the native panel kernel
(kernels/cpu/csrc/linear*.cpp) on every ISA path this CPU has, at prefill row counts on
SmolLM2-135M's shapes, in one process.

The weights stay in cache between calls (a prefill reuses each weight across its rows; what
linear_cpu.py measures is the decode case, weights streamed from DRAM). Each round times every
method once, in turn (A B C A B C ...), so a busy minute on this shared machine hits all of them;
reported: the median round's GFLOP/s and the span over rounds. `--cpu-time` times with the
process's CPU clock instead of the wall clock: with 1 thread, time a neighbour takes from the
core is then not counted (use it on a loaded host; with more threads spin-waits would count).

    .venv/bin/python benchmarks/prefill_linear_cpu.py --threads 1 --cpu-time
    .venv/bin/python benchmarks/prefill_linear_cpu.py --dtype bfloat16 --rows 16 1024
    .venv/bin/python benchmarks/prefill_linear_cpu.py --lib /path/to/deepserve_cpu.so  # another build

`--lib` loads that build of the native library instead of this checkout's (one built from an
older commit, for a before/after in the same run of this script).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out, in), SmolLM2-135M
    "up": (1536, 576),
    "down": (576, 1536),
    "o": (576, 576),
    "lm_head": (49152, 576),
}


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """kernels/cpu/packed.py's layout, here so `--lib` needs nothing of this checkout's build."""
    out, inp = w.shape
    panels = -(-out // 16)
    padded = torch.zeros(panels * 16, inp, dtype=w.dtype)
    padded[:out] = w
    return padded.view(panels, 16, inp).transpose(1, 2).contiguous()


def load_native(lib: str | None):
    if lib:
        torch.ops.load_library(lib)
    else:
        from deepserve.kernels.cpu import native

        if not native.load():
            raise SystemExit("native kernels unavailable")
    return torch.ops.deepserve_cpu


def methods(ops, w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, panels = w.shape[0], pack_panels(w)
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": lambda x: F.linear(x, w)}
    if w.dtype == torch.float32:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["onednn packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    for isa in ops.supported_isas():
        if isa == "avx512_bf16" and w.dtype != torch.bfloat16:
            continue  # the same kernel as avx512 for float32

        def native(x: torch.Tensor, isa: str = isa) -> torch.Tensor:
            previous = ops.set_isa(isa)
            try:
                return ops.linear(x, panels, n)
            finally:
                ops.set_isa(previous)

        out[f"native {isa}"] = native
    return out


def time_round(fns: dict, x: torch.Tensor, clock, min_s: float) -> dict[str, float]:
    """Seconds per call of each method, best of as many calls as fit in `min_s`, in turn."""
    times = {}
    for name, f in fns.items():
        f(x)
        best, spent = float("inf"), 0.0
        while spent < min_s:
            start = clock()
            f(x)
            dt = clock() - start
            best, spent = min(best, dt), spent + dt
        times[name] = best
    return times


def bench(args, name: str, ops, dtype: torch.dtype, clock) -> None:
    out, inp = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out, inp, generator=g) * 0.05).to(dtype)
    fns = methods(ops, w)
    for rows in args.rows:
        if name == "lm_head" and rows > args.lm_head_max_rows:
            continue
        x = torch.randn(rows, inp, generator=g).to(dtype)
        rounds = [time_round(fns, x, clock, args.min_s) for _ in range(args.rounds)]
        flops = 2 * rows * out * inp
        cells = []
        for m in fns:
            gf = sorted(flops / r[m] / 1e9 for r in rounds)
            cells.append(f"{statistics.median(gf):.0f} ({gf[0]:.0f}-{gf[-1]:.0f})")
        print(f"| {name} {inp}->{out} | {rows} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-s", type=float, default=0.05, help="seconds of calls per method a round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true", help="process CPU clock (use with 1 thread)")
    p.add_argument("--lm-head-max-rows", type=int, default=1024)
    p.add_argument("--lib", help="a native library .so to load instead of this checkout's")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_native(args.lib)
    clock = time.process_time if args.cpu_time else time.perf_counter
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    isa_flags = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'CPU' if args.cpu_time else 'wall'} clock, load {os.getloadavg()[0]:.2f}, "
        f"native {args.lib or 'this checkout'}, default path {ops.isa()}; CPU flags: "
        + " ".join(isa_flags)
    )
    for dt in args.dtype:
        dtype = getattr(torch, dt)
        names = list(methods(ops, torch.zeros(16, 16, dtype=dtype)))
        print(f"\n{dt}: GFLOP/s, median round (span over {args.rounds} rounds)\n")
        print("| shape | rows | " + " | ".join(names) + " |")
        print("|---|---:|" + "---:|" * len(names))
        for name in args.shapes:
            bench(args, name, ops, dtype, clock)
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
