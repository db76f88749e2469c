"""A job's git worktree (contract section 15), the blocking side: run in the io pool.

Each job with ``workspace.git`` works in ``.state/worktrees/<job_id>``, a worktree of
the repository on its own branch made from the base commit, resolved once and kept
in the job folder's ``workspace.json`` (so a recovered job starts from the same
commit even when ``main`` has moved). The caller serialises the calls that change
the repository's worktree list per repository (``job.workspace``); git's own lock
files cover other processes, and a call that finds one busy is tried again.

The daemon's git calls never run anything the repository configures (hooks, an
fsmonitor, diff or text-conversion drivers): an agent may have written its config.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher import faults, fsutil
from dispatcher.text import is_count

RECORD = "workspace.json"
DIFF_MAX_BYTES = 16 * 1024 * 1024
GIT_TIMEOUT_S = 300.0
SAFE = (  # every git call of the daemon: never the repository's hooks or fsmonitor
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.quotePath=false",
)
VIEW_SUFFIX = ".gitview"  # a sandboxed attempt's view of the repository (gitview), beside its worktree
_IDENTITY = {
    "GIT_AUTHOR_NAME": "dispatcher",
    "GIT_AUTHOR_EMAIL": "dispatcher@localhost",
    "GIT_COMMITTER_NAME": "dispatcher",
    "GIT_COMMITTER_EMAIL": "dispatcher@localhost",
}
ADDING = "initializing"  # the lock reason git writes while `git worktree add` makes a worktree
_BUSY = ("index.lock", ".lock': File exists", "cannot lock ref", "Unable to create", "is locked")


class GitError(Exception):
    """A git call failed; the message is git's last line of error output."""


@dataclass(frozen=True, slots=True)
class Workspace:
    """One job's worktree: the repository, its branch, the base commit it started from, its folder."""

    repo: str
    branch: str
    base: str  # the commit the branch started from
    base_ref: str  # what the config or the order named (a ref, or "parent")
    path: str

    def to_json(self) -> dict[str, Any]:
        """Return the record as plain JSON values (``workspace.json``)."""
        return {
            "repo": self.repo,
            "branch": self.branch,
            "base": self.base,
            "base_ref": self.base_ref,
            "path": self.path,
        }

    @classmethod
    def from_json(cls, data: Any) -> Workspace:
        """Rebuild a record (KeyError/TypeError if damaged)."""
        return cls(str(data["repo"]), str(data["branch"]), str(data["base"]), str(data["base_ref"]), str(data["path"]))


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment of the daemon's git calls: the daemon's, without GIT_* overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.update(_IDENTITY)
    env.update(extra or {})
    return env


class Checkouts:
    """The `git worktree add` runs of this process, so that a stop ends them as it ends agents (contract 9).

    A checkout of a large repository may take long: a stop's deadline (and a second stop) ends
    its process group, and the job, which started no agent, waits for the next start, whose
    add clears the half-made worktree (``clear``) and makes it again.
    """

    def __init__(self) -> None:
        self._groups: set[int] = set()
        self._lock = threading.Lock()
        self.ended = False

    def run(self, argv: list[str], cwd: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
        """Run argv in a session of its own, known to ``end_all`` while it runs."""
        with subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        ) as proc:  # fmt: skip
            with self._lock:
                self._groups.add(proc.pid)
                if self.ended:
                    _kill_group(proc.pid)
            try:
                out, err = proc.communicate(timeout=GIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                out, err = proc.communicate()
            finally:
                with self._lock:
                    self._groups.discard(proc.pid)
            return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def end_all(self) -> None:
        """End every checkout under way, and each that starts from now on (a stop's deadline, a second stop)."""
        with self._lock:
            self.ended = True
            for pgid in self._groups:
                _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


CHECKOUTS = Checkouts()


def git(
    cwd: str | Path, *args: str, env: dict[str, str] | None = None, check: bool = True, stoppable: bool = False
) -> str:
    """Run git in cwd and return its stdout; raise GitError with git's message (busy locks are tried again).

    ``stoppable``: a run a stop ends at its deadline (``CHECKOUTS``: the checkout of a new worktree).
    """
    delay = 0.05
    for tries in range(12):
        argv = ["git", *SAFE, *args]
        if stoppable:
            proc = CHECKOUTS.run(argv, cwd, env or git_env())
        else:
            proc = subprocess.run(
                argv,
                cwd=cwd,
                env=env or git_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=GIT_TIMEOUT_S,
                check=False,
            )
        if proc.returncode == 0 or not check:
            return proc.stdout.decode(errors="replace")
        err = proc.stderr.decode(errors="replace").strip()
        if tries < 11 and any(b in err for b in _BUSY):
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        last = err.splitlines()[-1] if err else f"exit {proc.returncode}"
        raise GitError(f"git {args[0]}: {last}")
    raise AssertionError("unreachable")


def _check_top(repo: str) -> None:
    """Refuse a folder that is not a repository's own (a subfolder of one, or no repository at all)."""
    bare = git(repo, "rev-parse", "--is-bare-repository", check=False).strip()
    if bare == "true":
        return
    top = git(repo, "rev-parse", "--show-toplevel", check=False).strip()
    if not top:
        raise GitError(f"{repo} is not a git repository")
    if os.path.realpath(top) != os.path.realpath(repo):
        raise GitError(f"{repo} is a folder inside the repository {top}: name the repository itself")


def read_record(job_folder: Path) -> Workspace | None:
    """Return the job's workspace record, or None when it has none yet."""
    try:
        return Workspace.from_json(json.loads((job_folder / RECORD).read_bytes()))
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def base_at_claim(repo: str, base_ref: str) -> str | None:
    """Return the commit base_ref names in repo now (section 15: a job's branch starts from base at claim time).

    None when it cannot be told (no repository, no such ref, git failing): the first attempt
    then resolves it and fails the job with the reason, as without this.
    """
    try:
        if not os.path.isdir(repo):
            return None
        found = git(repo, "rev-parse", "--verify", "--quiet", f"{base_ref}^{{commit}}", check=False).strip()
    except (GitError, OSError):
        return None
    return found or None


def plan(job_folder: Path, repo: str, base_ref: str, branch: str, path: Path, commit: str | None = None) -> Workspace:
    """Resolve the base to a commit and write ``workspace.json`` durably (once: a recovered job keeps it).

    ``commit``: the base as the claim resolved it, used instead of what base_ref names now.
    """
    found = read_record(job_folder)
    if found is not None:
        return found
    if not os.path.isdir(repo):
        raise GitError(f"repository {repo} does not exist")
    _check_top(repo)
    wanted = commit or base_ref
    base = git(repo, "rev-parse", "--verify", "--quiet", f"{wanted}^{{commit}}", check=False).strip()
    if not base:
        raise GitError(f"base {base_ref} is not a commit of {repo}")
    # a job works on a new branch: one that is there before its record was ever written is someone's
    if git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).strip():
        raise GitError(f"branch {branch} already exists in {repo}: a job works on a new branch (delete or rename it)")
    ws = Workspace(repo, branch, base, base_ref, str(path))
    fsutil.write_atomic(job_folder / RECORD, fsutil.dump_json(ws.to_json()))
    return ws


def worktrees(repo: str) -> dict[str, dict[str, str]]:
    """Return the repository's worktrees by path, each with its porcelain attributes (locked, prunable...)."""
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in git(repo, "worktree", "list", "--porcelain").splitlines():
        key, _, value = line.partition(" ")
        if key == "worktree":
            current = out.setdefault(value, {})
        elif current is not None and key:
            current[key] = value
    return out


def _entries(ws: Workspace) -> list[tuple[Path, str | None]]:
    """Return the repository's worktree entries that may be this worktree's, with their ``gitdir`` (None: unwritten).

    Git names an entry after the worktree's folder made a ref name's part (``_git_entry_name``),
    with a digit added when the name is taken.
    """
    names = {os.path.basename(ws.path), _git_entry_name(os.path.basename(ws.path))}
    out: list[tuple[Path, str | None]] = []
    try:
        admins = list((common_dir(ws.repo) / "worktrees").iterdir())
    except FileNotFoundError:
        return out
    for admin in admins:
        if not any(admin.name == n or (admin.name.startswith(n) and is_count(admin.name[len(n) :])) for n in names):
            continue
        try:
            out.append((admin, (admin / "gitdir").read_text().strip()))
        except FileNotFoundError:
            out.append((admin, None))
        except OSError:
            continue
    return out


def _git_entry_name(folder: str) -> str:
    """Return the name git gives the entry of a worktree folder named like a job id (``A..B`` -> ``A.B``).

    As git's ``sanitize_refname_component`` does for the characters of a job id: a run of dots
    is one dot, and a ``.lock`` ending goes, again and again (``X.lock`` -> ``X``).
    """
    name = re.sub(r"\.\.+", ".", folder)
    while name.endswith(".lock"):
        name = name[: -len(".lock")]
    return name or "worktree"


def _registered(ws: Workspace) -> bool:
    """Return True when the repository holds the worktree's entry, not locked by an unfinished add.

    Only git's own lock of an add (reason ``initializing``) says the add is unfinished: a worktree
    locked on purpose (`git worktree lock`, by a person or the agent) is complete.
    """
    mine = os.path.join(ws.path, ".git")
    entry = next((admin for admin, gitdir in _entries(ws) if gitdir == mine), None)
    return entry is not None and _lock_reason(entry) != ADDING


def _lock_reason(admin: Path) -> str | None:
    """Return the reason of a worktree entry's lock (stripped, maybe empty), or None when it is not locked."""
    try:
        return (admin / "locked").read_text(errors="replace").strip()
    except OSError:
        return None


def is_ready(ws: Workspace) -> bool:
    """Return True when the worktree exists complete (registered, not locked by an unfinished add)."""
    return _registered(ws) and os.path.exists(os.path.join(ws.path, ".git"))


def _sealable(ws: Workspace) -> bool:
    """Return True when the worktree's folder is there and registered: its ``.git`` file is not needed.

    The daemon's git calls name the worktree's own folder in the repository (``admin_dir``), so
    an agent that deleted or rewrote its ``.git`` file still has what it left committed.
    """
    return _registered(ws) and os.path.isdir(ws.path)


def has_branch(ws: Workspace) -> bool:
    """Return True if the job's branch exists in the repository."""
    ref = f"refs/heads/{ws.branch}"
    return bool(git(ws.repo, "rev-parse", "--verify", "--quiet", ref, check=False).strip())


def clear(ws: Workspace) -> str | None:
    """Remove whatever is left at the worktree's path (a worktree, a half-made one, a folder); None when done.

    An add that died half-way leaves its entry locked (git locks it first), maybe without
    its ``gitdir`` file or with it still empty, which makes ``git worktree list`` fail for the whole repository:
    such an entry of this worktree's is unlocked and removed. Entries of other worktrees,
    locked or not, are never touched. The worktree locked on purpose (`git worktree lock`) is
    left as it is, and its line for ``workspace.locked`` is returned instead: its path and lock reason.
    """
    mine = os.path.join(ws.path, ".git")
    entries = _entries(ws)
    for admin, gitdir in entries:
        reason = _lock_reason(admin) if gitdir == mine else None
        if reason is not None and reason != ADDING:
            return f"{ws.path} ({reason or 'no reason'})"
    registered = False
    for admin, gitdir in entries:
        if _half_written(gitdir, mine) and (admin / "locked").exists():
            shutil.rmtree(admin, ignore_errors=True)
        elif gitdir == mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(admin / "locked")
            registered = True
    if registered and os.path.isdir(ws.path):
        git(ws.repo, "worktree", "remove", "--force", "--force", ws.path, check=False)
    shutil.rmtree(ws.path, ignore_errors=True)
    if registered and any(gitdir == mine for _admin, gitdir in _entries(ws)):
        git(ws.repo, "worktree", "prune")
    return None


def _half_written(gitdir: str | None, mine: str) -> bool:
    """Return True when an entry's ``gitdir`` was never (or only partly) written: git died between lock and write."""
    return gitdir is None or (gitdir != mine and mine.startswith(gitdir))


ADD_AGAIN_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # waits before an add is tried again over a folder another git fills


def create(ws: Workspace, *, from_branch: bool) -> None:
    """Make the worktree on its branch: from the base commit, or (``from_branch``) from the branch's tip.

    A dead daemon's `git worktree add` may still be writing the same folder (git outlives a kill -9 of the
    daemon): the folder then reappears after ``clear`` and git says it already exists. The add is tried again,
    cleared each time, for up to about eight seconds, before that is an error.
    """
    for wait in ADD_AGAIN_S:
        try:
            _add(ws, from_branch=from_branch)
            return
        except GitError as exc:
            if f"'{ws.path}' already exists" not in str(exc):
                raise
            time.sleep(wait)
    _add(ws, from_branch=from_branch)


def _add(ws: Workspace, *, from_branch: bool) -> None:
    kept = clear(ws)
    if kept is not None:
        raise GitError(f"worktree {kept} is locked: unlock it with git worktree unlock {ws.path}")
    os.makedirs(os.path.dirname(ws.path), exist_ok=True)
    tip = ""
    if from_branch:
        tip = git(ws.repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{ws.branch}", check=False).strip()
    args = ["worktree", "add", ws.path, ws.branch] if tip else ["worktree", "add", "-B", ws.branch, ws.path, ws.base]
    if faults.armed("workspace.add"):  # a crash test: git and the daemon die while the new worktree is locked
        proc = subprocess.Popen(["git", *SAFE, *args], cwd=ws.repo, env=git_env())
        lock = common_dir(ws.repo) / "worktrees" / os.path.basename(ws.path) / "locked"
        deadline = time.monotonic() + 10
        while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        faults.point("workspace.add")
    git(ws.repo, *args, stoppable=True)


def common_dir(repo: str) -> Path:
    """Return the repository's git folder (``.git``, or the repository itself when bare)."""
    dot = Path(repo) / ".git"
    return dot if dot.is_dir() else Path(repo)


def admin_dir(ws: Workspace) -> Path:
    """Return the worktree's own folder in the repository (``.git/worktrees/<name>``), found from the repository.

    Never read from the worktree's ``.git`` file: the agent may have rewritten it.
    """
    mine = os.path.join(ws.path, ".git")
    with contextlib.suppress(FileNotFoundError):
        for admin in (common_dir(ws.repo) / "worktrees").iterdir():
            with contextlib.suppress(OSError):
                if (admin / "gitdir").read_text().strip() == mine:
                    return admin
    raise GitError(f"worktree {ws.path} is not registered in {ws.repo}")


def view_path(ws: Workspace) -> str:
    """Return where a sandboxed attempt's view of the repository lives (``gitview``): beside the worktree.

    Its name starts with a dot, which no job id does: job ``X``'s view is ``.X.gitview``,
    never the worktree of a job named ``X.gitview``.
    """
    head, _, name = ws.path.rpartition("/")
    return f"{head}/.{name}{VIEW_SUFFIX}"


def legacy_view_path(ws: Workspace) -> str:
    """Return where a view made before views were hidden names lived (``X.gitview``): taken back once."""
    return ws.path + VIEW_SUFFIX


def _job_of(name: str) -> str:
    """Return the job id a name in the worktrees' folder belongs to: a worktree's own, or a view's (made, kept)."""
    if not name.startswith("."):
        return name
    base = name[1:]
    for tail in (".new", ".old"):
        if base.endswith(VIEW_SUFFIX + tail):
            base = base[: -len(tail)]
    return base[: -len(VIEW_SUFFIX)] if base.endswith(VIEW_SUFFIX) else base


def _tree_env(ws: Workspace, extra: dict[str, str] | None = None) -> dict[str, str]:
    return git_env({"GIT_DIR": str(admin_dir(ws)), "GIT_WORK_TREE": ws.path, **(extra or {})})


def reset_to_base(ws: Workspace) -> None:
    """Put the branch and the worktree back at the base commit (a retry starts again from base)."""
    env = _tree_env(ws)
    branch = f"refs/heads/{ws.branch}"
    if git(ws.path, "symbolic-ref", "-q", "HEAD", env=env, check=False).strip() != branch:
        # the agent moved its HEAD (onto main, a branch of someone's, or detached): the reset below moves the
        # branch HEAD names, so HEAD goes back to the job's own branch first; no other branch is ever moved
        git(ws.path, "symbolic-ref", "HEAD", branch, env=env)
    git(ws.path, "reset", "-q", "--hard", ws.base, env=env)
    git(ws.path, "clean", "-q", "-ffdx", env=env)


def snapshot(
    ws: Workspace, out_dir: Path, max_bytes: int = DIFF_MAX_BYTES, left: Mapping[str, str] | None = None
) -> tuple[list[str], str]:
    """Write ``diff.patch`` (binary-safe) and ``changed.txt`` of the worktree against base; return the paths and tree.

    Committed and uncommitted changes both count: the worktree is added to a copy of
    its index (a temporary one: the agent's own index is untouched) and that tree is
    compared with the base commit. A patch above max_bytes is cut with a note saying so.
    The tree (its id) is what ``seal`` puts on the branch: what the checks saw. ``left``:
    what earlier attempts' user checks left (``left_by_checks``); a path still as they
    left it is taken as it was before them, so it is neither a change nor on the branch.
    """
    tree = worktree_tree(ws, left)
    names = [n for n in git(ws.repo, "diff", "--name-only", "-z", "--no-renames", ws.base, tree).split("\0") if n]
    _write_patch(ws, tree, out_dir / "diff.patch", max_bytes)
    text = "".join(f"{changed_line(n)}\n" for n in names)
    fsutil.write_atomic(out_dir / "changed.txt", text.encode(), sync=False, sync_dir=False)
    return names, tree


def changed_line(path: str) -> str:
    """Return a changed path as its line in ``changed.txt``: as it is, or quoted when it would not read back.

    A path holding a newline or another control character (C0, DEL, C1), a Unicode line or
    paragraph separator, or starting with a double quote, is written as a JSON string (quoted,
    escaped; those characters as ``\\uXXXX``), as git quotes such names, so that each line of
    the file is one path for any reader.
    """
    if path.startswith('"') or any(c < " " or "\x7f" <= c <= "\x9f" or c in "\u2028\u2029" for c in path):
        return json.dumps(path)
    return path


def worktree_tree(ws: Workspace, left: Mapping[str, str] | None = None) -> str:
    """Return the tree of everything in the worktree now (in a temporary index), less the checks' leftovers."""
    admin = admin_dir(ws)
    with tempfile.TemporaryDirectory(prefix="dispatcher-index-") as tmp:
        index = os.path.join(tmp, "index")
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(admin / "index", index)
        env = _tree_env(ws, {"GIT_INDEX_FILE": index, "GIT_LITERAL_PATHSPECS": "1"})
        git(ws.path, "add", "-A", env=env)
        if left:
            _put_back(ws, env, left)
        return git(ws.path, "write-tree", env=env).strip()


def _put_back(ws: Workspace, env: dict[str, str], left: Mapping[str, str]) -> None:
    """In the index of ``env``, put each path the checks left, and nobody changed since, back as it was before them."""
    listed = git(ws.path, "ls-files", "-s", "-z", "--", *left, env=env)
    now: dict[str, str] = {}
    for record in listed.split("\0"):
        meta, tab, path = record.partition("\t")
        if tab:
            now[path] = meta.split(" ")[1]
    records = []
    for path, mark in left.items():
        new, mode, old = mark.split(":")
        if now.get(path, "") != (new if new.strip("0") else ""):
            continue  # changed since the checks left it: the agent's, judged as such
        records.append(f"{mode if old.strip('0') else '0'} {old}\t{path}\0")  # mode 0: not in the tree before
    if records:
        argv = ["git", *SAFE, "update-index", "-z", "--index-info"]
        data = "".join(records).encode()
        subprocess.run(argv, cwd=ws.path, env=env, input=data, capture_output=True, timeout=GIT_TIMEOUT_S, check=True)


def left_by_checks(ws: Workspace, before: str, earlier: Mapping[str, str]) -> dict[str, str]:
    """Return what the user checks left in the worktree: each path they changed since the tree ``before``.

    Each is kept as ``new:mode:old`` (the object they left, and the mode and object before
    them; all zeros for none), beside ``earlier`` attempts' entries, for ``snapshot``.
    """
    after = worktree_tree(ws)
    raw = git(ws.repo, "diff-tree", "-r", "-z", "--no-renames", before, after).split("\0")
    left = dict(earlier)
    for meta, path in zip(raw[0::2], raw[1::2], strict=False):
        if not meta.startswith(":"):
            continue
        old_mode, _new_mode, old, new = meta[1:].split(" ")[:4]
        if path in left:  # changed again by these checks: it was left before, and goes back as it was then
            _, old_mode, old = left[path].split(":")
        left[path] = f"{new}:{old_mode}:{old}"
    return left


def _write_patch(ws: Workspace, tree: str, path: Path, max_bytes: int) -> None:
    argv = ["git", *SAFE, "diff", "--binary", "--no-ext-diff", "--no-textconv", "--no-renames", ws.base, tree]
    proc = subprocess.Popen(argv, cwd=ws.repo, env=git_env(), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None  # noqa: S101 - PIPE
    note = f"\n[dispatcher: diff cut at {max_bytes} bytes]\n".encode()
    written, cut = 0, False
    with open(path, "wb") as out:
        while chunk := proc.stdout.read(1 << 16):
            room = max_bytes - written
            if len(chunk) > room:
                end = max_bytes - len(note)  # the note too fits in max_bytes
                if written <= end:
                    out.write(chunk[: end - written])
                else:
                    out.truncate(end)
                    out.seek(end)
                cut = True
                break
            out.write(chunk)
            written += len(chunk)
        if cut:
            out.write(note)
            proc.kill()
    proc.stdout.close()
    proc.wait()


def seal(ws: Workspace, job_id: str, tree: str | None = None) -> tuple[str, list[str]]:
    """Commit what the job left uncommitted on its branch; return the branch's head and the changed paths.

    With ``tree`` (the last ``snapshot``'s), the branch gets exactly that tree: what the
    checks saw and writes_scope judged; files a user check left after it are not the
    job's work. Without it (no snapshot was taken in this daemon's life), whatever the
    worktree holds. The commit is the daemon's (author ``dispatcher``), made without the
    repository's hooks. Safe to call again after a crash: a worktree already gone leaves
    the branch as it is.
    """
    branch = f"refs/heads/{ws.branch}"
    message = f"dispatch {job_id}: changes left uncommitted"
    if _sealable(ws):
        env = _tree_env(ws)
        if git(ws.path, "symbolic-ref", "-q", "HEAD", env=env, check=False).strip() != branch:
            # the agent moved its HEAD (onto main, or detached): what it left goes on its branch all the same
            git(ws.path, "symbolic-ref", "HEAD", branch, env=env)
        if tree is not None:
            tip = git(ws.repo, "rev-parse", "--verify", branch).strip()
            if git(ws.repo, "rev-parse", f"{tip}^{{tree}}").strip() != tree:
                commit = git(ws.repo, "commit-tree", tree, "-p", tip, "-m", message).strip()
                git(ws.repo, "update-ref", "-m", message, branch, commit, tip)
        else:
            git(ws.path, "add", "-A", env=env)
            if _staged(ws, env):
                git(ws.path, "commit", "-q", "--no-verify", "-m", message, env=env)
    head = git(ws.repo, "rev-parse", "--verify", branch).strip()
    changed = [n for n in git(ws.repo, "diff", "--name-only", "-z", "--no-renames", ws.base, head).split("\0") if n]
    return head, changed


def _staged(ws: Workspace, env: dict[str, str]) -> bool:
    proc = subprocess.run(
        ["git", *SAFE, "diff", "--cached", "--quiet"],
        cwd=ws.path,
        env=env,
        capture_output=True,
        check=False,
    )
    return proc.returncode == 1


def prune(repo: str) -> list[str]:
    """Prune the repository's worktrees whose folder is gone; return the ones locked on purpose (path and reason).

    git's own lock of a `git worktree add` cut short (reason ``initializing``) is no one's to lift: the daemon
    clears such a worktree itself (``clear``, ``sweep``), so it is not named.
    """
    git(repo, "worktree", "prune")
    return [
        f"{p} ({e['locked'] or 'no reason'})"
        for p, e in worktrees(repo).items()
        if "locked" in e and (e["locked"] or "").strip() != ADDING
    ]


def sweep(worktrees_dir: Path, keep: Sequence[str], *, only: Sequence[str] | None = None) -> list[str]:
    """Remove worktrees of jobs that are no longer active (a crash after their finish); return their ids.

    ``only``: remove those of these jobs alone (final jobs whose after hook a dead daemon cut short).
    """
    removed = []
    try:
        names = os.listdir(worktrees_dir)
    except FileNotFoundError:
        return []
    for name in names:
        if _job_of(name) in keep:  # a job's worktree, its view (being made or removed too)
            continue
        if only is not None and _job_of(name) not in only:
            continue
        path = worktrees_dir / name
        if _locked_on_purpose(path):  # someone's, named in `workspace.locked`: they unlock it, then it goes
            continue
        repo = _repo_of(path)
        if repo is not None:
            git(repo, "worktree", "remove", "--force", "--force", str(path), check=False)
        shutil.rmtree(path, ignore_errors=True)
        if repo is not None:
            git(repo, "worktree", "prune", check=False)
        removed.append(name)
    return removed


def _locked_on_purpose(path: Path) -> bool:
    """Return True when the worktree at path is locked, other than by a `git worktree add` cut short."""
    try:
        text = (path / ".git").read_text().strip()
        if not text.startswith("gitdir: "):
            return False
    except OSError:
        return False
    reason = _lock_reason(Path(text[len("gitdir: ") :]))
    return reason is not None and reason != ADDING


def _repo_of(path: Path) -> str | None:
    """Return the main repository of a worktree folder, from its .git file, or None."""
    try:
        text = (path / ".git").read_text().strip()
    except OSError:
        return None
    if not text.startswith("gitdir: "):
        return None
    gitdir = Path(text[len("gitdir: ") :])  # <repo>/.git/worktrees/<name>
    common = gitdir.parent.parent
    return str(common.parent) if common.name == ".git" else str(common)
