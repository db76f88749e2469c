#!/usr/bin/env python3
"""Run the dispatcher CLI with each thread's Python name as its kernel name; nothing else changes.

    python benchmarks/named_threads.py [dispatcher arguments ...]

Python 3.11 does not pass a thread's name (`ledger_0`, `io_1`, `scan_0`) to the kernel, so
/proc/PID/task/*/comm says `python3` for every thread. This sets each new thread's kernel
name (prctl PR_SET_NAME, first 15 bytes) when it starts, then runs `python -m dispatcher`
in-process, so that the benchmark can read CPU and context switches per thread from
/proc. The cost is one prctl per thread.
"""

from __future__ import annotations

import ctypes
import runpy
import sys
import threading
from types import FrameType
from typing import Any

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def _name_thread(frame: FrameType, event: str, arg: Any) -> None:
    """Give the calling thread its Python name in the kernel, then stop hooking it."""
    sys.setprofile(None)
    name = threading.current_thread().name.encode(errors="replace")[:15]
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def main() -> int:
    """Run `python -m dispatcher ARGS` with named threads; return its exit code."""
    sys.argv = ["dispatcher", *sys.argv[1:]]
    threading.setprofile(_name_thread)
    try:
        runpy.run_module("dispatcher", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
