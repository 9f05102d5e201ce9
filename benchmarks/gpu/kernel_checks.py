"""The GPU kernels of the default path against their torch oracles, on fresh random inputs:
the fused rope + KV write (GQA) and absorbed query (MLA) against the torch ops (bitwise), fused MoE
(decode and prefill tiles) against a float32 loop, the decode attention kernel (MLA and
GQA layouts, shuffled block tables) against kernels/reference/attention.py, the fixed-split kernel's
device-side decode layout against its host layout (bitwise), and graph-replayed decode steps
against eager ones; the decompressed MLA prefill's flash attention against torch's SDPA (V2-Lite
geometry: a 2,000-token prompt, an 8,192-token chunk over 32,768), and V2-Lite prefill's
fused-MoE tiles, attention row tiles and long-context decode splits, timed. `run_v4`
(section v4_checks): DeepSeek-V4's sparse attention, indexer top-k, compressor pooling,
hyper-connections, sqrtsoftplus / hash routing and interleaved rope at V4-Flash sizes against
float32 torch (the rope bitwise against its composition), bitwise batch invariance, graph
replay, ms and GB/s.
`run_fp8` (`--only fp8`): the block-scaled FP8 GEMM on V3 / V4 / V2-Lite projection shapes and
the FP8 / MXFP4 fused MoE against dequantized references, timed beside bf16 (MXFP4's two e2m1
decodes, integer and PTX, side by side and its tiles swept: `check_mxfp4_moe`), V3 / V4 models on
kept FP8 / MXFP4 weights, and the default set's few-row FP8 path (GEMV) against the GEMM and
bf16 at M = 1..64.
`run_kv_fp8` (`--only kv_fp8`): `--kv-cache-dtype fp8` on the device: every Triton attention
kernel over an e4m3 cache against itself over the widened cache (bitwise) and the float32
reference, the fused KV writes' codes against torch's, decode attention timed over bf16 and e4m3
caches (V2-Lite's latent, SmolLM2's GQA) at long contexts, and a 4-layer V2-Lite-shaped engine
decoding batch 64 at a 4K context with either cache. Imported by
run_all.py; returns rows of max relative errors."""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.reference.sparse_attention import compress_pool as reference_compress_pool
from deepserve.kernels.triton.flash_prefill import FlashConfig, flash_prefill


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_moe(rows: list) -> None:
    from deepserve.kernels.triton import fused_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 64, 2048, 1408, 6
    for dtype in (torch.bfloat16, torch.float32):
        gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=dtype) / h**0.5
        down = torch.randn(e, h, i, device="cuda", generator=g, dtype=dtype) / i**0.5
        for t in (1, 5, 64, 300):
            x = torch.randn(t, h, device="cuda", generator=g, dtype=dtype)
            ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1)[1]
            w = torch.rand(t, k, device="cuda", generator=g)
            want = fused_moe.fused_moe_reference(x, gate_up, down, w, ids)
            cfgs = (
                ("decode", fused_moe.DECODE),
                ("prefill", fused_moe.PREFILL),
                ("large", fused_moe.LARGE),
            )
            for cname, cfg in cfgs:
                got = fused_moe.fused_moe(x, gate_up, down, w, ids, cfg)
                rows.append(dict(op="fused_moe", dtype=str(dtype), tokens=t, cfg=cname,
                                 rel_err=rel(got, want), nan=bool(got.isnan().any())))  # fmt: skip
            shared = torch.randn(t, h, device="cuda", generator=g, dtype=dtype)
            plus = fused_moe.fused_moe(x, gate_up, down, w, ids, add=shared)
            alone = fused_moe.fused_moe(x, gate_up, down, w, ids)
            rows.append(dict(op="fused_moe_add_shared", dtype=str(dtype), tokens=t,
                             equal=bool(torch.equal(plus, alone + shared))))  # fmt: skip
            # batch invariance of the fixed tile: a row alone equals the row in the batch
            full = fused_moe.fused_moe(x, gate_up, down, w, ids, fused_moe.DECODE)
            one = fused_moe.fused_moe(x[:1], gate_up, down, w[:1], ids[:1], fused_moe.DECODE)
            rows.append(dict(op="fused_moe_row_invariant", dtype=str(dtype), tokens=t,
                             equal=bool(torch.equal(full[:1], one))))  # fmt: skip


def _metadata(lens: list[int], block_size: int, num_blocks: int, gen) -> AttentionMetadata:
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device="cuda")  # noqa: E731
    return AttentionMetadata(
        query_start_loc=t(list(range(len(lens) + 1))),
        seq_lens=t(lens),
        context_lens=t([n - 1 for n in lens]),
        slot_mapping=t([0] * len(lens), torch.int64),
        block_tables=perm.to(torch.int32).cuda(),
        block_size=block_size,
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
        context_lens_cpu=[n - 1 for n in lens],
    )


def _decode_case(layout: str, dtype, lens: list[int], bs: int, nb: int, gen):
    """A decode step's query and shuffled paged caches: MLA's (16 heads over one latent "head",
    V its leading 512 columns) or a GQA's (9 query heads over 3 KV heads of 64)."""
    if layout == "mla":
        cache = torch.randn(nb, bs, 576, generator=gen).to("cuda", dtype).unsqueeze(2)
        k_cache, v_cache, hq = cache, cache[..., :512], 16
    else:
        cache = torch.randn(nb, bs, 2 * 3 * 64, generator=gen).to("cuda", dtype)
        k_cache = cache[..., :192].unflatten(-1, (3, 64))
        v_cache = cache[..., 192:].unflatten(-1, (3, 64))
        hq = 9
    q = torch.randn(len(lens), hq, k_cache.shape[-1], generator=gen).to("cuda", dtype)
    return q, k_cache, v_cache, _metadata(lens, bs, nb, gen)


def check_decode_attention(rows: list) -> None:
    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(1)
    bs, nb = 16, 9000
    for layout in ("mla", "gqa"):
        for dtype in (torch.bfloat16, torch.float32):
            for lens in ([1], [7, 300, 33], [1000] * 4, [17] * 64 + [2000]):
                q, k_cache, v_cache, attn = _decode_case(layout, dtype, lens, bs, nb, gen)
                want = attention_ref.paged_attention(q, k_cache, v_cache, attn, 0.07)
                got = decode_attention(q, k_cache, v_cache, attn, 0.07)
                rows.append(dict(op="decode_attention", layout=layout, dtype=str(dtype),
                                 lens=str(lens[:4]), rel_err=rel(got, want)))  # fmt: skip
                inv = attention.TritonPagedAttention()
                dev = inv(q, k_cache, v_cache, attn, 0.07)
                inv._layout = None
                host = inv._host_layout(attn, q.device)
                inv._layout = host
                ref = inv(q, k_cache, v_cache, attn, 0.07)
                rows.append(dict(op="invariant_decode_layout", layout=layout, dtype=str(dtype),
                                 lens=str(lens[:4]), equal=bool(torch.equal(dev, ref)),
                                 rel_err=rel(dev, want)))  # fmt: skip


def check_fused_rows(rows: list) -> None:
    """Residual add + RMSNorm and silu(gate) * up in one launch each, against the unfused ops
    (the add must round as torch's does; the norm must equal the Triton rms_norm bitwise)."""
    import torch.nn.functional as F

    from deepserve.kernels.triton import rows as row_ops

    g = torch.Generator(device="cuda").manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32):
        for t, d in ((1, 2048), (64, 576), (2000, 2048)):
            h = torch.randn(t, d, device="cuda", generator=g).to(dtype)
            delta = torch.randn(t, d, device="cuda", generator=g).to(dtype)
            w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(dtype)
            want_h = h + delta
            want = row_ops.rms_norm(want_h, w, 1e-6)
            got = row_ops.add_rms_norm_(h, delta, w, 1e-6)
            rows.append(dict(op="add_rms_norm_", dtype=str(dtype), tokens=t, d=d,
                             h_equal=bool(torch.equal(h, want_h)),
                             equal=bool(torch.equal(got, want))))  # fmt: skip
        for t, i in ((1, 1408 * 2), (64, 1536), (2000, 10944)):
            gu = torch.randn(t, 2 * i, device="cuda", generator=g).to(dtype)
            gate, up = gu.chunk(2, dim=-1)
            got = row_ops.silu_mul(gu)
            rows.append(dict(op="silu_mul", dtype=str(dtype), tokens=t, d=i,
                             rel_err=rel(got, F.silu(gate) * up)))  # fmt: skip


def check_routing(rows: list) -> None:
    """The one-launch MoE routing against kernels/reference/moe_routing.py's composition
    (V2-Lite's and V3's settings); a row alone must equal the same row in a batch."""
    from deepserve.kernels.reference import moe_routing
    from deepserve.kernels.triton import routing

    g = torch.Generator(device="cuda").manual_seed(3)
    specs = {
        "v2-lite": (64, moe_routing.RouteSpec("sigmoid", 1, 1, 6, False, 1.0), False),
        "v2-softmax": (64, moe_routing.RouteSpec("softmax", 1, 1, 6, True, 1.0), False),
        "v3": (256, moe_routing.RouteSpec("sigmoid", 8, 4, 8, True, 2.5), True),
    }
    for name, (e, spec, has_bias) in specs.items():
        bias = torch.randn(e, device="cuda", generator=g) * 0.1 if has_bias else None
        for t in (1, 64, 2048):
            logits = torch.randn(t, e, device="cuda", generator=g)
            w0, i0 = moe_routing.route(logits, bias, spec)
            w1, i1 = routing.route(logits, bias, spec)
            one = routing.route(logits[-1:], bias, spec)
            rows.append(dict(op="moe_route", cfg=name, tokens=t,
                             ids_equal=float((i0 == i1).all(-1).float().mean()),
                             rel_err=rel(w1, w0), row_invariant=bool(torch.equal(one[0], w1[-1:]))))  # fmt: skip


def check_rope_kernels(rows: list) -> None:
    """The GQA fused rope + KV write against apply_rope + write_kv (bitwise, as torch rounds
    each op), and MLA's absorbed query against rope_into_ + the latent copy (bitwise)."""
    from deepserve.kernels.reference.attention import write_kv
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import mla, rope

    g = torch.Generator(device="cuda").manual_seed(4)
    hq, hkv, d = 9, 3, 64  # SmolLM2
    tables = build_rope_tables(d, 10000.0, None, 4096, "cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for t in (1, 32, 2000):
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
            pos = torch.randperm(4096, device="cuda", generator=g)[:t]
            cos, sin = rope_at(tables, pos, dtype)
            layer = torch.randn(300, 16, 2 * hkv * d, device="cuda", generator=g).to(dtype)
            want_layer = layer.clone()
            k_c, v_c = (c.unflatten(-1, (hkv, d)) for c in layer.chunk(2, dim=-1))
            wk_c, wv_c = (c.unflatten(-1, (hkv, d)) for c in want_layer.chunk(2, dim=-1))
            slots = torch.randperm(300 * 16, device="cuda", generator=g)[:t]
            qk = apply_rope(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
            write_kv(wk_c, slots, qk[:, hq:])
            write_kv(wv_c, slots, qkv[:, (hq + hkv) * d :].view(t, hkv, d))
            ok = rope.rope_qk_write_kv_(qkv, cos, sin, k_c, v_c, slots, hq)
            q_equal = torch.equal(qkv[:, : hq * d].view(t, hq, d), qk[:, :hq])
            rows.append(dict(op="rope_qk_write_kv_", dtype=str(dtype), tokens=t, used=ok,
                             q_equal=q_equal, cache_equal=torch.equal(layer, want_layer)))  # fmt: skip
    heads, lora, nope, r = 16, 512, 128, 64  # V2-Lite
    tables = build_rope_tables(r, 10000.0, None, 4096, "cuda")
    for t in (1, 64, 2000):
        q = torch.randn(t, heads, nope + r, device="cuda", generator=g, dtype=torch.bfloat16)
        latent = torch.randn(heads, t, lora, device="cuda", generator=g, dtype=torch.bfloat16)
        cos, sin = rope_at(tables, torch.arange(t, device="cuda"), torch.bfloat16)
        want = q.new_zeros(t, heads, lora + r)
        mla.rope_into_(q[..., nope:], cos, sin, want[..., lora:])
        want[..., :lora] = latent.transpose(0, 1)
        got = q.new_zeros(t, heads, lora + r)
        ok = mla.absorbed_query_(latent.transpose(0, 1), q[..., nope:], cos, sin, got)
        torch_rope = apply_rope(q[..., nope:], cos, sin)
        rows.append(dict(op="absorbed_query_", tokens=t, used=ok, equal=torch.equal(got, want),
                         rel_err_vs_torch_rope=rel(got[..., lora:], torch_rope)))  # fmt: skip


def _timed(row: dict, fn, want: torch.Tensor, part) -> None:
    """`row` gains fn's error against `want` (on `part` of its output) and its median ms by CUDA
    events, or the error text of a configuration that does not build."""
    import triton.testing

    try:
        row["rel_err"] = rel(part(fn()), want)
        row["ms"] = triton.testing.do_bench(fn, return_mode="median")
    except Exception as exc:  # e.g. a tile over the shared memory: recorded, the rest go on
        row["error"] = str(exc)[-200:]


def time_prefill_tiles(rows: list) -> None:
    """V2-Lite's 2,000-token prefill: the fused MoE (64 experts, top-6) under candidate tiles
    and the varlen attention (MLA: one 576-wide latent head, 16 query heads) under candidate
    row tiles, splits and warps, each against a float32 reference."""
    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton import attention, fused_moe

    g = torch.Generator(device="cuda").manual_seed(5)
    e, h, i, k, t = 64, 2048, 1408, 6, 2000
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
    down = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1)[1]
    w = torch.rand(t, k, device="cuda", generator=g)
    want = fused_moe.fused_moe_reference(x[:8], gate_up, down, w[:8], ids[:8])
    cfgs = {
        "prefill": fused_moe.PREFILL,
        "64x128x64w4s4": fused_moe.MoeConfig(64, 128, 64, 4, 4),
        "128x128x64w8s3": fused_moe.MoeConfig(128, 128, 64, 8, 3),
        "128x128x64w4s4": fused_moe.MoeConfig(128, 128, 64, 4, 4),
        "64x256x64w8s3": fused_moe.MoeConfig(64, 256, 64, 8, 3),
        "128x256x64w8s3": fused_moe.MoeConfig(128, 256, 64, 8, 3),
        "64x128x128w8s3": fused_moe.MoeConfig(64, 128, 128, 8, 3),
        "128x64x64w4s4": fused_moe.MoeConfig(128, 64, 64, 4, 4),
    }
    for name, cfg in cfgs.items():
        fn = lambda cfg=cfg: fused_moe.fused_moe(x, gate_up, down, w, ids, cfg)  # noqa: E731
        row = dict(op="moe_prefill_tile", cfg=name, tokens=t)
        _timed(row, fn, want, lambda y: y[:8])
        rows.append(row)
    k_cache = torch.randn(130, 16, 1, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    v_cache = k_cache[..., :512]
    q = torch.randn(t, 16, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    attn = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([t], dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor([0], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.arange(t, device="cuda"),
        block_tables=torch.randperm(130, device="cuda", generator=g)[None].to(torch.int32),
        block_size=16, query_lens_cpu=[t], seq_lens_cpu=[t], context_lens_cpu=[0],
    )  # fmt: skip
    want = attention_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, 0.1)
    for split, block_m, warps in ((512, 16, 4), (2048, 16, 4), (512, 32, 4), (512, 64, 4),
                                  (512, 64, 8), (2048, 64, 8), (512, 128, 8)):  # fmt: skip
        kernel = attention.TritonPagedAttention(split, block_m, warps)
        fn = lambda kernel=kernel: kernel(q, k_cache, v_cache, attn, 0.1)  # noqa: E731
        row = dict(op="mla_prefill_attention", split=split, block_m=block_m, warps=warps)
        _timed(row, fn, want, lambda y: y)
        rows.append(row)


def _flash_case(ctx: int, chunk: int, g):
    """One sequence's chunk at V2-Lite's decompressed geometry (16 heads, 128 no-rope + 64 rope
    query/key dims, one rope key shared by the heads, 128 value dims), bf16, and its varlen."""
    from deepserve.kernels.attention_metadata import CausalVarlen

    heads, keys = 16, ctx + chunk
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(chunk, heads, 192, generator=g, **bf)
    kv = torch.randn(keys, heads, 256, generator=g, **bf)  # [k_nope | v], as kv_b's matmul gives
    k_rope = torch.randn(keys, 1, 64, generator=g, **bf).expand(-1, heads, -1)
    t = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    seqs = CausalVarlen(t([0, chunk]), t([0, keys]), t([ctx]), [chunk])
    return q, kv[..., :128], k_rope, kv[..., 128:], seqs


def _sdpa_operands(q, k_nope, k_rope, v, ctx: int, rows: torch.Tensor, dtype):
    """torch SDPA's operands for query `rows` of a chunk after `ctx` keys: [H, rows, D] q,
    [H, L, D] k and v, and the causal mask, in `dtype`."""
    k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1).to(dtype)
    mask = torch.arange(k.shape[1], device="cuda")[None, :] <= ctx + rows[:, None]
    return q[rows].transpose(0, 1).to(dtype), k, v.transpose(0, 1).to(dtype), mask


FLASH_CANDIDATES = {  # block_m, block_n, num_warps, num_stages
    "default": FlashConfig(),
    "m128w8s2": FlashConfig(128, 64, 8, 2),
    "m64w4s2": FlashConfig(64, 64, 4, 2),
    "m64w4s3": FlashConfig(64, 64, 4, 3),
    "m128n32w8s2": FlashConfig(128, 32, 8, 2),
}


def check_flash_prefill(rows: list, cases=((0, 2000), (32768, 8192))) -> None:
    """kernels/triton/flash_prefill.py at V2-Lite's decompressed geometry: a fresh 2,000-token
    prompt and an 8,192-token chunk over 32,768 cached tokens, against torch's SDPA in float32
    (sampled rows of the chunk), timed (median of do_bench) under candidate tiles beside torch's
    SDPA in bf16 with the same causal mask; TFLOP/s counts the visible (query, key) pairs; and
    the decompression matmul over the chunk's context."""
    g = torch.Generator(device="cuda").manual_seed(11)
    for ctx, chunk in cases:
        _flash_rows(rows, ctx, chunk, g)


def _flash_rows(rows: list, ctx: int, chunk: int, g) -> None:
    import torch.nn.functional as F
    import triton.testing

    scale = 192**-0.5
    q, k_nope, k_rope, v, seqs = _flash_case(ctx, chunk, g)
    pick = torch.tensor([0, 1, 63, 64, 777, chunk // 2, chunk - 2, chunk - 1], device="cuda")
    pick = pick[pick < chunk] if ctx else torch.arange(chunk, device="cuda")
    ref = _sdpa_operands(q, k_nope, k_rope, v, ctx, pick, torch.float32)
    want = F.scaled_dot_product_attention(*ref, scale=scale).transpose(0, 1)
    del ref
    flops = 2 * 16 * (192 + 128) * (chunk * ctx + chunk * (chunk + 1) // 2)

    def timed(row: dict, fn, part) -> None:
        _timed(row, fn, want, part)
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
        rows.append(row)
        print(row, flush=True)

    for name, cfg in FLASH_CANDIDATES.items():

        def fn(c: FlashConfig = cfg) -> torch.Tensor:
            return flash_prefill(q[..., :128], q[..., 128:], k_nope, k_rope, v, seqs, scale, c)

        timed(dict(op="flash_prefill", ctx=ctx, chunk=chunk, cfg=name), fn, lambda y: y[pick])
    sdpa = _sdpa_operands(q, k_nope, k_rope, v, ctx, torch.arange(chunk, device="cuda"), q.dtype)
    fn = lambda: F.scaled_dot_product_attention(*sdpa, scale=scale)  # noqa: E731
    row = dict(op="flash_prefill_vs_torch_sdpa_bf16", ctx=ctx, chunk=chunk)
    timed(row, fn, lambda y: y.transpose(0, 1)[pick])
    kv_b = torch.randn(16 * 256, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    latent = torch.randn(ctx + chunk, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    ms = triton.testing.do_bench(lambda: F.linear(latent[:, :512], kv_b), return_mode="median")
    rows.append(dict(op="mla_decompress_matmul", keys=ctx + chunk, ms=ms,
                     tflops=round(2 * (ctx + chunk) * 512 * 4096 / ms / 1e9, 1)))  # fmt: skip


def time_long_decode(rows: list) -> None:
    """The default decode attention at batch 1 over 32K and 131K-token MLA contexts (V2-Lite: 16
    heads over the 576-wide latent): decode_attention.py's split widths against the old cap of
    32 splits (`min_split_keys` past any length gives it back) and two other minimum widths,
    timed, each with its error against the reference."""
    gen = torch.Generator().manual_seed(12)
    for length in (32768, 131072):
        _long_decode_rows(rows, length, gen)


def _long_decode_rows(rows: list, length: int, gen) -> None:
    import triton.testing

    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton.decode_attention import decode_attention

    q, k_cache, v_cache, attn = _decode_case("mla", torch.bfloat16, [length], 16, length // 16 + 8, gen)  # fmt: skip
    want = attention_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, 0.07)
    for name, keys in (("cap32 (before)", 2**30), ("min256 (default)", 256), ("min512", 512),
                       ("min1024", 1024)):  # fmt: skip
        fn = lambda k=keys: decode_attention(q, k_cache, v_cache, attn, 0.07, k)  # noqa: E731
        err = rel(fn(), want)
        ms = triton.testing.do_bench(fn, return_mode="median")
        rows.append(dict(op="long_decode_splits", ctx=length, splits=name,
                         us=round(ms * 1000, 1), rel_err=err))  # fmt: skip
        print(rows[-1], flush=True)


DECODE_TILE_CASES = {  # name -> (context lengths of the batch, cache block size)
    "b1 x 32K": ([32768], 16),
    "b1 x 131K": ([131072], 16),
    "b64 x 4K": ([4096] * 64, 16),
}


def time_long_decode_tiles(rows: list, deadline: float = float("inf")) -> None:
    """MLA decode attention (V2-Lite: 16 heads over the 576-wide latent, bf16) swept over the
    split kernel's tile (keys per iteration, warps), the minimum split width and (batch 1) the
    launch's split count, at
    batch 1 over 32K and 131K keys and batch 64 over 4K: median us each, error against the
    reference; the default config's row first (`default` True). Issue 31: a layer's decode
    attention at 32K took ~98 us against ~8 us of HBM time (37.7 MB)."""
    import itertools

    from deepserve.kernels.triton import decode_attention as da

    gen = torch.Generator().manual_seed(12)
    # no stages: none of these tiles pipelines its loads (no LDGSTS in compile_check's SASS), so
    # a program's memory parallelism is its one tile in flight: more programs is the lever
    sweep = [(da.WIDE_TILE, da.MIN_SPLIT_KEYS, None)] + [
        (da.DecodeTile(n, w, 2), keys, splits)
        for n, w, keys, splits in itertools.product((16, 32), (4, 8), (128, 256, 512), (None, 528))
    ]
    for case, (lens, bs) in DECODE_TILE_CASES.items():
        if not _decode_tiles_at(rows, case, lens, bs, sweep, gen, deadline):
            return
        torch.cuda.empty_cache()


def _decode_tiles_at(rows: list, case: str, lens, bs: int, sweep, gen, deadline: float) -> bool:
    """time_long_decode_tiles at one case; False once out of time."""
    import triton.testing

    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton import decode_attention as da

    nb = sum(-(-n // bs) for n in lens) + 8
    q, k_cache, v_cache, attn = _decode_case("mla", torch.bfloat16, lens, bs, nb, gen)
    want = attention_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, 0.07)
    hbm_us = k_cache.shape[-1] * 2 * sum(lens) / 4.8e6
    # the first config timed read 103 us where its later repeat read 75 (run-gpu17-2): warm up
    triton.testing.do_bench(functools.partial(da.decode_attention, q, k_cache, v_cache, attn, 0.07))
    for i, (tile, keys, splits) in enumerate(sweep):
        if time.time() > deadline:
            rows.append(dict(op="decode_tile", error="skipped: out of time"))
            return False
        if splits and len(lens) > 1:
            continue  # a batch fills the GPU with its rows
        fn = functools.partial(
            da.decode_attention, q, k_cache, v_cache, attn, 0.07, keys, tile, splits
        )
        row = dict(op="decode_tile", case=case, default=i == 0, block_n=tile.block_n,
                   warps=tile.num_warps, min_keys=keys, splits=splits or "default",
                   hbm_us=round(hbm_us, 1))  # fmt: skip
        try:  # a tile past the shared memory fails to compile: recorded, the sweep goes on
            row["rel_err"] = rel(fn(), want)
            row["us"] = round(1000 * triton.testing.do_bench(fn, return_mode="median"), 1)
        except Exception as e:
            row["error"] = str(e)[:200]
        rows.append(row)
    timed = [r for r in rows if r.get("case") == case and "us" in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        print(case, "default", timed[0]["us"], "best", best, flush=True)
    return True


def run_decode_tiles(out: dict, deadline: float) -> None:
    """`--only decode_tiles`: `time_long_decode_tiles` alone."""
    time_long_decode_tiles(out.setdefault("decode_tiles", []), deadline)


def run(out: dict) -> None:
    rows = out.setdefault("kernel_checks", [])
    for fn in (
        check_flash_prefill,
        time_long_decode,
        check_rope_kernels,
        time_prefill_tiles,
        check_fused_rows,
        check_routing,
        check_moe,
        check_decode_attention,
    ):
        try:
            fn(rows)
        except Exception as e:  # recorded; the job goes on
            import traceback

            rows.append(dict(op=fn.__name__, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)


# ---- `--batch-invariant`'s matmul and decode attention: candidates timed, bits checked ---------

MATMUL_SHAPES = {  # (K, N, heads of a bmm or 0 for linear, dtype) -> its layer; most calls first
    (2048, 3072, 0, "bf16"): "v2 q_proj",
    (2048, 576, 0, "bf16"): "v2 kv_a",
    (2048, 2048, 0, "bf16"): "v2 o_proj",
    (2048, 2816, 0, "bf16"): "v2 shared gate_up",
    (1408, 2048, 0, "bf16"): "v2 down (1408)",
    (2816, 2048, 0, "bf16"): "v2 shared down",
    (2048, 64, 0, "fp32"): "v2 router gate",
    (128, 512, 16, "bf16"): "v2 bmm q absorb",
    (512, 128, 16, "bf16"): "v2 bmm out absorb",
    (576, 960, 0, "bf16"): "smol qkv",
    (576, 576, 0, "bf16"): "smol o_proj",
    (576, 3072, 0, "bf16"): "smol gate_up",
    (1536, 576, 0, "bf16"): "smol down",
    (2048, 102400, 0, "bf16"): "v2 lm_head",
    (576, 49152, 0, "bf16"): "smol lm_head",
}
TILE_CANDIDATES = {  # (block_n, block_k, num_warps, num_stages); block_m is always 64
    "n64k64w4s4": (64, 64, 4, 4),
    "n64k128w4s3": (64, 128, 4, 3),
    "n32k128w4s4": (32, 128, 4, 4),
    "n128k64w8s3": (128, 64, 8, 3),
    "n128k128w8s3": (128, 128, 8, 3),
}


def _graph_us(fn, calls: int) -> float:
    """Device us per call of `fn`, from `calls` launches captured in one CUDA graph (best of 3)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(3):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1e3 / calls)
    del graph
    return best


def _matmul_operands(k: int, n: int, heads: int, dtype: torch.dtype, g):
    """x [2048 rows] and the weight as linear / bmm take them, plus the op for a config."""
    from deepserve.kernels.triton import matmul

    if heads:
        a = torch.randn(2048, heads, k, device="cuda", generator=g, dtype=dtype).transpose(0, 1)
        b = torch.randn(heads, k, n, device="cuda", generator=g, dtype=dtype) / k**0.5
        return a, b, lambda x, cfg: matmul.bmm(x, b, cfg), lambda x: torch.matmul(x, b)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=dtype) / k**0.5
    x = torch.randn(2048, k, device="cuda", generator=g, dtype=dtype)
    return x, w, lambda x, cfg: matmul.linear(x, w, cfg), lambda x: x @ w.t()


def _rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return x[..., lo:hi, :] if x.dim() == 3 else x[lo:hi]


def _candidate_row(op, x, cfg, ref) -> dict:
    full = op(x, cfg)
    same = all(torch.equal(op(_rows(x, 0, m), cfg), _rows(full, 0, m)) for m in (1, 3, 17, 64, 65))
    same &= torch.equal(op(_rows(x, 5, 6), cfg), _rows(full, 5, 6))
    row = dict(invariant=bool(same), rel_err=rel(full, ref))
    for m, calls in ((1, 20), (64, 20), (2048, 3)):
        row[f"us_m{m}"] = round(_graph_us(lambda m=m: op(_rows(x, 0, m), cfg), calls), 2)
    return row


def _pick(cands: list[dict]) -> dict | None:
    """Fastest decode (M=1 plus M=64) among the invariant candidates whose M=2,048 time is within
    10% of the best M=2,048 time."""
    ok = [c for c in cands if c["invariant"] and c["rel_err"] < 2e-2]
    if not ok:
        return None
    best_prefill = min(c["us_m2048"] for c in ok)
    fair = [c for c in ok if c["us_m2048"] <= 1.1 * best_prefill]
    return min(fair, key=lambda c: c["us_m1"] + c["us_m64"])


def tune_matmul(rows: list, deadline: float) -> dict:
    """Every tile candidate x K-split count on each engine weight shape: bits across M, error vs
    float64, device us at M = 1 / 64 / 2,048 beside cuBLAS; the winners go into matmul.TUNED for
    the rest of this process (the speed section) and are printed to be hard-coded."""
    import time

    from deepserve.kernels.triton import matmul

    g = torch.Generator(device="cuda").manual_seed(5)
    winners = {}
    for (k, n, heads, dt), layer in MATMUL_SHAPES.items():
        if time.time() > deadline:
            rows.append(dict(op="tune_matmul", error=f"out of time before {layer}"))
            break
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        x, w, op, torch_op = _matmul_operands(k, n, heads, dtype, g)
        ref = torch.matmul(x.double(), w.double()) if heads else x.double() @ w.double().t()
        base = dict(op="matmul_tune", layer=layer, k=k, n=n, heads=heads, dtype=dt)
        cublas = dict(base, config="cublas")
        for m, calls in ((1, 20), (64, 20), (2048, 3)):
            cublas[f"us_m{m}"] = round(
                _graph_us(lambda m=m, x=x, f=torch_op: f(_rows(x, 0, m)), calls), 2
            )
        rows.append(cublas)
        cands = []
        for cname, (bn, bk, warps, stages) in TILE_CANDIDATES.items():
            if dt == "fp32" and bn > 64:
                continue  # the router gate: 64 columns
            for splits in (1, 2, 4, 8, 16):
                cfg = matmul.TileConfig(64, bn, bk, 8, warps, stages, splits)
                if splits > 1 and (cfg.chunk(k) * (splits - 1) >= k or k // splits < bk):
                    continue  # an empty or repeated chunk count
                cfg = cfg.fitted(x.element_size())
                try:
                    row = dict(base, config=f"{cname}x{splits}", **_candidate_row(op, x, cfg, ref))
                except Exception as e:  # e.g. out of shared memory: recorded, not chosen
                    row = dict(base, config=f"{cname}x{splits}", error=str(e)[:200])
                row["cfg"] = cfg
                rows.append(row)
                if "error" not in row:
                    cands.append(row)
        win = _pick(cands)
        if win is None:
            rows.append(dict(base, error="no invariant candidate"))
            continue
        winners[(k, n)] = win["cfg"]
        rows.append(dict(base, config="chosen:" + win["config"], us_m1=win["us_m1"],
                         us_m64=win["us_m64"], us_m2048=win["us_m2048"]))  # fmt: skip
        print(rows[-1], "cublas", cublas, flush=True)
    for row in rows:
        if "cfg" in row:
            row["cfg"] = str(row["cfg"])
    matmul.TUNED.update(winners)
    print("TUNED = {", flush=True)
    for key, cfg in winners.items():
        print(f"    {key}: {cfg!r},", flush=True)
    print("}", flush=True)
    return winners


def check_invariant_decode_attention(rows: list) -> None:
    """The head-grouped decode kernel against the fixed-split kernel (bitwise, its host layout as
    a prefill builds it) and attention_ref; device us beside the fixed-split kernel and the
    default set's decode kernel at V2-Lite's (MLA, 16 heads) and SmolLM2's (GQA 9/3) shapes."""
    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import InvariantPagedAttention

    gen = torch.Generator().manual_seed(4)
    bs, nb = 16, 9000
    for layout in ("mla", "gqa"):
        for dtype in (torch.bfloat16, torch.float32):
            for lens in ([1], [7, 300, 33], [17] * 64 + [2000], [256] * 64, [256]):
                q, k_cache, v_cache, attn = _decode_case(layout, dtype, lens, bs, nb, gen)
                want = attention_ref.paged_attention(q, k_cache, v_cache, attn, 0.07)
                fixed = attention.TritonPagedAttention()
                fixed._layout = fixed._host_layout(attn, q.device)
                ref = fixed(q, k_cache, v_cache, attn, 0.07)
                grouped = InvariantPagedAttention()
                got = grouped(q, k_cache, v_cache, attn, 0.07)
                alone = grouped(q[-1:], k_cache, v_cache, _metadata_rows(attn, len(lens) - 1), 0.07)
                row = dict(op="invariant_decode_attention", layout=layout, dtype=str(dtype),
                           lens=str(lens[:4]), batch=len(lens), equal_fixed_split=bool(torch.equal(got, ref)),
                           equal_alone=bool(torch.equal(alone, got[-1:])), rel_err=rel(got, want))  # fmt: skip
                if dtype == torch.bfloat16 and lens[0] == 256:
                    row.update(_attention_us(grouped, q, k_cache, v_cache, attn))
                rows.append(row)
                print(row, flush=True)


def _attention_us(grouped, q, k_cache, v_cache, attn) -> dict:
    """Device us of a decode step's attention: head-grouped, fixed-split, the default set's."""
    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import decode_attention

    fixed = attention.TritonPagedAttention()
    fns = {"grouped": grouped, "fixed_split": fixed, "flag_off": decode_attention}
    return {
        f"us_{name}": round(_graph_us(lambda f=f: f(q, k_cache, v_cache, attn, 0.07), 20), 2)
        for name, f in fns.items()
    }


def _metadata_rows(attn: AttentionMetadata, i: int) -> AttentionMetadata:
    """Sequence i of a decode step's metadata, as a step of its own."""
    return AttentionMetadata(
        query_start_loc=torch.arange(2, device="cuda", dtype=torch.int32),
        seq_lens=attn.seq_lens[i : i + 1],
        context_lens=attn.context_lens[i : i + 1],
        slot_mapping=attn.slot_mapping[i : i + 1],
        block_tables=attn.block_tables[i : i + 1],
        block_size=attn.block_size,
        query_lens_cpu=[1],
        seq_lens_cpu=attn.seq_lens_cpu[i : i + 1],
        context_lens_cpu=attn.context_lens_cpu[i : i + 1],
    )


def run_invariant(out: dict, deadline: float) -> None:
    """`--only invariant`: the attention checks, then the matmul tuning (its winners are used by
    the sections after it in the same process)."""
    import traceback

    rows = out.setdefault("invariant", [])
    for name, fn in (
        ("attention", lambda: check_invariant_decode_attention(rows)),
        ("matmul", lambda: tune_matmul(rows, deadline)),
    ):
        try:
            fn()
        except Exception as e:
            rows.append(dict(op=name, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)


# ---- DeepSeek-V4's sparse attention, indexer and pooling (kernels/triton/sparse_attention.py) ---

V4_HEADS, V4_DIM, V4_WINDOW = 64, 512, 128  # V4-Flash: 64 heads over one 512-wide latent
V4_INDEX_HEADS, V4_INDEX_DIM, V4_TOPK = 64, 128, 512


def _v4_attention_oracle(q, window_kv, window_slots, entry_kv, entry_slots, sinks, scale):
    """V4SPEC.md op 1 in float32 torch, 128 tokens at a time: gather, mask -1, softmax with the
    sink column, drop it, weight the keys."""
    out = torch.empty_like(q)
    slots = torch.cat([window_slots, entry_slots], dim=1)
    for lo in range(0, q.shape[0], 128):
        s = slots[lo : lo + 128]
        w = s[:, : window_slots.shape[1]]
        e = s[:, window_slots.shape[1] :]
        kv = torch.cat([window_kv[w.clamp_min(0)], entry_kv[e.clamp_min(0)]], dim=1).float()
        scores = torch.einsum("thd,tld->thl", q[lo : lo + 128].float(), kv) * scale
        scores = scores.masked_fill((s < 0)[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[lo : lo + 128] = torch.einsum("thl,tld->thd", probs, kv).to(q.dtype)
    return out


def _v4_attention_case(tokens: int, entries: int, dtype, g):
    """q, and the window / entry columns of a 1,536-wide flattened cache of 400K rows: window
    slots of consecutive rows (-1 before a sequence's start for some tokens), entry slots
    scattered with a per-token count of visible entries and -1 after it."""
    rows = 400_000
    cache = torch.randn(rows, 3 * V4_DIM, device="cuda", generator=g, dtype=dtype)
    window_kv, entry_kv = cache[:, :V4_DIM], cache[:, 2 * V4_DIM :]
    q = torch.randn(tokens, V4_HEADS, V4_DIM, device="cuda", generator=g, dtype=dtype)
    start = torch.randint(0, rows - V4_WINDOW, (tokens, 1), device="cuda", generator=g)
    window_slots = start + torch.arange(V4_WINDOW, device="cuda")
    window_slots[: tokens // 4, : V4_WINDOW // 2] = -1  # early tokens: half a window
    entry_slots = torch.randint(0, rows, (tokens, entries), device="cuda", generator=g)
    count = torch.randint(0, entries + 1, (tokens, 1), device="cuda", generator=g)
    count[-1] = entries  # the last token sees every entry
    entry_slots[torch.arange(entries, device="cuda")[None, :] >= count] = -1
    sinks = torch.randn(V4_HEADS, device="cuda", generator=g)
    return q, window_kv, window_slots, entry_kv, entry_slots, sinks


def _graph_replays_like_eager(fn, inputs: list[torch.Tensor], fresh: list[torch.Tensor]) -> bool:
    """`fn()` captured in a CUDA graph, its inputs overwritten in place with `fresh`, replayed:
    equal to an eager call on the new values (no host value baked into the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    for x, y in zip(inputs, fresh, strict=True):
        x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    equal = torch.equal(static, fn())
    del graph
    return equal


def check_v4_sparse_attention(rows: list) -> None:
    """Against the float32 oracle at V4-Flash's shapes; a token alone vs in its batch and the
    two launch paths (bitwise); graph replay; median ms and GB/s over the keys' bytes (each
    token's visible keys read once)."""
    g = torch.Generator(device="cuda").manual_seed(28)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 64, 2048):
            for entries in (512, 1024):
                if dtype == torch.float32 and tokens == 2048:
                    continue
                row = _v4_attention_row(_v4_attention_case(tokens, entries, dtype, g), g)
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()


def _v4_attention_row(case: tuple, g) -> dict:
    import triton.testing

    from deepserve.kernels.triton import sparse_attention as sa

    q, window_kv, window_slots, entry_kv, entry_slots, sinks = case
    tokens, entries, scale = q.shape[0], entry_slots.shape[1], V4_DIM**-0.5
    got = sa.sparse_attention(*case, scale)
    row = dict(op="v4_sparse_attention", dtype=str(q.dtype), tokens=tokens, window=V4_WINDOW,
               entries=entries, rel_err=rel(got, _v4_attention_oracle(*case, scale)),
               nan=bool(got.isnan().any()))  # fmt: skip
    last = slice(tokens - 1, tokens)
    alone = sa.sparse_attention(q[last], window_kv, window_slots[last], entry_kv,
                                entry_slots[last], sinks, scale)  # fmt: skip
    row["equal_alone"] = bool(torch.equal(alone, got[last]))
    folded = sa.sparse_attention(*case, scale, split_programs_max=0)
    split = sa.sparse_attention(*case, scale, split_programs_max=10**9)
    row["equal_paths"] = bool(torch.equal(folded, got) and torch.equal(split, got))
    no_skip = sa.sparse_attention(*case, scale, skip_empty=False)
    row["equal_no_skip"] = bool(torch.equal(no_skip, got))
    keys = int((window_slots >= 0).sum() + (entry_slots >= 0).sum())
    gbytes = keys * V4_DIM * q.element_size() / 1e9
    variants = {"": {}, "_no_skip": dict(skip_empty=False), "_split64": dict(split=64)}
    if tokens > 1:
        variants["_fold"] = dict(split_programs_max=0)
    for name, kw in variants.items():
        fn = lambda kw=kw: sa.sparse_attention(*case, scale, **kw)  # noqa: E731
        ms = triton.testing.do_bench(fn, return_mode="median")
        row[f"ms{name}"] = round(ms, 4)
        row[f"GBps{name}"] = round(gbytes / (ms / 1e3), 1)
    if tokens <= 64:
        fresh = _v4_attention_case(tokens, entries, q.dtype, g)
        row["graph_ok"] = _graph_replays_like_eager(
            lambda: sa.sparse_attention(*case, scale),
            [q, window_slots, entry_slots], [fresh[0], fresh[2], fresh[4]],
        )  # fmt: skip
    return row


def _v4_indexer_oracle(q, weights, keys, entry_slots, token_seq, visible, scale):
    """V4SPEC.md op 2's scores in float32 torch, 16 tokens at a time."""
    out = torch.empty(q.shape[0], entry_slots.shape[1], device="cuda")
    j = torch.arange(entry_slots.shape[1], device="cuda")
    for lo in range(0, q.shape[0], 16):
        seq = token_seq[lo : lo + 16]
        k = keys[entry_slots[seq].clamp(0, keys.shape[0] - 1)].float()  # [t, G, Di]
        dots = torch.relu(torch.einsum("thd,tgd->thg", q[lo : lo + 16].float(), k)) * scale
        s = (dots * weights[lo : lo + 16, :, None]).sum(1)
        out[lo : lo + 16] = s.masked_fill(j[None, :] >= visible[lo : lo + 16, None], float("-inf"))  # fmt: skip
    return out


def check_v4_indexer(rows: list) -> None:
    """Scores against the float32 oracle (V4-Flash: 64 heads of 128, up to 40,960 entries), the
    chosen sets against the oracle scores' top-k (share of equal ids: bf16 products may reorder
    near-ties), a token alone vs in its batch (bitwise), graph replay, median ms and GB/s over
    the visible keys' bytes."""
    g = torch.Generator(device="cuda").manual_seed(29)
    for tokens, entries in ((1, 4096), (1, 40960), (64, 40960), (2048, 4096), (2048, 40960)):
        row = _v4_indexer_row(tokens, entries, g)
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()


def _v4_indexer_row(tokens: int, entries: int, g) -> dict:
    import triton.testing

    from deepserve.kernels.triton import sparse_attention as sa

    dtype, scale, n, seqs = torch.bfloat16, V4_INDEX_DIM**-0.5, 2 * entries, 4
    cache = torch.randn(n, 3 * V4_INDEX_DIM, device="cuda", generator=g, dtype=dtype)
    keys = cache[:, V4_INDEX_DIM : 2 * V4_INDEX_DIM]
    q = torch.randn(tokens, V4_INDEX_HEADS, V4_INDEX_DIM, device="cuda", generator=g, dtype=dtype)  # fmt: skip
    weights = torch.randn(tokens, V4_INDEX_HEADS, device="cuda", generator=g)
    entry_slots = torch.randint(0, n, (seqs, entries), device="cuda", generator=g)
    token_seq = torch.randint(0, seqs, (tokens,), device="cuda", generator=g)
    visible = torch.randint(entries // 2, entries + 1, (tokens,), device="cuda", generator=g)
    visible[0] = 100  # a short sequence
    case = (q, weights, keys, entry_slots, token_seq, visible)
    scores = sa.indexer_scores(*case, scale)
    want = _v4_indexer_oracle(*case, scale)
    finite = want.isfinite()
    row = dict(op="v4_indexer", tokens=tokens, entries=entries,
               rel_err=rel(scores[finite], want[finite]),
               mask_ok=bool(torch.equal(scores.isfinite(), finite)))  # fmt: skip
    got = sa.indexer_topk(*case, V4_TOPK, scale)
    ref = sa.topk_ascending(want, visible, V4_TOPK)
    row["ids_equal_share"] = float((got == ref).float().mean())
    row["repeat_equal"] = bool(torch.equal(got, sa.indexer_topk(*case, V4_TOPK, scale)))
    last = slice(tokens - 1, tokens)
    alone = sa.indexer_scores(q[last], weights[last], keys, entry_slots, token_seq[last],
                              visible[last], scale)  # fmt: skip
    row["equal_alone"] = bool(torch.equal(alone, scores[last]))
    gbytes = int(visible.sum()) * V4_INDEX_DIM * keys.element_size() / 1e9
    ms = triton.testing.do_bench(lambda: sa.indexer_scores(*case, scale), return_mode="median")
    row.update(ms_scores=round(ms, 4), GBps_scores=round(gbytes / (ms / 1e3), 1))
    fn = lambda: sa.indexer_topk(*case, V4_TOPK, scale)  # noqa: E731
    row["ms_topk"] = round(triton.testing.do_bench(fn, return_mode="median"), 4)
    # the selection alone: topk.py's radix select against its torch twin, same scores
    from deepserve.kernels.triton import topk

    row["select_equal_torch"] = bool(
        torch.equal(topk.topk_ascending(scores, visible, V4_TOPK),
                    sa.topk_ascending(scores, visible, V4_TOPK))
    )  # fmt: skip
    for name, select in (
        ("ms_select", topk.topk_ascending),
        ("ms_select_torch", sa.topk_ascending),
    ):
        ms = triton.testing.do_bench(
            lambda s=select: s(scores, visible, V4_TOPK), return_mode="median"
        )
        row[name] = round(ms, 4)
    if tokens <= 64:
        fresh = [torch.randn_like(q), torch.randint_like(visible, 1, entries + 1)]
        row["graph_ok"] = _graph_replays_like_eager(fn, [q, visible], fresh)
    return row


def check_v4_compress_pool(rows: list) -> None:
    """CSA (ratio 4, two series) and HCA (ratio 128) pooling of 512 columns against the float32
    oracle; a group alone vs in its batch (bitwise); median ms and GB/s over the kv and gate
    bytes read."""
    g = torch.Generator(device="cuda").manual_seed(30)
    for ratio, series, groups in ((4, 2, 1), (4, 2, 64), (4, 2, 32768), (128, 1, 1), (128, 1, 1024)):  # fmt: skip
        row = _v4_pool_row(ratio, series, groups, g)
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()


def _v4_pool_row(ratio: int, series: int, groups: int, g) -> dict:
    import triton.testing

    from deepserve.kernels.triton import sparse_attention as sa

    dim = V4_DIM
    width = series * dim
    n = max(2 * groups * ratio, 4096)
    cache = torch.randn(n, 2 * width + 64, device="cuda", generator=g, dtype=torch.bfloat16)
    perm = torch.randperm(n, device="cuda", generator=g)
    tokens = perm[: groups * ratio].view(groups, ratio)
    previous = perm[groups * ratio : 2 * groups * ratio].view(groups, ratio)
    has_previous = torch.arange(groups, device="cuda") % 7 != 6
    ape = torch.randn(ratio, width, device="cuda", generator=g)
    case = (cache, tokens, previous, has_previous, ape, slice(0, width),
            slice(width + 64, 2 * width + 64), dim, series)  # fmt: skip
    got = sa.compress_pool(*case)
    row = dict(op="v4_compress_pool", ratio=ratio, series=series, groups=groups,
               rel_err=rel(got, reference_compress_pool(*case)))  # fmt: skip
    alone = sa.compress_pool(cache, tokens[-1:], previous[-1:], has_previous[-1:], *case[4:])
    row["equal_alone"] = bool(torch.equal(alone, got[-1:]))
    gbytes = groups * series * ratio * dim * 2 * cache.element_size() / 1e9
    ms = triton.testing.do_bench(lambda: sa.compress_pool(*case), return_mode="median")
    row.update(ms=round(ms, 4), GBps=round(gbytes / (ms / 1e3), 1))
    return row


V4_HC, V4_HIDDEN, V4_EXPERTS, V4_TOP_K = 4, 4096, 256, 6  # V4-Flash's streams and router


def _v4_hc_oracle(mixes, scale, base, h, iters, eps):
    """DeepseekV4ForCausalLM._hc_collapse's maths in float32 torch (its `_sinkhorn` itself)."""
    from deepserve.engine.models.deepseek_v4 import _sinkhorn

    n = h.shape[1]
    mixes = mixes * scale + base
    gates = torch.sigmoid(mixes[:, : 2 * n])
    pre, post = gates[:, :n] + eps, 2 * gates[:, n:]
    comb = _sinkhorn(torch.softmax(mixes[:, 2 * n :].reshape(-1, n, n), -1) + eps, iters, eps)
    return post, comb, (pre[..., None] * h.float()).sum(dim=1)


def _v4_expand_composed(h, out, post, comb):
    """DeepseekV4ForCausalLM._hc_expand's torch composition (in h's dtype, as the model runs)."""
    comb = comb.to(h.dtype)
    mixed = comb[:, 0, :, None] * h[:, :1]
    for i in range(1, h.shape[1]):
        mixed = mixed + comb[:, i, :, None] * h[:, i : i + 1]
    return post.to(h.dtype)[..., None] * out[:, None, :] + mixed


def check_v4_hyper_connections(rows: list) -> None:
    """hc_collapse (Sinkhorn included) and hc_expand at V4-Flash sizes (4 streams of 4096, bf16)
    against float32 torch; a token alone vs in its batch (bitwise); graph replay; median ms
    beside the torch composition the model runs without them (launch-bound at decode sizes)."""
    g = torch.Generator(device="cuda").manual_seed(31)
    for tokens in (1, 64, 2048):
        row = _v4_hc_row(tokens, g)
        rows.append(row)
        print(row, flush=True)


def _v4_hc_row(tokens: int, g) -> dict:
    import triton.testing

    from deepserve.kernels.triton import hyper_connections as hc

    n, iters, eps = V4_HC, 20, 1e-6
    h = torch.randn(tokens, n, V4_HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.randn(tokens, V4_HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    mixes = torch.randn(tokens, (2 + n) * n, device="cuda", generator=g)
    scale = torch.rand((2 + n) * n, device="cuda", generator=g)
    base = torch.randn((2 + n) * n, device="cuda", generator=g)
    post, comb, x = hc.hc_collapse(mixes, scale, base, h, iters, eps)
    want = _v4_hc_oracle(mixes, scale, base, h, iters, eps)
    row = dict(op="v4_hyper_connections", tokens=tokens, rel_err_post=rel(post, want[0]),
               rel_err_comb=rel(comb, want[1]), rel_err_x=rel(x, want[2]))  # fmt: skip
    y = hc.hc_expand(h, out, post, comb)
    want_y = _v4_expand_composed(h.float(), out.float(), post, comb)
    row["rel_err_expand"] = rel(y, want_y)
    row["rel_err_expand_composed_bf16"] = rel(_v4_expand_composed(h, out, post, comb), want_y)
    last = slice(tokens - 1, tokens)
    alone = hc.hc_collapse(mixes[last], scale, base, h[last], iters, eps)
    same = all(torch.equal(a, b[last]) for a, b in zip(alone, (post, comb, x), strict=True))
    same_y = torch.equal(hc.hc_expand(h[last], out[last], post[last], comb[last]), y[last])
    row["equal_alone"] = bool(same and same_y)
    fns = {
        "collapse": lambda: hc.hc_collapse(mixes, scale, base, h, iters, eps),
        "collapse_torch": lambda: _v4_hc_oracle(mixes, scale, base, h, iters, eps),
        "expand": lambda: hc.hc_expand(h, out, post, comb),
        "expand_torch": lambda: _v4_expand_composed(h, out, post, comb),
    }
    for name, fn in fns.items():
        row[f"ms_{name}"] = round(triton.testing.do_bench(fn, return_mode="median"), 4)
    if tokens <= 64:
        flat = lambda: torch.cat([t.float().flatten() for t in fns["collapse"]()])  # noqa: E731
        fresh = [torch.randn_like(mixes), torch.randn_like(h)]
        row["graph_ok"] = _graph_replays_like_eager(flat, [mixes, h], fresh)
    return row


def check_v4_routing(rows: list) -> None:
    """The routing kernel with V4's sqrtsoftplus scores (256 experts, top 6, correction bias,
    scale 1.5) against kernels/reference/moe_routing.py, and with given experts (hash routing)
    against the model's gather-and-normalise; median ms beside the composed routing."""
    g = torch.Generator(device="cuda").manual_seed(32)
    for tokens in (1, 64, 2048):
        row = _v4_routing_row(tokens, g)
        rows.append(row)
        print(row, flush=True)


def _v4_routing_row(tokens: int, g) -> dict:
    import triton.testing

    from deepserve.kernels.reference import moe_routing
    from deepserve.kernels.route_spec import RouteSpec
    from deepserve.kernels.triton import routing

    spec = RouteSpec("sqrtsoftplus", 1, 1, V4_TOP_K, True, 1.5)
    logits = torch.randn(tokens, V4_EXPERTS, device="cuda", generator=g) * 3
    bias = torch.randn(V4_EXPERTS, device="cuda", generator=g) * 0.1
    weights, ids = routing.route(logits, bias, spec)
    want_w, want_ids = moe_routing.route(logits, bias, spec)
    row = dict(op="v4_routing", tokens=tokens, experts=V4_EXPERTS, top_k=V4_TOP_K,
               ids_equal_share=float((ids == want_ids).float().mean()),
               rel_err=rel(weights, want_w))  # fmt: skip
    given = torch.rand(tokens, V4_EXPERTS, device="cuda", generator=g).argsort(-1)[:, :V4_TOP_K]
    hash_w, hash_ids = routing.route(logits, None, spec, ids=given)
    scores = torch.nn.functional.softplus(logits).sqrt().gather(1, given)
    want_hash = scores / (scores.sum(-1, keepdim=True) + 1e-20) * spec.scale
    row["rel_err_hash"] = rel(hash_w, want_hash)
    row["hash_ids_kept"] = bool(torch.equal(hash_ids, given))
    last = slice(tokens - 1, tokens)
    alone = routing.route(logits[last], bias, spec)
    row["equal_alone"] = bool(torch.equal(alone[0], weights[last]) and torch.equal(alone[1], ids[last]))  # fmt: skip
    fns = {"": lambda: routing.route(logits, bias, spec),
           "_composed": lambda: moe_routing.route(logits, bias, spec)}  # fmt: skip
    for name, fn in fns.items():
        row[f"ms{name}"] = round(triton.testing.do_bench(fn, return_mode="median"), 4)
    return row


def check_v4_rope(rows: list) -> None:
    """The interleaved rope on V4-Flash's queries (64 heads of 512, the last 64 rotated, bf16):
    bitwise kernels/rope.py's composition, with its -sin (the output's rotation back); median
    ms beside the composition."""
    g = torch.Generator(device="cuda").manual_seed(33)
    for tokens in (1, 64, 2048):
        row = _v4_rope_row(tokens, g)
        rows.append(row)
        print(row, flush=True)


def _v4_rope_row(tokens: int, g) -> dict:
    import triton.testing

    from deepserve.kernels.rope import apply_rope_interleaved
    from deepserve.kernels.triton.rope import rope_interleaved

    q = torch.randn(tokens, V4_HEADS, V4_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    cos, sin = torch.randn(2, tokens, 1, 32, device="cuda", generator=g, dtype=torch.bfloat16)
    equal = all(
        torch.equal(rope_interleaved(q, cos, s), apply_rope_interleaved(q, cos, s))
        for s in (sin, -sin)
    )
    row = dict(op="v4_rope", tokens=tokens, equal=equal)
    fns = {"": lambda: rope_interleaved(q, cos, sin),
           "_composed": lambda: apply_rope_interleaved(q, cos, sin)}  # fmt: skip
    for name, fn in fns.items():
        row[f"ms{name}"] = round(triton.testing.do_bench(fn, return_mode="median"), 4)
    return row


V4_TESTS = ("test_kernels_triton_sparse_attention", "test_kernels_triton_hyper_connections")


def check_v4_tests(rows: list) -> None:
    """V4_TESTS (tests/test_kernels_triton_*.py) on CUDA (their bitwise invariance asserts
    against real tensor-core products); without conftest.py, whose server fixtures import
    packages the device image may lack."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
    cmd += [str(repo / f"tests/{name}.py") for name in V4_TESTS]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, timeout=300)
    rows.append(dict(op="v4_pytest", rc=proc.returncode, tail=proc.stdout[-1500:] + proc.stderr[-500:]))  # fmt: skip


def run_v4(out: dict) -> None:
    """`--only v4_checks`: DeepSeek-V4's kernels at V4-Flash sizes."""
    import traceback

    rows = out.setdefault("v4_checks", [])
    checks = (check_v4_tests, check_v4_sparse_attention, check_v4_indexer, check_v4_compress_pool,
              check_v4_hyper_connections, check_v4_routing, check_v4_rope)  # fmt: skip
    for fn in checks:
        try:
            fn(rows)
        except Exception as e:  # recorded; the job goes on
            rows.append(dict(op=fn.__name__, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)


# ---- block-scaled FP8 (and MXFP4 experts): errors against dequantized references, timings -----

FP8_SHAPES = {  # [N, K] of a projection -> its layer
    (2112, 7168): "v3 x_proj (q_a + kv_a, as the engine fuses them)",
    (1536, 7168): "v3 q_a",
    (24576, 1536): "v3 q_b",
    (576, 7168): "v3 kv_a (N cut)",
    (7168, 16384): "v3 o_proj",
    (36864, 7168): "v3 dense gate_up",
    (7168, 18432): "v3 dense down",
    (4096, 7168): "v3 shared gate_up",
    (7168, 2048): "v3 shared down",
    (32768, 1024): "v4 wide (K 1024)",
    (4096, 32768): "v4 long K",
    (3648, 2048): "v2-lite x_proj (q_proj + kv_a, as the engine fuses them)",
    (3072, 2048): "v2-lite q_proj",
    (576, 2048): "v2-lite kv_a",
    (2048, 2048): "v2-lite o_proj",
    (2816, 2048): "v2-lite shared gate_up",
    (2048, 1408): "v2-lite shared down",
    (21888, 2048): "v2-lite dense gate_up",
    (2048, 10944): "v2-lite dense down (K cut)",
}
FP8_ROWS = (1, 16, 64, 256, 1024, 4096)
FP8_DECODE_CANDIDATES = {  # block_n, num_warps, num_stages of BLOCK_M 16 tiles, timed at M = 1
    "n16w4s4": (16, 4, 4),
    "n16w2s6": (16, 2, 6),
    "n32w4s4": (32, 4, 4),
    "n64w4s4": (64, 4, 4),
    "n64w4s6": (64, 4, 6),
    "n128w4s4": (128, 4, 4),
    "n128w8s3": (128, 8, 3),
}


def _fp8_reference(x: torch.Tensor, w_deq: torch.Tensor) -> torch.Tensor:
    """x's own per-group e4m3 codes times their scales, against w dequantized, in float32."""
    from deepserve.kernels.triton import fp8_matmul

    q, s = fp8_matmul.quantize_groups_reference(x)
    k = x.shape[1]
    xq = q.float() * s.repeat_interleave(fp8_matmul.GROUP, dim=1)[:, :k]
    return xq @ w_deq.T


def check_fp8_linear(rows: list) -> None:
    """fp8_linear on every projection shape and row count: error against the float32 product of
    the dequantized operands (gate 2e-2) and against unquantized x (e4m3's rounding, for the
    record), a row alone equal to it in a batch under decode_config, and median ms by do_bench
    beside torch's bf16 matmul of the same shape, with the weight bytes per second at M = 1."""
    import triton.testing

    from deepserve.kernels import block_quant
    from deepserve.kernels.triton import fp8_matmul

    g = torch.Generator(device="cuda").manual_seed(7)
    for (n, k), layer in FP8_SHAPES.items():
        w_bf16 = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        w = block_quant.quantize_fp8(w_bf16)
        w_deq = w.dequantize()
        x_all = torch.randn(max(FP8_ROWS), k, device="cuda", generator=g).to(torch.bfloat16)
        for m in FP8_ROWS:
            x = x_all[:m]
            got = fp8_matmul.fp8_linear(x, w)
            row = dict(op="fp8_linear", layer=layer, n=n, k=k, m=m,
                       rel_err=rel(got, _fp8_reference(x.float(), w_deq)),
                       rel_err_vs_bf16_x=rel(got, x.float() @ w_deq.T),
                       nan=bool(got.isnan().any()))  # fmt: skip
            row["ok"] = row["rel_err"] < 2e-2 and not row["nan"]
            if m == 64:
                fixed = fp8_matmul.decode_config(n)  # the invariant set's tile at every M
                full = fp8_matmul.fp8_linear(x, w, fixed)
                one = fp8_matmul.fp8_linear(x[5:6], w, fixed)
                row["row_invariant"] = bool(torch.equal(full[5:6], one))
            row["ms_fp8"] = triton.testing.do_bench(
                lambda x=x, w=w: fp8_matmul.fp8_linear(x, w), return_mode="median"
            )
            row["ms_bf16"] = triton.testing.do_bench(
                lambda x=x, w=w_bf16: x @ w.T, return_mode="median"
            )
            row["speedup"] = row["ms_bf16"] / row["ms_fp8"]
            if m == 1:
                fp8_bytes = w.data.numel() + w.scale.numel() * 4
                row["tb_s_fp8"] = fp8_bytes / row["ms_fp8"] / 1e9
                row["tb_s_bf16"] = 2 * n * k / row["ms_bf16"] / 1e9
            rows.append(row)
            print(row, flush=True)
        del w_deq
        torch.cuda.empty_cache()


def check_grouped_fp8(rows: list) -> None:
    """V4-Flash's grouped output projection (wo_a: 8 groups of 1,024 rows over 4,096 columns
    each) on its FP8 weight through the default and invariant sets' `grouped_linear`: error
    against the per-group float32 product of the operands as the path takes them (x's e4m3
    codes on the GEMM, x as it is on the GEMV; gate 2e-2), a row alone equal to it in a batch under
    the invariant set, us a call in a CUDA graph of 20 calls beside the bf16 bmm it replaces."""
    from deepserve.kernels import block_quant
    from deepserve.kernels.triton import fp8_gemv, fp8_matmul

    groups, n, k = 8, 8192, 4096
    g = torch.Generator(device="cuda").manual_seed(11)
    w = block_quant.quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    w_deq = w.dequantize(torch.bfloat16)
    per_group = w_deq.view(groups, n // groups, k).transpose(1, 2)
    fast, invariant = (fp8_matmul.grouped_linear_or_none(flag) for flag in (False, True))
    x_all = torch.randn(256, groups * k, device="cuda", generator=g).to(torch.bfloat16)

    def product(x: torch.Tensor, quantized: bool) -> torch.Tensor:
        if quantized:  # x's own per-group e4m3 codes times their scales
            q, s = fp8_matmul.quantize_groups_reference(x.float())
            x = q.float() * s.repeat_interleave(fp8_matmul.GROUP, dim=1)
        out = torch.einsum("tgk,gkn->tgn", x.float().view(-1, groups, k), per_group.float())
        return out.reshape(-1, n)

    for m in (1, 16, 64, 256):
        x = x_all[:m]
        got, inv = fast(x, w, groups), invariant(x, w, groups)
        gemv = fp8_matmul.path(m, w) == "gemv"  # x unquantized there
        row = dict(op="grouped_fp8_linear", m=m, rel_err=rel(got, product(x, not gemv)),
                   rel_err_invariant=rel(inv, product(x, True)))  # fmt: skip
        row["ok"] = max(row["rel_err"], row["rel_err_invariant"]) < 2e-2
        row["row_invariant"] = bool(torch.equal(invariant(x[m - 1 :], w, groups), inv[m - 1 :]))
        bmm = lambda x=x: torch.matmul(x.view(-1, groups, k).transpose(0, 1), per_group)  # noqa: E731
        row["us_fp8"] = round(_graph_us(lambda x=x: fast(x, w, groups), 20), 2)
        row["us_bf16_bmm"] = round(_graph_us(bmm, 20), 2)
        if m <= fp8_gemv.MAX_ROWS:  # the GEMV (x unquantized) at every row count it takes
            gemv_call = lambda x=x: fp8_gemv.fp8_gemv(x, w, groups=groups)  # noqa: E731
            row["us_gemv"] = round(_graph_us(gemv_call, 20), 2)
        rows.append(row)
        print(row, flush=True)


def time_fp8_decode_tiles(rows: list) -> None:
    """BLOCK_M 16 tiles of other widths, warps and stages at M = 1 on the V2-Lite and V3 shapes:
    the data to pick fp8_matmul.decode_config's tiles from (the error of each is checked too;
    `policy` is decode_config's own choice)."""
    from deepserve.kernels import block_quant
    from deepserve.kernels.triton import fp8_matmul

    g = torch.Generator(device="cuda").manual_seed(8)
    for (n, k), layer in FP8_SHAPES.items():
        w = block_quant.quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        want = _fp8_reference(x.float(), w.dequantize())
        policy = fp8_matmul.decode_config(n)
        cands = {f"policy n{policy.block_n}": policy} | {
            name: fp8_matmul.Fp8TileConfig(16, bn, 8, warps, stages)
            for name, (bn, warps, stages) in FP8_DECODE_CANDIDATES.items()
        }
        for name, cfg in cands.items():
            row = dict(op="fp8_decode_tile", layer=layer, n=n, k=k, cfg=name)
            fn = lambda x=x, w=w, cfg=cfg: fp8_matmul.fp8_linear(x, w, cfg)  # noqa: E731
            _timed(row, fn, want, lambda y: y)
            if "ms" in row:
                row["tb_s"] = (w.data.numel() + w.scale.numel() * 4) / row["ms"] / 1e9
            rows.append(row)


FP8_BATCH_SHAPES = {  # [N, K] of the projections a batch-64 step runs through the GEMM -> layer
    (1024, 4096): "v4 wq_a",
    (512, 4096): "v4 wkv",
    (4096, 8192): "v4 wo_b",
    (4096, 4096): "v4 shared gate_up",
    (4096, 2048): "v4 shared down",
    (32768, 1024): "v4 wq_b",
    (8192, 1024): "v4 indexer wq_b",
    (1536, 7168): "v3 q_a",
    (7168, 16384): "v3 o_proj",
    (7168, 2048): "v3 shared down",
    (3648, 2048): "v2-lite x_proj",
    (2048, 2048): "v2-lite o_proj",
    (2816, 2048): "v2-lite shared gate_up",
    (2048, 1408): "v2-lite shared down",
}
FP8_BATCH_ROWS = (32, 64, 128)
FP8_BATCH_CANDIDATES = {  # block_m, block_n, num_warps, num_stages, waves (Fp8TileConfig)
    "split m64n64w4x1": (64, 64, 4, 4, 1),
    "split m64n64w4x2": (64, 64, 4, 4, 2),  # fp8_matmul.SPLIT
    "split m64n64w4x4": (64, 64, 4, 4, 4),
    "split m64n128w4x2": (64, 128, 4, 4, 2),
    "split m32n64w4x2": (32, 64, 4, 4, 2),
    "split m16n64w4x2": (16, 64, 4, 4, 2),
    "split m64n64w4s3x2": (64, 64, 4, 3, 2),
}
FP8_BATCH_GRAPH_CALLS = 20


def time_fp8_batch_tiles(rows: list) -> None:
    """17-128 rows (a batch's decode step) through the w8a8 GEMM, device us per call from CUDA
    graphs of FP8_BATCH_GRAPH_CALLS calls (the activation quantize included, as the engine runs
    it): the tile before split-K (MEDIUM, or 16-row decode tiles where MEDIUM's leave SMs idle),
    the split-K candidates, the policy (`default_config`) and, up to 64 rows, the w8a16 GEMV;
    errors against the float32 product of the dequantized operands."""
    from deepserve.kernels import block_quant

    g = torch.Generator(device="cuda").manual_seed(12)
    for (n, k), layer in FP8_BATCH_SHAPES.items():
        w = block_quant.quantize_fp8(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        w_deq = w.dequantize()
        for m in FP8_BATCH_ROWS if layer.startswith("v4") else (64,):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            key = dict(op="fp8_batch_tile", layer=layer, n=n, k=k, m=m)
            timed = _fp8_batch_rows(key, x, w, _fp8_reference(x.float(), w_deq))
            rows.extend(timed)
            print(min((r for r in timed if "us" in r), key=lambda r: r["us"]), flush=True)
        del w, w_deq
        torch.cuda.empty_cache()


def _fp8_batch_rows(key: dict, x: torch.Tensor, w, want: torch.Tensor) -> list[dict]:
    """`time_fp8_batch_tiles`' rows for one shape and row count."""
    from deepserve.kernels.triton import fp8_gemv, fp8_matmul

    (m, n), out = (key["m"], key["n"]), []
    tiles = (m + 63) // 64 * ((n + 127) // 128)
    before = fp8_matmul.MEDIUM if tiles >= 132 else fp8_matmul.decode_config(n, m)
    cands = {"before": before, "policy": fp8_matmul.default_config(m, n, key["k"])} | {
        name: fp8_matmul.Fp8TileConfig(bm, bn, 8, warps, stages, waves)
        for name, (bm, bn, warps, stages, waves) in FP8_BATCH_CANDIDATES.items()
    }
    fns = {name: (lambda c=cfg: fp8_matmul.fp8_linear(x, w, c)) for name, cfg in cands.items()}
    if m <= fp8_gemv.MAX_ROWS:
        fns["gemv w8a16"] = lambda: fp8_gemv.fp8_gemv(x, w)
    for name, fn in fns.items():
        row = dict(key, cfg=name, tile=str(cands[name]) if name in cands else "")
        try:
            row["rel_err"] = rel(fn(), want)
            row["us"] = _graph_us(fn, FP8_BATCH_GRAPH_CALLS)
            row["tb_s"] = _weight_bytes(w) / row["us"] / 1e6
        except Exception as exc:  # a tile that does not build: recorded, the rest go on
            row["error"] = str(exc)[-200:]
        out.append(row)
    return out


FP8_PATH_ROWS = (1, 4, 16, 64)
FP8_GEMV_CANDIDATES = {  # block_n, num_warps, num_stages, waves (fp8_gemv.GemvConfig)
    "gemv n64w4s4x4": (64, 4, 4, 4),  # fp8_gemv.GEMV
    "gemv n64w4s4x2": (64, 4, 4, 2),
    "gemv n64w4s4x8": (64, 4, 4, 8),
    "gemv n32w4s4x4": (32, 4, 4, 4),
    "gemv n128w4s4x4": (128, 4, 4, 4),
    "gemv n128w8s3x4": (128, 8, 3, 4),
}


def time_fp8_paths(rows: list) -> None:
    """The default set's FP8 paths at M = 1, 4, 16, 64 on every FP8_SHAPES projection: the GEMV
    (fp8_gemv.py, x unquantized, split-K) under candidate configs, the w8a8 GEMM at its default
    tile, and bf16 cuBLAS on the same values; then one `fp8_path_pick` row per (shape, M): the
    path the policy takes (fp8_matmul.path), its ms through the set's own `linear`, the fastest
    candidate and the speedup over bf16. Errors against the float32 product of unquantized x
    and the dequantized weight."""
    from deepserve.kernels import block_quant

    g = torch.Generator(device="cuda").manual_seed(10)
    for (n, k), layer in FP8_SHAPES.items():
        w_bf16 = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        w = block_quant.quantize_fp8(w_bf16)
        w_deq = w.dequantize()
        for m in FP8_PATH_ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            rows.extend(_fp8_paths_at(dict(layer=layer, n=n, k=k, m=m), x, w, w_bf16, w_deq))
            print(rows[-1], flush=True)
        del w_deq
        torch.cuda.empty_cache()


def _fp8_paths_at(key: dict, x: torch.Tensor, w, w_bf16: torch.Tensor, w_deq) -> list[dict]:
    """`time_fp8_paths`' rows for one shape and row count, the pick last."""
    import triton.testing

    from deepserve.kernels.triton import fp8_gemv, fp8_matmul

    cands = {
        name: lambda c=fp8_gemv.GemvConfig(*c): fp8_gemv.fp8_gemv(x, w, c)
        for name, c in FP8_GEMV_CANDIDATES.items()
    }
    cands["gemm"] = lambda: fp8_matmul.fp8_linear(x, w)
    cands["bf16"] = lambda: x @ w_bf16.T
    want, out, timed = x.float() @ w_deq.T, [], {}
    for name, fn in cands.items():
        row = dict(op="fp8_path", **key, cfg=name)
        _timed(row, fn, want, lambda y: y)
        timed.update({name: row["ms"]} if "ms" in row else {})
        out.append(row)
    linear = fp8_matmul.linear_or(torch.nn.functional.linear)  # fast_kernels' linear
    ms = triton.testing.do_bench(lambda: linear(x, w), return_mode="median")
    fp8 = {name: t for name, t in timed.items() if name != "bf16"}
    best = min(fp8, key=fp8.get) if fp8 else None
    pick = dict(op="fp8_path_pick", **key, policy=fp8_matmul.path(key["m"], w),
                split=fp8_gemv.split_k(key["n"], key["k"]), ms_policy=ms,
                rel_err_policy=rel(linear(x, w), want), ms_bf16=timed.get("bf16"), best=best,
                ms_best=fp8.get(best))  # fmt: skip
    if pick["ms_bf16"]:
        pick["speedup_policy"] = pick["ms_bf16"] / ms
    return [*out, pick]


GEMV_SHAPES = {  # [N, K] of the dense projections at decode (V2-Lite, V3) -> layer
    (3648, 2048): "v2-lite x_proj (q_proj + kv_a, as the engine fuses them)",
    (3072, 2048): "v2-lite q_proj",
    (576, 2048): "v2-lite kv_a",
    (4096, 512): "v2-lite kv_b",
    (2048, 2048): "v2-lite o_proj",
    (5632, 2048): "v2-lite shared gate_up",
    (2048, 2816): "v2-lite shared down",
    (21888, 2048): "v2-lite dense gate_up",
    (2048, 10944): "v2-lite dense down (K cut)",
    (102400, 2048): "v2-lite lm head",
    (2112, 7168): "v3 x_proj (q_a + kv_a, as the engine fuses them)",
    (1536, 7168): "v3 q_a",
    (24576, 1536): "v3 q_b",
    (576, 7168): "v3 kv_a",
    (32768, 512): "v3 kv_b",
    (7168, 16384): "v3 o_proj",
    (36864, 7168): "v3 dense gate_up",
    (7168, 18432): "v3 dense down",
    (4096, 7168): "v3 shared gate_up",
    (7168, 2048): "v3 shared down",
    (129280, 7168): "v3 lm head",
}
# calls per decode step of V2-Lite (27 layers, the first dense) through the engine's linears
V2_LITE_STEP_CALLS = {
    (3648, 2048): 27,  # x_proj
    (2048, 2048): 27,  # o_proj
    (5632, 2048): 26,  # shared experts' gate_up
    (2048, 2816): 26,  # shared experts' down
    (21888, 2048): 1,
    (2048, 10944): 1,
    (102400, 2048): 1,  # lm head
}
GEMV_FP32_SHAPES = {(64, 2048): "v2-lite router", (256, 7168): "v3 router"}  # float32 x and w
GEMV_ROWS = (1, 2, 4, 8, 16)
GEMV_GRAPH_CALLS = 20
GEMV_TUNE_ROWS = (1,)  # these rows also time GEMV_CANDIDATES (graph us only)
GEMV_CANDIDATES = {  # block_n, num_warps, num_stages, waves (fp8_gemv.GemvConfig), one launch
    "n32": (32, 4, 4, 4),
    "n128w8": (128, 8, 3, 4),
    "x2": (64, 4, 4, 2),
    "x8": (64, 4, 4, 8),
    "xtile": (64, 4, 4, 4, True, True),  # x in w's layout at one row (GemvConfig.x_tile)
    "xtile n128w8": (128, 8, 3, 4, True, True),
}


def time_gemv_one_launch(rows: list) -> None:
    """fp8_gemv.py's one-launch split-K (the last program of a row block adds the partials)
    beside its two-launch form (a second kernel adds them) and cuBLAS bf16, for FP8 and bf16
    weights at every GEMV_SHAPES projection and M in GEMV_ROWS: one- vs two-launch bitwise, each
    path's relative error against the float32 product, and us per call inside a CUDA graph of
    GEMV_GRAPH_CALLS launches (as decode replays) and by do_bench; whether the default set's
    plain linear takes the stream (fp8_gemv.plain_path) and the graph speedup over cuBLAS (bf16
    on the unquantized weight for both formats), and the float32 routers (GEMV_FP32_SHAPES,
    beside float32 cuBLAS); at GEMV_TUNE_ROWS the graph us of other configs
    (GEMV_CANDIDATES, one launch)."""
    from deepserve.kernels import block_quant

    g = torch.Generator(device="cuda").manual_seed(11)
    for (n, k), layer in GEMV_SHAPES.items():
        w_bf16 = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        w8 = block_quant.quantize_fp8(w_bf16)
        weights = {"fp8": (w8, w8.dequantize()), "bf16": (w_bf16, w_bf16.float())}
        _gemv_rows(rows, dict(layer=layer, n=n, k=k), weights, w_bf16, torch.bfloat16, g)
        del w_bf16, w8, weights
        torch.cuda.empty_cache()
    for (n, k), layer in GEMV_FP32_SHAPES.items():
        w32 = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        _gemv_rows(rows, dict(layer=layer, n=n, k=k), {"fp32": (w32, w32)}, w32, torch.float32, g)
    rows.extend(_gemv_step_rows(rows))


def _gemv_step_rows(rows: list) -> list[dict]:
    """One row per (weights, M): V2-Lite's dense linears of one decode step (V2_LITE_STEP_CALLS)
    summed from the graph us of each path, and of the faster of one launch and cuBLAS."""
    out = []
    for fmt in ("fp8", "bf16"):
        for m in GEMV_ROWS:
            mine = {
                (r["n"], r["k"]): r
                for r in rows
                if r.get("op") == "gemv_one_launch" and r["weights"] == fmt and r["m"] == m
            }
            if not all(key in mine and "error" not in mine[key] for key in V2_LITE_STEP_CALLS):
                continue
            step = dict(op="gemv_v2_lite_step", weights=fmt, m=m)
            for path in ("one", "two", "cublas"):
                us = sum(c * mine[key][f"us_graph_{path}"] for key, c in V2_LITE_STEP_CALLS.items())
                step[f"us_{path}"] = round(us, 1)
            step["us_best_of_one_cublas"] = round(
                sum(
                    c * min(mine[key]["us_graph_one"], mine[key]["us_graph_cublas"])
                    for key, c in V2_LITE_STEP_CALLS.items()
                ),
                1,
            )
            out.append(step)
            print(step, flush=True)
    return out


def _gemv_rows(rows: list, key: dict, weights: dict, w_cublas, dtype: torch.dtype, g) -> None:
    """`time_gemv_one_launch`'s rows of one shape: every row count and weight format."""
    for m in GEMV_ROWS:
        x = torch.randn(m, key["k"], device="cuda", generator=g).to(dtype)
        for fmt, (w, w_ref) in weights.items():
            row = dict(op="gemv_one_launch", **key, m=m, weights=fmt)
            try:
                _gemv_paths_at(row, x, w, w_ref, w_cublas)
            except Exception as exc:  # recorded; the other shapes go on
                row["error"] = str(exc)[-300:]
            rows.append(row)
            print(row, flush=True)


def _gemv_paths_at(row: dict, x: torch.Tensor, w, w_ref: torch.Tensor, w_cublas) -> None:
    """`time_gemv_one_launch`'s columns for one weight format, shape and row count."""
    import triton.testing

    from deepserve.kernels.triton import fp8_gemv

    two = dataclasses.replace(fp8_gemv.GEMV, one_launch=False)
    run = fp8_gemv.gemv if isinstance(w, torch.Tensor) else fp8_gemv.fp8_gemv
    paths = {
        "one": lambda: run(x, w),
        "two": lambda: run(x, w, two),
        "cublas": lambda: torch.nn.functional.linear(x, w_cublas),
    }
    want = x.float() @ w_ref.T
    outs = {name: fn() for name, fn in paths.items()}
    again = paths["one"]()  # the counters reused: same bits
    row["split"] = fp8_gemv.split_k(row["n"], row["k"])
    row["bitwise_one_two"] = torch.equal(outs["one"], outs["two"])
    row["bitwise_repeat"] = torch.equal(outs["one"], again)
    for name, fn in paths.items():
        row[f"rel_{name}"] = rel(outs[name], want)
        row[f"us_graph_{name}"] = round(_graph_us(fn, GEMV_GRAPH_CALLS), 2)
        ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
        row[f"us_bench_{name}"] = round(ms * 1e3, 2)
    x_in = x.clone()
    fresh = torch.randn_like(x)
    row["graph_like_eager"] = _graph_replays_like_eager(lambda: run(x_in, w), [x_in], [fresh])
    counts = fp8_gemv._COUNTERS.get(x.device)
    row["counters_at_rest"] = counts is None or int(counts.abs().sum()) == 0
    row["tb_s_one"] = round(_weight_bytes(w) / row["us_graph_one"] / 1e6, 2)
    row["one_vs_cublas"] = round(row["us_graph_cublas"] / row["us_graph_one"], 3)
    if isinstance(w, torch.Tensor):
        row["plain_path"] = fp8_gemv.plain_path(row["m"], w)
    if row["m"] in GEMV_TUNE_ROWS:
        for name, c in GEMV_CANDIDATES.items():
            fn = functools.partial(run, x, w, fp8_gemv.GemvConfig(*c))
            if name == "xtile":  # same arithmetic as the default? (same tile, x from L1)
                row["xtile_bitwise_one"] = torch.equal(fn(), outs["one"])
                row["rel_xtile"] = rel(fn(), want)
            try:
                row[f"us_graph_{name}"] = round(_graph_us(fn, GEMV_GRAPH_CALLS), 2)
            except Exception as exc:  # a config over the shared memory: recorded
                row[f"us_graph_{name}"] = f"error: {str(exc)[-120:]}"


def _weight_bytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.data.numel() + w.scale.numel() * 4


def run_fp8(
    out: dict,
    deadline: float = float("inf"),
    checks: list[str] | None = None,
    moe_shapes: tuple[str, ...] | None = None,
) -> None:
    """`--only fp8`: the FP8 GEMM and the FP8 / MXFP4 fused MoE checks, the V3 slice in FP8 and
    a V4-Flash-shaped model in V4's FP8 + MXFP4 through the loader, the default set's paths by
    row count (GEMV beside GEMM and bf16), then the GEMM's decode tiles, and the MoE's `align`
    (sort kernel, old one-hot kernel, torch; `time_moe_align`); `checks` names a subset
    (`--fp8-checks`)."""
    import traceback

    rows = out.setdefault("fp8", [])
    every = (
        check_fp8_linear,
        check_grouped_fp8,
        functools.partial(check_quantized_moe, shapes=moe_shapes or FP8_MOE_DEFAULT),
        functools.partial(check_mxfp4_moe, shapes=moe_shapes or ("v4-flash",), deadline=deadline),
        check_fp8_model,
        check_v4_quantized_model,
        time_fp8_paths,
        time_gemv_one_launch,
        time_fp8_decode_tiles,
        time_fp8_batch_tiles,
        time_moe_decode_configs,
        time_moe_align,
    )
    for fn in every:
        name = getattr(fn, "__name__", None) or fn.func.__name__
        if checks is not None and name not in checks:
            continue
        if time.time() > deadline:  # the checks left are skipped, the rows so far kept
            rows.append(dict(op=name, error="skipped: out of time"))
            continue
        try:
            fn(rows)
        except Exception as e:  # recorded; the job goes on
            rows.append(dict(op=name, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)


ALIGN_CASES = (  # (tokens, top_k, experts, block_m): V2-Lite / V4-Flash decode, prefill sizes
    (64, 6, 64, 16), (64, 6, 256, 16), (1, 6, 256, 16), (2000, 6, 64, 64),
    (1024, 8, 256, 64), (2048, 8, 256, 64), (8192, 8, 256, 128),
)  # fmt: skip
ALIGN_GRAPH_CALLS = 100


def time_moe_align(rows: list) -> None:
    """The fused MoE's `align` three ways: the sort-based kernel (`align_kernel`, what `align`
    takes up to ALIGN_KERNEL_MAX_PAIRS pairs), the old one-hot kernel (where it fit) and the
    torch path (`align_reference`): us per call by do_bench (median, launch latency included)
    and inside one CUDA graph of ALIGN_GRAPH_CALLS launches (as decode replays it), and the
    kernel's outputs bitwise against the torch path's on these router-like ids."""
    import triton.testing
    from align_onehot import align_onehot, fits

    from deepserve.kernels.triton import fused_moe

    g = torch.Generator(device="cuda").manual_seed(12)
    for tokens, k, e, block_m in ALIGN_CASES:
        ids = torch.rand(tokens, e, device="cuda", generator=g).topk(k, dim=-1)[1]
        got, want = (
            fused_moe.align_kernel(ids, e, block_m),
            fused_moe.align_reference(ids, e, block_m),
        )
        row = dict(op="moe_align", tokens=tokens, top_k=k, experts=e, block_m=block_m,
                   bitwise=all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
                   kernel_path=tokens * k <= fused_moe.ALIGN_KERNEL_MAX_PAIRS)  # fmt: skip
        ways = {"sort": fused_moe.align_kernel, "torch": fused_moe.align_reference}
        if fits(tokens * k, e):
            ways["onehot"] = align_onehot
            row["onehot_bitwise"] = all(
                torch.equal(a, b) for a, b in zip(align_onehot(ids, e, block_m), want, strict=True)
            )
        for name, align in ways.items():
            fn = functools.partial(align, ids, e, block_m)
            row[f"us_{name}"] = round(1000 * triton.testing.do_bench(fn, return_mode="median"), 2)
            row[f"us_graph_{name}"] = round(_graph_us(fn, ALIGN_GRAPH_CALLS), 2)
        rows.append(row)
        print(row, flush=True)


FP8_MOE_SHAPES = {  # experts, hidden, intermediate, top-k
    "v2-lite": (64, 2048, 1408, 6),
    "v3": (256, 7168, 2048, 8),
    "v4-flash": (256, 4096, 2048, 6),
}
FP8_MOE_DEFAULT = ("v2-lite", "v3")  # V4-Flash's MXFP4 experts: `--fp8-moe-shapes v4-flash`
FP8_MOE_TOKENS = (1, 64, 1024)


def check_quantized_moe(rows: list, shapes: tuple[str, ...] = FP8_MOE_DEFAULT) -> None:
    """The fused MoE with FP8 and with MXFP4 experts against the float32 loop on their
    dequantization (FP8: on e4m3 inputs too where the default config quantizes them), a row
    alone equal to it in a batch under DECODE, and median ms beside the bf16 experts of the
    same values (FP8 at decode sizes: the w8a8 DECODE scheme's ms too)."""
    import triton.testing

    from deepserve.kernels import block_quant
    from deepserve.kernels.triton import fused_moe

    g = torch.Generator(device="cuda").manual_seed(9)
    for shape in shapes:
        e, h, i, k = FP8_MOE_SHAPES[shape]
        gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
        down = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
        formats = {  # expert by expert: a layer's float32 temporaries would not fit
            name: tuple(
                block_quant.stack([q(m[j]) for j in range(e)], m.dtype) for m in (gate_up, down)
            )
            for name, q in (
                ("fp8", block_quant.quantize_fp8),
                ("mxfp4", block_quant.quantize_mxfp4),
            )
        }
        for t in FP8_MOE_TOKENS:
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1)[1]
            w = torch.rand(t, k, device="cuda", generator=g)
            ms_bf16 = triton.testing.do_bench(
                lambda x=x, ids=ids, w=w, gu=gate_up, dn=down: fused_moe.fused_moe(
                    x, gu, dn, w, ids
                ),
                return_mode="median",
            )
            # the default config's FP8 scheme (w8a16 for decode-sized calls) is the reference's
            fp8_inputs = fused_moe.default_config(t * k, e).fp8_inputs
            for fmt, (gu, dn) in formats.items():
                checked = min(t, 8)  # the float32 loop is slow: the first rows
                want = fused_moe.fused_moe_reference(
                    x[:checked], gu, dn, w[:checked], ids[:checked], fp8_inputs=fp8_inputs
                )
                got = fused_moe.fused_moe(x, gu, dn, w, ids)
                full = fused_moe.fused_moe(x, gu, dn, w, ids, fused_moe.DECODE)
                one = fused_moe.fused_moe(x[:1], gu, dn, w[:1], ids[:1], fused_moe.DECODE)
                ms = triton.testing.do_bench(
                    lambda x=x, ids=ids, w=w, gu=gu, dn=dn: fused_moe.fused_moe(x, gu, dn, w, ids),
                    return_mode="median",
                )
                row = dict(op=f"fused_moe_{fmt}", shape=shape, tokens=t,
                           rel_err=rel(got[:checked], want), nan=bool(got.isnan().any()),
                           row_invariant=bool(torch.equal(full[:1], one)),
                           ms=ms, ms_bf16=ms_bf16, speedup=ms_bf16 / ms)  # fmt: skip
                row["ok"] = row["rel_err"] < 2e-2 and not row["nan"]
                if fmt == "fp8" and not fp8_inputs:  # the w8a8 scheme at the same tile, timed
                    row["ms_w8a8_decode"] = triton.testing.do_bench(
                        lambda x=x, ids=ids, w=w, gu=gu, dn=dn: fused_moe.fused_moe(
                            x, gu, dn, w, ids, fused_moe.DECODE
                        ),
                        return_mode="median",
                    )
                rows.append(row)
                print(row, flush=True)
        formats.clear()
        torch.cuda.empty_cache()


def time_moe_decode_configs(rows: list, shape: str = "v2-lite") -> None:
    """The fused MoE's decode tile (block_m 16) swept for bf16 and FP8 (w8a16) experts at 1 and
    64 tokens: median ms per config, the same values throughout, beside today's default config
    (the first row of each group); HBM GB/s of the expert bytes the call touches."""
    import itertools

    import triton.testing

    from deepserve.kernels import block_quant
    from deepserve.kernels.triton import fused_moe

    g = torch.Generator(device="cuda").manual_seed(11)
    e, h, i, k = FP8_MOE_SHAPES[shape]
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
    fp8 = tuple(
        block_quant.stack([block_quant.quantize_fp8(m[j]) for j in range(e)], m.dtype)
        for m in (gate_up, down)
    )
    sweep = [
        fused_moe.MoeConfig(16, bn, bk, warps, stages, fp8_inputs=False)
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 5))
    ]
    for tokens in (1, 64):
        x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
        ids = torch.rand(tokens, e, device="cuda", generator=g).topk(k, dim=-1)[1]
        w = torch.rand(tokens, k, device="cuda", generator=g)
        touched = int(ids.unique().numel())
        for fmt, (gu, dn), width in (("bf16", (gate_up, down), 2), ("fp8", fp8, 1)):
            default = fused_moe.default_config(tokens * k, e)
            configs = [default] + [c for c in sweep if fmt == "bf16" or c.block_k == 128]
            for cfg in configs:
                try:  # a tile past the shared memory fails to compile: recorded as inf
                    ms = triton.testing.do_bench(
                        lambda x=x, gu=gu, dn=dn, w=w, ids=ids, cfg=cfg: fused_moe.fused_moe(
                            x, gu, dn, w, ids, cfg
                        ),
                        return_mode="median",
                    )
                except Exception:
                    ms = float("inf")
                gb = touched * 3 * h * i * width / 1e9
                rows.append(dict(op="moe_decode_config", shape=shape, fmt=fmt, tokens=tokens,
                                 default=cfg is default, block_n=cfg.block_n, block_k=cfg.block_k,
                                 warps=cfg.num_warps, stages=cfg.num_stages, ms=ms,
                                 gb_s=round(gb / (ms / 1e3))))  # fmt: skip
            best = min((r for r in rows[-len(configs) :]), key=lambda r: r["ms"])
            print(fmt, tokens, "default", rows[-len(configs)]["ms"], "best", best, flush=True)


MXFP4_TILES = {  # (tokens they are swept at) -> name -> MoeConfig, the PTX e2m1 decode
    "decode": {
        "16x64x128w4s4": (16, 64, 128, 4, 4),
        "16x32x128w4s4": (16, 32, 128, 4, 4),
        "16x128x128w4s4": (16, 128, 128, 4, 4),
        "16x64x256w4s4": (16, 64, 256, 4, 4),
        "16x64x256w8s3": (16, 64, 256, 8, 3),
        "16x64x128w2s4": (16, 64, 128, 2, 4),
        "16x64x128w4s6": (16, 64, 128, 4, 6),
        "16x128x256w8s3": (16, 128, 256, 8, 3),
        # at 64 tokens the decode tile was L1-bound (ncu: L1 82%, issue slots 62%, DRAM 45%),
        # mostly each warp's reads of the activation tile: more columns a warp, fewer K a step
        "16x128x64w4s4": (16, 128, 64, 4, 4),
        "16x128x64w4s6": (16, 128, 64, 4, 6),
        "16x64x128w4s3": (16, 64, 128, 4, 3),
        "16x64x64w4s6": (16, 64, 64, 4, 6),
        "16x64x64w4s8": (16, 64, 64, 4, 8),
    },
    "prefill": {
        "64x128x64w8s3": (64, 128, 64, 8, 3),
        "64x128x128w8s3": (64, 128, 128, 8, 3),
        "32x128x128w4s4": (32, 128, 128, 4, 4),
        "16x128x128w4s4": (16, 128, 128, 4, 4),
        "64x64x128w4s4": (64, 64, 128, 4, 4),
        "128x128x64w8s3": (128, 128, 64, 8, 3),
    },
}


def check_mxfp4_moe(
    rows: list, shapes: tuple[str, ...] = ("v4-flash",), deadline: float = float("inf")
) -> None:
    """The fused MoE on MXFP4 experts, its e2m1 decodes (fused_moe.py `E2M1_BF16_PTX`, its folded
    text, the integer `_e2m1`) under the default config at 1 / 64 / 1024 tokens: the PTX one
    (folded: these scales are small) against the float32 loop on the dequantized experts and bit
    for bit against the other two (all exact), a row alone equal to it in a batch, median ms of
    all three and of the bf16 experts of the
    same values; then tiles swept with the PTX decode (`MXFP4_TILES`: the decode ones at 1 and
    64 tokens, the wide ones at 1024)."""
    from deepserve.kernels import block_quant

    g = torch.Generator(device="cuda").manual_seed(11)
    for shape in shapes:
        e, h, i, k = FP8_MOE_SHAPES[shape]
        bf16 = (
            (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16(),
            (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16(),
        )
        mx = tuple(
            block_quant.stack([block_quant.quantize_mxfp4(m[j]) for j in range(e)], m.dtype)
            for m in bf16
        )
        for t in FP8_MOE_TOKENS:
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1)[1]
            w = torch.rand(t, k, device="cuda", generator=g)
            if not _mxfp4_moe_at(rows, shape, x, ids, w, bf16, mx, deadline):
                return
        del bf16, mx
        torch.cuda.empty_cache()


def _mxfp4_moe_at(rows: list, shape: str, x, ids, w, bf16, mx, deadline: float) -> bool:
    """check_mxfp4_moe at one batch; False once out of time."""
    import dataclasses

    import triton.testing

    from deepserve.kernels.triton import fused_moe

    def bench(cfg) -> float:
        return triton.testing.do_bench(functools.partial(run, cfg), return_mode="median")

    t, k, e = x.shape[0], ids.shape[1], mx[0].shape[0]
    checked = min(t, 8)  # the float32 loop is slow: the first rows
    want = fused_moe.fused_moe_reference(x[:checked], *mx, w[:checked], ids[:checked])
    cfg = fused_moe.default_config(t * k, e, mxfp4=True)
    integer = dataclasses.replace(cfg, e2m1_ptx=False)
    unfolded = dataclasses.replace(cfg, e2m1_fold=False)
    run = functools.partial(fused_moe.fused_moe, x, *mx, w, ids)
    got, got_int, got_unfolded = run(cfg), run(integer), run(unfolded)
    one = fused_moe.fused_moe(x[:1], *mx, w[:1], ids[:1], cfg)
    plain = functools.partial(fused_moe.fused_moe, x, *bf16, w, ids)
    row = dict(op="mxfp4_moe", shape=shape, tokens=t, rel_err=rel(got[:checked], want),
               rel_err_integer=rel(got_int[:checked], want),
               bitwise_integer=bool(torch.equal(got, got_int)), nan=bool(got.isnan().any()),
               folded=bool(mx[0].small_scales and mx[1].small_scales),
               bitwise_unfolded=bool(torch.equal(got, got_unfolded)),
               row_invariant=bool(torch.equal(got[:1], one)), ms_ptx=bench(cfg),
               ms_unfolded=bench(unfolded), ms_integer=bench(integer),
               ms_bf16=triton.testing.do_bench(plain, return_mode="median"))  # fmt: skip
    row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_ptx"]
    row["speedup_vs_integer"] = row["ms_integer"] / row["ms_ptx"]
    row["speedup_vs_unfolded"] = row["ms_unfolded"] / row["ms_ptx"]
    row["ok"] = (
        row["rel_err"] < 2e-2 and row["bitwise_integer"] and row["bitwise_unfolded"]
        and not row["nan"]
    )  # fmt: skip
    rows.append(row)
    print(row, flush=True)
    tiles = MXFP4_TILES["decode" if t * k < fused_moe.PREFILL_MIN_PAIRS else "prefill"]
    for name, tile in tiles.items():
        if time.time() > deadline:
            rows.append(dict(op="mxfp4_moe_tile", error="skipped: out of time"))
            return False
        trow = dict(op="mxfp4_moe_tile", shape=shape, tokens=t, cfg=name)
        _timed(trow, functools.partial(run, fused_moe.MoeConfig(*tile)), want, lambda y: y[:checked])  # fmt: skip
        trow["speedup_vs_bf16"] = row["ms_bf16"] / trow["ms"] if "ms" in trow else None
        rows.append(trow)
        print(trow, flush=True)
    return True


def check_fp8_model(rows: list) -> None:
    """The DeepSeek-V3 slice (real geometry, 16 routed experts) written in V3's published FP8
    layout, loaded on the GPU the engine's way (FP8 kept for the CUDA kernels) and read
    dequantized to bf16: which weights stay FP8, and the last-position logits of both (relative
    error and top-1 agreement), for the fast set and `--batch-invariant`'s."""
    import tempfile
    from pathlib import Path

    from deepserve.engine.config import EngineConfig
    from deepserve.engine.loading.loader import load_model
    from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from deepserve.engine.testmodels.model_shapes import write_shaped_model
    from deepserve.kernels.block_quant import Fp8Weight

    folder = write_shaped_model(
        "deepseek-v3-slice", Path(tempfile.mkdtemp()) / "v3-fp8", device="cuda",
        overrides={"n_routed_experts": 16}, quantization="fp8",
    )  # fmt: skip
    loaded = load_model(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16")).model
    kept = {
        "x_proj": loaded.layers[0].attn.x_proj,
        "o": loaded.layers[0].attn.o,
        "dense gate_up": loaded.layers[0].mlp.gate_up,
        "experts gate_up": loaded.layers[3].mlp.gate_up,
        "experts down": loaded.layers[3].mlp.down,
    }
    rows.append(
        dict(op="fp8_model_weights", **{k: isinstance(v, Fp8Weight) for k, v in kept.items()})
    )
    del loaded
    torch.cuda.empty_cache()
    _kept_against_dequantized(rows, folder, DeepseekV3ForCausalLM, "fp8_model_logits")


def _kept_against_dequantized(rows: list, folder, model_cls, op: str) -> None:
    """Last-position logits of a 64-token prompt with the checkpoint's formats kept (fast set,
    then `--batch-invariant`'s) against its bf16 dequantization on the fast set."""
    from model_loop import SequenceLoop

    from deepserve.engine.loading.hf_loader import read_hf_folder
    from deepserve.engine.models.common import WeightStore
    from deepserve.kernels.registry import get_kernels

    prompt = list(range(100, 164))

    def last_logits(keep: bool, flag: bool) -> torch.Tensor:
        ckpt = read_hf_folder(folder, torch.bfloat16, keep_quantized=keep)
        store = WeightStore(ckpt.weights, torch.device("cuda"), torch.bfloat16)
        with torch.inference_mode():
            model = model_cls(ckpt.config, store, get_kernels("cuda", flag), "quantized")
        out = SequenceLoop(model, 128).logits(prompt).float()
        del model, store, ckpt
        torch.cuda.empty_cache()
        return out

    want = last_logits(keep=False, flag=False)  # bf16 weights, the default set
    for flag in (False, True):
        got = last_logits(keep=True, flag=flag)
        row = dict(op=op, batch_invariant=flag, rel_err=rel(got, want),
                   top1_equal=bool(got.argmax() == want.argmax()))  # fmt: skip
        rows.append(row)
        print(row, flush=True)


def check_v4_quantized_model(rows: list) -> None:
    """The V4-Flash geometry (3 layers: sliding, CSA, HCA; 16 routed experts) written in V4's
    published layout (FP8 dense projections with UE8M0 scales, MXFP4 routed experts), loaded
    the engine's way: which weights stay quantized, and the last-position logits with the
    formats kept against the bf16 dequantization, fast set and `--batch-invariant`'s."""
    import tempfile
    from pathlib import Path

    from deepserve.engine.config import EngineConfig
    from deepserve.engine.loading.loader import load_model
    from deepserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepserve.engine.testmodels.model_shapes import v4_layer_schedule, write_shaped_model
    from deepserve.kernels.block_quant import Fp8Weight, Mxfp4Weight

    folder = write_shaped_model(
        "deepseek-v4-flash", Path(tempfile.mkdtemp()) / "v4-mxfp4", device="cuda",
        overrides=dict(v4_layer_schedule(3), n_routed_experts=16), quantization="mxfp4",
    )  # fmt: skip
    loaded = load_model(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16")).model
    attn, moe = loaded.layers[1].attn, loaded.layers[1].moe
    formats = {"wq_b": attn.wq_b, "wo_b": attn.wo_b, "shared gate_up": moe.shared_gate_up,
               "experts gate_up": moe.gate_up, "experts down": moe.down}  # fmt: skip
    kinds = {Fp8Weight: "fp8", Mxfp4Weight: "mxfp4"}
    rows.append(dict(op="v4_quantized_weights",
                     **{k: kinds.get(type(v), "plain") for k, v in formats.items()}))  # fmt: skip
    del loaded, attn, moe, formats
    torch.cuda.empty_cache()
    _kept_against_dequantized(rows, folder, DeepseekV4ForCausalLM, "v4_quantized_logits")


# ---- `--kv-cache-dtype fp8`: the e4m3 KV cache's kernels and decode speed ----------------------


def _e4m3(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype):
    """`_decode_case`'s caches as e4m3 codes, and those codes widened to `dtype` (V still K's
    leading columns where it was)."""
    shared = v_cache.data_ptr() == k_cache.data_ptr()
    base = k_cache if shared else torch.cat([k_cache, v_cache], dim=-1)
    codes = base.to(torch.float8_e4m3fn)
    wide = codes.to(dtype)
    dk, dv = k_cache.shape[-1], v_cache.shape[-1]
    if shared:
        return (codes, codes[..., :dv]), (wide, wide[..., :dv])
    return (codes[..., :dk], codes[..., dk:]), (wide[..., :dk], wide[..., dk:])


def check_kv_fp8_attention(rows: list) -> None:
    """Decode steps through the default decode kernel and both sets' fixed-split kernels, and a
    prefill chunk mixed with decodes through both varlen kernels, over e4m3: bitwise their
    result over the widened bf16 cache, and close to the float32 reference."""
    from deepserve.kernels.reference import attention as attention_ref
    from deepserve.kernels.triton.decode_attention import InvariantPagedAttention
    from deepserve.kernels.triton.kernelset import FastPagedAttention

    gen = torch.Generator().manual_seed(21)
    ops = {"fast": FastPagedAttention(), "invariant": InvariantPagedAttention()}
    for layout in ("mla", "gqa"):
        for lens in ([1], [7, 300, 33], [17] * 64 + [2000]):
            q, k, v, attn = _decode_case(layout, torch.bfloat16, lens, 16, 9000, gen)
            (k8, v8), (kw, vw) = _e4m3(k, v, torch.bfloat16)
            want = attention_ref.paged_attention(q.float(), kw.float(), vw.float(), attn, 0.07)
            for name, op in ops.items():
                got = op(q, k8, v8, attn, 0.07)
                rows.append(dict(op="kv_fp8_decode", kernel=name, layout=layout,
                                 lens=str(lens[:4]), equal=bool(torch.equal(got, op(q, kw, vw, attn, 0.07))),
                                 rel_err=rel(got, want)))  # fmt: skip
        _kv_fp8_varlen_rows(rows, layout, ops, gen)


def _kv_fp8_varlen_rows(rows: list, layout: str, ops: dict, gen) -> None:
    from deepserve.kernels.reference import attention as attention_ref

    q, k, v, _ = _decode_case(layout, torch.bfloat16, [1], 16, 700, gen)
    (k8, v8), (kw, vw) = _e4m3(k, v, torch.bfloat16)
    # a 2,000-token prefill chunk over 3,000 cached tokens, beside a decode of 500
    tables = torch.randperm(700, generator=gen)[:626].view(2, 313).to(torch.int32).cuda()
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device="cuda")  # noqa: E731
    attn = AttentionMetadata(
        query_start_loc=t([0, 2000, 2001]), seq_lens=t([5000, 500]), context_lens=t([3000, 499]),
        slot_mapping=t([0] * 2001, torch.int64), block_tables=tables, block_size=16,
        query_lens_cpu=[2000, 1], seq_lens_cpu=[5000, 500], context_lens_cpu=[3000, 499],
    )  # fmt: skip
    qs = torch.randn(2001, q.shape[1], q.shape[2], generator=gen).to("cuda", torch.bfloat16)
    want = attention_ref.paged_attention(qs.float(), kw.float(), vw.float(), attn, 0.07)
    for name, op in ops.items():
        got = op(qs, k8, v8, attn, 0.07)
        rows.append(dict(op="kv_fp8_varlen", kernel=name, layout=layout,
                         equal=bool(torch.equal(got, op(qs, kw, vw, attn, 0.07))),
                         rel_err=rel(got, want)))  # fmt: skip


def check_kv_fp8_writes(rows: list) -> None:
    """The fused MLA latent write and llama's rope + K/V write into e4m3 caches from bf16 rows,
    against the unfused torch ops' codes (kv_quant.quantize): the share of equal codes (the MLA
    kernel rounds float32 straight to e4m3, torch through bf16 first: a rare code apart) and
    whether any value overflowed to NaN (values past 448: they must saturate)."""
    from deepserve.kernels import kv_quant
    from deepserve.kernels.reference import rms_norm
    from deepserve.kernels.reference.attention import write_kv
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import mla, rope

    g = torch.Generator().manual_seed(22)
    tokens, bf16, fp8 = 300, torch.bfloat16, torch.float8_e4m3fn
    pos = torch.randint(0, 4000, (tokens,), generator=g).cuda()
    slots = torch.randperm(64 * 16, generator=g)[:tokens].cuda()
    ckv = (torch.randn(tokens, 576, generator=g) * 50).to("cuda", bf16)
    norm = (torch.rand(512, generator=g) * 200).to("cuda", bf16)
    cos, sin = rope_at(build_rope_tables(64, 10000.0, None, 4096, "cuda"), pos, bf16)
    cache = torch.zeros(64, 16, 576, device="cuda", dtype=fp8)
    assert mla.kv_write_(ckv, norm, 1e-6, cos, sin, cache, slots)
    want = torch.cat([rms_norm(ckv[:, :512], norm, 1e-6),
                      apply_rope(ckv[:, 512:].unsqueeze(1), cos, sin)[:, 0]], -1)  # fmt: skip
    want = kv_quant.quantize(want, fp8)
    got = kv_quant.index_rows(cache.view(-1, 576), slots)
    rows.append(dict(op="kv_fp8_mla_write", equal_codes=float((got.view(torch.uint8) == want.view(torch.uint8)).float().mean()),
                     nan=bool(got.float().isnan().any()), saturated=float((got.float().abs() == 448).float().mean())))  # fmt: skip
    hq, hkv, d = 9, 3, 64
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 400).to("cuda", bf16)
    cos, sin = rope_at(build_rope_tables(d, 10000.0, None, 4096, "cuda"), pos, bf16)
    layer = torch.zeros(64, 16, 2 * hkv * d, device="cuda", dtype=fp8)
    ref = layer.clone()
    k_cache, v_cache = (p.unflatten(-1, (hkv, d)) for p in layer.chunk(2, dim=-1))
    want_k, want_v = (p.unflatten(-1, (hkv, d)) for p in ref.chunk(2, dim=-1))
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
    write_kv(want_k, slots, qk[:, hq:])
    write_kv(want_v, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    assert rope.rope_qk_write_kv_(qkv, cos, sin, k_cache, v_cache, slots, hq)
    rows.append(dict(op="kv_fp8_rope_write", equal=bool(torch.equal(layer.view(torch.uint8), ref.view(torch.uint8))),
                     nan=bool(layer.float().isnan().any())))  # fmt: skip


def time_kv_fp8_decode(rows: list) -> None:
    """The default decode kernel's us per layer over bf16 and e4m3 caches of the same values:
    V2-Lite's latent (16 heads over 576) at batch 1 x 32K and 131K and batch 64 x 4K, SmolLM2's
    GQA (9 over 3 heads of 64) at batch 64 x 4K; and the bytes of KV read per step."""
    import triton.testing

    from deepserve.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(23)
    for layout, batch, length in (("mla", 1, 32768), ("mla", 1, 131072), ("mla", 64, 4096),
                                  ("gqa", 64, 4096)):  # fmt: skip
        nb = batch * (length // 16) + 8
        q, k, v, attn = _decode_case(layout, torch.bfloat16, [length] * batch, 16, nb, gen)
        (k8, v8), _ = _e4m3(k, v, torch.bfloat16)
        row = dict(op="kv_fp8_decode_time", layout=layout, batch=batch, ctx=length)
        for name, (kc, vc) in (("bf16", (k, v)), ("fp8", (k8, v8))):
            fn = lambda q=q, kc=kc, vc=vc, a=attn: decode_attention(q, kc, vc, a, 0.07)  # noqa: E731
            ms = triton.testing.do_bench(fn, return_mode="median")
            width = kc.shape[-1] * kc.shape[-2] + (
                0 if layout == "mla" else vc.shape[-1] * vc.shape[-2]
            )
            gb = batch * length * width * kc.element_size() / 1e9
            row.update({f"{name}_us": round(ms * 1000, 1), f"{name}_gb_s": round(gb / ms * 1000)})
        row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 2)
        rows.append(row)
        print(row, flush=True)
        del k, v, k8, v8


def time_kv_fp8_engine(rows: list, layers: int = 4, batch: int = 64, ctx: int = 4000) -> None:
    """A V2-Lite-shaped engine of `layers` layers (random bf16 weights, the default CUDA set and
    its graphs) decoding `batch` sequences of `ctx`-token prompts, with a bf16 and an e4m3 KV
    cache in the same --kv-cache-bytes: decode tok/s, the pool's tokens, and whether the greedy
    first tokens agree (4,000 + 33 tokens: inside the shape's 4,096 positions)."""
    import random

    import speed

    config = dict(speed.SHAPES["v2-lite"], num_hidden_layers=layers)
    hf = speed.build_hf(config)
    weights = dict(hf.state_dict())
    firsts = {}
    for kv in ("auto", "fp8"):
        llm = speed.build_llm_over(config, weights, False, kv_cache_dtype=kv,
                                   kv_cache_bytes=4 * 2**30, max_num_batched_tokens=16384)  # fmt: skip
        rng = random.Random(5)  # the same prompts for both caches
        ps, fresh = (speed.prompts(rng, batch, ctx, config["vocab_size"]) for _ in range(2))
        llm.generate(ps[:2], speed.greedy(4))  # warm-up: graphs, kernels
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = llm.generate(ps, speed.greedy(1))
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        # fresh prompts (no prefix-cache hit), the decode steps timed on their own
        decode_tok_s = speed.decode_steps_tok_s(llm, fresh, 32)
        firsts[kv] = [r.samples[0].token_ids[0] for r in first]
        card = llm.engine.card()
        rows.append(dict(op="kv_fp8_engine_decode", kv=kv, layers=layers, batch=batch, ctx=ctx,
                         pool_tokens=card.limits.kv_pool_tokens, kv_block_bytes=card.kv_block_bytes,
                         decode_tok_s=round(decode_tok_s), prefill_s=round(t_prefill, 2)))  # fmt: skip
        print(rows[-1], flush=True)
        again = speed.prompts(rng, batch, ctx, config["vocab_size"])
        rows.append(dict(op="kv_fp8_engine_step_profile", kv=kv, **_profile_decode(llm, again)))
        print(rows[-1], flush=True)
        llm.close()
        del llm
        torch.cuda.empty_cache()
    agree = sum(a == b for a, b in zip(firsts["auto"], firsts["fp8"], strict=True))
    rows.append(dict(op="kv_fp8_engine_first_tokens", agree=agree, of=batch))


def _profile_decode(llm, prompts: list[list[int]]) -> dict:
    """One decode step of `prompts` (fresh, every one past its prefill) under torch.profiler:
    speed.py's summary (kernels, syncs, busy fraction, the costliest kernels)."""
    import speed

    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_admitted(f"prof-{i}", engine.admit(ids, speed.greedy(8)))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step())
    engine.step()
    return speed.profile_next_step(engine)


def run_kv_fp8(out: dict, deadline: float = float("inf")) -> None:
    """`--only kv_fp8`: the e4m3 KV cache's kernel checks, then decode timed with either cache."""
    import traceback

    rows = out.setdefault("kv_fp8", [])
    for fn in (check_kv_fp8_attention, check_kv_fp8_writes, time_kv_fp8_decode, time_kv_fp8_engine):
        if time.time() > deadline:
            rows.append(dict(op=fn.__name__, error="skipped: out of time"))
            continue
        try:
            fn(rows)
        except Exception as e:  # recorded; the job goes on
            rows.append(dict(op=fn.__name__, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)
