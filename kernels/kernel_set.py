"""`KernelSet`: the ops a model and the sampler call, one field per op; the contract every backend
fills in.

Models receive a KernelSet in their constructor (kernels/registry.py's `get_kernels` picks it) and
call `k.linear(x, w)`, `k.rms_norm(x, w, eps)`, ... so `--batch-invariant` swaps every
reduction-order-sensitive op in one place, and the torch reference stays the oracle in tests.
This module imports no backend: backends import it to build their sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor
# A matmul weight as `linear` takes it: a plain `[out, in]` tensor, or what the set's
# `pack_weight` made of one.
Weight = Any


@dataclass
class TorchCalls:
    """The ops a native set handed to torch, by name, in the order of their first call. A native
    op gives the same bits on any thread count; torch's ops are checked at one count only, so
    engine/threads.py keeps the count fixed from the first one on."""

    ops: list[str] = field(default_factory=list)

    def record(self, op: str) -> None:
        if op not in self.ops:
            self.ops.append(op)


@dataclass(frozen=True)
class KernelSet:
    name: str
    linear: Callable[[Tensor, Weight], Tensor]  # x[..., in] @ w[out, in].T
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps)
    softmax: Callable[[Tensor, int], Tensor]  # float32 softmax along dim
    log_softmax: Callable[[Tensor, int], Tensor]
    bmm: Callable[[Tensor, Tensor], Tensor]  # batched matmul used by attention and MLA absorption
    # paged attention over one flattened batch; see kernels/reference/attention.py for the signature
    paged_attention: Callable[..., Tensor]
    # (cache, slot_mapping, values): store a step's new KV at its slots of a paged cache
    write_kv: Callable[[Tensor, Tensor, Tensor], None]
    # MoE routing composed from torch ops and the given (sigmoid, softmax): (logits, bias, RouteSpec,
    # sigmoid, softmax) -> (weights, ids); kernels/reference/moe_routing.py
    moe_route_composed: Callable[..., tuple[Tensor, Tensor]]
    argmax: Callable[
        [Tensor], Tensor
    ]  # `x.argmax(dim=-1)` of 2-D logits (the sampler's greedy pick)
    # MoE routing scores; an op here because torch's CPU elementwise loops send a batch-dependent
    # tail through a scalar path with other rounding (kernels/reference/invariant.py)
    sigmoid: Callable[[Tensor], Tensor] = torch.sigmoid
    # DeepSeek-V4's sqrtsoftplus routing scores; an op for the same reason as `sigmoid`
    softplus: Callable[[Tensor], Tensor] = torch.nn.functional.softplus
    # Fused fast paths. None: models compose the op from the ones above; a fused op also returns
    # None (False for the in-place write) when it does not cover the call.
    add_rms_norm_: Callable[..., Tensor | None] | None = None  # (h, delta, w, eps): h += delta
    # ([gate | up], limit=None) -> silu(gate) * up; `limit`: gate clamped above, up both sides
    silu_mul: Callable[..., Tensor | None] | None = None
    rope_qk_write_kv_: Callable[..., bool] | None = None  # see kernels/cpu/ops.py
    # (w, quantized blocks or None) -> the weight in the layout this set's `linear` reads fastest,
    # packed once at model load (kernels/cpu/packed.py); None: models keep plain weights.
    pack_weight: Callable[..., Weight] | None = None
    # A whole llama decoder layer in one op (kernels/cpu/ops.py's `llama_layer_`), over the four
    # packed matmuls as `pack_llama_layer` groups them (None: the layer runs op by op).
    pack_llama_layer: Callable[[list[Weight]], Any] | None = None
    llama_layer_: Callable[..., Tensor | None] | None = None
    # All routed experts of a MoE layer in one op, (x, gate_up, down, weights, ids) -> [T, H]
    # (kernels/triton/fused_moe.py); None: the model loops over the chosen experts.
    moe: Callable[..., Tensor] | None = None
    # MLA's latent norm + key rope + cache write, and the query rope into the absorbed query
    # (kernels/triton/mla.py); each returns False when it does not cover the call.
    mla_kv_write_: Callable[..., bool] | None = None
    rope_into_: Callable[..., bool] | None = None
    # the whole absorbed query, [latent | rope(q_pe)], in one op (kernels/triton/mla.py)
    absorbed_query_: Callable[..., bool] | None = None
    # MoE routing in one op, (logits, bias, RouteSpec) -> (weights, ids) or None when it does not
    # cover the call (`moe_route_composed` is the composition it replaces); with `ids=` [T, k]
    # (hash routing) the weights of the given experts, scored and normalised the same way.
    moe_route: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    # DeepSeek-V4's ops over slot lists of the flattened cache (kernels/reference/sparse_attention.py
    # states the contracts): (q, window_kv, window_slots, entry_kv, entry_slots, sinks, scale) ->
    # [T, H, D] MQA over one K=V head with per-head sinks; (q, weights, keys, entry_slots,
    # token_seq, visible, k, scale) -> [T, k'] the lightning indexer's chosen entries, ascending;
    # (rows, tokens, previous, has_previous, ape, kv_cols, gate_cols, dim, series) -> [G, dim]
    # the compressors' gated pooling.
    sparse_attention: Callable[..., Tensor] | None = None
    indexer_topk: Callable[..., Tensor] | None = None
    compress_pool: Callable[..., Tensor] | None = None
    # Every op above runs without a host sync or a host value that changes between decode
    # steps, so the model runner may capture decode steps in CUDA graphs.
    graph_safe: bool = False
    # `linear` takes kernels/block_quant.py's `Fp8Weight` as it is (block-scaled FP8 GEMM), so
    # the loader keeps FP8 checkpoints' weights in FP8 on the device; False: it dequantizes them.
    fp8_weights: bool = False
    # (x [..., G * K], w [N, K] in G row groups, G) -> [..., N], group g's rows against x's g-th K
    # columns (DeepSeek-V4's grouped output projection on its FP8 weight, kernels/triton/
    # fp8_matmul.py), or None for a weight it does not take; None: the model's bmm over groups.
    grouped_linear: Callable[[Tensor, Weight, int], Tensor | None] | None = None
    # Causal varlen attention over gathered per-head keys (kernels/triton/flash_prefill.py's
    # `flash_prefill` signature): MLA's prefill chunks in the decompressed form. None: MLA
    # prefills in the absorbed form through `paged_attention`, as decode does. Prefill chunks
    # only, which are never captured in a graph: it may build its tile layout on the host.
    flash_prefill: Callable[..., Tensor] | None = None
    # Which rows take `flash_prefill`: False, the long chunks (where decompressing pays); True,
    # every prompt row and no generated one (`--batch-invariant`: a row's form then follows its
    # position in its sequence, never the chunking; engine/models/mla_prefill.py `plan_by_role`).
    flash_prefill_by_role: bool = False
    # DeepSeek-V4's hyper-connections (kernels/triton/hyper_connections.py states the contracts):
    # (h, fn, eps) -> the mixes, the normed streams times fn; (mixes, scale, base, h, iters,
    # eps) -> (post, comb, the block's input), the Sinkhorn mix included; (h, out, post, comb) ->
    # the expanded streams; (mixes, scale, base, h, eps) -> the hyper head's collapse. None: the
    # model composes them from torch ops.
    hc_mixes: Callable[[Tensor, Tensor, float], Tensor] | None = None
    hc_collapse: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
    hc_expand: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    hc_head: Callable[..., Tensor] | None = None
    # DeepSeek-V4's interleaved rope, kernels/rope.py's `apply_rope_interleaved` (x [N, H, D],
    # cos/sin [N, 1, rot / 2]) in one op, or None when it does not cover the call.
    rope_interleaved: Callable[[Tensor, Tensor, Tensor], Tensor | None] | None = None
    # The set's record of the calls it handed to torch (`--batch-invariant`'s native CPU set);
    # None: not recorded, any call may run on torch.
    torch_calls: TorchCalls | None = None
