"""One fused MoE call on MXFP4 experts at DeepSeek-V4-Flash's expert shape (256 experts, hidden
4096, intermediate 2048, top-6, random routing), made to be read by Nsight Compute: a warm-up
call (Triton compiles), then `--calls` more, so that `ncu --launch-skip 2` sees the grouped GEMMs
of a warm call. On the lent H200 (from the repo root, after run_all.sh has mapped the tree):

    PYTHONPATH=/tmp/deepserve-ns ncu --clock-control none -k regex:_moe_gemm --launch-skip 2 \\
        --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/gpu/moe_profile.py --tokens 64 [--unfolded]

What does not live here: the checks and timings of the same kernel (kernel_checks.py
`check_mxfp4_moe`).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from deepserve.kernels import block_quant
from deepserve.kernels.triton import fused_moe

EXPERTS, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 6


def experts(rows: int, cols: int, gen: torch.Generator) -> block_quant.Mxfp4Weight:
    """EXPERTS random `[rows, cols]` matrices as MXFP4, made one expert at a time."""
    parts = [
        block_quant.quantize_mxfp4(
            torch.randn(rows, cols, device="cuda", generator=gen) / cols**0.5
        )
        for _ in range(EXPERTS)
    ]
    return block_quant.stack(parts, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--unfolded", action="store_true", help="the decode's 2^126 mul kept")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = experts(2 * INTER, HIDDEN, gen), experts(HIDDEN, INTER, gen)
    x = torch.randn(args.tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(args.tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1)[1]
    weights = torch.rand(args.tokens, TOP_K, device="cuda", generator=gen)
    cfg = fused_moe.default_config(args.tokens * TOP_K, EXPERTS, mxfp4=True)
    cfg = dataclasses.replace(cfg, e2m1_fold=not args.unfolded)
    for _ in range(1 + args.calls):
        fused_moe.fused_moe(x, gate_up, down, weights, ids, cfg)
    torch.cuda.synchronize()
    print(f"tokens {args.tokens}, {cfg}, small scales {gate_up.small_scales and down.small_scales}")


if __name__ == "__main__":
    main()
