"""Which part of the model each rank owns, and the checkpoint config one rank's model is built from.

Attention is split by query heads. Llama's KV heads follow their query heads: whole GQA groups go to
a rank while there are at least as many KV heads as ranks; past that (or when N does not divide the
groups) a rank keeps one copy of a KV head per run of its query heads that share it, the smallest
run dividing both the group and its head range, so its local heads still form uniform GQA groups
(vLLM replicates KV heads the same way when N > num_kv_heads). DeepSeek's MLA splits its query
heads and keeps the latent projection, norm and cache whole on every rank (the latent is one
"head" shared by all of them, as in vLLM's MLA under TP). Dense MLPs, shared experts and (tensor
parallel alone) every routed expert split their intermediate columns; with expert parallelism the
routed experts are whole, a contiguous range per rank. Uneven sizes are allowed: earlier ranks take
one more. The embedding, norms, router and lm_head are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Protocol

import torch

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.common import require


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    expert_parallel: bool = False


def even_ranges(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


@dataclass(frozen=True)
class LlamaHeads:
    heads: range  # this rank's query heads
    kv_heads: tuple[int, ...]  # the checkpoint KV head each local KV head holds (may repeat)


def llama_heads(num_heads: int, num_kv_heads: int, plan: ShardPlan) -> LlamaHeads:
    if plan.size > num_heads:
        raise UnsupportedModelError(
            f"tensor parallel size {plan.size} is larger than the {num_heads} attention heads"
        )
    group = num_heads // num_kv_heads
    if plan.size <= num_kv_heads:
        groups = even_ranges(num_kv_heads, plan.size)[plan.rank]
        heads = range(groups.start * group, groups.stop * group)
    else:
        heads = even_ranges(num_heads, plan.size)[plan.rank]
    run = gcd(group, heads.start, len(heads))
    kv = tuple((heads.start + j * run) // group for j in range(len(heads) // run))
    return LlamaHeads(heads, kv)


def mla_heads(num_heads: int, plan: ShardPlan) -> range:
    if plan.size > num_heads:
        raise UnsupportedModelError(
            f"tensor parallel size {plan.size} is larger than the {num_heads} attention heads"
        )
    return even_ranges(num_heads, plan.size)[plan.rank]


def routed_experts(num_experts: int, plan: ShardPlan) -> range:
    if plan.size > num_experts:
        raise UnsupportedModelError(
            f"expert parallel size {plan.size} is larger than the {num_experts} routed experts"
        )
    return even_ranges(num_experts, plan.size)[plan.rank]


def llama_head_dim(config: dict) -> int:
    return config.get("head_dim") or require(config, "hidden_size") // require(
        config, "num_attention_heads"
    )


def shard_config(arch: str, config: dict, plan: ShardPlan) -> dict:
    """The checkpoint config as one rank's model sees it: its own head, column and expert counts.
    The model class is the unchanged one; only these sizes (and its weights) differ."""
    c = dict(config)
    mine = even_ranges(require(config, "intermediate_size"), plan.size)[plan.rank]
    c["intermediate_size"] = len(mine)
    if arch == "LlamaForCausalLM":
        heads = c.get("num_key_value_heads") or require(c, "num_attention_heads")
        local = llama_heads(require(c, "num_attention_heads"), heads, plan)
        c["head_dim"] = llama_head_dim(config)
        c["num_attention_heads"] = len(local.heads)
        c["num_key_value_heads"] = len(local.kv_heads)
        return c
    if arch == "DeepseekV3ForCausalLM":
        c["num_attention_heads"] = len(mla_heads(require(c, "num_attention_heads"), plan))
        if plan.expert_parallel and c.get("n_routed_experts"):
            c["n_routed_experts"] = len(routed_experts(c["n_routed_experts"], plan))
        elif c.get("moe_intermediate_size"):
            mine = even_ranges(c["moe_intermediate_size"], plan.size)[plan.rank]
            c["moe_intermediate_size"] = len(mine)
        return c
    raise UnsupportedModelError(f"tensor parallelism does not support {arch}")


class Collective(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ModelShard:
    """What a rank's model needs at run time: the sum over ranks of its partial outputs, and
    (expert parallel) which routed experts it holds."""

    plan: ShardPlan
    comm: Collective
    experts: range | None = None  # expert parallel: this rank's routed experts (global ids)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t)

    def own_experts(
        self, weights: torch.Tensor, ids: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing `(weights, ids)` [T, k] over global experts -> over this rank's local ones.
        Another rank's expert gets id -1 (the model's loop skips it) or, for a fused op that
        takes every (token, slot), local expert 0 with weight 0: the same sum, no host sync."""
        if self.experts is None:
            return weights, ids
        mine = (ids >= self.experts.start) & (ids < self.experts.stop)
        local = ids - self.experts.start
        if fused:
            return weights.masked_fill(~mine, 0.0), local.masked_fill(~mine, 0)
        return weights, local.masked_fill(~mine, -1)
