"""A mock coordinator for the tests: one connection, Welcome, then an answer per Call."""

import os
import socket
import tempfile
import threading

from prism_emulate.protocol import Bye, Call, Welcome, encode_frame, read_frame


class MockCoordinator:
    """Serves one rank on a Unix socket. ``answer(call)`` returns the body to send back, or
    None to stay silent. Records the calls and the final Bye."""

    def __init__(self, world_size, answer, real_ranks=None):
        self.dir = tempfile.mkdtemp(prefix="prism-py-")
        self.path = os.path.join(self.dir, "coord.sock")
        self.address = "unix:" + self.path
        self.world_size = world_size
        self.answer = answer
        self.real_ranks = real_ranks
        self.calls = []
        self.hello = None
        self.bye = None
        self.error = None
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            conn, _ = self.srv.accept()
            conn.settimeout(10)
            with conn:
                self.hello = read_frame(conn.recv)
                ranks = self.real_ranks if self.real_ranks is not None else [self.hello.rank]
                conn.sendall(encode_frame(Welcome(world_size=self.world_size, real_ranks=ranks)))
                while True:
                    body = read_frame(conn.recv)
                    if body is None:
                        return
                    if isinstance(body, Bye):
                        self.bye = body
                        return
                    assert isinstance(body, Call), body
                    self.calls.append(body)
                    reply = self.answer(body)
                    if reply is None:
                        threading.Event().wait(1.0)
                        return
                    conn.sendall(encode_frame(reply))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def close(self):
        self.thread.join(10)
        self.srv.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass
