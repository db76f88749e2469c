"""The HTTP side of `dispatcher web`: sockets in, ``Request`` to the app, ``Reply`` out.

The standard library's ``ThreadingHTTPServer`` answers each request in a
thread of its own; the work behind a request is blocking reads of folders and
the ledger, which is what threads suit. ``routes.serve`` holds the lifecycle.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import socket
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar, Protocol

import structlog

from dispatcher.text import is_count
from dispatcher.web.auth import is_loopback

log = structlog.get_logger("dispatcher")

DEFAULT_LISTEN = "127.0.0.1:8700"
#: the largest request body read (forms and JSON bodies are small)
MAX_BODY = 1024 * 1024  # a revise note as long as the command takes (it keeps 10,000 characters)
_SECURITY_HEADERS = (
    # nothing from outside the package, no inline script, no framing by another site
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


@dataclass(slots=True)
class Request:
    """What a route needs of one HTTP request."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes = b""


@dataclass(slots=True)
class Reply:
    """One HTTP answer."""

    status: int
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


class Handles(Protocol):
    """What answers the requests (``routes.App``): a plain function of each request."""

    def handle(self, req: Request) -> Reply:
        """Return the answer to one request."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = socket.SOMAXCONN  # the listen backlog: socketserver's 5 reset a burst of 50 requests
    app: Handles
    loopback_only: bool
    name: str = ""  # the --listen host, lower case: the Host header may name it besides a loopback address

    def __init__(self, address: tuple[str, int]) -> None:
        with contextlib.suppress(ValueError):  # a host name such as localhost: IPv4
            self.address_family = socket.AF_INET6 if ipaddress.ip_address(address[0]).version == 6 else socket.AF_INET
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "dispatcher-web"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    _METHODS: ClassVar[tuple[str, ...]] = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")

    def _answer(self) -> None:
        body = self._body()
        if body is None:
            self._send(Reply(413, b'{"error": "request body too large or unreadable"}\n', "application/json"))
            self.close_connection = True
            return
        host = _host_name(self.headers.get("Host") or "")
        if self.server.loopback_only and host and not is_loopback(host) and host.lower() != self.server.name:
            # a page of another site that rebinds its name to 127.0.0.1 would otherwise read this view
            self._send(Reply(421, b"this view answers only to a loopback host name\n", "text/plain; charset=utf-8"))
            return
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() in ("authorization", "cookie")}
        try:
            reply = self.server.app.handle(Request(self.command, self.path, headers, body))
        except Exception as exc:  # noqa: BLE001 - one broken request is answered and logged, the server goes on
            log.error("web.error", path=self.path[:200], error=f"{type(exc).__name__}: {exc}")
            reply = Reply(500, b"internal error; see the log\n", "text/plain; charset=utf-8")
        self._send(reply)

    def _body(self) -> bytes | None:
        """Return the request's body (a Content-Length one or a chunked one), or None if too large or unreadable."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return _read_chunked(self.rfile)
        length = self.headers.get("Content-Length", "0")
        size = int(length) if is_count(length) else -1
        if size < 0 or size > MAX_BODY:
            return None
        return self.rfile.read(size) if size else b""

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        for key, value in (*_SECURITY_HEADERS, *reply.headers):
            if key == "Cache-Control" and any(k == key for k, _ in reply.headers) and value == "no-store":
                continue
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

    def log_message(self, format: str, *args: object) -> None:
        """Say nothing per request (the journal would fill with polling)."""


def _host_name(header: str) -> str:
    """Return the host name of a Host header, without its port: ``[::1]:8700`` and ``[::1]`` are ``::1``."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _read_chunked(stream: io.BufferedIOBase) -> bytes | None:
    """Read a chunked body (RFC 9112, 7.1) of at most MAX_BODY bytes; None if longer or malformed."""
    out = bytearray()
    while True:
        line = stream.readline(1024)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            return None
        if size < 0 or len(out) + size > MAX_BODY:
            return None
        if size == 0:
            while stream.readline(1024) not in (b"\r\n", b"\n", b""):  # trailer fields, up to the blank line
                pass
            return bytes(out)
        out += stream.read(size)
        if stream.readline(1024) not in (b"\r\n", b"\n"):
            return None


def open_server(host: str, port: int, app: Handles, *, loopback_only: bool, name: str = "") -> _Server:
    """Bind host:port for app; raise OSError when the address cannot be bound.

    ``name``: the host name it was asked to listen on, which the Host header may give.
    """
    server = _Server((host, port))
    server.app = app
    server.loopback_only = loopback_only
    server.name = name.lower().removesuffix(".")
    return server
