"""DeepSeek's published quantized checkpoint formats, read tensor by tensor.

`quant_scheme(config)` reads a config's `quantization_config` (None for an unquantized checkpoint)
and refuses, naming the field and its value, anything this module does not read. The formats:

- FP8 e4m3 weights with one scale per `weight_block_size` block (128 x 128), as DeepSeek-V3 / R1 /
  V3.1 publish them: `X.weight` (float8_e4m3fn) beside `X.weight_scale_inv` (float32,
  [ceil(out/128), ceil(in/128)]); `W = fp8 * scale_inv`, the edge blocks cut to the matrix.
- DeepSeek-V4's: the same FP8 blocks with the scale named `X.scale` and stored as UE8M0
  (`scale_fmt: "ue8m0"`: one exponent byte per block, 2^(byte - 127)), and, with `expert_dtype:
  "fp4"`, MXFP4 routed experts: e2m1 values packed two per byte (low nibble first) along the input
  dim (int8 [out, in/2]) with one E8M0 scale per 32 inputs (`X.scale` [out, in/32]).

Tensors a checkpoint keeps unquantized (norms, embeddings, the head, router gates, biases) have no
scale and pass through. On the CPU the loader dequantizes each weight as it is read
(`read_dequantized`), so a checkpoint is never in host RAM twice; on a GPU whose KernelSet runs
them (`fp8_weights`) they are kept as stored (`keep`: kernels/block_quant.py's `Fp8Weight`,
`Mxfp4Weight`) and the model store decides per tensor (engine/models/common.py). Which tensors
a model reads is the model's business, not this module's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepserve.engine.errors import UnsupportedModelError
from deepserve.kernels.block_quant import Fp8Weight, Mxfp4Weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MX_BLOCK = 32  # MXFP4: values per E8M0 scale, along the input dim
# e2m1 code -> value; bit 3 is the sign
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# quantization_config fields we read, each with the values we read; others are refused
_ACCEPTED = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),
    "scale_fmt": ("float", "ue8m0"),
    "expert_dtype": ("fp8", "fp4"),
}
# fields that only say which modules a quantizer skipped: the scales beside the weights say it too
_IGNORED = ("modules_to_not_convert", "modules_to_convert", "ignored_layers", "dequantize")
_PACKED_FP4 = tuple(
    d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)


@dataclass(frozen=True)
class QuantScheme:
    block: tuple[int, int]  # FP8 scale block (out, in)
    scale_fmt: str  # "float" (float32 scales) | "ue8m0" (exponent bytes)
    expert_dtype: str  # "fp8" | "fp4" (MXFP4 routed experts)


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight as stored: the FP8 or packed-FP4 values and their scales."""

    values: torch.Tensor
    scale: torch.Tensor
    fmt: str  # "fp8" | "mxfp4"

    def dequantize(self, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(self.values, self.scale, dtype)
        return dequantize_fp8(self.values, self.scale, block, dtype)


def quant_scheme(config: dict) -> QuantScheme | None:
    """The scheme `config` declares, or None; an unread field or value: UnsupportedModelError."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise UnsupportedModelError(f"quantization_config = {q!r} is not an object")
    q = dict(q)
    if "expert_dtype" not in q and config.get("expert_dtype") is not None:
        q["expert_dtype"] = config["expert_dtype"]  # V4 ships it beside quantization_config
    # the method first: the rest of a config for another method means little
    for key, value in sorted(q.items(), key=lambda kv: kv[0] != "quant_method"):
        if key in _IGNORED or key == "weight_block_size":
            continue
        if key not in _ACCEPTED:
            raise UnsupportedModelError(
                f"quantization_config.{key} = {value!r} is not supported (deepserve reads "
                f"{', '.join(sorted(_ACCEPTED) + ['weight_block_size'])})"
            )
        if value not in _ACCEPTED[key]:
            raise UnsupportedModelError(
                f"quantization_config.{key} = {value!r} is not supported "
                f"(deepserve reads {' or '.join(map(repr, _ACCEPTED[key]))})"
            )
    if "quant_method" not in q:
        raise UnsupportedModelError(
            "quantization_config names no quant_method (deepserve reads 'fp8')"
        )
    block = q.get("weight_block_size")
    ok = isinstance(block, list | tuple) and len(block) == 2
    if not ok or not all(isinstance(b, int) and b > 0 for b in block):
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size = {block!r} is not supported "
            "(deepserve reads two positive integers, e.g. [128, 128])"
        )
    return QuantScheme(tuple(block), q.get("scale_fmt", "float"), q.get("expert_dtype", "fp8"))


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales from float32 / bf16 ones or from E8M0 exponent bytes (2^(byte - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight` [..., out, in] e4m3 times its per-block `scale_inv` [..., ceil(out/b0),
    ceil(in/b1)], the last row and column of blocks cut to the matrix."""
    _check_fp8_scale(weight, scale_inv, block)
    rows, cols = weight.shape[-2:]
    # scales spread over rows only, then broadcast over each block's columns: no second
    # weight-sized float32 tensor beside the one being scaled
    s = scale_to_float(scale_inv).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    w = weight.float()
    full = cols // block[1] * block[1]
    w[..., :full].unflatten(-1, (-1, block[1])).mul_(s[..., : full // block[1], None])
    w[..., full:].mul_(s[..., full // block[1] :])  # the cut last column of blocks, if any
    return w.to(dtype)


def _check_fp8_scale(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    rows, cols = weight.shape[-2:]
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != want or scale.shape[:-2] != weight.shape[:-2]:
        raise ValueError(
            f"FP8 weight {tuple(weight.shape)} with {block} blocks needs scales "
            f"{(*weight.shape[:-2], *want)}, not {tuple(scale.shape)}"
        )


def _check_mxfp4_scale(packed: torch.Tensor, scale: torch.Tensor) -> None:
    inputs = packed.shape[-1] * 2
    want = (*packed.shape[:-1], inputs // MX_BLOCK)
    if inputs % MX_BLOCK or tuple(scale.shape) != want:
        raise ValueError(
            f"MXFP4 weight of {inputs} inputs needs scales {want}, not {tuple(scale.shape)}"
        )


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2n] from bytes [..., n] holding two e2m1 codes each, the low nibble first."""
    u8 = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    pairs = torch.stack([table[(u8 & 0xF).long()], table[(u8 >> 4).long()]], dim=-1)
    return pairs.flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 `packed` [..., out, in/2] with one `scale` [..., out, in/32] per 32 inputs."""
    _check_mxfp4_scale(packed, scale)
    values = unpack_e2m1(packed)
    groups = values.shape[-1] // MX_BLOCK
    grouped = values.unflatten(-1, (groups, MX_BLOCK)) * scale_to_float(scale).unsqueeze(-1)
    return grouped.flatten(-2).to(dtype)


def scale_name(weight_name: str, names) -> str | None:
    """The scale stored beside `weight_name`: V3's `X.weight_scale_inv` or V4's `X.scale`
    (and `X_scale_inv` beside a fused expert tensor `X`)."""
    base = weight_name.removesuffix(".weight")
    candidates = (
        (base + ".weight_scale_inv", base + ".scale")
        if weight_name.endswith(".weight")
        else (weight_name + "_scale_inv",)
    )
    return next((c for c in candidates if c in names), None)


def read_dequantized(
    files: list[Path], scheme: QuantScheme | None, dtype: torch.dtype, keep: bool = False
) -> dict[str, torch.Tensor | Fp8Weight | Mxfp4Weight]:
    """Every tensor of `files` by name, the quantized ones dequantized to `dtype` one at a time;
    `keep` (a KernelSet that runs them, kernels/kernel_set.py `fp8_weights`): kept as stored,
    as kernels/block_quant.py's `Fp8Weight` (float32 scales) and `Mxfp4Weight` instead."""
    return dict(_stream(files, scheme, dtype, keep))


def _stream(
    files: list[Path], scheme: QuantScheme | None, dtype: torch.dtype, keep: bool
) -> Iterator[tuple[str, torch.Tensor | Fp8Weight | Mxfp4Weight]]:
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (not iterable)
    scales = {s for n in where if (s := scale_name(n, where)) is not None}
    for name, handle in where.items():
        if name in scales:
            continue
        tensor = handle.get_tensor(name)
        scale = scale_name(name, where)
        if scale is None:
            _refuse_unscaled(name, tensor, scheme)
            yield name, tensor
            continue
        if scheme is None:
            raise UnsupportedModelError(
                f"checkpoint stores {name} with scales ({scale}) but its config has no "
                "quantization_config"
            )
        weight = QuantizedWeight(
            tensor, where[scale].get_tensor(scale), _format(name, tensor, scheme)
        )
        try:
            yield name, _kept(weight, scheme) if keep else weight.dequantize(scheme.block, dtype)
        except ValueError as e:  # scales of the wrong shape
            raise UnsupportedModelError(f"checkpoint tensor {name}: {e}") from e


def _kept(weight: QuantizedWeight, scheme: QuantScheme) -> Fp8Weight | Mxfp4Weight:
    """The weight as the GPU kernels take it (scales checked, FP8 ones made float32)."""
    if weight.fmt == "mxfp4":
        _check_mxfp4_scale(weight.values, weight.scale)
        return Mxfp4Weight(weight.values.view(torch.uint8), weight.scale)
    _check_fp8_scale(weight.values, weight.scale, scheme.block)
    return Fp8Weight(weight.values, scale_to_float(weight.scale), scheme.block)


def _format(name: str, tensor: torch.Tensor, scheme: QuantScheme) -> str:
    if tensor.dtype == torch.float8_e4m3fn:
        return "fp8"
    if tensor.dtype in _PACKED_FP4 and scheme.expert_dtype == "fp4":
        return "mxfp4"
    raise UnsupportedModelError(
        f"checkpoint tensor {name} is {tensor.dtype} with scales, which deepserve does not read "
        f"under quantization_config expert_dtype {scheme.expert_dtype!r} (it reads float8_e4m3fn, "
        "and packed e2m1 bytes with expert_dtype 'fp4')"
    )


def _refuse_unscaled(name: str, tensor: torch.Tensor, scheme: QuantScheme | None) -> None:
    """A float8 tensor without its scales would be read as if its scale were 1: refuse it."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        raise UnsupportedModelError(
            f"checkpoint tensor {name} is {tensor.dtype} with no scale beside it "
            f"({name.removesuffix('.weight')}.weight_scale_inv or .scale)"
            + ("" if scheme else " and the config has no quantization_config")
        )
