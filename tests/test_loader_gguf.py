"""GGUF loading: small llama GGUFs written with the `gguf` package's writer in every supported tensor
type, checked against transformers loading the same files, against the writer's own dequantizer,
and round-tripped through llama.cpp's Q/K row permutation."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from model_loop import SequenceLoop

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.loading.gguf_format import dequantize, read_gguf_file
from deepserve.engine.loading.gguf_loader import read_gguf
from deepserve.engine.loading.loader import load_model

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def _byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """A gpt2-style byte-level vocabulary: 256 byte symbols, three merges, two control tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = ["<s>", "</s>"] + [chr(c) for c in cs] + ["Ġt", "he", "Ġthe"]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, types, ["Ġ t", "h e", "Ġt he"]


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (HF half-split -> interleaved pairs)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_llama_weights(vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(out, inp, gain=1.0):
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
            np.float32
        )
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = mat(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, INTER)
    w["model.norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    w["lm_head.weight"] = mat(vocab, HIDDEN, gain=4.0)
    return w


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_llama_gguf(
    path: Path, qtype: Q, weights: dict[str, np.ndarray], arch: str = "llama"
) -> Path:
    tokens, types, merges = _byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{{ messages }}")
    for name, array in weights.items():
        if ".q_proj." in name:
            array = llamacpp_permute(array, HEADS)
        elif ".k_proj." in name:
            array = llamacpp_permute(array, KV_HEADS)
        if array.ndim == 1 or qtype == Q.F32:
            w.add_tensor(_gguf_name(name), array)
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), array.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    weights = hf_llama_weights(len(_byte_vocab()[0]), seed=0)
    files = {
        q: write_llama_gguf(root / f"tiny-{q.name}.gguf", q, weights)
        for q in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
    }
    return files, weights


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_logits_match_transformers_loading_the_same_gguf(gguf_files, qtype):
    from transformers import AutoModelForCausalLM

    path = gguf_files[0][qtype]
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = load_model(EngineConfig(model=str(path)))
    prompt = [5, 77, 260, 3, 100, 42, 9, 199, 120, 18, 33]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    got = SequenceLoop(ours.model, 16).logits(prompt)
    assert (got - expected).abs().max().item() < 1e-4


def test_float32_gguf_round_trips_to_the_hf_weights(gguf_files):
    """Undoing llama.cpp's Q/K permutation restores the original HF rows exactly."""
    files, weights = gguf_files
    ckpt = read_gguf(files[Q.F32])
    assert set(ckpt.weights) == set(weights)
    for name, array in weights.items():
        assert torch.equal(ckpt.weights[name], torch.from_numpy(array)), name


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_matches_gguf_reference(gguf_files, qtype):
    path = gguf_files[0][qtype]
    ours = read_gguf_file(path)
    reader = gguf.GGUFReader(str(path))
    for info, t in zip(ours.tensors, reader.tensors, strict=True):
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = dequantize(ours.raw(info), info.qtype, info.shape)
        assert np.array_equal(got.numpy(), expected.astype(np.float32)), info.name


def test_header_metadata_matches_gguf_reader(gguf_files):
    path = gguf_files[0][Q.Q4_1]
    ours = read_gguf_file(path).metadata
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours[key] == field.contents(), key


def test_tokenizer_from_gguf_matches_transformers(gguf_files):
    from transformers import AutoTokenizer

    path = gguf_files[0][Q.F32]
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_model(EngineConfig(model=str(path)))
    for text in ["the the<s> then</s>", " the", "héllo wörld\n\t 12"]:
        assert ours.tokenizer.encode(text).ids == hf.encode(text)
    assert ours.tokenizer.decode(ours.tokenizer.encode("the  théorie").ids) == "the  théorie"
    assert (ours.info.bos_token_id, ours.info.eos_token_ids) == (0, [1])
    assert ours.info.chat_template == "{{ messages }}"


def test_unsupported_quantization_is_named(tmp_path):
    weights = hf_llama_weights(len(_byte_vocab()[0]), seed=1)
    path = write_llama_gguf(tmp_path / "q5.gguf", Q.Q5_0, weights)
    with pytest.raises(UnsupportedModelError, match="Q5_0"):
        load_model(EngineConfig(model=str(path)))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    weights = hf_llama_weights(len(_byte_vocab()[0]), seed=1)
    path = write_llama_gguf(tmp_path / "falcon.gguf", Q.F32, weights, arch="falcon")
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_model(EngineConfig(model=str(path)))


def test_truncated_gguf_is_rejected(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 10)
    with pytest.raises(UnsupportedModelError, match="truncated"):
        load_model(EngineConfig(model=str(path)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_blocks_are_kept_in_the_loaded_row_order(gguf_files, qtype):
    """Each matrix's raw blocks, Q/K rows unpermuted like the weights, dequantize to exactly the
    loaded float32 weight: the CPU kernels may read either."""
    ckpt = read_gguf(gguf_files[0][qtype])
    matrices = {n for n, w in ckpt.weights.items() if w.dim() == 2}
    assert set(ckpt.quantized) == matrices
    for name, m in ckpt.quantized.items():
        got = dequantize(m.rows.reshape(-1), qtype, (m.out_features, m.in_features))
        assert torch.equal(got, ckpt.weights[name]), name
