"""The link, hard-link and special-file rules of ``writes_scope``, applied to a job's worktree.

In ``work/`` the rules are checked on the walk that gathers the evidence. With a
git workspace the agent works in its worktree instead, where git itself would take
a link out of the tree onto the branch (and ``land`` would push it), and never
lists a FIFO at all. So the worktree is walked too (its ``.git`` file aside):

- a changed path that is a link pointing outside the worktree;
- a changed regular file with more than one hard link;
- a FIFO, socket or device anywhere (git tracks none, so each is the agent's).

Links and files the job did not change (the repository's own) are left alone.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from dispatcher import fsutil
from dispatcher.fsutil import kind_of, link_stays_inside


def hazard(tree: str, changed: Iterable[str]) -> str | None:
    """Return the first rule the worktree at ``tree`` breaks, in writes_scope's words; None if none."""
    root = os.path.normpath(tree)
    for rel in changed:
        path = os.path.join(root, rel)
        try:
            st = os.lstat(path)
        except OSError:  # deleted by the change
            continue
        if stat.S_ISLNK(st.st_mode):
            if not link_stays_inside(path, root):
                return f"{rel} is a link that points outside the workspace"
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return f"{rel} has {st.st_nlink} hard links"
    return _special(root)


def _special(root: str) -> str | None:
    """Return the first FIFO, socket or device under root (its top-level ``.git`` aside), described.

    An entry the walk cannot look at (below a path longer than the system can name, which
    git does not see either) is refused as well: what it holds cannot be judged.
    """
    unseen: list[str] = []
    for rel, st in fsutil.walk(root, skip=".git", unseen=unseen):
        mode = st.st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            return f"{rel} is a {kind_of(mode)}"
    return f"{unseen[0]} cannot be listed" if unseen else None
