"""Prism hybrid emulation, Python side: the protocol v1 codec and a real rank's client
(standard library only), a torch.distributed backend and a launcher (need torch).

See docs/emulate.md, "Python client".
"""

from .protocol import (  # noqa: F401
    MAX_FRAME,
    PROTOCOL_VERSION,
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
    encode_frame,
    read_frame,
    read_frames,
)
from .client import Client, EmulationError, EmulationFault  # noqa: F401
