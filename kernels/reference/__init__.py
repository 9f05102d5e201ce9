"""The reference backend: every op in plain torch, the oracle the other backends are tested
against. Imports nothing native or Triton (tests/test_import_layers.py checks it).

- `ops.py`: linear, rms_norm, softmax, log_softmax, bmm, argmax
- `attention.py`: paged attention over one flattened batch, and the KV-cache write
- `moe_routing.py`: MoE routing composed from torch ops
- `sparse_attention.py`: DeepSeek-V4's sparse attention, lightning-indexer top-k and
  compressor pooling
- `invariant.py`: the same ops with a fixed reduction order (`--batch-invariant` in torch)

`KERNELS` is the reference set: the ops of this package and nothing fused.
"""

from __future__ import annotations

from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.reference import attention, moe_routing, sparse_attention
from deepserve.kernels.reference.ops import argmax, bmm, linear, log_softmax, rms_norm, softmax

__all__ = ["KERNELS", "argmax", "bmm", "linear", "log_softmax", "rms_norm", "softmax"]

KERNELS = KernelSet(
    name="reference",
    linear=linear,
    rms_norm=rms_norm,
    softmax=softmax,
    log_softmax=log_softmax,
    bmm=bmm,
    paged_attention=attention.paged_attention,
    write_kv=attention.write_kv,
    moe_route_composed=moe_routing.route,
    argmax=argmax,
    sparse_attention=sparse_attention.sparse_attention,
    indexer_topk=sparse_attention.indexer_topk,
    compress_pool=sparse_attention.compress_pool,
)
