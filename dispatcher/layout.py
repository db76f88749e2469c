"""The dispatch root's folders, and the job states they stand for."""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

UMASK = 0o027


class State(enum.StrEnum):
    """Where a job is; each state is a folder of the dispatch root."""

    ACTIVE = "active"
    REVIEW = "review"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Layout:
    """Every path of one dispatch root, in one place."""

    root: Path

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def held(self) -> Path:
        """Orders an operator put on hold (never claimed there)."""
        return self.root / "held"

    @property
    def state_dir(self) -> Path:
        """The daemon's own state: ledger, locks, staging (not part of the contract)."""
        return self.root / ".state"

    @property
    def ledger(self) -> Path:
        return self.state_dir / "ledger.sqlite3"

    @property
    def staging(self) -> Path:
        """Where job and refusal folders are built before one rename puts them in place."""
        return self.state_dir / "staging"

    @property
    def daemons(self) -> Path:
        """One lock file (held while alive) and one info file per daemon process."""
        return self.state_dir / "daemons"

    @property
    def slots(self) -> Path:
        """Lock files that bound each agent's concurrency over all daemons."""
        return self.state_dir / "slots"

    @property
    def control(self) -> Path:
        """Hint files dropped by `retry` and `cancel` to wake a running daemon."""
        return self.state_dir / "control"

    def folder(self, state: State) -> Path:
        return self.root / state.value

    def job(self, state: State, job_id: str) -> Path:
        return self.root / state.value / job_id

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

    def create(self) -> None:
        """Create the missing folders of the layout."""
        for path in self.all_dirs():
            path.mkdir(parents=True, exist_ok=True)

    def find(self, job_id: str) -> tuple[State, Path] | None:
        """Return the state and folder of a job, or None if it has no folder."""
        root = os.fspath(self.root)
        for state in State:
            path = f"{root}/{state.value}/{job_id}"
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    return state, Path(path)
            except OSError:
                continue
        return None


def utc_stamp(when: float | None = None) -> str:
    """Return a refusal-folder timestamp such as 20261129T081600.123456Z."""
    moment = datetime.fromtimestamp(when, UTC) if when is not None else datetime.now(UTC)
    return moment.strftime("%Y%m%dT%H%M%S.%fZ")


def iso(when: float) -> str:
    """Return an ISO 8601 UTC time with milliseconds, as result.json writes it."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(when * 1000) % 1000:03d}Z"


def parse_iso(text: str) -> float:
    """Return epoch seconds for an ``iso`` time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def has_jobs(layout: Layout, *, finished: bool = False) -> bool:
    """Return True if any job folder exists in active/, review/, done/ or failed/ (not active/ when finished)."""
    for state in State:
        if finished and state is State.ACTIVE:
            continue
        try:
            with os.scandir(layout.folder(state)) as it:
                if any(not de.name.startswith(".") for de in it):
                    return True
        except FileNotFoundError:
            continue
    return False
