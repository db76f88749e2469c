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
        sandbox_writable=tuple(spec.get("sandbox_writable") or ()),
        sandbox_network=bool(spec.get("sandbox_network", True)),
        **hooks,
    )
