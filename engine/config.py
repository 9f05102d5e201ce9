"""Engine configuration: frozen dataclasses built once by the CLI and handed down by constructors."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.kvcache.store import DEFAULT_TIMEOUT_S

KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3")  # kernels/kv_quant.py's KV_CACHE_DTYPES
CPU_ISAS = ("avx2", "avx512", "avx512_bf16")  # kernels/cpu/csrc/isa.cpp's paths


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "mtp" | "ngram"
    num_speculative_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    # Per-sequence draft length that backs off when drafts are rejected (spec_decode/throttle.py);
    # False: always draft up to num_speculative_tokens.
    adaptive: bool = True


@dataclass(frozen=True)
class KVTierConfig:
    """KV tiers below the device pool (kvcache/): L1 host RAM and an optional shared L2 store."""

    host_bytes: int = 0  # L1 size; 0 = no host tier
    store_url: str | None = None  # redis://[:password@]host:port/db, rediss://..., or file:///dir
    store_ttl_s: int = 3600  # every L2 entry expires; the store's maxmemory policy evicts sooner
    store_timeout_s: float = DEFAULT_TIMEOUT_S  # connect/read timeout of one L2 socket operation
    store_max_bytes: int = 8 * 2**30  # size cap for a file:// store (Redis uses its maxmemory)
    max_pending_bytes: int = 256 * 2**20  # background offload/write-through queue, each
    # HMAC key of the L2 blocks (kvcache/codec.py): processes sharing a store need the same one.
    # None: a random key of this process, so only it can read what it wrote.
    store_mac_key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # a built-in name or a checkpoint path (HF folder or .gguf file)
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20
    # the device KV cache's element dtype (kernels/kv_quant.py): "auto" the model's dtype,
    # "fp8" / "fp8_e4m3" e4m3 with per-layer scales (the checkpoint's k_scale/v_scale, else 1.0)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill splits above it)
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    batch_invariant: bool = False
    enforce_eager: bool = False  # on CUDA: no decode CUDA graphs (every step launches eagerly)
    # Decode steps launched one step ahead of their sampled ids (engine/async_scheduling.py).
    # None: on where decode steps replay CUDA graphs, off elsewhere (a CPU forward is synchronous).
    async_scheduling: bool | None = None
    # How long requests arriving during decode-only steps may wait for more arrivals before they
    # join a step (engine/scheduler.py). None: PREFILL_GATHER_S where decode steps replay CUDA
    # graphs (a step with a prompt in it is eager and costs about a full step), else 0.
    prefill_gather_s: float | None = None
    # A waiting prompt joins a step already computing prompt tokens only while the step's prompt
    # tokens stay within this (engine/scheduler.py). None: PREFILL_GROUP_TOKENS_CPU on the CPU,
    # no limit elsewhere (a GPU step gains from more rows); 0: no limit.
    prefill_group_tokens: int | None = None
    num_threads: int | None = None  # torch intra-op threads on the CPU; None: torch's default
    # The native CPU kernels' instruction-set path ("avx2", "avx512", "avx512_bf16"; None: the
    # widest this CPU has). A narrower one gives another host's speed and its bits (each path's
    # bits are its own), e.g. an AVX2 laptop's, on an AVX-512 machine.
    cpu_isa: str | None = None
    speculative: SpeculativeConfig | None = None
    kv_tiers: KVTierConfig | None = None  # None: device prefix cache only
    seed: int = 0  # model init seed for generated checkpoints; not the sampling seed
    # Tensor parallelism over this many rank processes (engine/parallel/, docs/parallel.md);
    # expert parallelism splits the routed experts across the same ranks instead of their columns.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of "
                f"{', '.join(KV_CACHE_DTYPE_NAMES)}"
            )
        if self.kv_tiers is not None and not self.enable_prefix_caching:
            # The tiers hold prefix-cache blocks and are found through it: without it they
            # would be built and never used, which looked like a working KV tier.
            raise ValueError(
                "KV tiers (--kv-host-bytes / --kv-store) need prefix caching; "
                "drop --no-prefix-caching or the tier flags"
            )
        if self.cpu_isa is not None and self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"--cpu-isa {self.cpu_isa!r} is not one of {', '.join(CPU_ISAS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            # The ranks' step broadcast carries host input ids.
            raise ValueError("--async-scheduling does not combine with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and (self.kv_tiers or self.speculative):
            # Both read or write rank 0's KV cache (or run the MTP layer) outside the step that
            # rank 0 broadcasts, which the other ranks would never see.
            raise ValueError(
                "--tensor-parallel-size > 1 does not combine with KV tiers or speculative decoding"
            )
