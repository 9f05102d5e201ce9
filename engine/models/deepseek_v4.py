"""The `deepseek_v4` family: hybrid sliding-window / compressed attention over one latent K=V head,
hyper-connections, and sqrtsoftplus / hash-routed MoE.

Attention: queries through `wq_a -> q_norm -> wq_b` and a per-head unweighted norm; one shared
latent head (head_dim) is both key and value, its last `rope_dim` dims rotated (interleaved pairs)
and rotated back on the output before the grouped low-rank output projection (`wo_a` per group of
heads, then `wo_b`). Each head has a sink logit in its softmax. Every layer attends to its sliding
window; a CSA layer also to the `index_topk` compressed entries (one per `ratio` = 4 tokens, from
overlapping gated windows) its lightning indexer picks, an HCA layer to all its entries (one per
128 tokens). Sliding layers rotate with `rope_theta`; compressed layers, their entries and the
indexer with `compress_rope_theta` and the checkpoint's YaRN scaling.

Hyper-connections: the residual is `hc_mult` streams; around each block a learned map collapses
them into the block's input (`pre`), spreads its output back (`post`) and mixes the streams through
a Sinkhorn-normalised matrix (`comb`); a hyper head collapses them before the final norm.

MoE: sqrtsoftplus scores, a correction bias for the choice only, normalised top-k weights times
`routed_scaling_factor`, one shared expert; SwiGLU with clamped gate/up (`swiglu_limit`). The first
layers route by a fixed token -> experts table (`tid2eid[input_ids]`).

MTP (`num_nextn_predict_layers`, `mtp.{j}.*`): the token's embedding (enorm, e_proj) is added to
every stream of the previous position's hidden streams (hnorm per stream, h_proj), one decoder
block runs over them in the MTP's own KV slot, and its hyper head, norm and the shared head give
the draft's logits. So `forward` returns the streams before the hyper head (`[T, hc_mult *
hidden]`): the MTP drafter reads them, `compute_logits` collapses them.

Every step, prefill, chunk, decode or a mix, runs one batched path: the keys each token reads
are slot lists built on the device (deepseek_v4_cache.py's `StepPlan`, which also names the KV
rows) and attended by the KernelSet's `sparse_attention` / `indexer_topk` / `compress_pool`, with
no loop over sequences and no host sync, so decode steps may replay from CUDA graphs. Weights:
the published layout (engine/testmodels/deepseek_v4_layout.py names it). Matmul weights are read
as the KernelSet runs them (`WeightStore.get_linear`): a published V4 checkpoint (FP8 dense
projections, MXFP4 routed experts) stays quantized on a set that runs those formats, and is
dequantized at load on the others; `wo_a` stays FP8 only where the set has a grouped FP8
linear (see `_load_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.base import KVCacheSpec
from deepserve.engine.models.common import WeightStore, require
from deepserve.engine.models.deepseek_v4_cache import KVRow, StepPlan, kv_row, row_layout
from deepserve.engine.models.deepseek_v4_config import (
    CSA,
    HCA,
    SLIDING,
    compress_rate,
    layer_types,
    mlp_layer_types,
    mtp_layer_type,
)
from deepserve.engine.parallel.plan import ModelShard
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.block_quant import Matrix, stack
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.rope import apply_rope_interleaved, rope_inv_freq
from deepserve.kernels.route_spec import RouteSpec

F32 = torch.float32


@dataclass(frozen=True)
class DeepseekV4Args:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    hash_layers: tuple[bool, ...]
    compress_rates: dict[str, int]
    sliding_window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float | None
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    compress_rope_scaling: dict | None
    max_position_embeddings: int
    mtp_layer_types: tuple[str, ...]

    @classmethod
    def from_hf(cls, c: dict) -> DeepseekV4Args:
        head_dim = require(c, "head_dim")
        rope_dim = c.get("qk_rope_head_dim") or int(
            head_dim * (c.get("partial_rotary_factor") or 0.125)
        )
        kinds = layer_types(c)
        if c.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise UnsupportedModelError(f"MoE scoring_func {c['scoring_func']!r} is not supported")
        return cls(
            vocab_size=require(c, "vocab_size"),
            hidden_size=require(c, "hidden_size"),
            moe_intermediate_size=require(c, "moe_intermediate_size"),
            num_layers=require(c, "num_hidden_layers"),
            num_heads=require(c, "num_attention_heads"),
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=require(c, "q_lora_rank"),
            o_groups=require(c, "o_groups"),
            o_lora_rank=require(c, "o_lora_rank"),
            layer_types=tuple(kinds),
            hash_layers=tuple(t == "hash_moe" for t in mlp_layer_types(c)),
            compress_rates={kind: compress_rate(c, kind) for kind in (CSA, HCA)},
            sliding_window=require(c, "sliding_window"),
            index_heads=c.get("index_n_heads", 64),
            index_head_dim=c.get("index_head_dim", 128),
            index_topk=c.get("index_topk", 512),
            hc_mult=c.get("hc_mult", 4),
            hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
            hc_eps=c.get("hc_eps", 1e-6),
            n_routed_experts=require(c, "n_routed_experts"),
            n_shared_experts=c.get("n_shared_experts", 1),
            num_experts_per_tok=require(c, "num_experts_per_tok"),
            scoring_func=c.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            swiglu_limit=c.get("swiglu_limit"),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 10000.0),
            compress_rope_theta=c.get("compress_rope_theta", 160000.0),
            compress_rope_scaling=_compress_rope_scaling(c),
            max_position_embeddings=c.get("max_position_embeddings", 1048576),
            mtp_layer_types=tuple(
                mtp_layer_type(c, j) for j in range(c.get("num_nextn_predict_layers") or 0)
            ),
        )


def _compress_rope_scaling(c: dict) -> dict | None:
    """The compressed branch's YaRN settings (`rope_scaling`, or transformers' nested
    `rope_parameters["compress"]`). V4 does not scale cos/sin by YaRN's mscale: the attention
    factor is 1 unless the checkpoint names one."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope = rope.get("compress", rope)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    return {"attention_factor": 1.0, **rope, "rope_type": kind}


ROPE_BLOCK = 4096  # positions per block of the cos/sin table, each computed as one fixed shape


class _Rope:
    """cos/sin by position from a table grown in blocks of ROPE_BLOCK positions: a position's
    values are computed once, in a tensor of one fixed shape, so their bits never depend on the
    step (a CPU elementwise loop rounds its tail elements differently)."""

    def __init__(self, inv_freq: torch.Tensor, factor: float) -> None:
        self.inv_freq, self.factor = inv_freq, factor  # [rope_dim // 2] float32
        self.cos = self.sin = inv_freq.new_empty(0, inv_freq.shape[0])
        # the tables cast to each dtype asked for, so a step gathers without a cast launch
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(
        self, positions: torch.Tensor, upto: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, 1, rope_dim // 2]` in `dtype`, broadcast over heads; every position is
        below `upto` (a host value, so growing the table costs no sync)."""
        if self.cos.shape[0] < upto:
            self._grow(upto)
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[positions][:, None], sin[positions][:, None]

    def _grow(self, upto: int) -> None:
        cos, sin = [self.cos], [self.sin]
        for start in range(self.cos.shape[0], upto, ROPE_BLOCK):
            pos = torch.arange(start, start + ROPE_BLOCK, device=self.inv_freq.device).float()
            freqs = pos[:, None] * self.inv_freq[None, :]
            cos.append(freqs.cos() * self.factor)
            sin.append(freqs.sin() * self.factor)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)
        self._cast.clear()


@dataclass
class _HyperConnection:
    fn: torch.Tensor  # [(2 + n) * n, n * hidden] float32
    base: torch.Tensor  # [(2 + n) * n] float32
    # [(2 + n) * n] float32: the checkpoint's pre, post and comb scales ([3]; the hyper head's
    # [1], pre only) spread over the mixes' columns, so all are scaled and shifted in two ops
    scale: torch.Tensor


@dataclass
class _Compressor:
    """Gated pooling of `ratio` tokens into one entry; with `series` 2 (CSA) entry g pools group
    g-1's first series and group g's second. `kv`/`gate`/`out` are its cache columns."""

    wkv: Matrix  # [series * dim, hidden]
    wgate: Matrix
    ape: torch.Tensor  # [ratio, series * dim] float32, added to the gate by position in group
    norm: torch.Tensor  # [dim]
    ratio: int
    series: int
    kv: slice
    gate: slice
    out: slice


@dataclass
class _Indexer:
    wq_b: Matrix  # [heads * dim, q_lora]
    weights_proj: Matrix  # [heads, hidden]
    compressor: _Compressor


@dataclass
class _Attention:
    kind: str
    row: KVRow
    wq_a: Matrix
    q_norm: torch.Tensor
    wq_b: Matrix
    wkv: Matrix
    kv_norm: torch.Tensor
    wo_a: Matrix  # [groups * o_lora, heads * head_dim / groups]
    wo_b: Matrix
    sinks: torch.Tensor  # [heads] float32
    compressor: _Compressor | None
    indexer: _Indexer | None


@dataclass
class _MoE:
    gate: torch.Tensor  # [E, hidden] float32
    bias: torch.Tensor | None  # [E] float32 correction bias (learned routing)
    tid2eid: torch.Tensor | None  # [vocab, k] int64 (hash routing)
    gate_up: Matrix  # [E, 2 * I, hidden]
    down: Matrix  # [E, hidden, I]
    shared_gate_up: Matrix
    shared_down: Matrix


@dataclass
class _Layer:
    attn_hc: _HyperConnection
    attn_norm: torch.Tensor
    attn: _Attention
    ffn_hc: _HyperConnection
    ffn_norm: torch.Tensor
    moe: _MoE


@dataclass
class _MTP:
    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    e_proj: Matrix
    h_proj: Matrix
    layer: _Layer
    hc_head: _HyperConnection
    norm: torch.Tensor
    head: torch.Tensor


class DeepseekV4ForCausalLM:
    family = "deepseek_v4"
    # Each step's read plan (windows, entries, indexer candidates, the groups a decode step pools)
    # is built on the device from positions and block tables, with shapes from host maxima only:
    # a captured decode step replays right for any later step (with a graph-safe KernelSet).
    graph_safe = True

    def __init__(
        self,
        config: dict,
        weights: WeightStore,
        kernels: KernelSet,
        fingerprint: str,
        parallel: ModelShard | None = None,
        kv_cache_dtype: torch.dtype | None = None,  # only the model's own dtype is served
    ) -> None:
        if parallel is not None:
            raise UnsupportedModelError("deepseek_v4 does not run tensor/expert parallel yet")
        if kv_cache_dtype is not None:
            # its window and compressed entries share one cache row layout with the indexer's
            # keys, whose fp8 scheme (per-entry scales) is not the per-layer one of the others
            raise UnsupportedModelError(
                "--kv-cache-dtype fp8 is not supported for deepseek_v4 yet: use --kv-cache-dtype auto"
            )
        a = self.args = DeepseekV4Args.from_hf(config)
        self.k = kernels
        self.fingerprint = fingerprint
        self.vocab_size = a.vocab_size
        self.max_position_embeddings = a.max_position_embeddings
        self.num_mtp_layers = len(a.mtp_layer_types)
        self.device, self.dtype = weights.device, weights.dtype
        self.rows = {
            kind: kv_row(kind, a.head_dim, a.index_head_dim) for kind in (SLIDING, CSA, HCA)
        }
        kinds = a.layer_types + a.mtp_layer_types
        self.row_layout = row_layout([self.rows[kind].width for kind in kinds])
        self.kv_cache_spec = KVCacheSpec(1, self.row_layout.width, self.dtype)
        self.ropes = {
            SLIDING: self._rope(a.rope_theta, None),
            CSA: self._rope(a.compress_rope_theta, a.compress_rope_scaling),
        }
        self.ropes[HCA] = self.ropes[CSA]
        self._ones = {}  # unweighted RMSNorm weights by (size, dtype)
        self.embed = weights.get("embed.weight")
        self.layers = [self._load_layer(weights, i) for i in range(a.num_layers)]
        self.hc_head = self._load_hc(weights, "hc_head_", a.hc_mult)
        self.norm = weights.get("norm.weight")
        self.lm_head = weights.get("head.weight")
        self.mtp = [self._load_mtp(weights, j) for j in range(self.num_mtp_layers)]

    def _rope(self, theta: float, scaling: dict | None) -> _Rope:
        inv_freq, factor = rope_inv_freq(self.args.rope_dim, theta, scaling)
        return _Rope(inv_freq.to(self.device), factor)

    # ---- loading -------------------------------------------------------------------------------

    def _load_layer(self, w: WeightStore, i: int) -> _Layer:
        a = self.args
        return self._load_block(w, f"layers.{i}.", a.layer_types[i], a.hash_layers[i])

    def _load_block(self, w: WeightStore, p: str, kind: str, hashed: bool) -> _Layer:
        return _Layer(
            attn_hc=self._load_hc(w, p + "hc_attn_", self.args.hc_mult),
            attn_norm=w.get(p + "attn_norm.weight"),
            attn=self._load_attention(w, p + "attn.", kind),
            ffn_hc=self._load_hc(w, p + "hc_ffn_", self.args.hc_mult),
            ffn_norm=w.get(p + "ffn_norm.weight"),
            moe=self._load_moe(w, p + "ffn.", hashed),
        )

    def _load_mtp(self, w: WeightStore, j: int) -> _MTP:
        p = f"mtp.{j}."
        # published checkpoints share the main embedding and head; a checkpoint may carry its own
        own_embed, own_head = p + "emb.tok_emb.weight", p + "head.weight"
        return _MTP(
            embed=w.get(own_embed) if w.has(own_embed) else self.embed,
            enorm=w.get(p + "enorm.weight"),
            hnorm=w.get(p + "hnorm.weight"),
            e_proj=w.get_linear(p + "e_proj.weight"),
            h_proj=w.get_linear(p + "h_proj.weight"),
            layer=self._load_block(w, p, self.args.mtp_layer_types[j], hashed=False),
            hc_head=self._load_hc(w, p + "hc_head_", self.args.hc_mult),
            norm=w.get(p + "norm.weight"),
            head=w.get(own_head) if w.has(own_head) else self.lm_head,
        )

    @staticmethod
    def _load_hc(w: WeightStore, p: str, n: int) -> _HyperConnection:
        scale = w.get(p + "scale", F32)
        widths = torch.tensor([n, n, n * n] if scale.numel() == 3 else [n], device=scale.device)
        return _HyperConnection(
            w.get(p + "fn", F32), w.get(p + "base", F32), scale.repeat_interleave(widths)
        )

    def _load_attention(self, w: WeightStore, p: str, kind: str) -> _Attention:
        a, row = self.args, self.rows[kind]
        compressor = indexer = None
        if kind != SLIDING:
            ratio = a.compress_rates[kind]
            compressor = self._load_compressor(
                w, p + "compressor.", ratio, row.comp_kv, row.comp_gate, row.entry
            )
        if kind == CSA:
            indexer = _Indexer(
                wq_b=w.get_linear(p + "indexer.wq_b.weight"),
                weights_proj=w.get_linear(p + "indexer.weights_proj.weight"),
                compressor=self._load_compressor(
                    w, p + "indexer.compressor.", ratio, row.idx_kv, row.idx_gate, row.idx_key
                ),
            )
        # wo_a runs per head group (each group's heads against its own rows): as the set's
        # grouped FP8 linear where it has one (half bf16's bytes a decode step), else as a bmm
        # over the weight viewed [groups, o_lora, heads * head_dim / groups], dequantized at load
        name = p + "wo_a.weight"
        wo_a = w.get(name) if self.k.grouped_linear is None else w.get_linear(name)
        return _Attention(
            kind=kind,
            row=row,
            wq_a=w.get_linear(p + "wq_a.weight"),
            q_norm=w.get(p + "q_norm.weight"),
            wq_b=w.get_linear(p + "wq_b.weight"),
            wkv=w.get_linear(p + "wkv.weight"),
            kv_norm=w.get(p + "kv_norm.weight"),
            wo_a=wo_a,
            wo_b=w.get_linear(p + "wo_b.weight"),
            sinks=w.get(p + "attn_sink", F32),
            compressor=compressor,
            indexer=indexer,
        )

    @staticmethod
    def _load_compressor(
        w: WeightStore, p: str, ratio: int, kv: slice, gate: slice, out: slice
    ) -> _Compressor:
        wkv = w.get_linear(p + "wkv.weight")
        norm = w.get(p + "norm.weight")
        return _Compressor(
            wkv=wkv, wgate=w.get_linear(p + "wgate.weight"), ape=w.get(p + "ape", F32), norm=norm,
            ratio=ratio, series=wkv.shape[0] // norm.shape[0], kv=kv, gate=gate, out=out,
        )  # fmt: skip

    def _load_moe(self, w: WeightStore, p: str, hashed: bool) -> _MoE:
        experts = [self._load_mlp(w, f"{p}experts.{e}.") for e in range(self.args.n_routed_experts)]
        shared_gate_up, shared_down = self._load_mlp(w, p + "shared_experts.")
        return _MoE(
            gate=w.get(p + "gate.weight", F32),
            bias=None if hashed else w.get(p + "gate.bias", F32),
            tid2eid=w.get(p + "gate.tid2eid", torch.long) if hashed else None,
            # one quantized stack where every expert kept its format (MXFP4 / FP8 for `k.moe`)
            gate_up=stack([e[0] for e in experts], self.dtype),
            down=stack([e[1] for e in experts], self.dtype),
            shared_gate_up=shared_gate_up,
            shared_down=shared_down,
        )

    @staticmethod
    def _load_mlp(w: WeightStore, p: str) -> tuple[Matrix, Matrix]:
        return w.cat_linear([p + "w1.weight", p + "w3.weight"]), w.get_linear(p + "w2.weight")

    # ---- forward -------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The hidden streams before the hyper head, `[T, hc_mult * hidden]`."""
        plan, ropes = self._step(positions, attn)
        h = F.embedding(input_ids, self.embed)
        h = h[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()  # [T, streams, hidden]
        for i, layer in enumerate(self.layers):
            cache = self.row_layout.layer(kv_cache, i)
            h = self._decoder_layer(layer, h, input_ids, ropes, plan, cache)
        return h.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden, self.hc_head, self.norm, self.lm_head)

    def forward_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        mtp_index: int = 0,
    ) -> torch.Tensor:
        """One MTP step: `input_ids[t]` is the token after the one whose hidden streams (as
        `forward` returns them) are `previous_hidden[t]`; returns the MTP's streams, the same
        shape, for `compute_mtp_logits` and for the next draft's `previous_hidden`."""
        a, m, k = self.args, self.mtp[mtp_index], self.k
        plan, ropes = self._step(positions, attn)
        e = F.embedding(input_ids, m.embed)
        e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)  # no token before it
        e = k.linear(self._norm(e, m.enorm), m.e_proj)
        prev = previous_hidden.view(-1, a.hc_mult, a.hidden_size)
        h = k.linear(self._norm(prev, m.hnorm), m.h_proj) + e[:, None, :]
        cache = self.row_layout.layer(kv_cache, a.num_layers + mtp_index)
        return self._decoder_layer(m.layer, h, input_ids, ropes, plan, cache).flatten(1)

    def compute_mtp_logits(self, hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        m = self.mtp[mtp_index]
        return self._logits(hidden, m.hc_head, m.norm, m.head)

    def _step(self, positions: torch.Tensor, attn: AttentionMetadata) -> tuple[StepPlan, dict]:
        plan = StepPlan(attn, self.args.sliding_window, positions)
        ropes = {kind: r.at(positions, plan.max_len, self.dtype) for kind, r in self.ropes.items()}
        return plan, ropes

    def _logits(
        self, hidden: torch.Tensor, hc_head: _HyperConnection, norm: torch.Tensor, head
    ) -> torch.Tensor:
        h = hidden.view(hidden.shape[0], self.args.hc_mult, self.args.hidden_size)
        return self.k.linear(self._norm(self._hyper_head(h, hc_head), norm), head).float()

    def _decoder_layer(
        self,
        layer: _Layer,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        ropes: dict,
        plan: StepPlan,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        post, comb, x = self._hc_collapse(layer.attn_hc, h)
        out = self._attention(layer.attn, self._norm(x, layer.attn_norm), ropes, plan, cache)
        h = self._hc_expand(h, out, post, comb)
        post, comb, x = self._hc_collapse(layer.ffn_hc, h)
        out = self._moe(layer.moe, self._norm(x, layer.ffn_norm), input_ids)
        return self._hc_expand(h, out, post, comb)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm in float32, back in x's dtype; without a weight, the unweighted norm. Norm
        weights are held in the model's dtype (as transformers holds them): a bf16 norm is then
        one launch writing bf16, not a float32 product and a cast."""
        if weight is None:
            key = (x.shape[-1], x.dtype)
            if key not in self._ones:
                self._ones[key] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
            weight = self._ones[key]
        return self.k.rms_norm(x, weight, self.args.rms_norm_eps).to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rope_interleaved`, in one launch where the set has the op."""
        rotated = None if self.k.rope_interleaved is None else self.k.rope_interleaved(x, cos, sin)
        return apply_rope_interleaved(x, cos, sin) if rotated is None else rotated

    # ---- hyper-connections ---------------------------------------------------------------------

    def _hc_mixes(self, w: _HyperConnection, h: torch.Tensor) -> torch.Tensor:
        if self.k.hc_mixes is not None:  # one launch for the cast, the norm and the GEMM
            return self.k.hc_mixes(h, w.fn, self.args.rms_norm_eps)
        flat = self._norm(h.flatten(1).float())
        return self.k.linear(flat, w.fn)

    def _hc_collapse(
        self, w: _HyperConnection, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams `h [T, n, hidden]` -> (post [T, n], comb [T, n, n], the block's input [T, hidden])."""
        n, eps = self.args.hc_mult, self.args.hc_eps
        if self.k.hc_collapse is not None:  # one launch for the ~90 ops below
            mixes = self._hc_mixes(w, h)
            return self.k.hc_collapse(mixes, w.scale, w.base, h, self.args.hc_sinkhorn_iters, eps)
        mixes = self._hc_mixes(w, h) * w.scale + w.base
        gates = self.k.sigmoid(mixes[:, : 2 * n])
        pre, post = gates[:, :n] + eps, 2 * gates[:, n:]
        comb = self.k.softmax(mixes[:, 2 * n :].reshape(-1, n, n), -1) + eps
        comb = _sinkhorn(comb, self.args.hc_sinkhorn_iters, eps)
        return post, comb, (pre[..., None] * h).sum(dim=1).to(h.dtype)

    def _hc_expand(
        self, h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """Stream j of the result: `post[j] * out + sum_i comb[i, j] * h[i]`, the sum over the
        few streams in one fixed order (a batched matmul's order may change with the batch)."""
        if self.k.hc_expand is not None:
            return self.k.hc_expand(h, out, post, comb)
        comb = comb.to(h.dtype)
        mixed = comb[:, 0, :, None] * h[:, :1]
        for i in range(1, h.shape[1]):
            mixed = mixed + comb[:, i, :, None] * h[:, i : i + 1]
        return post.to(h.dtype)[..., None] * out[:, None, :] + mixed

    def _hyper_head(self, h: torch.Tensor, w: _HyperConnection) -> torch.Tensor:
        if self.k.hc_head is not None:
            return self.k.hc_head(self._hc_mixes(w, h), w.scale, w.base, h, self.args.hc_eps)
        pre = self.k.sigmoid(self._hc_mixes(w, h) * w.scale + w.base) + self.args.hc_eps
        return (pre[..., None] * h).sum(dim=1).to(h.dtype)

    # ---- attention -----------------------------------------------------------------------------

    def _attention(
        self, w: _Attention, x: torch.Tensor, ropes: dict, plan: StepPlan, cache: torch.Tensor
    ) -> torch.Tensor:
        a, k = self.args, self.k
        tokens = x.shape[0]
        cos, sin = ropes[w.kind]
        q_lora = self._norm(k.linear(x, w.wq_a), w.q_norm)
        q = self._norm(k.linear(q_lora, w.wq_b).view(tokens, a.num_heads, a.head_dim))
        q = self._rotate(q, cos, sin)
        self._write_rows(w, x, cos, sin, plan, cache)
        for c in (w.compressor, w.indexer and w.indexer.compressor):
            if c is not None:
                self._close_groups(c, plan, cache)
        rows = cache.view(-1, cache.shape[-1])
        entry_kv = entry_slots = None
        if w.compressor is not None:
            entry_kv = rows[:, w.compressor.out]
            if w.indexer is None:  # HCA: every entry complete before the query
                entry_slots = plan.token_entries(w.compressor.ratio)
            else:
                entry_slots = self._chosen(w.indexer, q_lora, x, ropes[CSA], plan, rows)
        window_kv, scale = rows[:, w.row.window], a.head_dim**-0.5
        out = k.sparse_attention(
            q, window_kv, plan.window_slots(), entry_kv, entry_slots, w.sinks, scale
        )
        out = self._rotate(out, cos, -sin)  # K = V: undo the rotation the values carried
        return self._output(w, out)

    def _write_rows(
        self,
        w: _Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        cache: torch.Tensor,
    ) -> None:
        """This step's tokens' own columns: the window latent and the compressors' inputs."""
        k = self.k
        latent = self._norm(k.linear(x, w.wkv), w.kv_norm)
        parts = [self._rotate(latent[:, None], cos, sin)[:, 0]]
        for c in (w.compressor, w.indexer and w.indexer.compressor):
            if c is not None:
                parts += [k.linear(x, c.wkv), k.linear(x, c.wgate)]
        k.write_kv(cache[..., w.row.written], plan.step_slots, torch.cat(parts, dim=-1))

    def _close_groups(self, c: _Compressor, plan: StepPlan, cache: torch.Tensor) -> None:
        """Pool the groups the step pools (`StepPlan.closing`) into their entries."""
        groups = plan.closing(c.ratio)
        if groups is None:
            return
        rows = cache.view(-1, cache.shape[-1])
        dim = c.norm.shape[0]
        pooled = self.k.compress_pool(
            rows, groups.tokens, groups.previous, groups.has_previous, c.ape, c.kv, c.gate, dim,
            c.series,
        )  # fmt: skip
        cos, sin = self.ropes[CSA].at(groups.first_position, plan.max_len, self.dtype)
        entry = self._norm(pooled.to(self.dtype), c.norm)[:, None]
        self.k.write_kv(cache[..., c.out], groups.last, self._rotate(entry, cos, sin)[:, 0])

    def _chosen(
        self,
        w: _Indexer,
        q_lora: torch.Tensor,
        x: torch.Tensor,
        rope: tuple,
        plan: StepPlan,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """`[T, k]` slots of the entries the indexer picks for each token, -1 padded."""
        a = self.args
        q = self.k.linear(q_lora, w.wq_b).view(x.shape[0], a.index_heads, a.index_head_dim)
        weights = self.k.linear(x, w.weights_proj).float() * a.index_heads**-0.5
        q = self._rotate(q, *rope)
        slots, visible = plan.entries(w.compressor.ratio)
        keys, scale = rows[:, w.compressor.out], a.index_head_dim**-0.5
        ids = self.k.indexer_topk(
            q, weights, keys, slots, plan.token_seq, visible, a.index_topk, scale
        )
        picked = slots.flatten()[plan.token_seq[:, None] * slots.shape[1] + ids.clamp(min=0)]
        return torch.where(ids >= 0, picked, -1)

    def _output(self, w: _Attention, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: each group of heads -> o_lora, then all -> hidden."""
        tokens, groups = out.shape[0], self.args.o_groups
        mid = None
        if self.k.grouped_linear is not None:
            mid = self.k.grouped_linear(out.reshape(tokens, -1), w.wo_a, groups)
        if mid is None:
            wo_a = w.wo_a if isinstance(w.wo_a, torch.Tensor) else w.wo_a.dequantize(out.dtype)
            grouped = out.reshape(tokens, groups, -1).transpose(0, 1)  # [G, T, heads*D/G]
            per_group = wo_a.view(groups, -1, wo_a.shape[-1]).transpose(1, 2)
            mid = self.k.bmm(grouped, per_group).transpose(0, 1).reshape(tokens, -1)
        return self.k.linear(mid, w.wo_b)

    # ---- MoE -----------------------------------------------------------------------------------

    def _moe(self, w: _MoE, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self._route(w, x, input_ids)
        shared = self._swiglu(x, w.shared_gate_up, w.shared_down)
        if self.k.moe is not None:  # all experts in one fused op, no host sync
            limit = self.args.swiglu_limit
            return self.k.moe(
                x, w.gate_up, w.down, weights, experts, add=shared, swiglu_limit=limit
            )
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            y = self._swiglu(x[rows], w.gate_up[e], w.down[e])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        return out + shared

    def _route(
        self, w: _MoE, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a, k = self.args, self.k
        logits = k.linear(x.float(), w.gate)
        spec = RouteSpec(a.scoring_func, 1, 1, a.num_experts_per_tok, True, a.routed_scaling_factor)
        experts = None if w.tid2eid is None else w.tid2eid[input_ids]
        # one launch where the set has the routing op (hash routing: the weights of `experts`)
        fused = None if k.moe_route is None else k.moe_route(logits, w.bias, spec, ids=experts)
        if fused is not None:
            return fused
        if experts is None:
            return k.moe_route_composed(
                logits, w.bias, spec, k.sigmoid, k.softmax, softplus=k.softplus
            )
        weights = self._scores(logits).gather(1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, experts

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router scores for hash routing, as the routing op scores them for learned routing."""
        if self.args.scoring_func == "sqrtsoftplus":
            return self.k.softplus(logits).sqrt()
        if self.args.scoring_func == "sigmoid":
            return self.k.sigmoid(logits)
        return self.k.softmax(logits, -1)

    def _swiglu(self, x: torch.Tensor, gate_up: Matrix, down: Matrix) -> torch.Tensor:
        """down(silu(gate) * up) with gate clamped above and up on both sides at `swiglu_limit`."""
        gate_up_out = self.k.linear(x, gate_up)
        limit = self.args.swiglu_limit
        fused = self.k.silu_mul(gate_up_out, limit) if self.k.silu_mul is not None else None
        if fused is not None:  # one launch where the set has it (Triton), instead of five
            return self.k.linear(fused, down)
        gate, up = gate_up_out.chunk(2, dim=-1)
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        # silu as gate * sigmoid(gate): the KernelSet's sigmoid keeps `--batch-invariant` exact
        return self.k.linear(gate * self.k.sigmoid(gate) * up, down)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalisation of `comb [T, n, n]` towards a doubly-stochastic
    matrix (columns first, `iters` column passes in all): `comb / (sum + eps)` each time. The sums
    plus eps are one op each, a batched matmul with a ones vector over the n streams in order
    (the same bits as `sum(...) + eps` on the CPU, and a third fewer launches: the 2 * iters
    passes are most of a decode step's ops)."""
    rows, n = comb.shape[0], comb.shape[-1]
    ones = comb.new_ones(1, n, 1).expand(rows, n, 1)
    eps_t = comb.new_full((1, 1, 1), eps)
    comb = comb / torch.baddbmm(eps_t, ones.transpose(1, 2), comb)
    for _ in range(iters - 1):
        comb = comb / torch.baddbmm(eps_t, comb, ones)
        comb = comb / torch.baddbmm(eps_t, ones.transpose(1, 2), comb)
    return comb
