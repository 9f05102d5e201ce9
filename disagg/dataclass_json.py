"""JSON for the plain dataclasses that cross a process boundary (SamplingParams, CompletionOutput,
ModelCard, the worker's wire messages in disagg/protocol.py), derived from their fields.

`to_json(obj)` and `from_json(cls, d)` read the class's fields and type hints once and keep a plan
per class, so a new field travels without a hand-written line. The few conversions JSON needs are
declared here, by type: a nested dataclass becomes an object, a tuple an array (and a tuple again),
`dict[int, ...]` keys strings (and ints again). Everything else is passed as it is: a field that is
already a JSON value is not copied (a prompt's token ids are not walked). `from_json` ignores
unknown keys and leaves missing ones to the field's default. Torch-free.

Not here: what a message means or checks (disagg/protocol.py, engine/admission.py).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
Convert = Callable[[Any], Any]
# (field name, encode, decode); None where the value is JSON as it is.
Plan = tuple[tuple[str, Convert | None, Convert | None], ...]


def to_json(obj: Any) -> dict[str, Any]:
    """The dataclass `obj` as a dict of JSON values, one key per field."""
    out = {}
    for name, encode, _ in _plan(type(obj)):
        value = getattr(obj, name)
        out[name] = value if encode is None or value is None else encode(value)
    return out


def from_json(cls: type[T], d: dict[str, Any]) -> T:
    """An instance of the dataclass `cls` from what `to_json` made of one; TypeError (or
    ValueError, AttributeError) when `d` has not that shape."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be a JSON object, not {type(d).__name__}")
    kwargs = {}
    for name, _, decode in _plan(cls):
        if name in d:
            value = d[name]
            kwargs[name] = value if decode is None or value is None else decode(value)
    return cls(**kwargs)


@functools.cache
def _plan(cls: type) -> Plan:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, *_codec(hints[f.name])) for f in dataclasses.fields(cls) if f.init)


def _codec(tp: Any) -> tuple[Convert | None, Convert | None]:
    """(encode, decode) of a value of type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return to_json, functools.partial(from_json, tp)
    if origin in (types.UnionType, typing.Union):  # `X | None`: None passes as it is
        inner = [a for a in args if a is not type(None)]
        return _codec(inner[0]) if len(inner) == 1 else (None, None)
    if origin is tuple:  # of scalars: (5, 6) and (token id, logprob)
        return list, tuple
    if origin is list and args:
        encode, decode = _codec(args[0])
        return _each(encode), _each(decode)
    if origin is dict and args and args[0] is int:  # JSON object keys are strings
        return _str_keys, _int_keys
    return None, None


def _each(convert: Convert | None) -> Convert | None:
    return None if convert is None else lambda values: [convert(v) for v in values]


def _str_keys(d: dict) -> dict:
    return {str(k): v for k, v in d.items()}


def _int_keys(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}
