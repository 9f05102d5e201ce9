"""The fused MoE's e2m1 decode in PTX (kernels/triton/fused_moe.py `E2M1_BF16_PTX`), run on the CPU
through a model of the few instructions it uses (prmt, shl, and, lop3, mul.rn.bf16x2, mov), on the
very text the kernel inlines: over every code byte and every finite E8M0 scale byte it gives the
bits of the reference dequantization (kernels/block_quant.py `Mxfp4Weight.dequantize`) rounded to
bf16, with the scales of one pack's four bytes differing. Triton's packing of the operands into
registers (byte i of a pack in bits 8i.., output i in half i % 2 of register i // 2) is the GPU
job's to check (benchmarks/gpu/kernel_checks.py `check_quantized_moe`: the same bits as the
integer decode)."""

from __future__ import annotations

import numpy as np
import torch

from deepserve.kernels import block_quant
from deepserve.kernels.triton.fused_moe import E2M1_BF16_PTX, E2M1_BF16_PTX_FOLDED

M32 = np.uint64(0xFFFFFFFF)


def _bf16_lanes_to_f32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = ((x & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32).view(np.float32)
    hi = ((x >> np.uint64(16)) << np.uint64(16)).astype(np.uint32).view(np.float32)
    return lo, hi


def _f32_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round to nearest even, as the GPU's `.rn` (torch's cast rounds so)."""
    bf = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
    return bf.view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mul.rn.bf16x2, lane by lane: the float32 product rounded to bf16 (the products here have at
    most 4 significant bits, so float32 holds them exactly and the one rounding is the GPU's)."""
    (a0, a1), (b0, b1) = _bf16_lanes_to_f32(a), _bf16_lanes_to_f32(b)
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = _f32_to_bf16_bits(a0 * b0), _f32_to_bf16_bits(a1 * b1)
    return lo | (hi << np.uint64(16))


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """prmt.b32's default mode: byte i of the result is byte (selector nibble i & 7) of {b, a},
    or that byte's sign bit replicated when the nibble's bit 3 is set."""
    pool = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    pool += [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = int(sel) >> (4 * i) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """lop3.b32: bit j of the result is bit (4 a_j + 2 b_j + c_j) of the table."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            term = (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            out |= term & M32
    return out


OPS = {
    "mov.b32": lambda x: x + np.uint64(0),
    "prmt.b32": _prmt,
    "shl.b32": lambda a, n: (a << n) & M32,
    "and.b32": lambda a, b: a & b,
    "lop3.b32": lambda a, b, c, lut: _lop3(a, b, c, int(lut)),
    "mul.rn.bf16x2": _mul_bf16x2,
}


def run_ptx(text: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The instruction lines of `text` in order over uint32 registers (numpy arrays, one lane per
    invocation); `inputs` names registers like "$4"; returns every register written."""
    regs = dict(inputs)

    def value(operand: str) -> np.ndarray | np.uint64:
        return regs[operand] if operand in regs else np.uint64(int(operand, 0))

    for line in text.splitlines():
        line = line.strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        assert op in OPS, f"no model for {op}"
        regs[dst] = OPS[op](*[value(s) for s in srcs])
    return regs


def _decode(
    codes: np.ndarray, scales: np.ndarray, folded: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(low nibbles, high nibbles) as bf16 bits of code bytes `codes` with scale bytes `scales`
    (equal 1-d uint8 arrays, a multiple of 4 long), 4 a pack as the kernel's asm takes them: the
    codes a byte each in one register, the scales as bf16 two to a register: S << 7, or for
    the folded text (S + 126) << 7 and 0 for S = 0, as the kernel makes them."""
    c = codes.astype(np.uint64).reshape(-1, 4)
    s = scales.astype(np.uint64).reshape(-1, 4)
    if folded:  # the kernel's bf16 2^(S - 1)
        s = np.where(s == 0, s, s + np.uint64(126))
    s = s << np.uint64(7)  # unfolded: the kernel's bf16 2^(S - 127)
    shift = np.uint64(8) * np.arange(4, dtype=np.uint64)
    pair = [s[:, 2 * j] | (s[:, 2 * j + 1] << np.uint64(16)) for j in (0, 1)]
    text = E2M1_BF16_PTX_FOLDED if folded else E2M1_BF16_PTX
    out = run_ptx(text, {"$4": (c << shift).sum(1), "$5": pair[0], "$6": pair[1]})
    halves = []
    for first in ("$0", "$2"):  # low nibbles in $0 $1, high ones in $2 $3
        regs = np.stack([out[first], out[f"${int(first[1]) + 1}"]], axis=1)  # [packs, 2]
        lanes = np.stack([regs & np.uint64(0xFFFF), regs >> np.uint64(16)], axis=2)
        halves.append(lanes.reshape(-1).astype(np.uint16))
    return halves[0], halves[1]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)


def _check_every_code(scales: torch.Tensor, folded: bool) -> None:
    """Rows of every code byte, row r under scale byte scales[r]; the bytes fed to the asm in a
    shuffled order, so a pack's four bytes differ in code and in scale."""
    data = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)  # [rows, 256]
    scale = scales[:, None].repeat(1, 256 // 16)  # one per 32 codes = 16 bytes
    want = _bits(block_quant.Mxfp4Weight(data, scale).dequantize())  # [254, 512]
    order = np.random.default_rng(0).permutation(data.numel())
    per_byte = scales[:, None].repeat(1, 256).numpy().reshape(-1)
    lo, hi = np.empty(data.numel(), np.uint16), np.empty(data.numel(), np.uint16)
    lo[order], hi[order] = _decode(data.numpy().reshape(-1)[order], per_byte[order], folded)
    assert np.array_equal(lo.reshape(data.shape), want[:, 0::2])
    assert np.array_equal(hi.reshape(data.shape), want[:, 1::2])


def test_the_ptx_decode_gives_the_reference_bits_for_every_code_and_finite_scale():
    _check_every_code(torch.arange(1, 255, dtype=torch.uint8), folded=False)


def test_the_folded_ptx_decode_gives_the_reference_bits_for_every_code_and_small_scale():
    """Scale bytes 1..128, all `Mxfp4Weight.small_scales` admits but 0 (below)."""
    _check_every_code(torch.arange(1, 129, dtype=torch.uint8), folded=True)


def test_the_folded_ptx_decode_reads_scale_byte_0_as_zeros_as_the_other_decodes_do():
    codes = np.arange(256, dtype=np.uint8).repeat(4)
    lo, hi = _decode(codes, np.zeros_like(codes), folded=True)
    magnitude = np.uint16(0x7FFF)  # negative codes give -0
    assert not (lo & magnitude).any() and not (hi & magnitude).any()


def test_the_folded_text_is_the_plain_one_without_its_renormalising_multiplies():
    plain, folded = E2M1_BF16_PTX.splitlines(), E2M1_BF16_PTX_FOLDED.splitlines()
    assert [line for line in plain if line != "mul.rn.bf16x2 v, v, k;"] == folded
    assert len(plain) - len(folded) == 4


def test_the_ptx_decode_reads_scale_bytes_0_and_255_as_the_integer_decode_does():
    """Outside E8M0's finite range the asm keeps the integer path's reading (the byte as a
    float32's exponent field): 0 gives zeros, 255 infinities (NaN for the zero codes)."""
    codes = np.arange(256, dtype=np.uint8).repeat(2)
    scales = np.tile(np.array([0, 255], dtype=np.uint8), 256)
    lo, hi = _decode(codes, scales)
    table = torch.tensor(block_quant.E2M1_VALUES)
    c = torch.from_numpy(codes).long()
    as_float = (torch.from_numpy(scales).int() << 23).view(torch.float32)
    for got, nib in ((lo, c & 0xF), (hi, c >> 4)):
        want = table[nib & 7] * torch.where(nib >= 8, -1.0, 1.0) * as_float
        nan = want.isnan().numpy()
        assert np.array_equal(np.isnan(_as_float(got)), nan)
        assert np.array_equal(got[~nan], _bits(want)[~nan])


def _as_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)
