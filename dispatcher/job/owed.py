"""A hook a job owes once it is final, made exactly-once with a durable marker (contract section 15).

Two hooks use it: ``land`` after a job is done (``job/landing.py``) and the
``after`` hook of a final job (``job/afterowed.py``). The marker
``.state/<kind>/<job_id>`` is written durably before the job's finish is
committed; a daemon renames it to ``<job_id>.running`` to run the hook (one rename
wins), writes the run's record into that marker, then into the job folder, and
drops the marker. The process that runs a hook holds an exclusive ``flock`` on its
``.running`` marker from before the rename until the marker is gone, so a daemon
that starts on the same root meanwhile leaves it alone. A job that is final at
once (no review) has its marker written locked by its own daemon (``own``), which
keeps the lock through its finish and takes the marker itself (``take``): another
daemon's pass, which may run at any moment, never runs that job's hooks meanwhile,
nor out of their order. An unlocked ``.running``
marker found at start is a run a stop or crash cut short: an empty one is recorded
as failed, never run again by itself; one holding its record was run to its end,
and only its record is put in place (once).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher import faults, fsutil
from dispatcher.job import hooks
from dispatcher.job.runner import build_env, dispatch_env
from dispatcher.job.worktree import Workspace, read_record
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.spec.result import Result
from dispatcher.spec.settings import Agent, Config, Hook

RUNNING = ".running"
Io = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Owed:
    """What a pass over the markers found: jobs to run the hook for now, runs a crash cut short, and runs
    that ended before a crash but whose record was put in place only now (job id, the run's record)."""

    ready: list[str]
    interrupted: list[str]
    ended: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # runs now: a live process holds the marker's lock


class Markers:
    """The markers of one owed hook, in ``.state/<kind>/``; every method blocks (call it in a lane)."""

    def __init__(
        self, kind: str, *, ready_in: frozenset[State], settled_in: frozenset[State], records: tuple[str, str]
    ) -> None:
        self.kind = kind
        self.records = records  # (sub-folder, file prefix) of the run records in a job folder
        self.ready_in = ready_in  # a job in these states runs its hook now
        self.settled_in = settled_in  # a job in these states owes nothing any more
        self._held: dict[str, int] = {}  # job id -> the locked descriptor of its ``.running`` marker
        self._lock = threading.Lock()

    def folder(self, layout: Layout) -> Path:
        """Return the folder of the markers."""
        return layout.state_dir / self.kind

    def owe(self, layout: Layout, job_id: str) -> None:
        """Record durably that job_id owes the hook (before its finish is committed)."""
        folder = self.folder(layout)
        fsutil.make_dirs(folder)  # the first marker of a root: the folder's name is part of the record
        if not (folder / job_id).exists():
            fsutil.write_atomic(folder / job_id, b"")

    def own(self, layout: Layout, job_id: str) -> None:
        """Record durably that job_id owes the hook and that this process runs it (before its finish is committed).

        The marker is written anew and stays locked (``flock``) until ``take``, ``settle`` or
        ``let_go``: a pass of another daemon on this root finds it owed and leaves it alone
        (and, for the ``after`` hook, lands nothing meanwhile), so that the job's own daemon
        runs its hooks in their order once the finish is committed. A crash before that
        leaves it owed, unlocked: the next pass runs it.
        """
        folder = self.folder(layout)
        fsutil.make_dirs(folder)
        self._hold(job_id, _write_locked(folder / job_id, b""))

    def take(self, layout: Layout, job_id: str, *, new: bool) -> bool:
        """Take job_id's marker for this process's own run of the hook; False when it is not ours to run.

        The marker this process owns (``own``) is renamed to ``.running``, its lock kept; else an
        owed one is claimed as a pass would; else, with ``new``, one is made (``start``). False
        when another process runs it now, or, without ``new``, when nothing is owed.
        """
        folder = self.folder(layout)
        with self._lock:
            fd = self._held.get(job_id)
        if fd is not None and _same_file(fd, folder / job_id):
            os.rename(folder / job_id, folder / f"{job_id}{RUNNING}")
            try:
                fsutil.fsync_dir(folder)
            except BaseException:
                _undo_rename(folder, job_id)  # still owned, not taken: the take may be tried again
                raise
            return True
        if os.path.lexists(folder / job_id):
            return self.claim(layout, job_id)
        if not new:
            return False
        self.start(layout, job_id)
        return True

    def held_fd(self, job_id: str) -> int | None:
        """Return the descriptor of job_id's marker lock this process holds (its hook inherits it), or None."""
        with self._lock:
            return self._held.get(job_id)

    def let_go(self, job_id: str) -> None:
        """Give up the lock this process holds on job_id's marker, if any: what it owes stays for a pass."""
        self._release(job_id)

    def claim(self, layout: Layout, job_id: str) -> bool:
        """Take the owed hook of job_id (one rename wins); False when it is not owed or another run holds it.

        The marker is locked before it is renamed, and stays locked until ``settle``.
        """
        folder = self.folder(layout)
        fd = _lock_current(folder / job_id)
        if fd is None:
            return False
        try:
            os.rename(folder / job_id, folder / f"{job_id}{RUNNING}")
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, FileNotFoundError):  # taken meanwhile by a claim that locked it first and let go
                return False
            raise
        try:
            fsutil.fsync_dir(folder)
        except BaseException:
            _undo_rename(folder, job_id)  # not claimed after all (a shortage, say): owed as before
            os.close(fd)
            raise
        self._hold(job_id, fd)
        return True

    def start(self, layout: Layout, job_id: str) -> None:
        """Mark durably that a final job's own hook runs now (no claim: nothing was owed), locked as a claim's."""
        folder = self.folder(layout)
        fsutil.make_dirs(folder)
        try:
            fd = _write_locked(folder / f"{job_id}{RUNNING}", b"")
        except BaseException:
            with contextlib.suppress(OSError):  # not durable: not started (a run that never began is no cut run)
                os.unlink(folder / f"{job_id}{RUNNING}")
            raise
        self._hold(job_id, fd)

    def _hold(self, job_id: str, fd: int) -> None:
        with self._lock:
            old = self._held.pop(job_id, None)
            self._held[job_id] = fd
        if old is not None:
            os.close(old)

    def _release(self, job_id: str) -> None:
        with self._lock:
            fd = self._held.pop(job_id, None)
        if fd is not None:
            os.close(fd)

    def finish(self, layout: Layout, job_id: str, path: Path, data: dict[str, Any]) -> None:
        """Record the claimed run of job_id's hook in its job folder at path, then drop the marker.

        The record goes into the ``.running`` marker first: a stop or crash before the marker
        is dropped then leaves a run known to have ended, whose record is put in place once at
        the next start, never a second record saying it was cut short.
        """
        body = fsutil.dump_json(data)
        self._hold(job_id, _write_locked(self.folder(layout) / f"{job_id}{RUNNING}", body))
        faults.point(f"{self.kind}.ended")
        _put_record(path / self.records[0], self.records[1], body)
        faults.point(f"{self.kind}.recorded")
        self.settle(layout, job_id)

    def settle(self, layout: Layout, job_id: str) -> None:
        """Drop the marker of job_id (its record is written), then its lock."""
        folder = self.folder(layout)
        try:
            for name in (job_id, f"{job_id}{RUNNING}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(folder / name)
            fsutil.fsync_dir(folder)
        finally:
            self._release(job_id)

    def look(self, layout: Layout) -> Owed:
        """Sort the markers: jobs in ``ready_in`` run now, gone or settled ones owe nothing, others wait.

        An unlocked ``.running`` marker is a run a crash cut short (its process died: a live run
        holds its lock from the marker's first byte): it is not run again. It is found at start
        and by a live daemon's pass alike, so that with two daemons on a root the one left ends
        what the dead one's hook left running and records it before it lands the job. A locked
        one runs now, in this or another daemon on this root or a `dispatcher land`.
        """
        try:
            names = sorted(os.listdir(self.folder(layout)))
        except FileNotFoundError:
            return Owed([], [])
        ready, interrupted, running = [], [], []
        ended: list[tuple[str, dict[str, Any]]] = []
        for name in names:
            if name.startswith("."):  # a marker being written (``write_atomic``'s temp name): no job id starts so
                continue
            if name.endswith(RUNNING):
                job_id = name[: -len(RUNNING)]
                record = self.ended(layout, job_id)
                if record is None:
                    interrupted.append(job_id)
                elif record:
                    ended.append((job_id, record))
                elif os.path.lexists(self.folder(layout) / name):
                    running.append(job_id)
                continue
            found = layout.find(name)
            if found is not None and found[0] in self.ready_in:
                ready.append(name)
            elif found is None or found[0] in self.settled_in:
                self.settle(layout, name)
        return Owed(ready, interrupted, ended, running)

    def busy(self, layout: Layout, job_id: str) -> bool:
        """Return True while job_id's hook is owed and not run yet, or runs now in a live process (its lock held).

        A ``.running`` marker no process holds is a run a crash cut short: the next pass records it.
        """
        folder = self.folder(layout)
        if os.path.lexists(folder / job_id):
            return True
        path = folder / f"{job_id}{RUNNING}"
        if not os.path.lexists(path):
            return False
        fd = _lock_current(path)
        if fd is None:
            return os.path.lexists(path)  # locked: it runs now, here or in another daemon on this root
        os.close(fd)
        return False

    def ended(self, layout: Layout, job_id: str) -> dict[str, Any] | None:
        """Return None when job_id's ``.running`` marker is a run cut short (unlocked and empty).

        Its lock is then held by this process until ``settle`` (the run recorded) or ``let_go``.

        An empty mapping when another process runs it now (the marker is locked). The run's record
        when the marker holds the record of a run that ended: its process died before the marker
        went, and so before the run's line was logged; the record is put in the job folder unless
        it is there already, and the marker dropped.
        """
        path = self.folder(layout) / f"{job_id}{RUNNING}"
        fd = _lock_current(path)
        if fd is None:
            return {}  # settled meanwhile, or its run goes on in a live process
        try:
            body = _read_all(fd)
            if not body:  # cut short: the lock is kept until ``record_interrupted`` settles it
                self._hold(job_id, fd)
                fd = -1
                return None
            found = layout.find(job_id)
            if found is not None:
                _put_record(found[1] / self.records[0], self.records[1], body)
            self.settle(layout, job_id)
            try:
                record = json.loads(body)
            except ValueError:
                record = None
            return record if isinstance(record, dict) and record else {"ok": False}
        finally:
            if fd >= 0:
                os.close(fd)  # held until the marker is gone: a daemon starting beside this one waits its turn


def _lock_current(path: Path) -> int | None:
    """Lock the file at path (``flock``, not waiting) and return its fd; None when it is gone or locked.

    The file locked must be the one still at path: a run that ends renames its record over
    its empty marker and then lets the old one go, which a plain open-then-lock would take
    for a marker no one holds.
    """
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.lstat(path).st_ino:
                return fd
        except BlockingIOError:
            os.close(fd)
            return None
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced meanwhile: look at the new one
    return None  # replaced again and again: a live run writes it


def _undo_rename(folder: Path, job_id: str) -> None:
    """Give a marker taken by a rename whose fsync failed its owed name back (best effort)."""
    with contextlib.suppress(OSError):
        os.rename(folder / f"{job_id}{RUNNING}", folder / job_id)


def _same_file(fd: int, path: Path) -> bool:
    """Return True if the open fd is the file at path."""
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def _write_locked(path: Path, body: bytes) -> int:
    """Write body to path through a temporary file locked (``flock``) before its rename; return the locked fd.

    The file and its folder are fsynced, as ``fsutil.write_atomic`` does.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a file of its own: no one else holds it
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        os.rename(tmp, path)
        fsutil.fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def record_run(folder: Path, sub: str, prefix: str, data: dict[str, Any]) -> Path:
    """Write <sub>/<prefix><k>.json in a job folder, never over an earlier one (blocking)."""
    return _put_record(folder / sub, prefix, fsutil.dump_json(data), always=True)


def _put_record(out: Path, prefix: str, body: bytes, *, always: bool = False) -> Path:
    """Write body as the next <prefix><k>.json in out; unless always, not when a record already holds it."""
    out.mkdir(exist_ok=True)
    k = 1
    while (out / f"{prefix}{k}.json").exists():
        if not always and (out / f"{prefix}{k}.json").read_bytes() == body:
            return out / f"{prefix}{k}.json"
        k += 1
    fsutil.write_atomic(out / f"{prefix}{k}.json", body)
    return out / f"{prefix}{k}.json"


async def run_hook(
    name: str,
    hook: Hook,
    path: Path,
    job_id: str,
    agent: Agent,
    result: Result | None,
    cfg: Config,
    io: Io,
    *,
    log_dir: Path,
    worktree_first: bool,
    keep_fd: int | None = None,
) -> tuple[hooks.HookRun, dict[str, str]]:
    """Run a final job's hook (``land``, an owed ``after``) with the job's placeholders; return it and them.

    It runs in the repository (first in the worktree, if ``worktree_first`` and it is still
    there), or in ``work/`` for a job without a workspace; ``{workspace}`` names where it runs.
    """
    work = path / "work"
    ws: Workspace | None = await io(read_record, path)
    wsr = result.extra.get("workspace") if result is not None else None
    wsr = wsr if isinstance(wsr, dict) else {}
    workspace = ws.path if ws is not None else str(work)
    places = (workspace if worktree_first else "", ws.repo if ws is not None else "")
    cwd = next((Path(p) for p in places if p and os.path.isdir(p)), work)
    if ws is not None and cwd == Path(ws.repo):
        workspace = ws.repo  # the worktree is gone (or never the place): the hook's workspace is the repository
    values = {
        "job_id": job_id,
        "workspace": workspace,
        "branch": ws.branch if ws is not None else "",
        "head": str(wsr.get("head") or ""),
        "result": str(path / "result.json"),
    }
    env = build_env(agent.env, dispatch_env(job_id, work, 0, Path(values["workspace"])), agent.pass_env)
    faults.point(f"{name}.started")
    done = await hooks.run_hook(
        name, hook, values, cwd=cwd, env=env, kill_grace_s=cfg.kill_grace_s, log_dir=log_dir,
        max_log_bytes=cfg.max_log_bytes, keep_fd=keep_fd,
    )  # fmt: skip
    return done, values
