"""The torch.distributed backend against a mock coordinator (skipped without torch)."""

import os
import struct
import unittest

try:
    import torch
    import torch.distributed as dist

    HAVE_TORCH = True
except ImportError:  # the CI image has no torch
    HAVE_TORCH = False

from prism_emulate.protocol import Done, Op
from tests.mock import MockCoordinator


def answer(call):
    """World of 2, rank 0 real, rank 1 virtual contributing a copy: sums double, gathers
    repeat, broadcasts echo, receives are zeros."""
    if call.op == Op.ALL_REDUCE:
        n = len(call.data) // 4
        data = struct.pack(f"<{n}f", *[2 * v for v in struct.unpack(f"<{n}f", call.data)])
    elif call.op == Op.ALL_GATHER:
        data = call.data * 2
    elif call.op == Op.BROADCAST:
        data = call.data
    elif call.op == Op.RECV:
        data = bytes(call.bytes)
    else:
        data = b""
    return Done(seq=call.seq, emulated_end_s=0.0, data=data)


@unittest.skipUnless(HAVE_TORCH, "torch is not importable: torch backend tests skipped")
class TorchBackend(unittest.TestCase):
    def test_unmodified_calls_reach_the_coordinator(self):
        from prism_emulate import launch, torch_backend

        m = MockCoordinator(2, answer)
        os.environ.update(PRISM_COORDINATOR=m.address, PRISM_RANK="0", PRISM_WORLD_SIZE="2")
        try:
            launch.install()
            dist.init_process_group("nccl")
            self.assertEqual(dist.get_backend(), "prism")
            t = torch.tensor([1.0, 2.5])
            dist.all_reduce(t)
            self.assertEqual(t.tolist(), [2.0, 5.0])
            outs = [torch.zeros(2), torch.zeros(2)]
            dist.all_gather(outs, torch.tensor([3.0, 4.0]))
            self.assertEqual([o.tolist() for o in outs], [[3.0, 4.0], [3.0, 4.0]])
            b = torch.tensor([7.0])
            dist.broadcast(b, src=0)
            r = torch.ones(3)
            dist.recv(r, src=1)
            self.assertEqual(r.tolist(), [0.0, 0.0, 0.0])
            dist.barrier()
            dist.destroy_process_group()
            torch_backend.close_session(peak_memory_bytes=5)
        finally:
            m.close()
        self.assertIsNone(m.error)
        self.assertEqual([c.op for c in m.calls][:3], [Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST])
        self.assertEqual(m.calls[0].group, [0, 1])
        self.assertEqual(m.bye.peak_memory_bytes, 5)


if __name__ == "__main__":
    unittest.main()
