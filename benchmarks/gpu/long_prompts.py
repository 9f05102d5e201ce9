"""Long prompts on the GPU (issue 33): kernels over tensors past 2^31 elements against torch, and
one fresh prompt at a time through the offline engine up to 131,072 tokens on the
DeepSeek-V2-Lite shape (its own 163,840-token context) and 8,192 on the SmolLM2 shape, with and
without `--batch-invariant`: TTFT and batch-1 decode over that context. `--sanitize` runs the
long-context kernels and a 2-layer V2-Lite-shaped engine on a 32,768-token prompt, meant to run
under `compute-sanitizer --tool memcheck` (every tensor its own allocation, so an access past one
is caught). Imported by run_all.py (sections `checks` and `long`); runs alone too:

    compute-sanitizer --tool memcheck python3 benchmarks/gpu/long_prompts.py --sanitize
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata

V2_CONTEXT = 163_840  # DeepSeek-V2-Lite's own max_position_embeddings
V2_LENGTHS = (2048, 8192, 16384, 32768, 65536, 131072)
DECODE_TOKENS = 64


def _sync() -> None:
    torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- kernels past 2^31 elements -------------------------------------------------------------


def _chunk_metadata(
    ctx: int, chunk: int, block_size: int, blocks: torch.Tensor
) -> AttentionMetadata:
    """One sequence's prefill chunk: `chunk` new tokens after `ctx` cached ones, on `blocks`."""
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device="cuda")  # noqa: E731
    total = ctx + chunk
    return AttentionMetadata(
        query_start_loc=t([0, chunk]),
        seq_lens=t([total]),
        context_lens=t([ctx]),
        slot_mapping=torch.arange(ctx, total, device="cuda"),
        block_tables=blocks[None, : -(-total // block_size)].to(torch.int32).cuda(),
        block_size=block_size,
        query_lens_cpu=[chunk],
        seq_lens_cpu=[total],
        context_lens_cpu=[ctx],
    )


def _rows_reference(q, keys: torch.Tensor, picks, scale: float, dv: int) -> torch.Tensor:
    """Plain softmax attention of query row i at position p for each (i, p) of `picks`, in float32
    (MLA: K is the 576-wide latent row of `keys` in sequence order, V its leading `dv` columns)."""
    out = []
    for i, p in picks:
        s = (q[i].float() @ keys[: p + 1].T) * scale  # [H, p + 1]
        out.append(torch.softmax(s, -1) @ keys[: p + 1, :dv])
    return torch.stack(out)


def check_long_attention(
    rows: list, ctx: int = 24576, chunk: int = 8192, huge: bool = True
) -> None:
    """The prefill chunk that faulted (8,192 queries after 24,576 cached tokens, MLA: 16 heads over
    the 576-wide latent) through the default and the invariant sets, on blocks at the far end of
    a cache past 2^31 elements, against torch on sampled rows; and the decode kernels there."""
    from deepserve.kernels.triton import attention
    from deepserve.kernels.triton.decode_attention import (
        InvariantPagedAttention,
        decode_attention,
    )
    from deepserve.kernels.triton.kernelset import FastPagedAttention

    gen = torch.Generator(device="cuda").manual_seed(5)
    bs, heads = 16, 16
    need = -(-(ctx + chunk) // bs)
    nb = (2**31 // (bs * 576) + 4096) if huge else need + 64  # past 2^31 elements: 4.4 GB
    cache = torch.empty(nb, bs, 1, 576, device="cuda", dtype=torch.bfloat16)
    blocks = torch.randperm(need, device="cpu") + (nb - need)  # the far end of the pool
    cache[blocks.cuda()] = torch.randn(need, bs, 1, 576, device="cuda", generator=gen).bfloat16()
    attn = _chunk_metadata(ctx, chunk, bs, blocks)
    q = torch.randn(chunk, heads, 576, device="cuda", generator=gen).bfloat16()
    scale = 576**-0.5
    picks = [(i, ctx + i) for i in (0, 1, 777, chunk // 2, chunk - 2, chunk - 1)]
    keys = cache[blocks.cuda()].flatten(0, 1)[:, 0].float()  # the sequence's rows, in order
    want = _rows_reference(q, keys, picks, scale, 512)
    del keys
    v = cache[..., :512]
    for name, kernel in (
        ("default", FastPagedAttention().varlen),
        ("invariant", attention.TritonPagedAttention()),
    ):
        got = kernel(q, cache, v, attn, scale)
        _sync()
        err = _rel(got[[i for i, _ in picks]].float(), want)
        rows.append(dict(op=f"long_prefill_attention_{name}", ctx=ctx, chunk=chunk,
                         cache_elements=cache.numel(), rel_err=err, ok=err < 2e-2))  # fmt: skip
        print(rows[-1], flush=True)
    last = _chunk_metadata(ctx + chunk - 1, 1, bs, blocks)
    qd = q[-1:].contiguous()
    for name, kernel in (("default", decode_attention), ("invariant", InvariantPagedAttention())):
        got = kernel(qd, cache, v, last, scale)
        _sync()
        err = _rel(got.float(), want[-1:])
        rows.append(dict(op=f"long_decode_attention_{name}", ctx=ctx + chunk,
                         cache_elements=cache.numel(), rel_err=err, ok=err < 2e-2))  # fmt: skip
        print(rows[-1], flush=True)
    del cache
    torch.cuda.empty_cache()


def check_long_rows(rows: list) -> None:
    """The row kernels (RMSNorm, add + RMSNorm, silu * up) on a tensor past 2^31 elements, against
    torch on its last rows."""
    from deepserve.kernels import reference
    from deepserve.kernels.triton import rows as row_kernels

    n, h = 2**31 // 4096 + 1024, 4096
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    x[-64:] = torch.randn(64, h, device="cuda", generator=gen).bfloat16()
    w = torch.rand(h, device="cuda", generator=gen).bfloat16() + 0.5
    got = row_kernels.rms_norm(x, w, 1e-6)[-64:]
    want = reference.rms_norm(x[-64:], w, 1e-6)
    rows.append(dict(op="long_rms_norm", elements=x.numel(), rel_err=_rel(got, want),
                     ok=_rel(got, want) < 1e-2))  # fmt: skip
    print(rows[-1], flush=True)
    up = row_kernels.silu_mul(x.view(n, 2, h // 2).flatten(1))[-64:]
    half = x[-64:].view(64, 2, h // 2)
    want = torch.nn.functional.silu(half[:, 0].float()) * half[:, 1].float()
    rows.append(dict(op="long_silu_mul", elements=x.numel(), rel_err=_rel(up, want),
                     ok=_rel(up, want) < 1e-2))  # fmt: skip
    print(rows[-1], flush=True)
    del x
    torch.cuda.empty_cache()


def run_checks(out: dict) -> None:
    """The checks above, and the invariant decode kernel against the fixed-split one, bitwise
    (kernel_checks.py): prefill rows now fold their splits in registers, decode rows from
    partials, and both must give a row the same bits."""
    from kernel_checks import check_invariant_decode_attention

    rows = out.setdefault("long_checks", [])
    for fn in (check_long_attention, check_long_rows, check_invariant_decode_attention):
        try:
            fn(rows)
        except Exception:
            import traceback

            rows.append(dict(op=fn.__name__, error=traceback.format_exc()[-1500:]))
            print(rows[-1], flush=True)


# ---- long prompts through the offline engine ------------------------------------------------


def _greedy(n: int):
    from deepserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _timed(llm, prompt: list[int], n: int) -> float:
    _sync()
    t0 = time.perf_counter()
    llm.generate([prompt], _greedy(n))
    _sync()
    return time.perf_counter() - t0


def prompt_row(llm, length: int, vocab: int, rng: random.Random) -> dict:
    """A fresh prompt's TTFT, then its batch-1 decode over that context: the same prompt again
    (its prefix now cached) for 1 and for 1 + DECODE_TOKENS tokens, the difference of the best
    of two of each timed (one pair read 0 s of decode at 32K, run-gpu17-3)."""
    prompt = [rng.randrange(3, vocab) for _ in range(length)]
    ttft = _timed(llm, prompt, 1)
    warm_one = min(_timed(llm, prompt, 1) for _ in range(2))
    warm_many = min(_timed(llm, prompt, 1 + DECODE_TOKENS) for _ in range(2))
    return dict(prompt_tokens=length, ttft_s=round(ttft, 3),
                decode_tok_s=round(DECODE_TOKENS / max(warm_many - warm_one, 1e-9), 1))  # fmt: skip


def section_long(
    out: dict,
    deadline: float,
    lengths=V2_LENGTHS,
    flags=(False, True),
    shapes=("v2-lite", "smollm2"),
) -> None:
    """Each shape's prompts, one fresh prompt at a time, with each `--batch-invariant` flag of
    `flags` (V2-Lite; SmolLM2's one 8K-token context runs with both)."""
    import speed

    rows = out.setdefault("long_prompts", [])
    todo = {
        "v2-lite": (dict(speed.SHAPES["v2-lite"], max_position_embeddings=V2_CONTEXT), lengths),
        "smollm2": (speed.SHAPES["smollm2"], (8192 - 1 - DECODE_TOKENS,)),
    }
    for name in [s for s in ("smollm2", "v2-lite") if s in shapes]:
        config, prompt_lengths = todo[name]
        hf = speed.build_hf(config)
        for flag in flags if name == "v2-lite" else (False, True):  # SmolLM2's 8K is cheap
            llm = speed.build_llm(config, hf, flag, kv_cache_bytes=24 * 2**30,
                                  max_num_batched_tokens=8192)  # fmt: skip
            rng = random.Random(7)
            _timed(llm, [5] * 2048, 4)  # warm-up: graphs captured, prefill kernels built
            for length in prompt_lengths:
                if time.time() > deadline:
                    out["errors"].append(f"long: {name} {length} flag {flag}: out of time")
                    break
                try:
                    row = prompt_row(llm, length, config["vocab_size"], rng)
                except Exception:
                    import traceback

                    row = dict(prompt_tokens=length, error=traceback.format_exc()[-1200:])
                rows.append(dict(shape=name, batch_invariant=flag, **row))
                print(rows[-1], flush=True)
                if "error" in row:
                    break
            llm.engine.runner.close()
            del llm
            torch.cuda.empty_cache()
        del hf
        torch.cuda.empty_cache()


def _serve_traffic(port: int, vocab: int, long_len: int, over_len: int) -> dict:
    """Ordinary requests (128-token prompts, 32 tokens) keep arriving while one `long_len`-token
    prompt runs; then one prompt over the context. Every status code is kept."""
    import asyncio

    import httpx

    rng = random.Random(11)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def body(n: int, max_tokens: int) -> dict:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        return dict(model="long", prompt=ids, max_tokens=max_tokens, temperature=0)

    async def main() -> dict:
        async with httpx.AsyncClient(timeout=600) as client:
            long_task = asyncio.create_task(client.post(url, json=body(long_len, 16)))
            t0 = time.perf_counter()
            codes: list[int] = []
            while not long_task.done():
                wave = await asyncio.gather(
                    *(client.post(url, json=body(128, 32)) for _ in range(8))
                )
                codes += [r.status_code for r in wave]
            long = await long_task
            long_s = time.perf_counter() - t0
            over = await client.post(url, json=body(over_len, 4))
            after = await client.post(url, json=body(128, 8))
            health = await client.get(f"http://127.0.0.1:{port}/health")
        usage = long.json().get("usage", {}) if long.status_code == 200 else long.text[:300]
        return dict(long_status=long.status_code, long_s=round(long_s, 2), long_usage=usage,
                    ordinary=len(codes), ordinary_ok=codes.count(200),
                    over_status=over.status_code, over_error=over.text[:300],
                    after_status=after.status_code, health=health.status_code)  # fmt: skip

    return asyncio.run(main())


def section_serve_long(out: dict, work, log_dir) -> None:
    """`deepserve serve --device cuda` on a 4-layer V2-Lite-shaped checkpoint with V2-Lite's own
    context: a 131,072-token prompt among ordinary traffic, then one over the context (400)."""
    import subprocess
    from pathlib import Path

    import serve_bench

    from deepserve.engine.testmodels.model_shapes import write_shaped_model

    folder = Path(work) / "v2-lite-4l-long"
    overrides = {"max_position_embeddings": V2_CONTEXT, "num_hidden_layers": 4}
    if not (folder / "config.json").exists():
        write_shaped_model("deepseek-v2-lite-v3arch", folder, "cuda", 0, overrides)
        torch.cuda.empty_cache()
    port = serve_bench._free_port()
    cmd = [sys.executable, "-m", "deepserve.server.cli", "serve", "--model", str(folder),
           "--device", "cuda", "--dtype", "bfloat16", "--port", str(port), "--served-model-name", "long",
           "--kv-cache-bytes", str(24 * 2**30), "--max-num-batched-tokens", "8192"]  # fmt: skip
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    log = Path(log_dir) / "serve_long.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        ready = serve_bench.wait_healthy(proc, port, 400)
        row = _serve_traffic(port, 102400, 131072, V2_CONTEXT + 1)
        row.update(healthy_after_s=round(ready, 1), alive=proc.poll() is None)
    finally:
        serve_bench.stop_server(proc)
    out["serve_long"] = row
    print(row, flush=True)


def sanitize() -> int:
    """Under compute-sanitizer: the long-context kernels at 32,768 tokens (cache sized to fit,
    so every access past it is caught), then a 2-layer V2-Lite-shaped engine on a fresh
    32,768-token prompt, eager."""
    import speed

    rows: list = []
    check_long_attention(rows, ctx=24576, chunk=8192, huge=False)
    config = dict(speed.SHAPES["v2-lite"], max_position_embeddings=V2_CONTEXT, num_hidden_layers=2)
    hf = speed.build_hf(config)
    llm = speed.build_llm(config, hf, False, kv_cache_bytes=4 * 2**30, max_num_batched_tokens=8192,
                          enforce_eager=True)  # fmt: skip
    prompt = [random.Random(1).randrange(3, config["vocab_size"]) for _ in range(32768)]
    t = _timed(llm, prompt, 2)
    print(dict(op="sanitized_engine_prompt", prompt_tokens=32768, seconds=round(t, 1)), flush=True)
    bad = [r for r in rows if not r.get("ok")]
    print("SANITIZE DONE", "bad rows:", bad, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sanitize", action="store_true")
    args = parser.parse_args()
    if args.sanitize:
        sys.exit(sanitize())
    out: dict = {"errors": []}
    run_checks(out)
    section_long(out, time.time() + 420)
    print(out)
