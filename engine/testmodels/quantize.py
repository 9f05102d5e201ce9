"""Quantizing a test model's random weights into DeepSeek's published formats, for
`make-test-model --quantization fp8 | mxfp4`: the writer's side of engine/loading/quantized.py.

- `fp8`, DeepSeek-V3 / R1 / V3.1: every linear weight but the embeddings, the head and the router
  gate as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (the block's absmax /
  448), the quantization_config V3 ships.
- DeepSeek-V4 (`fp8`, or `mxfp4` as V4 is published): the same blocks with UE8M0 scales (the
  power of two at or above absmax / 448, stored as float8_e8m0fnu) named `X.scale`; the compressor
  and indexer projections stay bf16 as in V4-Flash. With `mxfp4` the routed experts are e2m1 values
  packed two per int8 byte (low nibble first) with one E8M0 scale per 32 inputs (the power of two at
  or above absmax / 6), and the config says `expert_dtype: "fp4"`.

Norms, biases and other vectors are left as they are. What reads these back lives in
engine/loading/quantized.py.
"""

from __future__ import annotations

import re

import torch

from deepserve.engine.loading.quantized import E2M1_VALUES, FP8_MAX, MX_BLOCK

BLOCK = (128, 128)
FP4_MAX = 6.0
V3_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
             "activation_scheme": "dynamic"}  # fmt: skip
# kept in bf16 / fp32 by the published checkpoints
_V3_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|mlp\.gate)\.weight$")
_V4_KEEP = re.compile(r"(^embed|^head|\.gate|\.compressor\.\w+|\.indexer\.weights_proj)\.weight$")
_V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def quantize_checkpoint(
    config: dict, tensors: dict[str, torch.Tensor], method: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """`config` with its quantization_config, and `tensors` in the published layout."""
    v4 = config["model_type"] == "deepseek_v4"
    if config["model_type"] not in ("deepseek_v3", "deepseek_v4"):
        raise ValueError(f"{config['model_type']} is not published quantized (fp8: V3 and V4)")
    if method not in ("fp8", "mxfp4") or (method == "mxfp4" and not v4):
        raise ValueError(f"--quantization {method} is not how {config['model_type']} is published")
    qconfig = dict(V3_CONFIG, scale_fmt="ue8m0") if v4 else dict(V3_CONFIG)
    config = dict(config, quantization_config=qconfig)
    if method == "mxfp4":
        config["expert_dtype"] = "fp4"
    out = {}
    for name, t in tensors.items():
        fmt = published_format(name, t, v4, method)
        base = name.removesuffix(".weight")
        if fmt is None:
            out[name] = t
        elif fmt == "mxfp4":
            out[name], out[base + ".scale"] = quantize_mxfp4(t)
        elif v4:
            out[name], out[base + ".scale"] = quantize_fp8(t, ue8m0=True)
        else:
            out[name], out[base + ".weight_scale_inv"] = quantize_fp8(t, ue8m0=False)
    return config, out


def published_format(name: str, t: torch.Tensor, v4: bool, method: str) -> str | None:
    """How the published checkpoint stores tensor `name`: "fp8", "mxfp4" (V4's routed experts
    under `mxfp4`) or None (as it is). The GPU benchmark makes V4's published format on the
    device by the same rule (benchmarks/gpu/v4_speed.py)."""
    # linear weights only: V4's 2-D mixing tensors (hc_*_fn, ape) are not `.weight`s
    keep = _V4_KEEP if v4 else _V3_KEEP
    if t.dim() != 2 or not name.endswith(".weight") or keep.search(name):
        return None
    return "mxfp4" if method == "mxfp4" and _V4_EXPERT.search(name) else "fp8"


def quantize_fp8(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one scale per 128 x 128 block (edge blocks padded with zeros)."""
    rows, cols = w.shape[-2:]
    br, bc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    padded = w.float().new_zeros(*w.shape[:-2], br * BLOCK[0], bc * BLOCK[1])
    padded[..., :rows, :cols] = w.float()
    blocks = padded.unflatten(-1, (bc, BLOCK[1])).unflatten(-3, (br, BLOCK[0]))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., br, bc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale).contiguous()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in/2] with two e2m1 codes a byte, float8_e8m0fnu [out, in/32])."""
    groups = w.float().unflatten(-1, (w.shape[-1] // MX_BLOCK, MX_BLOCK))
    amax = groups.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / FP4_MAX, 1.0))))
    scaled = (groups / scale[..., None]).flatten(-2)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest e2m1 value
    code = (code | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()
