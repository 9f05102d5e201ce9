"""`make-test-model --shape`: real model shapes with random weights, written as HF folders that
the engine loads through its ordinary loader (shrunk here by overrides so the CPU test is quick;
the fused expert layout is the one the full shape uses)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.testmodels.model_shapes import v4_layer_schedule, write_shaped_model
from deepserve.server.cli import main

SMALL = {
    "deepseek-v2-lite": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2,
    ),
    "deepseek-v4-flash": dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=4, index_head_dim=16, index_topk=8, n_routed_experts=8,
        num_experts_per_tok=2, num_hidden_layers=4,
    ),
    "deepseek-v2-lite-v3arch": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2,
    ),
    # the real vocabulary: R1's special tokens sit at its top ids
    "r1-distill-qwen-1.5b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SMALL))
def test_shaped_model_loads_and_generates(shape, tmp_path):
    folder = write_shaped_model(shape, tmp_path / shape, overrides=SMALL[shape])
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["architectures"]
    llm = LLM(EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=2**22))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert all(0 <= t < config["vocab_size"] for t in out[0].token_ids)
    llm.close()


def test_v4_flash_schedule_keeps_every_layer_kind_with_few_layers():
    """`--layers N` of the V4-Flash shape (the full geometry is too big to write here)."""
    three, six = v4_layer_schedule(3), v4_layer_schedule(6)
    assert three["layer_types"] == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert three["mlp_layer_types"] == ["hash_moe", "hash_moe", "moe"]
    assert six["layer_types"][:3] == ["sliding_attention"] * 2 + ["compressed_sparse_attention"]
    assert six["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"] * 3
    with pytest.raises(ValueError):
        v4_layer_schedule(2)


def test_cli_rejects_an_unknown_shape(tmp_path):
    with pytest.raises(SystemExit):
        main(["make-test-model", "--out", str(tmp_path), "--shape", "gpt-9"])


def test_shaped_tokenizer_counts_words(tmp_path):
    """A text prompt of n words is n tokens (HTTP benchmarks send words), `t<i>` is id i."""
    folder = write_shaped_model("smollm2-135m", tmp_path / "s", overrides=SMALL["smollm2-135m"])
    llm = LLM(EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=2**22))
    assert llm.encode("t5 t7  river t299") == [5, 7, 0, 299]
    assert llm.decode([5, 7]) == "t5 t7"
    llm.close()


def test_deepseek_v2_lite_shape_is_the_published_v2_config(tmp_path):
    folder = write_shaped_model("deepseek-v2-lite", tmp_path, overrides=SMALL["deepseek-v2-lite"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (config["model_type"], config["scoring_func"], config["topk_method"]) == (
        "deepseek_v2", "softmax", "greedy"
    )  # fmt: skip
    assert config["q_lora_rank"] is None and config["rope_scaling"]["type"] == "yarn"


def test_r1_distill_shape_renders_r1_chat_template_with_single_think_tokens(tmp_path):
    from transformers import AutoTokenizer

    small = SMALL["r1-distill-qwen-1.5b"] | {"num_hidden_layers": 1}
    folder = write_shaped_model("r1-distill-qwen-1.5b", tmp_path, overrides=small)
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"]) == (["Qwen2ForCausalLM"], 151936)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "t5 t6"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<｜begin▁of▁sentence｜><｜User｜>t5 t6<｜Assistant｜><think>\n"
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))  # what the server encodes with
    assert ours.encode(text, add_special_tokens=False).ids == [151646, 151644, 5, 6, 151645, 151648]
    assert ours.token_to_id("</think>") == 151649
