"""Run an agent under bubblewrap (contract section 15, ``sandbox: true``).

The whole filesystem is mounted read-only; the job's workspace, its ``work/``, a private
``/tmp`` and the agent's ``sandbox_writable`` paths are writable. An agent with a
workspace commits on its branch through a view of the repository (``gitview``): its
own refs, reflogs and new objects, taken back after the attempt, of which only the
job's branch moves in the repository. Its probe and user checks see the repository
read-only. bwrap leads the process group the daemon made and the agent inside stays in
it, so ending the group ends the agent. The agent has a pid namespace of its own
(``--unshare-pid``): when it ends, whatever it left behind ends with it, even a process
that left its group (``setsid``), which would otherwise keep its writable mounts while
the daemon works on the worktree. ``--die-with-parent`` ends the sandbox if the daemon dies.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dispatcher.spec.repo import BWRAP
from dispatcher.spec.settings import RepoSettings


def writable_paths(repo: RepoSettings, work: Path, workspace: Path | None, home: str) -> list[str]:
    """Return the paths writable inside the sandbox, ``~`` expanded against home."""
    paths = [str(work)]
    if workspace is not None:
        paths.append(str(workspace))
    for p in repo.sandbox_writable:
        paths.append(home + p[1:] if p == "~" or p.startswith("~/") else p)
    return paths


def wrap(
    argv: Sequence[str],
    *,
    cwd: Path,
    writable: Iterable[str],
    network: bool,
    env: Mapping[str, str],
    binds: Sequence[tuple[str, str, bool]] = (),
) -> list[str]:
    """Return argv wrapped in bwrap; raise FileNotFoundError when bwrap or the agent's program is missing.

    ``binds`` (source, destination, writable) come last, in order: a view of the
    repository over its folders (``gitview.GitView.binds``).

    The agent's program is looked up here, on the agent's PATH, so that a missing one
    is "cannot start" as it is without the sandbox, not an exit code of bwrap.
    """
    bwrap = shutil.which(BWRAP)
    if bwrap is None:
        raise FileNotFoundError(2, "bubblewrap is not installed (package bubblewrap)", BWRAP)
    prog = argv[0]
    if "/" not in prog:
        found = shutil.which(prog, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(2, "No such file or directory", prog)
    else:
        found = str(cwd / prog) if not os.path.isabs(prog) else prog
        if not os.access(found, os.X_OK):
            raise FileNotFoundError(2, "No such file or directory", prog)
    out = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]  # noqa: S108 - a private /tmp
    for kept in _own_tmp_folders([found, *argv[1:]]):  # the agent's own program stays visible, read-only
        out += ["--ro-bind-try", kept, kept]
    for path in writable:
        out += ["--bind-try", path, path]
    for source, dest, rw in binds:
        out += ["--bind" if rw else "--ro-bind", source, dest]
    # no capability inside, whoever runs the daemon: as root, bwrap would leave the agent CAP_SYS_ADMIN, with which
    # `mount -o remount,rw /` undoes the read-only root
    out += ["--unshare-pid", "--die-with-parent", "--cap-drop", "ALL"]
    if not network:
        out.append("--unshare-net")
    out += ["--chdir", str(cwd), "--"]
    # bwrap sets PWD after its --chdir: `env` puts back what the agent's environment says of it (section 3:
    # no PWD unless its env or pass_env gives one), as without the sandbox; a program named like an
    # assignment is given by its path
    tool = shutil.which("env")
    if tool is not None:
        own = env.get("PWD")
        out += [tool, "-u", "PWD", "--"] if own is None else [tool, "--", f"PWD={own}"]
        out.append(found if "=" in prog else prog)
    else:
        out.append(prog)
    return [*out, *argv[1:]]


def _own_tmp_folders(paths: Iterable[str]) -> list[str]:
    """Return the folders right under /tmp that hold the agent's program or its path arguments.

    The sandbox's /tmp is private and empty; a program (or a virtualenv's interpreter, or a
    script named in argv) that lives under /tmp would vanish with it, so its top folder there
    is bound back read-only. The path as written and its real path both count (a venv's
    ``python`` is a link whose own folder holds the environment).
    """
    tops: set[str] = set()
    for path in paths:
        if not os.path.isabs(path) or not os.path.exists(path):
            continue
        for candidate in (os.path.normpath(path), os.path.realpath(path)):
            parts = candidate.split("/")
            if len(parts) > 2 and parts[1] == "tmp" and parts[2]:
                tops.add("/".join(parts[:3]))  # /tmp/<top>
    return sorted(tops)
