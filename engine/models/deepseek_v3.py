"""The `deepseek_v3` family: Multi-head Latent Attention (MLA), DeepSeekMoE, and the MTP module;
DeepSeek-V2 (`DeepseekV2ForCausalLM`) is the same model read through `DeepseekV3Args.from_hf_v2`.

MLA: queries through an optional low-rank `q_a -> norm -> q_b`; keys/values through a compressed latent
`kv_a -> norm` (kv_lora_rank) plus one shared rope key (qk_rope_head_dim). The KV cache holds only
`[latent | rope key]` per token per layer. Decode and small chunks attend in the absorbed form: the
no-rope query is mapped into latent space with kv_b's key half (W_UK), attention is MQA over the cached
latent, and the result leaves latent space through kv_b's value half (W_UV). Where the KernelSet has
`flash_prefill`, a chunk of at least `DECOMPRESS_MIN_TOKENS` fresh tokens (engine/models/mla_prefill.py
says why that many) attends in the decompressed form instead: its whole context's latent rows are
gathered and multiplied by kv_b into per-head keys and values, and attention runs per head on tensor
cores (192-dim keys, 128-dim values on V2/V3) rather than over the 576-wide latent.

DeepSeekMoE: shared experts plus routed top-k with group-limited routing (n_group / topk_group),
sigmoid or softmax scores, e_score_correction_bias (selection only), norm_topk_prob and
routed_scaling_factor; the first `first_k_dense_replace` layers use a dense MLP.

MTP (`num_nextn_predict_layers`, stored as layers num_hidden_layers..): enorm(embedding of the next
token) and hnorm(previous hidden) -> eh_proj -> one decoder layer -> shared_head norm. Its KV lives in
the cache slots after the main layers.

DeepSeek-V2 differs in routing only: softmax scores, no correction bias, `topk_method` "greedy"
(plain top-k) or "group_limited_greedy" (the best `topk_group` groups, a group scored by its best
expert); with `norm_topk_prob` the weights are normalized and not scaled, as DeepSeek's own V2
code does (transformers' V2 ignores the flag; every published V2 checkpoint has it false).

Interleaved rope (HF `rope_interleave`, the DeepSeek default) is turned into the half-split layout by
permuting the rope rows of q_b / kv_a once at load time: q.k is unchanged under a shared permutation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.base import KVCacheSpec
from deepserve.engine.models.common import WeightStore, add_rms_norm, require, swiglu
from deepserve.engine.models.kv_scales import read_kv_scales, scaled
from deepserve.engine.models.mla_prefill import (
    DECOMPRESS_MIN_TOKENS,
    DecompressPlan,
    plan_by_role,
    plan_step,
)
from deepserve.engine.parallel.plan import ModelShard
from deepserve.kernels import kv_quant
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.block_quant import Matrix, cat_rows, reorder_rows, stack
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at, yarn_get_mscale
from deepserve.kernels.route_spec import RouteSpec


@dataclass(frozen=True)
class DeepseekV3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    num_mtp_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, c: dict) -> DeepseekV3Args:
        rope = c.get("rope_scaling") or c.get("rope_parameters")
        scoring = c.get("scoring_func", "sigmoid")
        if scoring not in ("sigmoid", "softmax"):
            raise UnsupportedModelError(f"MoE scoring_func {scoring!r} is not supported")
        if c.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=True is not supported for deepseek_v3")
        return cls(
            vocab_size=require(c, "vocab_size"),
            hidden_size=require(c, "hidden_size"),
            intermediate_size=require(c, "intermediate_size"),
            moe_intermediate_size=require(c, "moe_intermediate_size"),
            num_layers=require(c, "num_hidden_layers"),
            num_heads=require(c, "num_attention_heads"),
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=require(c, "kv_lora_rank"),
            qk_nope_head_dim=require(c, "qk_nope_head_dim"),
            qk_rope_head_dim=require(c, "qk_rope_head_dim"),
            v_head_dim=require(c, "v_head_dim"),
            n_routed_experts=c.get("n_routed_experts") or 0,
            n_shared_experts=c.get("n_shared_experts") or 0,
            num_experts_per_tok=c.get("num_experts_per_tok") or 0,
            n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            scoring_func=scoring,
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=c.get("first_k_dense_replace", 0),
            num_mtp_layers=c.get("num_nextn_predict_layers") or 0,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=(rope or {}).get("rope_theta", c.get("rope_theta", 10000.0)),
            rope_scaling=rope
            if rope and rope.get("rope_type", rope.get("type")) != "default"
            else None,
            rope_interleave=bool(c.get("rope_interleave", True)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
        )

    @classmethod
    def from_hf_v2(cls, c: dict) -> DeepseekV3Args:
        """A DeepSeek-V2 config.json (model_type `deepseek_v2`)."""
        method = c.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepSeek-V2 topk_method {method!r} is not supported")
        if c.get("scoring_func", "softmax") != "softmax":
            raise UnsupportedModelError("DeepSeek-V2 routes with softmax scores only")
        grouped = method == "group_limited_greedy"
        # V2 always rotates interleaved pairs (transformers' V2 has no rope_interleave switch)
        args = cls.from_hf(
            dict(
                c,
                scoring_func="softmax",
                rope_interleave=True,
                n_group=c.get("n_group") if grouped else 1,
                topk_group=c.get("topk_group") if grouped else 1,
                num_nextn_predict_layers=0,
            )
        )
        normalize = args.norm_topk_prob and args.num_experts_per_tok > 1
        scale = 1.0 if normalize else args.routed_scaling_factor
        return replace(args, norm_topk_prob=normalize, routed_scaling_factor=scale)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        mscale_all = (self.rope_scaling or {}).get("mscale_all_dim")
        if self.rope_scaling and mscale_all:
            scale *= yarn_get_mscale(self.rope_scaling["factor"], mscale_all) ** 2
        return scale


@dataclass
class _Attention:
    # The two matmuls on the layer's input as one: [q_b (or q_a with a low-rank query) | kv_a]
    x_proj: torch.Tensor  # [q_rows + kv_lora + rope, hidden]
    q_rows: int  # H * qk_head_dim, or q_lora
    q_a_norm: torch.Tensor | None  # None when q_lora_rank is None
    q_b: torch.Tensor | None  # [H * qk_head_dim, q_lora] with a low-rank query
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [H, nope, kv_lora]: no-rope query -> latent space
    w_uv_t: torch.Tensor  # [H, kv_lora, v]: latent -> value space
    o: torch.Tensor
    # [H * (nope + v), kv_lora]: latent -> per-head [k_nope | v] (the decompressed form's matmul);
    # None when the KernelSet has no `flash_prefill`
    kv_b: torch.Tensor | None = None
    # the latent cache's scale (the checkpoint's k_scale, as vLLM reads MLA's), 1.0 unquantized
    kv_scale: float = 1.0


@dataclass
class _Dense:
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class _MoE:
    gate: torch.Tensor  # [E, hidden], float32 (router runs in float32)
    bias: torch.Tensor | None  # [E] e_score_correction_bias, float32
    gate_up: torch.Tensor  # [E, 2 * I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    shared: _Dense | None


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    attn: _Attention
    mlp_norm: torch.Tensor
    mlp: _Dense | _MoE


@dataclass
class _MTP:
    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [hidden, 2 * hidden]
    layer: _Layer
    norm: torch.Tensor  # shared_head.norm
    head: torch.Tensor  # shared_head.head


def _rope_rows_to_half_split(w: Matrix, head_dim: int, rope_dim: int, dtype: torch.dtype) -> Matrix:
    """Reorder the last `rope_dim` rows of every `head_dim`-row head from interleaved pairs
    (x0, x1, x2, x3, ...) to half-split (x0, x2, ..., x1, x3, ...). FP8 weights stay FP8 (the
    rows stay inside their scale blocks) where block_quant.reorder_rows allows."""
    perm = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    order = torch.arange(w.shape[0]).view(-1, head_dim)
    order[:, head_dim - rope_dim :] = order[:, head_dim - rope_dim :][:, perm]
    return reorder_rows(w, order.flatten(), dtype)


class DeepseekV3ForCausalLM:
    family = "deepseek_v3"
    args_from_hf = DeepseekV3Args.from_hf

    def __init__(
        self,
        config: dict,
        weights: WeightStore,
        kernels: KernelSet,
        fingerprint: str,
        parallel: ModelShard | None = None,  # tensor/expert parallel: this rank's share
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype; or e4m3
    ) -> None:
        a = self.args = type(self).args_from_hf(config)
        self.k = kernels
        self.parallel = parallel
        self.fingerprint = fingerprint
        self.vocab_size = a.vocab_size
        self.max_position_embeddings = a.max_position_embeddings
        self.num_mtp_layers = a.num_mtp_layers
        self.device, self.dtype = weights.device, weights.dtype
        width = a.kv_lora_rank + a.qk_rope_head_dim
        kv_dtype = kv_cache_dtype or self.dtype
        self.kv_quantized = kv_quant.is_quantized(kv_dtype)
        self.kv_cache_spec = KVCacheSpec(a.num_layers + a.num_mtp_layers, width, kv_dtype)
        self.scale = a.softmax_scale
        # fresh tokens from which a chunk takes the decompressed form (tests lower it)
        self.decompress_min_tokens = DECOMPRESS_MIN_TOKENS
        self.embed = weights.get("model.embed_tokens.weight")
        self.layers = [self._load_layer(weights, i) for i in range(a.num_layers)]
        self.norm = weights.get("model.norm.weight")
        self.lm_head = weights.get("lm_head.weight")
        self.mtp = [self._load_mtp(weights, a.num_layers + j) for j in range(a.num_mtp_layers)]
        self.rope = build_rope_tables(
            a.qk_rope_head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings, self.device
        )

    # ---- loading -------------------------------------------------------------------------------

    def _load_layer(self, w: WeightStore, i: int) -> _Layer:
        p = f"model.layers.{i}."
        mlp = self._load_moe(w, p + "mlp.") if i >= self.args.first_k_dense_replace else None
        return _Layer(
            attn_norm=w.get(p + "input_layernorm.weight"),
            attn=self._load_attention(w, p + "self_attn."),
            mlp_norm=w.get(p + "post_attention_layernorm.weight"),
            mlp=mlp or self._load_dense(w, p + "mlp."),
        )

    def _load_attention(self, w: WeightStore, p: str) -> _Attention:
        a = self.args
        low_rank = a.q_lora_rank is not None
        # matmul weights as the KernelSet runs them (FP8 kept on a set that runs it); kv_b is
        # read dequantized: its halves W_UK / W_UV are absorbed into bf16 bmm's
        q_b = w.get_linear(p + ("q_b_proj.weight" if low_rank else "q_proj.weight"))
        kv_a = w.get_linear(p + "kv_a_proj_with_mqa.weight")
        if a.rope_interleave:
            q_b = _rope_rows_to_half_split(q_b, a.qk_head_dim, a.qk_rope_head_dim, self.dtype)
            kv_a = _rope_rows_to_half_split(kv_a, kv_a.shape[0], a.qk_rope_head_dim, self.dtype)
        kv_b = w.get(p + "kv_b_proj.weight").view(a.num_heads, -1, a.kv_lora_rank)
        q_x = w.get_linear(p + "q_a_proj.weight") if low_rank else q_b
        return _Attention(
            x_proj=cat_rows([q_x, kv_a], self.dtype),  # one launch where a decode step took two
            q_rows=q_x.shape[0],
            q_a_norm=w.get(p + "q_a_layernorm.weight") if low_rank else None,
            q_b=q_b if low_rank else None,
            kv_a_norm=w.get(p + "kv_a_layernorm.weight"),
            w_uk=kv_b[:, : a.qk_nope_head_dim].contiguous(),
            w_uv_t=kv_b[:, a.qk_nope_head_dim :].transpose(1, 2).contiguous(),
            o=w.get_linear(p + "o_proj.weight"),
            kv_b=kv_b.flatten(0, 1) if self.k.flash_prefill is not None else None,
            kv_scale=read_kv_scales(w, p, self.kv_quantized).k,
        )

    @staticmethod
    def _load_dense(w: WeightStore, p: str) -> _Dense:
        return _Dense(
            gate_up=w.cat_linear([p + "gate_proj.weight", p + "up_proj.weight"]),
            down=w.get_linear(p + "down_proj.weight"),
        )

    def _load_moe(self, w: WeightStore, p: str) -> _MoE:
        a = self.args
        if w.has(p + "experts.gate_up_proj"):  # transformers 5's fused layout, gate rows first
            gate_up = w.get_linear(p + "experts.gate_up_proj")
            down = w.get_linear(p + "experts.down_proj")
        else:
            experts = [self._load_dense(w, f"{p}experts.{e}.") for e in range(a.n_routed_experts)]
            gate_up = stack([e.gate_up for e in experts], self.dtype)
            down = stack([e.down for e in experts], self.dtype)
        bias_name = p + "gate.e_score_correction_bias"
        return _MoE(
            gate=w.get(p + "gate.weight", torch.float32),
            bias=w.get(bias_name, torch.float32) if w.has(bias_name) else None,
            gate_up=gate_up,
            down=down,
            shared=self._load_dense(w, p + "shared_experts.") if a.n_shared_experts else None,
        )

    def _load_mtp(self, w: WeightStore, index: int) -> _MTP:
        p = f"model.layers.{index}."
        own = {n: w.has(p + n) for n in ("embed_tokens.weight", "shared_head.head.weight")}
        return _MTP(
            embed=w.get(p + "embed_tokens.weight") if own["embed_tokens.weight"] else self.embed,
            enorm=w.get(p + "enorm.weight"),
            hnorm=w.get(p + "hnorm.weight"),
            eh_proj=w.get_linear(p + "eh_proj.weight"),
            layer=self._load_layer(w, index),
            norm=w.get(p + "shared_head.norm.weight"),
            head=w.get(p + "shared_head.head.weight")
            if own["shared_head.head.weight"]
            else self.lm_head,
        )

    # ---- forward -------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos, sin = rope_at(self.rope, positions, self.dtype)
        x = self.k.rms_norm(h, self.layers[0].attn_norm, self.args.rms_norm_eps)
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms, strict=True)):
            h, x = self._decoder_layer(layer, h, x, next_norm, cos, sin, attn, kv_cache[i])
        return x

    def forward_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        mtp_index: int = 0,
    ) -> torch.Tensor:
        """One MTP step: `input_ids[t]` is the token after the one whose (final-normed) hidden state
        is `previous_hidden[t]`; returns shared_head-normed hidden states for `compute_mtp_logits`."""
        m, k, eps = self.mtp[mtp_index], self.k, self.args.rms_norm_eps
        e = k.rms_norm(F.embedding(input_ids, m.embed), m.enorm, eps)
        h = k.linear(torch.cat([e, k.rms_norm(previous_hidden, m.hnorm, eps)], dim=-1), m.eh_proj)
        cos, sin = rope_at(self.rope, positions, self.dtype)
        cache = kv_cache[self.args.num_layers + mtp_index]
        x = k.rms_norm(h, m.layer.attn_norm, eps)
        return self._decoder_layer(m.layer, h, x, m.norm, cos, sin, attn, cache)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.k.linear(hidden, self.lm_head).float()

    def compute_mtp_logits(self, hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        return self.k.linear(hidden, self.mtp[mtp_index].head).float()

    def _decoder_layer(
        self,
        layer: _Layer,
        h: torch.Tensor,
        x: torch.Tensor,
        next_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `h` (updated in place where the KernelSet fuses the add) and
        `x = attn_norm(h)` -> the new `h` and `next_norm(h)`: each residual add shares a launch
        with the norm after it."""
        k, eps = self.k, self.args.rms_norm_eps
        delta = self._sum_ranks(self._attention(layer.attn, x, cos, sin, attn, cache))
        h, x = add_rms_norm(k, h, delta, layer.mlp_norm, eps)
        if isinstance(layer.mlp, _MoE):
            delta = self._sum_ranks(self._moe(layer.mlp, x))
        else:
            delta = self._sum_ranks(swiglu(k, x, layer.mlp.gate_up, layer.mlp.down))
        return add_rms_norm(k, h, delta, next_norm, eps)

    def _sum_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """Tensor/expert parallel: every rank's partial output summed (nothing on one process)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)

    def _attention(
        self,
        w: _Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        cache: torch.Tensor,  # [num_blocks, block_size, kv_lora + rope]
    ) -> torch.Tensor:
        a, k, eps = self.args, self.k, self.args.rms_norm_eps
        tokens, heads = x.shape[0], a.num_heads
        projected = k.linear(x, w.x_proj)
        q, ckv = projected[:, : w.q_rows], projected[:, w.q_rows :]
        if w.q_b is not None:
            q = k.linear(k.rms_norm(q, w.q_a_norm, eps), w.q_b)
        q = q.view(tokens, heads, a.qk_head_dim)
        fused = self._write_kv(w, ckv, cos, sin, attn, cache)
        plan = self._decompress_plan(attn)
        if plan is None:
            out = self._absorbed(w, self._absorbed_query(w, q, cos, sin, fused), attn, cache)
        else:
            out = self._split_attention(w, q, cos, sin, fused, plan, cache)
        return k.linear(out.reshape(tokens, heads * a.v_head_dim), w.o)

    def _decompress_plan(self, attn: AttentionMetadata) -> DecompressPlan | None:
        """Which of the step's rows take the decompressed form (mla_prefill.py); None: none."""
        if self.k.flash_prefill is None:
            return None
        if self.k.flash_prefill_by_role:
            return plan_by_role(attn)
        return plan_step(attn, self.decompress_min_tokens)

    @property
    def kv_follows_row_role(self) -> bool:
        """Whether a cached token's KV depends on whether it was a prompt or a generated row
        (the block manager keys blocks past a prompt apart, engine/block_manager.py)."""
        return self.k.flash_prefill is not None and self.k.flash_prefill_by_role

    def _write_kv(
        self,
        w: _Attention,
        ckv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        cache: torch.Tensor,
    ) -> bool:
        """Writes the step's latent rows `[normed latent | rope(k_pe)]` to the cache; True when
        the KernelSet's fused write did (its query ops then take the query's rope part too)."""
        if w.kv_scale == 1.0 and self._fused_kv_write(w, ckv, cos, sin, attn, cache):
            return True  # 1 launch, not ~10; the fused write cannot divide by a scale
        lora, eps = self.args.kv_lora_rank, self.args.rms_norm_eps
        latent = self.k.rms_norm(ckv[:, :lora], w.kv_a_norm, eps)
        k_pe = apply_rope(ckv[:, lora:].unsqueeze(1), cos, sin)
        rows = scaled(torch.cat([latent, k_pe[:, 0]], dim=-1), w.kv_scale)
        self.k.write_kv(cache, attn.slot_mapping, rows)
        return False

    def _absorbed_query(
        self, w: _Attention, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
    ) -> torch.Tensor:
        """The absorbed query `[T, H, lora + rope]`, `[W_UK q_nope | rope(q_pe)]`."""
        a, k = self.args, self.k
        tokens, heads, nope, lora = q.shape[0], a.num_heads, a.qk_nope_head_dim, a.kv_lora_rank
        latent = k.bmm(q[..., :nope].transpose(0, 1), w.w_uk).transpose(0, 1)  # [T, H, lora]
        if not fused:
            return torch.cat([latent, apply_rope(q[..., nope:], cos, sin)], dim=-1)
        q_full = q.new_empty(tokens, heads, lora + a.qk_rope_head_dim)
        if not (
            k.absorbed_query_ is not None
            and k.absorbed_query_(latent, q[..., nope:], cos, sin, q_full)
        ):
            q_full[..., lora:] = self._query_rope(q[..., nope:], cos, sin, fused)
            q_full[..., :lora] = latent
        return q_full

    def _query_rope(
        self, q_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
    ) -> torch.Tensor:
        """rope(q_pe) `[T, H, rope]`, with the ops `_absorbed_query` rotates it with (the same
        bits for a row either way)."""
        if fused:
            out = torch.empty_like(q_pe)
            if self.k.rope_into_(q_pe, cos, sin, out):
                return out
        return apply_rope(q_pe, cos, sin)

    def _absorbed(
        self, w: _Attention, q_full: torch.Tensor, attn: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        """MQA over the cached latent, then out of latent space: `[T, H, v]`. A quantized
        latent's scale is folded into the softmax scale (keys) and the output (values)."""
        k_cache = cache.unsqueeze(2)  # MQA: one latent "head" shared by all query heads
        lora, s = self.args.kv_lora_rank, w.kv_scale
        out = self.k.paged_attention(q_full, k_cache, k_cache[..., :lora], attn, self.scale * s)
        if s != 1.0:
            out = out * s
        return self.k.bmm(out.transpose(0, 1), w.w_uv_t).transpose(0, 1)  # [H, T, v] -> [T, H, v]

    def _split_attention(
        self,
        w: _Attention,
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fused: bool,
        plan: DecompressPlan,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """The plan's rows in the decompressed form (no W_UK product for them), the other rows
        absorbed: `[T, H, v]`."""
        if plan.rows is None:
            return self._decompressed(w, q, cos, sin, fused, plan, cache)
        r, s = plan.rows, plan.short_rows
        long = self._decompressed(w, q[r], cos[r], sin[r], fused, plan, cache)
        out = long.new_empty(q.shape[0], *long.shape[1:])
        out[r] = long
        q_full = self._absorbed_query(w, q[s], cos[s], sin[s], fused)
        out[s] = self._absorbed(w, q_full, plan.short_attn, cache)
        return out

    def _decompressed(
        self,
        w: _Attention,
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fused: bool,
        plan: DecompressPlan,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """The long chunks' rows: their contexts' latent rows decompressed by kv_b into per-head
        `[k_nope | v]`, then causal attention per head (the rope key shared by the heads)."""
        a, heads = self.args, self.args.num_heads
        nope, lora = a.qk_nope_head_dim, a.kv_lora_rank
        keys = kv_quant.index_rows(
            cache.view(-1, cache.shape[-1]), plan.key_slots
        )  # [L, lora+rope]
        keys = kv_quant.dequantize(keys, self.dtype, w.kv_scale)
        kv = self.k.linear(keys[:, :lora], w.kv_b).view(-1, heads, nope + a.v_head_dim)
        k_rope = keys[:, None, lora:].expand(-1, heads, -1)
        q_rope = self._query_rope(q[..., nope:], cos, sin, fused)
        return self.k.flash_prefill(
            q[..., :nope], q_rope, kv[..., :nope], k_rope, kv[..., nope:], plan.varlen, self.scale
        )

    def _fused_kv_write(
        self,
        w: _Attention,
        ckv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        cache: torch.Tensor,
    ) -> bool:
        """The KernelSet's fused MLA ops, when it has both and they take these shapes: True when
        the KV rows were normed, rotated and written (the query's rope part is then rotated
        straight into the absorbed query)."""
        k = self.k
        if k.mla_kv_write_ is None or k.rope_into_ is None:
            return False
        eps = self.args.rms_norm_eps
        return k.mla_kv_write_(ckv, w.kv_a_norm, eps, cos, sin, cache, attn.slot_mapping)

    def _moe(self, w: _MoE, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self._route(w, x)
        if self.parallel is not None:  # expert parallel: other ranks' experts masked out
            weights, experts = self.parallel.own_experts(weights, experts, self.k.moe is not None)
        if self.k.moe is not None:  # all experts in one fused op, no host sync
            shared = (
                None if w.shared is None else swiglu(self.k, x, w.shared.gate_up, w.shared.down)
            )
            return self.k.moe(x, w.gate_up, w.down, weights, experts, add=shared)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            if e < 0:  # held by another rank (expert parallel)
                continue
            rows, slot = torch.where(experts == e)
            y = swiglu(self.k, x[rows], w.gate_up[e], w.down[e])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        if w.shared is not None:
            out = out + swiglu(self.k, x, w.shared.gate_up, w.shared.down)
        return out

    def _route(self, w: _MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token within the best `topk_group` groups -> (weights, ids) [T, k]."""
        a = self.args
        logits = self.k.linear(x.float(), w.gate)
        spec = RouteSpec(
            a.scoring_func, a.n_group, a.topk_group, a.num_experts_per_tok, a.norm_topk_prob,
            a.routed_scaling_factor,
        )  # fmt: skip
        fused = self.k.moe_route(logits, w.bias, spec) if self.k.moe_route is not None else None
        if fused is not None:
            return fused
        return self.k.moe_route_composed(logits, w.bias, spec, self.k.sigmoid, self.k.softmax)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite / Coder-V2: V3's model under V2's routing (see the module docstring).
    Its own family name: V2 checkpoints are served with their own chat template."""

    family = "deepseek_v2"
    args_from_hf = DeepseekV3Args.from_hf_v2
