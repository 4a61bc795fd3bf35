"""Prism emulation wire protocol, version 1 (docs/emulate.md), standard library only.

A frame is a 4-byte big-endian payload length N (1 <= N <= MAX_FRAME) and N bytes of one
protobuf-encoded Envelope: field 1 ``version`` (uint32), then one body (fields 2-7). The
encoder writes exactly the bytes the Rust side (prost) writes: fields in number order, proto3
defaults (0, 0.0, empty) left out, repeated uint32 packed, the body always present. The decoder
skips unknown fields and accepts packed and unpacked repeated fields.
"""

import struct
from dataclasses import dataclass, field
from typing import List, Optional, Union

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20


class Op:
    UNSPECIFIED = 0
    ALL_REDUCE = 1
    REDUCE_SCATTER = 2
    ALL_GATHER = 3
    ALL_TO_ALL = 4
    BROADCAST = 5
    SEND = 6
    RECV = 7
    BARRIER = 8


class DType:
    BYTES = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    F64 = 4
    I32 = 5
    I64 = 6
    U8 = 7


class ReduceOp:
    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3
    PRODUCT = 4


class ProtocolError(Exception):
    """A frame that cannot be read or written; the message says which rule it broke."""


@dataclass
class Hello:
    rank: int = 0
    world_size: int = 0
    client: str = ""


@dataclass
class Welcome:
    world_size: int = 0
    real_ranks: List[int] = field(default_factory=list)


@dataclass
class Call:
    seq: int = 0
    op: int = 0
    group: List[int] = field(default_factory=list)
    bytes: int = 0
    dtype: int = 0
    reduce: int = 0
    peer: int = 0
    data: bytes = b""
    compute_s: float = 0.0


@dataclass
class Done:
    seq: int = 0
    emulated_end_s: float = 0.0
    data: bytes = b""


@dataclass
class Fault:
    rank: int = 0
    group: List[int] = field(default_factory=list)
    op_index: int = 0
    message: str = ""


@dataclass
class Bye:
    compute_s: float = 0.0
    peak_memory_bytes: int = 0


Body = Union[Hello, Welcome, Call, Done, Fault, Bye]

# Envelope field number of each body, and each body's fields: (number, name, kind).
BODY_FIELD = {Hello: 2, Welcome: 3, Call: 4, Done: 5, Fault: 6, Bye: 7}
FIELD_BODY = {v: k for k, v in BODY_FIELD.items()}
SCHEMA = {
    Hello: [(1, "rank", "uint"), (2, "world_size", "uint"), (3, "client", "string")],
    Welcome: [(1, "world_size", "uint"), (2, "real_ranks", "packed")],
    Call: [
        (1, "seq", "uint"),
        (2, "op", "enum"),
        (3, "group", "packed"),
        (4, "bytes", "uint"),
        (5, "dtype", "enum"),
        (6, "reduce", "enum"),
        (7, "peer", "uint"),
        (8, "data", "bytes"),
        (9, "compute_s", "double"),
    ],
    Done: [(1, "seq", "uint"), (2, "emulated_end_s", "double"), (3, "data", "bytes")],
    Fault: [
        (1, "rank", "uint"),
        (2, "group", "packed"),
        (3, "op_index", "uint"),
        (4, "message", "string"),
    ],
    Bye: [(1, "compute_s", "double"), (2, "peak_memory_bytes", "uint")],
}


def encode_varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer below 2**64."""
    if value < 0 or value >= 1 << 64:
        raise ProtocolError(f"varint out of range: {value}")
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def decode_varint(buf: bytes, pos: int):
    """Returns (value, next position); raises ProtocolError on a truncated or overlong varint."""
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ProtocolError("malformed frame: truncated varint")
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise ProtocolError("malformed frame: varint overflows 64 bits")
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtocolError("malformed frame: varint longer than 10 bytes")


def _key(number: int, wire: int) -> bytes:
    return encode_varint((number << 3) | wire)


def encode_message(msg) -> bytes:
    """The protobuf encoding of one body message."""
    out = bytearray()
    for number, name, kind in SCHEMA[type(msg)]:
        v = getattr(msg, name)
        if kind in ("uint", "enum"):
            if v:
                out += _key(number, 0) + encode_varint(int(v))
        elif kind == "double":
            if v != 0.0:
                out += _key(number, 1) + struct.pack("<d", float(v))
        elif kind == "string":
            if v:
                b = v.encode("utf-8")
                out += _key(number, 2) + encode_varint(len(b)) + b
        elif kind == "bytes":
            if v:
                b = bytes(v)
                out += _key(number, 2) + encode_varint(len(b)) + b
        elif kind == "packed":
            if v:
                b = b"".join(encode_varint(int(x)) for x in v)
                out += _key(number, 2) + encode_varint(len(b)) + b
    return bytes(out)


def _fields(buf: bytes):
    """Yields (number, wire type, value) of each field; value is an int or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = decode_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtocolError("malformed frame: field number 0")
        if wire == 0:
            v, pos = decode_varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ProtocolError("malformed frame: truncated 64-bit field")
            v = buf[pos : pos + 8]
            pos += 8
        elif wire == 2:
            n, pos = decode_varint(buf, pos)
            if pos + n > len(buf):
                raise ProtocolError("malformed frame: truncated length-delimited field")
            v = buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ProtocolError("malformed frame: truncated 32-bit field")
            v = buf[pos : pos + 4]
            pos += 4
        else:
            raise ProtocolError(f"malformed frame: wire type {wire}")
        yield number, wire, v


def decode_message(cls, buf: bytes):
    """Decodes one body message of type ``cls``."""
    schema = {number: (name, kind) for number, name, kind in SCHEMA[cls]}
    msg = cls()
    for number, wire, v in _fields(buf):
        if number not in schema:
            continue  # unknown field: a later version's addition
        name, kind = schema[number]
        if kind in ("uint", "enum") and wire == 0:
            if kind == "uint" and name not in ("seq", "bytes", "op_index", "peak_memory_bytes"):
                v &= 0xFFFFFFFF  # uint32 fields keep the low 32 bits
            if kind == "enum":
                v &= 0xFFFFFFFF
                if v >= 1 << 31:
                    v -= 1 << 32
            setattr(msg, name, v)
        elif kind == "double" and wire == 1:
            setattr(msg, name, struct.unpack("<d", v)[0])
        elif kind == "string" and wire == 2:
            try:
                setattr(msg, name, v.decode("utf-8"))
            except UnicodeDecodeError:
                raise ProtocolError(f"malformed frame: {name} is not UTF-8") from None
        elif kind == "bytes" and wire == 2:
            setattr(msg, name, bytes(v))
        elif kind == "packed" and wire == 2:
            pos = 0
            vals = getattr(msg, name)
            while pos < len(v):
                x, pos = decode_varint(v, pos)
                vals.append(x & 0xFFFFFFFF)
        elif kind == "packed" and wire == 0:
            getattr(msg, name).append(v & 0xFFFFFFFF)
        else:
            raise ProtocolError(f"malformed frame: field {name} has wire type {wire}")
    return msg


def encode_frame(body: Body) -> bytes:
    """One frame (length prefix included) holding ``body`` in an Envelope of this version."""
    if type(body) not in BODY_FIELD:
        raise ProtocolError(f"not a message body: {type(body).__name__}")
    inner = encode_message(body)
    payload = (
        _key(1, 0)
        + encode_varint(PROTOCOL_VERSION)
        + _key(BODY_FIELD[type(body)], 2)
        + encode_varint(len(inner))
        + inner
    )
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME} bytes")
    return struct.pack(">I", len(payload)) + payload


def decode_payload(payload: bytes) -> Body:
    """The body of one frame's payload (the Envelope)."""
    version = 0
    body = None
    for number, wire, v in _fields(payload):
        if number == 1 and wire == 0:
            version = v & 0xFFFFFFFF
        elif number in FIELD_BODY and wire == 2:
            body = decode_message(FIELD_BODY[number], v)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this build speaks version {PROTOCOL_VERSION})"
        )
    if body is None:
        raise ProtocolError("frame without a message body")
    return body


def _read_full(read, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = read(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_frame(read) -> Optional[Body]:
    """Reads one frame with ``read(n)`` (a file's read or a socket's recv): None at a clean end
    of stream, the body otherwise; a short, empty, oversized, malformed or other-version frame
    raises ProtocolError."""
    head = _read_full(read, 4)
    if not head:
        return None
    if len(head) < 4:
        raise ProtocolError(f"truncated frame: the stream ended after {len(head)} of 4 bytes")
    (n,) = struct.unpack(">I", head)
    if n == 0:
        raise ProtocolError("empty frame: a frame holds at least one byte")
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME} bytes")
    payload = _read_full(read, n)
    if len(payload) < n:
        raise ProtocolError(
            f"truncated frame: the stream ended after {4 + len(payload)} of {4 + n} bytes"
        )
    return decode_payload(payload)


def read_frames(data: bytes) -> List[Body]:
    """Every frame of ``data`` (a recorded trace, for instance)."""
    pos = [0]

    def read(n):
        chunk = data[pos[0] : pos[0] + n]
        pos[0] += len(chunk)
        return chunk

    out = []
    while True:
        b = read_frame(read)
        if b is None:
            return out
        out.append(b)
