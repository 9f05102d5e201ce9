"""Triton, when installed: `triton`, `tl`, `jit` and `constexpr` for the kernel modules.

Without Triton (the CPU machines), the kernel modules still import: `jit` leaves functions as plain
Python and `HAVE_TRITON` is False, so only `kernelset.triton_kernels()` refuses to build.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the CPU machines: kernels are defined but never launched
    triton = None
    tl = None
    HAVE_TRITON = False

constexpr = tl.constexpr if HAVE_TRITON else object


def jit(fn=None, **kwargs):
    """`triton.jit` (with its keyword arguments) when Triton is present; otherwise a no-op."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAVE_TRITON else fn


def compiled(kernel) -> bool:
    """Whether `kernel` (a `jit` function) runs compiled for a device, not in Triton's
    interpreter (TRITON_INTERPRET=1 at import): inline assembly only runs compiled."""
    return HAVE_TRITON and isinstance(kernel, triton.runtime.jit.JITFunction)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
