"""One attempt's pieces: the argv and environment it gets, its process, its record.

Placeholders are rendered from the job's spec, never from files in work/ (an
agent may leave a FIFO or a link where its prompt was).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dispatcher.checks.facts import Exit
from dispatcher.job import sandbox
from dispatcher.job.gitview import GitView
from dispatcher.job.runner import AgentExit, AgentProcess, EnvB, agent_environ, build_env, dispatch_env
from dispatcher.job.worktree import Workspace
from dispatcher.spec.jobspec import Attempt, JobSpec, is_cost, prompt_values, render
from dispatcher.spec.settings import Agent, Config
from dispatcher.store.jobstore import JobFolder

HOST = socket.gethostname()


def values(spec: JobSpec, work: str | Path, workspace: Path | None = None) -> dict[str, str]:
    """Return the argv placeholders' values for a job (``workspace``: its git worktree, else work/)."""
    prompt = spec.agent.prompt
    # the prompt's own values (two JSON encodes among them) only when there is a prompt to render
    rendered = (
        render(prompt, prompt_values(spec.order, spec.writes, Path(work), workspace), prompt=True) if prompt else ""
    )
    w = os.fspath(work)
    vals = {
        "job_id": spec.job_id,
        "order": f"{w}/order.json",
        "workspace": os.fspath(workspace or work),
        "receipt": f"{w}/receipt.json",
        "prompt": rendered,
        "prompt_file": f"{w}/prompt.md" if prompt is not None else "",
    }
    if spec.order.get("after"):  # `{parents}` is a join's (section 16): elsewhere it passes unchanged
        vals["parents"] = f"{w}/parents.json"
    return vals


def argv(
    spec: JobSpec,
    work: str | Path,
    command: Iterable[str],
    workspace: Path | None = None,
    session_id: str | None = None,
) -> list[str]:
    """Return the command with its placeholders rendered (``{session_id}`` too when resuming a session)."""
    vals = values(spec, work, workspace)
    if session_id is None:
        return [render(a, vals) for a in command]
    # one pass: a {session_id} inside another placeholder's value (the order's task in {prompt}) stays as it is
    vals["session_id"] = session_id
    return [render(a, vals, resume=True) for a in command]


def argv_after(spec: JobSpec, work: str | Path, earlier: Sequence[Attempt], workspace: Path | None = None) -> list[str]:
    """Return the argv of the attempt after ``earlier``: its command (or ``resume``) with placeholders rendered."""
    command, session = command_for(spec.agent, earlier)
    return argv(spec, work, command, workspace, session)


def session_of(rec: Attempt) -> str | None:
    """Return the session_id an attempt's agent reported, if any (``session_of_result``)."""
    return session_of_result(rec.agent_result)


def command_for(agent: Agent, earlier: Sequence[Attempt]) -> tuple[tuple[str, ...], str | None]:
    """Return the argv template of the next attempt and the session it resumes (``resume:``), if any."""
    if agent.resume is None:
        return agent.command, None
    sid = next((s for s in (session_of(a) for a in reversed(earlier)) if s is not None), None)
    return (agent.resume, sid) if sid is not None else (agent.command, None)


def session_before(session_id: str | None, earlier: Sequence[Attempt]) -> float | None:
    """Return the latest running total an earlier attempt reported for this session (``total_cost_usd``).

    An attempt that resumed the session and named none in its final JSON counts as that session's.
    """
    if session_id is None:
        return None
    for a in reversed(earlier):
        of = session_of(a) or a.extra.get("resumed_session")
        if of == session_id and a.agent_result is not None:
            total = a.agent_result.get("total_cost_usd")
            if is_cost(total):
                return float(total)
    return None


def process(
    spec: JobSpec,
    folder: JobFolder,
    n: int,
    cmd: list[str],
    cfg: Config,
    log_dir: str | Path,
    *,
    probe: bool = False,
    workspace: Workspace | None = None,
    git_view: GitView | None = None,
    check: tuple[float, Path] | None = None,
    slot_fd: int | None = None,
) -> AgentProcess:
    """Return the (not yet started) process of attempt n, of its probe, or of a user check.

    With a workspace, the agent runs in its worktree; with ``sandbox``, under bubblewrap
    (raises FileNotFoundError, "cannot start", when bwrap or the program is missing).
    ``check`` = (timeout, log file) runs a user check (section 14) the same way, its
    stdout and stderr into that one file. ``git_view``: the attempt's own view of the
    repository under the sandbox (``gitview``); without it, a sandboxed probe or check
    sees the repository read-only. ``slot_fd``: the descriptor of the agent's slot, which the
    agent inherits (its slot stays taken while it lives, whatever happens to its daemon).
    """
    agent = spec.agent
    ws_path = Path(workspace.path) if workspace is not None else None
    cwd: str | Path = folder.work_dir if not probe or os.path.isdir(folder.work_dir) else folder.path
    if ws_path is not None and os.path.isdir(ws_path):
        cwd = ws_path
    env: dict[str, str] | EnvB
    if agent.repo.sandbox:
        env = build_env(agent.env, dispatch_env(spec.job_id, folder.work_dir, n, ws_path), agent.pass_env)
        home = env.get("HOME") or os.path.expanduser("~")
        writable = sandbox.writable_paths(agent.repo, folder.work, ws_path, home)
        binds = git_view.binds() if git_view is not None else ()
        cmd = sandbox.wrap(
            cmd, cwd=Path(cwd), writable=writable, network=agent.repo.sandbox_network, env=env, binds=binds
        )
    else:  # as bytes already: nothing of it is read here, and the process is given bytes
        env = agent_environ(agent.env, dispatch_env(spec.job_id, folder.work_dir, n, ws_path), agent.pass_env)
    return AgentProcess(
        cmd,
        cwd=cwd,
        env=env,
        timeout_s=check[0] if check is not None else spec.timeout_s,
        kill_grace_s=cfg.kill_grace_s,
        log_dir=None if check is not None else log_dir,
        max_log_bytes=cfg.max_log_bytes,
        log_prefix="probe-" if probe else "",
        idle_timeout_s=None if probe or check is not None else agent.idle_timeout_s,
        idle_also=folder.work_dir,  # work/ counts too when the agent works in its worktree (README, idle_timeout)
        one_log=check[1] if check is not None else None,
        keep_fd=slot_fd,
    )


def record(
    n: int,
    out: AgentExit,
    cmd: list[str],
    result: Mapping[str, Any] | None,
    earlier: Sequence[Attempt] = (),
    resumed: str | None = None,
) -> Attempt:
    """Return the record of an attempt that ran.

    An attempt that resumed a session (``resumed``: the session_id its ``resume`` argv was
    given; it reported that one, or none) records that session's earlier total, so that its
    cost is the difference: a resumed CLI reports the whole session's running cost. An attempt
    that did not resume one, or reported another session, costs what it reported.
    """
    extra = _session_extra(result, earlier, resumed)
    if out.idle_s is not None:
        extra["idle_s"] = out.idle_s
    return Attempt(
        n=n,
        started=out.started,
        ended=out.ended,
        exit_code=out.exit_code,
        timed_out=out.timed_out,
        argv=tuple(cmd),
        host=HOST,
        agent_result=result,
        aborted=out.aborted,
        extra=extra,
    )


def _session_extra(result: Mapping[str, Any] | None, earlier: Sequence[Attempt], resumed: str | None) -> dict[str, Any]:
    """Return the record's note of a resumed session's earlier total (its cost is the difference).

    An attempt started with ``resume`` resumed that session: its total is the session's running
    total unless it names another session (the CLI started a new one), also when it names none.
    """
    session = session_of_result(result)
    if resumed is None or session not in (None, resumed):
        return {}
    extra: dict[str, Any] = {} if session is not None else {"resumed_session": resumed}
    before = session_before(resumed, earlier)
    if before is not None:
        extra["session_cost_before_usd"] = before
    return extra


SESSION_ID_MAX = 1024  # characters: a CLI's session id is a UUID or so; this one goes into an argv


def session_of_result(result: Mapping[str, Any] | None) -> str | None:
    """Return the session_id of an agent's final JSON, if any.

    Only a non-empty string of at most ``SESSION_ID_MAX`` characters with no control character
    counts: the agent's own output must not make the next attempt's argv one no program can be
    started with (a NUL byte, an argument list too long), which would fail the job as a config error.
    """
    sid = result.get("session_id") if result is not None else None
    if not isinstance(sid, str) or not sid or len(sid) > SESSION_ID_MAX:
        return None
    return None if any(ord(c) < 32 or ord(c) == 127 for c in sid) else sid


def exit_of(rec: Attempt, timeout_s: float) -> Exit:
    """Return how the agent of a recorded attempt ended, as the checks see it."""
    idle = rec.extra.get("idle_s")
    return Exit(
        code=rec.exit_code,
        timed_out=rec.timed_out,
        seconds=rec.duration_ms / 1000,
        timeout_s=timeout_s,
        idle_s=float(idle) if isinstance(idle, (int, float)) else None,
    )


def interrupted(
    n: int,
    started: float | None,
    argv: Sequence[str] = (),
    result: Mapping[str, Any] | None = None,
    earlier: Sequence[Attempt] = (),
    resumed: str | None = None,
    host: str | None = None,
) -> Attempt:
    """Return the record of attempt n found without its end (its daemon died, or a stop cut it).

    ``host``: the host its agent ran on, as noted at its spawn (a daemon of another host that died);
    this host when none was noted.

    ``argv``: what it ran, rendered again from the job's frozen spec (the record that would
    have held it is written at an attempt's end). ``result``: the final JSON its stdout.log
    ends with, if the agent printed one before its daemon died (its cost counts).
    """
    started = started if started is not None else time.time()
    return Attempt(
        n=n,
        started=started,
        ended=time.time(),
        exit_code=None,
        interrupted=True,
        host=host or HOST,
        argv=tuple(argv),
        agent_result=result,
        extra=_session_extra(result, earlier, resumed),
    )


def hook_failed(n: int, why: str) -> Attempt:
    """Return the record of attempt n whose before hook failed: the agent never ran."""
    now = time.time()
    return Attempt(n=n, started=now, ended=now, exit_code=None, host=HOST, extra={"before": why})
