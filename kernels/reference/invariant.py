"""Batch-invariant ops in torch: a row's result depends only on that row's data, never on the batch
around it.

`invariant_kernels()` is the `KernelSet` of these ops: `--batch-invariant`'s CPU set where the
native kernels are not built, the fallback of the native invariant set where they are
(kernels/cpu/kernelset.py), and the oracle that set is tested against. The reference ops
(ops.py, attention.py) stay the oracle of these; what this module adds is a fixed reduction
order. kernels/registry.py picks the flag's set for a device (Triton's on CUDA).

Where the batch leaks into the bits on the CPU, and what each op does about it (measured, see
docs/batch_invariance.md):
- GEMM: MKL takes a different code path for a few rows (GEMV for 1, edge kernels for 2-3, and more
  shapes with 2 threads), so `x[:m] @ W` differs from `(x @ W)[:m]`. `linear`/`bmm` pad the row count
  to a multiple of a fixed row tile, found by probing the library once per dtype; rows whose count is
  a multiple of the tile were bitwise equal for every m and row position tried. Where no tile keeps
  a dtype's rows (bf16 on AMX hosts: oneDNN's blocking changes past ~40 rows), its GEMMs run in
  calls of at most CHUNK_ROWS rows when the probe finds every such call gives a row the same bits,
  else in float32, rounded once.
- Row reductions: torch splits a single long row across threads (two-pass), but never a row among
  many. `_row_sum` reduces fixed-size chunks and folds them in order with a sequential scan.
- Elementwise ops: torch's CPU loops run whole vectors and send the tail (numel mod the vector
  chunk, per thread's share) through a scalar path whose transcendental functions round
  differently; `elementwise` pads so no element is in a tail (used for the MoE router's sigmoid).
- Attention: keys are taken in fixed splits of `KV_SPLIT`; the row max is exact in any order; each
  split's P@V and sum of P is a GEMM of one fixed shape; splits are folded in order by a scan, so
  extra all-masked splits (a longer neighbour, a prefill chunk) add exact zeros. A query row gets the
  same bits in prefill, any chunking, decode, or after a prefix-cache hit.
- DeepSeek-V4's sparse attention: a query's slot lists may hold -1 anywhere (the window's start,
  entries not chosen, upper-bound widths), so each query's keys are first packed to the front of
  its own row (in list order: window by position, then entries by index), then attended in
  KV_SPLIT splits folded in order as above, the sink joining the sum last. The lightning indexer
  scores a token's entries in tiles of KV_SPLIT, one fixed-shape GEMM per tile, sums heads one by
  one, and breaks ties by the stable sort of the reference. The compressors' pooling reduces each
  group over its own few tokens: the reference op, whatever the number of groups.
What does not live here: the reference ops, the native and GPU kernels, and anything with engine
state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deepserve.kernels import kv_quant
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.reference import attention, moe_routing, ops, sparse_attention

Tensor = torch.Tensor

ROW_TILES = (4, 8, 16, 32, 64)  # candidate row tiles, smallest first; 64 is the fallback
KV_SPLIT = 128  # keys per attention split: a fixed reduction unit, whatever the context length
SUM_CHUNK = 1024  # elements per chunk in long row sums
ELEMENT_CHUNK = 64  # floats per vectorized elementwise step, with room for AVX-512 (16 x 2 x 2)
QUERY_BLOCK = 512  # query rows per attention pass (bounds memory; rows are independent)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """Pad dim -2 of `x` with zeros up to `rows` (zeros: never NaN, so padded rows stay harmless)."""
    extra = rows - x.shape[-2]
    if extra == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(*x.shape[:-2], extra, x.shape[-1])], dim=-2)


PROBE_ROWS = 140  # rows in the probe's batch: past the row counts where oneDNN changes kernels
CHUNK_ROWS = 32  # the most rows of a call whose kernel gives a row the bits of a one-row call


@dataclass(frozen=True)
class MatmulPlan:
    """How one input dtype's GEMMs run: rows in calls of at most `chunk` rows (None: one call),
    each padded to a multiple of `tile`, multiplied in `compute`."""

    tile: int
    compute: torch.dtype
    chunk: int | None = None

    def run(self, a: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """`fn` over a's rows (dim -2) as planned; the rows' results without the padding."""
        rows = a.shape[-2]
        step = self.chunk or max(rows, 1)
        outs = []
        for start in range(0, max(rows, 1), step):
            part = a[..., start : start + step, :]
            m = part.shape[-2]
            outs.append(
                fn(_pad_rows(part, _round_up(max(m, 1), self.tile)).to(self.compute))[..., :m, :]
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _probe_invariant(plan: MatmulPlan, dtype: torch.dtype) -> bool:
    """True when, with the threads torch uses now, each row of a `dtype` GEMM run as `plan` gets
    the bits it gets alone, for small and large row counts and several positions."""
    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(768, 576, generator=gen).to(dtype).to(plan.compute)
    x = torch.randn(PROBE_ROWS, 576, generator=gen).to(dtype)

    def gemm(a: Tensor) -> Tensor:
        return plan.run(a, lambda p: F.linear(p, w)).to(dtype)

    alone = torch.cat([gemm(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, plan.tile + 1, 2 * plan.tile, 4 * plan.tile + 3, 33, 67, PROBE_ROWS - 3):
        for off in (0, 1, 3):
            m = min(rows, len(x) - off)
            if not torch.equal(gemm(x[off : off + m]), alone[off : off + m]):
                return False
    return True


def _probe_plan(dtype: torch.dtype) -> MatmulPlan:
    # A bf16 GEMM on AMX takes kernels whose float32 accumulation order changes with the row
    # count past ~40 rows, whatever the padding (no tile kept 140-row batches bitwise), while
    # every call of 1 to 32 rows gives a row the same bits: there the GEMMs run in calls of at
    # most CHUNK_ROWS rows. Else float32: bf16 products are exact in it, so the same GEMM in
    # float32 rounded once is the same function with float32 GEMM's row invariance.
    candidates = [MatmulPlan(t, dtype) for t in ROW_TILES[:-1]]
    if dtype != torch.float32:
        candidates += [MatmulPlan(1, dtype, CHUNK_ROWS)]
        candidates += [MatmulPlan(t, torch.float32) for t in ROW_TILES[:-1]]
    for plan in candidates:
        if _probe_invariant(plan, dtype):
            return plan
    return MatmulPlan(ROW_TILES[-1], torch.float32)


@dataclass
class RowTiledMatmul:
    """GEMMs whose row count is always a multiple of one probed tile, per dtype, in the dtype
    whose library kernels keep rows invariant.

    The probe runs once per dtype on first use (a few hundred small GEMMs); its result is kept
    here, in this object, not in module state."""

    plans: dict[torch.dtype, MatmulPlan] = field(default_factory=dict)

    def plan(self, dtype: torch.dtype) -> MatmulPlan:
        if dtype not in self.plans:
            self.plans[dtype] = _probe_plan(dtype)
        return self.plans[dtype]

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x[..., in] @ w[out, in].T with rows padded to the tile."""
        lead, k = x.shape[:-1], x.shape[-1]
        plan = self.plan(x.dtype)
        wc = w.to(plan.compute)
        y = plan.run(x.reshape(-1, k), lambda p: F.linear(p, wc)).to(x.dtype)
        return y.reshape(*lead, w.shape[0])

    def bmm(self, a: Tensor, b: Tensor) -> Tensor:
        """torch.matmul(a, b) for a [..., M, K], b [..., K, N], with M run as the plan says."""
        plan = self.plan(a.dtype)
        bc = b.contiguous().to(plan.compute)
        return plan.run(a, lambda p: torch.matmul(p, bc)).to(a.dtype)


def _row_sum(x: Tensor) -> Tensor:
    """Sum over the last dim in an order fixed by the row length alone (keepdim)."""
    d = x.shape[-1]
    if d <= SUM_CHUNK:
        return x.sum(-1, keepdim=True)
    pad = _round_up(d, SUM_CHUNK) - d
    chunks = F.pad(x, (0, pad)).unflatten(-1, (-1, SUM_CHUNK)).sum(-1)
    return chunks.cumsum(-1)[..., -1:]


def elementwise(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`fn` applied so every element takes torch's vectorized path: the flat length is padded to a
    multiple of a vector chunk times every thread split, so no element lands in a scalar tail."""

    def apply(x: Tensor) -> Tensor:
        flat = x.reshape(-1)
        unit = ELEMENT_CHUNK * math.lcm(*range(1, torch.get_num_threads() + 1))
        pad = -flat.numel() % unit
        return fn(F.pad(flat, (0, pad)))[: flat.numel()].view_as(x)

    return apply


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32, cast back before the weight (as the reference and HF do)."""
    xf = x.float()
    mean_sq = _row_sum(xf * xf) / xf.shape[-1]
    return weight * (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype)


def softmax(x: Tensor, dim: int) -> Tensor:
    # torch's CPU softmax reduces each row on one thread in a fixed order (checked up to 129K cols)
    return torch.softmax(x.float(), dim=dim)


def log_softmax(x: Tensor, dim: int) -> Tensor:
    return torch.log_softmax(x.float(), dim=dim)


@dataclass
class _Queries:
    """Query rows of one or more sequences, laid out per KV head: [B, Hkv, R, Dk]."""

    q: Tensor
    positions: Tensor  # [B, R] absolute position of each row (pad rows: the last valid one)


def _rows(cache: Tensor, blocks: Tensor) -> Tensor:
    """`cache[blocks]`, a quantized (e4m3) cache's through bytes (widened to float32 after)."""
    if not kv_quant.is_quantized(cache.dtype):
        return cache[blocks]
    return kv_quant.byte_view(cache)[blocks].view(cache.dtype)


class SplitKVAttention:
    """Paged attention with a fixed reduction order over keys (see the module docstring)."""

    def __init__(self, mm: RowTiledMatmul) -> None:
        self.mm = mm

    def __call__(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata, scale: float
    ) -> Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        decode = [i for i, n in enumerate(attn.query_lens_cpu) if n == 1]
        if decode:
            self._decode(q, k_cache, v_cache, attn, scale, decode, out)
        starts = [0, *itertools.accumulate(attn.query_lens_cpu)]
        for i, n in enumerate(attn.query_lens_cpu):
            if n > 1:
                self._prefill(q, k_cache, v_cache, attn, scale, i, starts[i], out)
        return out

    def _decode(self, q, k_cache, v_cache, attn, scale, seqs: list[int], out: Tensor) -> None:
        """Every sequence that brings one query row, in one batched pass."""
        idx = torch.tensor(seqs, device=q.device)
        starts = attn.query_start_loc[idx].long()
        lens = [attn.seq_lens_cpu[i] for i in seqs]
        hkv = k_cache.shape[2]
        group = q.shape[1] // hkv
        qs = q[starts].view(len(seqs), hkv, group, -1)  # rows = the group's heads
        pos = attn.seq_lens[idx].long()[:, None].expand(-1, group) - 1
        k, v = self._gather(k_cache, v_cache, attn.block_tables[idx], max(lens), attn.block_size)
        # a shorter sequence's tail reads padded block-table entries: zero that V (0 * NaN is NaN)
        inside = torch.arange(k.shape[2], device=q.device)[None, :] < attn.seq_lens[idx, None]
        v = v.masked_fill(~inside[:, None, :, None], 0.0)
        o = self._attend(_Queries(qs, pos), k, v, scale)  # [B, Hkv, G, Dv]
        out[starts] = o.reshape(len(seqs), q.shape[1], -1).to(out.dtype)

    def _prefill(self, q, k_cache, v_cache, attn, scale, i: int, start: int, out: Tensor) -> None:
        """One sequence's chunk of n > 1 query rows, in blocks of QUERY_BLOCK rows."""
        n, length, ctx = attn.query_lens_cpu[i], attn.seq_lens_cpu[i], attn.context_lens_cpu[i]
        hkv = k_cache.shape[2]
        group = q.shape[1] // hkv
        k, v = self._gather(k_cache, v_cache, attn.block_tables[i : i + 1], length, attn.block_size)
        for b in range(0, n, QUERY_BLOCK):
            rows = min(QUERY_BLOCK, n - b)
            # rows ordered (group, query) per kv head so GQA needs no KV copy
            qi = q[start + b : start + b + rows].view(rows, hkv, group, -1).permute(1, 2, 0, 3)
            qi = qi.reshape(1, hkv, group * rows, -1)
            pos = (torch.arange(rows, device=q.device) + ctx + b).repeat(group)[None]
            o = self._attend(_Queries(qi, pos), k, v, scale)  # [1, Hkv, G*rows, Dv]
            o = o.view(hkv, group, rows, -1).permute(2, 0, 1, 3).reshape(rows, q.shape[1], -1)
            out[start + b : start + b + rows] = o.to(out.dtype)

    @staticmethod
    def _gather(k_cache, v_cache, tables: Tensor, length: int, block_size: int):
        """KV of `tables` [B, nb] -> k [B, Hkv, Lp, Dk], v [B, Hkv, Lp, Dv] in float32, Lp a multiple
        of KV_SPLIT; keys at or past each sequence's length are masked later, their V zeroed here."""
        padded = _round_up(length, KV_SPLIT)
        blocks = tables[:, : -(-length // block_size)].long()
        k = _rows(k_cache, blocks).flatten(1, 2)[:, :length]  # [B, L, Hkv, Dk]
        shared = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
        v = (
            k[..., : v_cache.shape[-1]]
            if shared
            else _rows(v_cache, blocks).flatten(1, 2)[:, :length]
        )
        k = F.pad(k.float(), (0, 0, 0, 0, 0, padded - length)).transpose(1, 2)
        v = F.pad(v.float(), (0, 0, 0, 0, 0, padded - length)).transpose(1, 2)
        return k, v

    def _attend(self, qs: _Queries, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Softmax(q k^T * scale) v with keys past each row's position masked -> [B, Hkv, R, Dv].

        k/v may be longer than a row needs (a longer neighbour, later rows of a chunk): masked keys
        give p = 0 exactly and zero V, so the splits they fall in add exact zeros to the scan."""
        lp = k.shape[2]
        scores = self.mm.bmm(qs.q.float(), k.transpose(-1, -2)) * scale  # [B, Hkv, R, Lp]
        keys = torch.arange(lp, device=k.device)
        valid = keys[None, None, :] <= qs.positions[:, :, None]  # [B, R, Lp]
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        p = torch.exp(scores - scores.amax(-1, keepdim=True))  # the max is exact in any order
        splits = lp // KV_SPLIT
        denom = p.unflatten(-1, (splits, KV_SPLIT)).sum(-1)  # [B, Hkv, R, S]: C values, fixed order
        p = p.unflatten(-1, (splits, KV_SPLIT)).transpose(2, 3)  # [B, Hkv, S, R, C]
        vs = v.unflatten(2, (splits, KV_SPLIT))  # [B, Hkv, S, C, Dv]
        partial = self.mm.bmm(p, vs)  # one fixed GEMM shape per split
        acc = partial.cumsum(2)[:, :, -1]  # splits folded in order by a sequential scan
        return acc / denom.cumsum(-1)[..., -1:]


class SplitSparseAttention:
    """`sparse_attention.sparse_attention` with a fixed reduction order (see the module docstring)."""

    def __init__(self, mm: RowTiledMatmul) -> None:
        self.mm = mm
        self.exp = elementwise(torch.exp)

    def __call__(
        self,
        q: Tensor,
        window_kv: Tensor,
        window_slots: Tensor,
        entry_kv: Tensor | None,
        entry_slots: Tensor | None,
        sinks: Tensor,
        scale: float,
    ) -> Tensor:
        out = torch.empty_like(q)
        width = sparse_attention.key_width(window_slots, entry_slots)
        for rows in sparse_attention.row_blocks(q.shape[0], width * q.shape[-1]):
            entries = None if entry_slots is None else entry_slots[rows]
            keys, valid = sparse_attention.gather_keys(
                window_kv, window_slots[rows], entry_kv, entries
            )
            out[rows] = self._block(q[rows].float(), keys, valid, sinks.float(), scale)
        return out

    def _block(self, q: Tensor, keys: Tensor, valid: Tensor, sinks: Tensor, scale: float) -> Tensor:
        counts = valid.sum(-1)
        # every listed key's place, not the most any row sees: no host sync (a capturable step);
        # the splits past a row's keys add exact zeros
        width = _round_up(max(keys.shape[1], 1), KV_SPLIT)
        # a stable sort of "not valid" puts each row's keys first, in list order
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
        order = F.pad(order, (0, max(0, width - order.shape[1])))[:, :width]
        inside = torch.arange(width, device=q.device)[None, :] < counts[:, None]  # [T, W]
        keys = keys.gather(1, order[..., None].expand(-1, -1, keys.shape[-1]))
        keys = keys.masked_fill(~inside[..., None], 0.0)  # [T, W, D]
        scores = self.mm.bmm(q, keys.transpose(1, 2)) * scale  # [T, H, W]
        scores = scores.masked_fill(~inside[:, None], float("-inf"))
        top = torch.maximum(scores.amax(-1), sinks[None])  # exact in any order
        p = self.exp(scores - top[..., None])
        splits = width // KV_SPLIT
        denom = p.unflatten(-1, (splits, KV_SPLIT)).sum(-1).cumsum(-1)[..., -1]
        denom = denom + self.exp(sinks[None] - top)
        p = p.unflatten(-1, (splits, KV_SPLIT)).transpose(1, 2)  # [T, S, H, C]
        partial = self.mm.bmm(p, keys.unflatten(1, (splits, KV_SPLIT)))  # [T, S, H, D]
        return partial.cumsum(1)[:, -1] / denom[..., None]


@dataclass
class TiledIndexer:
    """`sparse_attention.indexer_topk` with scores whose bits do not depend on the step: each
    token's entries, padded to whole tiles of KV_SPLIT, are scored by GEMMs of one fixed shape."""

    mm: RowTiledMatmul

    def __call__(
        self,
        q: Tensor,
        weights: Tensor,
        keys: Tensor,
        entry_slots: Tensor,
        token_seq: Tensor,
        visible: Tensor,
        k: int,
        scale: float,
    ) -> Tensor:
        entries = entry_slots.shape[1]
        k = min(k, entries)
        out = torch.empty(q.shape[0], k, dtype=torch.long, device=q.device)
        if k == 0:
            return out
        slots = F.pad(entry_slots, (0, _round_up(entries, KV_SPLIT) - entries), value=-1)
        per_row = slots.shape[1] * max(keys.shape[1], q.shape[1])
        for rows in sparse_attention.row_blocks(q.shape[0], per_row):
            scores = self._scores(q[rows], weights[rows], keys, slots[token_seq[rows]], scale)
            out[rows] = sparse_attention.choose(scores[:, :entries], visible[rows], k)
        return out

    def _scores(self, q: Tensor, weights: Tensor, keys: Tensor, slots: Tensor, scale: float):
        key_rows, _ = sparse_attention.gather_rows(keys, slots)  # [t, Gp, Di]
        tiles = key_rows.unflatten(1, (-1, KV_SPLIT)).transpose(2, 3)  # [t, S, Di, C]
        queries = q.float()[:, None].expand(-1, tiles.shape[1], -1, -1)  # [t, S, Hi, Di]
        dots = torch.relu(self.mm.bmm(queries, tiles)) * scale  # [t, S, Hi, C]
        dots = dots.transpose(1, 2).flatten(2)  # [t, Hi, Gp]
        w = weights.float()
        scores = dots[:, 0] * w[:, 0, None]
        for h in range(1, dots.shape[1]):  # heads summed in one fixed order
            scores = scores + dots[:, h] * w[:, h, None]
        return scores


def invariant_kernels() -> KernelSet:
    mm = RowTiledMatmul()
    return KernelSet(
        name="batch_invariant_cpu",
        linear=mm.linear,
        rms_norm=rms_norm,
        softmax=softmax,
        log_softmax=log_softmax,
        bmm=mm.bmm,
        paged_attention=SplitKVAttention(mm),
        write_kv=attention.write_kv,
        moe_route_composed=moe_routing.route,
        argmax=ops.argmax,
        sigmoid=elementwise(torch.sigmoid),
        softplus=elementwise(F.softplus),
        sparse_attention=SplitSparseAttention(mm),
        indexer_topk=TiledIndexer(mm),
        compress_pool=sparse_attention.compress_pool,  # per group, in a fixed order already
    )
