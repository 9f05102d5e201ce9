"""Reads an HF checkpoint folder into the engine's common form: config.json, safetensors weights
(single file or sharded with model.safetensors.index.json; a quantized checkpoint's weights
dequantized as they are read, or kept for the GPU kernels, by quantized.py), tokenizer.json, and
the chat template, BOS and EOS ids from tokenizer_config.json / generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError
from deepserve.engine.loading.checkpoint import Checkpoint
from deepserve.engine.loading.quantized import quant_scheme, read_dequantized
from deepserve.engine.loading.tokenizer import load_tokenizer_json


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.exists()]
    if not files or missing:
        raise ModelNotFoundError(
            f"no safetensors weights in {folder}" + (f" (missing {missing})" if missing else "")
        )
    return files


def read_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False
) -> Checkpoint:
    """`dtype`: what quantized weights are dequantized to (the engine's); others keep theirs.
    `keep_quantized`: FP8 / MXFP4 weights kept as stored, for kernels that run them."""
    if not (folder / "config.json").exists():
        raise ModelNotFoundError(f"{folder} has no config.json")
    config = _read_json(folder / "config.json")
    scheme = quant_scheme(config)  # before reading gigabytes: refuse a format we do not read
    files = weight_files(folder)
    weights = read_dequantized(files, scheme, dtype, keep_quantized)
    tokenizer = load_tokenizer_json(folder / "tokenizer.json")
    tok_config = _optional_json(folder / "tokenizer_config.json")
    gen_config = _optional_json(folder / "generation_config.json")
    bos = _token_id(tokenizer, tok_config.get("bos_token"), gen_config.get("bos_token_id"))
    bos = bos if bos is not None else config.get("bos_token_id")
    return Checkpoint(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        bos_token_id=bos,
        eos_token_ids=_eos_ids(config, tok_config, gen_config, tokenizer),
        chat_template=tok_config.get("chat_template"),
        files=files,
    )


def _optional_json(path: Path) -> dict:
    return _read_json(path) if path.exists() else {}


def _token_id(tokenizer: Tokenizer, token, fallback: int | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
        return tokenizer.token_to_id(token)
    return fallback


def _eos_ids(config: dict, tok_config: dict, gen_config: dict, tokenizer: Tokenizer) -> list[int]:
    """generation_config's eos list wins (it names every end-of-turn token); then the config's."""
    for source in (gen_config.get("eos_token_id"), config.get("eos_token_id")):
        if source is not None:
            return [source] if isinstance(source, int) else list(source)
    eos = _token_id(tokenizer, tok_config.get("eos_token"), None)
    return [eos] if eos is not None else []
