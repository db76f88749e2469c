"""The job store: the one owner of a job folder's state on disk.

A job folder (``active/<id>``, later ``review/``, ``done/`` or ``failed/``) holds
``order.<ext>`` (the dropped bytes), ``job.json`` (the ``JobSpec``), ``work/``,
``attempts/<n>/`` and, once finished, ``result.json``. Everything that reads or
writes those files is here, so that one module decides their format, and every
read of a file an agent could have touched is bounded, follows no link and
never blocks (``fsutil.read_regular``).

The finishing sequence, in order, each step safe to interrupt:

1. ``stage_result``: ``.result.json.staged`` written and fsynced in the folder;
2. the ledger records the end, conditional on the claim's fencing token
   (a job taken over by another daemon changes nothing: ``job.fenced``);
3. ``land``: the staged result renamed to ``result.json`` and the folder
   renamed into its state's folder (``done/``...); the state folders touched by
   a batch of jobs are fsynced once per batch.

A crash between 2 and 3 leaves a folder in active/ whose ledger row is finished:
recovery lands it from its staged result.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dispatcher import fsutil, procs
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.shortage import resource_of
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.result import CheckResult, Result
from dispatcher.text import is_count

JOB_FILE = "job.json"
RESULT = "result.json"
STAGED = ".result.json.staged"
AGENT_XATTR = "user.dispatcher.agent"  # on attempts/<n>/stdout.log: "PID BOOT_STARTED WALL_STARTED HOST PIDNS SLOT"
_HOST = procs.this_host()  # the host an attempt started on, as its record will say
_PIDNS = procs.pid_namespace()  # the pid namespace its pid is one of
SPEC_MAX = 8 * 1024 * 1024
RECORD_MAX = 1024 * 1024
_WORK_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


#: an attempt record kept by a fenced daemon (a staging name: hidden, never read as attempt.json)
FENCED_RECORD = ".attempt.json.fenced"


class JobFolder:
    """One job's folder wherever it is; every read bounded and link-safe."""

    def __init__(self, path: str | Path, *, claimed: float | None = None) -> None:
        # the paths as str: a job's per-attempt steps join strings (a Path per join costs more than the syscall)
        self._dir = os.fspath(path)
        self.job_id = self._dir.rpartition("/")[2]
        self.claimed = claimed  # Unix time of the job's claim, when known (the metrics count from it)
        self.work_dir = f"{self._dir}/work"  # work/ as a plain path (the hot path's: no Path made or converted)
        self._attempts = f"{self._dir}/attempts"
        self._named = False  # this process named a staged result result.json here (``name_result``)

    @property
    def path_str(self) -> str:
        """Return the folder as a plain path."""
        return self._dir

    @functools.cached_property
    def path(self) -> Path:
        """Return the folder as a Path, made once when first asked for."""
        return Path(self._dir)

    @functools.cached_property
    def work(self) -> Path:
        """Return work/ (the agent's working folder) as a Path, made once when first asked for."""
        return Path(self.work_dir)

    @functools.cached_property
    def attempts_dir(self) -> Path:
        """Return attempts/ as a Path, made once when first asked for."""
        return Path(self._attempts)

    # -- reading ----------------------------------------------------------------------------
    def read_json(self, rel: str, limit: int = RECORD_MAX, *, shortage_raises: bool = False) -> Any:
        """Return a JSON file of the folder, or None if missing, unreadable, odd or torn.

        With ``shortage_raises``, a shortage (EMFILE, ENOMEM ...) is raised: it says nothing of the file.
        """
        try:
            return json.loads(fsutil.read_regular(f"{self._dir}/{rel}", limit, base=self._dir))
        except OSError as exc:
            if shortage_raises and resource_of(exc) is not None:
                raise
            return None
        except (ValueError, fsutil.NotRegular, RecursionError):
            return None

    def spec(self) -> JobSpec:
        """Return the job's spec; raise ValueError if job.json is missing or damaged, OSError for a shortage."""
        data = self.read_json(JOB_FILE, SPEC_MAX, shortage_raises=True)
        try:
            return JobSpec.from_json(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{JOB_FILE} is missing or damaged ({type(exc).__name__})") from None

    @staticmethod
    def in_state_since(spec: JobSpec) -> float:
        """Return when the job entered its state: its claim, or its last return to active/ since (``spec.since``).

        Not when its order was read (``received``): an order read ahead waits for its agent's slot unclaimed.
        """
        if spec.since is not None:
            return spec.since
        return spec.claimed if spec.claimed is not None else spec.received

    def has_receipt(self) -> bool:
        """Return True if work/receipt.json exists as any entry (a link or FIFO too: it is never followed).

        Never through a work/ that is itself a link (its agent replaced it): that work/ is gone.
        """
        return os.path.lexists(f"{self.work_dir}/receipt.json") and not os.path.islink(self.work_dir)

    def attempt_numbers(self) -> list[int]:
        """Return the numbers of attempts/<n>/ folders, in order."""
        try:
            names = os.listdir(self._attempts)
        except OSError:
            return []
        return sorted(int(n) for n in names if is_count(n))

    def attempts(self) -> list[Attempt]:
        """Return the recorded attempts, in order (an attempt with no readable record is left out)."""
        out = []
        for n in self.attempt_numbers():
            data = self.read_json(f"attempts/{n}/attempt.json")
            try:
                out.append(Attempt.from_json(data))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        return out

    def pid_record(self, n: int) -> dict[str, Any] | None:
        """Return the running record of attempt n ({pid, boot_started[, started, host, pidns, slot_ino]}), or None.

        The agent's pid and start on the boot clock (and on the wall clock: ``started``, and the
        host it runs on), noted on its stdout.log as an extended attribute (``note_agent``);
        else one an older daemon wrote in attempt.json (or ``pid``).
        """
        try:
            pid, boot, *rest = os.getxattr(f"{self._attempts}/{n}/stdout.log", AGENT_XATTR).decode().split()
            record: dict[str, Any] = {"pid": int(pid), "boot_started": float(boot)}
            if rest:  # noted since the wall clock was added: the start as attempt.json would have it
                record["started"] = float(rest[0])
            if len(rest) > 1:  # noted since the host was added
                record["host"] = rest[1]
            if len(rest) > 2:  # and its pid namespace: a pid of another one means another process here
                record["pidns"] = rest[2]
            if len(rest) > 3 and is_count(rest[3]):  # and the inode of the slot lock the agent inherited
                record["slot_ino"] = int(rest[3])
            return record
        except (OSError, ValueError):
            pass
        for name in ("attempt.json", "pid"):  # "pid": jobs from before the record moved into attempt.json
            data = self.read_json(f"attempts/{n}/{name}")
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                return data
        return None

    def note_agent(self, n: int, pid: int, slot_fd: int | None = None) -> None:
        """Note attempt n's agent (its pid, its start on the boot and the wall clock, its host, its pid namespace and
        the inode of the slot lock it inherits) on its stdout.log.

        One system call, no file and no fsync (a power cut ends the agent too): after a crash
        of the daemon, recovery finds the agent's group by it even when the agent cleared the
        environment that names its job (``env -i``). A filesystem without user attributes
        keeps nothing; the environment then remains the only sign.
        """
        try:  # (not contextlib.suppress: three calls more at every agent's start)
            boot = time.clock_gettime(time.CLOCK_BOOTTIME)
            slot = os.fstat(slot_fd).st_ino if slot_fd is not None else "-"
            note = f"{pid} {boot:.3f} {time.time():.3f} {_HOST} {_PIDNS} {slot}"
            os.setxattr(f"{self._attempts}/{n}/stdout.log", AGENT_XATTR, note.encode())
        except OSError:
            return

    def result(self) -> Result | None:
        """Return result.json (or the staged result of a job cut short while landing), None if unreadable."""
        data = self.read_json(RESULT, SPEC_MAX)
        if data is None:
            data = self.read_json(STAGED, SPEC_MAX)
        return Result.from_json(data) if isinstance(data, dict) else None

    def staged_result(self) -> Result | None:
        """Return the staged result only (a decision not landed yet), None if there is none."""
        data = self.read_json(STAGED, SPEC_MAX)
        return Result.from_json(data) if isinstance(data, dict) else None

    def attempt_started(self, n: int) -> float | None:
        """Return when attempt n started (wall clock): its running record's, else when attempts/<n>/ last changed.

        The record noted on stdout.log at the spawn holds the start on the wall clock (on any host);
        attempts/<n>/ may have changed long after it (a full disk held the attempt's record back).
        """
        info = self.pid_record(n)
        if info is not None and isinstance(info.get("started"), int | float):
            return float(info["started"])
        try:
            return os.stat(f"{self._attempts}/{n}").st_mtime  # its logs are made just before the agent starts
        except OSError:
            return None

    def stdout_path(self, n: int) -> str:
        """Return the path of attempts/<n>/stdout.log."""
        return f"{self._attempts}/{n}/stdout.log"

    def stdout_tail(self, n: int, limit: int) -> bytes:
        """Return the last ``limit`` bytes of attempts/<n>/stdout.log (b"" when it cannot be read)."""
        return fsutil.read_tail(f"{self._attempts}/{n}/stdout.log", limit)

    def has_kept_result(self, n: int) -> bool:
        """Return True if attempts/<n>/ keeps an earlier result.json (the job was retried)."""
        try:
            return any(p.startswith("result") for p in os.listdir(self.attempts_dir / str(n)))
        except OSError:
            return False

    # -- writing ----------------------------------------------------------------------------
    def write_spec(self, spec: JobSpec, *, sync: bool = False) -> None:
        """Write job.json atomically."""
        fsutil.write_atomic(self.path / JOB_FILE, fsutil.dump_json(spec.to_json()), sync=sync, sync_dir=sync)

    def begin_attempt(self, n: int, *, sync: bool = True) -> str:
        """Make attempts/<n>/ (its logs come just before its agent starts: ``make_logs``); return its path.

        Raises OSError (a full disk, say) before any agent starts: the job then waits.
        Without ``sync`` the caller fsyncs ``attempts_path`` before the agent starts.
        """
        folder = f"{self._attempts}/{n}"
        fsutil.make_dir(folder)
        # attempts/<n>/ is the durable proof that attempt n may have started: after a power cut
        # recovery counts it as interrupted instead of starting an agent that is not retry-safe again
        if sync:
            fsutil.fsync_dir(self._attempts)
        return folder

    def make_logs(self, n: int, *, keep: bool = False) -> None:
        """Create attempts/<n>/stdout.log and stderr.log empty, as the last step before its agent starts.

        Until they exist, the agent of attempt n has certainly not started (see ``never_started``).
        ``keep`` leaves a log that exists as it is (recovery: an interrupted attempt keeps what it wrote).
        """
        folder = f"{self._attempts}/{n}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (0 if keep else os.O_TRUNC)
        for name in ("stdout.log", "stderr.log"):
            os.close(os.open(f"{folder}/{name}", flags, 0o640))

    def never_started(self, n: int) -> bool:
        """Return True if attempts/<n>/ exists without its logs: its agent was never started.

        Exact after a crash of the daemon alone; after a power cut the logs' entries may be lost
        although the agent ran, so only a job that may run again anyway (retry-safe) relies on it.
        """
        folder = f"{self._attempts}/{n}"
        return os.path.isdir(folder) and not os.path.lexists(f"{folder}/stdout.log")

    @property
    def attempts_path(self) -> str:
        """Return attempts/ as a plain path (what ``begin_attempt(sync=False)`` leaves to the caller to fsync)."""
        return self._attempts

    def begin_probe(self, n: int) -> Path:
        """Make attempts/<n>/ with empty probe logs; return the folder."""
        folder = self.attempts_dir / str(n)
        os.makedirs(folder, exist_ok=True)
        for name in ("probe-stdout.log", "probe-stderr.log"):
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
            os.close(fd)
        return folder

    def drop_attempt(self, n: int) -> None:
        """Remove attempts/<n>/ made for an agent that could not start (a config error, not an attempt)."""
        folder = self.attempts_dir / str(n)
        for name in ("stdout.log", "stderr.log", "pid"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
        with contextlib.suppress(OSError):
            os.rmdir(folder)

    def record_attempt(self, attempt: Attempt) -> None:
        """Write attempts/<n>/attempt.json (a torn first one reads as missing: the attempt counts as interrupted).

        A record written again (a retry marked, a usage limit noted) replaces the file whole through a
        rename: a crash in the rewrite leaves the first record, with its exit status, never a torn one.
        """
        path, data = f"{self._attempts}/{attempt.n}/attempt.json", fsutil.dump_json(attempt.to_json())
        try:
            fsutil.write_new(path, data)
        except FileExistsError:
            fsutil.write_atomic(Path(path), data, sync=False)

    def keep_fenced_attempt(self, attempt: Attempt) -> bool:
        """Keep the record of an attempt whose ``attempt.json`` was not written, its daemon fenced (section 12).

        A fenced daemon changes nothing outside its own staging names: the record goes to
        ``attempts/<n>/.attempt.json.fenced``, where whoever recovers the job takes it up
        (``take_fenced_attempt``). Return False if attempt.json was written after all.
        """
        folder = f"{self._attempts}/{attempt.n}"
        if os.path.lexists(f"{folder}/attempt.json"):
            return False
        fsutil.write_atomic(Path(f"{folder}/{FENCED_RECORD}"), fsutil.dump_json(attempt.to_json()), sync=False)
        return True

    def take_fenced_attempt(self, n: int) -> Attempt | None:
        """Return the record a fenced daemon kept for attempt n, now written as its attempt.json; None if none."""
        data = self.read_json(f"attempts/{n}/{FENCED_RECORD}")
        try:
            record = Attempt.from_json(data)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if record.n != n:
            return None
        self.record_attempt(record)
        with contextlib.suppress(OSError):
            os.unlink(f"{self._attempts}/{n}/{FENCED_RECORD}")
        return record

    def stash(self, n: int, *, feedback: bool = False) -> None:
        """Move receipt.json and outbox/ (and feedback.json) of attempt n into attempts/<n>/ (idempotent).

        Whatever they are (a file, a folder, a link, a FIFO), the entries are renamed,
        never read or followed, so no leftover can pass for proof of a later attempt;
        ``feedback`` also moves an older feedback.json aside before a new one is written.
        """
        folder = self.attempts_dir / str(n)
        os.makedirs(folder, exist_ok=True)
        moved = False
        _own_writable(self.work)  # left read-only by the agent: the moves and the feedback below need it
        for name in ("receipt.json", "outbox", "feedback.json")[: 3 if feedback else 2]:
            src = self.work / name
            if not os.path.lexists(src):
                continue
            dst, k = folder / name, 2
            while os.path.lexists(dst):
                dst, k = folder / f"{name}.{k}", k + 1
            _own_writable(src)  # a folder moved to another parent must be writable itself (its "..")
            os.rename(src, dst)
            moved = True
        if moved:  # durable before the next attempt starts: after a power cut no old receipt is back in work/
            _sync_dirs(self.work, folder)

    def give_feedback(self, n: int, checks: Sequence[CheckResult]) -> str:
        """Give a repair attempt work/feedback.json: the checks attempt n failed; return its digest.

        Attempt n's receipt, outbox/ and any older feedback.json are stashed first,
        so nothing is written through a link the agent left.
        """
        failed = [c.to_json() for c in checks if c.ok is False]
        data = fsutil.dump_json({"job_id": self.job_id, "attempt": n, "failed_checks": failed})
        self.stash(n, feedback=True)
        fsutil.write_new(self.work / "feedback.json", data, sync=True)
        fsutil.fsync_dir(self.work)  # given to the next attempt: a power cut must not take it back
        return fsutil.digest(data)

    def keep_result(self) -> None:
        """Move result.json into attempts/<last>/ (never over an older kept one), for a retry."""
        src = self.path / RESULT
        if not src.exists():
            return
        last = max(self.attempt_numbers(), default=0)
        keep_dir = self.attempts_dir / str(last)
        os.makedirs(keep_dir, exist_ok=True)
        keep, k = keep_dir / RESULT, 2
        while os.path.lexists(keep):
            keep, k = keep_dir / f"result-{k}.json", k + 1
        os.rename(src, keep)
        _sync_dirs(keep_dir, self.path)  # both names durable before the job leaves failed/ or review/

    def unkeep_result(self) -> bool:
        """Put back the result ``keep_result`` moved aside when the reopen it began was cut short; True if it did.

        Only for a folder still in failed/ or review/ without a result.json: the newest kept result
        of its last attempt is the one the cut reopen moved.
        """
        if os.path.lexists(self.path / RESULT):
            return False
        last = max(self.attempt_numbers(), default=0)
        keep_dir = self.attempts_dir / str(last)
        kept = sorted(keep_dir.glob("result*.json"), key=lambda p: int(p.stem.partition("-")[2] or 1))
        if not kept:
            return False
        try:
            fsutil.rename_noreplace(kept[-1], self.path / RESULT)
        except (FileExistsError, FileNotFoundError):  # put back meanwhile (another command, a daemon)
            return False
        _sync_dirs(keep_dir, self.path)
        return True

    def kept_end(self) -> tuple[str | None, list[CheckResult]]:
        """Return the reason and the checks of the newest result ``keep_result`` kept (a reopened job's last end)."""
        for n in reversed(self.attempt_numbers()):
            folder = self.attempts_dir / str(n)
            kept = sorted((p for p in folder.glob("result*.json")), key=lambda p: int(p.stem.partition("-")[2] or 1))
            if kept:
                data = self.read_json(f"attempts/{n}/{kept[-1].name}")
                if not isinstance(data, dict):
                    return None, []
                reason, checks = data.get("reason"), data.get("checks")
                rebuilt = (
                    [CheckResult.from_json(c) for c in checks if isinstance(c, dict)]
                    if isinstance(checks, list)
                    else []
                )
                return (reason if isinstance(reason, str) else None), rebuilt
        return None, []

    def sync_outbox(self, names: list[str]) -> None:
        """Make the follow-ups in work/outbox/ durable (their bytes, then the folders naming them).

        The agent wrote them without fsync; the ledger is about to reserve them, and
        their release after a power cut reads these very files.
        """
        outbox = self.work / "outbox"
        for name in names:
            fd = os.open(outbox / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsutil.fsync_dir(outbox)
        fsutil.fsync_dir(self.work)

    def sync_work(self, rels: Sequence[str]) -> None:
        """Make files of work/ durable: their bytes, then each folder naming them, up to work/ itself.

        For the files the checks vouch for (the follow-ups, ``accept.output``, the receipt),
        in the order given: the agent wrote them without fsync, and result.json is about to
        say they passed. The folders come after every file, work/ last. Every path is
        opened one part at a time without following links, from work/ opened once
        (``fsutil.open_beneath``); one that is gone or is not a regular file is left out
        (the checks said so already).
        """
        if not rels:
            return
        folders: dict[tuple[str, ...], None] = {}  # the parts of each folder below work/
        work = os.open(self.work_dir, _WORK_FLAGS)
        try:
            for rel in rels:
                fd = self._open_in_work(work, rel, folders)
                if fd is None:
                    continue
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        os.fsync(fd)
                finally:
                    os.close(fd)
            for rel_dir in sorted(folders, key=len, reverse=True):
                try:
                    fd = fsutil.open_beneath(self.work_dir, "/".join(rel_dir), dir_fd=work)
                except (FileNotFoundError, fsutil.NotRegular):
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.fsync(work)
        finally:
            os.close(work)

    def _open_in_work(self, work: int, rel: str, folders: dict[tuple[str, ...], None]) -> int | None:
        """Open work/<rel> for ``sync_work`` without following links (None: gone or not a file); note its folders."""
        try:
            fd = fsutil.open_beneath(self.work_dir, rel, dir_fd=work)
        except (FileNotFoundError, NotADirectoryError, fsutil.NotRegular):
            return None
        if "/" in rel:
            parts = fsutil.rel_parts(rel)
            for k in range(len(parts) - 1, 0, -1):  # its folders below work/, the deepest first
                folders[parts[:k]] = None
        return fd

    def stage_result(self, result: Result) -> None:
        """Step 1 of finishing: write the result under its staging name, fsynced (a torn one is rewritten)."""
        for error in fsutil.fsync_many(self.write_staged(result)):
            if error is not None:
                raise error

    def write_staged(self, result: Result) -> tuple[str, str]:
        """Step 1 without its fsyncs: write the staged result; return what the caller must fsync before the ledger
        records the end (the file, and the folder for its name: recovery lands from it)."""
        staged = f"{self._dir}/{STAGED}"
        fsutil.write_in_place(staged, fsutil.dump_json(result.to_json()))
        return staged, self._dir

    def name_result(self, *, replace: bool = False) -> str | None:
        """Step 3's first half: name the staged result result.json; return the folder to fsync (None: no staged one).

        A result.json already there is replaced only when ``replace`` (a review's decision names its result over
        the one that says `review`), or when this process named it (a finish tried again after a shortage met
        after the naming); else it is none of the daemon's (an agent wrote outside work/), and the
        FileExistsError leaves the job stuck, never overwriting it.
        """
        staged, result = f"{self._dir}/{STAGED}", f"{self._dir}/{RESULT}"
        try:  # no lexists first: the rename says whether a staged result is there (one system call, not two)
            if replace or self._named:
                os.rename(staged, result)
            else:
                fsutil.rename_noreplace(staged, result)
            self._named = True
        except FileNotFoundError:
            return None
        except FileExistsError:
            with contextlib.suppress(OSError):
                if os.path.samefile(staged, result):  # a link-and-unlink rename (no renameat2) cut by a crash
                    os.unlink(staged)
                    return self._dir
            raise
        return self._dir

    def move_to(self, layout: Layout, state: State) -> str:
        """Step 3's second half: move the folder into state's folder (once its result.json is on disk); return it."""
        target = layout.job_str(state, self.job_id)
        if self._dir != target:
            fsutil.rename_into(self._dir, target)  # FileNotFoundError: landed already
        return target

    def land(self, layout: Layout, state: State) -> str:
        """Step 3 of finishing: name the staged result result.json and move the folder to state's folder.

        The caller fsyncs the state folder (once per batch).
        """
        if self.name_result() is not None:
            fsutil.fsync_dir(self._dir)  # else a power cut can bring the folder back in done/ without result.json
        return self.move_to(layout, state)


def _sync_dirs(*folders: str | Path) -> None:
    """Fsync these folders at once (a rename between them is durable in both); raise the first error."""
    for error in fsutil.fsync_many([str(f) for f in folders]):
        if error is not None:
            raise error


def _own_writable(path: str | Path) -> bool:
    """Give a file or folder of the daemon's own user back its owner's rights when an agent took them away;
    return True if it had to.

    An agent runs as that user and may leave ``work/``, ``work/outbox/`` or its job folder
    read-only; a daemon that is not root could then not set a receipt aside nor write its
    records. Links and what another user owns are left as they are (a write then fails as before).
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    want = stat.S_IRWXU if stat.S_ISDIR(st.st_mode) else stat.S_IRUSR | stat.S_IWUSR
    if st.st_uid != os.geteuid() or stat.S_ISLNK(st.st_mode) or st.st_mode & want == want:
        return False
    os.chmod(path, stat.S_IMODE(st.st_mode) | want)
    return True


def give_back_rights(folder: str) -> int:
    """Give the daemon's own user back its rights on a job folder's own files and folders; return how many.

    Only the folder itself, work/ as a folder and what lies outside work/ are touched: the
    agent's files in work/ are its work, and its checks judge them as they are.
    """
    mended = 0
    with contextlib.suppress(OSError):
        mended += _own_writable(folder)
    for top, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            with contextlib.suppress(OSError):
                mended += _own_writable(os.path.join(top, name))
        if top == folder:
            dirs[:] = [d for d in dirs if d != "work"]  # work/ itself mended above, not what the agent made in it
    return mended
