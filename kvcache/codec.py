"""The on-tier format of one KV block: a versioned header, the raw payload, and a checksum trailer.

Layout (little endian)::

    fixed header  magic "DSKV", format version, dtype code, num_layers, block_size, width,
                  num_tokens, payload bytes, fingerprint length, key length
    fingerprint   utf-8
    key           utf-8
    payload       num_layers * block_size * width * itemsize bytes
    trailer       xxh3_64 of everything before it

Decoding checks every field against the `BlockSpec` the caller expects: no size or shape is ever
taken from the bytes themselves, so a corrupt or hostile entry cannot make the reader allocate or
slice what it did not ask for. Any mismatch raises `BlockFormatError`.

What does not live here: tensors and attention layouts (the engine turns a block into bytes), and
what a tier does with a bad block (see tiered.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"DSKV"
FORMAT_VERSION = 1

_FIXED = struct.Struct("<4sHHIIIIQHH")
_TRAILER = struct.Struct("<Q")

# Codes are part of the format: never renumber, only append.
DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3, "float8_e4m3fn": 4}
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class BlockFormatError(ValueError):
    """An encoded block failed a check: bad magic/version, a header field that differs from what
    the reader expects, a wrong length, or a checksum mismatch."""


@dataclass(frozen=True)
class BlockSpec:
    """What every block of one model's KV cache looks like; both writer and reader hold one."""

    fingerprint: str  # model fingerprint: blocks of another model are never accepted
    num_layers: int
    block_size: int  # tokens per block
    width: int  # elements per token per layer
    dtype: str  # a key of DTYPE_CODES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if min(self.num_layers, self.block_size, self.width) <= 0:
            raise ValueError(f"block dimensions must be positive: {self}")

    @property
    def payload_nbytes(self) -> int:
        return self.num_layers * self.block_size * self.width * DTYPE_ITEMSIZE[self.dtype]

    def encoded_nbytes(self, key: str) -> int:
        fp, k = len(self.fingerprint.encode()), len(key.encode())
        return _FIXED.size + fp + k + self.payload_nbytes + _TRAILER.size


def encode_block(spec: BlockSpec, key: str, payload: bytes | memoryview) -> bytes:
    """Frame one full block's payload (the raw bytes of `cache[:, block_id]`)."""
    payload = memoryview(payload).cast("B")
    if payload.nbytes != spec.payload_nbytes:
        raise BlockFormatError(
            f"payload is {payload.nbytes} bytes, spec says {spec.payload_nbytes}"
        )
    fp, k = spec.fingerprint.encode(), key.encode()
    head = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        DTYPE_CODES[spec.dtype],
        spec.num_layers,
        spec.block_size,
        spec.width,
        spec.block_size,
        payload.nbytes,
        len(fp),
        len(k),
    )
    h = xxhash.xxh3_64()
    for part in (head, fp, k, payload):
        h.update(part)
    return b"".join((head, fp, k, payload, _TRAILER.pack(h.intdigest())))


def decode_block(spec: BlockSpec, key: str, data: bytes | memoryview) -> memoryview:
    """Validate an encoded block against `spec` and `key`; return a view of its payload."""
    view = memoryview(data).cast("B")
    fp, k = spec.fingerprint.encode(), key.encode()
    expected_len = _FIXED.size + len(fp) + len(k) + spec.payload_nbytes + _TRAILER.size
    if view.nbytes != expected_len:
        raise BlockFormatError(f"block is {view.nbytes} bytes, expected {expected_len}")
    _check_header(spec, _FIXED.unpack_from(view, 0), len(fp), len(k))
    body_end = expected_len - _TRAILER.size
    (stored,) = _TRAILER.unpack_from(view, body_end)
    if xxhash.xxh3_64_intdigest(view[:body_end]) != stored:
        raise BlockFormatError("checksum mismatch")
    off = _FIXED.size
    if view[off : off + len(fp)] != fp:
        raise BlockFormatError("block belongs to another model fingerprint")
    off += len(fp)
    if view[off : off + len(k)] != k:
        raise BlockFormatError("block key differs from the requested key")
    off += len(k)
    return view[off:body_end]


def _check_header(spec: BlockSpec, fields: tuple, fp_len: int, key_len: int) -> None:
    magic, version, dtype, layers, bsize, width, ntok, nbytes, fpl, kl = fields
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise BlockFormatError(f"unsupported block format version {version}")
    got = (dtype, layers, bsize, width, ntok, nbytes, fpl, kl)
    want = (
        DTYPE_CODES[spec.dtype],
        spec.num_layers,
        spec.block_size,
        spec.width,
        spec.block_size,
        spec.payload_nbytes,
        fp_len,
        key_len,
    )
    if got != want:
        names = ("dtype", "layers", "block_size", "width", "tokens", "bytes", "fp_len", "key_len")
        diff = [f"{n}={g} (want {w})" for n, g, w in zip(names, got, want, strict=True) if g != w]
        raise BlockFormatError("header mismatch: " + ", ".join(diff))
