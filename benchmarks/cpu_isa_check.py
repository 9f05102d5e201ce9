"""Every ISA path of the native CPU kernels on this machine: built, right, batch invariant, timed.

Self-contained (torch and a C++ compiler; no other dependency of the project), so it runs on a
bare machine with a different CPU than the one that wrote the code: it loads
kernels/cpu/native.py by path, builds the library, and for each path the CPU supports (cpuid:
avx2, avx512, avx512_bf16), forced through `set_isa`:

- linear (float32 and bfloat16 panels; float32 and bfloat16 rows) and paged attention (float32
  and bfloat16 caches, GQA) against a float64 torch reference: max relative error;
- bitwise row invariance: each row alone vs inside batches of many sizes and offsets (linear),
  a prefill vs its chunks vs decode rows vs mixed batches (attention);
- whether two paths give the same bits (AVX2 and AVX-512 should, for the linear);
- time per call at SmolLM2-135M's shapes, 1 thread and all, each path.

    python3 benchmarks/cpu_isa_check.py --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PANEL = 16
# SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, MLP 1536, vocabulary 49,152
LINEAR_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
ROW_COUNTS = (1, 2, 3, 5, 7, 12, 13, 16, 25, 33, 100)


def load_cpu_native():
    spec = importlib.util.spec_from_file_location("cpu_native", ROOT / "kernels/cpu/native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    keep = ("avx", "fma", "amx", "f16c")
    return sorted(f for f in line.split(":", 1)[-1].split() if f.startswith(keep))


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """kernels/cpu/packed.py's pack_panels: w[out, in] -> [ceil(out / 16), in, 16]."""
    out, inp = w.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, inp, dtype=w.dtype)
    padded[:out] = w
    return padded.view(panels, PANEL, inp).transpose(1, 2).contiguous()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


# ---- linear ----


def linear_cases():
    """(name, x dtype, weight dtype, K, N): odd K and N off the panel width included."""
    for wd in (torch.float32, torch.bfloat16):
        for xd in (torch.float32, torch.bfloat16):
            for k, n in ((576, 960), (577, 200), (1536, 576)):
                yield f"linear x={str(xd)[6:]} w={str(wd)[6:]} {k}x{n}", xd, wd, k, n


def check_linear(ops, xd, wd, k, n) -> dict:
    w = rand(n, k, seed=k + n).to(wd)
    packed = pack_panels(w)
    x = rand(120, k, seed=k).to(xd)
    y = ops.linear(x, packed, n)
    ref = x.double() @ w.double().T
    alone = [ops.linear(x[i : i + 1], packed, n)[0] for i in range(len(x))]
    bad = 0
    for m in ROW_COUNTS:
        for off in (0, 3, 17):
            got = ops.linear(x[off : off + m], packed, n)
            bad += sum(not torch.equal(got[i], alone[off + i]) for i in range(len(got)))
    return {"rel_err": rel_err(y, ref), "rows_differing": bad, "bits": y}


# ---- attention ----


class PagedCase:
    """Sequences of the given lengths in a shuffled paged cache [blocks, 16, hkv, d]."""

    def __init__(self, lengths, dtype, hq=9, hkv=3, d=64, block=16, seed=0):
        self.lengths, self.hq, self.hkv, self.d, self.block = lengths, hq, hkv, d, block
        nblocks = sum(-(-n // block) for n in lengths) + 3
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(nblocks, block, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(nblocks, block, hkv, d, generator=g).to(dtype)
        order = torch.randperm(nblocks, generator=g).tolist()
        width = max(-(-n // block) for n in lengths)
        self.tables = torch.zeros(len(lengths), width, dtype=torch.int32)
        for i, n in enumerate(lengths):
            for j in range(-(-n // block)):
                self.tables[i, j] = order.pop()
        self.q = torch.randn(sum(lengths), hq, d, generator=g)
        self.starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def run(self, ops, seqs):
        """seqs: (sequence, first query position, rows); returns each one's output rows."""
        q = torch.cat([self.q[self.starts[i] + p : self.starts[i] + p + m] for i, p, m in seqs])
        loc = torch.tensor([0, *torch.tensor([m for _, _, m in seqs]).cumsum(0).tolist()])
        lens = torch.tensor([p + m for _, p, m in seqs], dtype=torch.int32)
        tables = self.tables[[i for i, _, _ in seqs]]
        out = ops.paged_attention(
            q, self.k, self.v, loc.to(torch.int32), lens, tables, self.d**-0.5
        )
        return list(out.split([m for _, _, m in seqs]))

    def reference(self, i, p, m) -> torch.Tensor:
        n = p + m
        blocks = self.tables[i, : -(-n // self.block)].long()
        k = self.k[blocks].flatten(0, 1)[:n].double()  # [n, hkv, d]
        v = self.v[blocks].flatten(0, 1)[:n].double()
        q = self.q[self.starts[i] + p : self.starts[i] + n].double()  # [m, hq, d]
        group = self.hq // self.hkv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("mhd,nhd->hmn", q, k) * self.d**-0.5
        mask = torch.arange(n)[None, :] > (torch.arange(m) + p)[:, None]
        s = s.masked_fill(mask[None], float("-inf"))
        return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


def check_attention(ops, dtype, **heads) -> dict:
    case = PagedCase([2 * 128 + 37, 5, 40, 129], dtype, **heads)
    n = case.lengths[0]
    whole = case.run(ops, [(0, 0, n)])[0]
    err = rel_err(whole, case.reference(0, 0, n))
    mixed = [(0, 60, 90), (1, 4, 1), (2, 39, 1), (3, 100, 29)]
    for (i, p, m), o in zip(mixed, case.run(ops, mixed), strict=True):
        err = max(err, rel_err(o, case.reference(i, p, m)))
    bad = 0
    for chunk in (7, 16, 33, 200):
        rows = [case.run(ops, [(0, c, min(chunk, n - c))])[0] for c in range(0, n, chunk)]
        bad += int((torch.cat(rows) != whole).flatten(1).any(1).sum())
    for pos in (0, 1, 15, 16, n - 1):
        bad += int(not torch.equal(case.run(ops, [(0, pos, 1)])[0][0], whole[pos]))
    alone = [case.run(ops, [(i, m - 1, 1)])[0][0] for i, m in enumerate(case.lengths)]
    decodes = [(i, m - 1, 1) for i, m in enumerate(case.lengths)]
    for batch in (decodes, decodes[::-1], decodes[1:], [(0, 100, 50), *decodes[1:]]):
        for (i, _, m), o in zip(batch, case.run(ops, batch), strict=True):
            if m == 1:
                bad += int(not torch.equal(o[0], alone[i]))
    return {"rel_err": err, "rows_differing": bad, "bits": whole}


# ---- timing ----


def best_ms(fn, budget_s: float = 0.25) -> float:
    fn()
    times, end = [], time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def time_paths(ops, isas: list[str], threads: list[int]) -> list[dict]:
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 16, 256):
                x = rand(m, 576, seed=m).to(dtype)
                for name, (k, n) in {
                    "gate_up": LINEAR_SHAPES["gate_up"],
                    "lm_head": (576, 49152),
                }.items():
                    packed = pack_panels(rand(n, k, seed=n).to(dtype))
                    flops = 2 * m * k * n
                    for isa in isas:
                        ops.set_isa(isa)
                        ms = best_ms(lambda x=x, p=packed, n=n: ops.linear(x, p, n))
                        rows.append({"op": f"linear {name}", "dtype": str(dtype)[6:], "rows": m,
                                     "threads": t, "isa": isa, "ms": ms,
                                     "gflops": flops / ms / 1e6})  # fmt: skip
            case = PagedCase([1000] * 16, dtype, seed=5)
            seqs = [(i, 999, 1) for i in range(16)]
            for isa in isas:
                ops.set_isa(isa)
                ms = best_ms(lambda c=case, s=seqs: c.run(ops, s))
                rows.append({"op": "attention decode 16 x 1000", "dtype": str(dtype)[6:],
                             "rows": 16, "threads": t, "isa": isa, "ms": ms})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    started = time.time()
    cpu_native = load_cpu_native()
    report = {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(),
              "torch": torch.__version__, "python": sys.version.split()[0]}  # fmt: skip
    t = time.time()
    if not cpu_native.load():
        print(json.dumps(report | {"error": "native kernels did not build"}))
        return 1
    ops = cpu_native.ops()
    report["build_s"] = round(time.time() - t, 1)
    isas = list(ops.supported_isas())
    report["isas"] = isas
    print(json.dumps(report), flush=True)
    checks, bits = [], {}
    ok = True
    for isa in isas:
        ops.set_isa(isa)
        cases = [(name, lambda a=a: check_linear(ops, *a)) for name, *a in linear_cases()]
        cases += [(f"attention {str(d)[6:]}", lambda d=d: check_attention(ops, d))
                  for d in (torch.float32, torch.bfloat16)]  # fmt: skip
        # a head size of 16 k + 8: the AVX-512 path's half-register tail
        cases.append(
            (
                "attention float32 d=72",
                lambda: check_attention(ops, torch.float32, hq=4, hkv=2, d=72),
            )
        )
        for name, run in cases:
            r = run()
            bits[(isa, name)] = r.pop("bits")
            # inputs are exact in every dtype tried, so only float32 accumulation errs
            r["ok"] = r["rows_differing"] == 0 and r["rel_err"] < 1e-5
            ok &= r["ok"]
            checks.append({"isa": isa, "check": name} | r)
            print(json.dumps(checks[-1]), flush=True)
    same = {}
    for (isa, name), y in bits.items():
        if isa != isas[0]:
            same[f"{name}: {isa} == {isas[0]}"] = bool(torch.equal(y, bits[(isas[0], name)]))
    report |= {"checks": checks, "same_bits_as_first_path": same, "all_ok": ok}
    print(json.dumps({"same_bits_as_first_path": same, "all_ok": ok}), flush=True)
    if not args.no_timing:
        cores = os.cpu_count() or 1
        report["timing"] = time_paths(ops, isas, sorted({1, cores}))
        for row in report["timing"]:
            print(json.dumps(row), flush=True)
    report["wall_s"] = round(time.time() - started, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"all_ok": ok, "wall_s": report["wall_s"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
