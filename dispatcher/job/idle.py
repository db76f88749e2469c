"""idle_timeout (contract section 14): when an agent was last heard or seen working.

An agent is active while it prints (stdout or stderr) or changes anything under
its folder. The folder is only scanned after a silent stretch, and in a worker
thread (the loop never walks a tree); the answer is applied on the loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path


class IdleWatch:
    """When an agent was last heard (output) or seen working (a change in its folder).

    The folder is scanned only after a silent stretch, in a worker thread (the
    loop never walks a tree): the newest modification or change time of any
    entry under it, up to ``SCAN_MAX`` entries, counts as activity.
    """

    SCAN_MAX = 100_000

    def __init__(self, folder: str | Path, timeout_s: float, also: str | Path | None = None) -> None:
        """``folder``: where the agent works (its worktree, or work/); ``also``: its job's work/ when that is apart."""
        self.folders: tuple[str | Path, ...] = (folder,)
        if also is not None and os.fspath(also) != os.fspath(folder):
            self.folders = (folder, also)
        self.timeout_s = timeout_s
        self.every_s = max(0.05, min(timeout_s / 4, 10.0))
        self.scanning = False
        self._last = time.monotonic()
        self._newest = time.time()  # wall clock of the newest change seen in the folder

    def heard(self) -> None:
        """Note output on stdout or stderr."""
        self._last = time.monotonic()

    def quiet_s(self) -> float:
        """Return seconds since the agent was last heard or seen changing its folder."""
        return time.monotonic() - self._last

    def scanned(self, fut: asyncio.Future[float]) -> None:
        """Take a scan's answer (on the loop): a change newer than the last one seen counts as activity."""
        self.scanning = False
        if fut.cancelled() or fut.exception() is not None:
            return
        newest = fut.result()
        if newest > self._newest:
            self._newest = newest
            self._last = max(self._last, time.monotonic() - max(0.0, time.time() - newest))


def newest_change(folders: Sequence[str | Path], limit: int) -> float:
    """Return the newest mtime or ctime of any entry under the folders (links not followed), at most limit entries."""
    newest = 0.0
    stack = [str(folder) for folder in folders]
    seen = 0
    while stack and seen < limit:
        path = stack.pop()
        try:
            st = os.lstat(path)
            newest = max(newest, st.st_mtime, st.st_ctime)
            with os.scandir(path) as it:
                for de in it:
                    seen += 1
                    try:
                        est = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, est.st_mtime, est.st_ctime)
                    if de.is_dir(follow_symlinks=False):
                        stack.append(de.path)
        except OSError:
            continue
    return newest
