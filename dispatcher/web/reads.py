"""What the web view reads: the same queries as `status`, `list` and `show`, through one kept ledger.

The ledger is opened once, on first use, the way the reading commands open it
(``open_reader``: never created, never written but for the engine's own
open), and kept: opening a SQLite ledger takes its write lock for a moment, so
opening it per request would slow the daemon. Calls are serialised by a lock
(the engines' connections are shared). A root that has no ledger yet is read
from its folders alone until one appears. An SQLite ledger is looked at again
before each read (one ``stat``): one deleted or rebuilt since it was opened is
opened again, so the view answers as the commands do (a 503 while it is missing
beside jobs), never from the deleted file it still holds.

The overview is cached for at most ``CACHE_S``: many open pages, or a page that
polls, cost one read per turn, not one each. A cached overview is used only while
the root looks unchanged (``_fingerprint``: the modification times of the layout's
folders and of an SQLite ledger's files), so an action, `submit` or a job that moves
shows in the next `/api/status` at once, as `status --json` would show it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from dispatcher.errors import DispatchError, printable
from dispatcher.fsutil import file_id
from dispatcher.layout import JOB_ID, Layout
from dispatcher.ledger.base import Ledger
from dispatcher.lifecycle import State
from dispatcher.query.jobinfo import log_tail, refusal_json, show_json
from dispatcher.query.listing import list_jobs, refusals_of
from dispatcher.query.report import status_with
from dispatcher.spec.settings import Config
from dispatcher.store.ledgers import LedgerLost, NoLedgerYet, open_reader

#: a refused file's folder name in failed/: its stem, @, a UTC time, perhaps -2, -3...
REFUSAL = re.compile(r"[^/\x00-\x1f]{1,200}@\d{8}T\d{6}(?:\.\d+)?Z(?:-\d+)?")
#: how long an overview is reused
CACHE_S = 1.0
#: lines of each attempt's stdout and stderr a job page shows
PAGE_TAIL_LINES = 20
#: at most this much of an attempt's diff.patch is shown
DIFF_BYTES = 256 * 1024


class Reader:
    """Read-only access to one dispatch root for the web view."""

    def __init__(self, config: Config, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self._ledger: Ledger | None = None
        self._opened: tuple[int, int] | None = None  # (st_dev, st_ino) of the SQLite ledger file it opened
        self._lock = threading.Lock()
        self._cached: tuple[float, tuple[tuple[int, int], ...], dict[str, Any]] | None = None
        names = [layout.inbox, layout.held, *(layout.folder(s) for s in State), layout.daemons, layout.control]
        if config.ledger == "sqlite":
            names += [layout.ledger, Path(f"{layout.ledger}-wal")]
        self._watched = [os.fspath(p) for p in names]

    def close(self) -> None:
        """Close the ledger if it was opened."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        self._opened = None

    def _file_id(self) -> tuple[int, int] | None:
        """Return (st_dev, st_ino) of the SQLite ledger file, None if it is missing (or not SQLite)."""
        return file_id(self.layout.ledger) if self.config.ledger == "sqlite" else None

    def _reader(self) -> Ledger | None:
        """Return the kept ledger, opening it on first use; None while the root has none (call under the lock).

        A kept SQLite ledger whose file was deleted or replaced since is closed and opened again.
        """
        if self._ledger is not None and self.config.ledger == "sqlite" and self._file_id() != self._opened:
            self._drop()
        if self._ledger is None:
            opened = self._file_id()
            self._ledger = open_reader(self.config, self.layout)
            self._opened = opened if self._ledger is not None else None
        return self._ledger

    def check(self) -> None:
        """Open the ledger now; raise LedgerLost as every command does when it is lost beside job folders.

        A ledger out of reach (a PostgreSQL server down) is not raised: the view answers 503 until it is back.
        """
        with self._lock:
            try:
                self._reader()
            except LedgerLost as exc:
                if not isinstance(exc, NoLedgerYet):
                    raise
            except DispatchError:
                pass

    def _fingerprint(self) -> tuple[tuple[int, int], ...]:
        """Return what changes when the overview may: each watched folder's and ledger file's (mtime, size)."""
        out = []
        for path in self._watched:
            try:
                st = os.stat(path)
            except OSError:
                out.append((-1, -1))
                continue
            out.append((st.st_mtime_ns, st.st_size))
        return tuple(out)

    def status(self) -> dict[str, Any]:
        """Return what `status --json` prints (reused for up to CACHE_S while the root looks unchanged)."""
        now = time.time()
        seen = self._fingerprint()
        cached = self._cached
        if cached is not None and now - cached[0] < CACHE_S and cached[1] == seen:
            return cached[2]
        with self._lock:
            info = status_with(self.layout, self._reader(), now)
        self._cached = (now, seen, info)
        return info

    def forget(self) -> None:
        """Drop the cached overview (after an action of the view's own)."""
        self._cached = None

    def jobs(self, state: str | None = None, agent: str | None = None) -> list[dict[str, Any]]:
        """Return what `list --json` prints, as one list, newest first."""
        with self._lock:
            # the ledger tells done jobs from lost ones, and a gated job in active/ as waiting (its `until`); it is
            # opened for every state, so that a ledger out of reach answers 503 as `list` exits 2, whatever the filter
            reader = self._reader()
            ledger = reader if state in (None, "done", "active", "waiting") else None
            if reader is not None and ledger is None:
                reader.get(".")  # one look up by key (no job has this id): a server gone raises here
            return list_jobs(self.config, self.layout, ledger, state=state, agent=agent)

    def show(self, job_id: str, *, whole_tree: bool = False, refused: bool = False) -> dict[str, Any] | None:
        """Return what `show --json` prints for job_id, or None for an unknown (or malformed) id.

        ``refused``: an id (or file stem) that never became a job answers with its newest refusal,
        as `show --json` does; a refusal's folder name (``stem@time``) answers as a job folder.
        """
        if not JOB_ID.fullmatch(job_id) and not (refused and REFUSAL.fullmatch(job_id)):
            # no job: perhaps the stem of a refused file named like no job id (`my order.json`), as `show` finds it
            rows = refusals_of(self.config, self.layout, job_id) if refused and job_id.isprintable() else []
            return refusal_json(rows[0]) if rows else None
        with self._lock:
            found = show_json(
                self.layout,
                self._reader(),
                job_id,
                self.config.max_order_bytes,
                whole_tree=whole_tree,
                agents=self.config.agents,
            )
        if found is not None:
            return found[0]
        rows = refusals_of(self.config, self.layout, job_id) if refused else []
        return refusal_json(rows[0]) if rows else None


def attempt_files(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Return each attempt of a `show` answer with the ends of its logs and its diff, for the job page."""
    folder = job.get("folder")
    out = []
    for a in job.get("attempts", []):
        a = dict(a)
        logs = a.get("logs") or {}
        a["stdout_tail"] = log_tail(Path(logs["stdout"]), PAGE_TAIL_LINES) if "stdout" in logs else []
        a["stderr_tail"] = log_tail(Path(logs["stderr"]), PAGE_TAIL_LINES) if "stderr" in logs else []
        n = a.get("n")
        a["diff"] = read_diff(Path(folder) / "attempts" / str(n) / "diff.patch") if folder and n else None
        out.append(a)
    return out


def read_diff(path: Path) -> str | None:
    """Return an attempt's diff.patch (at most DIFF_BYTES, no link followed), or None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, DIFF_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = data[:DIFF_BYTES].decode("utf-8", "replace")
    lines = [printable(line) for line in text.splitlines()]
    if len(data) > DIFF_BYTES:
        lines.append(f"... cut at {DIFF_BYTES // 1024} KiB")
    return "\n".join(lines)
