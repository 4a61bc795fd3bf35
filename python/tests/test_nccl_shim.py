"""The NCCL shim's C ABI (libnccl.so from crates/prism-nccl-shim) loaded with ctypes, against
the mock coordinator. Skipped unless PRISM_NCCL_SHIM names the library (the shim crate's
Rust test sets it)."""

import ctypes
import os
import struct
import unittest

from prism_emulate.protocol import Done, Op
from tests.mock import MockCoordinator

SHIM = os.environ.get("PRISM_NCCL_SHIM")


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def answer(call):
    """World of 2, rank 0 real: a virtual copy doubles sums; broadcasts echo."""
    n = len(call.data) // 4
    vals = struct.unpack(f"<{n}f", call.data)
    if call.op == Op.ALL_REDUCE:
        return Done(seq=call.seq, data=struct.pack(f"<{n}f", *[2 * v for v in vals]))
    if call.op == Op.BROADCAST:
        return Done(seq=call.seq, data=call.data)
    return Done(seq=call.seq)


@unittest.skipUnless(SHIM, "PRISM_NCCL_SHIM not set: NCCL shim ABI test skipped")
class NcclShimAbi(unittest.TestCase):
    def test_c_abi_through_ctypes(self):
        m = MockCoordinator(2, answer)
        os.environ.update(PRISM_COORDINATOR=m.address, PRISM_RANK="0", PRISM_WORLD_SIZE="2")
        try:
            lib = ctypes.CDLL(SHIM)
            vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
            lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
            lib.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
            lib.ncclGetErrorString.restype = ctypes.c_char_p
            lib.ncclGetLastError.restype = ctypes.c_char_p
            v = ctypes.c_int()
            self.assertEqual(lib.ncclGetVersion(ctypes.byref(v)), 0)
            self.assertEqual(v.value, 22809)
            uid = UniqueId()
            self.assertEqual(lib.ncclGetUniqueId(ctypes.byref(uid)), 0)
            comm = ctypes.c_void_p()
            self.assertEqual(lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0), 0)
            rank = ctypes.c_int(-1)
            lib.ncclCommUserRank(comm, ctypes.byref(rank))
            self.assertEqual(rank.value, 0)
            buf = (ctypes.c_float * 3)(1.0, 2.5, -4.0)
            self.assertEqual(lib.ncclAllReduce(buf, buf, 3, 7, 0, comm, None), 0)
            self.assertEqual(list(buf), [2.0, 5.0, -8.0])
            self.assertEqual(lib.ncclBroadcast(buf, buf, 3, 7, 5, comm, None), 4)
            self.assertIn(b"peer 5 outside a communicator of 2", lib.ncclGetLastError(comm))
            self.assertEqual(lib.ncclGetErrorString(4), b"invalid argument")
            self.assertEqual(lib.ncclCommDestroy(comm), 0)
        finally:
            m.close()
        self.assertIsNone(m.error)
        self.assertEqual([c.op for c in m.calls], [Op.ALL_REDUCE])
        self.assertEqual(m.calls[0].group, [0, 1])
        self.assertIsNotNone(m.bye)


if __name__ == "__main__":
    unittest.main()
