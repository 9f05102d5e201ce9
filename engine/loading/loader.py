"""`load_model(config)`: from a model name to a ready `LoadedModel` (model on its device and dtype,
tokenizer, `ModelInfo`). Finding the files is builtin_models.py's job, reading them gguf_loader.py's
or hf_loader.py's; the network is built by the class the architecture names (architectures.py).
With `tensor_parallel_size > 1`, engine/parallel/launch.py starts the ranks and is handed
`load_model` to load each rank's share."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import xxhash
from tokenizers import Tokenizer

from deepserve.engine.config import EngineConfig
from deepserve.engine.contract import ModelInfo
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.loading.architectures import architecture_of, model_class
from deepserve.engine.loading.builtin_models import resolve_model
from deepserve.engine.loading.checkpoint import Checkpoint
from deepserve.engine.models.base import CausalLM
from deepserve.engine.models.common import WeightStore
from deepserve.engine.parallel.launch import load_parallel_model
from deepserve.engine.parallel.plan import ModelShard, shard_config
from deepserve.engine.parallel.sharded_weights import ShardedWeightStore
from deepserve.kernels.errors import KernelUnavailableError
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.kv_quant import KV_CACHE_DTYPES
from deepserve.kernels.registry import get_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FULL_HASH_LIMIT = 4 * 2**30  # above this, weight identity hashes sampled chunks, not every byte
_CHUNK = 2**20


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    info: ModelInfo
    kernels: KernelSet | None = None  # the set the model runs (None: not known, e.g. built apart)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UnsupportedModelError(f"dtype {name!r} is not supported ({', '.join(DTYPES)})")
    return DTYPES[name]


def _choose_cpu_isa(config: EngineConfig) -> None:
    """`--cpu-isa`: the native CPU kernels' path for this process (its ranks choose their own)."""
    from deepserve.kernels.cpu import native

    if torch.device(config.device).type != "cpu":
        raise UnsupportedModelError("--cpu-isa applies to --device cpu only")
    if not native.load():
        raise UnsupportedModelError("--cpu-isa needs the native CPU kernels, which did not load")
    try:
        native.set_isa(config.cpu_isa)
    except RuntimeError as e:
        raise UnsupportedModelError(f"--cpu-isa {config.cpu_isa}: {e}") from e


def load_model(config: EngineConfig, shard: ModelShard | None = None) -> LoadedModel:
    """The model on one process; with `tensor_parallel_size > 1`, rank 0's driver of the ranks
    (engine/parallel/launch.py). `shard`: one rank's share, loaded by that rank."""
    if shard is None and config.tensor_parallel_size > 1:
        return load_parallel_model(config, load_model)
    path = resolve_model(config.model)
    dtype = torch_dtype(config.dtype)
    if config.cpu_isa is not None:
        _choose_cpu_isa(config)
    try:
        kernels = get_kernels(config.device, config.batch_invariant)
    except KernelUnavailableError as e:
        raise UnsupportedModelError(str(e)) from e
    # FP8 / MXFP4 weights stay quantized for kernels that run them, on one process (a rank's
    # slices of block-scaled weights are not cut along their blocks: they are dequantized)
    keep = kernels.fp8_weights and shard is None
    checkpoint = _read_checkpoint(path, dtype, keep)
    arch = architecture_of(checkpoint.config)
    cls = model_class(arch)
    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
    fingerprint = kv_fingerprint(
        model_fingerprint(checkpoint.config, checkpoint.files), config.kv_cache_dtype
    )
    model_config = checkpoint.config
    device = torch.device(config.device)
    if shard is None:
        store = WeightStore(checkpoint.weights, device, dtype, checkpoint.quantized)
    else:
        model_config = shard_config(arch, checkpoint.config, shard.plan)
        store = ShardedWeightStore(
            checkpoint.weights, device, dtype, arch, checkpoint.config, shard.plan
        )
        shard = replace(shard, experts=store.experts)
    with torch.inference_mode():
        model = cls(
            model_config, store, kernels, fingerprint, parallel=shard, kv_cache_dtype=kv_dtype
        )
    leftover = store.unused()
    if leftover:
        raise UnsupportedModelError(
            f"checkpoint {path} has {len(leftover)} tensors the {arch} model does not use, "
            f"e.g. {leftover[:3]}"
        )
    max_len = model.max_position_embeddings
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    info = ModelInfo(
        name=config.model,
        family=model.family,
        architecture=arch,
        path=str(path),
        vocab_size=model.vocab_size,
        max_model_len=max_len,
        eos_token_ids=checkpoint.eos_token_ids,
        bos_token_id=checkpoint.bos_token_id,
        chat_template=checkpoint.chat_template,
        fingerprint=fingerprint,
        num_mtp_layers=getattr(model, "num_mtp_layers", 0),
    )
    return LoadedModel(model=model, tokenizer=checkpoint.tokenizer, info=info, kernels=kernels)


def _read_checkpoint(path: Path, dtype: torch.dtype, keep_quantized: bool) -> Checkpoint:
    if path.suffix == ".gguf":
        from deepserve.engine.loading.gguf_loader import read_gguf

        return read_gguf(path)
    from deepserve.engine.loading.hf_loader import read_hf_folder

    return read_hf_folder(path, dtype, keep_quantized)


def model_fingerprint(config: dict, files: list[Path]) -> str:
    """xxh3-128 over the canonical architecture config and the weight files' bytes (sampled for very
    large checkpoints). Stable across processes and copies; salts prefix-cache keys."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    total = sum(f.stat().st_size for f in files)
    for f in files:
        h.update(f"{f.stat().st_size}".encode())
        with f.open("rb") as fh:
            if total <= _FULL_HASH_LIMIT:
                while chunk := fh.read(16 * _CHUNK):
                    h.update(chunk)
            else:
                _hash_sampled(h, fh, f.stat().st_size)
    return h.hexdigest()


def kv_fingerprint(fingerprint: str, kv_cache_dtype: str) -> str:
    """The model fingerprint a KV cache of `kv_cache_dtype` salts its block keys with: blocks of
    a quantized cache never match (in the device pool, the tiers or a hand-off) those of the
    model's own dtype, nor the reverse. "auto" keeps the model's fingerprint as it is."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if dtype is None:
        return fingerprint
    return xxhash.xxh3_128_hexdigest(f"{fingerprint}|kv={dtype}".encode())


def _hash_sampled(h, fh, size: int, samples: int = 64) -> None:
    for i in range(samples):
        fh.seek(i * max(size - _CHUNK, 0) // max(samples - 1, 1))
        h.update(fh.read(_CHUNK))
