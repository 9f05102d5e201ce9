"""`ParallelModel`: rank 0's model under tensor parallelism, the `CausalLM` the engine drives.

Rank 0 keeps the one scheduler, block manager, sampler and tokenizer. Each forward first
broadcasts the step (`StepMessage`) so ranks 1..N-1 run the same forward on their shards, then runs
rank 0's own shard; the all-reduces inside the layers meet the other ranks'. Only rank 0 computes
logits. Block copies (forked samples) ride along with the next step, which is before any rank reads
them. The runner and engine are the single-process ones: nothing changes for them but the model.
"""

from __future__ import annotations

import torch

from deepserve.engine.parallel.comm import RankComm
from deepserve.engine.parallel.step import StepMessage
from deepserve.kernels.attention_metadata import AttentionMetadata

_JOIN_TIMEOUT_S = 10.0


class ParallelModel:
    def __init__(self, local, comm: RankComm, processes: list) -> None:
        self.local = local  # rank 0's shard of the model
        self.comm = comm
        self.processes = processes
        self.family = local.family
        self.vocab_size = local.vocab_size
        self.max_position_embeddings = local.max_position_embeddings
        self.kv_cache_spec = local.kv_cache_spec  # rank 0's share; every rank has as many blocks
        self.fingerprint = local.fingerprint
        self.tensor_parallel_size = comm.size
        self._copies: list[tuple[int, int]] = []
        self._closed = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("the tensor-parallel ranks were stopped")
        step = StepMessage.build(input_ids, positions, attn, kv_cache.shape[1], self._copies)
        self._copies = []
        self.comm.broadcast(step)
        return self.local.forward(input_ids, positions, attn, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.compute_logits(hidden)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Rank 0 copied these KV blocks; the other ranks copy theirs before the next step."""
        self._copies += copies

    def close(self) -> None:
        """Stop the other ranks (they leave their loop on `None`) and leave the group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.comm.broadcast(None)
        finally:
            for p in self.processes:
                p.join(_JOIN_TIMEOUT_S)
                if p.is_alive():
                    p.terminate()
            self.comm.close()
