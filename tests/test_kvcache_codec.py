"""The block codec rejects every kind of damaged or foreign block and round-trips good ones."""

import os

import pytest

from deepserve.kvcache.codec import (
    BlockFormatError,
    BlockSpec,
    decode_block,
    derive_mac_key,
    encode_block,
)

SPEC = BlockSpec(fingerprint="fp-smollm2", num_layers=3, block_size=4, width=8, dtype="float32")
KEY = "a1b2c3"


def _payload(spec: BlockSpec = SPEC) -> bytes:
    return os.urandom(spec.payload_nbytes)


def test_round_trip_returns_the_same_payload():
    payload = _payload()
    blob = encode_block(SPEC, KEY, payload)
    assert len(blob) == SPEC.encoded_nbytes(KEY)
    assert bytes(decode_block(SPEC, KEY, blob)) == payload


@pytest.mark.parametrize("where", ["magic", "header", "fingerprint", "key", "payload", "trailer"])
def test_a_flipped_byte_anywhere_is_detected(where):
    blob = bytearray(encode_block(SPEC, KEY, _payload()))
    header = 36
    offsets = {
        "magic": 0,
        "header": 8,
        "fingerprint": header + 1,
        "key": header + len(SPEC.fingerprint) + 1,
        "payload": header + len(SPEC.fingerprint) + len(KEY) + 17,
        "trailer": len(blob) - 3,
    }
    blob[offsets[where]] ^= 0x40
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, bytes(blob))


@pytest.mark.parametrize("cut", [0, 1, 10, 100, -1])
def test_truncated_block_is_detected(cut):
    blob = encode_block(SPEC, KEY, _payload())
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, blob[:cut])


def test_trailing_garbage_is_detected():
    blob = encode_block(SPEC, KEY, _payload())
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, blob + b"\0")


def test_block_of_another_model_fingerprint_is_rejected():
    other = BlockSpec("fp-other-x", SPEC.num_layers, SPEC.block_size, SPEC.width, SPEC.dtype)
    assert len(other.fingerprint) == len(SPEC.fingerprint)  # same length: only the bytes differ
    blob = encode_block(other, KEY, _payload())
    with pytest.raises(BlockFormatError, match="fingerprint"):
        decode_block(SPEC, KEY, blob)


def test_block_stored_under_another_key_is_rejected():
    blob = encode_block(SPEC, "a1b2c4", _payload())
    with pytest.raises(BlockFormatError, match="key"):
        decode_block(SPEC, KEY, blob)


@pytest.mark.parametrize(
    "field,value", [("num_layers", 4), ("block_size", 2), ("width", 16), ("dtype", "bfloat16")]
)
def test_header_that_disagrees_with_the_readers_shape_is_rejected(field, value):
    fields = {
        "fingerprint": SPEC.fingerprint,
        "num_layers": SPEC.num_layers,
        "block_size": SPEC.block_size,
        "width": SPEC.width,
        "dtype": SPEC.dtype,
    }
    writer = BlockSpec(**{**fields, field: value})
    blob = encode_block(writer, KEY, _payload(writer))
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, blob)


def test_hostile_length_fields_do_not_decide_a_read_size():
    # A block that claims a huge payload but has the right total size fails on the header
    # check instead of slicing or allocating what the header says.
    blob = bytearray(encode_block(SPEC, KEY, _payload()))
    blob[24:32] = (2**62).to_bytes(8, "little")
    with pytest.raises(BlockFormatError, match="header mismatch"):
        decode_block(SPEC, KEY, bytes(blob))


def test_encoding_a_payload_of_the_wrong_size_is_refused():
    with pytest.raises(BlockFormatError):
        encode_block(SPEC, KEY, b"\0" * (SPEC.payload_nbytes - 1))


MAC = derive_mac_key(b"shared secret")


def test_authenticated_round_trip_returns_the_same_payload():
    payload = _payload()
    blob = encode_block(SPEC, KEY, payload, MAC)
    assert len(blob) == SPEC.encoded_nbytes(KEY, MAC)
    assert bytes(decode_block(SPEC, KEY, blob, MAC)) == payload


def test_block_authenticated_under_another_secret_is_rejected():
    blob = encode_block(SPEC, KEY, _payload(), derive_mac_key(b"attacker's guess"))
    with pytest.raises(BlockFormatError, match="MAC"):
        decode_block(SPEC, KEY, blob, MAC)


def test_checksummed_block_is_rejected_where_a_mac_is_expected_and_vice_versa():
    with pytest.raises(BlockFormatError, match="version"):
        decode_block(SPEC, KEY, encode_block(SPEC, KEY, _payload()) + b"\0" * 24, MAC)
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, encode_block(SPEC, KEY, _payload(), MAC))


@pytest.mark.parametrize("offset", [0, 8, 40, -40, -1])
def test_a_flipped_byte_in_an_authenticated_block_is_detected(offset):
    blob = bytearray(encode_block(SPEC, KEY, _payload(), MAC))
    blob[offset] ^= 0x01
    with pytest.raises(BlockFormatError):
        decode_block(SPEC, KEY, bytes(blob), MAC)


def test_derived_mac_key_differs_from_the_secret_and_is_stable():
    assert derive_mac_key(b"s") == derive_mac_key(b"s") != derive_mac_key(b"t")
    assert derive_mac_key(b"s") != b"s"
    with pytest.raises(ValueError):
        derive_mac_key(b"")
