"""The `llama` family (SmolLM2, Llama 2/3): GQA attention with RoPE (llama3 scaling when configured),
RMSNorm, SwiGLU MLP, optionally tied embeddings. `Qwen2ForCausalLM` (Qwen2, DeepSeek-R1-Distill-Qwen)
is the same model with biases on q, k and v; its sliding window is refused (R1-Distill ships it off).

Weights arrive as a dict of HF-named tensors (the loaders translate GGUF names); q/k/v and gate/up are
fused at construction so a layer is four matmuls. KV cache layout per layer: `[K | V]` on the last dim,
each `num_kv_heads * head_dim` wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.base import KVCacheSpec
from deepserve.engine.models.common import WeightStore, add_rms_norm, require, swiglu
from deepserve.engine.models.kv_scales import KVScales, read_kv_scales, scaled
from deepserve.engine.parallel.plan import ModelShard
from deepserve.kernels import kv_quant
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.kernel_set import KernelSet, Weight
from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: dict) -> LlamaArgs:
        heads = require(c, "num_attention_heads")
        hidden = require(c, "hidden_size")
        return cls(
            vocab_size=require(c, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=require(c, "intermediate_size"),
            num_layers=require(c, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 10000.0),
            rope_scaling=c.get("rope_scaling"),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Weight  # [(Hq + 2 Hkv) * D, hidden]
    o: Weight
    mlp_norm: torch.Tensor
    gate_up: Weight  # [2 * I, hidden]
    down: Weight
    # The four matmuls as the KernelSet's `llama_layer_` takes them, when all are packed.
    native: object | None = None
    qkv_bias: torch.Tensor | None = None  # Qwen2: [(Hq + 2 Hkv) * D]
    kv_scales: KVScales = KVScales()  # a quantized cache's (1.0 unquantized)


class LlamaForCausalLM:
    family = "llama"
    qkv_bias = False

    def __init__(
        self,
        config: dict,
        weights: WeightStore,
        kernels: KernelSet,
        fingerprint: str,
        parallel: ModelShard | None = None,  # tensor parallel: this rank's share (engine/parallel/)
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype; or e4m3
    ) -> None:
        a = self.args = LlamaArgs.from_hf(config)
        self.k = kernels
        self.parallel = parallel
        self.fingerprint = fingerprint
        self.vocab_size = a.vocab_size
        self.max_position_embeddings = a.max_position_embeddings
        self.device, self.dtype = weights.device, weights.dtype
        kv_dtype = kv_cache_dtype or self.dtype
        self.kv_quantized = kv_quant.is_quantized(kv_dtype)
        self.kv_cache_spec = KVCacheSpec(a.num_layers, 2 * a.num_kv_heads * a.head_dim, kv_dtype)
        self.scale = a.head_dim**-0.5
        self.embed = weights.get("model.embed_tokens.weight")
        self.layers = [self._load_layer(weights, i) for i in range(a.num_layers)]
        self.norm = weights.get("model.norm.weight")
        tied = a.tie_word_embeddings or not weights.has("lm_head.weight")
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = self.embed if tied else weights.get(head)
        if kernels.pack_weight is not None:
            self._pack_weights(weights, head)
        self._views_key: tuple | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rope = build_rope_tables(
            a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings, self.device
        )

    @staticmethod
    def _matmul_names(i: int) -> dict[str, list[str]]:
        """A layer's matmul weights (fused ones list their parts in order)."""
        p = f"model.layers.{i}."
        return {
            "qkv": [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")],
            "o": [p + "self_attn.o_proj.weight"],
            "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "down": [p + "mlp.down_proj.weight"],
        }

    def _load_layer(self, w: WeightStore, i: int) -> _Layer:
        p = f"model.layers.{i}."
        matmuls = {field: w.cat(names) for field, names in self._matmul_names(i).items()}
        biases = [p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
        return _Layer(
            attn_norm=w.get(p + "input_layernorm.weight"),
            mlp_norm=w.get(p + "post_attention_layernorm.weight"),
            qkv_bias=w.cat(biases) if self.qkv_bias else None,
            kv_scales=read_kv_scales(w, p + "self_attn.", self.kv_quantized),
            **matmuls,
        )

    def _pack_weights(self, w: WeightStore, head: str) -> None:
        """Matmul weights in the KernelSet's packed layout (a no-op where its kernels do not apply),
        with the checkpoint's quantized blocks where it has them. A tied lm_head gets its own
        packed copy: the embedding lookup needs the plain table."""
        pack = self.k.pack_weight
        # the fused layer has no all-reduce between its matmuls, and no biases
        fused_ok = self.parallel is None and not self.qkv_bias
        fuse = self.k.pack_llama_layer if fused_ok else None
        for i, layer in enumerate(self.layers):
            for field, names in self._matmul_names(i).items():
                setattr(layer, field, pack(getattr(layer, field), w.quantized(names)))
            if fuse is not None:
                layer.native = fuse([layer.qkv, layer.o, layer.gate_up, layer.down])
        self.lm_head = pack(self.lm_head, w.quantized([head]))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        a, k = self.args, self.k
        h = F.embedding(input_ids, self.embed)
        cos, sin = rope_at(self.rope, positions, self.dtype)
        views = self._cache_views(kv_cache)
        eps = a.rms_norm_eps
        x = k.rms_norm(h, self.layers[0].attn_norm, eps)
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        for layer, cache, next_norm in zip(self.layers, views, norms, strict=True):
            if layer.native is not None:
                fused = k.llama_layer_(
                    layer.native, h, x, (layer.mlp_norm, next_norm), (cos, sin), cache, attn,
                    a.num_heads, eps, self.scale,
                )  # fmt: skip
                if fused is not None:
                    x = fused
                    continue
            delta = self._sum_ranks(self._attention(layer, x, cos, sin, attn, cache))
            h, x = add_rms_norm(k, h, delta, layer.mlp_norm, eps)
            delta = self._sum_ranks(swiglu(k, x, layer.gate_up, layer.down))
            h, x = add_rms_norm(k, h, delta, next_norm, eps)
        return x

    def _sum_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: every rank's row-parallel output summed (nothing on one process)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        cache: tuple[torch.Tensor, torch.Tensor],  # K and V views [num_blocks, block_size, Hkv, D]
    ) -> torch.Tensor:
        a = self.args
        tokens, hq, hkv, d = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.k.linear(x, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        k_cache, v_cache = cache
        s = layer.kv_scales
        fused = (
            s.unit  # the fused write cannot divide by a scale
            and self.k.rope_qk_write_kv_ is not None
            and self.k.rope_qk_write_kv_(qkv, cos, sin, k_cache, v_cache, attn.slot_mapping, hq)
        )
        if fused:
            q = qkv[:, : hq * d].view(tokens, hq, d)
        else:
            qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
            q = qk[:, :hq]
            v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
            self.k.write_kv(k_cache, attn.slot_mapping, scaled(qk[:, hq:], s.k))
            self.k.write_kv(v_cache, attn.slot_mapping, scaled(v, s.v))
        # a quantized cache's scales: K's folded into the softmax scale, V's into the output
        out = self.k.paged_attention(q, k_cache, v_cache, attn, self.scale * s.k)
        if s.v != 1.0:
            out = out * s.v
        return self.k.linear(out.reshape(tokens, hq * d), layer.o)

    def _cache_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V views of the engine's cache tensor, rebuilt only when the tensor changes
        (saves a handful of view ops per layer per step)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._views_key != key:
            hkv, d = self.args.num_kv_heads, self.args.head_dim
            self._views = [
                (
                    c[..., : hkv * d].unflatten(-1, (hkv, d)),
                    c[..., hkv * d :].unflatten(-1, (hkv, d)),
                )
                for c in kv_cache.unbind(0)
            ]
            self._views_key = key
        return self._views

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.k.linear(hidden, self.lm_head).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / R1-Distill-Qwen: Llama with q/k/v biases."""

    family = "qwen2"
    qkv_bias = True

    def __init__(self, config: dict, *args, **kwargs) -> None:
        if config.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
        super().__init__(config, *args, **kwargs)
