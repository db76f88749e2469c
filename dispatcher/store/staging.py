"""Staging folders, where a claim or a refusal is built before its rename, and the inbox twin it leaves.

A claimed order is hard-linked into its staging folder; once the folder is renamed into
place, the inbox name (the same inode) goes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
from pathlib import Path

from dispatcher.layout import Layout


def drop_inbox_twin(layout: Layout, name: str, kept: str | Path) -> bool:
    """Remove inbox/<name> if it is the same inode as kept (the claimed file's second name).

    Return True if it was. Another daemon may have removed it first (it saw the
    placed job's folder): that is fine.
    """
    if not name:
        return False
    try:
        st = os.lstat(kept)
    except OSError:
        return False
    return drop_inbox_inode(f"{layout.inbox_str}/{name}", (st.st_dev, st.st_ino))


def drop_inbox_inode(inboxed: str, inode: tuple[int, int]) -> bool:
    """Remove the inbox file at ``inboxed`` if it is the inode ``(st_dev, st_ino)``; return True if it was.

    ``drop_inbox_twin`` for a caller that knows the inode: a claim, which linked the inbox
    file it read into the job's folder and checked it there.
    """
    try:
        st = os.lstat(inboxed)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != inode:
        return False
    try:
        os.unlink(inboxed)
    except FileNotFoundError:
        return True  # another daemon removed it first (it saw the placed folder): as good
    return True


_serial = itertools.count(1)  # the owner names the process (host, pid, a random part): a count makes the rest unique


def new_stage(layout: Layout, owner: str, kind: str, job_id: str) -> str:
    """Make an empty staging folder named for its owner (so recovery knows whose it is); return its path."""
    stage = f"{layout.staging_str}/{owner}.{kind}-{job_id}-{next(_serial):x}"
    try:
        os.mkdir(stage)
    except FileNotFoundError:  # .state/staging/ removed by hand while the daemon runs: made again
        os.makedirs(layout.staging_str, exist_ok=True)
        os.mkdir(stage)
    except FileExistsError:  # an owner shared with another process: a random part instead
        stage = f"{layout.staging_str}/{owner}.{kind}-{job_id}-{secrets.token_hex(4)}"
        os.mkdir(stage)
    return stage


def claim_stages(layout: Layout, job_id: str) -> list[str]:
    """Return the names of the claim staging folders of job_id (any daemon's) in ``.state/staging/``."""
    try:
        names = os.listdir(layout.staging)
    except FileNotFoundError:
        return []
    mark = f".claim-{job_id}"
    return [n for n in names if mark in n and n.rsplit("-", 1)[0].endswith(mark)]


def remove_stage(stage: str | Path) -> None:
    """Remove a staging folder holding only the daemon's own files (and links to user files).

    A part already gone is passed over: a second daemon finishing a dead daemon's folder may remove it at once.
    """
    for root, dirs, files in os.walk(stage, topdown=False):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            path = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.islink(path):
                    os.unlink(path)
                else:
                    os.rmdir(path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(stage)
