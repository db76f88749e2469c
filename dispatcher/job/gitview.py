"""A sandboxed agent's own view of its repository: private refs, reflogs and new objects (contract section 15).

Under ``sandbox: true`` the agent may commit on its job's branch, and nothing else in
the repository may change. Git moves a ref by renaming a lock file in the ref's folder
and writes objects into the shared object folder, so the repository's ``refs/``,
``logs/`` and ``objects/`` cannot be opened to the agent one file at a time. Each
sandboxed attempt gets a view instead, made next to its worktree
(``.state/worktrees/.<job_id>.gitview``) and bound over the repository's folders inside
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

import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dispatcher.job import worktree
from dispatcher.job.worktree import GitError, Workspace

OBJECTS_MOUNT = "/tmp/.dispatcher-objects"  # noqa: S108 - inside the sandbox's own /tmp
_META = "view.json"
_WORKTREE_CONFIG = "config.worktree"


@dataclass(frozen=True)
class GitView:
    """Where one attempt's view lives, and the repository folders it stands in for."""

    path: str  # the view's folder
    common: str  # the repository's git folder
    admin: str  # the worktree's own folder in it (.git/worktrees/<name>)

    def binds(self) -> list[tuple[str, str, bool]]:
        """Return bubblewrap's binds, in order: (source, destination, writable)."""
        out = [(f"{self.common}/objects", OBJECTS_MOUNT, False)]
        for name in ("objects", "refs", "logs"):
            out.append((f"{self.path}/{name}", f"{self.common}/{name}", True))
        out.append((self.admin, self.admin, True))  # HEAD, index and reflog of the worktree itself
        # what the daemon's own git calls in the worktree obey: which repository, which config
        for name in ("commondir", "gitdir", _WORKTREE_CONFIG):
            out.append((f"{self.admin}/{name}", f"{self.admin}/{name}", False))
        return out


def make(ws: Workspace) -> GitView:
    """Make a fresh view for the next sandboxed attempt (after ``absorb``, which takes a view a crash left)."""
    common = worktree.common_dir(ws.repo)
    admin = worktree.admin_dir(ws)
    ref = f"refs/heads/{ws.branch}"
    before = worktree.git(ws.repo, "rev-parse", "--verify", "--quiet", ref, check=False).strip()
    os.makedirs(common / "logs", exist_ok=True)  # a bare repository has none: its worktree's commits log there
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
    if config is None:  # an empty one, bound read-only, so that the agent cannot make one (absorb removes it)
        (admin / _WORKTREE_CONFIG).write_text("", encoding="utf-8")
    os.rename(tmp, final)  # a half-made view is never taken for one
    return GitView(final, str(common), str(admin))


def absorb(ws: Workspace) -> None:
    """Take a view's work back: the objects of the job's new branch tip, then the branch itself; remove the view.

    First the worktree's own folder is made safe for the daemon's git calls again: its
    HEAD names the job's branch, its reflogs go (a reflog that is a link would make git
    append outside the sandbox), its ``config.worktree`` is as it was. The objects come
    in through git (``pack-objects`` from the view, ``index-pack --strict`` into the
    repository), which names each object by its content: no file of the view is copied.
    Raise GitError when the branch moved outside the view meanwhile (the view is kept).
    """
    view = worktree.view_path(ws)
    for leftover in (f"{view}.new", f"{view}.old"):
        shutil.rmtree(leftover, ignore_errors=True)
    legacy = worktree.legacy_view_path(ws)  # made by an earlier version under a name a job id can have
    if not os.path.isdir(view) and os.path.isfile(os.path.join(legacy, _META)):
        view = legacy
    if not os.path.isdir(view):
        return
    try:
        meta = json.loads(Path(view, _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # half removed by a crash: it was taken already
        _retire(view)
        return
    ref, before = str(meta["ref"]), str(meta["before"])
    _make_safe(Path(meta["admin"]), ref, meta["worktree_config"])
    after = _loose_ref(Path(view, "refs"), ref)
    if after and after != before:
        now = worktree.git(ws.repo, "rev-parse", "--verify", "--quiet", ref, check=False).strip()
        if now == before:
            _import(ws, view, after, before)
            worktree.git(ws.repo, "update-ref", "-m", "dispatcher: the sandboxed agent's commits", ref, after, before)
        elif now != after:  # moved by someone else while the agent ran
            raise GitError(f"{ref} moved outside the sandbox while the agent ran ({before[:12]} -> {now[:12]})")
    _retire(view)


def _retire(view: str) -> None:
    """Remove a view: renamed aside first, so that a crash half-way never leaves one that looks whole."""
    with contextlib.suppress(FileNotFoundError):
        os.rename(view, f"{view}.old")
    shutil.rmtree(f"{view}.old", ignore_errors=True)


def _make_safe(admin: Path, ref: str, config: str | None) -> None:
    """Put the worktree's own folder back as the daemon's git calls need it, whatever the agent left there."""
    _put_back(admin / "HEAD", f"ref: {ref}\n")
    logs = admin / "logs"
    if logs.is_symlink() or logs.exists():
        if logs.is_dir() and not logs.is_symlink():
            shutil.rmtree(logs)
        else:
            logs.unlink()
    _put_back(admin / _WORKTREE_CONFIG, config)


def _import(ws: Workspace, view: str, after: str, before: str) -> None:
    """Bring the objects of ``after`` the repository lacks in from the view, checked by git (io pool)."""
    objects = str(worktree.common_dir(ws.repo) / "objects")
    Path(view, "objects", "info", "alternates").write_text("", encoding="utf-8")  # only what the env names
    env = worktree.git_env({"GIT_OBJECT_DIRECTORY": f"{view}/objects", "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects})
    packed = _piped(["pack-objects", "--revs", "--stdout", "-q"], f"{after}\n^{before}\n".encode(), ws.repo, env)
    if isinstance(packed, str):
        raise GitError(f"the sandboxed agent's commits cannot be read: {packed}")
    taken = _piped(["index-pack", "--stdin", "--strict", "--fix-thin"], packed, ws.repo, worktree.git_env())
    if isinstance(taken, str):
        raise GitError(f"the sandboxed agent's commits were refused: {taken}")


def _piped(args: list[str], data: bytes, cwd: str, env: dict[str, str]) -> bytes | str:
    """Run git with data on its stdin; return its stdout, or what it said on stderr when it failed."""
    proc = subprocess.run(
        ["git", *worktree.SAFE, *args],
        input=data,
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=worktree.GIT_TIMEOUT_S,
        check=False,
    )
    return proc.stdout if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()


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
