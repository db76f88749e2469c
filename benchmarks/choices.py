#!/usr/bin/env python3
"""Measured alternatives for a job's small steps: each beside what the daemon does now.

    .venv/bin/python benchmarks/choices.py [--rounds 5] [--spawns 400]

- **schema**: an order checked by the compiled schema closures (`schema.validate`) and by
  the schema walk they replaced (`schema.check_interpreted`);
- **json**: the JSON a job writes and reads (`result.json`, `job.json`, `attempt.json`,
  `work/order.json`, a receipt, a log line), with the standard library as the daemon uses
  it and, when installed (`pip install -e '.[bench]'`), with orjson and msgspec;
- **spawn**: one agent start and reap as the daemon makes it (`subprocess.Popen`, a new
  session, piped output, the descriptors closed) and with glibc's `posix_spawn` through
  ctypes (a chdir file action, `closefrom`, `SETSID`, SIGPIPE and SIGXFSZ back to their
  defaults: the same child). Python's own `os.posix_spawn` cannot set the child's working
  folder before 3.13's file actions, so it is shown without one, as a bound.

Every figure is the parent's CPU per call (`time.thread_time`), the median of the rounds;
the ratio is against the daemon's way in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatcher import fsutil
from dispatcher.spec import loader, schema

ORDER = {
    "job_id": "J-0000001",
    "from": "bench",
    "to": "bench-agent",
    "task": "Copy the one item id to out.csv.",
    "items": [{"id": "R1"}],
    "accept": {"output": "out.csv"},
}
RESULT = {
    "job_id": "J-0000001",
    "state": "done",
    "agent": "bench-agent",
    "attempts": 1,
    "claimed_at": "2026-12-02T03:43:00.100000Z",
    "finished_at": "2026-12-02T03:43:00.112000Z",
    "duration_s": 0.012,
    "checks": [
        {"name": n, "passed": True, "detail": f"{n} holds: 1 of 1"}
        for n in ("receipt_exists", "receipt_job_id", "receipt_status", "receipt_inputs", "output_exists")
    ]
    + [
        {"name": n, "passed": True, "detail": f"{n} holds: 1 of 1"}
        for n in ("output_rows", "receipt_outputs", "writes_scope", "followups")
    ],
    "reason": None,
    "cost_usd": None,
    "followups": [],
}
LOG_LINE = {
    "event": "job.done",
    "level": "info",
    "timestamp": "2026-12-02T03:43:00.123456Z",
    "job_id": "J-0000001",
    "agent": "bench-agent",
    "state": "done",
    "duration_s": 0.0123,
    "attempts": 1,
}


def per_call_us(fn: Callable[[], Any], n: int, rounds: int) -> float:
    """Return the median over rounds of the parent's CPU per call of fn, in microseconds."""
    times = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        times.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(times)


def row(name: str, us: float, base: float) -> None:
    print(f"  {name:52s} {us:8.2f} us   {us / base:5.2f} x")


def schema_section(rounds: int) -> None:
    print("[schema] one order's schema check")
    base = per_call_us(lambda: schema.check_interpreted(ORDER, "order"), 20000, rounds)
    row("schema walk (before)", base, base)
    row("compiled closures (the daemon)", per_call_us(lambda: schema.validate(ORDER, "order"), 20000, rounds), base)


def json_section(rounds: int) -> None:
    docs = {"result.json": RESULT, "order": ORDER, "log line": LOG_LINE}
    try:
        import orjson
    except ImportError:
        orjson = None
    try:
        import msgspec
    except ImportError:
        msgspec = None
    print("[json] per document, encode and decode" + ("" if orjson and msgspec else " (orjson/msgspec: not installed)"))
    for name, doc in docs.items():
        raw = fsutil.dump_json(doc)
        base = per_call_us(lambda doc=doc: fsutil.dump_json(doc), 20000, rounds)
        row(f"{name} ({len(raw)} B): encode, json (the daemon)", base, base)
        if orjson is not None:
            enc = per_call_us(lambda doc=doc: orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE), 20000, rounds)
            row(f"{name}: encode, orjson", enc, base)
        if msgspec is not None:
            encoder = msgspec.json.Encoder()
            row(f"{name}: encode, msgspec", per_call_us(lambda d=doc, e=encoder: e.encode(d), 20000, rounds), base)
        text = raw.decode()
        strict = name == "order"
        if strict:
            load: Callable[[], Any] = lambda text=text: loader.load_json(text)  # noqa: E731 - one line each
        else:
            load = lambda raw=raw: json.loads(raw)  # noqa: E731
        dbase = per_call_us(load, 20000, rounds)
        row(f"{name}: decode, json{' strict (the daemon)' if strict else ''}", dbase, dbase)
        if orjson is not None:
            row(f"{name}: decode, orjson", per_call_us(lambda raw=raw: orjson.loads(raw), 20000, rounds), dbase)


class GlibcSpawn:
    """glibc's posix_spawn through ctypes, with the file actions the daemon's child needs."""

    SETSIGDEF, SETSID = 0x04, 0x80

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.libc = libc
        self.attr = ctypes.create_string_buffer(512)
        sigset = ctypes.create_string_buffer(128)
        libc.sigemptyset(sigset)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            libc.sigaddset(sigset, sig)
        libc.posix_spawnattr_init(self.attr)
        libc.posix_spawnattr_setsigdefault(self.attr, sigset)
        libc.posix_spawnattr_setflags(self.attr, ctypes.c_short(self.SETSIGDEF | self.SETSID))

    def spawn(self, path: str, argv: list[str], env: dict[str, str], cwd: str, fds: list[tuple[int, int]]) -> int:
        libc = self.libc
        actions = ctypes.create_string_buffer(256)
        libc.posix_spawn_file_actions_init(actions)
        try:
            for src, dst in fds:
                libc.posix_spawn_file_actions_adddup2(actions, src, dst)
            libc.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd))
            libc.posix_spawn_file_actions_addclosefrom_np(actions, 3)
            cargv = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
            cenv = (ctypes.c_char_p * (len(env) + 1))(*[f"{k}={v}".encode() for k, v in env.items()], None)
            pid = ctypes.c_int()
            err = libc.posix_spawn(ctypes.byref(pid), os.fsencode(path), actions, self.attr, cargv, cenv)
            if err:
                raise OSError(err, os.strerror(err), argv[0])
            return pid.value
        finally:
            libc.posix_spawn_file_actions_destroy(actions)


def spawn_section(rounds: int, n: int) -> None:
    sh = shutil.which("sh") or "/bin/sh"
    argv = [sh, "-c", ":"]
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update({"DISPATCH_JOB_ID": "J-0000001", "DISPATCH_WORKSPACE": "/tmp", "DISPATCH_ORDER": "/tmp/order.json"})
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    cwd = os.getcwd()

    def popen() -> None:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=devnull,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()

    def piped(spawn: Callable[[list[tuple[int, int]]], int]) -> None:
        r1, w1 = os.pipe2(os.O_CLOEXEC)
        r2, w2 = os.pipe2(os.O_CLOEXEC)
        pid = spawn([(devnull, 0), (w1, 1), (w2, 2)])
        for fd in (w1, w2, r1, r2):
            os.close(fd)
        os.waitpid(pid, 0)

    glibc = GlibcSpawn()
    print(f"[spawn] start and reap `sh -c :` ({n} per round), the parent's CPU")
    base = per_call_us(popen, n, rounds)
    row("subprocess.Popen (the daemon)", base, base)
    row("glibc posix_spawn via ctypes, same child", per_call_us(
        lambda: piped(lambda fds: glibc.spawn(sh, argv, env, cwd, fds)), n, rounds), base)  # fmt: skip
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0)]
    row("os.posix_spawn, no working folder (a bound)", per_call_us(
        lambda: piped(lambda fds: os.posix_spawn(sh, argv, env, file_actions=actions + [
            (os.POSIX_SPAWN_DUP2, s, d) for s, d in fds[1:]], setsid=True)), n, rounds), base)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spawns", type=int, default=400)
    parser.add_argument("--only", default="schema,json,spawn")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}, medians of {args.rounds} rounds")
    only = set(args.only.split(","))
    if "schema" in only:
        schema_section(args.rounds)
    if "json" in only:
        json_section(args.rounds)
    if "spawn" in only:
        spawn_section(args.rounds, args.spawns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
