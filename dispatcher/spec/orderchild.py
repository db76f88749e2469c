"""Parse a large YAML order in a child process, so that its parse never holds the daemon's threads.

A parse is CPU work that holds the interpreter lock; in a thread of the daemon, every
system call of the loop and of the ledger lane waits for that lock when it returns, so
a 1 MB YAML order (about 60 ms to parse) delayed other orders' pickup by tens of ms. In
a child process the daemon only waits for the answer, then reads it as JSON (1 ms for
1 MB). ``python -m dispatcher.spec.orderchild FORMAT`` reads the order on stdin and
writes ``{"error": ..., "field": ...}`` or the value as ``{"text": 1, "value": ...}``:
the value's part is exactly ``json.dumps(value, ensure_ascii=False)``, so the daemon
takes the order's JSON text from it too (``load_apart_text``) instead of encoding a
large body again in its own threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from dispatcher.errors import OrderError
from dispatcher.spec.loader import load_document

#: YAML orders larger than this are parsed in a child process (``load_apart``); JSON never is (1 MB: 1 ms)
APART_YAML_BYTES = 16 * 1024
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


TEXT_HEAD = b'{"text": 1, "value": '  # an answer whose value's part is the value's own JSON text


def load_apart(data: bytes, fmt: str) -> Any:
    """Return ``load_document(data, fmt)`` as computed by a child process; raise OrderError as it would.

    If the child cannot be started or answers nothing readable (no process or memory left,
    a killed child), the document is parsed here instead: the same answer, later.
    """
    return load_apart_text(data, fmt)[0]


def load_apart_text(data: bytes, fmt: str) -> tuple[Any, str | None]:
    """Return ``load_apart(data, fmt)`` and the value's ``json.dumps(value, ensure_ascii=False)`` (None if not had)."""
    env = {"PYTHONPATH": _PACKAGE_PARENT, "LANG": "C.UTF-8", "PATH": os.environ.get("PATH", os.defpath)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dispatcher.spec.orderchild", fmt],
            input=data,
            capture_output=True,
            env=env,
            check=False,
        )
        out = done.stdout if done.returncode == 0 else b""
        answer = json.loads(out) if out else None
    except (OSError, ValueError):
        answer = None
    if not isinstance(answer, dict) or not ("value" in answer or "error" in answer):
        return load_document(data, fmt), None
    if "error" in answer:
        raise OrderError(str(answer["error"]), field=answer.get("field"))
    text = out[len(TEXT_HEAD) : -1].decode() if out.startswith(TEXT_HEAD) and out.endswith(b"}") else None
    return answer["value"], text


def main() -> int:
    """Read an order on stdin, parse it as argv[1] (``yaml`` or ``json``), write the answer as JSON."""
    data = sys.stdin.buffer.read()
    try:
        value = load_document(data, sys.argv[1])
    except OrderError as exc:
        sys.stdout.write(json.dumps({"error": exc.message, "field": exc.field}))
        return 0
    except RecursionError:
        sys.stdout.write(json.dumps({"error": "nesting too deep"}))
        return 0
    try:
        answer = TEXT_HEAD + json.dumps(value, ensure_ascii=False).encode() + b"}"
    except UnicodeEncodeError:  # a lone surrogate: no text to share, the value goes as escaped ASCII
        answer = json.dumps({"value": value}).encode()
    sys.stdout.buffer.write(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
