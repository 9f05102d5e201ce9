"""The native CPU fused elementwise ops (kernels/cpu/csrc/norm.cpp, rope.cpp, activation.cpp,
through kernels/cpu/ops.py) against the torch ops they replace in the llama decoder layer, on
float32 and bfloat16 rows, and the linear's bfloat16 output (kernels/cpu/csrc/linear.cpp)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu import ops as cpu_ops
from deepserve.kernels.cpu.packed import ONEDNN_MIN_ROWS, pack_linear_weight
from deepserve.kernels.reference.attention import write_kv
from deepserve.kernels.reference.ops import rms_norm as reference_rms_norm
from deepserve.kernels.registry import cpu_kernels
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


def test_native_ops_decline_mixed_or_other_dtypes_and_leave_inputs_alone():
    h = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    before = h.clone()
    assert (
        cpu_ops.add_rms_norm_(h, h.float(), torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6) is None
    )
    assert cpu_ops.rms_norm(h, torch.ones(HIDDEN), 1e-6) is None
    assert torch.equal(h, before)
    assert cpu_ops.silu_mul(h.half()) is None


def test_default_cpu_rms_norm_uses_the_same_values_on_cpu():
    x, w = torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    assert torch.equal(cpu_kernels().rms_norm(x, w, 1e-5), cpu_ops.rms_norm(x, w, 1e-5))


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


def _bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _mostly_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 rounding of the reference everywhere, and its very bits almost everywhere:
    the kernels round where torch's bf16 ops round, and differ only where a float32 value that
    differs in its last bits (a sum in another order, exp's polynomial) falls on the other side
    of a bf16 rounding boundary."""
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
    assert (got == want).float().mean() > 0.99


def test_bfloat16_rms_norm_rounds_as_the_reference():
    x, w = _bf16(7, HIDDEN, seed=1, scale=3), _bf16(HIDDEN, seed=2)
    _mostly_bitwise(cpu_ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


def test_bfloat16_add_rms_norm_stores_torchs_bfloat16_sum_and_normalizes_it():
    h, delta, w = _bf16(5, HIDDEN, seed=3), _bf16(5, HIDDEN, seed=4), _bf16(HIDDEN, seed=5)
    want_h = h + delta
    out = cpu_ops.add_rms_norm_(h, delta, w, 1e-6)
    assert torch.equal(h, want_h)
    _mostly_bitwise(out, reference_rms_norm(want_h, w, 1e-6))


def test_bfloat16_silu_mul_rounds_as_torchs_silu_then_multiply():
    gate_up = _bf16(6, 2 * 1536, seed=6, scale=6)
    gate, up = gate_up.chunk(2, dim=-1)
    _mostly_bitwise(cpu_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_bfloat16_rope_qk_write_kv_equals_apply_rope_and_write_kv_bitwise():
    tokens, hq, hkv, d = 6, 9, 3, 64
    qkv = _bf16(tokens, (hq + 2 * hkv) * d, seed=7)
    cos, sin = _bf16(tokens, 1, d // 2, seed=8), _bf16(tokens, 1, d // 2, seed=9)
    slots = torch.tensor([0, 17, 18, 40, 63, 5])
    want_k, want_v = torch.zeros(2, 4, 16, hkv, d, dtype=torch.bfloat16)
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
    write_kv(want_k, slots, qk[:, hq:])
    write_kv(want_v, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    got_k, got_v = torch.zeros(2, 4, 16, hkv, d, dtype=torch.bfloat16)
    fused = qkv.clone()
    assert cpu_ops.rope_qk_write_kv_(fused, cos, sin, got_k, got_v, slots, hq)
    assert torch.equal(fused[:, : hq * d].view(tokens, hq, d), qk[:, :hq])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


ISAS = cpu_native.supported_isas() if cpu_native.load() else []


@pytest.mark.parametrize("width", [HIDDEN, HIDDEN + 8 + 5])  # 16-lane steps, then 8, then 1
def test_bfloat16_elementwise_ops_give_the_same_bits_on_every_isa_path(width):
    x, d, w = _bf16(9, width, seed=12, scale=3), _bf16(9, width, seed=13), _bf16(width, seed=14)
    gate_up = _bf16(9, 2 * width, seed=15, scale=6)

    def run():
        h = x.clone()
        return [cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.add_rms_norm_(h, d, w, 1e-5), h]

    results = {}
    for isa in ISAS:
        with cpu_native.use_isa(isa):
            results[isa] = [*run(), cpu_ops.silu_mul(gate_up)]
    for isa, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, results["avx2"], strict=True)), isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [0, 1, 13, 200])
def test_bfloat16_output_linear_has_the_bits_of_the_float32_output_cast(isa, rows):
    from deepserve.kernels.cpu.packed import pack_panels

    w, x = _bf16(200, 577, seed=10), _bf16(rows, 577, seed=11)  # odd K, N off the panel width
    with cpu_native.use_isa(isa):
        want = cpu_native.op("linear")(x, pack_panels(w), 200).bfloat16()
        got = cpu_native.op("linear_bf16")(x, pack_panels(w), 200)
    assert torch.equal(got, want)


def _tiny_llama(seed: int, dtype: torch.dtype = torch.float32, onednn: bool = False):
    """A 2-layer llama with random weights; the matmuls also carry Q4_1 blocks, as a GGUF's do
    (which only a float32 model keeps)."""
    from gguf import GGMLQuantizationType, quants

    from deepserve.engine.loading.gguf_format import dequantize
    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.llama import LlamaForCausalLM
    from deepserve.kernels.quant_panels import QuantizedMatrix

    config = {
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (96, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
        }
        for n, rows in [("q", 64), ("k", 32), ("v", 32), ("o", 64)]:
            shapes[p + f"self_attn.{n}_proj.weight"] = (rows, 64)
        shapes |= {p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64)}
        shapes[p + "mlp.down_proj.weight"] = (64, 128)
    weights, blocks = {}, {}
    for name, shape in shapes.items():
        w = torch.randn(*shape, generator=g) * 0.2 + (1.0 if len(shape) == 1 else 0.0)
        if len(shape) == 2 and "embed" not in name:
            q = quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1)
            raw = torch.from_numpy(q).view(torch.uint8).reshape(shape[0], -1)
            blocks[name] = QuantizedMatrix("Q4_1", raw, shape[1])
            w = dequantize(raw.reshape(-1), GGMLQuantizationType.Q4_1, shape)
        weights[name] = w
    store = WeightStore(weights, torch.device("cpu"), dtype, blocks)
    kernels = replace(cpu_kernels(), pack_weight=partial(pack_linear_weight, onednn=onednn))
    return LlamaForCausalLM(config, store, kernels, "test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_llama_layer_gives_the_bits_of_the_op_by_op_layer(monkeypatch, dtype):
    """Prefill chunks and decode steps (float32: few rows read the quantized blocks, more the
    float32 panels; bfloat16: bf16 panels, bf16 rows and cache)."""
    from model_loop import SequenceLoop

    native_runs = []

    def counted(*args, **kwargs):
        out = llama_layer_(*args, **kwargs)
        native_runs.append(out is not None)
        return out

    llama_layer_ = cpu_ops.llama_layer_
    monkeypatch.setattr(cpu_ops, "llama_layer_", counted)
    fused, plain = _tiny_llama(0, dtype), _tiny_llama(0, dtype)
    assert all(layer.native is not None for layer in fused.layers)
    for layer in plain.layers:
        layer.native = None
    runs = [SequenceLoop(m, 64) for m in (fused, plain)]
    for chunk in ([5, 17, 3, 90, 41, 8, 8, 2, 60, 33, 12], [7], [70, 1, 2], [9]):
        got, want = (run.hidden(chunk) for run in runs)
        assert torch.equal(got, want), chunk
    assert torch.equal(runs[0].cache, runs[1].cache)
    assert native_runs == [True] * 8  # 2 layers x 4 calls, all native


def test_the_fused_layer_never_runs_weights_the_flag_sends_through_onednn():
    """Under `--batch-invariant` on AMX every bf16 call of a weight with oneDNN's copy goes
    through it (`onednn_chunk`): the fused layer's native linears would give other bits."""
    ws = [
        replace(
            pack_linear_weight(torch.randn(32, 32).bfloat16()),
            onednn=torch.empty(1),
            onednn_chunk=32,
        )
        for _ in range(4)
    ]
    assert cpu_ops.pack_llama_layer(ws).max_rows == 0


def test_the_fused_layer_leaves_steps_past_its_rows_to_the_ops_where_weights_keep_onednn_copies():
    """bf16 weights with oneDNN's copies (the default set on AMX CPUs): a decode-sized step runs
    the fused layer, a prefill-sized one runs op by op so its linears take oneDNN's GEMM."""
    from model_loop import SequenceLoop

    model = _tiny_llama(0, torch.bfloat16, onednn=True)
    assert all(layer.native.max_rows == ONEDNN_MIN_ROWS - 1 for layer in model.layers)
    calls = []
    original = model.k.llama_layer_

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out)
        return out

    model.k = replace(model.k, llama_layer_=counted)
    run = SequenceLoop(model, 64)
    run.hidden(list(range(ONEDNN_MIN_ROWS)))  # a prefill chunk
    run.hidden(list(range(ONEDNN_MIN_ROWS - 1)))  # a step of fewer rows
    assert [c is not None for c in calls] == [False, False, True, True]


def test_native_argmax_matches_torch_on_logit_rows():
    x = torch.randn(16, 49152)
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))


def test_native_argmax_picks_the_first_of_tied_maxima_like_torch():
    x = torch.full((3, 37), -1.0)
    x[0, [5, 30]] = 2.0  # vector part
    x[1, [33, 35]] = 2.0  # scalar tail
    x[2, 4], x[2, 9] = -0.0, 0.0  # equal values: the lower index wins
    assert cpu_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist() == [5, 33, 4]


def test_native_argmax_treats_nan_as_the_maximum_and_takes_all_minus_inf_rows():
    x = torch.randn(3, 50)
    x[0, [12, 40]] = float("nan")
    x[1, 47] = float("nan")  # in the tail
    x[2] = float("-inf")
    assert cpu_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist() == [12, 47, 0]


def test_native_argmax_reads_a_column_slice_of_wider_rows():
    wide = torch.randn(4, 100)
    x = wide[:, :90]
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
