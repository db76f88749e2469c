"""Run one agent process: argv, environment, folder, group, timeout, capped logs.

Like rq's work horse: ``Popen(argv, cwd=work, start_new_session=True, env=...,
stdin=DEVNULL)``. One thread per attempt waits on the process (a pidfd), its
two output pipes and an abort pipe with one ``poll``, so a timeout, a cancel
or a stop wakes it at once, without polling. When the agent exits, times out
or is aborted, whatever remains in its process group gets SIGTERM, then
SIGKILL after ``kill_grace``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher import procs

AGENT_RESULT_MAX = 64 * 1024
AGENT_RESULT_KEYS = (
    "total_cost_usd",
    "session_id",
    "num_turns",
    "is_error",
    "duration_ms",
    "usage",
)
TAIL_BYTES = 4 * 1024 * 1024
PASSED_ENV = ("PATH", "HOME", "LANG")
ARGV_PLACEHOLDERS = ("job_id", "order", "workspace", "receipt", "prompt", "prompt_file")
PROMPT_PLACEHOLDERS = (
    "job_id", "from", "to", "task", "items_json", "writes", "accept_json", "order", "workspace", "receipt",
)  # fmt: skip
_READ = 1 << 16
_DRAIN_AFTER_EXIT_S = 1.0


def _pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(r"\{(" + "|".join(re.escape(n) for n in names) + r")\}")


_ARGV_RE = _pattern(ARGV_PLACEHOLDERS)
_PROMPT_RE = _pattern(PROMPT_PLACEHOLDERS)


def render(text: str, values: Mapping[str, str], *, prompt: bool = False) -> str:
    """Replace the contract's exact placeholders in text; leave every other brace alone."""
    regex = _PROMPT_RE if prompt else _ARGV_RE
    return regex.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def build_env(agent_env: Mapping[str, str], dispatch: Mapping[str, str]) -> dict[str, str]:
    """Return the agent's environment: PATH, HOME, LANG, its own env, then DISPATCH_*."""
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.update(agent_env)
    env.update(dispatch)
    return env


class Abort:
    """A wake-up an attempt's thread waits on beside its process: cancel or stop."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.reason: str | None = None

    def fileno(self) -> int:
        return self._r

    def trigger(self, reason: str) -> None:
        """Ask the attempt to end its agent now (first reason wins)."""
        if self.reason is None:
            self.reason = reason
        with contextlib.suppress(OSError):
            os.write(self._w, b"x")

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Stream:
    """One output pipe copied into a log file, up to a cap, with a tail kept in memory."""

    fd: int
    log: Any
    cap: int
    keep_tail: bool
    written: int = 0
    cut: bool = False
    tail: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> None:
        if self.written < self.cap:
            room = self.cap - self.written
            self.log.write(data[:room])
            self.written += min(room, len(data))
            if len(data) > room:
                self.cut = True
        else:
            self.cut = True
        if self.keep_tail:
            self.tail += data
            if len(self.tail) > TAIL_BYTES:
                del self.tail[: len(self.tail) - TAIL_BYTES]

    def close(self, stream_name: str) -> None:
        if self.cut:
            self.log.write(f"\n[dispatcher: {stream_name} cut at {self.cap} bytes (max_log_bytes)]\n".encode())
        self.log.close()


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one agent process."""

    exit_code: int | None
    timed_out: bool
    aborted: str | None
    started: float
    ended: float
    pid: int
    agent_result: dict[str, Any] | None
    stdout_cut: bool
    stderr_cut: bool

    @property
    def duration_ms(self) -> int:
        return round((self.ended - self.started) * 1000)


def run(
    argv: list[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    kill_grace_s: float,
    log_dir: Path,
    log_prefix: str = "",
    max_log_bytes: int,
    abort: Abort,
    on_start: Callable[[int], None] | None = None,
) -> Outcome:
    """Run argv to its end and return the Outcome; raise OSError if it cannot start."""
    out_log = (log_dir / f"{log_prefix}stdout.log").open("wb")
    err_log = (log_dir / f"{log_prefix}stderr.log").open("wb")
    started = time.time()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        out_log.close()
        err_log.close()
        raise
    if proc.stdout is None or proc.stderr is None:  # pragma: no cover - PIPE always gives both
        raise OSError("no output pipes")
    if on_start is not None:
        on_start(proc.pid)
    streams = {
        proc.stdout.fileno(): _Stream(proc.stdout.fileno(), out_log, max_log_bytes, True),
        proc.stderr.fileno(): _Stream(proc.stderr.fileno(), err_log, max_log_bytes, False),
    }
    for fd in streams:
        os.set_blocking(fd, False)
    try:
        deadline = time.monotonic() + timeout_s
        exit_code, timed_out, aborted = _supervise(proc, streams, abort, deadline, kill_grace_s)
    finally:
        procs.end_group(proc.pid, kill_grace_s)
        _drain(streams, time.monotonic() + _DRAIN_AFTER_EXIT_S)
        proc.stdout.close()
        proc.stderr.close()
        streams_by_name = list(streams.values())
        streams_by_name[0].close("stdout")
        streams_by_name[1].close("stderr")
    return Outcome(
        exit_code=exit_code,
        timed_out=timed_out,
        aborted=aborted,
        started=started,
        ended=time.time(),
        pid=proc.pid,
        agent_result=parse_agent_result(bytes(streams_by_name[0].tail)),
        stdout_cut=streams_by_name[0].cut,
        stderr_cut=streams_by_name[1].cut,
    )


def _supervise(
    proc: subprocess.Popen[bytes],
    streams: dict[int, _Stream],
    abort: Abort,
    deadline: float,
    kill_grace_s: float,
) -> tuple[int | None, bool, str | None]:
    """Wait for exit, timeout or abort while copying output; return (code, timed_out, aborted)."""
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    timed_out = False
    killed_at: float | None = None
    open_fds = set(streams)
    try:
        while True:
            code = proc.poll() if pidfd is None else None
            if code is not None:
                return code, timed_out, abort.reason
            now = time.monotonic()
            if killed_at is None and (now >= deadline or abort.reason is not None):
                timed_out = abort.reason is None
                procs.signal_group(proc.pid, signal.SIGTERM)
                killed_at = now
            elif killed_at is not None and now >= killed_at + kill_grace_s:
                procs.signal_group(proc.pid, signal.SIGKILL)
                killed_at = float("inf")
            wait = deadline - now if killed_at is None else max(0.0, killed_at + kill_grace_s - now)
            if pidfd is None:
                wait = min(wait, 0.05)
            fds: list[int] = [*open_fds, abort.fileno()]
            if pidfd is not None:
                fds.append(pidfd)
            ready = wait_readable(fds, min(wait, 3600.0))
            for fd in ready:
                if fd in streams:
                    if not _pump(streams[fd]):
                        open_fds.discard(fd)
                elif fd == pidfd:
                    return proc.wait(), timed_out, abort.reason
                elif fd == abort.fileno():
                    with contextlib.suppress(BlockingIOError):
                        os.read(fd, 64)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def wait_readable(fds: list[int], timeout_s: float) -> list[int]:
    """Return the fds that are readable (or closed) within timeout_s; poll has no fd-number limit."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    return [fd for fd, _ in poller.poll(max(0, int(timeout_s * 1000 + 0.999)))]


def _pump(stream: _Stream) -> bool:
    """Copy what is readable; return False at end of file."""
    while True:
        try:
            data = os.read(stream.fd, _READ)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        stream.feed(data)


def _drain(streams: dict[int, _Stream], deadline: float) -> None:
    """Read what is left in the pipes after the group ended, until EOF or the deadline."""
    open_fds = set(streams)
    while open_fds:
        wait = deadline - time.monotonic()
        if wait <= 0:
            return
        ready = wait_readable(list(open_fds), wait)
        for fd in ready:
            if not _pump(streams[fd]):
                open_fds.discard(fd)


def parse_agent_result(tail: bytes) -> dict[str, Any] | None:
    """Return the JSON object that ends stdout, as headless agent CLIs print it, or None."""
    text = tail.decode("utf-8", errors="replace").rstrip()
    if not text.endswith("}"):
        return None
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*\{", text)]
    for pos in reversed(starts):
        try:
            value, end = decoder.raw_decode(text, text.index("{", pos))
        except (json.JSONDecodeError, RecursionError):
            continue
        if end == len(text) and isinstance(value, dict):
            if len(text[pos:].encode()) > AGENT_RESULT_MAX:
                return {k: value[k] for k in AGENT_RESULT_KEYS if k in value}
            return value
    return None
