"""MoE routing as one op: router logits -> (weights, expert ids) of each token's top-k experts.

`route` is the torch composition (the oracle, and every KernelSet's routing where it has no fused
op or its op does not cover the call): sigmoid, softmax or sqrtsoftplus (DeepSeek-V4) scores, `e_score_correction_bias` added
for the selection only, group-limited selection (the best `topk_group` of `n_group` groups, a
group scored by its top two biased scores, or its best score without a bias), top-k, then the
chosen scores optionally normalised and scaled. kernels/triton/routing.py does the same in one
launch; the settings (`RouteSpec`) live in kernels/route_spec.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepserve.kernels.reference.ops import softmax as reference_softmax
from deepserve.kernels.route_spec import RouteSpec

Tensor = torch.Tensor


def _scores(logits: Tensor, scoring: str, sigmoid, softmax, softplus) -> Tensor:
    if scoring == "sigmoid":
        return sigmoid(logits)
    if scoring == "sqrtsoftplus":  # DeepSeek-V4
        return softplus(logits).sqrt()
    return softmax(logits, -1)


def route(
    logits: Tensor,
    bias: Tensor | None,
    spec: RouteSpec,
    sigmoid: Callable[[Tensor], Tensor] = torch.sigmoid,
    softmax: Callable[[Tensor, int], Tensor] = reference_softmax,
    softplus: Callable[[Tensor], Tensor] = torch.nn.functional.softplus,
) -> tuple[Tensor, Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k] int64), best first."""
    scores = _scores(logits, spec.scoring, sigmoid, softmax, softplus)
    choice = scores if bias is None else scores + bias
    if spec.n_group > 1:
        grouped = choice.view(logits.shape[0], spec.n_group, -1)
        # with the bias (aux-loss-free balancing) a group scores by its top two experts
        group_score = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.amax(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(spec.topk_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(spec.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if spec.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.scale, ids
