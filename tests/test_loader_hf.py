"""HF-folder loading and `write_tiny_deepseek`: sharded checkpoints, determinism, fingerprints,
max_model_len, and the typed errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_loop import SequenceLoop
from safetensors.torch import load_file, save_file

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.tiny_deepseek import write_tiny_deepseek

PROMPT = [671, 4787, 13769, 46012, 54994, 1060, 270]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_write_tiny_deepseek_is_deterministic_per_seed(tiny, tmp_path):
    again = write_tiny_deepseek(tmp_path / "again", seed=0)
    other = write_tiny_deepseek(tmp_path / "other", seed=1)
    same = (tiny / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert same
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    fp = [load_model(EngineConfig(model=str(p))).info.fingerprint for p in (tiny, again, other)]
    assert fp[0] == fp[1] != fp[2]


def test_sharded_checkpoint_loads_like_the_single_file(tiny, tmp_path):
    sharded = copy_folder(tiny, tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a = SequenceLoop(load_model(EngineConfig(model=str(tiny))).model, 16).logits(PROMPT)
    b = SequenceLoop(load_model(EngineConfig(model=str(sharded))).model, 16).logits(PROMPT)
    assert torch.equal(a, b)


def test_max_model_len_is_the_smaller_of_config_and_model(tiny):
    assert load_model(EngineConfig(model=str(tiny), max_model_len=100)).info.max_model_len == 100
    assert load_model(EngineConfig(model=str(tiny), max_model_len=10**6)).info.max_model_len == 2048


def test_unknown_model_name_is_named():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(EngineConfig(model="no-such-model"))


def test_missing_weights_are_reported(tiny, tmp_path):
    folder = copy_folder(tiny, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(EngineConfig(model=str(folder)))


def test_missing_shard_is_reported(tiny, tmp_path):
    folder = copy_folder(tiny, tmp_path / "noshard")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002"):
        load_model(EngineConfig(model=str(folder)))


def test_missing_tokenizer_is_reported(tiny, tmp_path):
    folder = copy_folder(tiny, tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        load_model(EngineConfig(model=str(folder)))


def _edit_config(tiny, tmp_path, **changes):
    folder = copy_folder(tiny, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_unsupported_architecture_is_named(tiny, tmp_path):
    folder = _edit_config(tiny, tmp_path, architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        load_model(EngineConfig(model=str(folder)))


def test_unsupported_moe_scoring_is_named(tiny, tmp_path):
    folder = _edit_config(tiny, tmp_path, scoring_func="sqrtsoftplus")
    with pytest.raises(UnsupportedModelError, match="sqrtsoftplus"):
        load_model(EngineConfig(model=str(folder)))


def test_config_that_mismatches_the_weights_is_reported(tiny, tmp_path):
    folder = _edit_config(tiny, tmp_path, num_hidden_layers=2)  # layer 2 becomes "MTP", 3 unused
    with pytest.raises(UnsupportedModelError, match="does not use|missing"):
        load_model(EngineConfig(model=str(folder)))


def test_unsupported_dtype_is_named(tiny):
    with pytest.raises(UnsupportedModelError, match="float8"):
        load_model(EngineConfig(model=str(tiny), dtype="float8"))


def test_hf_llama_folder_with_llama3_rope_matches_transformers(tmp_path):
    """The HF-folder path for the llama family (untied head, llama3 rope scaling) against
    transformers' LlamaForCausalLM on the same folder."""
    from test_loader_gguf import _byte_vocab, hf_llama_weights
    from transformers import AutoModelForCausalLM

    from deepserve.engine.loading.tokenizer import tokenizer_from_gguf

    tokens, types, merges = _byte_vocab()
    weights = {k: torch.from_numpy(v) for k, v in hf_llama_weights(len(tokens), seed=3).items()}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tokens),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(tmp_path / "model.safetensors"))
    tokenizer_from_gguf("gpt2", tokens, types, merges, 0, False).save(
        str(tmp_path / "tokenizer.json")
    )
    ours = load_model(EngineConfig(model=str(tmp_path)))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = torch.randint(
        2, len(tokens), (200,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    got = SequenceLoop(ours.model, 201).logits(prompt)
    assert (got - expected).abs().max().item() < 1e-4
    assert (ours.info.family, ours.info.eos_token_ids, ours.info.bos_token_id) == ("llama", [1], 0)
