"""A TCP proxy in front of a server, for tests of a slow or stalled network path (no pytest needed).

``silent()`` holds every byte both ways until ``speak()``, as a stalled path does;
``delay_s`` holds each chunk that long before passing it on, as a slow link does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    """Forward 127.0.0.1:``port`` to (host, port), stalled or slowed on demand."""

    def __init__(self, host: str, port: int, *, delay_s: float = 0.0) -> None:
        self.upstream = (host, port)
        self.delay_s = delay_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def silent(self) -> None:
        """Hold every byte, both ways, from now on."""
        self._open.clear()

    def speak(self) -> None:
        """Pass the held bytes on, and every later one."""
        self._open.set()

    def via(self, dsn: str) -> str:
        """Return a postgresql:// DSN with its port replaced by this proxy's."""
        head, tail = dsn.rsplit(":", 1)
        return f"{head}:{self.port}/{tail.split('/', 1)[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._socks += [client, upstream]
            self._serve(client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        """Pass bytes both ways between a client and its upstream connection (a subclass may do otherwise)."""
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self._open.wait()
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting, pass on what is held, and close every connection."""
        self.speak()
        self.server.close()
        for s in self._socks:
            s.close()
