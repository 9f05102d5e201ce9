"""`ShardedWeightStore`: one rank's slices of the checkpoint tensors, under their HF names.

The model class asks for the same names as on one process and gets its rank's rows or columns:
column-parallel matmuls (q/k/v, gate/up) keep their output rows, row-parallel ones (o, down) their
input columns, so a rank's partial outputs sum to the whole (`ModelShard.all_reduce`). Under expert
parallelism local expert j is the checkpoint's expert `experts.start + j`. Slicing happens before
the move to the device, so a rank's device holds only its own part. A GGUF's quantized blocks are
not sliced: a rank's matmuls use the dequantized slice.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.common import Weights, WeightStore, require
from deepserve.engine.parallel.plan import (
    ShardPlan,
    even_ranges,
    llama_head_dim,
    llama_heads,
    mla_heads,
    routed_experts,
)
from deepserve.kernels.quant_panels import QuantizedMatrix

Slice = Callable[[torch.Tensor], torch.Tensor]

_DENSE = re.compile(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj$")


def _rows(r: range, unit: int = 1) -> Slice:
    return lambda t: t[r.start * unit : r.stop * unit]


def _cols(r: range, unit: int = 1) -> Slice:
    return lambda t: t[..., r.start * unit : r.stop * unit]


def _mine(n: int, plan: ShardPlan) -> range:
    return even_ranges(n, plan.size)[plan.rank]


def _column_row(kind: str, plan: ShardPlan) -> Slice:
    """gate/up keep their rows, down its columns, over the same intermediate range."""
    if kind == "down":
        return lambda t: _cols(_mine(t.shape[-1], plan))(t)
    return lambda t: _rows(_mine(t.shape[0], plan))(t)


class _Rules:
    """Name -> slice for one architecture; `source` maps a local expert name to the checkpoint's."""

    def __init__(self, arch: str, config: dict, plan: ShardPlan) -> None:
        self.plan = plan
        self.experts: range | None = None
        self.attention: list[tuple[str, Slice]] = []
        if arch == "LlamaForCausalLM":
            self._llama(config)
        elif arch == "DeepseekV3ForCausalLM":
            self._mla(config)
        else:
            raise UnsupportedModelError(f"tensor parallelism does not support {arch}")

    def _llama(self, c: dict) -> None:
        heads = require(c, "num_attention_heads")
        local = llama_heads(heads, c.get("num_key_value_heads") or heads, self.plan)
        d = llama_head_dim(c)
        kv_rows = torch.tensor([h * d + i for h in local.kv_heads for i in range(d)])
        self.attention = [
            (".self_attn.q_proj.weight", _rows(local.heads, d)),
            (".self_attn.k_proj.weight", lambda t: t[kv_rows]),
            (".self_attn.v_proj.weight", lambda t: t[kv_rows]),
            (".self_attn.o_proj.weight", _cols(local.heads, d)),
        ]

    def _mla(self, c: dict) -> None:
        heads = mla_heads(require(c, "num_attention_heads"), self.plan)
        nope, rope = require(c, "qk_nope_head_dim"), require(c, "qk_rope_head_dim")
        v = require(c, "v_head_dim")
        self.attention = [
            (".self_attn.q_proj.weight", _rows(heads, nope + rope)),
            (".self_attn.q_b_proj.weight", _rows(heads, nope + rope)),
            (".self_attn.kv_b_proj.weight", _rows(heads, nope + v)),
            (".self_attn.o_proj.weight", _cols(heads, v)),
        ]
        if self.plan.expert_parallel and c.get("n_routed_experts"):
            self.experts = routed_experts(c["n_routed_experts"], self.plan)

    def source(self, name: str) -> str:
        m = _EXPERT.search(name)
        if m is None or self.experts is None:
            return name
        return name[: m.start(1)] + str(self.experts.start + int(m.group(1))) + name[m.end(1) :]

    def elsewhere(self, name: str) -> bool:
        """A checkpoint tensor another rank holds (an expert outside this rank's range)."""
        m = _EXPERT.search(name)
        return m is not None and self.experts is not None and int(m.group(1)) not in self.experts

    def slice_for(self, name: str) -> Slice | None:
        for suffix, cut in self.attention:
            if name.endswith(suffix):
                return cut
        if m := _DENSE.search(name):
            return _column_row(m.group(2), self.plan)
        if m := _EXPERT.search(name):
            return None if self.experts is not None else _column_row(m.group(2), self.plan)
        if m := _FUSED_EXPERTS.search(name):
            return self._fused_experts(m.group(1))
        return None  # replicated

    def _fused_experts(self, kind: str) -> Slice:
        """transformers 5's stacked experts: gate_up [E, 2I, H], down [E, H, I]."""
        if self.experts is not None:
            return lambda t: t[self.experts.start : self.experts.stop]
        if kind == "down":
            return lambda t: _cols(_mine(t.shape[-1], self.plan))(t)

        def gate_up(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[1] // 2
            r = _mine(half, self.plan)
            return torch.cat([t[:, r.start : r.stop], t[:, half + r.start : half + r.stop]], 1)

        return gate_up


class ShardedWeightStore(WeightStore):
    def __init__(
        self,
        weights: Weights,
        device: torch.device,
        dtype: torch.dtype,
        arch: str,
        config: dict,
        plan: ShardPlan,
    ) -> None:
        super().__init__(weights, device, dtype)
        self.rules = _Rules(arch, config, plan)

    @property
    def experts(self) -> range | None:
        return self.rules.experts

    def has(self, name: str) -> bool:
        return super().has(self.rules.source(name))

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        src = self.rules.source(name)
        if src not in self._weights:
            raise UnsupportedModelError(f"checkpoint is missing tensor {src!r}")
        self._used.add(src)
        t = self._weights[src]
        cut = self.rules.slice_for(src)
        if cut is not None:
            t = cut(t)
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def get_linear(self, name: str) -> torch.Tensor:
        return self.get(name)  # a rank's weights are read dequantized (loader.py's `keep`)

    def quantized(self, names: list[str]) -> QuantizedMatrix | None:
        return None

    def unused(self) -> list[str]:
        return [n for n in super().unused() if not self.rules.elsewhere(n)]
