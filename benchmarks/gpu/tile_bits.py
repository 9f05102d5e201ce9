"""Do a tile's shape and a launch's warps change a GEMM's bits? (issue 31, `--batch-invariant`)

The batch-invariant set fixes every launch parameter of its matmul and fused MoE from the
weight alone (kernels/triton/matmul.py), so its decode runs 64-row tiles at M = 1 and its
prefill the same narrow tiles at M = 2,000. The premise: a different tile could change an
output element's bits. The arithmetic of an element is its chain of tensor-core products over
K (16 deep each) added into one float32 accumulator, chunk partials added in chunk order: this
script checks, on the GPU, whether the MMA's M / N extent (mma.sync at 16 rows, wgmma from 64),
BLOCK_K (how many of those products one loop step issues), warps and stages leave those bits
alone when the K chunks stay the weight's. Each candidate's output at M = 1 / 17 / 64 / 2,000
rows is compared bit for bit with the weight's own configuration at 2,000 rows, and timed (CUDA
graph) beside cuBLAS. The fused MoE likewise (bf16 experts, V2-Lite shape: DECODE / PREFILL /
LARGE tiles and the `invariant_config` ones), the block-scaled FP8 GEMM's whole-K tiles, and
attention.py's prefill tiles of (token, head) rows against its one-head tiles.

From the repo root on the GPU machine (run_all.sh's namespace mapping, then this script):

    ns=/tmp/deepserve-ns/deepserve; mkdir -p $ns
    for r in engine kernels server kvcache router disagg; do ln -sfn $PWD/$r $ns/$r; done
    PYTHONPATH=/tmp/deepserve-ns:$PWD/tests:$PWD/benchmarks/gpu \
        python3 benchmarks/gpu/tile_bits.py --out $OUT/tile_bits.json --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from kernel_checks import _graph_us

from deepserve.kernels.triton import fused_moe, matmul

SHAPES = {  # (K, N) -> layer
    (2048, 3072): "v2 q_proj",
    (2048, 576): "v2 kv_a",
    (2048, 2048): "v2 o_proj",
    (2048, 2816): "v2 shared gate_up",
    (1408, 2048): "v2 down (1408)",
    (2816, 2048): "v2 shared down",
    (2048, 102400): "v2 lm_head",
}
CANDIDATES = {  # name -> (block_m, block_n, block_k, warps, stages)
    "m16n32k128w4s4": (16, 32, 128, 4, 4),
    "m16n64k128w4s4": (16, 64, 128, 4, 4),
    "m16n64k64w4s6": (16, 64, 64, 4, 6),
    "m16n128k128w4s4": (16, 128, 128, 4, 4),
    "m32n64k128w4s4": (32, 64, 128, 4, 4),
    "m64n64k64w4s4": (64, 64, 64, 4, 4),
    "m64n128k128w8s3": (64, 128, 128, 8, 3),
    "m128n128k64w8s3": (128, 128, 64, 8, 3),
    "m128n256k64w8s3": (128, 256, 64, 8, 3),
    "m128n128k128w8s3": (128, 128, 128, 8, 3),
    "m128n64k128w8s3": (128, 64, 128, 8, 3),
    "m64n256k64w8s3": (64, 256, 64, 8, 3),
}
ROWS = (1, 17, 64, 2000)


def launch(x, w, out, cfg: matmul.TileConfig, kc: int) -> torch.Tensor:
    """matmul's launch with the K chunk `kc` given (the weight's), not derived from cfg."""
    matmul._launch(x[None], w.t()[None], out[None], replace(cfg, chunk_k=kc))
    return out


def linear_rows(out: dict, deadline: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    for (k, n), layer in SHAPES.items():
        if time.time() > deadline:
            out["errors"].append(f"out of time before {layer}")
            return
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5
        x = torch.randn(2000, k, device="cuda", generator=g, dtype=torch.bfloat16)
        own = matmul.config_for(k, n, torch.bfloat16)
        kc = own.chunk(k)
        ref = matmul.linear(x, w, own)  # the weight's own configuration, 2,000 rows
        row = dict(layer=layer, k=k, n=n, own=str(own), kc=kc, cands={})
        row.update(cublas={}, own_us={}, policy_us={}, policy_equal={})
        for m in ROWS:
            calls = 3 if m == 2000 else 20
            xm = x[:m]
            row["cublas"][m] = round(_graph_us(lambda xm=xm, w=w: xm @ w.t(), calls), 2)
            fixed = (xm, w, own)  # the weight's one tile at every M (before `for_rows`)
            row["own_us"][m] = round(_graph_us(lambda a=fixed: matmul.linear(*a), calls), 2)
            row["policy_us"][m] = round(_graph_us(lambda a=fixed[:2]: matmul.linear(*a), calls), 2)
            row["policy_equal"][m] = bool(torch.equal(matmul.linear(xm, w), ref[:m]))
        for name, (bm, bn, bk, warps, stages) in CANDIDATES.items():
            cfg = matmul.TileConfig(bm, bn, bk, 8, warps, stages).fitted(2)
            if kc % bk:
                continue
            cand = {}
            try:
                for m in ROWS:
                    o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    launch(x[:m], w, o, cfg, kc)
                    same = bool(torch.equal(o, ref[:m]))
                    calls = 3 if m == 2000 else 20
                    args = (x[:m], w, o, cfg, kc)
                    us = _graph_us(lambda args=args: launch(*args), calls)
                    cand[m] = dict(equal=same, us=round(us, 2))
            except Exception as e:  # out of shared memory, registers: recorded
                cand["error"] = str(e)[:160]
            row["cands"][name] = cand
        out["linear"].append(row)
        print(json.dumps(row), flush=True)


def moe_rows(out: dict, experts: str = "bf16") -> None:
    """V2-Lite's routed experts (64 x [2 x 1408, 2048], top-6), bf16 or MXFP4 (e2m1 decoded to
    bf16 in the K loop): every tile's rows against DECODE's at 2,000 tokens, bitwise."""
    from deepserve.kernels.block_quant import quantize_mxfp4

    g = torch.Generator(device="cuda").manual_seed(8)
    e, h, inter, topk, t = 64, 2048, 1408, 6, 2000
    gate_up = torch.randn(e, 2 * inter, h, device="cuda", generator=g, dtype=torch.bfloat16) / 45
    down = torch.randn(e, h, inter, device="cuda", generator=g, dtype=torch.bfloat16) / 38
    if experts == "mxfp4":
        gate_up, down = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:topk] for _ in range(t)])
    wts = torch.rand(t, topk, device="cuda", generator=g)
    ref = fused_moe.fused_moe(x, gate_up, down, wts, ids, fused_moe.DECODE)
    tiles = {
        "DECODE": fused_moe.DECODE,
        "PREFILL": fused_moe.PREFILL,
        "LARGE": fused_moe.LARGE,
        "MXFP4_PREFILL": fused_moe.MXFP4_PREFILL,
        "m64n64k128w4s4": fused_moe.MoeConfig(64, 64, 128, 4, 4),
        "m16n128k64w4s4": fused_moe.MoeConfig(16, 128, 64, 4, 4),
        "invariant 2,000 tokens": fused_moe.invariant_config(12000, gate_up),
        "invariant 1,024 pairs": fused_moe.invariant_config(1024, gate_up),
    }
    for name, cfg in tiles.items():
        row = dict(experts=experts, tile=name, cfg=str(cfg))
        for m in ROWS:
            o = fused_moe.fused_moe(x[:m], gate_up, down, wts[:m], ids[:m], cfg)
            us = _graph_us(
                lambda m=m, cfg=cfg: fused_moe.fused_moe(
                    x[:m], gate_up, down, wts[:m], ids[:m], cfg
                ),
                3 if m == 2000 else 20,
            )
            row[m] = dict(equal=bool(torch.equal(o, ref[:m])), us=round(us, 1))
        out["moe"].append(row)
        print(json.dumps(row), flush=True)


ATTENTION = {  # name -> TritonPagedAttention's arguments (split fixed: attention.SPLIT)
    "one head, 16 tokens (--batch-invariant)": dict(block_m=16),
    "one head, 32 tokens (default set)": dict(block_m=32),
    "heads x tokens, 32 rows, 4 warps": dict(grouped_rows=32, grouped_warps=4),
    "heads x tokens, 32 rows, 8 warps (--batch-invariant)": dict(grouped_rows=32, grouped_warps=8),
    "heads x tokens, 64 rows, 4 warps": dict(grouped_rows=64, grouped_warps=4),
    "heads x tokens, 64 rows, 8 warps": dict(grouped_rows=64, grouped_warps=8),
    "InvariantPagedAttention (--batch-invariant)": None,  # decode steps: value runs by batch
}
# (query heads, KV heads, key width, value width, latent): V2-Lite's absorbed MLA, SmolLM2's GQA
ATTENTION_SHAPES = {
    "mla 16 x 576": (16, 1, 576, 512, True),
    "gqa 9 / 3 x 64": (9, 3, 64, 64, False),
}


def attention_rows(out: dict) -> None:
    """Paged bf16 caches of V2-Lite's absorbed MLA (16 heads over one 576-wide latent, values
    its first 512) and SmolLM2's GQA: a fresh 2,000-token prompt, and a 256-token chunk after
    3,000 cached tokens beside 8 decodes (a mixed step); every variant's rows against the
    first's (the flag's one-head tile), bitwise. Tiles of 64 rows differed on the H100: from 64
    rows Triton issues wgmma, whose layout sums a row's softmax in another order."""
    from paged_kv import Cache

    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import InvariantPagedAttention

    g = torch.Generator(device="cuda").manual_seed(9)
    steps = {"prefill 2,000": [(0, 0, 2000)], "chunk 256 + 8 decodes": [(0, 3000, 256)]}
    steps["chunk 256 + 8 decodes"] += [(i, 599, 1) for i in range(1, 9)]
    steps["decode 1 x 200"] = [(1, 199, 1)]
    steps["decode 8 x 600 + 3,256"] = [(i, 599, 1) for i in range(1, 9)] + [(0, 3255, 1)]
    for shape, (hq, hkv, dk, dv, mla) in ATTENTION_SHAPES.items():
        cache = Cache([3256] + [600] * 8, hkv, dk, dv, mla, 0, "cuda", torch.bfloat16, 64)
        for step, seqs in steps.items():
            meta = cache.meta(seqs)
            q = torch.randn(meta.num_tokens, hq, dk, device="cuda", generator=g,
                            dtype=torch.bfloat16)  # fmt: skip
            want = None
            for name, kw in ATTENTION.items():
                op = (
                    InvariantPagedAttention()
                    if kw is None
                    else attention.TritonPagedAttention(attention.SPLIT, **kw)
                )
                row = dict(shape=shape, step=step, variant=name)
                try:
                    got = op(q, cache.k, cache.v, meta, 0.07)
                    args = (q, cache.k, cache.v, meta, 0.07)
                    us = _graph_us(lambda op=op, args=args: op(*args), 3)
                except Exception as e:  # registers or shared memory: recorded
                    out["attention"].append(dict(row, error=str(e)[:160]))
                    continue
                want = got if want is None else want
                row.update(equal=bool(torch.equal(got, want)), us=round(us, 1))
                out["attention"].append(row)
                print(json.dumps(row), flush=True)


def fp8_rows(out: dict) -> None:
    """Block-scaled FP8 weights (V2-Lite's q_proj and shared down, V4's wq_b): the GEMM's
    whole-K tiles (the default set's by M, without split-K) against `--batch-invariant`'s
    `decode_config(N)` at 2,000 rows, bitwise; inline and separate quantization alike."""
    from deepserve.kernels.block_quant import quantize_fp8
    from deepserve.kernels.triton import fp8_matmul as f8

    g = torch.Generator(device="cuda").manual_seed(10)
    for k, n in ((2048, 3072), (2816, 2048), (1024, 32768)):
        w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        x = torch.randn(2000, k, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = f8.fp8_linear(x, w, f8.decode_config(n))
        tiles = {"decode_config(n)": f8.decode_config(n), "DECODE": f8.DECODE,
                 "MEDIUM": f8.MEDIUM, "LARGE": f8.LARGE,
                 "decode_config(n, 64)": f8.decode_config(n, 64),
                 "32 x 64": f8.Fp8TileConfig(block_m=32)}  # fmt: skip
        for name, cfg in tiles.items():
            row = dict(k=k, n=n, tile=name)
            for m in ROWS:
                o = f8.fp8_linear(x[:m], w, cfg)
                args = (x[:m], w, cfg)
                us = _graph_us(lambda args=args: f8.fp8_linear(*args), 20)
                row[m] = dict(equal=bool(torch.equal(o, ref[:m])), us=round(us, 2))
            out["fp8"].append(row)
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--only", nargs="*", default=["linear", "moe", "attention", "fp8"])
    args = parser.parse_args()
    deadline = time.time() + args.budget_s
    out: dict = {"gpu": torch.cuda.get_device_name(), "errors": [], "linear": [], "moe": []}
    out["attention"], out["fp8"] = [], []
    sections = dict(linear=lambda: linear_rows(out, deadline), moe=lambda: moe_rows(out),
                    moe_mxfp4=lambda: moe_rows(out, "mxfp4"),
                    attention=lambda: attention_rows(out), fp8=lambda: fp8_rows(out))  # fmt: skip
    for section in (sections[name] for name in args.only):
        if time.time() > deadline:
            out["errors"].append("out of time")
            break
        try:
            section()
        except Exception as e:  # recorded; the next section still runs
            out["errors"].append(repr(e)[:300])
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
