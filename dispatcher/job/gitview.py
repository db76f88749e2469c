"""A sandboxed agent's own view of its repository: private refs, reflogs and new objects (contract section 15).

Under ``sandbox: true`` the agent may commit on its job's branch, and nothing else in
the repository may change. Git moves a ref by renaming a lock file in the ref's folder
and writes objects into the shared object folder, so the repository's ``refs/``,
``logs/`` and ``objects/`` cannot be opened to the agent one file at a time. Each
sandboxed attempt gets a view instead, made next to its worktree
(``.state/worktrees/<job_id>.gitview``) and bound over the repository's folders inside
the sandbox only:

- ``refs/``: a copy of the repository's loose refs (``packed-refs`` stays read-only):
  the agent may move any ref, in its copy;
- ``logs/``: empty: the reflogs it writes stay in the view;
- ``objects/``: empty but for ``info/alternates``, which names the repository's objects,
  bound read-only at ``/tmp/.dispatcher-objects`` in the sandbox's own ``/tmp``: the
  objects the agent makes land in the view.

The worktree's own folder (``.git/worktrees/<name>``: its HEAD, index and reflog) stays
writable, but for what tells the daemon's own git calls which repository and config they
work in: ``commondir`` and ``gitdir`` are bound read-only, and a ``config.worktree`` the
agent writes there (read when the repository has ``extensions.worktreeConfig``: a clean
filter in it would run outside the sandbox at the daemon's next ``git add``) is put back
as it was by ``absorb``, first.

``absorb`` takes the attempt's work back: the new objects are copied into the
repository (each under a temporary name, then renamed; a pack's index last), and only
the job's branch is moved, from the commit it had when the view was made (compare and
swap); then the view is removed. It runs before anything reads the branch (the diff,
the seal, the next attempt's worktree), so a view a crash left is absorbed as well.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dispatcher.job import worktree
from dispatcher.job.worktree import GitError, Workspace

OBJECTS_MOUNT = "/tmp/.dispatcher-objects"  # noqa: S108 - inside the sandbox's own /tmp
_META = "view.json"
_WORKTREE_CONFIG = "config.worktree"
_PACK_ORDER = {".pack": 0, ".rev": 1, ".idx": 2}  # git finds a pack by its index: that comes last


@dataclass(frozen=True)
class GitView:
    """Where one attempt's view lives, and the repository folders it stands in for."""

    path: str  # the view's folder
    common: str  # the repository's git folder
    admin: str  # the worktree's own folder in it (.git/worktrees/<name>)

    def binds(self) -> list[tuple[str, str, bool]]:
        """Return bubblewrap's binds, in order: (source, destination, writable)."""
        return [
            (f"{self.common}/objects", OBJECTS_MOUNT, False),
            (f"{self.path}/objects", f"{self.common}/objects", True),
            (f"{self.path}/refs", f"{self.common}/refs", True),
            (f"{self.path}/logs", f"{self.common}/logs", True),
            (self.admin, self.admin, True),  # HEAD, index and reflog of the worktree itself
            # which repository the worktree belongs to: the daemon's own git calls read these
            (f"{self.admin}/commondir", f"{self.admin}/commondir", False),
            (f"{self.admin}/gitdir", f"{self.admin}/gitdir", False),
        ]


def make(ws: Workspace) -> GitView:
    """Make a fresh view for the next sandboxed attempt (a view a crash left is absorbed first)."""
    absorb(ws)
    common = worktree.common_dir(ws.repo)
    admin = worktree.admin_dir(ws)
    ref = f"refs/heads/{ws.branch}"
    before = worktree.git(ws.repo, "rev-parse", "--verify", "--quiet", ref, check=False).strip()
    final = worktree.view_path(ws)
    tmp = f"{final}.new"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(f"{tmp}/objects/info")
    os.mkdir(f"{tmp}/logs")
    _copy_refs(str(common / "refs"), f"{tmp}/refs")
    with open(f"{tmp}/objects/info/alternates", "w", encoding="utf-8") as fh:
        fh.write("".join(f"{line}\n" for line in [OBJECTS_MOUNT, *_alternates(common / "objects")]))
    config = _read_text(admin / _WORKTREE_CONFIG)
    with open(f"{tmp}/{_META}", "w", encoding="utf-8") as fh:
        json.dump({"ref": ref, "before": before, "admin": str(admin), "worktree_config": config}, fh)
    os.rename(tmp, final)  # a half-made view is never taken for one
    return GitView(final, str(common), str(admin))


def absorb(ws: Workspace) -> None:
    """Copy a view's new objects into the repository and move the job's branch as the agent did; remove the view.

    Raise GitError when the branch moved outside the view meanwhile (the view is kept).
    """
    view = worktree.view_path(ws)
    shutil.rmtree(f"{view}.new", ignore_errors=True)
    try:
        meta = json.loads(Path(view, _META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except ValueError:  # a view never finished: nothing ran in it
        shutil.rmtree(view, ignore_errors=True)
        return
    ref, before = str(meta["ref"]), str(meta["before"])
    _put_back(Path(meta["admin"]) / _WORKTREE_CONFIG, meta["worktree_config"])
    _copy_objects(Path(view, "objects"), worktree.common_dir(ws.repo) / "objects")
    after = _loose_ref(Path(view, "refs"), ref)
    if after and after != before:
        now = worktree.git(ws.repo, "rev-parse", "--verify", "--quiet", ref, check=False).strip()
        if now == before:
            worktree.git(ws.repo, "update-ref", "-m", "dispatcher: the sandboxed agent's commits", ref, after, before)
        elif now != after:  # moved by someone else while the agent ran
            raise GitError(f"{ref} moved outside the sandbox while the agent ran ({before[:12]} -> {now[:12]})")
    shutil.rmtree(view, ignore_errors=True)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return None


def _put_back(path: Path, text: str | None) -> None:
    """Make path hold text again (None: no such file), whatever the agent left there."""
    plain = not path.is_symlink()
    if plain and ((path.is_file() and _read_text(path) == text) or (text is None and not path.exists())):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if text is not None:
        path.write_text(text, encoding="utf-8", errors="surrogateescape")


def _alternates(objects: Path) -> list[str]:
    """Return the repository's own alternates as absolute paths (a relative one is relative to its objects)."""
    try:
        lines = (objects / "info" / "alternates").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [os.path.normpath(os.path.join(objects, line)) for line in lines if line and not line.startswith("#")]


def _copy_refs(src: str, dst: str) -> None:
    """Copy the loose refs; a ref another git call removes meanwhile, or its lock file, is left out."""
    os.mkdir(dst)
    for folder, dirs, files in os.walk(src):
        here = os.path.join(dst, os.path.relpath(folder, src))
        for name in dirs:
            os.makedirs(os.path.join(here, name), exist_ok=True)
        for name in files:
            if name.endswith(".lock"):
                continue
            try:
                shutil.copyfile(os.path.join(folder, name), os.path.join(here, name), follow_symlinks=False)
            except FileNotFoundError:
                continue


def _loose_ref(refs: Path, ref: str) -> str | None:
    """Return the commit a loose ref of the view names, or None (gone, or a symbolic ref)."""
    try:
        text = refs.parent.joinpath(ref).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and not text.startswith("ref:") else None


def _copy_objects(src: Path, dst: Path) -> None:
    """Copy the objects and packs made in the view into the repository, never over one it has."""
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.name == "info" or not entry.is_dir(follow_symlinks=False):
            continue
        names = [e.name for e in os.scandir(entry.path) if e.is_file(follow_symlinks=False)]
        if entry.name == "pack":
            names.sort(key=lambda n: _PACK_ORDER.get(os.path.splitext(n)[1], -1))
        for name in names:
            if name.startswith("tmp"):  # git's own half-written file
                continue
            target = dst / entry.name / name
            if target.exists():
                continue
            target.parent.mkdir(exist_ok=True)
            part = target.with_name(f".{name}.dispatcher-part")
            shutil.copyfile(os.path.join(entry.path, name), part)
            os.chmod(part, 0o444)
            os.replace(part, target)
