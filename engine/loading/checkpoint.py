"""`Checkpoint`: what a loader reads from disk (config, weights by HF name, tokenizer, special token
ids, chat template, the files read), the same for an HF folder and a GGUF file. Building a model
from it is engine/loading/loader.py's job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepserve.kernels.quant_panels import QuantizedMatrix


@dataclass
class Checkpoint:
    config: dict  # HF config.json keys (a GGUF's metadata translated to them)
    weights: dict[str, torch.Tensor]  # HF tensor names
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None
    files: list[Path]  # the weight files, hashed into the model fingerprint
    # A GGUF's block-quantized matrices as stored (HF names): `weights` holds their exact
    # dequantization, these let the CPU kernels stream the smaller blocks instead.
    quantized: dict[str, QuantizedMatrix] = field(default_factory=dict)
