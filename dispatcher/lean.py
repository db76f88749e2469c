"""Keep the daemon's process small: no OpenSSL in it unless a part that needs it is loaded.

The daemon never speaks TLS itself and hashes only small files, yet ``asyncio`` imports
``ssl`` and ``hashlib`` loads ``_hashlib``, which map libssl and libcrypto: about 5 MB of
resident memory for the daemon's whole life. ``dispatcher run`` starts with both left
out: ``hashlib`` then uses Python's own SHA-256 (the same digests), ``asyncio`` runs
without TLS. The PostgreSQL ledger and the metrics file, whose libraries import ``ssl``,
put them back before they load (``with_openssl``). Every other command, and any other
program that imports this package, is left as it is.

Python's own SHA-256 holds the interpreter lock for the whole of its input (about 7 ms a
MiB here), so a large order hashed in one of the daemon's threads stalls the loop as long.
``sha256_for(size)`` hands data from ``BIG_HASH_BYTES`` up to OpenSSL's (about 0.8 ms a MiB,
the lock given up while it runs), loading ``_hashlib`` at the first such file: a daemon
that never sees one stays small.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

LEFT_OUT = ("ssl", "_ssl", "_hashlib")
_VALUED = ("--config", "--root")  # the top-level options that take a value


def runs_daemon(argv: Sequence[str]) -> bool:
    """Return True if argv is the dispatcher's own command line and its command is ``run``."""
    if not argv:
        return False
    program = argv[0]
    if os.path.basename(program) != "dispatcher" and not program.endswith(f"dispatcher{os.sep}__main__.py"):
        return False
    args = iter(argv[1:])
    for arg in args:
        if arg in _VALUED:
            next(args, None)
        elif not arg.startswith("-"):
            return arg == "run"
    return False


def without_openssl(argv: Sequence[str]) -> None:
    """Leave ssl and OpenSSL's hashes out of this process if it is to run the daemon (before any import)."""
    if runs_daemon(argv):
        for name in LEFT_OUT:
            if name not in sys.modules:
                sys.modules[name] = None  # type: ignore[assignment]  # None: "import name" fails


def with_openssl() -> None:
    """Let ssl and OpenSSL's hashes be imported again (before a library that needs them is)."""
    for name in LEFT_OUT:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


class Hasher(Protocol):
    """What the daemon uses of a hashlib object."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


BIG_HASH_BYTES = 64 * 1024  # from this size up, data is hashed by OpenSSL when the process has it
_big_sha256: Callable[..., Hasher] | None = None


def sha256_for(size: int) -> Callable[..., Hasher]:
    """Return a SHA-256 constructor for ``size`` bytes: ``hashlib.sha256``, or OpenSSL's for large data.

    The digests are the same; OpenSSL's is several times faster and lets other threads
    run while it hashes. Without OpenSSL in this Python, ``hashlib.sha256`` is used.
    """
    global _big_sha256
    import hashlib  # here, not at the top: this module runs before anything may import hashlib

    if size < BIG_HASH_BYTES:
        return hashlib.sha256
    if _big_sha256 is None:
        if "_hashlib" in sys.modules and sys.modules["_hashlib"] is None:
            del sys.modules["_hashlib"]  # left out at start (``without_openssl``): loaded now, for large data only
        try:
            import _hashlib

            _big_sha256 = _hashlib.openssl_sha256
        except (ImportError, AttributeError):
            _big_sha256 = hashlib.sha256
    return _big_sha256
