"""MoE routing in one launch (kernels/reference/moe_routing.py's `route`): one program per token
scores its experts (sigmoid, softmax or DeepSeek-V4's sqrtsoftplus), adds the selection bias,
keeps the best groups, picks the top k by repeated argmax (best first, as torch.topk orders
them) and writes the normalised, scaled weights and the ids. Hash routing (V4's first layers)
passes its experts in and gets their weights.

In a decode step this replaces seven to nine small launches a MoE layer (cast, sigmoid, add, topk's
sort and gather, gather, sum, divide, scale). A row depends on its own logits only, so the op is
batch-invariant as it stands.
"""

from __future__ import annotations

import torch

from deepserve.kernels.route_spec import RouteSpec
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl

# the kernel's SCORING constexpr (literals in the kernel: Triton compiles no module globals)
SCORING_CODES = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}


@jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)), log1p as
    log(u) * e / (u - 1) with u = 1 + e (exact where 1 + e rounds to 1, as log(1 + e) is not)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    exact = u == 1.0
    log1p = tl.where(exact, e, tl.log(u) * e / tl.where(exact, 1.0, u - 1.0))
    return tl.where(x > 20.0, x, log1p)


@jit
def _route_kernel(
    logits_ptr, bias_ptr, fixed_ptr, w_ptr, ids_ptr, E, s_l, scale,
    E_P2: constexpr, HAS_BIAS: constexpr, SCORING: constexpr, N_GROUP: constexpr,
    TOPK_GROUP: constexpr, K: constexpr, K_P2: constexpr, NORMALIZE: constexpr, FIXED: constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    valid = e < E
    x = tl.load(logits_ptr + row * s_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORING == 1:  # softmax
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    elif SCORING == 2:  # sqrtsoftplus (DeepSeek-V4)
        scores = tl.sqrt(_softplus(x))
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
        if FIXED:  # noqa: SIM108  (hash routing: the experts are given, only their weights)
            j = tl.load(fixed_ptr + row * K + i)
        else:
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
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    spec: RouteSpec,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), best first; None when the
    kernel does not cover the call (groups over a number of experts that is no power of two,
    an unknown scoring). Given `ids` [T, k] (hash routing: a fixed token -> experts table),
    only the weights of those experts: scored, normalised and scaled as a choice's would be."""
    t, e = logits.shape
    e_p2 = next_power_of_2(e)
    if spec.n_group > 1 and e_p2 != e:  # groups are reshaped in the kernel: no padding allowed
        return None
    if spec.scoring not in SCORING_CODES:
        return None
    weights = torch.empty(t, spec.top_k, device=logits.device, dtype=torch.float32)
    fixed = None if ids is None else ids.to(torch.int64).contiguous()
    out_ids = torch.empty(t, spec.top_k, device=logits.device, dtype=torch.int64)
    if t == 0:
        return weights, out_ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, fixed if fixed is not None else out_ids,
        weights, out_ids, e, logits.stride(0), float(spec.scale), E_P2=e_p2,
        HAS_BIAS=bias is not None, SCORING=SCORING_CODES[spec.scoring], N_GROUP=spec.n_group,
        TOPK_GROUP=spec.topk_group, K=spec.top_k, K_P2=next_power_of_2(spec.top_k),
        NORMALIZE=spec.normalize, FIXED=fixed is not None, num_warps=1 if e_p2 <= 256 else 4,
    )  # fmt: skip
    return weights, out_ids
