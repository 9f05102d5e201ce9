"""MoE routing in one launch (kernels/reference/moe_routing.py's `route`): one program per token
scores its experts, adds the selection bias, keeps the best groups, picks the top k by repeated argmax
(best first, as torch.topk orders them) and writes the normalised, scaled weights and the ids.

In a decode step this replaces seven to nine small launches a MoE layer (cast, sigmoid, add, topk's
sort and gather, gather, sum, divide, scale). A row depends on its own logits only, so the op is
batch-invariant as it stands.
"""

from __future__ import annotations

import torch

from deepserve.kernels.route_spec import RouteSpec
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl


@jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, E, s_l, scale,
    E_P2: constexpr, HAS_BIAS: constexpr, SOFTMAX: constexpr, N_GROUP: constexpr,
    TOPK_GROUP: constexpr, K: constexpr, K_P2: constexpr, NORMALIZE: constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    valid = e < E
    x = tl.load(logits_ptr + row * s_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        grouped = tl.reshape(choice, (N_GROUP, E_P2 // N_GROUP))
        col = tl.arange(0, E_P2 // N_GROUP)[None, :]
        best = tl.max(grouped, axis=1)
        if HAS_BIAS:
            first = tl.argmax(grouped, axis=1)
            second = tl.max(tl.where(col == first[:, None], float("-inf"), grouped), axis=1)
            best = best + second
        g = tl.arange(0, N_GROUP)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            j = tl.argmax(tl.where(keep, float("-inf"), best), axis=0)
            keep = keep | (g == j)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E_P2,))
    slot = tl.arange(0, K_P2)
    weights = tl.zeros((K_P2,), tl.float32)
    ids = tl.zeros((K_P2,), tl.int64)
    for i in tl.static_range(K):
        j = tl.argmax(choice, axis=0)
        w = tl.sum(tl.where(e == j, scores, 0.0), axis=0)
        weights = tl.where(slot == i, w, weights)
        ids = tl.where(slot == i, j.to(tl.int64), ids)
        choice = tl.where(e == j, float("-inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + row * K + slot, weights * scale, mask=slot < K)
    tl.store(ids_ptr + row * K + slot, ids, mask=slot < K)


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), best first; None when the
    kernel does not cover the call (groups over a number of experts that is no power of two)."""
    t, e = logits.shape
    e_p2 = next_power_of_2(e)
    if spec.n_group > 1 and e_p2 != e:  # groups are reshaped in the kernel: no padding allowed
        return None
    weights = torch.empty(t, spec.top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(t, spec.top_k, device=logits.device, dtype=torch.int64)
    if t == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0),
        float(spec.scale), E_P2=e_p2, HAS_BIAS=bias is not None,
        SOFTMAX=spec.scoring == "softmax", N_GROUP=spec.n_group, TOPK_GROUP=spec.topk_group,
        K=spec.top_k, K_P2=next_power_of_2(spec.top_k), NORMALIZE=spec.normalize,
        num_warps=1 if e_p2 <= 256 else 4,
    )  # fmt: skip
    return weights, ids
