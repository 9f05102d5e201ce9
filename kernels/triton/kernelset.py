"""The `KernelSet` of Triton kernels that `--batch-invariant` runs with on CUDA."""

from __future__ import annotations

import torch

from deepserve.kernels.errors import KernelUnavailableError
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.triton import attention, matmul, rows
from deepserve.kernels.triton.lang import HAVE_TRITON


def triton_kernels() -> KernelSet:
    if not HAVE_TRITON:
        raise KernelUnavailableError("--batch-invariant on a CUDA device needs the triton package")
    return KernelSet(
        name="batch_invariant_triton",
        linear=matmul.linear,
        rms_norm=rows.rms_norm,
        softmax=rows.softmax,
        log_softmax=rows.log_softmax,
        bmm=matmul.bmm,
        paged_attention=attention.TritonPagedAttention(),
        sigmoid=torch.sigmoid,  # CUDA elementwise ops compute every element the same way
    )
