"""Both model families on CUDA (skipped without a GPU): random SmolLM2-shaped llama and tiny-deepseek
weights, our model on cuda against transformers on cuda with the same weights (float32 and
bfloat16), plus a decode-batch consistency check. Prints the measured differences."""

from __future__ import annotations

import json

import pytest
import torch
from model_loop import SequenceLoop, batched_step_logits
from safetensors.torch import save_file

from deepserve.engine.models.common import WeightStore
from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepserve.engine.models.llama import LlamaForCausalLM
from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors
from deepserve.kernels.reference import KERNELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip


def _llama_weights(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d

    def mat(o, n):
        return torch.randn(o, n, generator=g) / n**0.5

    w = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": mat(h, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, h),
            p + "mlp.gate_proj.weight": mat(i, h),
            p + "mlp.up_proj.weight": mat(i, h),
            p + "mlp.down_proj.weight": mat(h, i),
        }
    w["model.norm.weight"] = torch.ones(h)
    return w


def _folder(tmp_path, config, weights):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        config = SMOLLM2_SHAPE
        weights = _llama_weights(config)
        return LlamaForCausalLM, config, weights, _folder(root, config, weights)
    config = dict(TINY_CONFIG, vocab_size=4096)
    weights = _tensors(config, torch.Generator().manual_seed(0))
    return DeepseekV3ForCausalLM, config, weights, _folder(root, config, weights)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, None)])
def test_cuda_logits_match_transformers_on_cuda(family, dtype, tol):
    from transformers import AutoModelForCausalLM

    cls, config, weights, folder = family
    ours = cls(config, WeightStore(weights, torch.device("cuda"), dtype), KERNELS, "test")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    prompt = torch.randint(0, 4000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    for n in (1, 17, 300):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt[:n]], device="cuda")).logits[0, -1].float()
        got = SequenceLoop(ours, n + 1).logits(prompt[:n])
        diff = (got - expected).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
        print(f"{cls.family} cuda {dtype} {n}-token: max abs diff {diff:.2e}, cosine {cos:.6f}")
        assert diff < tol if tol else cos > 0.99
    greedy_ids = prompt[:8]
    expected = hf.generate(
        torch.tensor([greedy_ids], device="cuda"), max_new_tokens=32, do_sample=False
    )
    got = SequenceLoop(ours, 41).greedy(greedy_ids, 32)
    if dtype == torch.float32:
        assert got == expected[0, 8:].tolist()


def test_cuda_batch_step_matches_single_sequences(family):
    cls, config, weights, _ = family
    ours = cls(config, WeightStore(weights, torch.device("cuda"), torch.float32), KERNELS, "test")
    ids = torch.randint(0, 4000, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    contexts, new = (
        [[], ids[:40], ids[50:90], ids[100:117]],
        [ids[:23], ids[40:52], [ids[90]], [ids[117]]],
    )
    batched = batched_step_logits(ours, contexts, new)
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        alone = SequenceLoop(ours, len(c) + len(n) + 1).logits(c + n)
        assert (batched[i] - alone).abs().max().item() < 1e-3
