"""The config's settings as typed values: each agent and the whole config (contract sections 3, 14, 15).

Frozen dataclasses only, with their JSON forms (a job snapshots its agent's settings into
``job.json``); ``config.py`` loads and checks the file, ``agent_rules.py`` and ``repo.py``
build the parts of an agent from it. Internal names carry units (``timeout_s``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher.spec.limits import LimitRule

MAX_RETRY_DELAY_S = 300.0


DEFAULT_BRANCH = "dispatch/{job_id}"
DEFAULT_HOOK_TIMEOUT_S = 300.0
HOOKS = ("before", "after", "land")
DEFAULT_CHECK_TIMEOUT_S = 600.0


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


@dataclass(frozen=True, slots=True)
class UserCheck:
    """A check of the user's own: a command run in the workspace after the agent passed."""

    name: str
    command: tuple[str, ...]
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "command": list(self.command), "timeout": self.timeout_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UserCheck:
        return cls(str(data["name"]), tuple(data["command"]), float(data.get("timeout", DEFAULT_CHECK_TIMEOUT_S)))


@dataclass(frozen=True, slots=True)
class Agent:
    """One agent of the config: how to run it and what it may do."""

    name: str
    command: tuple[str, ...]
    prompt: str | None = None
    timeout_s: float = 600.0
    concurrency: int = 1
    max_attempts: int = 1
    retry_safe: bool = False
    probe: tuple[str, ...] | None = None
    repair: bool = False
    writes: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    pass_env: tuple[str, ...] = ()
    max_cost_usd: float | None = None
    review: bool = False
    idle_timeout_s: float | None = None
    limits: tuple[LimitRule, ...] = ()
    checks: tuple[UserCheck, ...] = ()
    resume: tuple[str, ...] | None = None
    max_revisions: int = 5
    max_daily_cost_usd: float | None = None
    repo: RepoSettings = field(default_factory=RepoSettings)  # section 15: workspace, sandbox, hooks

    def to_json(self) -> dict[str, Any]:
        """Return the agent as plain JSON values (snapshotted into each job)."""
        return {
            "name": self.name,
            "command": list(self.command),
            "prompt": self.prompt,
            "timeout": self.timeout_s,
            "concurrency": self.concurrency,
            "max_attempts": self.max_attempts,
            "retry_safe": self.retry_safe,
            "probe": list(self.probe) if self.probe is not None else None,
            "repair": self.repair,
            "writes": list(self.writes),
            "env": dict(self.env),
            "pass_env": list(self.pass_env),
            "max_cost_usd": self.max_cost_usd,
            "review": self.review,
            "idle_timeout": self.idle_timeout_s,
            "limits": [r.to_json() for r in self.limits],
            "checks": [c.to_json() for c in self.checks],
            "resume": list(self.resume) if self.resume is not None else None,
            "max_revisions": self.max_revisions,
            "max_daily_cost_usd": self.max_daily_cost_usd,
            **self.repo.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Agent:
        """Rebuild an agent from ``to_json`` output (snapshots older than ``pass_env`` included)."""
        return cls(
            name=data["name"],
            command=tuple(data["command"]),
            prompt=data["prompt"],
            timeout_s=float(data["timeout"]),
            concurrency=int(data["concurrency"]),
            max_attempts=int(data["max_attempts"]),
            retry_safe=bool(data["retry_safe"]),
            probe=tuple(data["probe"]) if data["probe"] is not None else None,
            repair=bool(data["repair"]),
            writes=tuple(data["writes"]),
            env=dict(data["env"]),
            pass_env=tuple(data.get("pass_env", ())),
            max_cost_usd=data.get("max_cost_usd"),
            review=bool(data.get("review", False)),
            idle_timeout_s=data.get("idle_timeout"),
            limits=tuple(LimitRule.from_json(r) for r in data.get("limits") or ()),
            checks=tuple(UserCheck.from_json(c) for c in data.get("checks") or ()),
            resume=tuple(data["resume"]) if data.get("resume") is not None else None,
            max_revisions=int(data.get("max_revisions", 5)),
            max_daily_cost_usd=data.get("max_daily_cost_usd"),
            repo=RepoSettings.from_json(data),
        )


@dataclass(frozen=True, slots=True)
class Config:
    """The whole config. ``path`` is the file it came from (None: built-in defaults)."""

    path: Path | None
    root: Path
    max_jobs: int = 2
    max_timeout_s: float = 3600.0
    max_hops: int = 5
    max_followups: int = 100
    max_order_bytes: int = 1_048_576
    stop_timeout_s: float = 60.0
    retry_delay_s: float = 2.0
    rescan_interval_s: float = 30.0
    settle_s: float = 2.0
    kill_grace_s: float = 5.0
    max_log_bytes: int = 10_485_760
    log_file: Path | None = None
    metrics_file: str | None = None
    metrics_labels: Mapping[str, str] = field(default_factory=dict)
    notify: tuple[str, ...] | None = None
    notify_max_running: int = 4
    max_chain_cost_usd: float | None = None
    max_daily_cost_usd: float | None = None
    max_limit_wait_s: float = 86400.0
    web_token_file: Path | None = None
    ledger: str = "sqlite"
    lease_s: float = 30.0
    watch: str = "inotify"
    poll_interval_s: float = 1.0
    max_wait_s: float = 604800.0
    agents: Mapping[str, Agent] = field(default_factory=dict)
    #: a digest of the file's bytes (None: built-in defaults); a daemon records the one it loaded
    digest: str | None = None
    #: the file's path as it was given, made absolute (``path`` resolves links; a reload reads this one again)
    given: str | None = None
    #: agents a reload removed from the running daemon's config: orders for them wait, follow-ups to them too
    retired: frozenset[str] = frozenset()

    def agent_names(self) -> Container[str]:
        """Return the names an order may give in ``to``: the agents, and those a reload retired."""
        return self.agents if not self.retired else {*self.agents, *self.retired}


#: programs whose first argument is a script file they run
INTERPRETERS = re.compile(r"(python[0-9.]*|pypy[0-9.]*|node|nodejs|deno|bun|bash|sh|dash|zsh|ruby|perl|php|Rscript)")
SCRIPT_SUFFIXES = (".py", ".js", ".mjs", ".cjs", ".ts", ".sh", ".bash", ".rb", ".pl", ".php", ".r", ".R")


_CODE_OPTIONS = frozenset(("-c", "-m", "-e", "--eval", "-p", "--print"))  # the program is not a script file
_ARG_OPTIONS = frozenset(("-W", "-X", "-r", "--require"))  # an option whose value is the next element


def script_index(argv: Sequence[str]) -> int | None:
    """Return where an interpreter's script is in argv (``[python3, -u, agent.py]``: 2), or None.

    The interpreter may come through ``env`` (``[/usr/bin/env, python3, agent.py]``, with
    ``NAME=value`` or option elements before it); its own options before the script are
    passed over; a program given as code (``-c``, ``-m``, ``-e``) has no script.
    """
    i = 0
    if argv and os.path.basename(argv[0]) == "env":
        i = 1
        while i < len(argv) and (argv[i].startswith("-") or "=" in argv[i]):
            i += 1
    if i >= len(argv) or not INTERPRETERS.fullmatch(os.path.basename(argv[i])):
        return None
    i += 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] in _CODE_OPTIONS:
            return None
        i += 2 if argv[i] in _ARG_OPTIONS else 1
    return i if i < len(argv) else None


def resolve_argv(argv: Sequence[str], base: Path) -> tuple[str, ...]:
    """Resolve path-like argv elements against the config's folder.

    An element is resolved when it has no placeholder, is relative, contains a
    ``/`` and names something that exists under ``base`` (so ``agents/a.py``
    works from any working folder). So is an interpreter's script given by its
    bare name (``[python3, agent.py]``) when that file is beside the config.
    Other bare names such as ``python3`` are left for PATH, and anything else
    passes unchanged.
    """
    out = []
    at = script_index(argv)
    for i, arg in enumerate(argv):
        pathlike = "/" in arg or (i == at and arg.endswith(SCRIPT_SUFFIXES) and (base / arg).is_file())
        if pathlike and "{" not in arg and not os.path.isabs(arg) and (base / arg).exists():
            arg = os.path.normpath(base / arg)
        out.append(arg)
    return tuple(out)
