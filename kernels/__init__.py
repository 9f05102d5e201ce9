"""Numerics as pure functions of tensors, no engine state. Models and the sampler reach them through
one `KernelSet` (kernel_set.py), which registry.py picks for a device and `--batch-invariant`.

Backends, each a sub-package that imports only kernel_set.py and the shared modules below, never
another backend:
- `reference/`: every op in plain torch, the oracle (and the flag's torch set, invariant.py)
- `cpu/`: the native C++ ops (csrc/), their build and loader, the packed linear weights
- `triton/`: Triton kernels for CUDA

Shared by all (plain types and pure torch helpers): attention_metadata.py (`AttentionMetadata`),
route_spec.py (`RouteSpec`), errors.py, rope.py (rotary tables and the rotation), random.py
(the sampler's hashed noise), quant_panels.py (GGUF blocks and their panel layout), block_quant.py
(FP8 / MXFP4 block-scaled weights as the GPU kernels take them, and their torch dequantization).

A new backend (FP8 or MXFP4 matmuls, DeepSeek-V4's attention kernels, a library such as
DeepGEMM) goes in the same way: a sub-package with its ops and a function that builds its
KernelSet over a base set it is given (as `triton/kernelset.py` does); a new op is a new
KernelSet field with its reference in `reference/`; registry.py alone decides where it runs.
"""
