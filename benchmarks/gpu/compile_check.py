"""Compile `--batch-invariant`'s matmul for the H200 (sm_90) on any machine, no GPU needed: the
kernel each engine weight shape launches (config_for), specialised as Triton specialises it at run
time, through ptxas; prints registers, spill stores, shared memory, and the SASS counts that say
whether the tensor-core (HGMMA) and pipelined-copy (LDGSTS) paths were taken. Run it before a
device call: a kernel that does not compile here does not compile there.

    .venv/bin/python benchmarks/gpu/compile_check.py   # PYTHONPATH=dir for another Triton
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepserve.kernels.triton import matmul

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


def compile_matmul(k: int, n: int, bmm: bool, dtype: str) -> dict:
    import torch

    cfg = matmul.config_for(k, n, getattr(torch, TORCH_DTYPE[dtype]))
    fn = matmul._matmul_kernel
    names = fn.arg_names
    sig = {name: "i32" for name in names}
    sig.update(a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", c_ptr=f"*{dtype}", ws_ptr="*fp32")
    const = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        PRECISION="ieee" if dtype == "fp32" else "tf32", s_ak=1,
    )  # fmt: skip
    const["s_bn" if bmm else "s_bk"] = 1  # linear's B is w.t(): K contiguous
    sig.update({name: "constexpr" for name in const})
    div = ["a_ptr", "b_ptr", "c_ptr", "ws_ptr", "N", "K", "KC", "s_am", "s_bb", "s_cm"]
    div.append("s_bk" if bmm else "s_bn")
    attrs = {(names.index(d),): [["tt.divisibility", 16]] for d in div}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout  # fmt: skip
        res = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout  # fmt: skip
    return dict(
        cfg=f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
        f"splits{cfg.splits}",
        regs=int(re.findall(r"REG:(\d+)", res)[0]),
        spill_stores=sass.count("STL"),
        shared=kernel.metadata.shared,
        hgmma=sass.count("HGMMA"),
        ldgsts=sass.count("LDGSTS"),
    )


def main() -> int:
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for k, n, heads, dtype in SHAPES:
        try:
            print(k, n, heads, dtype, compile_matmul(k, n, bool(heads), dtype), flush=True)
        except Exception as e:
            failed += 1
            print(k, n, heads, dtype, "FAILED:", str(e)[-600:], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
