"""Files a command makes under a root's ``.state/``, left usable by the daemon and the root's other users.

A root made for a service user (``dispatcher`` under systemd) must stay writable by its
daemon even when root was the first to run a command in it, and a root shared by a group
must stay usable by every member: a lock or a ledger made under umask 027 would otherwise
be its maker's alone, and the next user's command could not open it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from dispatcher.layout import Layout


def hand_over(layout: Layout, files: Iterable[Path], folders: Iterable[Path] = ()) -> None:
    """As root, give files and folders this command made the root's owner; as a member of a root's group, make
    the files it made in a group-writable ``.state/`` writable by the group."""
    if os.geteuid() == 0:
        try:
            owner = os.stat(layout.root)
        except OSError:
            return
        if owner.st_uid == 0:
            return
        for path in (*folders, *files):
            with contextlib.suppress(OSError):
                if os.lstat(path).st_uid == 0:
                    os.lchown(path, owner.st_uid, owner.st_gid)
        return
    try:
        if not os.stat(layout.state_dir).st_mode & stat.S_IWGRP:
            return  # .state/ is not shared for writing: nothing a member made is in it
    except OSError:
        return
    me = os.geteuid()
    for path in files:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_uid == me and stat.S_ISREG(st.st_mode) and st.st_mode & 0o060 != 0o060:
                os.chmod(path, stat.S_IMODE(st.st_mode) | 0o060)
