"""Run agent processes on the daemon's event loop: argv, environment, group, timeout, capped logs.

Like rq's work horse: ``Popen(argv, cwd=work, start_new_session=True, env=...,
stdin=DEVNULL)``. Instead of a thread per agent, every agent is watched by the
one event loop: its pidfd and its two output pipes are readers on one epoll the
loop watches (``readers``), its timeout and kill grace are the loop's timers. asyncio's own
subprocess layer is not used: on Python 3.11 it needs a child watcher (a thread
per child by default, PITFALLS) and builds transports and stream protocols per
pipe; a pidfd reader is all that is needed to learn of an exit.

When the agent exits, times out, or is aborted (cancel, stop), whatever remains
in its process group gets SIGTERM, then SIGKILL after ``kill_grace``; the group
is signalled while the leader is still an unreaped zombie, so its pgid cannot
have been reused by another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dispatcher.job.idle import IdleWatch, newest_change
from dispatcher.job.readers import Readers, readers
from dispatcher.procs import end_group, group_gone, signal_group

AGENT_TAIL_BYTES = 4 * 1024 * 1024  # stdout kept in memory for the agent's final JSON
ERR_TAIL_BYTES = 64 * 1024  # stderr kept in memory, for usage limits (section 14)
PASSED_ENV = ("PATH", "HOME", "LANG")
_READ = 1 << 16
_DRAIN_AFTER_EXIT_S = 1.0
_DEVNULL_LOCK = threading.Lock()
_devnull_fd = -1  # /dev/null, opened once for every agent's stdin (Popen's DEVNULL opens and closes it per spawn)


class EnvB(dict[bytes, bytes]):
    """An agent's environment as ``Popen`` gets it: each name and value ``os.fsencode``d, in order."""


_FS_ENCODING = sys.getfilesystemencoding()  # what os.fsencode encodes with
_FS_ERRORS = sys.getfilesystemencodeerrors()
_PASSED_ENVB = tuple(os.fsencode(k) for k in PASSED_ENV)


def encode_env(env: Mapping[str, str]) -> EnvB:
    """Return env as bytes, as ``Popen`` would encode it."""
    enc, errors = _FS_ENCODING, _FS_ERRORS
    return EnvB({k.encode(enc, errors): v.encode(enc, errors) for k, v in env.items()})


def agent_environ(agent_env: Mapping[str, str], dispatch: Mapping[str, str], pass_env: tuple[str, ...] = ()) -> EnvB:
    """Return an agent's environment as bytes: PATH, HOME, LANG, the pass_env names, its own env, then DISPATCH_*.

    The one place that decides what an agent sees, in which order. Made as bytes: the
    passed names are read from ``os.environb`` (no decoding), and ``Popen`` encodes nothing.
    """
    enc, errors = _FS_ENCODING, _FS_ERRORS
    environ = os.environb
    names = (*_PASSED_ENVB, *(k.encode(enc, errors) for k in pass_env)) if pass_env else _PASSED_ENVB
    env = EnvB({k: v for k in names if (v := environ.get(k)) is not None})
    if agent_env:
        env.update(encode_env(agent_env))
    env.update(encode_env(dispatch))
    return env


def build_env(
    agent_env: Mapping[str, str], dispatch: Mapping[str, str], pass_env: tuple[str, ...] = ()
) -> dict[str, str]:
    """Return ``agent_environ`` as text (for a sandbox's ``--setenv`` and hooks that read it)."""
    decode = os.fsdecode
    return {decode(k): decode(v) for k, v in agent_environ(agent_env, dispatch, pass_env).items()}


def dispatch_env(job_id: str, work: str | Path, n: int, workspace: Path | None = None) -> dict[str, str]:
    """Return the DISPATCH_* variables of attempt n."""
    w = os.fspath(work)
    return {
        "DISPATCH_JOB_ID": job_id,
        "DISPATCH_ORDER": f"{w}/order.json",
        "DISPATCH_WORKSPACE": os.fspath(workspace) if workspace else w,
        "DISPATCH_RECEIPT": f"{w}/receipt.json",
        "DISPATCH_ATTEMPT": str(n),
    }


@dataclass
class _Stream:
    """One output pipe copied into a log file up to a cap; stdout's tail is kept in memory."""

    fd: int
    path: str | Path | None  # None: the output is kept in memory only (its tail), never written
    cap: int
    keep_tail: int  # bytes of the stream's end kept in memory
    log_fd: int = -1
    written: int = 0
    cut: bool = False
    lost: bool = False  # the log could not be written (a full disk): the agent runs on
    open: bool = True
    tail: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> None:
        if self.keep_tail:
            self.tail += data
            if len(self.tail) > self.keep_tail:
                del self.tail[: len(self.tail) - self.keep_tail]
        room = self.cap - self.written
        if len(data) > room:
            self.cut = True
            data = data[: max(room, 0)]
        if data and not self.lost and self.path is not None:
            self._write(data)
        self.written += len(data)

    def _write(self, data: bytes) -> None:
        if self.path is None:
            return
        try:
            if self.log_fd < 0:  # opened on first output: thousands of quiet agents hold no log fds
                self.log_fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
            view = memoryview(data)
            while view:
                view = view[os.write(self.log_fd, view) :]
        except OSError:
            self.lost = True

    def close(self, name: str, cap_is: str = "max_log_bytes") -> None:
        if self.cut and self.path is not None:
            self._write(f"\n[dispatcher: {name} cut at {self.cap} bytes ({cap_is})]\n".encode())
        if self.log_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.log_fd)
            self.log_fd = -1


@dataclass(frozen=True, slots=True)
class AgentExit:
    """What happened to one agent process."""

    exit_code: int | None
    timed_out: bool
    aborted: str | None
    started: float
    ended: float
    pid: int
    stdout_tail: bytes
    stderr_tail: bytes
    stdout_cut: bool
    stderr_cut: bool
    logs_lost: bool
    idle_s: float | None = None  # ended by idle_timeout: no output and no change in work/ for this long

    @property
    def duration_ms(self) -> int:
        return round((self.ended - self.started) * 1000)


class AgentProcess:
    """One agent process supervised by the event loop."""

    _readers: Readers  # its pipes' and pidfd's, from ``start``

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | Path,
        env: Mapping[str, str] | EnvB,
        timeout_s: float,
        kill_grace_s: float,
        log_dir: str | Path | None,
        max_log_bytes: int,
        log_prefix: str = "",
        idle_timeout_s: float | None = None,
        one_log: Path | None = None,
        keep_fd: int | None = None,
        idle_also: str | Path | None = None,
    ) -> None:
        """``env``: names and values as text, or as bytes already (``EnvB``); ``one_log``: write stdout and
        stderr, as they come, into this one file (a user check's log); ``keep_fd``: a descriptor the agent
        inherits (its slot's lock); ``idle_also``: a second folder whose changes count as activity for
        ``idle_timeout`` (the job's work/ when the agent works in a worktree)."""
        self.argv = argv
        self.cwd = cwd
        self.env = env if isinstance(env, EnvB) else encode_env(env)
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.keep_fd = keep_fd
        logs = os.fspath(log_dir) if log_dir is not None else None
        out_path = f"{logs}/{log_prefix}stdout.log" if logs is not None else one_log
        err_path = f"{logs}/{log_prefix}stderr.log" if logs is not None else one_log
        # one log for both streams (a user check's): it holds what two logs of max_log_bytes each would
        self._one = out_path is not None and out_path == err_path
        self._out = _Stream(-1, out_path, max_log_bytes * (2 if self._one else 1), AGENT_TAIL_BYTES)
        self._err = _Stream(-1, err_path, max_log_bytes, ERR_TAIL_BYTES)
        self._idle = IdleWatch(cwd, idle_timeout_s, also=idle_also) if idle_timeout_s else None
        self.pid = 0
        self.started = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._timed_out = False
        self._idle_s: float | None = None
        self._aborted: str | None = None
        self._signalled = False
        self._group_ended = False
        self._hurry = False
        self._timers: list[asyncio.TimerHandle] = []
        self._done: asyncio.Future[AgentExit] | None = None

    def start(self) -> None:
        """Spawn the agent; raise OSError if its program cannot start (nothing else does)."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self.started = time.time()
        merge = self._one  # one log: one pipe, in the order written
        self._proc, self._out.fd, self._err.fd = _spawn(self.argv, self.cwd, self.env, self.keep_fd, merge=merge)
        # from here on the agent runs: nothing below may turn into "cannot start"
        self.pid = self._proc.pid
        watch = self._readers = readers()
        if merge:
            self._err.open = False
        for stream in (self._out, self._err) if not merge else (self._out,):
            os.set_blocking(stream.fd, False)
            watch.add(stream.fd, self._pump, stream)
        try:
            self._pidfd = os.pidfd_open(self.pid)
            watch.add(self._pidfd, self._on_exit)
        except OSError:  # no pidfds (old kernel): fall back to polling the child
            self._timers.append(loop.call_later(0.05, self._poll_exit))
        self._timers.append(loop.call_later(self.timeout_s, self._on_timeout))
        if self._idle is not None:
            self._timers.append(loop.call_later(self._idle.every_s, self._check_idle))

    async def wait(self) -> AgentExit:
        """Wait for the agent's end (its group ended and its pipes drained)."""
        assert self._done is not None  # noqa: S101 - start() first
        return await self._done

    def mute(self) -> None:
        """Stop writing the agent's logs (a fenced daemon changes nothing in a job folder any more)."""
        self._out.lost = self._err.lost = True

    def abort(self, reason: str, *, now: bool = False) -> None:
        """End the agent now (cancel or stop); the first reason wins.

        ``now`` (a second stop signal): SIGKILL its group at once, not after ``kill_grace``.
        """
        if self._aborted is None and not self._timed_out and not self._exited:
            self._aborted = reason
            self._terminate()
        if now and not self._hurry:
            self._hurry = True
            if self.pid and not self._group_ended:
                signal_group(self.pid, signal.SIGKILL)

    @property
    def _exited(self) -> bool:
        return self._proc is not None and self._proc.returncode is not None

    # -- loop callbacks -----------------------------------------------------------------------
    def _pump(self, stream: _Stream) -> None:
        try:
            data = os.read(stream.fd, _READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            stream.feed(data)
            if self._idle is not None:
                self._idle.heard()
        else:
            self._close_stream(stream)

    def _close_stream(self, stream: _Stream) -> None:
        if stream.open:
            stream.open = False
            self._readers.remove(stream.fd)
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        """Finish once the group has ended and both pipes reached end of file."""
        if self._group_ended and not (self._out.open or self._err.open) and self._done and not self._done.done():
            self._complete()

    def _on_timeout(self) -> None:
        if not self._exited and self._aborted is None and not self._has_exited():
            self._timed_out = True
            self._terminate()

    def _has_exited(self) -> bool:
        """Has the agent exited, its exit not yet taken up (the daemon stalled, say by SIGSTOP, past its timeout)?

        Looked at without reaping it (``WNOWAIT``: its pgid stays ours to signal); the exit's
        own callback takes it up, and an agent that exited in time is judged by its exit.
        """
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped already: its exit is being taken up

    def _check_idle(self) -> None:
        """Every few seconds: end the agent when it was silent and left work/ alone for idle_timeout."""
        idle = self._idle
        if idle is None or self._exited or self._aborted is not None or self._timed_out:
            return
        loop = asyncio.get_running_loop()
        if idle.quiet_s() >= idle.every_s and not idle.scanning:  # silent a while: did work/ change?
            idle.scanning = True
            loop.run_in_executor(None, newest_change, idle.folders, idle.SCAN_MAX).add_done_callback(idle.scanned)
        if idle.quiet_s() >= idle.timeout_s:
            for stream in (self._out, self._err):  # output the daemon had no turn to read (it stalled) is heard
                if stream.open:
                    self._pump(stream)
            if self._exited or self._has_exited():  # it ended while the daemon stalled: judged by its exit
                return
        if idle.quiet_s() >= idle.timeout_s:
            self._timed_out = True
            self._idle_s = idle.timeout_s
            self._terminate()
            return
        self._timers.append(loop.call_later(idle.every_s, self._check_idle))

    def _terminate(self) -> None:
        signal_group(self.pid, signal.SIGTERM)
        self._signalled = True
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(self.kill_grace_s, signal_group, self.pid, signal.SIGKILL))

    def _poll_exit(self) -> None:
        assert self._proc is not None  # noqa: S101
        if self._proc.poll() is None:
            self._timers.append(asyncio.get_running_loop().call_later(0.05, self._poll_exit))
            return
        self._after_exit()

    def _on_exit(self) -> None:
        self._readers.remove(self._pidfd)
        # the leader is an unreaped zombie: its pgid is still ours to signal
        signal_group(self.pid, signal.SIGTERM)
        os.close(self._pidfd)
        self._pidfd = -1
        assert self._proc is not None  # noqa: S101
        if self._proc.poll() is None:  # not reapable yet (a tracer such as strace sees the exit first): poll
            self._poll_exit()
            return
        self._after_exit()

    def _after_exit(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        # the group is looked at in the loop's next round, where a task's first step would be (not here at the exit:
        # that delays the next start), and a task ends it only if something is left in it
        asyncio.get_running_loop().call_soon(self._group_look)

    def _group_look(self) -> None:
        """Look at the group once, as ``end_group`` first does: gone (most agents), or left to a task to end."""
        if group_gone(self.pid):
            self._group_gone()
        else:
            asyncio.get_running_loop().create_task(self._end_group_then_drain())

    async def _end_group_then_drain(self) -> None:
        await end_group(self.pid, self.kill_grace_s, already_termed=True, hurry=lambda: self._hurry)
        self._group_gone()

    def _group_gone(self) -> None:
        self._group_ended = True
        self._maybe_complete()
        if self._done is not None and not self._done.done():
            asyncio.get_running_loop().call_later(_DRAIN_AFTER_EXIT_S, self._stop_draining)

    def _stop_draining(self) -> None:
        """A process that left the group still holds a pipe: stop reading it."""
        for stream in (self._out, self._err):
            if stream.open:
                stream.open = False
                self._readers.remove(stream.fd)
        self._maybe_complete()

    def _complete(self) -> None:
        assert self._proc is not None and self._done is not None  # noqa: S101
        if self._one:
            self._out.close("stdout and stderr", "2 x max_log_bytes")
        else:
            self._out.close("stdout")
            self._err.close("stderr")
        for stream in (self._out, self._err):
            if stream.fd >= 0:
                os.close(stream.fd)
        self._done.set_result(
            AgentExit(
                exit_code=self._proc.returncode,
                timed_out=self._timed_out,
                aborted=self._aborted,
                started=self.started,
                ended=time.time(),
                pid=self.pid,
                stdout_tail=bytes(self._out.tail),
                stderr_tail=bytes(self._err.tail),
                stdout_cut=self._out.cut,
                stderr_cut=self._err.cut,
                logs_lost=self._out.lost or self._err.lost,
                idle_s=self._idle_s,
            )
        )


@functools.lru_cache(maxsize=256)
def _which(name: str, path: bytes | None) -> str | None:
    return shutil.which(name, path=os.defpath if path is None else os.fsdecode(path))


def _spawn(
    argv: Sequence[str], cwd: str | os.PathLike[str], env: EnvB, keep_fd: int | None = None, *, merge: bool = False
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start argv in its own session; return it and the read ends of its stdout and stderr pipes.

    ``keep_fd``: a descriptor the child inherits (open in it under the same number). ``merge``:
    stderr goes into stdout's pipe, as ``2>&1`` does (a user check's one log, in the order
    written); the stderr read end returned is then -1.

    A bare program name is looked up on PATH once: Popen would try every folder of PATH
    with its own execve at each start; the lookup is cached per (name, PATH), and a cached
    path that has gone is looked up again. The pipes are made here and handed to Popen as
    descriptors (close-on-exec, as ``PIPE``'s): Popen makes no file objects of them and no
    callbacks to close them; the write ends are closed once the child has them.
    """
    name = argv[0] if argv else ""
    found = _which(name, env.get(b"PATH")) if name and "/" not in name else None
    out_r, out_w = os.pipe()
    try:
        err_r, err_w = (-1, out_w) if merge else os.pipe()
    except OSError:
        os.close(out_r)
        os.close(out_w)
        raise
    try:
        try:
            proc = _popen(argv, cwd, env, found, out_w, err_w, keep_fd)
        except FileNotFoundError:
            if found is None:
                raise
            _which.cache_clear()  # the program moved since it was looked up: let Popen search again
            proc = _popen(argv, cwd, env, None, out_w, err_w, keep_fd)
        except ValueError as exc:  # an argument with a NUL in it (an order's text put into {prompt}): no exec takes it
            raise OSError(errno.EINVAL, f"an argument cannot be passed: {exc}") from None
    except BaseException:
        os.close(out_r)
        if err_r >= 0:
            os.close(err_r)
        raise
    finally:
        os.close(out_w)
        if err_w != out_w:
            os.close(err_w)
    return proc, out_r, err_r


def _devnull() -> int:
    """Return the daemon's one /dev/null descriptor (close-on-exec: the child gets it only as its stdin)."""
    global _devnull_fd
    if _devnull_fd < 0:
        with _DEVNULL_LOCK:
            if _devnull_fd < 0:
                _devnull_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)  # the mode Popen's DEVNULL uses
    return _devnull_fd


def _popen(
    argv: Sequence[str],
    cwd: str | os.PathLike[str],
    env: EnvB,
    executable: str | None,
    stdout: int,
    stderr: int,
    keep_fd: int | None = None,
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        executable=executable,  # argv[0] stays as written: the agent sees the name it was given
        cwd=cwd,
        env=env,
        stdin=_devnull(),
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        close_fds=True,
        pass_fds=() if keep_fd is None else (keep_fd,),
    )
