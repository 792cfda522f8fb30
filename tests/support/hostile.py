"""Hypothesis strategies for hostile input at the gateway's edge: well-typed protobuf messages of
any descriptor with extreme values (so a field added to a .proto is fuzzed with no change here),
bytes that are no serialization of them, and JSON bodies that break OpenAI's request shapes."""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor
MANY = (33, 257, 5000)  # lengths of a repeated field or map with "thousands of" elements
HUGE = (4097, 70_000, 4 * 2**20 + 1)  # string lengths; the last is over gRPC's 4 MiB message limit
MAX_DEPTH = 3  # nested messages below it keep their base (reflection's messages nest)

# Pieces of hostile text: NUL, a BOM, right-to-left override, a combining mark, astral emoji, CRLF,
# the model's and its chat template's own markup. Proto strings may hold NUL (it is valid UTF-8),
# but no lone surrogate (protobuf refuses to encode one).
PIECES = ["a", "\x00", " ", "\t", "\r\n", "é", "\u0301", "\u202e", "\ufeff", "😀", "<think>", "</think>",
          "<|im_end|>", "{{ x }}", "%s", "'\""]  # fmt: skip
# Bytes no UTF-8 decoder may take: a stray continuation, a truncated sequence, overlong NUL, an
# encoded surrogate, a code point above U+10FFFF, bytes that never occur.
BAD_UTF8 = [b"\x80", b"\xc3\x28", b"\xe2\x82", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff\xfe"]


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, low + 1, 0, 1, high - 1, high, min(high, 2**31 - 1), min(high, 2**31)})
    return st.one_of(
        st.sampled_from([e for e in edges if low <= e <= high] + [-1] * (low < 0)), st.integers(low, high)
    )


INTEGERS = {
    kind: _integers(low, high)
    for kinds, (low, high) in [
        ((F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32), (-(2**31), 2**31 - 1)),
        ((F.TYPE_UINT32, F.TYPE_FIXED32), (0, 2**32 - 1)),
        ((F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64), (-(2**63), 2**63 - 1)),
        ((F.TYPE_UINT64, F.TYPE_FIXED64), (0, 2**64 - 1)),
    ]
    for kind in kinds
}
FLOAT_EDGES = [0.0, -0.0, -1.0, 1e-45, 0.009, 0.01, 0.5, 1.0, 1.5, 100.0, 100.5, 3.4e38, float("inf"),
               float("-inf"), float("nan")]  # fmt: skip


def text(small: bool = False) -> st.SearchStrategy[str]:
    """Empty, random, or a hostile piece repeated (up to over 4 MiB unless `small`)."""
    lengths = (1, 2, 65) if small else (1, 2, 65, *HUGE)
    repeated = st.builds(operator.mul, st.sampled_from(PIECES), st.sampled_from(lengths))
    return st.one_of(st.just(""), st.text(max_size=16 if small else 64), repeated)


def binary(small: bool = False) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=32), st.just(b"\x00" * (65 if small else HUGE[1])))


def _scalars(field: FieldDescriptor, small: bool) -> st.SearchStrategy[Any]:
    if field.type in INTEGERS:
        return INTEGERS[field.type]
    if field.type == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
    if field.type == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats())
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:  # proto3 enums are open: numbers no value has are valid too
        assert field.enum_type is not None
        return st.sampled_from([v.number for v in field.enum_type.values] + [-1, 99, 2**31 - 1])
    if field.type == F.TYPE_STRING:
        return text(small)
    if field.type == F.TYPE_BYTES:
        return binary(small)
    raise TypeError(f"no strategy for field {field.full_name} of type {field.type}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.is_repeated and field.message_type is not None and field.message_type.GetOptions().map_entry


def _single(
    field: FieldDescriptor, bases: Mapping[str, Message], small: bool, depth: int
) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        return messages(field.message_type, bases, small=small, depth=depth + 1)
    return _scalars(field, small)


def _many_keys(field: FieldDescriptor, n: int) -> list[Any]:
    return [f"k{i}" for i in range(n)] if field.type == F.TYPE_STRING else list(range(n))


def _field_values(
    field: FieldDescriptor, bases: Mapping[str, Message], small: bool, depth: int
) -> st.SearchStrategy[Any]:
    """Values of `field`: a scalar or message, or for a repeated field or map a few hostile elements
    or thousands of them (small ones: a message of thousands of huge strings helps no one). A
    `small` message has a few at most: a stream of thousands of messages of thousands of labels
    each is hundreds of MB, which tests the network, not the gateway."""
    if _is_map(field):
        assert field.message_type is not None
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        values = _single(value, bases, True, depth)
        few = st.dictionaries(_scalars(key, True), values, max_size=4)
        if small:
            return few
        return few | st.builds(
            lambda n, v: dict.fromkeys(_many_keys(key, n), v), st.sampled_from(MANY), values
        )
    if field.is_repeated:
        element = _single(field, bases, True, depth)
        few = st.lists(element, max_size=4)
        if small:
            return few
        return few | st.builds(lambda e, n: [e] * n, element, st.sampled_from(MANY))
    return _single(field, bases, small, depth)


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(message, field.name)
    if _is_map(field):
        target.clear()
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        del target[:]
        target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def messages(
    descriptor: Descriptor, bases: Mapping[str, Message] | None = None, *, small: bool = False, depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`: its base in `bases` (by full name; else the empty message) with any
    of its fields (about one in four) set to a hostile value, nested messages likewise."""
    bases = bases or {}
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        if descriptor.full_name in bases:
            message.CopyFrom(bases[descriptor.full_name])
        for field in descriptor.fields:
            if draw(st.integers(0, 3)) < 3 or (field.message_type is not None and depth >= MAX_DEPTH):
                continue  # shrinks toward the base
            _set(message, field, draw(_field_values(field, bases, small, depth)))
        return message

    return build()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string_paths(descriptor: Descriptor, depth: int = 0) -> list[list[int]]:
    """Field-number paths to every string field of `descriptor`, nested messages (and map entries)
    included, down to MAX_DEPTH."""
    paths: list[list[int]] = []
    for field in descriptor.fields:
        if field.type == F.TYPE_STRING:
            paths.append([field.number])
        elif field.message_type is not None and depth < MAX_DEPTH:
            paths += [[field.number, *p] for p in _string_paths(field.message_type, depth + 1)]
    return paths


def _bad_string(path: list[int], payload: bytes) -> bytes:
    """The serialization of a message whose string field at `path` holds `payload`."""
    for number in reversed(path):
        payload = _length_delimited(number, payload)
    return payload


def undecodable(
    descriptor: Descriptor, bases: Mapping[str, Message] | None = None
) -> st.SearchStrategy[bytes]:
    """Bytes sent as a message of `descriptor` that mostly are none: random bytes, a valid message
    cut short or with a byte flipped, and a valid message followed by a string field (nested ones
    too) whose bytes are not UTF-8, which protobuf must refuse."""
    valid = messages(descriptor, bases, small=True).map(lambda m: m.SerializeToString())
    strategies = [
        st.binary(max_size=64),
        st.builds(lambda b, k: b[: max(len(b) - k, 0)], valid, st.integers(1, 8)),
        st.builds(
            lambda b, i, x: b[:i] + bytes([x]) + b[i + 1 :], valid, st.integers(0, 64), st.integers(0, 255)
        ),
    ]
    if paths := _string_paths(descriptor):
        bad = st.builds(
            lambda b, path, prefix, junk: b + _bad_string(path, prefix.encode() + junk),
            valid, st.sampled_from(paths), st.sampled_from(["", "ok", "\x00"]), st.sampled_from(BAD_UTF8),
        )  # fmt: skip
        strategies.append(bad)
    return st.one_of(strategies)


# JSON

RAW = "\u0001raw{}\u0001"  # a placeholder json.dumps leaves as it is, replaced by raw JSON text after


class Raw(str):
    """JSON text spliced into a body as it is (what json.dumps cannot write: deep nesting)."""


def json_scalars() -> st.SearchStrategy[Any]:
    """Values OpenAI's bodies must refuse or survive: huge and negative numbers, floats NaN and
    infinite, numbers and booleans as strings, text with NUL bytes and lone surrogates (escaped as
    JSON has them, "\\ud800")."""
    surrogates = st.text(
        st.characters(categories=["Cs"]) | st.sampled_from(["a", "\x00"]), min_size=1, max_size=4
    )
    return st.one_of(
        st.none(), st.booleans(),
        st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, 10**30, -(10**30), 0.5, -0.0, 1e308]),
        st.integers(), st.floats(), text(small=True), surrogates,
        st.sampled_from(["1.5", "1", "true", "null", "NaN", "", " "]),
    )  # fmt: skip


def json_values() -> st.SearchStrategy[Any]:
    """A hostile scalar, a small nested structure of them, thousands of elements, or deep nesting."""
    scalars = json_scalars()
    nested = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=6,
    )
    return st.one_of(
        nested,
        st.builds(lambda v, n: [v] * n, scalars, st.sampled_from(MANY)),
        st.builds(lambda n: [f"s{i}" for i in range(n)], st.sampled_from(MANY)),
        st.builds(lambda n: {f"k{i}": "v" for i in range(n)}, st.sampled_from(MANY)),
        st.builds(lambda n: Raw("[" * n + "]" * n), st.sampled_from([64, 1000, 100_000])),
    )


def dumps(value: Any) -> str:
    """`value` as JSON text (NaN and Infinity as Python writes them; lone surrogates escaped), with
    each Raw in it spliced in as it is."""
    raws: list[str] = []

    def placeholder(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(str(v))
            return RAW.format(len(raws) - 1)
        if isinstance(v, dict):
            return {k: placeholder(x) for k, x in v.items()}
        if isinstance(v, list):
            return [placeholder(x) for x in v]
        return v

    out = json.dumps(placeholder(value))
    for i, raw in enumerate(raws):
        out = out.replace(json.dumps(RAW.format(i)), raw)
    return out


def mutated_objects(base: dict[str, Any], names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with some of `names` (a body's documented fields, and some it has not) set to hostile
    JSON values, or removed."""
    keys = st.sampled_from(sorted({*names, *base, "", "\x00", "unknown_field"}))
    removed = object()
    changes = st.dictionaries(keys, st.one_of(json_values(), st.just(removed)), min_size=1, max_size=3)
    return changes.map(lambda c: {k: v for k, v in {**base, **c}.items() if v is not removed})
