"""DeepSeekMoE routing against transformers' routers fed the same gate weights: V3's sigmoid scores
with the correction bias and top-2-sum group scores, and V2's softmax scores with group-max
(group_limited_greedy) and no renormalization."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.tiny_deepseek import write_tiny_deepseek


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(
        EngineConfig(model=str(write_tiny_deepseek(tmp_path_factory.mktemp("t"))))
    ).model


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def test_sigmoid_group_routing_matches_transformers_v3_router(model):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = model.layers[1].mlp
    a = model.args
    config = DeepseekV3Config(
        hidden_size=a.hidden_size, n_routed_experts=a.n_routed_experts,
        num_experts_per_tok=a.num_experts_per_tok, n_group=a.n_group, topk_group=a.topk_group,
        norm_topk_prob=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    router.weight.data.copy_(moe.gate)
    router.e_score_correction_bias.copy_(moe.bias)
    x = torch.randn(64, a.hidden_size, generator=torch.Generator().manual_seed(0))
    _, ref_w, ref_ids = router(x)
    got_w, got_ids = model._route(moe, x)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w)


def test_softmax_group_limited_routing_matches_transformers_v2_router(model):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    moe = dataclasses.replace(model.layers[1].mlp, bias=None)
    model.args = dataclasses.replace(model.args, scoring_func="softmax", norm_topk_prob=False)
    a = model.args
    config = DeepseekV2Config(
        hidden_size=a.hidden_size, n_routed_experts=a.n_routed_experts,
        num_experts_per_tok=a.num_experts_per_tok, n_group=a.n_group, topk_group=a.topk_group,
        topk_method="group_limited_greedy", routed_scaling_factor=a.routed_scaling_factor,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    router.weight.data.copy_(moe.gate)
    x = torch.randn(64, a.hidden_size, generator=torch.Generator().manual_seed(1))
    _, ref_w, ref_ids = router(x)
    got_w, got_ids = model._route(moe, x)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w)
