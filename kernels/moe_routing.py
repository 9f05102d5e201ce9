"""MoE routing as one op: router logits -> (weights, expert ids) of each token's top-k experts.

`RouteSpec` holds the model's routing settings; `route` is the torch composition (the oracle and
the CPU path): sigmoid or softmax scores, `e_score_correction_bias` added for the selection only,
group-limited selection (the best `topk_group` of `n_group` groups, a group scored by its top two
biased scores, or its best score without a bias), top-k, then the chosen scores optionally
normalised and scaled. kernels/triton/routing.py does the same in one launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepserve.kernels import reference

Tensor = torch.Tensor


@dataclass(frozen=True)
class RouteSpec:
    scoring: str  # "sigmoid" | "softmax"
    n_group: int
    topk_group: int
    top_k: int
    normalize: bool
    scale: float


def route(
    logits: Tensor,
    bias: Tensor | None,
    spec: RouteSpec,
    sigmoid: Callable[[Tensor], Tensor] = torch.sigmoid,
    softmax: Callable[[Tensor, int], Tensor] = reference.softmax,
) -> tuple[Tensor, Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k] int64), best first."""
    scores = sigmoid(logits) if spec.scoring == "sigmoid" else softmax(logits, -1)
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
