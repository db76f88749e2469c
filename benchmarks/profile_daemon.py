#!/usr/bin/env python3
"""Run the dispatcher CLI with every thread under cProfile; write the merged stats.

    python benchmarks/profile_daemon.py [--wall] OUT.prof [dispatcher arguments ...]

`python -m cProfile -m dispatcher` sees the main thread only; a daemon that runs jobs on
other threads would look idle there. This starts a profiler in each thread as it starts
(`threading.setprofile`), runs `python -m dispatcher` in-process, and on exit adds every
thread's figures into one file for `pstats`. Only the CLI is used, so it works whatever
the daemon's inside looks like (threads, asyncio or one loop).

Times are each thread's own CPU time (`time.thread_time`), so a thread that waits costs
nothing and the figures add up to what the daemon spends; `--wall` uses the wall clock
instead (cProfile's default), where every wait counts.
"""

from __future__ import annotations

import cProfile
import pstats
import runpy
import sys
import threading
import time
from types import FrameType
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()
_timer = time.thread_time


def _start_in_thread(frame: FrameType, event: str, arg: Any) -> None:
    """Replace this hook, in the thread that calls it, with a fresh profiler."""
    prof = cProfile.Profile(_timer)
    with _lock:
        _profiles.append(prof)
    prof.enable()


def main() -> int:
    """Profile `python -m dispatcher ARGS`; return its exit code."""
    global _timer
    args = sys.argv[1:]
    if args[:1] == ["--wall"]:
        _timer = time.perf_counter
        args = args[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    out = args[0]
    sys.argv = ["dispatcher", *args[1:]]
    threading.setprofile(_start_in_thread)
    main_prof = cProfile.Profile(_timer)
    _profiles.append(main_prof)
    code: Any = 0
    main_prof.enable()
    try:
        runpy.run_module("dispatcher", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        main_prof.disable()
        threading.setprofile(None)
        with _lock:
            profiles = list(_profiles)
        stats = pstats.Stats(profiles[0])
        for prof in profiles[1:]:
            try:
                stats.add(prof)
            except (TypeError, ValueError):  # a thread still running may have nothing to give
                continue
        stats.dump_stats(out)
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
