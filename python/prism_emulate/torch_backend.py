"""A torch.distributed backend over the emulation coordinator (needs torch; see
docs/emulate.md, "Python client").

``register()`` registers the backend ``prism`` with
``dist.Backend.register_backend("prism", create, extended_api=True, devices=["cpu", "cuda"])``.
Every process group of the process shares one coordinator session (the rank's), opened on
first use from PRISM_COORDINATOR / PRISM_RANK / PRISM_WORLD_SIZE; calls name the group by its
global ranks (``global_ranks_in_group``; the default group is every rank). Each collective
sends the tensor's bytes, blocks until the coordinator's Done (released at the call's emulated
completion) and writes the result back into the tensor; the returned Work is already complete.
"""

import ctypes
import threading

import torch
import torch.distributed as dist

from .client import Client
from .protocol import DType, Op, ReduceOp

_session = None
_session_lock = threading.Lock()


def session() -> Client:
    """The process's coordinator session (opened on first use)."""
    global _session
    with _session_lock:
        if _session is None:
            _session = Client.from_env()
        return _session


def close_session(peak_memory_bytes: int = 0) -> None:
    """Sends Bye (with the peak memory, e.g. torch.cuda.max_memory_allocated()) and closes."""
    global _session
    with _session_lock:
        if _session is not None:
            _session.bye(peak_memory_bytes=peak_memory_bytes)
            _session = None


_DTYPES = {
    torch.float32: DType.F32,
    torch.float16: DType.F16,
    torch.bfloat16: DType.BF16,
    torch.float64: DType.F64,
    torch.int32: DType.I32,
    torch.int64: DType.I64,
    torch.uint8: DType.U8,
}


def _reduce_op(op) -> int:
    table = {
        dist.ReduceOp.SUM: ReduceOp.SUM,
        dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.MIN: ReduceOp.MIN,
        dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    }
    if hasattr(dist.ReduceOp, "AVG"):
        table[dist.ReduceOp.AVG] = ReduceOp.AVG
    for k, v in table.items():
        if op == k:
            return v
    raise ValueError(f"prism backend: unsupported reduction {op}")


def _bytes(t: torch.Tensor) -> bytes:
    c = t.detach().contiguous().cpu()
    return ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())


def _fill(t: torch.Tensor, data: bytes) -> None:
    src = torch.frombuffer(bytearray(data), dtype=t.dtype).reshape(t.shape) if data else None
    if src is not None:
        with torch.no_grad():
            t.copy_(src.to(t.device))


class _DoneWork(dist._Work):
    """A Work that is complete when created."""

    def __init__(self, result=None):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        return self._future


class PrismProcessGroup(dist.ProcessGroup):
    """One process group whose calls go to the coordinator."""

    def __init__(self, rank: int, size: int, global_ranks):
        super().__init__(rank, size)
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))

    def getBackendName(self):
        return "prism"

    # -- helpers
    def _call(self, op, t: torch.Tensor, out: torch.Tensor, reduce=0, peer=0, group=True):
        c = session()
        data = _bytes(t) if op not in (Op.RECV, Op.BARRIER) else b""
        nbytes = t.numel() * t.element_size() if op != Op.BARRIER else 0
        done = c.call(
            op,
            group=self.global_ranks if group else (),
            data=data,
            nbytes=nbytes,
            dtype=_DTYPES.get(t.dtype, DType.BYTES),
            reduce=reduce,
            peer=peer,
        )
        if out is not None:
            _fill(out, done.data)
        return _DoneWork()

    # -- collectives
    def allreduce(self, tensors, opts=None):
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for t in tensors:
            self._call(Op.ALL_REDUCE, t, t, reduce=op)
        return _DoneWork(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            flat = torch.empty(len(outs) * t.numel(), dtype=t.dtype)
            self._call(Op.ALL_GATHER, t, flat)
            for i, o in enumerate(outs):
                o.copy_(flat[i * t.numel() : (i + 1) * t.numel()].reshape(o.shape))
        return _DoneWork(output_tensors)

    def _allgather_base(self, output, input, opts=None):
        self._call(Op.ALL_GATHER, input, output)
        return _DoneWork(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._call(Op.ALL_GATHER, i, o)
        return _DoneWork(outputs)

    all_gather_single = _allgather_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([x.reshape(-1) for x in ins])
            self._call(Op.REDUCE_SCATTER, flat, out, reduce=op)
        return _DoneWork(output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        self._call(Op.REDUCE_SCATTER, input, output, reduce=op)
        return _DoneWork(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return _DoneWork(outputs)

    reduce_scatter_single = _reduce_scatter_base

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if (output_split_sizes and len(set(output_split_sizes)) > 1) or (
            input_split_sizes and len(set(input_split_sizes)) > 1
        ):
            raise ValueError("prism backend: all_to_all with unequal splits is not supported")
        self._call(Op.ALL_TO_ALL, input, output)
        return _DoneWork(output)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty_like(flat_in)
        self._call(Op.ALL_TO_ALL, flat_in, flat_out)
        n = flat_in.numel() // max(1, len(output_tensors))
        for i, o in enumerate(output_tensors):
            o.copy_(flat_out[i * n : (i + 1) * n].reshape(o.shape))
        return _DoneWork(output_tensors)

    def broadcast(self, tensors, opts=None):
        root = self.global_ranks[opts.rootRank if opts is not None else 0]
        for t in tensors:
            self._call(Op.BROADCAST, t, t, peer=root)
        return _DoneWork(tensors)

    def send(self, tensors, dst, tag=0):
        for t in tensors:
            self._call(Op.SEND, t, None, peer=self.global_ranks[dst], group=False)
        return _DoneWork()

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            self._call(Op.RECV, t, t, peer=self.global_ranks[src], group=False)
        return _DoneWork(tensors)

    def barrier(self, opts=None):
        self._call(Op.BARRIER, torch.empty(0, dtype=torch.uint8), None)
        return _DoneWork()


def create(dist_backend_opts, backend_options=None):
    """The creator ``register_backend`` calls with ``extended_api=True``."""
    return PrismProcessGroup(
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        getattr(dist_backend_opts, "global_ranks_in_group", None),
    )


def register(name: str = "prism") -> None:
    """Registers the backend (idempotent)."""
    if name.upper() in dist.Backend.__dict__ or name.lower() in getattr(dist.Backend, "backend_list", []):
        return
    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu", "cuda"])
