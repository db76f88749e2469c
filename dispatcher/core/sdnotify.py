"""The systemd notify protocol: READY, STATUS, WATCHDOG and STOPPING datagrams."""

from __future__ import annotations

import contextlib
import os
import socket

from dispatcher.text import is_count


class Notifier:
    """Send state to systemd when ``$NOTIFY_SOCKET`` is set; do nothing otherwise."""

    def __init__(self) -> None:
        addr = os.environ.get("NOTIFY_SOCKET")
        self._addr: str | None = None
        self._sock: socket.socket | None = None
        if addr:
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        self.watchdog_interval_s: float | None = None
        self._stopping = False
        if usec and is_count(usec) and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2_000_000

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, message: str) -> None:
        """Send one notify datagram; errors are ignored (systemd may be gone)."""
        if self._sock is None or self._addr is None:
            return
        with contextlib.suppress(OSError):
            self._sock.sendto(message.encode(), self._addr)

    def ready(self) -> None:
        self.send("READY=1")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        """Say STOPPING=1, once."""
        if not self._stopping:
            self._stopping = True
            self.send("STOPPING=1")
