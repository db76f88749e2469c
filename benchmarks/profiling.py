"""`bench.py --profile`: `run --once` over N orders under cProfile, every thread, top functions."""

from __future__ import annotations

import argparse
import contextlib
import io
import pstats
import re
from collections.abc import Iterator
from pathlib import Path

from harness import HERE, REPO, BenchError, Daemon, job_ids, write_backlog, write_config
from throughput import once

TOP = 25


def short_path(path: str) -> str:
    """Return path relative to the repository, site-packages or the standard library."""
    if path.startswith(str(REPO) + "/"):
        return path[len(str(REPO)) + 1 :]
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    m = re.search(r"/lib/python3\.\d+/(.*)$", path)
    return m.group(1) if m else path


@contextlib.contextmanager
def package_paths() -> Iterator[None]:
    """Make `Stats.strip_dirs()` keep package paths (dispatcher/daemon.py), not bare names.

    pstats has no option for it; strip_dirs() calls the module-level func_strip_path.
    """
    original = pstats.func_strip_path  # type: ignore[attr-defined]

    def strip(func_name: tuple[str, int, str]) -> tuple[str, int, str]:
        filename, line, name = func_name
        return short_path(filename), line, name

    pstats.func_strip_path = strip  # type: ignore[attr-defined]
    try:
        yield
    finally:
        pstats.func_strip_path = original  # type: ignore[attr-defined]


def run_profile(base: Path, opts: argparse.Namespace) -> list[str]:
    """Profile `run --once` over opts.orders orders; return the report's lines."""
    n = opts.orders
    # The same run without the profiler, to say how much the profiler itself costs.
    plain = once(base / "plain", opts.max_jobs, job_ids("PLAIN", n), opts.timeout)
    base = base / "profiled"
    config, root = write_config(base, max_jobs=opts.max_jobs)
    ids = job_ids("PROF", n)
    write_backlog(root / "inbox", ids)
    out = base / "daemon.prof"
    wrapper = [str(HERE / "profile_daemon.py"), *(["--wall"] if opts.profile_wall else []), str(out)]
    d = Daemon(config, base, ["--once"], prefix=wrapper, label="profile")
    d.start()
    try:
        code = d.wait_exit(opts.timeout)
    finally:
        d.stop()
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if code != 0 or done != n or not out.exists():
        raise BenchError(f"profiled run --once exited {code} with {done}/{n} jobs in done/\n{d.symptoms()}")
    buf = io.StringIO()
    stats = pstats.Stats(str(out), stream=buf)
    with package_paths():
        stats.strip_dirs()
    total = stats.total_tt  # type: ignore[attr-defined]
    clock = "wall-clock time" if opts.profile_wall else "CPU time (each thread's own)"
    lines = [
        f"profile: run --once over N = {n} orders (max_jobs {opts.max_jobs}), every thread of the daemon, {clock}",
        f"profiled {total:.2f} s in the daemon, start-up included: {total / n * 1000:.2f} ms per job",
        f"whole run, agents included: {d.wall_s:.2f} s wall, {d.cpu_s:.2f} s CPU under the profiler; "
        f"{plain.wall_s:.2f} s wall, {plain.cpu_s:.2f} s CPU without it: the profiler slows Python code "
        "more than system calls, so read shares, not absolute times",
    ]
    if opts.profile_wall:
        lines.append("wall clock: times add up across threads, and every wait counts (locks, poll, queue get)")
    for key, title in (("cumulative", "by cumulative time"), ("tottime", "by own (total) time")):
        buf.seek(0)
        buf.truncate()
        stats.sort_stats(key).print_stats(TOP)
        text = buf.getvalue()
        # print_stats starts with the file name and totals, already said above
        body = text[text.find("   ncalls") :] if "   ncalls" in text else text
        lines += ["", f"== top {TOP} {title}", body.rstrip()]
    if opts.keep:
        lines.append(f"\nstats kept in {out} (python -m pstats {out})")
    return lines
