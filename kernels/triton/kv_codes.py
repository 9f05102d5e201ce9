"""KV cache elements in and out of Triton kernels: a quantized (e4m3) cache's codes widened as they
are loaded, and values saturated to e4m3's finite range as they are stored (kernels/kv_quant.py
states the scheme; the scales are the model's). For a cache in the model's dtype both are the
plain load and cast. What does not live here: the kernels that call them."""

from __future__ import annotations

from deepserve.kernels.triton.lang import constexpr, jit, tl


@jit
def widen_kv(x, dt: constexpr):
    """KV loaded from a quantized (e4m3) cache, widened to `dt` (through float32, exact: Triton's
    interpreter has no e4m3 -> bfloat16); from any other cache, as loaded."""
    if x.dtype == tl.float8e4nv:
        x = x.to(tl.float32).to(dt)
    return x


@jit
def narrow_kv(x, dt: constexpr):
    """`x` as a cache of element type `dt` stores it: saturated first when `dt` is e4m3 (an
    overflow would otherwise be NaN where the conversion does not saturate)."""
    if dt == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)  # kv_quant.FP8_MAX
    return x.to(dt)
