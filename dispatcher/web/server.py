"""`dispatcher web`: a small HTTP server in its own process, apart from the daemon.

The standard library's ``ThreadingHTTPServer`` answers each request in a
thread of its own; the work behind a request is blocking reads of folders and
the ledger, which is what threads suit. The lifecycle fits on one screen:
check the address and the token, bind, serve in a thread until SIGTERM or
SIGINT, then shut down and close the ledger.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import ClassVar

import structlog

from dispatcher.errors import UsageError
from dispatcher.layout import Layout
from dispatcher.spec.config import Config
from dispatcher.web.auth import Auth, is_loopback, load_token, parse_listen
from dispatcher.web.routes import App, Reply, Request

log = structlog.get_logger("dispatcher")

DEFAULT_LISTEN = "127.0.0.1:8700"
#: the largest request body read (forms and JSON bodies are small)
MAX_BODY = 64 * 1024
_SECURITY_HEADERS = (
    # nothing from outside the package, no inline script, no framing by another site
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    app: App
    loopback_only: bool

    def __init__(self, address: tuple[str, int]) -> None:
        with contextlib.suppress(ValueError):  # a host name such as localhost: IPv4
            self.address_family = socket.AF_INET6 if ipaddress.ip_address(address[0]).version == 6 else socket.AF_INET
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "dispatcher-web"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    _METHODS: ClassVar[tuple[str, ...]] = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")

    def _answer(self) -> None:
        length = self.headers.get("Content-Length", "0")
        size = int(length) if length.isdigit() else -1
        if size < 0 or size > MAX_BODY:
            self._send(Reply(413, b'{"error": "request body too large or unreadable"}\n', "application/json"))
            self.close_connection = True
            return
        body = self.rfile.read(size) if size else b""
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        if self.server.loopback_only and host and not is_loopback(host):
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

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

    def log_message(self, format: str, *args: object) -> None:
        """Say nothing per request (the journal would fill with polling)."""


def serve(config: Config, listen: str | None) -> int:
    """Serve the web view of config's root on listen (ADDR:PORT) until SIGTERM or SIGINT; return 0.

    A non-loopback address without ``web_token_file`` is refused (UsageError,
    exit 2) before anything is bound.
    """
    address = listen or DEFAULT_LISTEN
    host, port = parse_listen(address)
    loopback = is_loopback(host)
    if not loopback and config.web_token_file is None:
        raise UsageError(
            f"web: --listen {address} is not a loopback address: set web_token_file in the config to serve it"
        )
    token = load_token(config)
    app = App(config, Layout(config.root), Auth(token.value))
    try:
        server = _Server((host, port))
    except OSError as exc:
        raise UsageError(f"web: cannot listen on {address}: {exc.strerror or exc}") from None
    server.app = app
    server.loopback_only = loopback
    bound = server.server_address
    bound_host, bound_port = str(bound[0]), int(bound[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"dispatcher web: {config.root} on http://{shown}:{bound_port}/", flush=True)
    if token.made:
        print(f"action token (printed once; set web_token_file to keep one): {token.value}", flush=True)
    log.info("web.started", root=str(config.root), listen=f"{shown}:{bound_port}", token_made=token.made)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="web", daemon=True)
    thread.start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()
        app.close()
        log.info("web.stopped", root=str(config.root))
    return 0
