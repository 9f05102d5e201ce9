"""The native CPU paged attention alone (issue 32), two builds of the library side by side: one
layer of SmolLM2-135M (9 query / 3 kv heads of 64, block 16, blocks scattered) on a causal
prefill of `--tokens` tokens, and a decode step of 16 sequences x 1,000 keys (and x 50). Each build runs in
its own process (two builds' ops cannot share one), the builds alternate round by round, and a
round's figure is the minimum of its calls; the median and span of the rounds are printed.

    .venv/bin/python benchmarks/attention_cpu.py --lib /tmp/old.so this --rounds 5
    .venv/bin/python benchmarks/attention_cpu.py --lib this --dtype bfloat16 --tokens 4096

`this` is this checkout's library (built on demand). With one thread (the default) calls are
timed with the process's CPU clock, so time a neighbour takes from the core is not counted;
`--threads N` times wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def load(lib: str):
    if lib == "this":
        from deepserve.kernels.cpu import native

        assert native.load(), "native CPU kernels did not build"
    else:
        torch.ops.load_library(lib)
    return torch.ops.deepserve_cpu.paged_attention


def case(lengths: list[int], new: list[int], dtype: torch.dtype, seed: int = 0):
    """Caches holding `lengths` keys per sequence in scattered blocks; the last `new` of each are
    the query rows."""
    g = torch.Generator().manual_seed(seed)
    nblk = [(n + BLOCK - 1) // BLOCK for n in lengths]
    perm = torch.randperm(sum(nblk), generator=g).to(torch.int32)
    tables = torch.zeros(len(lengths), max(nblk), dtype=torch.int32)
    at = 0
    for i, m in enumerate(nblk):
        tables[i, :m] = perm[at : at + m]
        at += m
    k = torch.randn(sum(nblk), BLOCK, HKV, D, generator=g).to(dtype)
    v = torch.randn(sum(nblk), BLOCK, HKV, D, generator=g).to(dtype)
    q = torch.randn(sum(new), HQ, D, generator=g).to(dtype)  # a bf16 model's q is bf16 too
    loc = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return q, k, v, loc, lens, tables


def flops(lengths: list[int], new: list[int]) -> int:
    """q.k and p.v multiply-adds over the keys each row sees (causal)."""
    keys = sum(n - m + t + 1 for n, m in zip(lengths, new, strict=True) for t in range(m))
    return 4 * D * HQ * keys


def worker(lib: str, dtype: torch.dtype, tokens: list[int], calls: int, isa: str | None,
           threads: int) -> dict:  # fmt: skip
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    op = load(lib)
    if isa:
        torch.ops.deepserve_cpu.set_isa(isa)
    shapes = {f"prefill {n}": ([n], [n]) for n in tokens}
    shapes["decode 16 x 1000"] = ([1000] * 16, [1] * 16)
    shapes["decode 16 x 50"] = ([50] * 16, [1] * 16)
    out = {}
    for name, (lengths, new) in shapes.items():
        args = case(lengths, new, dtype)
        op(*args, D**-0.5)
        best = float("inf")
        for _ in range(calls):
            t = clock()
            op(*args, D**-0.5)
            best = min(best, clock() - t)
        out[name] = {"ms": best * 1e3, "gflops": flops(lengths, new) / best / 1e9}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lib", nargs="+", default=["this"], help="library builds ('this': ours)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="calls per round; its minimum counts")
    p.add_argument("--threads", type=int, default=1, help="above 1: wall clock")
    p.add_argument("--isa", help="force a path: avx2, avx512, avx512_bf16 (default: the widest)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.worker:
        print(json.dumps(worker(a.worker, dtype, a.tokens, a.calls, a.isa, a.threads)))
        return
    runs: dict[str, list[dict]] = {lib: [] for lib in a.lib}
    for _ in range(a.rounds):
        for lib in a.lib:
            cmd = [sys.executable, __file__, "--worker", lib, "--dtype", a.dtype,
                   "--calls", str(a.calls), "--tokens", *map(str, a.tokens),
                   "--threads", str(a.threads),
                   *(["--isa", a.isa] if a.isa else [])]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[lib].append(json.loads(res.stdout.strip().splitlines()[-1]))
    clock = "CPU time" if a.threads == 1 else "wall clock"
    print(f"{a.dtype} cache, path {a.isa or 'widest'}, {a.threads} thread(s), {clock}, "
          f"min of {a.calls} calls, {a.rounds} rounds")  # fmt: skip
    for name in runs[a.lib[0]][0]:
        for lib in a.lib:
            ms = [r[name]["ms"] for r in runs[lib]]
            gf = [r[name]["gflops"] for r in runs[lib]]
            print(f"{name:18s} {lib:28s} {statistics.median(ms):9.3f} ms "
                  f"({min(ms):.3f}-{max(ms):.3f})  {statistics.median(gf):6.1f} GFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
