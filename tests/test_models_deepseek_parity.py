"""tiny-deepseek (seeded DeepSeek-V3 architecture: MLA, MoE with group routing, YaRN, MTP) against
HuggingFace transformers' DeepseekV3ForCausalLM on the same HF folder, plus the MTP layer against
transformers' own decoder-layer and norm modules fed the same weights."""

from __future__ import annotations

import pytest
import torch
from model_loop import SequenceLoop, batched_step_logits
from safetensors.torch import load_file

from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, write_tiny_deepseek

TEXT = (
    "DeepSeek-V3 compresses keys and values into a small latent vector per token, which is what the "
    "cache stores; every attention head reconstructs its own keys from that latent. Mixture-of-experts "
    "layers route each token to a few experts chosen within a few groups. "
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), seed=0)


@pytest.fixture(scope="module")
def ours(tiny_dir):
    torch.set_num_threads(1)
    return load_model(EngineConfig(model=str(tiny_dir)))


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def long_ids(hf):
    ids = hf[1].encode(TEXT * 12, add_special_tokens=False)
    assert len(ids) >= 300
    return ids[:300]


@pytest.mark.parametrize(
    "text", [TEXT, "<｜User｜>hi<｜Assistant｜><think>", "<｜System｜>sys 1234 日本語 🤖"]
)
def test_tokenizer_encodes_like_transformers(ours, hf, text):
    assert ours.tokenizer.encode(text).ids == hf[1].encode(text, add_special_tokens=False)


def test_deepseek_recipe_v41_encoding_tokenizes_with_our_tokenizer(ours, tiny_dir):
    """The V4.1 encoding renders <｜System｜>, which the stock V4 tokenizer lacks; ours has it."""
    import deepseek_recipe as dr

    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    conversation = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation
    tokenizer = dr.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = dr.DeepseekV41Encoding().with_tokenizer(tokenizer).encode(conversation)
    assert ours.tokenizer.token_to_id("<｜System｜>") in ids
    assert max(ids) < ours.info.vocab_size == ours.tokenizer.get_vocab_size()


def test_model_info_and_latent_only_kv_cache(ours):
    info, spec = ours.info, ours.model.kv_cache_spec
    assert (info.family, info.num_mtp_layers) == ("deepseek_v3", 1)
    assert info.eos_token_ids == [ours.tokenizer.token_to_id("<｜end▁of▁sentence｜>")]
    # the cache holds the compressed latent + rope key only, for 3 layers + the MTP layer
    width = TINY_CONFIG["kv_lora_rank"] + TINY_CONFIG["qk_rope_head_dim"]
    assert (spec.num_layers, spec.width) == (TINY_CONFIG["num_hidden_layers"] + 1, width)


@pytest.mark.parametrize("length", [1, 17, 300])
def test_last_position_logits_match_transformers(ours, hf, long_ids, length):
    prompt = long_ids[:length]
    with torch.inference_mode():
        expected = hf[0](torch.tensor([prompt])).logits[0, -1]
    got = SequenceLoop(ours.model, length + 1).logits(prompt)
    diff = (got - expected).abs().max().item()
    print(f"tiny-deepseek float32 {length}-token prompt: max abs logit diff {diff:.2e}")
    assert diff < 2e-3


@pytest.mark.parametrize("prompt", ["Once upon a time", "def main():", "1 2 3 4"])
def test_greedy_generation_matches_transformers(ours, hf, prompt):
    ids = hf[1].encode(prompt, add_special_tokens=False)
    expected = hf[0].generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    got = SequenceLoop(ours.model, len(ids) + 33).greedy(ids, 32, tuple(ours.info.eos_token_ids))
    assert got == expected[0, len(ids) :].tolist()


def test_greedy_text_depends_on_the_prompt(ours, hf):
    outs = {
        tuple(SequenceLoop(ours.model, 40).greedy(hf[1].encode(p, add_special_tokens=False), 8))
        for p in ("Once upon a time", "def main():", "1 2 3 4", "Hello")
    }
    assert len(outs) == 4


def test_mixed_batch_step_matches_each_sequence_alone(ours, long_ids):
    contexts = [[], long_ids[:40], long_ids[50:90], long_ids[100:117]]
    new = [long_ids[200:223], long_ids[40:52], [long_ids[90]], [long_ids[117]]]
    batched = batched_step_logits(ours.model, contexts, new, block_size=8)
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        alone = SequenceLoop(ours.model, len(c) + len(n) + 1).logits(c + n)
        assert (batched[i] - alone).abs().max().item() < 1e-3


def _hf_mtp_reference(hf_model, tiny_dir, ids, prev_hidden):
    """MTP with transformers' own modules: enorm/hnorm (RMSNorm), eh_proj, DeepseekV3DecoderLayer,
    shared_head norm, all loaded with the checkpoint's layer-`num_hidden_layers` weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    config = hf_model.config
    index = config.num_hidden_layers
    prefix = f"model.layers.{index}."
    raw = {
        k[len(prefix) :]: v
        for k, v in load_file(str(tiny_dir / "model.safetensors")).items()
        if k.startswith(prefix)
    }
    layer = DeepseekV3DecoderLayer(config, layer_idx=index).eval()
    experts = config.n_routed_experts
    state = {k: v for k, v in raw.items() if k.startswith(("self_attn.", "input_", "post_"))}
    state["mlp.gate.weight"] = raw["mlp.gate.weight"]
    state["mlp.gate.e_score_correction_bias"] = raw["mlp.gate.e_score_correction_bias"]
    for n in ("gate_proj", "up_proj", "down_proj"):
        state[f"mlp.shared_experts.{n}.weight"] = raw[f"mlp.shared_experts.{n}.weight"]
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [raw[f"mlp.experts.{e}.gate_proj.weight"], raw[f"mlp.experts.{e}.up_proj.weight"]]
            )
            for e in range(experts)
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [raw[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
    )
    layer.load_state_dict(state, strict=True)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(raw[f"{name}.weight"])
    n = len(ids)
    with torch.inference_mode():
        e = norms["enorm"](hf_model.model.embed_tokens(torch.tensor([ids])))
        h = torch.cat([e, norms["hnorm"](prev_hidden[None])], dim=-1) @ raw["eh_proj.weight"].T
        pos = torch.arange(n)[None]
        cos_sin = hf_model.model.rotary_emb(h, pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return norms["shared_head.norm"](out)[0]


def test_mtp_layer_matches_transformers_modules(ours, hf, tiny_dir, long_ids):
    """forward_mtp on tokens t+1 with the main model's hidden at t: a 20-token prefill then one
    decode (absorbed MLA over the MTP layer's own cache slot) against transformers' modules."""
    hf[0].config._attn_implementation = "eager"
    ids = long_ids[:22]
    loop = SequenceLoop(ours.model, 32)
    main_hidden = loop.hidden(ids[:21])  # fills the main layers' cache; MTP slot is separate
    model = ours.model
    got = []
    with torch.inference_mode():
        for lo, hi in ((0, 20), (20, 21)):
            loop.length = lo
            attn = loop.metadata(hi - lo)
            got.append(
                model.forward_mtp(
                    torch.tensor(ids[lo + 1 : hi + 1]),
                    torch.arange(lo, hi),
                    main_hidden[lo:hi],
                    attn,
                    loop.cache,
                )
            )
    expected = _hf_mtp_reference(hf[0], tiny_dir, ids[1:22], main_hidden[:21])
    diff = (torch.cat(got) - expected).abs().max().item()
    print(f"tiny-deepseek MTP hidden max abs diff {diff:.2e}")
    assert diff < 1e-4
    logits = model.compute_mtp_logits(got[1])
    assert logits.shape == (1, ours.info.vocab_size)


def test_bfloat16_logits_close_to_float32(ours, tiny_dir, long_ids):
    bf16 = load_model(EngineConfig(model=str(tiny_dir), dtype="bfloat16"))
    assert bf16.model.kv_cache_spec.dtype == torch.bfloat16
    ref = SequenceLoop(ours.model, 70).logits(long_ids[:64])
    got = SequenceLoop(bf16.model, 70).logits(long_ids[:64])
    assert got.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
    print(
        f"tiny-deepseek bfloat16 vs float32 logits: max abs diff {(got - ref).abs().max().item():.3f}, cosine {cos:.5f}"
    )
    assert cos > 0.99
