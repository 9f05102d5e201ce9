"""DeepSeek's published quantized checkpoints (engine/loading/quantized.py): FP8 e4m3 with 128 x 128
block scales (V3: float32 `weight_scale_inv`; V4: UE8M0 `scale`) and V4's MXFP4 experts, written by
`make-test-model --quantization`, load and give exactly the greedy tokens of the same weights
dequantized (by the few lines of `reference_dequantize` here) and saved in bf16; the dequantization
agrees with transformers' own; a quantization_config we do not read is refused, naming the field."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.llm import LLM
from deepserve.engine.loading.loader import load_model
from deepserve.engine.loading.quantized import dequantize_fp8, dequantize_mxfp4
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.testmodels.model_shapes import write_shaped_model
from deepserve.engine.testmodels.quantize import quantize_fp8, quantize_mxfp4
from deepserve.engine.testmodels.tiny_deepseek import write_tiny_deepseek
from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4
from deepserve.server.cli import main

PROMPTS = [[671, 4787, 13769, 46012, 54994, 1060, 270], [5, 6, 7, 8]]
V3_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
              "activation_scheme": "dynamic"}  # fmt: skip


def reference_dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each scaled weight as bf16, written from the format's definition; the rest unchanged."""
    out = {}
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        scale = tensors.get(base + ".weight_scale_inv", tensors.get(base + ".scale"))
        if name.endswith(("_scale_inv", ".scale")):
            continue
        if scale is None:
            out[name] = t
            continue
        scale = scale.float()
        if t.dtype == torch.int8:  # MXFP4: two e2m1 codes a byte, low nibble first; 32 a scale
            u = t.view(torch.uint8)
            codes = torch.stack([u & 15, u >> 4], dim=-1).flatten(-2).long()
            magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7]
            w = magnitude * (1 - 2 * (codes >> 3)) * scale.repeat_interleave(32, dim=-1)
        else:  # FP8, one scale per 128 x 128 block, the edge blocks cut
            rows, cols = t.shape
            s = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            w = t.float() * s
        out[name] = w.to(torch.bfloat16)
    return out


def dequantized_copy(folder, dst):
    """`folder` with its weights dequantized by the reference and no quantization_config."""
    shutil.copytree(folder, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = reference_dequantize(load_file(str(folder / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    config.pop("expert_dtype", None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def greedy(folder, max_tokens=8, prompts=PROMPTS):
    llm = LLM(EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_bytes=2**22))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return [r.token_ids for r in llm.generate(prompts, params)]
    finally:
        llm.close()


def with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("v3") / "fp8", quantization="fp8")


# -- the published layouts, as make-test-model writes them


def test_v3_fp8_checkpoint_is_in_the_published_layout(v3_fp8):
    config = json.loads((v3_fp8 / "config.json").read_text())
    assert config["quantization_config"] == V3_QCONFIG
    t = load_file(str(v3_fp8 / "model.safetensors"))
    p = "model.layers.1."
    assert t[p + "self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[p + "self_attn.q_b_proj.weight_scale_inv"].dtype == torch.float32
    assert t[p + "mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    for kept in ("model.embed_tokens.weight", "lm_head.weight", p + "mlp.gate.weight",
                 p + "input_layernorm.weight", p + "mlp.gate.e_score_correction_bias"):  # fmt: skip
        assert (
            t[kept].dtype == torch.float32
            and kept.removesuffix("weight") + "weight_scale_inv" not in t
        )


def test_v4_mxfp4_checkpoint_is_in_the_published_layout(tmp_path):
    args = ["make-test-model", "--shape", "tiny-deepseek-v4", "--quantization", "mxfp4"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == V3_QCONFIG | {"scale_fmt": "ue8m0"}
    assert config["expert_dtype"] == "fp4"
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["layers.2.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.2.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    w1, s1 = t["layers.2.ffn.experts.0.w1.weight"], t["layers.2.ffn.experts.0.w1.scale"]
    assert (w1.dtype, tuple(w1.shape), s1.dtype, tuple(s1.shape)) == (
        torch.int8, (32, 32), torch.float8_e8m0fnu, (32, 2)
    )  # fmt: skip
    assert t["layers.2.ffn.shared_experts.w1.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32
    assert t["layers.1.hc_attn_fn"].dtype == torch.float32


def test_mxfp4_is_refused_for_v3_which_is_not_published_so(tmp_path, capsys):
    args = ["make-test-model", "--shape", "tiny-deepseek", "--quantization", "mxfp4"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    assert "--quantization mxfp4 is not how deepseek_v3 is published" in capsys.readouterr().err


# -- greedy tokens: the quantized checkpoint against its reference dequantization in bf16


def test_v3_fp8_greedy_tokens_equal_the_dequantized_bf16_checkpoint(v3_fp8, tmp_path):
    reference = dequantized_copy(v3_fp8, tmp_path / "bf16")
    assert greedy(v3_fp8) == greedy(reference)


@pytest.mark.parametrize("quantization", ["mxfp4", "fp8"])
def test_v4_greedy_tokens_equal_the_dequantized_bf16_checkpoint(quantization, tmp_path):
    folder = write_tiny_deepseek_v4(tmp_path / "q", quantization=quantization)
    reference = dequantized_copy(folder, tmp_path / "bf16")
    assert greedy(folder) == greedy(reference)


def test_scales_are_applied(v3_fp8, tmp_path):
    """The loaded model is not the FP8 values read as if their scales were 1."""
    tensors = load_file(str(v3_fp8 / "model.safetensors"))
    unscaled = {n: t.float() if t.dtype == torch.float8_e4m3fn else t for n, t in tensors.items()}
    unscaled = {n: t for n, t in unscaled.items() if not n.endswith("_scale_inv")}
    folder = tmp_path / "unscaled"
    shutil.copytree(v3_fp8, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(unscaled, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    assert greedy(v3_fp8, 4) != greedy(folder, 4)


def test_scales_in_another_shard_than_their_weights_are_found(v3_fp8, tmp_path):
    tensors = load_file(str(v3_fp8 / "model.safetensors"))
    sharded = tmp_path / "sharded"
    shutil.copytree(v3_fp8, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    scales = sorted(n for n in tensors if n.endswith("_scale_inv"))
    shards = {"model-00001-of-00002.safetensors": sorted(set(tensors) - set(scales)),
              "model-00002-of-00002.safetensors": scales}  # fmt: skip
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, str(sharded / file))
    index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert greedy(sharded, 4) == greedy(v3_fp8, 4)


# -- the dequantization against transformers' FP8 integration


def test_fp8_dequantization_agrees_with_transformers_with_cut_edge_blocks():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale_inv = quantize_fp8(w, ue8m0=False)
    assert tuple(scale_inv.shape) == (3, 2)
    ours = dequantize_fp8(q, scale_inv, (128, 128), torch.float32)
    theirs = _dequantize_fp8_weight(q, scale_inv, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
    assert (ours - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


def test_ue8m0_fp8_dequantization_agrees_with_transformers():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8(w, ue8m0=True)
    assert scale.dtype == torch.float8_e8m0fnu
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)
    assert torch.equal(dequantize_fp8(q, scale, (128, 128), torch.float32), theirs)
    as_bytes = dequantize_fp8(q, scale.view(torch.uint8), (128, 128), torch.float32)
    assert torch.equal(as_bytes, theirs)  # E8M0 shipped as raw bytes reads the same


def test_mxfp4_dequantization_agrees_with_transformers():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    packed, scale = quantize_mxfp4(w)
    assert (packed.dtype, tuple(packed.shape), tuple(scale.shape)) == (
        torch.int8,
        (64, 48),
        (64, 3),
    )
    theirs = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), theirs)


# -- what is refused, and how it is named


@pytest.mark.parametrize(
    "qconfig, named",
    [
        (V3_QCONFIG | {"quant_method": "awq"}, "quantization_config.quant_method = 'awq'"),
        (V3_QCONFIG | {"fmt": "e5m2"}, "quantization_config.fmt = 'e5m2'"),
        (V3_QCONFIG | {"activation_scheme": "static"}, "quantization_config.activation_scheme"),
        (V3_QCONFIG | {"weight_block_size": [128]}, "quantization_config.weight_block_size"),
        (V3_QCONFIG | {"bits": 4}, "quantization_config.bits = 4"),
        ({"bits": 4, "quant_method": "gptq"}, "quantization_config.quant_method = 'gptq'"),
    ],
)
def test_unread_quantization_config_is_refused_naming_the_field(v3_fp8, tmp_path, qconfig, named):
    folder = with_config(v3_fp8, tmp_path / "bad", quantization_config=qconfig)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        load_model(EngineConfig(model=str(folder)))


def test_cli_names_the_refused_field(v3_fp8, tmp_path, capsys):
    folder = with_config(v3_fp8, tmp_path / "bad", quantization_config={"quant_method": "awq"})
    assert main(["generate", "--model", str(folder), "hi"]) == 2
    assert "quantization_config.quant_method = 'awq'" in capsys.readouterr().err


def test_fp8_weights_without_quantization_config_are_refused(v3_fp8, tmp_path):
    folder = tmp_path / "no-config"
    shutil.copytree(v3_fp8, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no quantization_config"):
        load_model(EngineConfig(model=str(folder)))


def test_fp8_weight_without_its_scale_is_refused(v3_fp8, tmp_path):
    folder = tmp_path / "no-scale"
    shutil.copytree(v3_fp8, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.weight is torch.float8_e4m3fn"):
        load_model(EngineConfig(model=str(folder)))


# -- the DeepSeek-V3 slice: the real routing and layer plan, dims shrunk to blocks with cut edges

V3_SLICE_SMALL = dict(
    vocab_size=300, hidden_size=160, intermediate_size=288, moe_intermediate_size=96,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=136, kv_lora_rank=64,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=16,
)  # fmt: skip


def test_v3_slice_fp8_greedy_tokens_equal_the_dequantized_bf16_checkpoint(tmp_path):
    folder = write_shaped_model(
        "deepseek-v3-slice", tmp_path / "q", overrides=V3_SLICE_SMALL, quantization="fp8"
    )
    config = json.loads((folder / "config.json").read_text())
    routing = ("n_group", "topk_group", "num_experts_per_tok", "routed_scaling_factor")
    assert [config[k] for k in routing] == [8, 4, 8, 2.5]
    assert (config["first_k_dense_replace"], config["num_nextn_predict_layers"]) == (3, 1)
    t = load_file(str(folder / "model.safetensors"))
    assert tuple(t["model.layers.3.mlp.experts.15.up_proj.weight_scale_inv"].shape) == (1, 2)
    assert t["model.layers.4.eh_proj.weight"].dtype == torch.float8_e4m3fn  # the MTP layer
    assert t["model.layers.4.shared_head.head.weight"].dtype == torch.bfloat16
    reference = dequantized_copy(folder, tmp_path / "bf16")
    prompts = [[5, 6, 7, 8], [299, 17, 123]]
    assert greedy(folder, prompts=prompts) == greedy(reference, prompts=prompts)


# every quantized matrix one 128 block or whole blocks along each side: transformers' FP8 loader
# (Fp8Dequantize) divides a side by its scale count, so a cut edge block (V3's 576-row
# kv_a_proj_with_mqa, the small slice above) reads as equal blocks there, or is refused
V3_SLICE_ALIGNED = dict(
    vocab_size=300, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=16,
)  # fmt: skip


@pytest.mark.parametrize("length", [1, 40])
def test_v3_fp8_logits_match_transformers_finegrained_fp8_on_the_same_checkpoint(tmp_path, length):
    """transformers' own reading of V3's FP8 format (FineGrainedFP8, dequantizing: its FP8
    kernels come from the hub) against ours, float32, last-position logits."""
    from model_loop import logit_gap_to_transformers
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    folder = write_shaped_model(
        "deepseek-v3-slice", tmp_path / "q", overrides=V3_SLICE_ALIGNED, quantization="fp8"
    )
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    ).eval()
    ours = load_model(EngineConfig(model=str(folder), dtype="float32"))
    prompt = torch.randint(2, 300, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    assert logit_gap_to_transformers(ours.model, hf, prompt) < 1e-4


def test_scales_of_the_wrong_shape_are_refused_naming_the_tensor(v3_fp8, tmp_path):
    folder = tmp_path / "bad-scale"
    shutil.copytree(v3_fp8, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"o_proj\.weight: FP8 weight \(64, 64\)"):
        load_model(EngineConfig(model=str(folder)))


def test_v4_flash_shape_in_its_published_mxfp4_layout_matches_its_dequantized_copy(tmp_path):
    """model_shapes' V4 weights (bf16 matrices, fp32 vectors) through the same path."""
    small = dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=4, index_head_dim=16, index_topk=8, n_routed_experts=8,
        num_experts_per_tok=2, num_hidden_layers=3,
    )  # fmt: skip
    folder = write_shaped_model("deepseek-v4-flash", tmp_path / "q", overrides=small,
                                quantization="mxfp4")  # fmt: skip
    assert load_file(str(folder / "model.safetensors"))[
        "layers.2.ffn.experts.7.w2.weight"
    ].shape == (64, 32)
    reference = dequantized_copy(folder, tmp_path / "bf16")
    prompts = [[5, 6, 7, 8], [299, 17, 123]]
    assert greedy(folder, prompts=prompts) == greedy(reference, prompts=prompts)


# -- kept quantized for a KernelSet that runs FP8 (`fp8_weights`: the CUDA sets), as the GPU loads


def _dequantizing_kernels():
    """The reference set, with a `linear` that takes kept weights by dequantizing them: the
    CUDA sets' dispatch without their kernels, so logits can be compared exactly on the CPU."""
    from dataclasses import replace

    from deepserve.kernels import reference

    def linear(x, w):
        return reference.linear(x, w if isinstance(w, torch.Tensor) else w.dequantize(x.dtype))

    return replace(reference.KERNELS, linear=linear, fp8_weights=True)


def _v3_model(folder, keep: bool):
    from deepserve.engine.loading.hf_loader import read_hf_folder
    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from deepserve.kernels import reference

    ckpt = read_hf_folder(folder, torch.float32, keep_quantized=keep)
    store = WeightStore(ckpt.weights, torch.device("cpu"), torch.float32)
    kernels = _dequantizing_kernels() if keep else reference.KERNELS
    with torch.inference_mode():
        model = DeepseekV3ForCausalLM(ckpt.config, store, kernels, "fp")
    assert store.unused() == []
    return model


def test_kept_fp8_weights_are_the_published_pairs_with_float32_scales(v3_fp8):
    from deepserve.engine.loading.hf_loader import read_hf_folder
    from deepserve.kernels.block_quant import Fp8Weight

    kept = read_hf_folder(v3_fp8, torch.float32, keep_quantized=True).weights
    plain = read_hf_folder(v3_fp8, torch.float32).weights
    o = kept["model.layers.1.self_attn.o_proj.weight"]
    assert isinstance(o, Fp8Weight) and o.scale.dtype == torch.float32 and o.block == (128, 128)
    assert torch.equal(o.dequantize(), plain["model.layers.1.self_attn.o_proj.weight"])
    assert isinstance(kept["model.norm.weight"], torch.Tensor)  # unscaled tensors pass through


def test_a_model_on_kept_fp8_weights_gives_the_logits_of_the_dequantized_load(v3_fp8):
    """Projections and stacked experts stay FP8; a fused gate/up whose gate ends inside a scale
    block (the tiny model's 32 rows) is dequantized, as is kv_b for MLA's absorbed bmm's; the
    forward is that of the dequantized checkpoint."""
    from model_loop import SequenceLoop

    from deepserve.kernels.block_quant import Fp8Weight

    kept, plain = _v3_model(v3_fp8, keep=True), _v3_model(v3_fp8, keep=False)
    attn, moe = kept.layers[1].attn, kept.layers[1].mlp
    assert isinstance(attn.o, Fp8Weight) and isinstance(moe.down, Fp8Weight)
    assert moe.down.data.dim() == 3 and moe.down.scale.dim() == 3  # experts stacked
    assert isinstance(moe.gate_up, torch.Tensor) and moe.gate_up.dtype == torch.float32
    assert isinstance(attn.w_uk, torch.Tensor) and attn.w_uk.dtype == torch.float32
    got = SequenceLoop(kept, 16).logits(PROMPTS[0])
    assert torch.equal(got, SequenceLoop(plain, 16).logits(PROMPTS[0]))


def _v4_model(folder, keep: bool):
    from deepserve.engine.loading.hf_loader import read_hf_folder
    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepserve.kernels import reference

    ckpt = read_hf_folder(folder, torch.float32, keep_quantized=keep)
    store = WeightStore(ckpt.weights, torch.device("cpu"), torch.float32)
    kernels = _dequantizing_kernels() if keep else reference.KERNELS
    with torch.inference_mode():
        model = DeepseekV4ForCausalLM(ckpt.config, store, kernels, "fp")
    assert store.unused() == []
    return model


@pytest.mark.parametrize("quantization", ["mxfp4", "fp8"])
def test_a_v4_model_on_kept_weights_gives_the_logits_of_the_dequantized_load(
    quantization, tmp_path
):
    """V4 as published: the dense projections stay FP8 and (`mxfp4`) the routed experts MXFP4,
    stacked, gate and up fused along their rows; wo_a, a batched matmul's operand, and the
    compressors (bf16 in the checkpoint) are plain; the forward is the dequantized one's."""
    from model_loop import SequenceLoop

    from deepserve.kernels.block_quant import Fp8Weight, Mxfp4Weight

    folder = write_tiny_deepseek_v4(tmp_path / "q", quantization=quantization)
    kept, plain = _v4_model(folder, keep=True), _v4_model(folder, keep=False)
    attn, moe = kept.layers[1].attn, kept.layers[1].moe
    assert all(isinstance(m, Fp8Weight) for m in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b))
    assert isinstance(attn.wo_a, torch.Tensor) and isinstance(attn.compressor.wkv, torch.Tensor)
    assert isinstance(kept.mtp[0].h_proj, Fp8Weight)
    if quantization == "mxfp4":  # per-row scales: gate and up fuse and stay MXFP4
        assert isinstance(moe.gate_up, Mxfp4Weight) and moe.gate_up.data.dim() == 3
    assert isinstance(moe.down, Mxfp4Weight if quantization == "mxfp4" else Fp8Weight)
    assert moe.down.data.dim() == 3  # experts stacked
    prompt = PROMPTS[0]
    got = SequenceLoop(kept, 16).logits(prompt)
    assert torch.equal(got, SequenceLoop(plain, 16).logits(prompt))


def test_fp8_rows_stay_fp8_only_where_their_scale_blocks_allow():
    from deepserve.kernels import block_quant

    g = torch.Generator().manual_seed(0)
    a = block_quant.quantize_fp8(torch.randn(256, 64, generator=g))
    b = block_quant.quantize_fp8(torch.randn(72, 64, generator=g))
    fused = block_quant.cat_rows([a, b], torch.float32)  # a fills two whole blocks
    assert isinstance(fused, block_quant.Fp8Weight) and fused.scale.shape == (3, 1)
    want = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(fused.dequantize(), want)
    unaligned = block_quant.cat_rows([b, a], torch.float32)  # b ends inside a block
    assert isinstance(unaligned, torch.Tensor)
    assert torch.equal(unaligned, torch.cat([b.dequantize(), a.dequantize()]))
    inside = torch.arange(256).view(4, 64).flip(-1).flatten()  # rows within their 128-block
    assert isinstance(block_quant.reorder_rows(a, inside, torch.float32), block_quant.Fp8Weight)
    across = torch.arange(256).flip(0)
    moved = block_quant.reorder_rows(a, across, torch.float32)
    assert isinstance(moved, torch.Tensor) and torch.equal(moved, a.dequantize().flip(0))
    stacked = block_quant.stack([a, a], torch.float32)
    assert isinstance(stacked, block_quant.Fp8Weight) and torch.equal(stacked[1].data, a.data)


def test_mxfp4_rows_stack_in_any_count_their_scales_being_per_row():
    from deepserve.kernels import block_quant

    g = torch.Generator().manual_seed(1)
    gate, up = (block_quant.quantize_mxfp4(torch.randn(24, 64, generator=g)) for _ in range(2))
    fused = block_quant.cat_rows([gate, up], torch.float32)
    assert isinstance(fused, block_quant.Mxfp4Weight) and fused.shape == (48, 64)
    assert torch.equal(fused.dequantize(), torch.cat([gate.dequantize(), up.dequantize()]))
