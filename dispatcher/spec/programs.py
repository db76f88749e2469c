"""What `validate --config` and a starting daemon check beyond the schema: can each agent be started?

A program that is missing or not executable (an agent's, its resume's, probe's, hooks'
and user checks', or ``notify``'s), or a script an interpreter is given
that the agent will not find, is an error (each job would fail with ``config: agent
NAME cannot start``, or the agent with a path inside its job folder); ``repair``
that can never act is a warning. The daemon logs these at start and on reload but
does not refuse them: an agent installed later must still work.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dispatcher.spec.settings import SCRIPT_SUFFIXES, Config, script_index

# Substituted per job (contract 3): a program path holding one is only known when the job runs.
PLACEHOLDERS = ("{job_id}", "{order}", "{workspace}", "{receipt}", "{prompt}", "{prompt_file}")


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing `validate` finds in a loaded config: an error (exit 2) or a warning."""

    field: str
    message: str
    error: bool


def check_agents(cfg: Config) -> list[Finding]:
    """Return what a loaded config gets wrong that its schema cannot say.

    A ``command``, ``resume`` or ``probe`` whose program is missing or not
    executable is an error (the daemon would fail each job with ``config: agent
    NAME cannot start``), and so is a hook's, a user check's or ``notify``'s;
    ``repair`` without ``retry_safe`` or a ``probe`` is a warning, since such an
    agent is never run again after failed checks. The daemon does not refuse
    these at start: an agent installed later must still work.
    """
    base = cfg.path.parent if cfg.path is not None else Path.cwd()
    out: list[Finding] = []
    if cfg.notify and (problem := program_problem(cfg.notify, {}, base) or script_problem(cfg.notify, base)):
        out.append(Finding("notify", problem, error=True))  # run with the daemon's PATH
    for name, agent in cfg.agents.items():
        r = agent.repo  # section 15: hooks are programs too, and the workspace's repository must exist
        hooks = [
            (key, h.command if h else None) for key, h in (("before", r.before), ("after", r.after), ("land", r.land))
        ]
        own = [("command", agent.command), ("resume", agent.resume), ("probe", agent.probe), *hooks]
        for key, argv in own:
            problem = (program_problem(argv, agent.env, base) or script_problem(argv, base)) if argv else None
            if problem is not None:
                out.append(Finding(f"agents.{name}.{key}", problem, error=True))
        for i, check in enumerate(agent.checks):  # run in the workspace: a relative path is the workspace's own
            argv = check.command
            if not argv or ("/" in argv[0] and not os.path.isabs(argv[0])):
                continue
            if (problem := program_problem(argv, agent.env, base)) is not None:
                out.append(Finding(f"agents.{name}.checks[{i}].command", problem, error=True))
        if r.workspace is not None and not os.path.isdir(r.workspace.git):
            out.append(Finding(f"agents.{name}.workspace.git", f"repository {r.workspace.git} not found", error=True))
        if agent.repair and not agent.retry_safe and agent.probe is None:
            out.append(Finding(f"agents.{name}.repair", "has no effect without retry_safe or probe", error=False))
        if both := [k for k in dict.fromkeys(agent.pass_env) if k in agent.env]:
            shown = ", ".join(both)
            out.append(Finding(f"agents.{name}.pass_env", f"{shown} also set in env: env's value wins", error=False))
    return out


def program_problem(argv: tuple[str, ...], env: Mapping[str, str], base: Path) -> str | None:
    """Return why argv[0] cannot be run (not found, not executable), or None when it can.

    A path is shown absolute (resolved against the config's folder) in both
    messages; a bare name is looked up on the agent's PATH (its ``env`` PATH,
    else the daemon's), the way the agent is started.
    """
    prog = argv[0]
    if any(p in prog for p in PLACEHOLDERS):
        return None
    if "/" in prog:
        path = os.path.normpath(base / prog)
        if not os.path.exists(path):
            return f"program '{path}' not found"
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            return f"program '{path}' is not executable"
        return None
    search = env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(prog, path=search) is not None:
        return None
    if any(os.path.isfile(os.path.join(d or ".", prog)) for d in search.split(os.pathsep)):
        return f"program '{prog}' is not executable"
    return f"program '{prog}' not found"


def script_problem(argv: tuple[str, ...], base: Path) -> str | None:
    """Return why the script an interpreter is given cannot be found as the agent will look for it, or None.

    The loader makes a relative path absolute (against the config's folder) only when
    something is there; one left relative is looked for in the job's ``work/``, where
    it never is (``[python3, ../agents/shuot.py]``). Options (``-c``, ``-m``) and
    placeholders are not scripts.
    """
    at = script_index(argv)
    if at is None:
        return None
    script = argv[at]
    if script.startswith("-") or any(p in script for p in PLACEHOLDERS):
        return None
    if "/" not in script and not script.endswith(SCRIPT_SUFFIXES):
        return None
    if os.path.isabs(script):
        return None if os.path.exists(script) else f"script '{script}' not found"
    where = os.path.normpath(base / script)
    return (
        f"script '{where}' not found: a relative path is resolved against the config's folder,"
        " else the agent would look for it in its job's work/"
    )
