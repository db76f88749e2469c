"""Watch inbox/ with watchdog and keep track of which files are ready to take.

Filesystem events are hints; the folder is the truth. The watchdog handler only
puts ``(kind, name)`` on the daemon's queue, inside try/except (an exception in
a handler silently kills the observer thread, gorakhargosh/watchdog #427).
``InboxTracker`` decides when a file may be read:

- moved in (a rename) or closed after writing: ready now;
- created, or seen by a scan, with no close seen: ready once its size and
  mtime have not changed for ``settle`` seconds and no process holds it open
  for writing (a writer that pauses longer than ``settle`` is waited for).
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.events import (
    DirCreatedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from dispatcher import procs
from dispatcher.evidence import is_ignored

Post = Callable[[tuple[Any, ...]], None]
# opens and no-write closes are left out: every read of an order (ours included) makes two
_FILTER = [FileMovedEvent, FileCreatedEvent, DirCreatedEvent, FileClosedEvent, FileDeletedEvent]


class _Handler(FileSystemEventHandler):
    def __init__(self, inbox: str, control: str, post: Post) -> None:
        self.inbox = inbox
        self.control = control
        self.post = post

    def dispatch(self, event: FileSystemEvent) -> None:
        try:
            self._classify(event)
        except Exception:  # noqa: BLE001 - an exception here would kill the observer thread
            self.post(("fs", "rescan", ""))

    def _classify(self, event: FileSystemEvent) -> None:
        src = os.fsdecode(event.src_path)
        if isinstance(event, FileMovedEvent):
            dest = os.fsdecode(event.dest_path)
            if src and os.path.dirname(src) == self.inbox:
                self.post(("fs", "gone", os.path.basename(src)))
            if dest and os.path.dirname(dest) == self.inbox:
                self.post(("fs", "moved", os.path.basename(dest)))
            elif dest and os.path.dirname(dest) == self.control:
                self.post(("control",))
            return
        folder = os.path.dirname(src)
        if folder == self.control:
            if isinstance(event, (FileCreatedEvent, FileClosedEvent)):
                self.post(("control",))
            return
        if folder != self.inbox:
            return
        kind = {
            FileCreatedEvent: "created",
            DirCreatedEvent: "created",
            FileClosedEvent: "closed",
            FileDeletedEvent: "gone",
        }.get(type(event))
        if kind is not None:
            self.post(("fs", kind, os.path.basename(src)))


def start_observer(inbox: Path, control: Path, post: Post) -> BaseObserver:
    """Start a watchdog observer on inbox/ and the control folder."""
    try:
        from watchdog.observers.inotify import InotifyObserver

        observer: BaseObserver = InotifyObserver(generate_full_events=True)
    except (ImportError, OSError):
        observer = Observer()
    handler = _Handler(str(inbox), str(control), post)
    observer.schedule(handler, str(inbox), recursive=False, event_filter=_FILTER)
    observer.schedule(handler, str(control), recursive=False, event_filter=_FILTER)
    observer.daemon = True
    observer.start()
    return observer


@dataclass
class _Pending:
    size: int
    mtime_ns: int
    changed_at: float


class InboxTracker:
    """Which inbox names are waiting to settle, ready to read, or already taken up."""

    def __init__(self, inbox: Path, settle_s: float, *, wait_for_writers: bool = True) -> None:
        self.inbox = inbox
        self.settle_s = settle_s
        self.wait_for_writers = wait_for_writers  # off for `run --once`: at most settle s after the last change
        self._pending: dict[str, _Pending] = {}
        self._ready: list[tuple[int, str]] = []
        self._ready_names: set[str] = set()
        self._known: set[str] = set()  # pending, ready, or being handled by the daemon

    def __len__(self) -> int:
        return len(self._known)

    def event(self, kind: str, name: str) -> None:
        """Take one filesystem event into account."""
        if not name or is_ignored(name):
            return
        if kind in ("moved", "closed"):
            self._pending.pop(name, None)
            self._make_ready(name)
        elif kind == "created":
            if name not in self._known:
                self._watch(name, fresh=True)
        elif kind == "gone" and name in self._pending:
            del self._pending[name]
            self._known.discard(name)

    def _make_ready(self, name: str) -> None:
        if name in self._ready_names:
            return
        try:
            st = os.lstat(self.inbox / name)
        except FileNotFoundError:
            self._known.discard(name)
            return
        self._known.add(name)
        self._ready_names.add(name)
        heapq.heappush(self._ready, (st.st_mtime_ns, name))

    def _watch(self, name: str, *, fresh: bool = False) -> None:
        try:
            st = os.lstat(self.inbox / name)
        except FileNotFoundError:
            return
        if not os.path.isfile(self.inbox / name) or os.path.islink(self.inbox / name):
            self._make_ready(name)  # links, FIFOs, folders: refused at once, never opened
            return
        self._known.add(name)
        now = time.monotonic()
        age = time.time() - st.st_mtime_ns / 1e9
        if not fresh and age >= self.settle_s:
            self._make_ready(name)
            return
        # a created file is held until its writer closes it (or it settles, if no open was seen)
        self._pending[name] = _Pending(st.st_size, st.st_mtime_ns, now)

    def scan(self) -> None:
        """Look at every name in inbox/; track the ones not known yet (no close seen)."""
        try:
            names = os.listdir(self.inbox)
        except FileNotFoundError:
            return
        for name in names:
            if not is_ignored(name) and name not in self._known:
                self._watch(name)

    def due(self) -> float | None:
        """Move settled files to ready; return seconds until the next settle check, or None."""
        if not self._pending:
            return None
        now = time.monotonic()
        wait: float | None = None
        for name, p in list(self._pending.items()):
            try:
                st = os.lstat(self.inbox / name)
            except FileNotFoundError:
                del self._pending[name]
                self._known.discard(name)
                continue
            if (st.st_size, st.st_mtime_ns) != (p.size, p.mtime_ns):
                p.size, p.mtime_ns, p.changed_at = st.st_size, st.st_mtime_ns, now
            left = p.changed_at + self.settle_s - now
            if left <= 0 and self.wait_for_writers and procs.open_for_writing(os.path.abspath(self.inbox / name)):
                p.changed_at, left = now, self.settle_s  # a writer still holds it: wait for its close
            if left <= 0:
                del self._pending[name]
                self._make_ready(name)
                continue
            left = max(left, 0.05) if left > 0 else self.settle_s
            wait = left if wait is None else min(wait, left)
        return wait

    def has_ready(self) -> bool:
        """Return True if a file is ready to be read."""
        return bool(self._ready)

    def has_pending(self) -> bool:
        """Return True while some file waits to settle (it may still become an order)."""
        return bool(self._pending)

    def pop(self) -> str | None:
        """Return the oldest ready name (by mtime, then name), or None."""
        if self._ready:
            name = heapq.heappop(self._ready)[1]
            self._ready_names.discard(name)
            return name
        return None

    def forget(self, name: str) -> None:
        """Forget a name the daemon has finished with (claimed, refused or gone)."""
        self._known.discard(name)
        self._pending.pop(name, None)
