"""Which `KernelSet` runs: `get_kernels(device, batch_invariant)` picks one at model load, and the
functions below wire each set from its backend and the fallback set under it.

| device | default                               | `--batch-invariant`                          |
| ------ | ------------------------------------- | -------------------------------------------- |
| cpu    | native ops over the reference         | native ops over the torch invariant ops      |
|        | (`cpu_kernels`)                       | (`invariant_cpu_kernels`)                    |
| cuda   | cuBLAS + Triton (`fast_kernels`)      | Triton, fixed tiles (`triton_kernels`)       |

Where the native library is not built, the CPU sets are their fallbacks (the reference set,
`kernels/reference/invariant.py`'s set); without Triton the CUDA default is the reference set.
This is the one module that imports several backends: they import only kernel_set.py and the
shared types, never each other.
"""

from __future__ import annotations

import torch

from deepserve.kernels import reference
from deepserve.kernels.cpu import kernelset as cpu_sets
from deepserve.kernels.cpu import native
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.reference.invariant import invariant_kernels


def get_kernels(device: str | torch.device, batch_invariant: bool) -> KernelSet:
    """The set a model on `device` ("cpu", "cuda", "cuda:N") runs with."""
    if torch.device(device).type == "cuda":
        if batch_invariant:
            return triton_kernels()
        return fast_kernels() or reference.KERNELS
    return invariant_cpu_kernels() if batch_invariant else cpu_kernels()


def cpu_kernels() -> KernelSet:
    """The default CPU set: the native ops over the reference set where the library loads."""
    if not native.load():
        return reference.KERNELS
    return cpu_sets.native_kernels(reference.KERNELS)


def invariant_cpu_kernels() -> KernelSet:
    """`--batch-invariant` on the CPU: the native ops where the library loads (they are invariant
    by construction), over the torch invariant set, which runs alone elsewhere."""
    torch_set = invariant_kernels()
    if not native.load():
        return torch_set
    return cpu_sets.native_invariant_kernels(torch_set)


def fast_kernels() -> KernelSet | None:
    """The CUDA default over the reference set; None without Triton."""
    from deepserve.kernels.triton import kernelset as triton_sets  # imports triton: CUDA only

    return triton_sets.fast_kernels(reference.KERNELS)


def triton_kernels() -> KernelSet:
    """`--batch-invariant` on CUDA; raises KernelUnavailableError without Triton."""
    from deepserve.kernels.triton import kernelset as triton_sets  # imports triton: CUDA only

    return triton_sets.triton_kernels(reference.KERNELS)


def kernels_in_use(device: str) -> str:
    """Which kernels an engine runs: "native" (kernels/cpu/csrc/: the CPU sets, default and
    batch-invariant, when the library loads) or "torch" (torch's own ops; Triton on CUDA).
    Reported on /health."""
    return "native" if device == "cpu" and native.load() else "torch"
