"""Compile `--batch-invariant`'s matmul and fixed-split attention for the H200 (sm_90) on any
machine, no GPU needed: the matmul each engine weight shape launches (config_for), the
attention kernels at the two models' head shapes, and DeepSeek-V4's sparse attention, indexer
and pooling kernels at V4-Flash's shapes, and the attention and KV-write kernels over an e4m3 KV
cache (`--kv-cache-dtype fp8`), and the fused MoE on MXFP4 experts (both e2m1 decodes, the GPU job's
tiles), specialised as Triton specialises them at run time, through ptxas; prints registers, spill stores, shared memory, and the SASS counts that say
whether the tensor-core (HGMMA) and pipelined-copy (LDGSTS) paths were taken. Run it before a
device call: a kernel that does not compile here does not compile there.

    .venv/bin/python benchmarks/gpu/compile_check.py   # PYTHONPATH=dir for another Triton
    .venv/bin/python benchmarks/gpu/compile_check.py --kv-fp8   # only the fp8 KV cache's kernels
    .venv/bin/python benchmarks/gpu/compile_check.py --moe-mxfp4   # only the MXFP4 MoE's
    .venv/bin/python benchmarks/gpu/compile_check.py --gemv   # only the decode GEMV's
    .venv/bin/python benchmarks/gpu/compile_check.py --align   # only the MoE's align
    .venv/bin/python benchmarks/gpu/compile_check.py --tiles   # the flag's tiles by row count
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from functools import partial

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepserve.kernels.triton import (
    attention,
    decode_attention,
    fp8_gemv,
    fused_moe,
    matmul,
    mla,
    rope,
    sparse_attention,
    topk,
)

SHAPES = [  # (K, N, bmm heads or 0, dtype): the V2-Lite and SmolLM2 weights
    (2048, 3072, 0, "bf16"),
    (2048, 576, 0, "bf16"),
    (2048, 2048, 0, "bf16"),
    (2048, 2816, 0, "bf16"),
    (1408, 2048, 0, "bf16"),
    (2816, 2048, 0, "bf16"),
    (2048, 102400, 0, "bf16"),
    (2048, 64, 0, "fp32"),
    (128, 512, 16, "bf16"),
    (512, 128, 16, "bf16"),
    (576, 960, 0, "bf16"),
    (576, 576, 0, "bf16"),
    (576, 3072, 0, "bf16"),
    (1536, 576, 0, "bf16"),
    (576, 49152, 0, "bf16"),
]
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
TORCH_KV = {"bf16": "bfloat16", "fp8e4nv": "float8_e4m3fn"}


def compile_matmul(k: int, n: int, bmm: bool, dtype: str, rows: int | None = None) -> dict:
    import torch

    cfg = matmul.config_for(k, n, getattr(torch, TORCH_DTYPE[dtype]), rows)
    tiles = triton.cdiv(rows or 1, cfg.block_m) * triton.cdiv(n, cfg.block_n)  # _launch's mode
    fn = matmul._matmul_kernel
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update(
        a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", c_ptr=f"*{dtype}", ws_ptr="*fp32", count_ptr="*i32"
    )
    const = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        PRECISION="ieee" if dtype == "fp32" else "tf32", s_ak=1,
        SPLIT_MODE=cfg.splits > 1 and tiles < matmul.FILL_PROGRAMS,
    )  # fmt: skip
    const["s_bn" if bmm else "s_bk"] = 1  # linear's B is w.t(): K contiguous
    sig.update({name: "constexpr" for name in const})
    div = ["a_ptr", "b_ptr", "c_ptr", "ws_ptr", "N", "K", "KC", "s_am", "s_bb", "s_cm"]
    div.append("s_bk" if bmm else "s_bn")
    attrs = {(names.index(d),): [["tt.divisibility", 16]] for d in div}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    cfg_name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    return _resources(kernel, f"{cfg_name} splits{cfg.splits}")


ATTENTION = [  # (name, DK, DV): V2-Lite's absorbed MLA (latent + rope key), SmolLM2's GQA
    ("mla", 576, 512),
    ("gqa", 64, 64),
]


def compile_attention(
    fn, dk: int, dv: int, kv: str = "bf16", heads: int = 1, rows: int = 0, warps: int = 4
) -> dict:
    """A fixed-split attention kernel (attention.py's or decode_attention.py's invariant one) in
    bf16 with the engine's tile constants, over a `kv` ("bf16" or "fp8e4nv") cache; `heads` and
    `rows` (0: BLOCK_M) the varlen kernel's (token, head) tiles."""
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update({n: "*i32" for n in names if n.endswith("_ptr")})  # tables, lengths, offsets
    typed = dict(q_ptr="*bf16", k_ptr=f"*{kv}", v_ptr=f"*{kv}", o_ptr="*bf16", scale="fp32")
    typed.update(pm_ptr="*fp32", pl_ptr="*fp32", pacc_ptr="*fp32")
    sig.update({n: t for n, t in typed.items() if n in names})
    const = dict(
        SPLIT=attention.SPLIT, BLOCK_M=rows or attention.BLOCK_M, BLOCK_N=attention.BLOCK_N,
        BLOCK_D=attention.BLOCK_D, BLOCK_DV=triton.next_power_of_2(dv), PRECISION="tf32",
        s_qd=1, s_kd=1, s_vd=1, HEADS=heads,
    )  # fmt: skip
    const = {n: v for n, v in const.items() if n in names}
    sig.update({name: "constexpr" for name in const})
    kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=2))  # fmt: skip
    tile = f" rows={rows} heads={heads} w{warps}" if rows else ""
    return _resources(kernel, f"{fn.__name__} DK={dk} DV={dv} kv={kv}{tile}")


def tiles_main() -> int:
    """`--batch-invariant`'s tiles by row count (matmul.ROW_TILES) on V2-Lite's weights, and the
    varlen attention's (token, head) tiles on its absorbed MLA: registers, spills, HGMMA."""
    cases = [
        *((f"{k}x{n} rows={m}", partial(compile_matmul, k, n, False, "bf16", m))
          for k, n, _, dt in SHAPES[:7] for m in (1, 64, 2000)),
        *((f"mla rows={r} w{w}", partial(compile_attention, attention._varlen_kernel, 576, 512,
                                         "bf16", 16, r, w))
          for r, w in ((32, 4), (32, 8), (64, 4), (64, 8))),
    ]  # fmt: skip
    return 1 if _compile_cases(cases) else 0


def _compile_cases(cases, tag: str = "") -> int:
    """Builds each (what, build) case and prints its resources; how many failed."""
    failed = 0
    for what, build in cases:
        try:
            print(what, build(), flush=True)
        except Exception as e:
            failed += 1
            print(what, tag, "FAILED:", str(e)[-600:], flush=True)
    return failed


def compile_decode(dk: int, dv: int, heads: int, kv_heads: int, shared: bool, kv: str) -> dict:
    """The default set's graph-safe decode kernel as `decode_attention` launches it (bf16
    queries) over a `kv` cache."""
    fn = decode_attention._decode_split_kernel
    pow2 = triton.next_power_of_2
    dm = dv if shared else pow2(dk) // (2 if pow2(dk) != dk else 1)
    dm = min(dm, dk)
    dt, wide = dk - dm, dk > 256
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update({n: "*i32" for n in names if n.endswith("_ptr")})
    sig.update(q_ptr="*bf16", k_ptr=f"*{kv}", v_ptr=f"*{kv}", scale="fp32")
    sig.update(pm_ptr="*fp32", pl_ptr="*fp32", pacc_ptr="*fp32")
    group = heads // kv_heads
    const = dict(
        BASE=decode_attention.BASE_SPLITS, MIN_KEYS=decode_attention.MIN_SPLIT_KEYS, DM=dm,
        DT=max(16, pow2(dt)) if dt else 0, DT_REAL=dt, BLOCK_DV=pow2(dv), SHARED_V=shared,
        HEAD_BLOCKS=-(-group // decode_attention.BLOCK_H), BLOCK_H=decode_attention.BLOCK_H,
        BLOCK_N=32 if wide else 64, PRECISION="tf32",
    )  # fmt: skip
    sig.update({name: "constexpr" for name in const})
    import torch

    tile = decode_attention.default_tile(dk, getattr(torch, TORCH_KV[kv]))
    const["BLOCK_N"] = tile.block_n
    # as the JIT specialises them at run time (pointers, and the cache's strides are multiples of
    # 16 elements): without the head stride's, no K load is pipelined (no LDGSTS)
    div = [n for n in names if n.endswith("_ptr")] + [
        "s_kb",
        "s_ks",
        "s_kh",
        "s_vb",
        "s_vs",
        "s_vh",
    ]
    attrs = {(names.index(d),): [["tt.divisibility", 16]] for d in div}
    opts = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    return _resources(kernel, f"_decode_split_kernel DK={dk} DV={dv} kv={kv}")


def compile_kv_writes(kv: str) -> list[dict]:
    """MLA's fused latent write (V2-Lite: lora 512, rope 64) and llama's rope + K/V write
    (SmolLM2: 9 + 3 heads of 64) into a `kv` cache from bf16 rows."""
    out = []
    fn = mla._kv_write_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(ckv_ptr="*bf16", w_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16")
    sig.update(cache_ptr=f"*{kv}", slot_ptr="*i64", eps="fp32", LORA="constexpr", HALF="constexpr")
    const = dict(LORA=512, HALF=32)
    kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))  # fmt: skip
    out.append(_resources(kernel, f"mla._kv_write_kernel kv={kv}"))
    fn = rope._rope_qk_write_kv_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", k_ptr=f"*{kv}", v_ptr=f"*{kv}")
    sig.update(slot_ptr="*i64", BLOCK_H="constexpr", HALF="constexpr")
    const = dict(BLOCK_H=16, HALF=32)
    opts = dict(num_warps=1, enable_fp_fusion=False)
    kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    out.append(_resources(kernel, f"rope._rope_qk_write_kv_kernel kv={kv}"))
    return out


def kv_fp8_main() -> int:
    """Only the kernels `--kv-cache-dtype fp8` changes, in bf16 and e4m3 side by side."""
    failed = 0
    for kv in ("bf16", "fp8e4nv"):
        cases = [
            *((f"{fn.__name__} {n}", partial(compile_attention, fn, dk, dv, kv))
              for fn in (attention._varlen_kernel, decode_attention._invariant_split_kernel)
              for n, dk, dv in ATTENTION),
            ("decode mla", partial(compile_decode, 576, 512, 16, 1, True, kv)),
            ("decode gqa", partial(compile_decode, 64, 64, 9, 3, False, kv)),
            ("kv writes", partial(compile_kv_writes, kv)),
        ]  # fmt: skip
        failed += _compile_cases(cases, kv)
    return 1 if failed else 0


MOE_POINTERS = dict(a_ptr="*bf16", w_ptr="*u8", c_ptr="*bf16", pair_ptr="*i64",
                    block_expert_ptr="*i32", scale_ptr="*fp32", as_ptr="*bf16", ws_ptr="*u8")  # fmt: skip


def compile_moe_mxfp4(cfg, ptx: bool) -> dict:
    """The fused MoE's grouped GEMM on MXFP4 experts with E8M0 scales and bf16 activations (K a
    multiple of the tile's, as V4-Flash's 4096 and 2048), under `cfg`, with the PTX e2m1 decode
    or the integer one; `dot_asm`: the PTX's bf16x2 multiplies in the SASS (HMUL2.BF16)."""
    fn = fused_moe._moe_gemm_kernel
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update(MOE_POINTERS)
    const = dict(
        A_DIV=1, SCALE=True, PRECISION="tf32", WFMT=fused_moe.MXFP4, SCALE_N=1, E8M0=True,
        PTX=ptx, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        s_wk=1, s_wsk=1,
    )  # fmt: skip
    sig.update({name: "constexpr" for name in const})
    div = [n for n in names if n not in const and n != "num_pairs"]
    attrs = {(names.index(d),): [["tt.divisibility", 16]] for d in div}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    name = f"moe mxfp4 {'ptx' if ptx else 'integer'} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"  # fmt: skip
    return _resources(kernel, name)


def moe_mxfp4_main() -> int:
    """The MXFP4 MoE's default tiles with both decodes, and the GPU job's swept tiles
    (kernel_checks `MXFP4_TILES`) with the PTX one."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_checks import MXFP4_TILES

    cases = [(c, ptx) for c in (fused_moe.DECODE, fused_moe.PREFILL) for ptx in (False, True)]
    cases += [(fused_moe.MoeConfig(*t), True) for tiles in MXFP4_TILES.values() for t in tiles.values()]  # fmt: skip
    failed = 0
    for cfg, ptx in cases:
        try:
            print(compile_moe_mxfp4(cfg, ptx), flush=True)
        except Exception as e:
            failed += 1
            print("moe mxfp4", cfg, ptx, "FAILED:", str(e)[-600:], flush=True)
    return 1 if failed else 0


SPARSE_POINTERS = {  # DeepSeek-V4's kernels (sparse_attention.py): bf16 cache, int64 slots
    "*bf16": ("q_ptr", "wkv_ptr", "ekv_ptr", "o_ptr", "keys_ptr", "rows_ptr"),
    "*i64": (
        "ws_ptr",
        "es_ptr",
        "slots_ptr",
        "seq_ptr",
        "visible_ptr",
        "tokens_ptr",
        "prev_ptr",
        "ids_ptr",
    ),
    "*fp32": (
        "pm_ptr",
        "pl_ptr",
        "pacc_ptr",
        "sinks_ptr",
        "w_ptr",
        "out_ptr",
        "ape_ptr",
        "scores_ptr",
    ),
    "*u8": ("has_prev_ptr",),
}


def compile_sparse(fn, const: dict, ones: tuple[str, ...], what: str) -> dict:
    """One of sparse_attention.py's kernels with the constants its wrapper launches it with
    (`const`, launch options included); `ones`: the strides Triton sees as 1 at run time."""
    const = dict(const)
    opts = dict(num_warps=const.pop("num_warps"), num_stages=const.pop("num_stages", 2))
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    for ty, ptrs in SPARSE_POINTERS.items():
        sig.update({n: ty for n in ptrs if n in names})
    if "scale" in names:
        sig["scale"] = "fp32"
    const.update({n: 1 for n in ones if n in names})
    sig.update({name: "constexpr" for name in const})
    kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    return _resources(kernel, what)


def sparse_cases() -> list[tuple]:
    """V4-Flash: 64 heads over the 512-wide latent (head blocks of 16, and of 32 to compare),
    the indexer's 64 heads of 128 over 64-entry blocks, CSA (4 x 2 candidates) and HCA (128)
    pooling of 512 columns."""
    import torch

    sa = sparse_attention
    cases = []
    for block_h in (16, 32):
        for skip in (True, False):
            const = sa.attention_launch(512, torch.bfloat16, block_h, skip)
            for fn in (sa._split_kernel, sa._fold_kernel):
                what = f"{fn.__name__} H=64 D=512 block_h={block_h} skip_empty={skip}"
                cases.append((fn, const, ("s_qd", "s_wkd", "s_ekd", "s_od"), what))
    combine = dict(BLOCK_D=512, num_warps=4)
    cases.append((sa._combine_kernel, combine, ("s_od",), "_combine_kernel D=512"))
    index = dict(BLOCK_HI=64, BLOCK_DI=128, BLOCK_G=64, PRECISION="tf32", num_warps=4)
    cases.append((sa._indexer_scores_kernel, index, ("s_qd", "s_kd", "s_sg"), "indexer Hi=64 Di=128"))  # fmt: skip
    select = dict(BLOCK=topk.BLOCK, num_warps=8)
    cases.append((topk._topk_ascending_kernel, select, (), "topk_ascending"))
    for ratio, series in ((4, 2), (128, 1)):
        block_r, block_c = sa.pool_tiles(ratio, 512)
        pool = dict(SERIES=series, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
        cases.append((sa._compress_pool_kernel, pool, ("s_tr", "s_pr"), f"pool ratio={ratio}"))
    return cases


def compile_gemv(w: str, x: str, block_m: int, one_launch: bool, x_tile: bool = False) -> dict:
    """fp8_gemv.py's weight-streaming kernel for `w` weights ("fp8e4nv", "bf16", "fp32") and `x`
    rows, one-row (block_m 1) or dot form, with its one-launch split sum or not, specialised as a
    decode call is (pointers and the K-long strides divisible by 16, K a multiple of 128)."""
    fn, cfg = fp8_gemv._gemv_kernel, fp8_gemv.GEMV
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update(x_ptr=f"*{x}", w_ptr=f"*{w}", ws_ptr="*fp32" if w == "fp8e4nv" else f"*{w}")
    sig.update(out_ptr="*fp32" if one_launch else f"*{x}", y_ptr=f"*{x}", count_ptr="*i32")
    const = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=fp8_gemv.GROUP, SCALE_N=128, EVEN_K=True,
        IEEE=x == "fp32", SCALED=w == "fp8e4nv", ONE_LAUNCH=one_launch, X_TILE=x_tile,
        GROUP_N=0,
    )  # fmt: skip
    sig.update({name: "constexpr" for name in const})
    div = [n for n in names if n.endswith("_ptr") or n in ("K", "s_xm", "s_wn")]
    attrs = {(names.index(d),): [["tt.divisibility", 16]] for d in div}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    what = f"gemv w={w} x={x} block_m={block_m} one_launch={one_launch} x_tile={x_tile}"
    return _resources(kernel, what)


def gemv_main() -> int:
    """The GEMV's FP8, bf16 and float32 variants the default set launches at decode."""
    failed = 0
    for w, x in (("fp8e4nv", "bf16"), ("bf16", "bf16"), ("fp32", "fp32")):
        for block_m, one, tile in ((1, True, False), (1, False, False), (1, True, True), (16, True, False)):  # fmt: skip
            try:
                print(compile_gemv(w, x, block_m, one, tile), flush=True)
            except Exception as e:
                failed += 1
                print("gemv", w, x, block_m, one, "FAILED:", str(e)[-600:], flush=True)
    return 1 if failed else 0


ALIGN_CASES = [  # (tokens, top_k, experts, block_m): V2-Lite and V4-Flash decode, prefill sizes
    (1, 6, 256, 16), (64, 6, 64, 16), (64, 6, 256, 16), (2000, 6, 64, 64), (1024, 8, 256, 64),
    (8192, 8, 256, 128),
]  # fmt: skip


def compile_align(tokens: int, top_k: int, experts: int, block_m: int) -> dict:
    """The fused MoE's `_align_kernel` as `align_kernel` launches it, over int64 router ids."""
    fn = fused_moe._align_kernel
    const = fused_moe.align_launch(tokens * top_k, experts, block_m)
    opts = dict(num_warps=const.pop("num_warps"))
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(ids_ptr="*i64", table_ptr="*i64", block_expert_ptr="*i32")
    sig.update({name: "constexpr" for name in const})
    kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    return _resources(kernel, f"align {tokens}x{top_k} experts={experts} block_m={block_m} {const}")


def align_main() -> int:
    failed = 0
    for case in ALIGN_CASES:
        try:
            print(compile_align(*case), flush=True)
        except Exception as e:
            failed += 1
            print("align", case, "FAILED:", str(e)[-600:], flush=True)
    return 1 if failed else 0


def _resources(kernel, what: str) -> dict:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout  # fmt: skip
        res = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout  # fmt: skip
    return dict(
        what=what,
        regs=int(re.findall(r"REG:(\d+)", res)[0]),
        spill_stores=sass.count("STL"),
        shared=kernel.metadata.shared,
        hgmma=sass.count("HGMMA"),
        ldgsts=sass.count("LDGSTS"),
        hmul2_bf16=sass.count("HMUL2.BF16"),
        instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
    )


def main() -> int:
    print(f"triton {triton.__version__}, target sm_90")
    if "--kv-fp8" in sys.argv[1:]:
        return kv_fp8_main()
    if "--moe-mxfp4" in sys.argv[1:]:
        return moe_mxfp4_main()
    if "--gemv" in sys.argv[1:]:
        return gemv_main()
    if "--align" in sys.argv[1:]:
        return align_main()
    if "--tiles" in sys.argv[1:]:
        return tiles_main()
    failed = 0
    for k, n, heads, dtype in SHAPES:
        try:
            print(k, n, heads, dtype, compile_matmul(k, n, bool(heads), dtype), flush=True)
        except Exception as e:
            failed += 1
            print(k, n, heads, dtype, "FAILED:", str(e)[-600:], flush=True)
    for fn, const, ones, what in sparse_cases():
        try:
            print(compile_sparse(fn, const, ones, what), flush=True)
        except Exception as e:
            failed += 1
            print(what, "FAILED:", str(e)[-600:], flush=True)
    for fn in (attention._varlen_kernel, decode_attention._invariant_split_kernel):
        for name, dk, dv in ATTENTION:
            try:
                print(name, compile_attention(fn, dk, dv), flush=True)
            except Exception as e:
                failed += 1
                print(name, fn.__name__, "FAILED:", str(e)[-600:], flush=True)
    return 1 if failed or kv_fp8_main() or moe_mxfp4_main() or gemv_main() or align_main() else 0


if __name__ == "__main__":
    sys.exit(main())
