"""The stdlib client against a mock coordinator, and a recorded trace of the Rust worker read
by the Python codec."""

import os
import struct
import subprocess
import tempfile
import unittest

from prism_emulate.client import Client, EmulationError, EmulationFault, expected_output_len
from prism_emulate.protocol import Bye, Call, Done, DType, Fault, Hello, Op, ReduceOp, read_frames
from tests.mock import MockCoordinator


def doubled(call):
    """The virtual-contribution rule for a group of two with one real rank: the virtual peer
    contributes a copy, so a sum doubles each f32."""
    if call.op == Op.ALL_REDUCE:
        vals = struct.unpack(f"<{len(call.data) // 4}f", call.data)
        data = struct.pack(f"<{len(vals)}f", *[2 * v for v in vals])
    elif call.op == Op.RECV:
        data = bytes(call.bytes)
    else:
        data = b""
    return Done(seq=call.seq, emulated_end_s=0.5 * (call.seq + 1), data=data)


class ClientSession(unittest.TestCase):
    def test_calls_block_for_done_and_carry_compute(self):
        m = MockCoordinator(4, doubled)
        try:
            c = Client.connect(m.address, rank=1, world_size=4, timeout=5)
            self.assertEqual(c.welcome.real_ranks, [1])
            d = c.call(Op.ALL_REDUCE, group=[0, 1], data=struct.pack("<2f", 1.5, -2.0), dtype=DType.F32)
            self.assertEqual(struct.unpack("<2f", d.data), (3.0, -4.0))
            sum(i * i for i in range(200000))  # some compute between calls
            d = c.call(Op.RECV, peer=3, nbytes=12, dtype=DType.F32)
            self.assertEqual(d.data, bytes(12))
            self.assertEqual(c.last_end_s, 1.0)
            c.bye(peak_memory_bytes=77)
        finally:
            m.close()
        self.assertIsNone(m.error)
        self.assertEqual(m.hello, Hello(rank=1, world_size=4, client="prism-python 0.1"))
        self.assertEqual([x.seq for x in m.calls], [0, 1])
        self.assertEqual(m.calls[0].group, [0, 1])
        self.assertEqual(m.calls[0].bytes, 8)
        self.assertEqual(m.calls[1].peer, 3)
        self.assertEqual(m.calls[1].bytes, 12)
        self.assertEqual(m.calls[1].data, b"")
        self.assertGreater(m.calls[1].compute_s, 0.0, "the loop's CPU time")
        self.assertEqual(m.bye.peak_memory_bytes, 77)

    def test_fault_names_rank_group_and_op(self):
        def answer(call):
            return Fault(rank=2, group=list(call.group), op_index=call.seq, message="bytes differ from the graph")

        m = MockCoordinator(4, answer)
        try:
            c = Client.connect(m.address, rank=2, world_size=4, timeout=5)
            with self.assertRaises(EmulationFault) as e:
                c.call(Op.BARRIER, group=[2, 3])
            c.close()
        finally:
            m.close()
        self.assertEqual(e.exception.fault.op_index, 0)
        self.assertIn("rank 2, group [2, 3], op 0: bytes differ", str(e.exception))

    def test_silence_is_a_bounded_time_out(self):
        m = MockCoordinator(2, lambda call: None)
        try:
            c = Client.connect(m.address, rank=0, world_size=2, timeout=0.2)
            with self.assertRaisesRegex(EmulationError, r"rank 0, op 0: no answer from the coordinator within 0.2 s"):
                c.call(Op.BARRIER, group=[0, 1])
            c.close()
        finally:
            m.close()

    def test_wrong_world_and_no_coordinator(self):
        m = MockCoordinator(16, doubled)
        try:
            with self.assertRaisesRegex(EmulationError, "world of 16, this rank believes in 8"):
                Client.connect(m.address, rank=0, world_size=8, timeout=5)
        finally:
            m.close()
        with self.assertRaisesRegex(EmulationError, "cannot connect to the coordinator"):
            Client.connect("unix:/nonexistent/x.sock", 0, 2, connect_timeout=0.05)
        with self.assertRaisesRegex(EmulationError, "expected unix:PATH or tcp:HOST:PORT"):
            Client.connect("nowhere", 0, 2)

    def test_output_lengths(self):
        self.assertEqual(expected_output_len(Op.ALL_GATHER, 8, 4), 32)
        self.assertEqual(expected_output_len(Op.REDUCE_SCATTER, 8, 4), 2)
        self.assertEqual(expected_output_len(Op.SEND, 8, 2), 0)


@unittest.skipUnless(os.environ.get("PRISM_GPT_WORKER"), "PRISM_GPT_WORKER (the Rust worker binary) not given")
class RustTrace(unittest.TestCase):
    def test_reads_a_trace_the_rust_worker_recorded(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank3.trace")
            env = dict(os.environ, PRISM_RANK="3", PRISM_WORLD_SIZE="4", PRISM_LAYOUT="2,2,1")
            subprocess.run(
                [os.environ["PRISM_GPT_WORKER"], "--record", path, "--iters", "1", "--warmup", "0",
                 "--hidden", "16", "--heads", "4", "--ffn", "32", "--layers", "2", "--seq", "8",
                 "--vocab", "32", "--micro-batches", "2"],
                env=env, check=True, capture_output=True, timeout=120,
            )
            with open(path, "rb") as f:
                frames = read_frames(f.read())
        self.assertEqual(frames[0].rank, 3)
        self.assertEqual(frames[0].world_size, 4)
        calls = frames[1:-1]
        self.assertTrue(all(isinstance(c, Call) for c in calls))
        self.assertEqual([c.seq for c in calls], list(range(len(calls))))
        # Rank 3 = tp 1 of the last stage: per micro-batch a receive from rank 1, two TP
        # all-reduces per layer forward and backward, a send back; then no DP all-reduce (dp 1).
        self.assertEqual(sum(c.op == Op.RECV for c in calls), 2)
        self.assertEqual(sum(c.op == Op.SEND for c in calls), 2)
        self.assertEqual(sum(c.op == Op.ALL_REDUCE for c in calls), 2 * 1 * 4)
        self.assertTrue(all(c.peer == 1 for c in calls if c.op in (Op.SEND, Op.RECV)))
        self.assertTrue(all(c.group == [2, 3] for c in calls if c.op == Op.ALL_REDUCE))
        self.assertTrue(all(c.bytes == 8 * 16 * 4 for c in calls))
        self.assertTrue(all(c.reduce == ReduceOp.SUM and c.dtype == DType.F32 for c in calls))
        self.assertIsInstance(frames[-1], Bye)
        self.assertGreater(frames[-1].peak_memory_bytes, 0)


if __name__ == "__main__":
    unittest.main()
