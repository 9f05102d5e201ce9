"""The `--batch-invariant` matmul and decode attention at decode sizes, read cold (issue 31).

tile_bits.py times one weight over and over in a CUDA graph, so a 12 MB projection sits in the
H100's 50 MB L2 and reads at L2 speed; a decode step reads each weight once, from HBM. Here every
candidate runs over enough copies of its weight to pass L2, in one graph, beside cuBLAS over the
same copies. Sections (`--only`):
- policy: the landed `matmul.linear` / `bmm` on every decode weight and the router's float32
  gate, rows of 1 / 17 / 64 / 65-row calls bit for bit against a 2,000-row call, timed cold;
- router: the float32 gate's candidate tiles per chunk, bits against its own tile at 2,000 rows;
- matmul: the K chunk (the weight's own property: any chunk keeps a row's bits as long as every
  M uses it) x the decode tile (rows, columns, BLOCK_K, warps, stages) x split or inline mode,
  at M = 1 on V2-Lite's decode weights; each chunk's M = 1 row is compared bit for bit with the
  prefill tile's at 2,000 rows, and the chunk is also timed at M = 64 and 2,000 (the weight's own
  and the prefill tile);
- attention: `_invariant_split_kernel`'s stages at batch 1 and 64 (MLA's 16 x 576 latent),
  each output compared bit for bit with the landed launch; prefill_split: the flag's prefill
  attention at SPLIT 512 / 256 / 128;
- speed: V2-Lite decode at batch 1 / 64 and a 2,000-token prefill, flag off and on;
- step: the engine: one batch-1 decode step of the V2-Lite shape under the flag and without, profiled
  launch by launch (name and device us, in order), so a step's matmul time splits by weight.

From the repo root on the GPU machine:

    ns=/tmp/deepserve-ns/deepserve; mkdir -p $ns
    for r in engine kernels server kvcache router disagg; do ln -sfn $PWD/$r $ns/$r; done
    PYTHONPATH=/tmp/deepserve-ns:$PWD/tests:$PWD/benchmarks/gpu \\
        python3 benchmarks/gpu/decode_matmul.py --out $OUT/decode_matmul.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from deepserve.kernels.triton import matmul

L2_PASS_BYTES = 160 * 2**20  # copies of a weight until a graph's pass reads this many bytes
# V2-Lite's decode weights: (K, N, heads) -> (layer, launches per step); heads > 0: a bmm
LINEARS = {
    (2048, 3648, 0): ("x_proj", 27),
    (2048, 2048, 0): ("o_proj", 27),
    (2048, 5632, 0): ("shared gate_up", 26),
    (2816, 2048, 0): ("shared down", 26),
    (2048, 21888, 0): ("dense gate_up", 1),
    (10944, 2048, 0): ("dense down", 1),
    (2048, 102400, 0): ("lm_head", 1),
    (128, 512, 16): ("w_uk bmm", 27),
    (512, 128, 16): ("w_uv bmm", 27),
}
# decode tiles: (block_n, block_k, warps, stages), 16 rows
DECODE_TILES = (
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (16, 256, 4, 3),
    (64, 64, 4, 6),
    (64, 256, 4, 3),
    (128, 128, 4, 3),
    (128, 64, 4, 4),
)
CHUNKS = (128, 256, 512, 1024)
PREFILL_TILE = dict(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3)


def graph_us(fns: list, reps: int = 3) -> float:
    """Device us per call of the calls `fns`, captured in one CUDA graph (best of `reps`)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1e3 / len(fns))
    del graph
    return best


class Operands:
    """`copies` weights of one shape and inputs of 1 / 64 / 2,000 rows, as the model passes them
    (a bmm's input is the heads-first view of [T, H, K])."""

    def __init__(self, k: int, n: int, heads: int, g: torch.Generator):
        self.k, self.n, self.heads = k, n, heads
        bytes_ = k * n * max(heads, 1) * 2
        self.copies = max(2, -(-L2_PASS_BYTES // bytes_))
        shape = (max(heads, 1), k, n)
        self.w = [
            torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(self.copies)
        ]
        if not heads:  # linear: b is w.t() of an [N, K] weight
            self.w = [w[0].t().contiguous().t()[None] for w in self.w]
        t = torch.randn(2000, max(heads, 1), k, device="cuda", generator=g).bfloat16()
        self.x = {m: t[:m].transpose(0, 1) for m in (1, 64, 2000)}  # [B, M, K]: rows of one input
        self.out = {
            m: torch.empty(max(heads, 1), m, n, device="cuda", dtype=torch.bfloat16)
            for m in (1, 64, 2000)
        }

    def calls(self, m: int, cfg: matmul.TileConfig, split: bool | None) -> list:
        return [
            lambda w=w: matmul._launch(self.x[m], w, self.out[m], cfg, split_mode=split)
            for w in self.w
        ]

    def cublas(self, m: int) -> list:
        if self.heads:
            return [lambda w=w: torch.bmm(self.x[m], w, out=self.out[m]) for w in self.w]
        return [lambda w=w: torch.mm(self.x[m][0], w[0], out=self.out[m][0]) for w in self.w]


def landed(k: int, n: int, m: int) -> matmul.TileConfig:
    return matmul.config_for(k, n, torch.bfloat16, m)


def chunk_rows(ops: Operands, kc: int, layer: str) -> list[dict]:
    """One chunk length: every decode tile at M = 1 (split and inline mode), bits against the
    prefill tile at 2,000 rows, and the chunk at 64 rows (the landed tile) and 2,000."""
    k, n = ops.k, ops.n
    base = dict(layer=layer, k=k, n=n, heads=ops.heads, chunk=kc, chunks=-(-k // kc))
    prefill = replace(landed(k, n, 2000), chunk_k=kc)
    if kc % prefill.block_k:
        prefill = replace(prefill, block_k=64)
    matmul._launch(ops.x[2000], ops.w[0], ops.out[2000], prefill, split_mode=False)
    want = ops.out[2000][:, :1].clone()
    rows = []
    for bn, bk, warps, stages in DECODE_TILES:
        if kc % bk or bn > max(16, n):
            continue
        cfg = matmul.TileConfig(16, bn, bk, 8, warps, stages, chunk_k=kc)
        for split in (True, False):
            if split and kc >= k:
                continue
            row = dict(base, m=1, tile=f"16x{bn} k{bk} w{warps} s{stages}", split=split)
            try:
                matmul._launch(ops.x[1], ops.w[0], ops.out[1], cfg, split_mode=split)
                row["equal"] = bool(torch.equal(ops.out[1], want))
                row["us"] = round(graph_us(ops.calls(1, cfg, split)), 2)
            except Exception as e:  # e.g. shared memory: recorded, not chosen
                row["error"] = str(e)[:160]
            rows.append(row)
    mid = replace(landed(k, n, 64), chunk_k=kc)
    if kc % mid.block_k == 0:
        rows.append(
            dict(base, m=64, tile="landed", us=round(graph_us(ops.calls(64, mid, None)), 2))
        )
    rows.append(
        dict(base, m=2000, tile="prefill", us=round(graph_us(ops.calls(2000, prefill, False)), 2))
    )
    return rows


def section_matmul(out: dict, deadline: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    res = out.setdefault("matmul", [])
    for (k, n, heads), (layer, per_step) in LINEARS.items():
        if time.time() > deadline:
            out["errors"].append(f"matmul: out of time before {layer}")
            return
        ops = Operands(k, n, heads, g)
        base = dict(layer=layer, k=k, n=n, heads=heads, per_step=per_step, copies=ops.copies)
        for m in (1, 64, 2000):
            res.append(dict(base, m=m, tile="cublas", us=round(graph_us(ops.cublas(m)), 2)))
            cfg = landed(k, n, m)
            res.append(dict(base, m=m, tile="landed " + repr(cfg), chunk=cfg.chunk(k),
                            us=round(graph_us(ops.calls(m, cfg, None)), 2)))  # fmt: skip
            print(res[-2], res[-1], flush=True)
        chunks = sorted({c for c in CHUNKS if c < k} | {landed(k, n, 1).chunk(k), k})
        for kc in chunks:
            rows = chunk_rows(ops, kc, layer)
            res.extend(rows)
            timed = [r for r in rows if r.get("m") == 1 and "us" in r]
            best = min(timed, key=lambda r: r["us"]) if timed else None
            print(kc, best, [r for r in rows if r["m"] != 1], flush=True)
        del ops
        torch.cuda.empty_cache()


ROUTER = (2048, 64)  # V2-Lite's float32 gate over 64 experts
ROUTER_TILES = (  # (block_m, block_n, block_k, warps, stages)
    (64, 64, 64, 4, 4),
    (16, 16, 32, 4, 3),
    (16, 16, 64, 4, 3),
    (16, 32, 32, 4, 3),
    (16, 64, 32, 4, 3),
    (16, 16, 32, 2, 3),
    (16, 16, 16, 1, 3),
)


def section_policy(out: dict) -> None:
    """The landed policy (`matmul.linear` / `bmm` as the flag calls them) on every decode weight
    and the router's float32 gate: each row of a 1 / 17 / 64 / 65-row call bit for bit against
    the same row of a 2,000-row call, and the 1-row call timed cold beside cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(13)
    res = out.setdefault("policy", [])
    shapes = {**LINEARS, (*ROUTER, 0): ("router (float32)", 26)}
    for (k, n, heads), (layer, per_step) in shapes.items():
        dtype = torch.float32 if (k, n) == ROUTER else torch.bfloat16
        w = torch.randn(max(heads, 1), k, n, device="cuda", generator=g).to(dtype)
        t = torch.randn(2000, max(heads, 1), k, device="cuda", generator=g).to(dtype)
        if heads:
            call = lambda m, w=w, t=t: matmul.bmm(t[:m].transpose(0, 1), w)  # noqa: E731
        else:
            wt = w[0].t().contiguous()
            call = lambda m, wt=wt, t=t: matmul.linear(t[:m, 0], wt)[:, None].transpose(0, 1)  # noqa: E731
        full = call(2000)
        equal = {m: bool(torch.equal(call(m), full[:, :m])) for m in (1, 17, 64, 65)}
        row = dict(layer=layer, k=k, n=n, heads=heads, per_step=per_step, equal=equal)
        copies = max(2, -(-L2_PASS_BYTES // w.numel() // w.element_size()))
        ws = [w.clone() for _ in range(copies)]
        x1 = t[:1].transpose(0, 1)
        if heads:
            row["us"] = graph_us([lambda v=v, x1=x1: matmul.bmm(x1, v) for v in ws])
            row["cublas_us"] = graph_us([lambda v=v, x1=x1: torch.bmm(x1, v) for v in ws])
        else:
            wts = [v[0].t().contiguous() for v in ws]
            row["us"] = graph_us([lambda v=v, x1=x1: matmul.linear(x1[0], v) for v in wts])
            row["cublas_us"] = graph_us(
                [lambda v=v, x1=x1: torch.nn.functional.linear(x1[0], v) for v in wts]
            )
        res.append(row)
        print(row, flush=True)
        del ws
    torch.cuda.empty_cache()


def section_router(out: dict) -> None:
    """The float32 gate's tiles at 1 / 64 rows, each chunk's row bits against the 64 x 64 tile
    at 2,000 rows (FMA chains over K in order: the tile should not enter them)."""
    g = torch.Generator(device="cuda").manual_seed(17)
    k, n = ROUTER
    ops = Operands(k, n, 0, g)
    ops.w = [w.float() for w in ops.w]
    ops.x = {m: x.float() for m, x in ops.x.items()}
    ops.out = {m: o.float() for m, o in ops.out.items()}
    res = out.setdefault("router", [])
    res.append(dict(tile="cublas", m=1, us=round(graph_us(ops.cublas(1)), 2)))
    for kc in (128, 256, 512, 2048):
        big = matmul.TileConfig(64, 64, 64, 8, 4, 4, chunk_k=kc)
        matmul._launch(ops.x[2000], ops.w[0], ops.out[2000], big, split_mode=False)
        want = ops.out[2000][:, :64].clone()
        for bm, bn, bk, warps, stages in ROUTER_TILES:
            cfg = matmul.TileConfig(bm, bn, bk, 8, warps, stages, chunk_k=kc)
            for m in (1, 64):
                row = dict(chunk=kc, m=m, tile=f"{bm}x{bn} k{bk} w{warps} s{stages}")
                try:
                    matmul._launch(ops.x[m], ops.w[0], ops.out[m], cfg)
                    row["equal"] = bool(torch.equal(ops.out[m], want[:, :m]))
                    row["us"] = round(graph_us(ops.calls(m, cfg, None)), 2)
                except Exception as e:
                    row["error"] = str(e)[:160]
                res.append(row)
                print(row, flush=True)


def section_attention(out: dict) -> None:
    """The invariant decode over MLA's latent at batch 1 / 64, contexts 200 and 2,000: launch
    variants against the landed one, bits and cold-ish us (each layer's cache is its own)."""
    from deepserve.kernels.attention_metadata import AttentionMetadata
    from deepserve.kernels.triton import decode_attention as da

    res = out.setdefault("attention", [])
    g = torch.Generator(device="cuda").manual_seed(3)
    layers, block = 27, 64
    for batch, ctx in ((1, 200), (1, 2000), (64, 600)):
        width = 64 if batch == 1 else 16  # the graph's table: a 4K-token row at batch 1
        blocks = batch * width
        caches = [
            torch.randn(blocks, block, 1, 576, device="cuda", generator=g).bfloat16()
            for _ in range(layers)
        ]
        tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, width)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        attn = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
            seq_lens=lens, context_lens=lens - 1,
            slot_mapping=torch.zeros(batch, device="cuda", dtype=torch.int64),
            block_tables=tables, block_size=block, query_lens_cpu=[1] * batch,
            seq_lens_cpu=[ctx] * batch, context_lens_cpu=[ctx - 1] * batch,
        )  # fmt: skip
        q = torch.randn(batch, 16, 576, device="cuda", generator=g).bfloat16()

        def run(cache, q=q, attn=attn, **kw):
            return da.invariant_decode_attention(q, cache, cache[..., :512], attn, 0.1, **kw)

        want = run(caches[0])
        variants = {"landed": {}}
        for stages in (2, 5, 6):
            variants[f"w4 s{stages}"] = dict(num_warps=4, num_stages=stages)
        for name, kw in variants.items():
            row = dict(batch=batch, ctx=ctx, variant=name)
            try:
                got = run(caches[0], **kw)
                row["equal"] = bool(torch.equal(got, want))
                row["us"] = round(graph_us([lambda c=c, kw=kw: run(c, **kw) for c in caches]), 2)
            except Exception as e:
                row["error"] = str(e)[:160]
            res.append(row)
            print(row, flush=True)


def section_prefill_split(out: dict) -> None:
    """What the flag's prefill attention (32 (token, head) rows, 8 warps) costs at SPLIT 512 /
    256 / 128: one 2,000-token prompt over MLA's latent, one layer."""
    from deepserve.kernels.attention_metadata import AttentionMetadata
    from deepserve.kernels.triton import attention

    g = torch.Generator(device="cuda").manual_seed(5)
    n, block = 2000, 64
    width = -(-n // block)
    cache = torch.randn(width, block, 1, 576, device="cuda", generator=g).bfloat16()
    q = torch.randn(n, 16, 576, device="cuda", generator=g).bfloat16()
    i32 = dict(device="cuda", dtype=torch.int32)
    attn = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], **i32), seq_lens=torch.tensor([n], **i32),
        context_lens=torch.tensor([0], **i32),
        slot_mapping=torch.zeros(n, device="cuda", dtype=torch.int64),
        block_tables=torch.arange(width, **i32)[None], block_size=block, query_lens_cpu=[n],
        seq_lens_cpu=[n], context_lens_cpu=[0],
    )  # fmt: skip
    for split in (512, 256, 128):
        op = attention.TritonPagedAttention(split, grouped_rows=32, grouped_warps=8)
        us = graph_us([lambda op=op: op(q, cache, cache[..., :512], attn, 0.1)] * 3)
        out.setdefault("prefill_split", []).append(dict(split=split, us=round(us, 1)))
        print(out["prefill_split"][-1], flush=True)


def section_speed(out: dict, profile_prefill: bool = False) -> None:
    """V2-Lite shape, bf16: decode tokens/s at batch 1 and 64 and a 2,000-token prefill, the
    default set and the flag side by side (speed.py's measurements, without transformers' rows:
    the short form of run_all.sh's `speed` section); with `profile_prefill`, the prefill's
    kernels too."""
    import speed

    config = speed.SHAPES["v2-lite"]
    hf = speed.build_hf(config)
    vocab = config["vocab_size"]
    for flag in (False, True):
        rng = random.Random(3)
        llm = speed.build_llm(config, hf, flag, "bf16", max_model_len=4096)
        row = dict(batch_invariant=flag)
        for b in (1, 64):
            row[f"decode_b{b}_tok_s"] = round(speed.engine_decode_tok_s(llm, b, vocab, rng, 128), 1)
        row["prefill_2000_tok_s"] = round(speed.engine_prefill_tok_s(llm, vocab, rng, 2000))
        if profile_prefill:
            row["prefill_profile"] = speed.profile_prefill(llm, vocab, rng, 2000)
        out.setdefault("speed", []).append(row)
        print(row, flush=True)
        llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()


def section_step(out: dict) -> None:
    """One batch-1 decode step of the V2-Lite shape, flag off and on: every kernel in order."""
    import speed
    from torch.profiler import ProfilerActivity, profile

    config = speed.SHAPES["v2-lite"]
    hf = speed.build_hf(config)
    rng = random.Random(3)
    for flag in (False, True):
        llm = speed.build_llm(config, hf, flag, "bf16", max_model_len=4096)
        tok_s = speed.engine_decode_tok_s(llm, 1, config["vocab_size"], rng, 64)
        engine = llm.engine
        engine.add_request(
            "prof", speed.prompts(rng, 1, 128, config["vocab_size"])[0], speed.greedy(64)
        )
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
        kernels = [
            (e.time_range.start, e.name[:60], round(e.device_time, 2))
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
        ]
        kernels.sort()
        out.setdefault("step", []).append(
            dict(batch_invariant=flag, decode_tok_s=tok_s, kernels=[k[1:] for k in kernels])
        )
        print(flag, tok_s, len(kernels), sum(k[2] for k in kernels), flush=True)
        llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--only",
        nargs="*",
        default=["policy", "router", "attention", "prefill_split", "matmul", "step"],
    )
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--prefill-profile", action="store_true", help="speed: profile the prefill")
    args = p.parse_args()
    deadline = time.time() + args.budget_s
    out: dict = {"errors": [], "gpu": torch.cuda.get_device_name()}
    for name, fn in (
        ("policy", lambda: section_policy(out)),
        ("router", lambda: section_router(out)),
        ("attention", lambda: section_attention(out)),
        ("prefill_split", lambda: section_prefill_split(out)),
        ("matmul", lambda: section_matmul(out, deadline)),
        ("speed", lambda: section_speed(out, args.prefill_profile)),
        ("step", lambda: section_step(out)),
    ):
        if name not in args.only:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception:
            import traceback

            out["errors"].append(f"{name}: {traceback.format_exc()[-1500:]}")
        out[f"seconds_{name}"] = round(time.time() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["errors"]))


if __name__ == "__main__":
    main()
