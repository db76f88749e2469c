"""The dispatch root's folders, and the job states they stand for."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from dispatcher import fsutil, storage
from dispatcher.errors import NotFound, printable
from dispatcher.lifecycle import State

UMASK = 0o027
#: a job id (the order schema's pattern): never a path, a refused file's ``stem@time`` or a control character
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, slots=True)
class Layout:
    """Every path of one dispatch root, in one place (made once: the hot path joins no paths again)."""

    root: Path
    inbox: Path = field(init=False, repr=False, compare=False)
    held: Path = field(init=False, repr=False, compare=False)  # orders an operator put on hold (never claimed)
    state_dir: Path = field(init=False, repr=False, compare=False)  # ledger, locks, staging (not in the contract)
    ledger: Path = field(init=False, repr=False, compare=False)
    staging: Path = field(init=False, repr=False, compare=False)  # job and refusal folders built before one rename
    daemons: Path = field(init=False, repr=False, compare=False)  # a lock file and an info file per daemon
    slots: Path = field(init=False, repr=False, compare=False)  # lock files bounding each agent's concurrency
    control: Path = field(init=False, repr=False, compare=False)  # hint files that wake a running daemon
    # the hot path's folders as plain paths, the same text as the Paths: a job's steps join str (a Path per
    # join, and its conversion at each system call, cost more than the call)
    inbox_str: str = field(init=False, repr=False, compare=False)
    staging_str: str = field(init=False, repr=False, compare=False)
    _folders: dict[State, Path] = field(init=False, repr=False, compare=False)
    _folder_strs: dict[State, str] = field(init=False, repr=False, compare=False)
    _job_prefixes: dict[State, str] = field(init=False, repr=False, compare=False)  # "ROOT/STATE/"

    def __post_init__(self) -> None:
        root, state_dir = self.root, self.root / ".state"
        folders = {s: root / s.value for s in State}
        prefixes = {s: f"{os.fspath(p)}/" for s, p in folders.items()}
        for name, path in (
            ("inbox", root / "inbox"),
            ("held", root / "held"),
            ("state_dir", state_dir),
            ("ledger", state_dir / "ledger.sqlite3"),
            ("staging", state_dir / "staging"),
            ("daemons", state_dir / "daemons"),
            ("slots", state_dir / "slots"),
            ("control", state_dir / "control"),
            ("inbox_str", os.fspath(root / "inbox")),
            ("staging_str", os.fspath(state_dir / "staging")),
            ("_folders", folders),
            ("_folder_strs", {s: os.fspath(p) for s, p in folders.items()}),
            ("_job_prefixes", prefixes),
        ):
            object.__setattr__(self, name, path)

    def worktree(self, job_id: str) -> Path:
        """Return where a job's git worktree lives (contract section 15): outside its folder, which moves."""
        return self.state_dir / "worktrees" / job_id

    def folder(self, state: State) -> Path:
        """Return the folder of a state (active/, review/, done/, failed/)."""
        return self._folders[state]

    def job(self, state: State, job_id: str) -> Path:
        """Return the folder a job has in a state."""
        return self._folders[state] / job_id

    def folder_str(self, state: State) -> str:
        """Return ``folder(state)`` as a plain path (for the hot path: no Path made or converted)."""
        return self._folder_strs[state]

    def job_str(self, state: State, job_id: str) -> str:
        """Return ``job(state, job_id)`` as a plain path (for the hot path: no Path made or converted)."""
        return self._job_prefixes[state] + job_id

    def all_dirs(self) -> list[Path]:
        """Return every folder `run` and `init` create."""
        return [
            self.inbox,
            self.held,
            *(self.folder(s) for s in State),
            self.state_dir,
            self.staging,
            self.daemons,
            self.slots,
            self.control,
        ]

    def create(self) -> bool:
        """Create the missing folders of the layout, durably (each new folder's parent fsynced once).

        Return True if any was made; an existing root costs a stat per folder.
        """
        return fsutil.make_dirs(*self.all_dirs())

    def elsewhere(self) -> Path | None:
        """Return the first folder of the layout on another filesystem than the root (a mount), or None.

        A job moves between the folders by rename, which only works inside one filesystem.
        """
        device = os.stat(self.root).st_dev
        for path in self.all_dirs():
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_dev != device:
                    return path
        try:  # a bind mount of a folder of the same disk: the same device, a mount of its own
            with open(storage.MOUNTINFO, encoding="utf-8", errors="surrogateescape") as fh:
                mountinfo = fh.read()
        except OSError:
            return None
        point = storage.mount_point_of(os.path.realpath(self.root), mountinfo)
        for path in self.all_dirs():
            if os.path.isdir(path) and storage.mount_point_of(os.path.realpath(path), mountinfo) != point:
                return path
        return None

    def find(self, job_id: str) -> tuple[State, Path] | None:
        """Return the state and folder of a job, or None if it has no folder."""
        is_dir, lstat = stat.S_ISDIR, os.lstat
        for state, prefix in self._job_prefixes.items():
            path = prefix + job_id
            try:
                if is_dir(lstat(path).st_mode):
                    return state, Path(path)
            except (OSError, ValueError):  # ValueError: a NUL in what is no job id names no folder
                continue
        return None


def has_jobs(layout: Layout, *, finished: bool = False) -> bool:
    """Return True if any job folder exists in active/, waiting/, review/, done/ or failed/.

    With ``finished``, only review/, done/ and failed/ count (claims commit without an fsync:
    after a power cut a young ledger may hold no row beside active/ jobs, which are put back at
    start). A refused file's folder (``<stem>@<time>`` in failed/) is not a job: it never made
    the ledger lose anything (contract 13).
    """
    for state in State:
        if finished and state in (State.ACTIVE, State.WAITING):
            continue
        try:
            with os.scandir(layout.folder(state)) as it:
                if any(is_job_entry(de) and "@" not in de.name for de in it):
                    return True
        except FileNotFoundError:
            continue
    return False


def is_job_entry(de: os.DirEntry[str]) -> bool:
    """Return True for an entry of a state folder that may be a job (or a refusal): a folder, not hidden.

    A job is always a folder; a file or link put there by hand (a README, an editor's
    backup) is no job: never recovered, counted, listed or taken for a lost ledger.
    """
    return not de.name.startswith(".") and de.is_dir(follow_symlinks=False)


def is_ignored(name: str) -> bool:
    """Return True for hidden and temporary names in inbox/ (never picked up)."""
    return name.startswith(".") or name.endswith((".tmp", ".part"))


def name_is_utf8(name: str) -> bool:
    """Is a file name (bytes the OS gave, surrogate-escaped where they were not UTF-8) valid UTF-8?"""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_id(job_id: str) -> None:
    """Raise NotFound (the id shown escaped) unless job_id is a job id, before it names a folder or a ledger row."""
    if not JOB_ID.fullmatch(job_id):
        raise NotFound(f"{printable(job_id)}: not a job id (letters, digits, '.', '_', '-'; at most 128)")


def hint_name(kind: str, job_id: str) -> str:
    """Return the name of a command's hint file in control/: ``<kind>-<job id>-<ns>`` (unique per call)."""
    return f"{kind}-{job_id}-{time.time_ns()}"


def job_of_hint(name: str) -> str:
    """Return the job id a hint file names (``hint_name``'s; ids hold no dot, may hold ``-``)."""
    return name.split("-", 1)[1].rsplit("-", 1)[0]
