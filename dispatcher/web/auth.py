"""Who may act: the action token, login sessions kept in a cookie, and CSRF tokens for forms.

A request acts with ``Authorization: Bearer <token>`` (the API) or with the
session cookie a login with the token gave (the pages' forms, which also carry
a CSRF token tied to that session). Sessions live in this process only: a
restart logs everyone out. Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from dispatcher import fsutil
from dispatcher.errors import ConfigError, UsageError
from dispatcher.spec.settings import Config
from dispatcher.text import is_count

COOKIE = "dispatcher_session"
SESSION_S = 12 * 3600.0
_MAX_SESSIONS = 1000
_MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Token:
    """The action token, and whether it was made at start (then it is printed once)."""

    value: str
    made: bool


def load_token(config: Config) -> Token:
    """Read the token from ``web_token_file``, or make one when the config names none.

    A named file that cannot be read, or that is empty, is a config error
    naming the file and the key.
    """
    path = config.web_token_file
    if path is None:
        return Token(secrets.token_urlsafe(32), made=True)
    where = str(config.path) if config.path else str(path)
    try:
        text = fsutil.read_regular(path, _MAX_TOKEN_BYTES).decode("utf-8").strip()
    except (OSError, ValueError, fsutil.NotRegular) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a readable text file"
        raise ConfigError(f"{path}: cannot read the token: {why}", file=where, field="web_token_file") from None
    if not text or any(c.isspace() for c in text):
        raise ConfigError(f"{path}: holds no token (one line, no spaces)", file=where, field="web_token_file")
    return Token(text, made=False)


def parse_listen(text: str) -> tuple[str, int]:
    """Return (host, port) of ``ADDR:PORT`` (``[::1]:8700`` for IPv6); a bad one is a UsageError."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not is_count(port) or not 0 <= int(port) <= 65535:
        raise UsageError(f"web: --listen {text}: give ADDR:PORT, for example 127.0.0.1:8700")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Return True for an address only this machine can reach (127.0.0.0/8, ::1, localhost in any case)."""
    if host.lower().removesuffix(".") == "localhost":  # DNS names know no case; `localhost.` is the same name
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Auth:
    """Checks the token of API calls and keeps the login sessions of the pages."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._secret = secrets.token_bytes(32)
        self._sessions: dict[str, float] = {}
        self._lock = threading.Lock()

    def bearer(self, header: str | None) -> int:
        """Return 0 when the Authorization header carries the token, 401 without one, 403 for a wrong one."""
        if not header:
            return 401
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return 401
        return 0 if self.matches(given.strip()) else 403

    def matches(self, given: str) -> bool:
        """Return True if given is the token."""
        return hmac.compare_digest(given.encode(), self._token)

    def login(self, given: str) -> str | None:
        """Return a new session id for the right token, else None."""
        if not self.matches(given):
            return None
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            if len(self._sessions) >= _MAX_SESSIONS:
                for old in sorted(self._sessions, key=self._sessions.__getitem__)[: _MAX_SESSIONS // 10]:
                    del self._sessions[old]
            self._sessions[sid] = now + SESSION_S
        return sid

    def logout(self, sid: str | None) -> None:
        """Forget a session."""
        if sid:
            with self._lock:
                self._sessions.pop(sid, None)

    def session(self, cookie_header: str | None) -> str | None:
        """Return the live session id of a Cookie header, or None.

        Our cookie is picked out of the header by its name: the other cookies a browser sends to this host
        (other local apps, any port) may hold values a strict parser rejects, which must not log the user out.
        """
        sid = session_cookie(cookie_header)
        if sid is None:
            return None
        with self._lock:
            until = self._sessions.get(sid)
            if until is None or until < time.monotonic():
                self._sessions.pop(sid, None)
                return None
        return sid

    def csrf(self, sid: str) -> str:
        """Return the CSRF token of a session (what its forms carry)."""
        return hmac.new(self._secret, sid.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, sid: str | None, given: str | None) -> bool:
        """Return True if given is the CSRF token of the live session sid."""
        # bytes: compare_digest refuses str with non-ASCII text (a TypeError, answered 500 instead of 403)
        return bool(sid and given) and hmac.compare_digest(self.csrf(sid or "").encode(), (given or "").encode())


def session_cookie(cookie_header: str | None) -> str | None:
    """Return the value of our session cookie in a Cookie header (``name=value`` pairs split by ``;``), or None."""
    for part in (cookie_header or "").split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name == COOKIE:
            return value.strip().strip('"') or None
    return None


def names_loopback(host: str) -> bool:
    """Return True for a loopback address, or a host name every address of which is a loopback one.

    A name such as the machine's own (``/etc/hosts``: ``127.0.1.1 vm``) is served
    without a token as 127.0.0.1 is; a name that does not resolve is not loopback.
    """
    if is_loopback(host):
        return True
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(is_loopback(str(info[4][0]).partition("%")[0]) for info in found)
