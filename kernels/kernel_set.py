"""Picks the implementation of each op for a device and mode; models call ops only through here.

`get_kernels(device, batch_invariant)` returns a `KernelSet`. Models receive it in their constructor
and call `k.linear(x, w)`, `k.rms_norm(x, w, eps)`, ... so `--batch-invariant` swaps every
reduction-order-sensitive op in one place, and the torch reference stays the oracle in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class KernelSet:
    name: str
    linear: Callable[[Tensor, Tensor], Tensor]  # x[..., in] @ w[out, in].T
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps)
    softmax: Callable[[Tensor, int], Tensor]  # float32 softmax along dim
    log_softmax: Callable[[Tensor, int], Tensor]
    bmm: Callable[[Tensor, Tensor], Tensor]  # batched matmul used by attention and MLA absorption
    # paged attention over one flattened batch; see kernels/attention_ref.py for the signature
    paged_attention: Callable[..., Tensor]
    # MoE routing scores; an op here because torch's CPU elementwise loops send a batch-dependent
    # tail through a scalar path with other rounding (kernels/batch_invariant.py)
    sigmoid: Callable[[Tensor], Tensor] = torch.sigmoid
    # Fused fast paths (kernels/cpu_ops.py). None: models compose the op from the ones above; a
    # fused op also returns None (False for the in-place write) when it does not cover the call.
    add_rms_norm_: Callable[..., Tensor | None] | None = None  # (h, delta, w, eps): h += delta
    silu_mul: Callable[[Tensor], Tensor | None] | None = None  # [gate | up] -> silu(gate) * up
    rope_qk_write_kv_: Callable[..., bool] | None = None  # see cpu_ops.rope_qk_write_kv_
    # Models pack their CPU matmul weights once (reference.pack_linear_weight) and may run a
    # whole llama layer natively (cpu_ops.llama_layer_); `linear` then takes packed weights.
    packed_weights: bool = False
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
    # cover the call (kernels/moe_routing.py is the composition it replaces).
    moe_route: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    # Every op above runs without a host sync or a host value that changes between decode
    # steps, so the model runner may capture decode steps in CUDA graphs.
    graph_safe: bool = False


def get_kernels(device: str, batch_invariant: bool) -> KernelSet:
    from deepserve.kernels import reference

    if not batch_invariant:
        if torch.device(device).type == "cuda":
            from deepserve.kernels.triton.kernelset import fast_kernels

            return fast_kernels() or reference.KERNELS
        return reference.KERNELS
    from deepserve.kernels import batch_invariant as bi

    return bi.kernels_for(device)
