"""The native CPU backend: deepserve's C++ kernels (csrc/) on torch's thread pool.

- `native.py`: builds and loads the library (`python -m deepserve.kernels.cpu.native`)
- `packed.py`: `PackedWeight`, the native linear's packed weights, and the linear over them
- `ops.py`: the other native ops as Python calls, each saying when it does not cover a call
- `kernelset.py`: the default and `--batch-invariant` CPU sets, each over a fallback set

Imports no other backend: kernels/registry.py hands each set its fallback.
"""
