"""The native CPU fused elementwise ops (kernels/csrc/norm.cpp, rope.cpp, activation.cpp, through
kernels/cpu_ops.py) against the torch ops they replace in the llama decoder layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels import cpu_native, cpu_ops, reference
from deepserve.kernels.attention_ref import write_kv
from deepserve.kernels.rope import apply_rope

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")

HIDDEN = 576  # SmolLM2's width: not a multiple of 16, so the 8-wide tail path runs too


def test_native_rms_norm_matches_torch():
    x, w = torch.randn(7, HIDDEN), torch.randn(HIDDEN)
    out = cpu_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (HIDDEN,), w, 1e-5), atol=1e-5, rtol=1e-5)


def test_native_rms_norm_handles_rows_not_a_multiple_of_eight():
    x, w = torch.randn(3, 37), torch.randn(37)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (37,), w, 1e-6))


def test_add_rms_norm_updates_residual_in_place_and_normalizes_the_sum():
    h, delta, w = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN), torch.randn(HIDDEN)
    want_h = h + delta
    out = cpu_ops.add_rms_norm_(h, delta, w, 1e-6)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out, F.rms_norm(want_h, (HIDDEN,), w, 1e-6), atol=1e-5, rtol=1e-5)


def test_native_ops_decline_bfloat16_and_leave_inputs_alone():
    h = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    before = h.clone()
    assert (
        cpu_ops.add_rms_norm_(h, h.clone(), torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6) is None
    )
    assert torch.equal(h, before)
    assert cpu_ops.silu_mul(h) is None


def test_reference_rms_norm_uses_the_same_values_on_cpu():
    x, w = torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    assert torch.equal(reference.rms_norm(x, w, 1e-5), cpu_ops.rms_norm(x, w, 1e-5))


def test_native_silu_mul_matches_torch():
    gate_up = torch.randn(6, 2 * 1536) * 6  # wide range: exp's large and small arguments
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_native_silu_mul_saturates_without_nan():
    gate_up = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 2.0, 3.0] + [1.0] * 8])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_rope_qk_write_kv_equals_apply_rope_and_write_kv_bitwise():
    tokens, hq, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    cos, sin = torch.randn(tokens, 1, d // 2), torch.randn(tokens, 1, d // 2)
    slots = torch.tensor([0, 17, 18, 40, 63])

    def layer():  # llama's layout: K and V as column slices of one cache layer
        c = torch.zeros(4, 16, 2 * hkv * d)
        return (
            c,
            c[..., : hkv * d].unflatten(-1, (hkv, d)),
            c[..., hkv * d :].unflatten(-1, (hkv, d)),
        )

    want, wk, wv = layer()
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
    write_kv(wk, slots, qk[:, hq:])
    write_kv(wv, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    got, gk, gv = layer()
    fused = qkv.clone()
    assert cpu_ops.rope_qk_write_kv_(fused, cos, sin, gk, gv, slots, hq)
    assert torch.equal(fused[:, : hq * d].view(tokens, hq, d), qk[:, :hq])
    assert torch.equal(got, want)
