"""The stdlib protocol codec: golden frames from the Rust encoder, round trips, bad frames."""

import os
import random
import struct
import unittest

from prism_emulate.protocol import (
    MAX_FRAME,
    Bye,
    Call,
    Done,
    DType,
    Fault,
    Hello,
    Op,
    ProtocolError,
    ReduceOp,
    Welcome,
    decode_varint,
    encode_frame,
    encode_varint,
    read_frame,
    read_frames,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "frames.bin")

# The values crates/prism-emulate/tests/python.rs encodes into golden/frames.bin.
SAMPLES = [
    Hello(rank=5, world_size=8192, client="prism-rust 0.1 \u03bb"),
    Welcome(world_size=65536, real_ranks=[0, 5, 300, 65535]),
    Call(
        seq=17,
        op=Op.ALL_REDUCE,
        group=[0, 1, 2, 3],
        bytes=8,
        dtype=DType.F32,
        reduce=ReduceOp.AVG,
        peer=0,
        data=bytes([0, 0, 128, 63, 0, 0, 0, 64]),
        compute_s=0.0125,
    ),
    Call(
        seq=2**64 - 1,
        op=Op.RECV,
        group=[],
        bytes=1 << 40,
        dtype=DType.BF16,
        reduce=ReduceOp.SUM,
        peer=2**32 - 1,
        data=b"",
        compute_s=-2.5e-300,
    ),
    Done(seq=17, emulated_end_s=1.5, data=bytes([1, 2, 3])),
    Fault(rank=3, group=[2, 3], op_index=9, message="never arrived"),
    Bye(),
    Bye(compute_s=0.75, peak_memory_bytes=123456789012),
]


def reader(data):
    pos = [0]

    def read(n):
        chunk = data[pos[0] : pos[0] + n]
        pos[0] += len(chunk)
        return chunk

    return read


class GoldenFrames(unittest.TestCase):
    def test_decodes_the_rust_encoders_frames(self):
        with open(GOLDEN, "rb") as f:
            data = f.read()
        self.assertEqual(read_frames(data), SAMPLES)

    def test_encodes_the_same_bytes_as_rust(self):
        with open(GOLDEN, "rb") as f:
            data = f.read()
        self.assertEqual(b"".join(encode_frame(s) for s in SAMPLES), data)

    def test_empty_bye_is_the_documented_bytes(self):
        self.assertEqual(encode_frame(Bye()), bytes([0, 0, 0, 4, 8, 1, 0x3A, 0]))


class Codec(unittest.TestCase):
    def test_varints_round_trip(self):
        for v in [0, 1, 127, 128, 300, 2**32 - 1, 2**32, 2**63, 2**64 - 1]:
            b = encode_varint(v)
            self.assertEqual(decode_varint(b, 0), (v, len(b)))
        for bad in [-1, 2**64]:
            with self.assertRaises(ProtocolError):
                encode_varint(bad)
        with self.assertRaises(ProtocolError):
            decode_varint(b"\xff" * 10 + b"\x01", 0)
        with self.assertRaises(ProtocolError):
            decode_varint(b"\x80", 0)

    def test_random_calls_round_trip(self):
        rng = random.Random(5)
        for _ in range(300):
            c = Call(
                seq=rng.randrange(2**64),
                op=rng.randrange(9),
                group=[rng.randrange(2**32) for _ in range(rng.randrange(5))],
                bytes=rng.randrange(2**64),
                dtype=rng.randrange(8),
                reduce=rng.randrange(5),
                peer=rng.randrange(2**32),
                data=bytes(rng.randrange(256) for _ in range(rng.randrange(20))),
                compute_s=rng.choice([0.0, rng.random(), -rng.random() * 1e9]),
            )
            self.assertEqual(read_frame(reader(encode_frame(c))), c)

    def test_every_truncation_is_an_error(self):
        frame = encode_frame(SAMPLES[2])
        self.assertIsNone(read_frame(reader(b"")))
        for k in range(1, len(frame)):
            with self.assertRaises(ProtocolError) as e:
                read_frame(reader(frame[:k]))
            self.assertIn("truncated frame", str(e.exception))

    def test_bad_frames_are_refused_by_name(self):
        with self.assertRaisesRegex(ProtocolError, "empty frame"):
            read_frame(reader(b"\0\0\0\0"))
        with self.assertRaisesRegex(ProtocolError, "exceeds the limit"):
            read_frame(reader(struct.pack(">I", MAX_FRAME + 1)))
        v2 = bytes([8, 2, 0x3A, 0])
        with self.assertRaisesRegex(ProtocolError, "protocol version 2 is not supported"):
            read_frame(reader(struct.pack(">I", len(v2)) + v2))
        nobody = bytes([8, 1])
        with self.assertRaisesRegex(ProtocolError, "without a message body"):
            read_frame(reader(struct.pack(">I", 2) + nobody))
        bad = bytes([8, 1, 0x3A, 5, 1])
        with self.assertRaisesRegex(ProtocolError, "malformed"):
            read_frame(reader(struct.pack(">I", len(bad)) + bad))

    def test_unknown_fields_are_skipped(self):
        # Hello with an extra field 15 (varint 7) and field 16 (bytes) a later version may add.
        inner = bytes([8, 5, 0x78, 7, 0x82, 1, 2, 0xAA, 0xBB])
        env = bytes([8, 1, 0x12, len(inner)]) + inner
        self.assertEqual(read_frame(reader(struct.pack(">I", len(env)) + env)), Hello(rank=5))

    def test_random_bytes_raise_only_protocol_errors(self):
        rng = random.Random(9)
        for _ in range(2000):
            n = rng.randrange(1, 40)
            payload = bytes(rng.randrange(256) for _ in range(n))
            try:
                read_frame(reader(struct.pack(">I", n) + payload))
            except ProtocolError:
                pass


if __name__ == "__main__":
    unittest.main()
