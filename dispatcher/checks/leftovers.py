"""Files the agent's own checks leave in work/: not the job's work.

A user check (section 14) runs in work/ after the agent: pytest leaves ``.pytest_cache/``,
a formatter its cache. On the job's next attempt (a retry, a repair, a revision) those
files are still there, and ``writes_scope`` would charge them to the agent. So the
daemon stamps work/'s files before the checks run and again after, and keeps the files
the checks created or changed, each with its stamp, in ``job.json`` (``checks_left``).
``writes_scope`` skips such a file while its stamp is unchanged; once the agent writes
it, it is judged as any file the agent wrote.

A stamp is the file's size, modification and change times (ns) and inode: what
changes whenever anyone writes the file, read without opening it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from dispatcher import fsutil


def stamp_of(st: os.stat_result) -> str:
    """Return a regular file's stamp: size, mtime and ctime (ns), inode."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def stamps(work: str) -> dict[str, str]:
    """Return every regular file below work/ (POSIX relative path) with its stamp; links are not followed."""
    return {rel: stamp_of(st) for rel, st in fsutil.walk(work) if stat.S_ISREG(st.st_mode)}


def left_by_checks(before: Mapping[str, str], after: Mapping[str, str], earlier: Mapping[str, str]) -> dict[str, str]:
    """Return the files the checks left: those new or changed between ``before`` and ``after``.

    ``earlier``: what the checks of earlier attempts left; each entry still present is kept
    with its recorded stamp (a file the agent rewrote since then stays the agent's).
    """
    left = {path: mark for path, mark in earlier.items() if path in after}
    for path, mark in after.items():
        if before.get(path) != mark:
            left[path] = mark
    return left
