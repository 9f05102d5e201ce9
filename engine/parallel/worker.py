"""Ranks 1..N-1: join the group, load this rank's shard, then run every step rank 0 broadcasts.

A rank owns its KV cache (its heads' share for llama, the whole latent for MLA), sized to rank 0's
block count on the first step. It never samples: logits and the sampler live on rank 0 only.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection

import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.parallel.step import StepMessage


def rank_device(config: EngineConfig, rank: int) -> str:
    """cuda ranks use one GPU each (cuda:rank); the CPU is shared."""
    return f"cuda:{rank}" if torch.device(config.device).type == "cuda" else config.device


def run_rank(rank: int, config: EngineConfig, port: int, threads: int, ready: Connection) -> None:
    """A spawned process's entry point (`launch.py`). Reports 'ready' or the load error on `ready`."""
    from deepserve.engine.parallel.launch import load_shard

    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    try:
        loaded, comm = load_shard(config, rank, port, device)
    except Exception:  # noqa: BLE001 - rank 0 raises it as the load error
        ready.send(traceback.format_exc())
        return
    ready.send("ready")
    try:
        _serve(loaded.model, comm, torch.device(device))
    finally:
        comm.close()


@torch.inference_mode()
def _serve(model, comm, device: torch.device) -> None:
    cache: torch.Tensor | None = None
    while (msg := comm.broadcast(None)) is not None:
        cache = _cache_for(model, msg, cache, device)
        if msg.block_copies:
            src = torch.tensor([s for s, _ in msg.block_copies], device=device)
            dst = torch.tensor([d for _, d in msg.block_copies], device=device)
            cache[:, dst] = cache[:, src]
        model.forward(*msg.on(device), cache)


def _cache_for(
    model, msg: StepMessage, cache: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    if cache is not None and cache.shape[1] == msg.num_blocks:
        return cache
    spec = model.kv_cache_spec
    shape = (spec.num_layers, msg.num_blocks, msg.attn.block_size, spec.width)
    return torch.zeros(shape, dtype=spec.dtype, device=device)
