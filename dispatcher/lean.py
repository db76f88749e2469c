"""Keep the daemon's process small: no OpenSSL in it unless a part that needs it is loaded.

The daemon never speaks TLS itself and hashes only small files, yet ``asyncio`` imports
``ssl`` and ``hashlib`` loads ``_hashlib``, which map libssl and libcrypto: about 5 MB of
resident memory for the daemon's whole life. ``dispatcher run`` starts with both left
out: ``hashlib`` then uses Python's own SHA-256 (the same digests), ``asyncio`` runs
without TLS. The PostgreSQL ledger and the metrics file, whose libraries import ``ssl``,
put them back before they load (``with_openssl``). Every other command, and any other
program that imports this package, is left as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

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
