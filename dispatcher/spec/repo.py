"""The agent settings of contract section 15: a git workspace, the sandbox, hooks.

Parsed from an agent's config mapping (the schema has checked the shapes) and
snapshotted into each job with the rest of the agent (``to_json``/``from_json``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dispatcher.errors import ConfigError
from dispatcher.spec.settings import DEFAULT_BRANCH, HOOKS, Hook, RepoSettings, WorkspaceConf, resolve_argv

BWRAP = "bwrap"
BWRAP_PACKAGE = "bubblewrap"


_REF_BAD_CHARS = frozenset(" ~^:?*[\\\x7f")


def branch_for(template: str, job_id: str) -> str:
    """Return a job's branch: ``template`` with ``{job_id}`` made safe for a git ref name.

    Every job id is a valid ref part but three kinds: with ``..``, or ending in ``.`` or
    ``.lock``. ``+`` (never in a job id) goes between two dots and after such an ending:
    ``A..B`` -> ``A.+.B``, ``X.lock`` -> ``X.lock+``; no two ids share a branch.
    """
    safe = job_id
    while ".." in safe:
        safe = safe.replace("..", ".+.")
    if safe.endswith((".", ".lock")):
        safe += "+"
    branch = template.replace("{job_id}", safe)
    if branch_problem(branch) is not None and branch_problem(branch + "+") is None:
        branch += "+"  # the id with what follows it in the template (`{job_id}k`: `A.loc` -> `A.lock`), or `HEAD`
    return branch


def branch_problem(name: str) -> str | None:
    """Return why name is not a valid git branch name (``git check-ref-format --branch``), or None."""
    if not name or name in ("@", "HEAD"):
        return "empty" if not name else f"{name} alone"
    if bad := sorted({c for c in name if c in _REF_BAD_CHARS or ord(c) < 32}):
        return "holds " + ", ".join(repr(c) for c in bad)
    for part, why in (("..", ".."), ("@{", "@{"), ("//", "//")):
        if part in name:
            return f"holds {why}"
    if name.startswith("/") or name.endswith(("/", ".")):
        return "starts with / or ends with / or ."
    if any(p.startswith(".") or p.endswith(".lock") for p in name.split("/")):
        return "a part starts with . or ends with .lock"
    return None


def build_repo_settings(name: str, spec: Mapping[str, Any], base: Path) -> RepoSettings:
    """Build an agent's section 15 settings from its config mapping; raise ConfigError naming the key."""
    ws = spec.get("workspace")
    workspace = None
    if ws is not None:
        branch = ws.get("branch", DEFAULT_BRANCH)
        if "{job_id}" not in branch:
            raise ConfigError(
                "must hold {job_id}: each job needs a branch of its own", field=f"agents.{name}.workspace.branch"
            )
        if branch.startswith("-"):  # git would read it as an option
            raise ConfigError(
                "must not start with -: git reads that as an option", field=f"agents.{name}.workspace.branch"
            )
        problem = branch_problem(branch_for(branch, "X"))
        if problem is not None:
            raise ConfigError(f"makes no valid git branch name: {problem}", field=f"agents.{name}.workspace.branch")
        workspace = WorkspaceConf(
            os.path.normpath(base / os.path.expanduser(ws["git"])), ws.get("base", "HEAD"), branch
        )
    sandbox = bool(spec.get("sandbox", False))
    if sandbox and shutil.which(BWRAP) is None:
        raise ConfigError(
            f"sandbox: true needs {BWRAP}, which is not installed (install the {BWRAP_PACKAGE} package)",
            field=f"agents.{name}.sandbox",
        )
    hooks: dict[str, Hook | None] = {}
    for key in HOOKS:
        value = spec.get(key)
        hook = Hook.from_json(value)
        if hook is not None:
            hook = Hook(resolve_argv(hook.command, base), hook.timeout_s)
        hooks[key] = hook
    return RepoSettings(
        workspace=workspace,
        sandbox=sandbox,
        sandbox_writable=tuple(_writable(p, base) for p in spec.get("sandbox_writable") or ()),
        sandbox_network=bool(spec.get("sandbox_network", True)),
        **hooks,
    )


def _writable(path: str, base: Path) -> str:
    """Return a sandbox_writable entry resolved against the config's folder (``~`` stays, for the agent's home)."""
    if path == "~" or path.startswith("~/") or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))
