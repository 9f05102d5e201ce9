"""The rank processes' process group and the one collective the models call.

torch.distributed over a TCP rendezvous on a free 127.0.0.1 port: gloo on the CPU, nccl when the
device is cuda (same code). A second, gloo, group carries rank 0's pickled step messages, so on a
GPU the control traffic never queues behind nccl kernels.

`RankComm.all_reduce` sums the ranks' partial outputs. Plain mode uses the backend's all-reduce,
whose summation order depends on how the backend chunks the tensor (so on the row count) once
there are more than two ranks. Batch-invariant mode all-gathers the partials and adds them in rank
order, `((p0 + p1) + p2) + ...`, on every rank: the same order for every element whatever the batch,
and the same bits on every rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

RENDEZVOUS_TIMEOUT = timedelta(minutes=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class RankComm:
    rank: int
    size: int
    ordered: bool  # batch-invariant: a fixed summation order (module docstring)
    control: object  # the gloo group of the step messages

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if not self.ordered:
            dist.all_reduce(t)
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def broadcast(self, message: object) -> object:
        """Rank 0's `message` on every rank (pickled over the control group)."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(rank: int, size: int, port: int, device: str, ordered: bool) -> RankComm:
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=RENDEZVOUS_TIMEOUT,
    )
    control = dist.new_group(backend="gloo") if backend_for(device) != "gloo" else dist.group.WORLD
    return RankComm(rank, size, ordered, control)
