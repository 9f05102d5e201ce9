"""Start N ranks: spawn ranks 1..N-1 (torch.multiprocessing, spawn), join the group as rank 0,
load every rank's shard at once, and hand the engine rank 0's `ParallelModel`.

The caller passes the function that loads one rank's share (engine/loading/loader.py's
`load_model`); this package never imports the loader."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.parallel.comm import RankComm, free_port
from deepserve.engine.parallel.driver import ParallelModel
from deepserve.engine.parallel.worker import ShardLoader, load_shard, rank_device, run_rank

_READY_POLL_S = 1.0


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of ranks 1..N-1: `num_threads` when given, else an equal share of the cores
    (rank 0's own count is the engine's ThreadPolicy's)."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def load_parallel_model(config: EngineConfig, load: ShardLoader):
    """Rank 0's loaded model, its `.model` the `ParallelModel` driving every rank; `load` loads
    one rank's share (in this process for rank 0, in each spawned one for the others)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    processes, pipes = [], []
    for rank in range(1, config.tensor_parallel_size):
        receive, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=run_rank,
            args=(rank, config, port, rank_threads(config), send, load),
            name=f"deepserve-rank{rank}",
            daemon=True,
        )
        p.start()
        send.close()
        processes.append(p)
        pipes.append(receive)
    try:
        device = rank_device(config, 0)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        loaded, comm = load_shard(load, config, 0, port, device)
        _wait_ready(processes, pipes)
    except BaseException:
        for p in processes:
            p.terminate()
        raise
    return replace(loaded, model=ParallelModel(loaded.model, comm, processes))


def _wait_ready(processes: list, pipes: list) -> None:
    for rank, (p, pipe) in enumerate(zip(processes, pipes, strict=True), start=1):
        while not pipe.poll(_READY_POLL_S):
            if not p.is_alive():
                raise UnsupportedModelError(f"tensor-parallel rank {rank} exited while loading")
        status = pipe.recv()
        if status != "ready":
            raise UnsupportedModelError(f"tensor-parallel rank {rank} failed to load:\n{status}")


__all__ = ["RankComm", "load_parallel_model"]
