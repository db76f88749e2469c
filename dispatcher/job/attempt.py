"""One attempt's pieces: the argv and environment it gets, its process, its record.

Placeholders are rendered from the job's spec, never from files in work/ (an
agent may leave a FIFO or a link where its prompt was).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dispatcher.checks.builtin import Exit
from dispatcher.job.runner import AgentExit, AgentProcess, build_env, render
from dispatcher.spec.config import Config
from dispatcher.spec.jobspec import Attempt, JobSpec, prompt_values
from dispatcher.store.jobstore import JobFolder

HOST = socket.gethostname()


def values(spec: JobSpec, work: Path) -> dict[str, str]:
    """Return the argv placeholders' values for a job."""
    prompt = spec.agent.prompt
    rendered = render(prompt, prompt_values(spec.order, spec.writes, work), prompt=True) if prompt is not None else ""
    return {
        "job_id": spec.job_id,
        "order": str(work / "order.json"),
        "workspace": str(work),
        "receipt": str(work / "receipt.json"),
        "prompt": rendered,
        "prompt_file": str(work / "prompt.md") if prompt is not None else "",
        "parents": str(work / "parents.json"),
    }


def argv(spec: JobSpec, work: Path, command: Iterable[str]) -> list[str]:
    """Return the command with its placeholders rendered."""
    vals = values(spec, work)
    return [render(a, vals) for a in command]


def dispatch_env(job_id: str, work: Path, n: int) -> dict[str, str]:
    """Return the DISPATCH_* variables of attempt n."""
    return {
        "DISPATCH_JOB_ID": job_id,
        "DISPATCH_ORDER": str(work / "order.json"),
        "DISPATCH_WORKSPACE": str(work),
        "DISPATCH_RECEIPT": str(work / "receipt.json"),
        "DISPATCH_ATTEMPT": str(n),
    }


def process(
    spec: JobSpec, folder: JobFolder, n: int, cmd: list[str], cfg: Config, log_dir: Path, *, probe: bool = False
) -> AgentProcess:
    """Return the (not yet started) process of attempt n, or of its probe."""
    agent = spec.agent
    cwd = folder.work if not probe or os.path.isdir(folder.work) else folder.path
    return AgentProcess(
        cmd,
        cwd=cwd,
        env=build_env(agent.env, dispatch_env(spec.job_id, folder.work, n), agent.pass_env),
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
