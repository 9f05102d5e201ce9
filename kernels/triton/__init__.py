"""Triton kernels for the GPU's batch-invariant mode: one fixed tile configuration per op, so a row's
result never depends on how many rows share the launch.

- `lang.py`: the import shim (these modules import without Triton; kernels are only launched with it)
- `matmul.py`: persistent matmul for `linear` and `bmm` (fixed tiles, no split-K)
- `rows.py`: row-per-program RMSNorm, softmax and log_softmax
- `attention.py`: fixed-split paged attention over the block-table KV cache (prefill and decode alike)
- `kernelset.py`: the `KernelSet` of these kernels
"""
