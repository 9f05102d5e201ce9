"""Every rank joins the group and loads its shard (`load_shard`, rank 0 included); ranks 1..N-1 then
run every step rank 0 broadcasts (`run_rank`).

The load function comes in from the caller (`ShardLoader`, engine/loading/loader.py's
`load_model`), so parallel/ never imports the loader that starts it.

A rank owns its KV cache (its heads' share for llama, the whole latent for MLA), sized to rank 0's
block count on the first step. It never samples: logits and the sampler live on rank 0 only.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.parallel.comm import RankComm, join_group
from deepserve.engine.parallel.plan import ModelShard, ShardPlan
from deepserve.engine.parallel.step import StepMessage

# (config, this rank's share) -> a loaded model with `.model` (engine/loading/loader.py
# `LoadedModel`). A module-level function, so spawn can pickle it to the ranks it starts.
ShardLoader = Callable[[EngineConfig, ModelShard], Any]


def rank_device(config: EngineConfig, rank: int) -> str:
    """cuda ranks use one GPU each (cuda:rank); the CPU is shared."""
    return f"cuda:{rank}" if torch.device(config.device).type == "cuda" else config.device


def load_shard(
    load: ShardLoader, config: EngineConfig, rank: int, port: int, device: str
) -> tuple[Any, RankComm]:
    """Join the group as `rank` and load that rank's share of the model -> (loaded model, comm)."""
    n = config.tensor_parallel_size
    comm = join_group(rank, n, port, device, ordered=config.batch_invariant)
    plan = ShardPlan(rank, n, config.enable_expert_parallel)
    try:
        loaded = load(replace(config, device=device), ModelShard(plan, comm))
    except BaseException:
        comm.close()
        raise
    return loaded, comm


def run_rank(
    rank: int, config: EngineConfig, port: int, threads: int, ready: Connection, load: ShardLoader
) -> None:
    """A spawned process's entry point (`launch.py`); `load` loads its share. Reports 'ready' or
    the load error on `ready`."""
    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    try:
        loaded, comm = load_shard(load, config, rank, port, device)
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
