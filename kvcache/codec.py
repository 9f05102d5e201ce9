"""The on-tier format of one KV block: a versioned header, the raw payload, and a checksum trailer.

Layout (little endian)::

    fixed header  magic "DSKV", format version, dtype code, num_layers, block_size, width,
                  num_tokens, payload bytes, fingerprint length, key length
    fingerprint   utf-8
    key           utf-8
    payload       num_layers * block_size * width * itemsize bytes
    trailer       format 1: xxh3_64 of everything before it (a checksum)
                  format 2: HMAC-SHA256 of everything before it under the tier's MAC key

Format 2 is for tiers other processes can write (Redis, a shared disk): whoever can write there
but lacks the key cannot make a block that decodes, so a forged or altered block is a miss, never
another prompt's context. Format 1 is for process-private memory (the host tier), where a checksum
against corruption is enough and 40x cheaper. A reader holding a key accepts only format 2 and
one without accepts only format 1, so a block cannot be downgraded past the check.

Decoding checks every field against the `BlockSpec` the caller expects: no size or shape is ever
taken from the bytes themselves, so a corrupt or hostile entry cannot make the reader allocate or
slice what it did not ask for. Any mismatch raises `BlockFormatError`.

What does not live here: tensors and attention layouts (the engine turns a block into bytes), and
what a tier does with a bad block (see tiered.py).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"DSKV"
CHECKSUM_VERSION = 1  # xxh3_64 trailer
MAC_VERSION = 2  # HMAC-SHA256 trailer

_FIXED = struct.Struct("<4sHHIIIIQHH")
_TRAILER = struct.Struct("<Q")
_MAC_BYTES = 32
_MAC_LABEL = b"deepserve kv block mac v2"

# Codes are part of the format: never renumber, only append.
DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3, "float8_e4m3fn": 4}
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class BlockFormatError(ValueError):
    """An encoded block failed a check: bad magic/version, a header field that differs from what
    the reader expects, a wrong length, or a checksum mismatch."""


class MACMismatchError(BlockFormatError):
    """A well-formed block whose MAC does not verify under the reader's key: forged, altered, or
    written by a process holding another KV secret."""


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

    def encoded_nbytes(self, key: str, mac_key: bytes | None = None) -> int:
        fp, k = len(self.fingerprint.encode()), len(key.encode())
        return _FIXED.size + fp + k + self.payload_nbytes + _trailer_nbytes(mac_key)


def derive_mac_key(secret: bytes) -> bytes:
    """The block MAC key for a shared secret (its own key, whatever else the secret keys)."""
    if not secret:
        raise ValueError("the KV block secret is empty")
    return hmac.digest(secret, _MAC_LABEL, "sha256")


@functools.cache
def process_mac_key() -> bytes:
    """A random MAC key for this process: blocks it writes are readable by it alone."""
    return secrets.token_bytes(32)


def encode_block(
    spec: BlockSpec, key: str, payload: bytes | memoryview, mac_key: bytes | None = None
) -> bytes:
    """Frame one full block's payload (the raw bytes of `cache[:, block_id]`); with `mac_key`
    in format 2 (authenticated), else format 1 (checksummed)."""
    payload = memoryview(payload).cast("B")
    if payload.nbytes != spec.payload_nbytes:
        raise BlockFormatError(
            f"payload is {payload.nbytes} bytes, spec says {spec.payload_nbytes}"
        )
    fp, k = spec.fingerprint.encode(), key.encode()
    head = _FIXED.pack(
        MAGIC,
        MAC_VERSION if mac_key is not None else CHECKSUM_VERSION,
        DTYPE_CODES[spec.dtype],
        spec.num_layers,
        spec.block_size,
        spec.width,
        spec.block_size,
        payload.nbytes,
        len(fp),
        len(k),
    )
    parts = (head, fp, k, payload)
    return b"".join((*parts, _trailer(parts, mac_key)))


def decode_block(
    spec: BlockSpec, key: str, data: bytes | memoryview, mac_key: bytes | None = None
) -> memoryview:
    """Validate an encoded block against `spec`, `key` and the tier's `mac_key` (None: the
    block must be checksummed, not authenticated); return a view of its payload."""
    view = memoryview(data).cast("B")
    fp, k = spec.fingerprint.encode(), key.encode()
    trailer = _trailer_nbytes(mac_key)
    expected_len = _FIXED.size + len(fp) + len(k) + spec.payload_nbytes + trailer
    if view.nbytes != expected_len:
        raise BlockFormatError(f"block is {view.nbytes} bytes, expected {expected_len}")
    version = MAC_VERSION if mac_key is not None else CHECKSUM_VERSION
    _check_header(spec, _FIXED.unpack_from(view, 0), len(fp), len(k), version)
    body_end = expected_len - trailer
    # compare_digest: how long a forged tag matched must not show in the time taken.
    if not hmac.compare_digest(_trailer((view[:body_end],), mac_key), view[body_end:]):
        if mac_key is not None:
            raise MACMismatchError("MAC mismatch")
        raise BlockFormatError("checksum mismatch")
    off = _FIXED.size
    if view[off : off + len(fp)] != fp:
        raise BlockFormatError("block belongs to another model fingerprint")
    off += len(fp)
    if view[off : off + len(k)] != k:
        raise BlockFormatError("block key differs from the requested key")
    off += len(k)
    return view[off:body_end]


def _trailer_nbytes(mac_key: bytes | None) -> int:
    return _MAC_BYTES if mac_key is not None else _TRAILER.size


def _trailer(parts: tuple, mac_key: bytes | None) -> bytes:
    if mac_key is not None:
        mac = hmac.new(mac_key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return _TRAILER.pack(h.intdigest())


def _check_header(
    spec: BlockSpec, fields: tuple, fp_len: int, key_len: int, expected_version: int
) -> None:
    magic, version, dtype, layers, bsize, width, ntok, nbytes, fpl, kl = fields
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}")
    if version != expected_version:
        raise BlockFormatError(
            f"block format version {version}, this tier reads version {expected_version}"
        )
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
