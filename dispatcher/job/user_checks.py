"""The agent's own checks (``checks:`` in the config, contract section 14), run after the built-in ones.

Each is a command from the config (never from an order), run in the workspace
like the agent itself: the same environment rules, its own process group, its
own timeout, ended with the agent's kill grace. Its output (stdout and stderr
as they come) goes to ``attempts/<n>/checks/<name>.log``, appended to when the check
runs again for the same attempt (after a crash); its result is a named check whose
detail holds the exit code, the duration and the last line of this run's output (past a
``max_log_bytes`` cut too: the last line of its stdout, else of its stderr).
When the agent did not pass (``exit_ok`` or ``receipt_present`` not true) the
checks do not run and record ``ok: null``. A cancel cuts them: the check it ends records
``ok: null`` ("cancelled after ..."), the ones after it "not run", and the job ends
``cancelled`` (``Deciding``); a stop leaves the job for the next start (``Left``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import structlog

from dispatcher import fsutil
from dispatcher.checks.builtin import DETAIL_MAX
from dispatcher.errors import cut, printable
from dispatcher.job import attempt
from dispatcher.job.control import Control, Left
from dispatcher.job.worktree import Workspace
from dispatcher.lanes import Lanes
from dispatcher.lifecycle import Stop
from dispatcher.shortage import PAUSE_MIN_S, SHORT
from dispatcher.spec.jobspec import JobSpec
from dispatcher.spec.result import CheckResult
from dispatcher.spec.settings import Config, UserCheck
from dispatcher.store.jobstore import JobFolder
from dispatcher.text import number

log = structlog.get_logger("dispatcher")
_LAST_LINE_READ = 4096


def not_run(checks: Sequence[UserCheck], why: str) -> list[CheckResult]:
    """Return every user check recorded as not run."""
    return [CheckResult(c.name, None, f"not run: {why}") for c in checks]


def agent_passed(builtin: Sequence[CheckResult]) -> bool:
    """Return True when receipt_present is true and exit_ok is too: only then do user checks run.

    An ``exit_ok`` of null is a job recovered with its receipt after its daemon died ("exit status
    lost", section 6): its checks decide, the user's included, so that a crash never lets work pass
    that the user's checks would fail.
    """
    ok = {c.name: c.ok for c in builtin}
    return ok.get("exit_ok") in (True, None) and ok.get("receipt_present") is True


async def run(
    spec: JobSpec,
    folder: JobFolder,
    n: int,
    cfg: Config,
    control: Control,
    lanes: Lanes,
    builtin: Sequence[CheckResult],
    workspace: Workspace | None = None,
) -> list[CheckResult]:
    """Run the agent's checks in order for attempt n; return their results (all recorded, even after a failure).

    They run where the agent ran (its worktree when it has one), in its sandbox when it has one
    (where the repository is read-only to them).
    """
    checks = spec.agent.checks
    if not agent_passed(builtin):
        return not_run(checks, "the agent did not pass (exit_ok and receipt_present must be true)")
    logs = folder.attempts_dir / str(n) / "checks"
    await lanes.io(os.makedirs, logs, 0o750, True)
    results: list[CheckResult] = []
    for i, check in enumerate(checks):
        if control.reason is Stop.CANCELLED:
            return results + not_run(checks[i:], "the job was cancelled")
        results.append(await _one(spec, folder, n, cfg, control, lanes, check, logs, workspace))
    return results


async def _one(
    spec: JobSpec,
    folder: JobFolder,
    n: int,
    cfg: Config,
    control: Control,
    lanes: Lanes,
    check: UserCheck,
    logs: Path,
    workspace: Workspace | None,
) -> CheckResult:
    path = os.path.join(logs, f"{check.name}.log")
    start = await lanes.io(_create, path)
    ws_path = Path(workspace.path) if workspace is not None else None
    argv = attempt.argv(spec, folder.work, check.command, ws_path)
    while True:
        try:
            proc = attempt.process(
                spec, folder, n, argv, cfg, logs, workspace=workspace, check=(check.timeout_s, Path(path)),
            )  # fmt: skip
            proc.start()
            break
        except OSError as exc:
            if SHORT.note(exc, "check.start"):  # a shortage is never the check's answer (section 13): it waits
                if await control.sleep(max(SHORT.wait_s(), PAUSE_MIN_S)):
                    if control.reason is Stop.CANCELLED:
                        return _result(check.name, None, "not run: the job was cancelled")
                    raise Left from None
                continue
            why = exc.strerror or str(exc)
            return _result(check.name, False, f"cannot start: {why}" + (f": {exc.filename}" if exc.filename else ""))
    control.attach(proc)
    out = await proc.wait()
    control.attach(None)
    if out.aborted == Stop.STOPPED:
        raise Left
    if out.stdout_cut or out.stderr_cut:  # the log ends at max_log_bytes: its last line is the daemon's notice
        last = _tail_line(out.stdout_tail) or _tail_line(out.stderr_tail)
    else:
        last = await lanes.io(_last_line, path, start)
    secs = out.duration_ms / 1000
    tail = f": {last}" if last else ""
    ok: bool | None
    if out.aborted:  # a cancel: neither passed nor failed, the job ends cancelled
        ok, detail = None, f"{out.aborted} after {secs:.2f} s{tail}"
    elif out.timed_out:
        ok, detail = False, f"timed out after {number(check.timeout_s)} s{tail}"
    elif out.exit_code is None or out.exit_code < 0:
        ok, detail = False, f"killed by signal {-(out.exit_code or 0)} after {secs:.2f} s{tail}"
    else:
        ok, detail = out.exit_code == 0, f"exit {out.exit_code} in {secs:.2f} s{tail}"
    log.info(
        "check.exited",
        check=check.name,
        ok=ok,
        exit_code=out.exit_code,
        timed_out=out.timed_out,
        duration_ms=out.duration_ms,
    )
    return _result(check.name, ok, detail)


def _result(name: str, ok: bool | None, detail: str) -> CheckResult:
    return CheckResult(name, ok, cut(printable(detail), DETAIL_MAX))


def _create(path: str) -> int:
    """Create a check's log if it is missing and return its size: where this run's output starts.

    A run again after a crash appends: the interrupted run's output is kept (contract section 1).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _last_line(path: str, start: int) -> str:
    """Return the last non-blank line this run wrote to a check's log (from byte start; its last 4 KiB)."""
    return _tail_line(fsutil.read_tail(path, _LAST_LINE_READ, start=start))


def _tail_line(data: bytes) -> str:
    """Return the last non-blank line of output (its last 4 KiB): what the check printed last."""
    lines = [ln.strip() for ln in data[-_LAST_LINE_READ:].decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""
