"""The Triton batch-invariant kernels: row bits independent of the batch, and close to the torch
reference. Runs on CUDA when there is one, else in Triton's interpreter on the CPU; skipped where
the triton package is absent (the CPU CI machines)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")


def _patch_interpreter() -> None:
    """Two fixes to Triton's CPU interpreter, for this test harness only (CUDA never runs them):
    loop bounds are 1-element arrays that NumPy >= 2.4 refuses to int(); and its tl.dot is one
    np.matmul whose BLAS rounds a row differently by its position in the tile, so it is done row
    by row here, the way a GPU's matrix instructions treat every row alike. A float32 dot is a
    chain over K in order for each element, as the GPU's `ieee` FMA dot is (BLAS's vector-matrix
    product would also round an element by the tile's width)."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, *rest):  # Triton >= 3.6 also passes a patch scope
        original(tensor, *rest)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == np.float32:
            acc = d.data.copy()
            for k in range(a.data.shape[1]):
                acc += a.data[:, k, None] * b.data[None, k, :]
            return interpreter.TensorHandle(acc, d.dtype.scalar)
        rows = [np.matmul(a.data[i], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)

    interpreter._patch_lang_tensor = patched
    interpreter.InterpreterBuilder.create_dot = dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()

from paged_kv import PagedCase  # noqa: E402

from deepserve.kernels import reference  # noqa: E402
from deepserve.kernels.registry import triton_kernels  # noqa: E402
from deepserve.kernels.triton import attention  # noqa: E402
from deepserve.kernels.triton.decode_attention import InvariantPagedAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TK = triton_kernels()


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def test_linear_rows_equal_for_any_row_count_and_match_reference():
    w, x = _rand(96, 80, seed=1), _rand(70, 80, seed=2)
    full = TK.linear(x, w)
    for m in [1, 3, 17, 64, 65]:
        assert torch.equal(TK.linear(x[:m], w), full[:m]), m
    assert torch.equal(TK.linear(x[5:6], w)[0], full[5])
    torch.testing.assert_close(full, reference.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_split_and_inline_modes_give_the_same_bits():
    """K chunks added by a second pass (decode) or inside the program (prefill): same bits."""
    from deepserve.kernels.triton import matmul

    cfg = matmul.TileConfig(block_m=16, block_n=16, block_k=16, splits=3)
    w, x = _rand(40, 72, seed=8), _rand(20, 72, seed=9)  # K=72: the last chunk is short
    a, b = x[None], w.t()[None]
    outs = []
    for split_mode in (True, False):
        out = torch.empty(1, 20, 40, device=DEVICE)
        outs.append(matmul._launch(a, b, out, cfg, split_mode)[0])
    assert torch.equal(outs[0], outs[1])
    for m in [1, 3, 17]:
        assert torch.equal(matmul.linear(x[:m], w, cfg), outs[1][:m]), m
    torch.testing.assert_close(outs[0], reference.linear(x, w), rtol=1e-5, atol=1e-5)


def test_matmul_config_depends_on_the_weight_alone():
    from deepserve.kernels.triton import matmul

    narrow = matmul.config_for(2048, 576, torch.bfloat16)
    assert narrow.splits > 1 and narrow.chunk(2048) % narrow.block_k == 0
    assert matmul.config_for(2048, 102400, torch.bfloat16).splits == 1
    wide = matmul.config_for(2048, 576, torch.float32)  # a shallower pipeline, same reduction
    assert (wide.block_k, wide.splits) == (narrow.block_k, narrow.splits)


def test_row_count_changes_a_16_bit_weights_tiles_never_its_k_chunks():
    """Tiles follow M (16 and 32 rows for decode, 64 x 256 for prefill); the K chunks that
    order a row's sums stay the weight's at every M, each a whole number of the tile's K steps."""
    from deepserve.kernels.triton import matmul

    for k, n in ((2048, 3072), (1408, 2048), (2048, 576)):
        own = matmul.config_for(k, n, torch.bfloat16)
        shapes = set()
        for m in (1, 16, 17, 32, 64, 512, 513, 4096):
            cfg = matmul.config_for(k, n, torch.bfloat16, m)
            assert cfg.chunk(k) == own.chunk(k) and cfg.chunk(k) % cfg.block_k == 0, (k, m)
            shapes.add((cfg.block_m, cfg.block_n))
        assert len(shapes) == (3 if n % 256 else 4), (k, n)  # 64 x 256 only where it divides N


def test_float32_weights_take_small_tiles_for_decode_and_keep_their_chunks():
    """The router's float32 gate: 16 x 16 tiles up to 64 rows (FMA chains over K in order, so
    the tile does not enter a row's sum), its own tile past that, the same K chunks at every M."""
    from deepserve.kernels.triton import matmul

    own = matmul.config_for(2048, 64, torch.float32)
    for m in (1, 17, 64):
        cfg = matmul.config_for(2048, 64, torch.float32, m)
        assert (cfg.block_m, cfg.block_n) == (16, 16), m
        assert cfg.chunk(2048) == own.chunk(2048) and cfg.chunk(2048) % cfg.block_k == 0, m
    for m in (65, 2000):
        assert matmul.config_for(2048, 64, torch.float32, m) == own, m


def test_float32_rows_keep_their_bits_across_the_row_count_tiles():
    """A float32 row is the same from a 1-, 17- or 64-row launch (16 x 16 tiles) as from a
    100-row one (the weight's own tile)."""
    from deepserve.kernels.triton import matmul

    w = _rand(64, 512, seed=21)
    x = _rand(100, 512, seed=22)
    full = matmul.linear(x, w)
    for m in (1, 17, 64):
        assert torch.equal(matmul.linear(x[:m], w), full[:m]), m


def test_bf16_rows_keep_their_bits_across_the_row_count_tiles():
    """A bf16 row's output is the same from a 1-, 20- or 30-row launch, though they run 16- and
    32-row tiles (`matmul.ROW_TILES`): only the pinned K chunks order its sums. (BLOCK_K too is
    free on the GPU, where a tile's K steps chain the same 16-deep MMAs; the interpreter adds a
    step's K in numpy's order, so there tile_bits.py checks it.)"""
    from deepserve.kernels.triton import matmul

    w = _rand(256, 384, seed=11).to(torch.bfloat16)
    x = _rand(30, 384, seed=12).to(torch.bfloat16)
    cfg = dataclasses.replace(matmul.config_for(384, 256, torch.bfloat16), splits=3)
    full = matmul.linear(x, w, cfg.for_rows(30, 384, 256))
    for m in (1, 20):
        tile = cfg.for_rows(m, 384, 256)
        assert tile.block_k == 128 and tile.chunk(384) == cfg.chunk(384)
        assert torch.equal(matmul.linear(x[:m], w, tile), full[:m]), m


def test_invariant_moe_tiles_are_the_ones_the_gpu_found_bitwise_equal():
    """bf16 experts take the default tiles with K in 128-steps; MXFP4 experts DECODE, then the
    32-row MXFP4_PREFILL; FP8 (e4m3 dots differ by tile on the GPU) and float32 experts keep
    the decode tile at every size."""
    from deepserve.kernels.block_quant import quantize_fp8, quantize_mxfp4
    from deepserve.kernels.triton import fused_moe

    bf16 = torch.zeros(64, 256, 128, dtype=torch.bfloat16)
    mxfp4 = quantize_mxfp4(torch.randn(64, 256, 128))
    others = (quantize_fp8(torch.randn(64, 256, 128)), torch.zeros(64, 256, 128))
    tiles = set()
    for pairs in (1, 384, 1024, 12000, 100000):
        cfg = fused_moe.invariant_config(pairs, bf16)
        assert (cfg.block_k, cfg.fp8_inputs) == (fused_moe.DECODE.block_k, True), pairs
        tiles.add((cfg.block_m, cfg.block_n))
        big = pairs >= fused_moe.PREFILL_MIN_PAIRS
        want = fused_moe.MXFP4_PREFILL if big else fused_moe.DECODE
        assert fused_moe.invariant_config(pairs, mxfp4) == want
        assert all(fused_moe.invariant_config(pairs, w) == fused_moe.DECODE for w in others)
    assert len(tiles) == 3  # DECODE's, PREFILL's and LARGE's shapes


def test_bmm_rows_equal_for_any_row_count_and_match_reference():
    a, b = _rand(3, 70, 40, seed=3), _rand(3, 40, 24, seed=4)
    full = TK.bmm(a, b)
    for m in [1, 2, 65]:
        assert torch.equal(TK.bmm(a[:, :m], b), full[:, :m]), m
    at = a.transpose(0, 1).contiguous().transpose(0, 1)  # strided, as the MLA absorption passes it
    assert torch.equal(TK.bmm(at, b), full)
    torch.testing.assert_close(full, reference.bmm(a, b), rtol=1e-5, atol=1e-5)


def test_row_kernels_equal_alone_and_match_reference():
    x, w = _rand(5, 300, seed=5) * 3, _rand(300, seed=6)
    for name, args in [("rms_norm", (w, 1e-5)), ("softmax", (-1,)), ("log_softmax", (-1,))]:
        full = getattr(TK, name)(x, *args)
        assert all(
            torch.equal(getattr(TK, name)(x[i : i + 1], *args)[0], full[i]) for i in range(5)
        )
        torch.testing.assert_close(full, getattr(reference, name)(x, *args), rtol=1e-5, atol=1e-5)
    wide = _rand(2, 5000, seed=7)  # several chunks per row
    torch.testing.assert_close(TK.log_softmax(wide, -1), reference.log_softmax(wide, -1))


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_across_prefill_chunks_decode_and_batches(layout):
    split = attention.SPLIT if DEVICE == "cuda" else 2 * attention.BLOCK_N  # interpreter: small
    kernels = dataclasses.replace(TK, paged_attention=attention.TritonPagedAttention(split))
    case = PagedCase(layout, [2 * split + 21, 5, 40], device=DEVICE)
    n = case.lengths[0]
    whole = case.run(kernels, [(0, 0, n)])[0]
    for chunk in [13, attention.BLOCK_M + 3]:
        starts = [0, split - 7, n - chunk]
        for c in starts:
            got = case.run(kernels, [(0, c, chunk)])[0]
            assert torch.equal(got, whole[c : c + chunk]), (chunk, c)
    decodes = [(0, n - 1, 1), (1, 4, 1), (2, 39, 1), (0, split - 1, 1)]
    outs = case.run(kernels, decodes)
    assert torch.equal(outs[0][0], whole[n - 1]) and torch.equal(outs[3][0], whole[split - 1])
    alone = case.run(kernels, [(2, 39, 1)])[0]
    assert torch.equal(outs[2], alone)
    # one at a time: the reference's batched decode reads other sequences' padding as it finds it
    ref = torch.cat([case.run(reference.KERNELS, [d])[0] for d in decodes])
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-5)
    ref_whole = case.run(reference.KERNELS, [(0, 0, n)])[0]
    torch.testing.assert_close(whole, ref_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_tiles_of_tokens_by_heads_give_the_one_head_tiles_bits(layout):
    """A prefill tile of (token, head) rows over one KV head reads each key block once for all
    its heads; every row walks the same splits and key blocks as in a one-head tile."""
    split = attention.SPLIT if DEVICE == "cuda" else 2 * attention.BLOCK_N
    case = PagedCase(layout, [2 * split + 21, 5, 40], device=DEVICE)
    steps = [[(0, 0, 2 * split + 21)], [(0, split - 7, 30), (1, 0, 5), (2, 3, 37)]]
    for rows, warps in ((16, 4), (32, 8)):
        grouped = attention.TritonPagedAttention(split, grouped_rows=rows, grouped_warps=warps)
        for seqs in steps:
            want = case.run(
                dataclasses.replace(TK, paged_attention=attention.TritonPagedAttention(split)), seqs
            )
            got = case.run(dataclasses.replace(TK, paged_attention=grouped), seqs)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (rows, seqs)


def test_decode_value_runs_give_the_whole_rows_bits():
    """A batch-1 decode spreads a wide latent's value columns over programs (`value_runs`):
    each run recomputes the split's scores, so every column's bits are the one-program row's."""
    from paged_kv import Cache

    from deepserve.kernels.triton import decode_attention

    split = attention.SPLIT if DEVICE == "cuda" else 2 * attention.BLOCK_N
    cache = Cache([split + 30, 40], 1, 288, 256, True, 0, DEVICE)
    meta = cache.meta([(0, split + 29, 1), (1, 39, 1)])
    q = torch.randn(2, 16, 288, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert decode_attention.value_runs(2, 256) == decode_attention.MIN_VALUE_RUN < 256
    got = decode_attention.invariant_decode_attention(q, cache.k, cache.v, meta, 0.07, split)
    want = attention.TritonPagedAttention(split)(q, cache.k, cache.v, meta, 0.07)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_head_grouped_decode_equals_the_fixed_split_kernel_row_for_row(layout):
    """Decode steps read a KV row once per head group; the bits are the prefill kernel's."""
    split = attention.SPLIT if DEVICE == "cuda" else 2 * attention.BLOCK_N
    case = PagedCase(layout, [split + 21, 5, 40], device=DEVICE)
    decodes = [(0, split + 20, 1), (1, 4, 1), (2, 39, 1), (0, split - 1, 1)]
    want = case.run(
        dataclasses.replace(TK, paged_attention=attention.TritonPagedAttention(split)), decodes
    )
    grouped = dataclasses.replace(TK, paged_attention=InvariantPagedAttention(split))
    got = case.run(grouped, decodes)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(case.run(grouped, [(2, 39, 1)])[0], got[2])  # alone = in the batch
