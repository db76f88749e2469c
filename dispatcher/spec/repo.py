"""The agent settings of contract section 15: a git workspace, the sandbox, hooks.

Parsed from an agent's config mapping (the schema has checked the shapes) and
snapshotted into each job with the rest of the agent (``to_json``/``from_json``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher.errors import ConfigError

DEFAULT_BRANCH = "dispatch/{job_id}"
DEFAULT_HOOK_TIMEOUT_S = 300.0
HOOKS = ("before", "after", "land")
BWRAP = "bwrap"
BWRAP_PACKAGE = "bubblewrap"


@dataclass(frozen=True, slots=True)
class WorkspaceConf:
    """``workspace: {git, base, branch}``: each job works in a worktree of ``git`` on its own branch."""

    git: str  # the repository, absolute
    base: str = "HEAD"
    branch: str = DEFAULT_BRANCH

    def to_json(self) -> dict[str, Any]:
        """Return the setting as plain JSON values."""
        return {"git": self.git, "base": self.base, "branch": self.branch}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> WorkspaceConf | None:
        """Rebuild the setting (None: no workspace)."""
        if not data:
            return None
        return cls(str(data["git"]), str(data.get("base") or "HEAD"), str(data.get("branch") or DEFAULT_BRANCH))


@dataclass(frozen=True, slots=True)
class Hook:
    """One hook: an argv (never a shell) and its timeout."""

    command: tuple[str, ...]
    timeout_s: float = DEFAULT_HOOK_TIMEOUT_S

    def to_json(self) -> dict[str, Any]:
        """Return the hook as plain JSON values."""
        return {"command": list(self.command), "timeout": self.timeout_s}

    @classmethod
    def from_json(cls, data: Any) -> Hook | None:
        """Rebuild a hook from ``to_json`` output or the config's argv (None: no hook)."""
        if not data:
            return None
        if isinstance(data, list):
            return cls(tuple(data))
        return cls(tuple(data["command"]), float(data.get("timeout") or DEFAULT_HOOK_TIMEOUT_S))


@dataclass(frozen=True, slots=True)
class RepoSettings:
    """Section 15 of one agent: workspace, sandbox and hooks (all off by default)."""

    workspace: WorkspaceConf | None = None
    sandbox: bool = False
    sandbox_writable: tuple[str, ...] = ()
    sandbox_network: bool = True
    before: Hook | None = None
    after: Hook | None = None
    land: Hook | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the settings as plain JSON values (merged into the agent's snapshot)."""
        return {
            "workspace": self.workspace.to_json() if self.workspace else None,
            "sandbox": self.sandbox,
            "sandbox_writable": list(self.sandbox_writable),
            "sandbox_network": self.sandbox_network,
            **{name: (h.to_json() if (h := getattr(self, name)) else None) for name in HOOKS},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RepoSettings:
        """Rebuild the settings from an agent snapshot (older snapshots have none of these keys)."""
        return cls(
            workspace=WorkspaceConf.from_json(data.get("workspace")),
            sandbox=bool(data.get("sandbox", False)),
            sandbox_writable=tuple(data.get("sandbox_writable") or ()),
            sandbox_network=bool(data.get("sandbox_network", True)),
            before=Hook.from_json(data.get("before")),
            after=Hook.from_json(data.get("after")),
            land=Hook.from_json(data.get("land")),
        )


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
            hook = Hook(_resolve(hook.command, base), hook.timeout_s)
        hooks[key] = hook
    return RepoSettings(
        workspace=workspace,
        sandbox=sandbox,
        sandbox_writable=tuple(spec.get("sandbox_writable") or ()),
        sandbox_network=bool(spec.get("sandbox_network", True)),
        **hooks,
    )


def _resolve(argv: tuple[str, ...], base: Path) -> tuple[str, ...]:
    out = []
    for arg in argv:
        if "/" in arg and "{" not in arg and not os.path.isabs(arg) and (base / arg).exists():
            arg = os.path.normpath(base / arg)
        out.append(arg)
    return tuple(out)
