"""Count the kernel launches of one tiny-deepseek-v4 decode step on the CPU, as the CUDA sets
would issue them: every torch op that computes (views and empty allocations excluded) is one
launch, and every op the CUDA set runs as a Triton kernel or a cuBLAS call (rms_norm, linear,
bmm, the sparse attention ops, the fused MoE, and with `--fused` the hyper-connection and routing
kernels) is counted once under its KernelSet name, whatever torch does inside it here.

    TRITON_INTERPRET=1 python benchmarks/v4_launches.py [--fused [NAME ...]] [--dtype bfloat16]

Without `--fused` the step composes the hyper-connections and the routing from torch ops (the
CUDA sets before KernelSet.hc_* and sqrtsoftplus routing); with it they run the Triton kernels
in the interpreter. The counts are per step of tiny-deepseek-v4's 4 layers (1 sliding, CSA,
HCA, ...) plus the MTP-free head; the real model's step has the same ops per layer kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.loader import load_model
from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4
from deepserve.kernels import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_loop import SequenceLoop  # noqa: E402

# ops that launch nothing: views, metadata, allocations without a fill
FREE = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "permute",
    "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unflatten", "split", "chunk",
    "split_with_sizes", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
    "_to_copy_noop", "unbind", "flatten", "diagonal", "narrow", "movedim", "numpy_T",
}  # fmt: skip
# KernelSet fields the CUDA sets run as one Triton kernel or cuBLAS call each
OPAQUE = ("linear", "rms_norm", "bmm", "sparse_attention", "indexer_topk", "compress_pool", "moe")
FUSED = ("hc_mixes", "hc_collapse", "hc_expand", "hc_head", "moe_route", "rope_interleaved")


class LaunchCount(TorchDispatchMode):
    """Counts computing aten ops by name; `opaque` ops count once and hide what they run."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.hidden = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = name == "to" and out is args[0]  # a cast to the dtype it has: no copy
        if not self.hidden and name not in FREE and not same:
            self.ops[name] += 1
        return out

    def opaque(self, name: str, fn):
        def call(*args, **kwargs):
            self.ops[f"[{name}]"] += 1
            self.hidden += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.hidden -= 1

        return call


def _moe_by_pairs(x, gate_up, down, weights, ids, add=None, swiglu_limit=None):
    """KernelSet.moe's contract in torch (the CUDA set's fused MoE stands in for it)."""
    gate, up = torch.einsum("tkoh,th->tko", gate_up[ids], x).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    y = torch.einsum("tkhi,tki->tkh", down[ids], torch.nn.functional.silu(gate) * up)
    out = (y * weights[..., None]).sum(dim=1).to(x.dtype)
    return out if add is None else out + add


def _kernels(counter: LaunchCount, fused: tuple[str, ...]):
    ops = {name: getattr(reference.KERNELS, name) for name in OPAQUE[:-1]}
    ops["moe"] = _moe_by_pairs
    if fused:
        from deepserve.kernels.triton import hyper_connections as hc
        from deepserve.kernels.triton import rope, routing

        kernels = dict(hc_mixes=hc.hc_mixes, hc_collapse=hc.hc_collapse, hc_expand=hc.hc_expand)
        kernels["hc_head"] = hc.hc_head
        kernels.update(moe_route=routing.route, rope_interleaved=rope.rope_interleaved)
        ops.update({name: kernels[name] for name in fused})
    wrapped = {name: counter.opaque(name, fn) for name, fn in ops.items()}
    return dataclasses.replace(reference.KERNELS, **wrapped)


def count_decode_step(
    fused: tuple[str, ...], dtype: str = "bfloat16", prompt: int = 40
) -> Counter[str]:
    """Launches of one decode step (forward and logits) after a prompt: the same at any batch
    size, as the step runs one batched path with no per-sequence loop."""
    folder = write_tiny_deepseek_v4(Path(tempfile.mkdtemp()) / "tiny-deepseek-v4", seed=0)
    model = load_model(EngineConfig(model=str(folder), dtype=dtype)).model
    counter = LaunchCount()
    model.k = _kernels(counter, fused)
    loop, g = SequenceLoop(model, prompt + 2), torch.Generator().manual_seed(0)
    loop.hidden(torch.randint(0, model.vocab_size, (prompt,), generator=g).tolist())
    token = [int(torch.randint(0, model.vocab_size, (1,), generator=g))]
    counter.ops.clear()  # the prefill's opaque ops
    with torch.inference_mode(), counter:
        loop.logits(token)
    return counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fused", nargs="*", choices=FUSED, help="all of them without names")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dtype", default="bfloat16", help="the casts follow the model's dtype")
    args = parser.parse_args()
    fused = FUSED if args.fused == [] else tuple(args.fused or ())
    if fused and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--fused runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    ops = count_decode_step(fused, args.dtype)
    print(f"launches per decode step (fused: {', '.join(fused) or 'none'}): {sum(ops.values())}")
    for name, n in ops.most_common(args.top):
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
