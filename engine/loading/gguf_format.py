"""A small GGUF reader: the header's key/value metadata and tensor index parsed straight from the
file bytes, and dequantization of the tensor types we support done in torch.

Why not `gguf.GGUFReader`: it builds a numpy view per field part, which takes seconds for a 49k-token
vocabulary; this parser reads the same header in tens of milliseconds. The `gguf` package's
constants name the types and block sizes, and its numpy dequantizer is the oracle in the tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from deepserve.engine.errors import UnsupportedModelError

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy/torch order): the reverse of GGUF's dims
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict
    tensors: list[TensorInfo]

    def raw(self, t: TensorInfo) -> torch.Tensor:
        data = np.fromfile(self.path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return torch.from_numpy(data)


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.scalar("<I"), self.scalar("<Q")
            if inner in _SCALARS and inner != _BOOL:
                fmt = _SCALARS[inner]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
                self.pos += size * count
                return arr.tolist()
            return [self.value(inner) for _ in range(count)]
        if kind not in _SCALARS:
            raise UnsupportedModelError(f"GGUF metadata has unknown value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf_file(path: Path, header_bytes: int = 64 * 2**20) -> GGUFFile:
    """Parse the header (metadata + tensor index). Headers larger than `header_bytes` are re-read."""
    with path.open("rb") as f:
        buf = f.read(header_bytes)
    try:
        return _parse(path, buf)
    except struct.error:
        if len(buf) < header_bytes:
            raise UnsupportedModelError(f"{path} is truncated or not a GGUF file") from None
        return read_gguf_file(path, header_bytes * 4)


def _parse(path: Path, buf: bytes) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise UnsupportedModelError(f"{path} is not a GGUF file (bad magic)")
    c = _Cursor(buf)
    c.pos = 4
    version = c.scalar("<I")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.scalar("<Q") for _ in range(c.scalar("<I"))]
        qtype, offset = c.scalar("<I"), c.scalar("<Q")
        infos.append((name, tuple(reversed(dims)), qtype, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-c.pos // align) * align
    return GGUFFile(path, metadata, [_tensor_info(data_start, *i) for i in infos])


def _tensor_info(data_start: int, name: str, shape: tuple, qtype: int, offset: int) -> TensorInfo:
    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedModelError(f"GGUF tensor {name} has unknown type id {qtype}") from None
    block, size = GGML_QUANT_SIZES[kind]
    nbytes = int(np.prod(shape)) // block * size
    return TensorInfo(name, shape, kind, data_start + offset, nbytes)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles are elements 0-15, high ones 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Bytes of one tensor -> float32 tensor of `shape`."""
    q = GGMLQuantizationType
    if qtype == q.F32:
        return raw.view(torch.float32).reshape(shape).clone()
    if qtype == q.F16:
        return raw.view(torch.float16).float().reshape(shape)
    if qtype == q.BF16:
        return raw.view(torch.bfloat16).float().reshape(shape)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, size)
    d = _f16(blocks[:, :2])
    if qtype == q.Q8_0:
        values = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    elif qtype == q.Q4_0:
        values = d * (_nibbles(blocks[:, 2:]) - 8)
    elif qtype == q.Q4_1:
        values = d * _nibbles(blocks[:, 4:]) + _f16(blocks[:, 2:4])
    else:
        raise UnsupportedModelError(f"GGUF quantization {qtype.name} is not supported")
    return values.reshape(shape)
