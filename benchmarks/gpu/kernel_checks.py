"""The GPU kernels of the default path against their torch oracles, on fresh random inputs:
fused MoE (decode and prefill tiles) against a float32 loop, the decode attention kernel (MLA and
GQA layouts, shuffled block tables) against kernels/attention_ref.py, the fixed-split kernel's
device-side decode layout against its host layout (bitwise), and graph-replayed decode steps
against eager ones. Imported by run_all.py; returns rows of max relative errors."""

from __future__ import annotations

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata


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
            for cname, cfg in (("decode", fused_moe.DECODE), ("prefill", fused_moe.PREFILL)):
                got = fused_moe.fused_moe(x, gate_up, down, w, ids, cfg)
                rows.append(dict(op="fused_moe", dtype=str(dtype), tokens=t, cfg=cname,
                                 rel_err=rel(got, want), nan=bool(got.isnan().any())))  # fmt: skip
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


def check_decode_attention(rows: list) -> None:
    from deepserve.kernels import attention_ref
    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(1)
    bs, nb = 16, 9000
    for layout in ("mla", "gqa"):
        for dtype in (torch.bfloat16, torch.float32):
            for lens in ([1], [7, 300, 33], [1000] * 4, [17] * 64 + [2000]):
                if layout == "mla":
                    cache = torch.randn(nb, bs, 576, generator=gen).to("cuda", dtype).unsqueeze(2)
                    k_cache, v_cache, hq = cache, cache[..., :512], 16
                else:
                    cache = torch.randn(nb, bs, 2 * 3 * 64, generator=gen).to("cuda", dtype)
                    k_cache = cache[..., :192].unflatten(-1, (3, 64))
                    v_cache = cache[..., 192:].unflatten(-1, (3, 64))
                    hq = 9
                q = torch.randn(len(lens), hq, k_cache.shape[-1], generator=gen).to("cuda", dtype)
                attn = _metadata(lens, bs, nb, gen)
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


def run(out: dict) -> None:
    rows = out.setdefault("kernel_checks", [])
    for fn in (check_moe, check_decode_attention):
        try:
            fn(rows)
        except Exception as e:  # recorded; the job goes on
            import traceback

            rows.append(dict(op=fn.__name__, error=traceback.format_exc()[-1500:]))
            print(e, flush=True)
