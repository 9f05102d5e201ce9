"""DeepSeek-V4's fused decode-step ops against the model's torch composition: the hyper-connection
kernels (kernels/triton/hyper_connections.py), sqrtsoftplus / hash routing in the routing
kernel (kernels/triton/routing.py) and the interleaved rope (kernels/triton/rope.py), each
token's result alone vs in its batch, their sm90 builds, and
tiny-deepseek-v4's logits with a set that has these ops against the set without. Runs on CUDA
when there is one, else in Triton's interpreter (float32: its bf16 dot is broken); skipped
without triton."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)
from model_loop import SequenceLoop  # noqa: E402

from deepserve.engine.config import EngineConfig  # noqa: E402
from deepserve.engine.loading.loader import load_model  # noqa: E402
from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4  # noqa: E402
from deepserve.kernels.reference import moe_routing  # noqa: E402
from deepserve.kernels.rope import apply_rope_interleaved  # noqa: E402
from deepserve.kernels.route_spec import RouteSpec  # noqa: E402
from deepserve.kernels.triton import hyper_connections as hc  # noqa: E402
from deepserve.kernels.triton import rope, routing, rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-6, atol=1e-6)
FUSED = ("hc_mixes", "hc_collapse", "hc_expand", "hc_head", "moe_route", "rope_interleaved")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny-deepseek-v4 in float32 composing its hyper-connections and routing from torch ops."""
    torch.set_num_threads(1)
    folder = write_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny-deepseek-v4"), seed=0)
    loaded = load_model(EngineConfig(model=str(folder), device=DEVICE)).model
    loaded.k = dataclasses.replace(loaded.k, **dict.fromkeys(FUSED))  # CUDA sets have them
    return loaded


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _streams(model, tokens: int, seed: int = 0) -> torch.Tensor:
    return _randn(tokens, model.args.hc_mult, model.args.hidden_size, seed=seed)


def _collapse(model, w, h):
    a = model.args
    return hc.hc_collapse(model._hc_mixes(w, h), w.scale, w.base, h, a.hc_sinkhorn_iters, a.hc_eps)


# ---- hyper-connections ---------------------------------------------------------------------


def test_mixes_match_the_models_norm_and_gemm(model):
    h = _streams(model, 5)
    for w in (model.layers[0].attn_hc, model.layers[3].ffn_hc, model.hc_head):
        got = hc.hc_mixes(h, w.fn, model.args.rms_norm_eps)
        torch.testing.assert_close(got, model._hc_mixes(w, h), rtol=1e-5, atol=1e-6)


def test_a_tokens_mixes_do_not_depend_on_the_batch(model):
    h, w, eps = _streams(model, 2 * hc.MIX_BLOCK_M + 3), model.layers[1].ffn_hc, 1e-6
    full = hc.hc_mixes(h, w.fn, eps)
    for t in (0, hc.MIX_BLOCK_M + 1, h.shape[0] - 1):
        assert torch.equal(hc.hc_mixes(h[t : t + 1], w.fn, eps), full[t : t + 1])


def test_mixes_over_more_inputs_than_the_splits_cover_in_one_step():
    k = hc.MIX_SPLITS * hc.MIX_BLOCK_K * 3 + 50  # three 128-steps a run and a ragged end
    h, fn = _randn(3, 1, k, seed=13), _randn(24, k, seed=14)
    # against float64: over 12,338 inputs torch's own float32 product is 4e-4 off on an AMD
    # host's BLAS path (the kernel 6e-5), more than a float32 reference's tolerance
    x = torch.nn.functional.rms_norm(h.flatten(1).double(), (k,), eps=1e-6)
    got = hc.hc_mixes(h, fn, 1e-6).double()
    torch.testing.assert_close(got, x @ fn.double().T, rtol=1e-5, atol=1e-4)


def test_collapse_matches_the_models_composition(model):
    h = _streams(model, 5)
    for w in (model.layers[0].attn_hc, model.layers[3].ffn_hc):
        for got, want in zip(_collapse(model, w, h), model._hc_collapse(w, h), strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_collapse_comb_is_doubly_stochastic_after_sinkhorn(model):
    _, comb, _ = _collapse(model, model.layers[1].attn_hc, _streams(model, 3))
    ones = torch.ones(comb.shape[:2], device=comb.device)
    torch.testing.assert_close(comb.sum(1), ones, rtol=0, atol=1e-4)
    torch.testing.assert_close(comb.sum(2), ones, rtol=0, atol=1e-4)


def test_expand_matches_the_models_composition(model):
    h, out = _streams(model, 5), _randn(5, model.args.hidden_size, seed=1)
    post, comb, _ = model._hc_collapse(model.layers[2].ffn_hc, h)
    want = model._hc_expand(h, out, post, comb)
    torch.testing.assert_close(hc.hc_expand(h, out, post, comb), want, **TOL)


def test_hyper_head_matches_the_models_composition(model):
    h = _streams(model, 4)
    w = model.hc_head
    got = hc.hc_head(model._hc_mixes(w, h), w.scale, w.base, h, model.args.hc_eps)
    torch.testing.assert_close(got, model._hyper_head(h, w), **TOL)


def test_a_tokens_hyper_connection_does_not_depend_on_the_batch(model):
    a, h, w = model.args, _streams(model, 6), model.layers[0].attn_hc
    mixes = model._hc_mixes(w, h)  # the kernels' input (a GEMM outside them)
    full = hc.hc_collapse(mixes, w.scale, w.base, h, a.hc_sinkhorn_iters, a.hc_eps)
    out = _randn(6, model.args.hidden_size, seed=2)
    expanded = hc.hc_expand(h, out, full[0], full[1])
    for t in (0, 5):
        r = slice(t, t + 1)
        alone = hc.hc_collapse(mixes[r], w.scale, w.base, h[r], a.hc_sinkhorn_iters, a.hc_eps)
        for one, batched in zip(alone, full, strict=True):
            assert torch.equal(one, batched[r])
        assert torch.equal(hc.hc_expand(h[r], out[r], full[0][r], full[1][r]), expanded[r])


def test_hidden_wider_than_a_block_spreads_over_programs():
    hidden, n, tokens = hc.BLOCK + 100, 4, 2
    h, mixes = _randn(tokens, n, hidden, seed=3), _randn(tokens, (2 + n) * n, seed=4)
    scale, base = _randn((2 + n) * n, seed=5).abs(), _randn((2 + n) * n, seed=6)
    post, comb, x = hc.hc_collapse(mixes, scale, base, h, 20, 1e-6)
    pre = torch.sigmoid(mixes[:, :n] * scale[:n] + base[:n]) + 1e-6
    torch.testing.assert_close(x, (pre[..., None] * h).sum(1), **TOL)
    out = _randn(tokens, hidden, seed=7)
    want = post[..., None] * out[:, None] + torch.einsum("tij,tih->tjh", comb, h)
    torch.testing.assert_close(hc.hc_expand(h, out, post, comb), want, rtol=1e-5, atol=1e-5)


# ---- routing -------------------------------------------------------------------------------


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    logits = _randn(tokens, experts, seed=seed) * 4
    logits[0, :4] = torch.tensor([-30.0, -17.0, 20.5, 25.0])  # softplus' tails and threshold
    return logits


@pytest.mark.parametrize("experts,top_k", [(8, 2), (256, 6)])
def test_sqrtsoftplus_routing_matches_the_reference(experts, top_k):
    logits = _logits(5, experts, seed=experts)
    bias = _randn(experts, seed=4) * 0.1
    spec = RouteSpec("sqrtsoftplus", 1, 1, top_k, True, 1.5)
    got_w, got_ids = routing.route(logits, bias, spec)
    want_w, want_ids = moe_routing.route(logits, bias, spec)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, **TOL)


def test_sqrtsoftplus_scores_match_torch_softplus_across_its_range():
    logits = torch.linspace(-40, 40, 64, device=DEVICE)[None, :]
    spec = RouteSpec("sqrtsoftplus", 1, 1, 64, False, 1.0)
    weights, ids = routing.route(logits, None, spec)
    want = torch.nn.functional.softplus(logits).sqrt()[0, ids[0]]
    torch.testing.assert_close(weights[0], want, rtol=1e-6, atol=0)


def test_given_experts_get_the_models_hash_routing_weights(model):
    moe, ids = model.layers[0].moe, torch.tensor([3, 17, 99000, 5], device=DEVICE)
    x = _randn(4, model.args.hidden_size, seed=5)
    fused = copy.copy(model)
    fused.k = dataclasses.replace(model.k, moe_route=routing.route)
    got_w, got_ids = fused._route(moe, x, ids)
    want_w, want_ids = model._route(moe, x, ids)
    assert moe.tid2eid is not None and torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, **TOL)


# ---- rope ----------------------------------------------------------------------------------


# the interpreter truncates float32 to bfloat16 where CUDA rounds to nearest: bf16 on CUDA only
ROPE_DTYPES = [torch.float32] + [torch.bfloat16] * (DEVICE == "cuda")


@pytest.mark.parametrize("dtype", ROPE_DTYPES)
def test_interleaved_rope_is_bitwise_the_composition(dtype):
    x = _randn(5, 3, 40, seed=8).to(dtype)[:, :, :36]  # strided rows, 20 dims passed through
    cos, sin = _randn(5, 1, 8, seed=9).to(dtype), _randn(5, 1, 8, seed=10).to(dtype)
    assert torch.equal(rope.rope_interleaved(x, cos, sin), apply_rope_interleaved(x, cos, sin))
    assert torch.equal(rope.rope_interleaved(x, cos, -sin), apply_rope_interleaved(x, cos, -sin))


def test_interleaved_rope_declines_other_layouts():
    x, cos = _randn(5, 3, 16, seed=11), _randn(5, 3, 4, seed=12)  # cos per head
    assert rope.rope_interleaved(x, cos, cos) is None


# ---- the model -----------------------------------------------------------------------------


def test_tiny_v4_logits_with_the_fused_ops_match_the_composed_ones(model):
    """The mixes sum their products in split order and scale after (the composition: scale,
    then cuBLAS's or torch's order); CUDA's fused multiply-adds round apart too."""
    tol = 1e-4
    fused = copy.copy(model)
    fused.k = dataclasses.replace(
        model.k, hc_mixes=hc.hc_mixes, hc_collapse=hc.hc_collapse, hc_expand=hc.hc_expand, hc_head=hc.hc_head,
        moe_route=routing.route, rope_interleaved=rope.rope_interleaved,
        silu_mul=rows.silu_mul,  # the shared expert's clamped SwiGLU in one launch
    )  # fmt: skip
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.vocab_size, (40,), generator=g).tolist()
    decoded = torch.randint(0, model.vocab_size, (3,), generator=g).tolist()
    loops = [SequenceLoop(m, 48) for m in (model, fused)]
    for step in [prompt] + [[t] for t in decoded]:  # a prefill, then decode steps
        want, got = (loop.logits(step) for loop in loops)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# ---- registration --------------------------------------------------------------------------


def test_both_cuda_sets_take_the_hyper_connection_and_routing_kernels():
    from deepserve.kernels import reference
    from deepserve.kernels.triton import kernelset

    for cuda_set in (kernelset.fast_kernels(reference.KERNELS), kernelset.triton_kernels(reference.KERNELS)):  # fmt: skip
        assert (cuda_set.hc_mixes, cuda_set.hc_collapse, cuda_set.hc_expand, cuda_set.hc_head) == (
            hc.hc_mixes, hc.hc_collapse, hc.hc_expand, hc.hc_head,
        )  # fmt: skip
        assert cuda_set.moe_route is routing.route
        assert cuda_set.rope_interleaved is rope.rope_interleaved
    assert reference.KERNELS.hc_collapse is None  # the CPU composes them


# ---- the compiler --------------------------------------------------------------------------

_SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepserve.kernels.triton import hyper_connections as hc, rope, routing

def build(fn, names, types, consts):
    sig = dict(zip(names.split(), types), **{k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

collapse = "mix_ptr scale_ptr base_ptr h_ptr post_ptr comb_ptr x_ptr HIDDEN s_m s_ht s_hn s_xt iters eps"
for mix in (True, False):
    types = ["*fp32"] * 3 + ["*bf16", "*fp32", "*fp32", "*bf16"] + ["i32"] * 6 + ["fp32"]
    build(hc._collapse_kernel, collapse, types, dict(N=4, N_P2=4, MIX=mix, BLOCK=1024))
mixes = "h_ptr fn_ptr part_ptr sq_ptr y_ptr count_ptr T M K steps s_ht s_fm eps"
for h_type in ("*bf16", "*fp32"):
    types = [h_type, "*fp32", "*fp32", "*fp32", "*fp32", "*i32"] + ["i32"] * 6 + ["fp32"]
    consts = dict(SPLITS=32, BLOCK_M=16, BLOCK_K=128, M_P2=32, PRECISION=hc.MIX_PRECISION)
    build(hc._mixes_kernel, mixes, types, consts)
expand = "h_ptr out_ptr post_ptr comb_ptr y_ptr HIDDEN s_ht s_hn s_ot s_yt s_yn"
types = ["*bf16", "*bf16", "*fp32", "*fp32", "*bf16"] + ["i32"] * 6
build(hc._expand_kernel, expand, types, dict(N=4, N_P2=4, BLOCK=256))
route = "logits_ptr bias_ptr fixed_ptr w_ptr ids_ptr E s_l scale"
types = ["*fp32", "*fp32", "*i64", "*fp32", "*i64", "i32", "i32", "fp32"]
for fixed in (True, False):
    consts = dict(E_P2=256, HAS_BIAS=not fixed, SCORING=2, N_GROUP=1, TOPK_GROUP=1, K=6, K_P2=8,
                  NORMALIZE=True, FIXED=fixed)
    build(routing._route_kernel, route, types, consts)
names = "x_ptr cos_ptr sin_ptr y_ptr H s_xn s_xh s_cn s_sn s_yn s_yh"
types = ["*bf16"] * 4 + ["i32"] * 7
consts = dict(PASS=448, PASS_P2=512, HALF=32, HALF_P2=32)
build(rope._rope_interleaved_kernel, names, types, consts)
"""


def test_the_kernels_build_for_hopper():
    """The interpreter runs kernels as Python and misses what only the compiler refuses: the
    hyper-connection kernels (the mixes from bf16 and float32 streams, the collapse with and
    without the Sinkhorn branch), the routing kernel's
    sqrtsoftplus and given-experts variants and the interleaved rope compiled for sm90, without
    the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _SM90_BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
