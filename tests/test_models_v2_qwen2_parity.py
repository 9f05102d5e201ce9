"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: V3's MLA + MoE under softmax routing) and Qwen2
(`Qwen2ForCausalLM`: Llama with q/k/v biases) against transformers' own classes, float32, on tiny
random weights written by make-test-model's `deepseek-v2-lite` and `r1-distill-qwen-1.5b` shapes:
V2 with greedy and group-limited top-k, with and without a q LoRA, YaRN rope; Qwen2 with an
untied head (as R1-Distill ships) and a tied one."""

from __future__ import annotations

import pytest
import torch
from model_loop import greedy_pair, logit_gap_to_transformers

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.model_shapes import write_shaped_model

V2_TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=3, routed_scaling_factor=1.5, max_position_embeddings=2048,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
)  # fmt: skip
QWEN2_TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
CHECKPOINTS = {  # name -> (shape, overrides, architecture)
    "v2-greedy-no-q-lora": (
        "deepseek-v2-lite",
        V2_TINY | dict(topk_method="greedy", q_lora_rank=None),
    ),
    "v2-group-limited-q-lora": (
        "deepseek-v2-lite",
        V2_TINY | dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=24),
    ),
    "qwen2-untied": ("r1-distill-qwen-1.5b", QWEN2_TINY),
    "qwen2-tied": ("r1-distill-qwen-1.5b", QWEN2_TINY | {"tie_word_embeddings": True}),
}
ARCHITECTURES = {
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", "deepseek_v2"),
    "r1-distill-qwen-1.5b": ("Qwen2ForCausalLM", "qwen2"),
}


def _prompt(n: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def pair(request, tmp_path_factory):
    """(ours, transformers', shape) loaded from one folder."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    shape, overrides = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    write_shaped_model(shape, folder, seed=3, overrides=overrides)
    ours = load_model(EngineConfig(model=str(folder), dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, hf, shape


def test_checkpoint_loads_as_its_architecture(pair):
    ours, hf, shape = pair
    assert (ours.info.architecture, ours.info.family) == ARCHITECTURES[shape]
    assert type(hf).__name__ == ours.info.architecture


@pytest.mark.parametrize("length", [1, 7, 40])
def test_logits_match_transformers(pair, length):
    assert logit_gap_to_transformers(pair[0].model, pair[1], _prompt(length)) < 1e-4


def test_greedy_tokens_match_transformers(pair):
    ours, theirs = greedy_pair(pair[0].model, pair[1], _prompt(9), 16)
    assert ours == theirs


def test_v2_group_limited_routing_keeps_the_best_groups(pair):
    """Group-limited top-k picks only from the `topk_group` groups with the best single expert
    (transformers' V2 router is the reference)."""
    ours, hf, _ = pair
    groups = getattr(ours.model.args, "n_group", 1)
    if groups == 1:
        pytest.skip("no expert groups in this checkpoint")
    x = torch.randn(64, ours.model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = ours.model._route(ours.model.layers[1].mlp, x)
    _, hf_weights, hf_ids = hf.model.layers[1].mlp.gate(x)
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.allclose(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))


def test_qwen2_has_qkv_biases_and_r1_chat_template(pair):
    ours, _, shape = pair
    if shape != "r1-distill-qwen-1.5b":
        pytest.skip("a Qwen2 checkpoint's property")
    assert all(layer.qkv_bias is not None for layer in ours.model.layers)
    assert "<｜Assistant｜><think>" in ours.info.chat_template


def test_sliding_window_qwen2_is_refused(tmp_path):
    over = QWEN2_TINY | {"num_hidden_layers": 1, "use_sliding_window": True}
    folder = write_shaped_model("r1-distill-qwen-1.5b", tmp_path, overrides=over)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        load_model(EngineConfig(model=str(folder), dtype="float32"))
