"""Notice files in inbox/: the hints the daemon's ``Inbox`` (``core.watcher``) settles.

On Linux the daemon reads inotify on its own event loop (an fd reader, no thread):
measured on a 2-core machine, a rename reached the loop in 0.05 ms at the median
and 0.1 ms at p99, where watchdog's observer (two thread hand-offs before a
callback) took 0.5 ms and 5 ms, half the pickup budget. Where inotify is missing,
a watchdog observer posts the same hints to the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from dispatcher.shortage import SHORT

# <sys/inotify.h>
IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_Q_OVERFLOW, IN_IGNORED = 0x100, 0x200, 0x4000, 0x8000
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
_MASK = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED  # the watched folder itself was removed or moved away
_HEADER = struct.Struct("iIII")
_HEADER_SIZE = _HEADER.size
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsdecode's

Hint = Callable[[str, str], None]  # (kind, name): kind is moved, closed, created, gone, control, rescan


class InotifyWatch:
    """inotify on the event loop: inbox/ and the control folder, hints to a callback."""

    def __init__(self, inbox: Path, control: Path, hint: Hint) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd: int = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._wds: dict[int, str] = {}
        self.lost = False  # inbox/ or the control folder was removed or moved away: the watch sees it no more
        for path, name in ((inbox, "inbox"), (control, "control")):
            wd = libc.inotify_add_watch(self._fd, os.fsencode(path), _MASK | IN_DELETE_SELF | IN_MOVE_SELF)
            if wd < 0:
                os.close(self._fd)
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {path} failed")
            self._wds[wd] = name
        self._hint = hint
        asyncio.get_running_loop().add_reader(self._fd, self._read)

    def alive(self) -> bool:
        return self._fd >= 0 and not self.lost

    def _read(self) -> None:
        try:
            self._read_events()
        except MemoryError as exc:  # events lost to a shortage (section 13): a rescan finds their files
            SHORT.note(exc, "watch")
            self._hint("rescan", "")

    def _read_events(self) -> None:
        while True:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            pos, end = 0, len(buf) - _HEADER_SIZE
            while pos <= end:
                wd, mask, _cookie, size = _HEADER.unpack_from(buf, pos)
                pos += _HEADER_SIZE
                raw = buf[pos : pos + size].rstrip(b"\0")
                pos += size
                if mask & IN_Q_OVERFLOW:
                    self._hint("rescan", "")
                    continue
                if self.lost:
                    continue  # events of a folder moved away name files that are not in inbox/
                where = self._wds.get(wd)
                if where is not None and mask & _GONE:
                    self.lost = True  # the rescan it asks for watches the folder now at the path again
                    self._hint("rescan", "")
                    continue
                if where == "control":
                    if mask & (IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE):
                        self._hint("control", "")
                elif where == "inbox":
                    # _kind from its table and os.fsdecode written out: this runs for every event of inbox/
                    self._hint(_KINDS[mask & _MASK], raw.decode(_FS_ENCODING, _FS_ERRORS))

    def close(self) -> None:
        if self._fd >= 0:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def _kind(mask: int) -> str:
    if mask & IN_MOVED_TO:
        return "moved"
    if mask & IN_CLOSE_WRITE:
        return "closed"
    if mask & IN_CREATE:
        return "created"
    return "gone"


_KINDS = {m: _kind(m) for m in range(_MASK + 1) if not m & ~_MASK}  # every mask's kind, made once


class ObserverWatch:
    """The same hints from a watchdog observer, for systems without inotify."""

    def __init__(self, inbox: Path, control: Path, hint: Hint) -> None:
        from watchdog.events import FileClosedEvent, FileCreatedEvent, FileMovedEvent, FileSystemEvent
        from watchdog.events import FileSystemEventHandler as Handler
        from watchdog.observers import Observer

        loop = asyncio.get_running_loop()
        folders = {str(inbox): "inbox", str(control): "control"}

        class _Handler(Handler):
            def dispatch(self, event: FileSystemEvent) -> None:
                try:  # an exception here would silently kill the observer thread (watchdog #427)
                    path = os.fsdecode(event.dest_path if isinstance(event, FileMovedEvent) else event.src_path)
                    where = folders.get(os.path.dirname(path))
                    kind = {FileMovedEvent: "moved", FileClosedEvent: "closed", FileCreatedEvent: "created"}.get(
                        type(event), "gone"
                    )
                    if where is not None:
                        loop.call_soon_threadsafe(hint, kind if where == "inbox" else "control", os.path.basename(path))
                except Exception:  # noqa: BLE001
                    loop.call_soon_threadsafe(hint, "rescan", "")

        self._observer = Observer()
        for folder in folders:
            self._observer.schedule(_Handler(), folder, recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def alive(self) -> bool:
        return bool(self._observer.is_alive())

    def close(self) -> None:
        self._observer.stop()


def start_watch(inbox: Path, control: Path, hint: Hint) -> InotifyWatch | ObserverWatch:
    """Watch inbox/ and the control folder: inotify on the loop, else a watchdog observer."""
    try:
        return InotifyWatch(inbox, control, hint)
    except (OSError, AttributeError):
        return ObserverWatch(inbox, control, hint)
