"""`RouteSpec`: a MoE model's routing settings, the argument every backend's routing op takes.

A plain type below the backends, so the reference composition (kernels/reference/moe_routing.py)
and the Triton kernel (kernels/triton/routing.py) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouteSpec:
    scoring: str  # "sigmoid" | "softmax" | "sqrtsoftplus"
    n_group: int
    topk_group: int
    top_k: int
    normalize: bool
    scale: float
