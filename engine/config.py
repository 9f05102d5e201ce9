"""Engine configuration: frozen dataclasses built once by the CLI and handed down by constructors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "mtp" | "ngram"
    num_speculative_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # a built-in name or a checkpoint path (HF folder or .gguf file)
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill splits above it)
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    batch_invariant: bool = False
    num_threads: int | None = None  # torch intra-op threads on the CPU; None: torch's default
    speculative: SpeculativeConfig | None = None
    seed: int = 0  # model init seed for generated checkpoints; not the sampling seed
