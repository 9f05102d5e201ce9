"""Numerics as pure functions of tensors: a torch reference for every op (the CPU path and the test
oracle), batch-invariant variants, and Triton kernels for the GPU. No engine state lives here."""
