"""The torch.distributed backend against a mock coordinator (skipped without torch)."""

import os
import struct
import subprocess
import sys
import tempfile
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
    repeat, broadcasts echo, receives are zeros (float32 data)."""
    n = len(call.data) // 4
    vals = struct.unpack(f"<{n}f", call.data[: 4 * n])
    if call.op == Op.ALL_REDUCE:
        data = struct.pack(f"<{n}f", *[2 * v for v in vals])
    elif call.op == Op.REDUCE_SCATTER:
        half = vals[: n // 2]  # group index 0's chunk
        data = struct.pack(f"<{len(half)}f", *[2 * v for v in half])
    elif call.op == Op.ALL_TO_ALL:
        data = call.data[: len(call.data) // 2] * 2
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
            rs = torch.zeros(2)
            dist.reduce_scatter_tensor(rs, torch.tensor([1.0, 2.0, 3.0, 4.0]))
            self.assertEqual(rs.tolist(), [2.0, 4.0])
            ag = torch.zeros(4)
            dist.all_gather_into_tensor(ag, torch.tensor([5.0, 6.0]))
            self.assertEqual(ag.tolist(), [5.0, 6.0, 5.0, 6.0])
            a2a = torch.zeros(4)
            dist.all_to_all_single(a2a, torch.tensor([1.0, 2.0, 3.0, 4.0]))
            self.assertEqual(a2a.tolist(), [1.0, 2.0, 1.0, 2.0])
            dist.send(torch.tensor([9.0]), dst=1)
            dist.barrier()
            # DDP: C++ reaches the Python group (broadcast of the states, all-reduce of the
            # gradient buckets); with the virtual rank's copy, the averaged gradient is this
            # rank's own.
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            ref = torch.nn.Linear(3, 2)
            ref.load_state_dict(model.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            x = torch.randn(5, 3)
            ddp(x).square().sum().backward()
            ref(x).square().sum().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                self.assertTrue(torch.allclose(p.grad, q.grad), (p.grad, q.grad))
            dist.destroy_process_group()
            torch_backend.close_session(peak_memory_bytes=5)
        finally:
            m.close()
        self.assertIsNone(m.error)
        ops = [c.op for c in m.calls]
        self.assertEqual(ops[:3], [Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST])
        self.assertIn(Op.SEND, ops)
        self.assertEqual([c.seq for c in m.calls], list(range(len(m.calls))))
        self.assertEqual(m.calls[0].group, [0, 1])
        self.assertEqual(m.bye.peak_memory_bytes, 5)


SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.ones(3)
dist.all_reduce(t)
g = dist.new_group([0, 1], backend="gloo")
dist.all_reduce(t, group=g)
print("RESULT", dist.get_backend(), t.tolist(), flush=True)
dist.destroy_process_group()
"""


@unittest.skipUnless(HAVE_TORCH, "torch is not importable: launcher test skipped")
class Launcher(unittest.TestCase):
    def test_an_unmodified_gloo_script_runs_on_the_coordinator(self):
        m = MockCoordinator(2, answer)
        try:
            with tempfile.TemporaryDirectory() as d:
                script = os.path.join(d, "train.py")
                with open(script, "w") as f:
                    f.write(SCRIPT)
                root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                env = dict(
                    os.environ,
                    PRISM_COORDINATOR=m.address,
                    PRISM_RANK="0",
                    PRISM_WORLD_SIZE="2",
                    PYTHONPATH=root,
                )
                for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
                    env.pop(k, None)
                out = subprocess.run(
                    [sys.executable, "-m", "prism_emulate.launch", script],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
        finally:
            m.close()
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("RESULT prism [4.0, 4.0, 4.0]", out.stdout)
        self.assertIsNone(m.error)
        self.assertEqual([c.group for c in m.calls], [[0, 1], [0, 1]])
        self.assertIsNotNone(m.bye, "the launcher ends the session at exit")


if __name__ == "__main__":
    unittest.main()
