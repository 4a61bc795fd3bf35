"""A real rank's session with the emulation coordinator (protocol v1), standard library only.

    c = Client.connect("unix:/tmp/prism.sock", rank=0, world_size=8)
    done = c.call(Op.ALL_REDUCE, group=[0, 1], data=payload, dtype=DType.F32)
    c.bye(peak_memory_bytes=...)

``call`` measures the compute since the previous call's release as this thread's CPU time
(``time.thread_time``) unless ``compute_s`` is given, sends the Call and blocks until the Done
of the same seq; a Fault from the coordinator raises EmulationFault naming its rank, group and
op index. Every wait is bounded by ``timeout``.
"""

import os
import socket
import time
from typing import List, Optional, Sequence

from .protocol import (
    Bye,
    Call,
    Done,
    Fault,
    Hello,
    Op,
    ProtocolError,
    Welcome,
    encode_frame,
    read_frame,
)

CLIENT_NAME = "prism-python 0.1"


class EmulationError(Exception):
    """A failed session or call; the message names the rank and op index."""


class EmulationFault(EmulationError):
    """The coordinator ended the session with a Fault."""

    def __init__(self, fault: Fault):
        self.fault = fault
        super().__init__(
            f"fault from the coordinator: rank {fault.rank}, group {list(fault.group)}, "
            f"op {fault.op_index}: {fault.message}"
        )


def open_socket(address: str, connect_timeout: float) -> socket.socket:
    """Connects to ``unix:PATH`` or ``tcp:HOST:PORT`` (retrying until ``connect_timeout``)."""
    deadline = time.monotonic() + connect_timeout
    if address.startswith("unix:") and len(address) > 5:
        family, target = socket.AF_UNIX, address[5:]
    else:
        hp = address[4:] if address.startswith("tcp:") else address
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise EmulationError(f"address {address!r}: expected unix:PATH or tcp:HOST:PORT")
        family, target = socket.AF_INET, (host, int(port))
    while True:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.connect(target)
            if family == socket.AF_INET:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError as e:
            s.close()
            if time.monotonic() >= deadline:
                raise EmulationError(f"cannot connect to the coordinator at {address}: {e}") from None
            time.sleep(0.02)


class Client:
    """One real rank's connection to the coordinator."""

    def __init__(self, sock: socket.socket, rank: int, world_size: int, timeout: float):
        self.sock = sock
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.seq = 0
        self.welcome: Optional[Welcome] = None
        self.last_release = time.thread_time()
        self.last_end_s: Optional[float] = None
        sock.settimeout(timeout)

    @classmethod
    def connect(
        cls,
        address: str,
        rank: int,
        world_size: int,
        timeout: float = 300.0,
        connect_timeout: float = 30.0,
        client: str = CLIENT_NAME,
    ) -> "Client":
        """Opens the session: Hello, then Welcome (a Fault or another world size raises)."""
        c = cls(open_socket(address, connect_timeout), rank, world_size, timeout)
        c._send(Hello(rank=rank, world_size=world_size, client=client))
        reply = c._recv("Welcome")
        if isinstance(reply, Fault):
            c.close()
            raise EmulationFault(reply)
        if not isinstance(reply, Welcome):
            c.close()
            raise EmulationError(f"rank {rank}: expected Welcome, got {type(reply).__name__}")
        if reply.world_size != world_size:
            c.close()
            raise EmulationError(
                f"rank {rank}: the coordinator emulates a world of {reply.world_size}, "
                f"this rank believes in {world_size}"
            )
        c.welcome = reply
        c.last_release = time.thread_time()
        return c

    @classmethod
    def from_env(cls, timeout: Optional[float] = None) -> "Client":
        """Connects with PRISM_COORDINATOR, PRISM_RANK and PRISM_WORLD_SIZE."""
        try:
            addr = os.environ["PRISM_COORDINATOR"]
            rank = int(os.environ["PRISM_RANK"])
            world = int(os.environ["PRISM_WORLD_SIZE"])
        except KeyError as e:
            raise EmulationError(f"{e.args[0]} is not set") from None
        except ValueError as e:
            raise EmulationError(f"PRISM_RANK/PRISM_WORLD_SIZE: {e}") from None
        t = timeout if timeout is not None else float(os.environ.get("PRISM_TIMEOUT_S", "300"))
        return cls.connect(addr, rank, world, timeout=t)

    def _send(self, body) -> None:
        try:
            self.sock.sendall(encode_frame(body))
        except OSError as e:
            raise EmulationError(f"rank {self.rank}: coordinator connection: {e}") from None

    def _recv(self, what: str):
        try:
            body = read_frame(self.sock.recv)
        except socket.timeout:
            raise EmulationError(
                f"rank {self.rank}, op {self.seq}: no answer from the coordinator within "
                f"{self.timeout} s (waiting for {what})"
            ) from None
        except (OSError, ProtocolError) as e:
            raise EmulationError(f"rank {self.rank}, op {self.seq}: coordinator connection: {e}") from None
        if body is None:
            raise EmulationError(f"rank {self.rank}, op {self.seq}: the coordinator closed the connection")
        return body

    def call(
        self,
        op: int,
        group: Sequence[int] = (),
        data: bytes = b"",
        nbytes: Optional[int] = None,
        dtype: int = 0,
        reduce: int = 0,
        peer: int = 0,
        compute_s: Optional[float] = None,
    ) -> Done:
        """Sends one Call and waits for its Done. ``nbytes`` defaults to ``len(data)`` (give it
        for a receive, whose data is empty)."""
        now = time.thread_time()
        if compute_s is None:
            compute_s = max(0.0, now - self.last_release)
        n = len(data) if nbytes is None else nbytes
        call = Call(
            seq=self.seq,
            op=op,
            group=list(group),
            bytes=n,
            dtype=dtype,
            reduce=reduce,
            peer=peer,
            data=bytes(data),
            compute_s=compute_s,
        )
        self._send(call)
        reply = self._recv("Done")
        if isinstance(reply, Fault):
            raise EmulationFault(reply)
        if not isinstance(reply, Done):
            raise EmulationError(
                f"rank {self.rank}, op {self.seq}: expected Done, got {type(reply).__name__}"
            )
        if reply.seq != self.seq:
            raise EmulationError(
                f"rank {self.rank}: the coordinator answered op {reply.seq} while op {self.seq} waits"
            )
        self.seq += 1
        self.last_end_s = reply.emulated_end_s
        self.last_release = time.thread_time()
        return reply

    def bye(self, peak_memory_bytes: int = 0, compute_s: Optional[float] = None) -> None:
        """Ends the session cleanly."""
        if compute_s is None:
            compute_s = max(0.0, time.thread_time() - self.last_release)
        self._send(Bye(compute_s=compute_s, peak_memory_bytes=peak_memory_bytes))
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def expected_output_len(op: int, nbytes: int, group_size: int) -> int:
    """Bytes of a call's result: as the Rust client's ``output_len``."""
    g = max(1, group_size)
    if op in (Op.ALL_REDUCE, Op.BROADCAST, Op.RECV, Op.ALL_TO_ALL):
        return nbytes
    if op == Op.ALL_GATHER:
        return nbytes * g
    if op == Op.REDUCE_SCATTER:
        return nbytes // g
    return 0


__all__: List[str] = [
    "Client",
    "EmulationError",
    "EmulationFault",
    "open_socket",
    "expected_output_len",
    "CLIENT_NAME",
]
