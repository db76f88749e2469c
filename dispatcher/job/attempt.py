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

from dispatcher.checks.builtin import Exit
from dispatcher.job import sandbox
from dispatcher.job.runner import AgentExit, AgentProcess, build_env, dispatch_env, render
from dispatcher.job.worktree import Workspace
from dispatcher.spec.config import Config
from dispatcher.spec.jobspec import Attempt, JobSpec, prompt_values
from dispatcher.store.jobstore import JobFolder

HOST = socket.gethostname()


def values(spec: JobSpec, work: Path, workspace: Path | None = None) -> dict[str, str]:
    """Return the argv placeholders' values for a job (``workspace``: its git worktree, else work/)."""
    prompt = spec.agent.prompt
    vals = prompt_values(spec.order, spec.writes, work, workspace)
    rendered = render(prompt, vals, prompt=True) if prompt is not None else ""
    return {
        "job_id": spec.job_id,
        "order": str(work / "order.json"),
        "workspace": str(workspace or work),
        "receipt": str(work / "receipt.json"),
        "prompt": rendered,
        "prompt_file": str(work / "prompt.md") if prompt is not None else "",
        "parents": str(work / "parents.json"),
    }


def argv(spec: JobSpec, work: Path, command: Iterable[str], workspace: Path | None = None) -> list[str]:
    """Return the command with its placeholders rendered."""
    vals = values(spec, work, workspace)
    return [render(a, vals) for a in command]


def process(
    spec: JobSpec,
    folder: JobFolder,
    n: int,
    cmd: list[str],
    cfg: Config,
    log_dir: Path,
    *,
    probe: bool = False,
    workspace: Workspace | None = None,
    git_writable: Sequence[str] = (),
) -> AgentProcess:
    """Return the (not yet started) process of attempt n, or of its probe.

    With a workspace, the agent runs in its worktree; with ``sandbox``, under bubblewrap
    (raises FileNotFoundError, "cannot start", when bwrap or the program is missing).
    """
    agent = spec.agent
    ws_path = Path(workspace.path) if workspace is not None else None
    cwd = folder.work if not probe or os.path.isdir(folder.work) else folder.path
    if ws_path is not None and os.path.isdir(ws_path):
        cwd = ws_path
    env = build_env(agent.env, dispatch_env(spec.job_id, folder.work, n, ws_path), agent.pass_env)
    if agent.repo.sandbox:
        home = env.get("HOME") or os.path.expanduser("~")
        writable = sandbox.writable_paths(agent.repo, folder.work, ws_path, git_writable, home)
        cmd = sandbox.wrap(cmd, cwd=cwd, writable=writable, network=agent.repo.sandbox_network, env=env)
    return AgentProcess(
        cmd,
        cwd=cwd,
        env=env,
        timeout_s=spec.timeout_s,
        kill_grace_s=cfg.kill_grace_s,
        log_dir=log_dir,
        max_log_bytes=cfg.max_log_bytes,
        log_prefix="probe-" if probe else "",
    )


def record(n: int, out: AgentExit, cmd: list[str], result: Mapping[str, Any] | None) -> Attempt:
    """Return the record of an attempt that ran."""
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
    )


def exit_of(rec: Attempt, timeout_s: float) -> Exit:
    """Return how the agent of a recorded attempt ended, as the checks see it."""
    return Exit(code=rec.exit_code, timed_out=rec.timed_out, seconds=rec.duration_ms / 1000, timeout_s=timeout_s)


def interrupted(n: int, running: Mapping[str, Any] | None) -> Attempt:
    """Return the record of attempt n found without its end (its daemon died, or a stop cut it)."""
    started = float((running or {}).get("started") or time.time())
    return Attempt(n=n, started=started, ended=time.time(), exit_code=None, interrupted=True, host=HOST)


def hook_failed(n: int, why: str) -> Attempt:
    """Return the record of attempt n whose before hook failed: the agent never ran."""
    now = time.time()
    return Attempt(n=n, started=now, ended=now, exit_code=None, host=HOST, extra={"before": why})
