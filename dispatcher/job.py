"""Run one claimed job to its end: attempts, checks, retries, the final move.

``JobRun.run`` executes in the job's own worker thread. What it writes, in
order, is what makes a crash at any point recoverable (see README, "Design"):

- ``attempts/<n>/pid`` right after the agent starts (so a successor can end it);
- ``attempts/<n>/attempt.json`` when the agent has ended (its exit status);
- on a retry, the old ``receipt.json`` and ``outbox/`` move into ``attempts/<n>/``;
- ``result.json`` (fsynced), then one rename to done/ or failed/, then the ledger;
- follow-ups are reserved in the ledger before ``result.json`` and released after.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dispatcher import fsutil, runner
from dispatcher.checks import CheckResult, Exit, run_checks, verdict
from dispatcher.claim import JOB_FILE
from dispatcher.config import MAX_RETRY_DELAY_S, Agent, Config
from dispatcher.errors import oneline
from dispatcher.evidence import digest, gather
from dispatcher.followups import release_followups
from dispatcher.layout import Layout, State, iso
from dispatcher.ledger import DONE, FAILED, Ledger
from dispatcher.orders import Order, parse_order, validate_order
from dispatcher.recovery import end_leftover

log = structlog.get_logger("dispatcher")

CANCELLED = "cancelled"
STOPPED = "stopped"


@dataclass
class Context:
    """What every job needs from its daemon."""

    layout: Layout
    ledger: Ledger
    owner: str
    config: Callable[[], Config]
    released: Callable[[str], None]
    is_cancelled: Callable[[str], bool]
    stopping: Callable[[], bool] = lambda: False


class JobRun:
    """One job in active/<job_id>, driven to done/ or failed/ (or left for recovery on stop)."""

    def __init__(
        self,
        ctx: Context,
        job_id: str,
        *,
        recovering: bool = False,
        fresh: tuple[dict[str, Any], Order] | None = None,
    ) -> None:
        """Load a job from active/<job_id>; ``fresh`` passes a just-built job's spec and order."""
        self.ctx = ctx
        self.job_id = job_id
        self.folder = ctx.layout.job(State.ACTIVE, job_id)
        self.work = self.folder / "work"
        if fresh is not None:
            self.spec, self.order = fresh
        else:
            self.spec = json.loads((self.folder / JOB_FILE).read_text())
        self.agent = Agent.from_json(self.spec["agent"])
        if fresh is None:
            self.order = self._load_order()
        self.abort = runner.Abort()
        self.recovering = recovering
        self.attempts: list[dict[str, Any]] = _read_attempts(self.folder) if fresh is None else []
        self.retries = 0
        self.waiting_retry = False

    def _load_order(self) -> Order:
        body = json.loads((self.work / "order.json").read_text()) if (self.work / "order.json").exists() else None
        if body is None:
            src = next(self.folder.glob("order.*"))
            body = dict(parse_order(src.read_bytes(), src.name).body)
            body.update(parent=self.spec["parent"], hops=self.spec["hops"])
        return validate_order(body)

    # -- the lifecycle ---------------------------------------------------------
    def run(self) -> str | None:
        """Drive the job to its end; return 'done' or 'failed', or None if stopped."""
        with structlog.contextvars.bound_contextvars(job_id=self.job_id, agent=self.agent.name):
            state = self._run()
        return None if state == STOPPED else state

    def fail_after_crash(self, exc: Exception) -> str:
        """Fail a job whose run raised (a bug): 'failed' if that worked, else 'crashed'."""
        try:
            checks = self._checks(Exit(lost=True)) if self.work.is_dir() else []
        except Exception:  # noqa: BLE001 - best effort: the reason is what matters here
            checks = []
        try:
            return self._finish("failed", oneline(f"crashed: {type(exc).__name__}: {exc}"), checks)
        except Exception:
            log.exception("job.crashed", step="fail")
            return "crashed"

    def _run(self) -> str | None:
        if (self.folder / "result.json").exists():
            result = json.loads((self.folder / "result.json").read_text())
            return self._place(result)
        if self.recovering:
            verdict_ = self._recover()
            if verdict_ is not None:
                return verdict_
        while True:
            if self.abort.reason == STOPPED or self.ctx.stopping():
                return None  # no new attempt once a stop began: recovered at the next start
            if self.abort.reason == CANCELLED or self.ctx.is_cancelled(self.job_id):
                return self._finish("failed", CANCELLED, [])
            n = self.attempts[-1]["n"] + 1 if self.attempts else 1
            if n > 1:
                self._stash(n - 1)
            if not self.work.is_dir():
                checks = self._checks(Exit(lost=True))
                return self._finish("failed", verdict(checks, exit_lost=True) or "writes_scope: work/ is gone", checks)
            outcome = self._attempt(n)
            if isinstance(outcome, str):
                return outcome
            decision = self._decide(n, outcome)
            if decision is not None:
                return decision

    def _recover(self) -> str | None:
        """Pick up a job whose daemon died: end its agent, then let the evidence decide."""
        log.info("job.recovered", attempts=len(self.attempts))
        last_dir = self._last_attempt_dir()
        if last_dir is None:
            return None
        end_leftover(last_dir, self.work, self.ctx.config().kill_grace_s)
        if any(last_dir.glob("result*.json")):
            return None  # reopened by `dispatcher retry`: its earlier result is kept; go on with a new attempt
        n = int(last_dir.name)
        record = _read_json(last_dir / "attempt.json")
        if record is None or record.get("interrupted") or record.get("aborted") == STOPPED:
            if record is None:
                record = self._interrupted_record(n, last_dir)
                self.attempts.append(record)
                _write(last_dir / "attempt.json", record)
            if record.get("next") == "retry":
                return None
            if os.path.lexists(self.work / "receipt.json"):
                return self._evaluate(n, Exit(lost=True), final=True)
            checks = self._checks(Exit(lost=True))
            reason = verdict(checks, exit_lost=True) or "receipt_present: no receipt.json"
            return self._retry_or_fail(n, f"{reason}; attempt {n} was interrupted by a stop or crash", checks)
        if record.get("next") == "retry":
            return None
        exit_ = Exit(
            code=record.get("exit_code"),
            timed_out=record.get("timed_out", False),
            seconds=record.get("duration_ms", 0) / 1000,
            timeout_s=self.spec["timeout"],
        )
        return self._decide(n, exit_)

    def _last_attempt_dir(self) -> Path | None:
        folder = self.folder / "attempts"
        dirs = [p for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
        return max(dirs, key=lambda p: int(p.name)) if dirs else None

    def _interrupted_record(self, n: int, folder: Path) -> dict[str, Any]:
        pid = _read_json(folder / "pid") or {}
        started = pid.get("started", time.time())
        return {
            "n": n,
            "started": iso(started),
            "ended": iso(time.time()),
            "exit_code": None,
            "timed_out": False,
            "duration_ms": round((time.time() - started) * 1000),
            "interrupted": True,
        }

    # -- one attempt -----------------------------------------------------------
    def _attempt(self, n: int) -> Exit | str:
        """Run attempt n; return its Exit, or the final state / STOPPED when it never ran."""
        cfg = self.ctx.config()
        values = self._argv_values(n)
        argv = [runner.render(a, values) for a in self.agent.command]
        env = self._env(n)
        folder = self.folder / "attempts" / str(n)
        try:
            os.mkdir(folder)
        except FileNotFoundError:  # a job from before attempts/ was made at claim time
            folder.mkdir(parents=True)
        except FileExistsError:  # an attempt interrupted before its agent started
            pass

        def on_start(pid: int) -> None:
            # the start time guards against a reused pid when a successor ends this agent
            info = {"pid": pid, "started": time.time()}
            (folder / "pid").write_bytes(json.dumps(info).encode())
            log.info("agent.started", attempt=n, pid=pid)

        try:
            out = runner.run(
                argv,
                cwd=self.work,
                env=env,
                timeout_s=self.spec["timeout"],
                kill_grace_s=cfg.kill_grace_s,
                log_dir=folder,
                max_log_bytes=cfg.max_log_bytes,
                abort=self.abort,
                on_start=on_start,
            )
        except OSError as exc:
            for name in ("stdout.log", "stderr.log", "pid"):
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
            why = exc.strerror or str(exc)
            detail = f"{why}: {exc.filename!r}" if exc.filename else why
            reason = f"config: agent {self.agent.name} cannot start: {detail}"
            log.error("agent.exited", error=reason)
            return self._finish("failed", reason, [])
        record: dict[str, Any] = {
            "n": n,
            "started": iso(out.started),
            "ended": iso(out.ended),
            "exit_code": out.exit_code,
            "timed_out": out.timed_out,
            "duration_ms": out.duration_ms,
        }
        if out.agent_result is not None:
            record["agent_result"] = out.agent_result
        if out.aborted:
            record["aborted"] = out.aborted
        self.attempts.append(record)
        _write(folder / "attempt.json", record)
        log.info(
            "agent.exited",
            attempt=n,
            exit_code=out.exit_code,
            timed_out=out.timed_out,
            duration_ms=out.duration_ms,
            stdout_cut=out.stdout_cut or None,
        )
        if out.aborted == STOPPED:
            return STOPPED
        if out.aborted == CANCELLED:
            return self._finish("failed", CANCELLED, [])
        return Exit(
            code=out.exit_code,
            timed_out=out.timed_out,
            seconds=out.duration_ms / 1000,
            timeout_s=self.spec["timeout"],
        )

    def _argv_values(self, n: int) -> dict[str, str]:
        values = {
            "job_id": self.job_id,
            "order": str(self.work / "order.json"),
            "workspace": str(self.work),
            "receipt": str(self.work / "receipt.json"),
            "prompt": "",
            "prompt_file": "",
        }
        prompt = self.work / "prompt.md"
        if prompt.exists():
            values["prompt"] = prompt.read_text()
            values["prompt_file"] = str(prompt)
        return values

    def _env(self, n: int) -> dict[str, str]:
        return runner.build_env(
            self.agent.env,
            {
                "DISPATCH_JOB_ID": self.job_id,
                "DISPATCH_ORDER": str(self.work / "order.json"),
                "DISPATCH_WORKSPACE": str(self.work),
                "DISPATCH_RECEIPT": str(self.work / "receipt.json"),
                "DISPATCH_ATTEMPT": str(n),
            },
        )

    # -- deciding --------------------------------------------------------------
    def _decide(self, n: int, exit_: Exit) -> str | None:
        """Check attempt n; finish the job, or return None to run attempt n + 1."""
        receipt_missing = not os.path.lexists(self.work / "receipt.json")
        unclear = exit_.timed_out or (exit_.code not in (0, None)) or receipt_missing
        if unclear:
            checks = self._checks(exit_)
            reason = verdict(checks) or "receipt_present: no receipt.json"
            if _receipt_invalid(checks):
                return self._finish("failed", reason, checks)
            return self._retry_or_fail(n, reason, checks)
        return self._evaluate(n, exit_, final=False)

    def _evaluate(self, n: int, exit_: Exit, *, final: bool) -> str | None:
        checks = self._checks(exit_)
        reason = verdict(checks, exit_lost=exit_.lost)
        if reason is None:
            return self._finish_done(checks)
        if not final and self.agent.repair and self._may_run_again(n) and not _receipt_invalid(checks):
            safe, _why = self._safe_to_retry()
            if safe:
                self._write_feedback(checks)
                return self._schedule_retry(n, reason)
        return self._finish("failed", reason, checks)

    def _may_run_again(self, n: int) -> bool:
        return n < int(self.spec["budget"])

    def _retry_or_fail(self, n: int, reason: str, checks: list[CheckResult] | None = None) -> str | None:
        if checks is None:
            checks = self._checks(Exit(lost=True))
        if not self._may_run_again(n):
            return self._finish("failed", f"{reason}; not retried: no attempts left", checks)
        safe, why = self._safe_to_retry()
        if self.abort.reason == CANCELLED:
            return self._finish("failed", CANCELLED, checks)
        if self.abort.reason == STOPPED:
            return STOPPED
        if not safe:
            return self._finish("failed", f"{reason}; not retried: {why}", checks)
        return self._schedule_retry(n, reason)

    def _safe_to_retry(self) -> tuple[bool, str]:
        """Decide with the probe, else retry_safe; return (safe, why not)."""
        if self.agent.probe is not None:
            code = self._run_probe()
            if code is None:
                return False, "the probe could not run, so the work may have happened"
            if code == 0:
                return False, "the probe says the work may have happened"
            return True, ""
        if self.agent.retry_safe:
            return True, ""
        return False, f"agent {self.agent.name} is not retry_safe and has no probe"

    def _run_probe(self) -> int | None:
        n = self.attempts[-1]["n"] if self.attempts else 0
        folder = self.folder / "attempts" / str(n)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [runner.render(a, self._argv_values(n)) for a in self.agent.probe or ()]
        try:
            out = runner.run(
                argv,
                cwd=self.work if self.work.is_dir() else self.folder,
                env=self._env(n),
                timeout_s=self.spec["timeout"],
                kill_grace_s=self.ctx.config().kill_grace_s,
                log_dir=folder,
                log_prefix="probe-",
                max_log_bytes=self.ctx.config().max_log_bytes,
                abort=self.abort,
            )
        except OSError as exc:
            log.warning("probe.failed", error=str(exc))
            return None
        log.info("probe.exited", exit_code=out.exit_code, timed_out=out.timed_out)
        if out.timed_out or out.aborted or out.exit_code is None or out.exit_code < 0:
            return None
        return out.exit_code

    def _schedule_retry(self, n: int, reason: str) -> str | None:
        folder = self.folder / "attempts" / str(n)
        record = _read_json(folder / "attempt.json") or {"n": n}
        record["next"] = "retry"
        _write(folder / "attempt.json", record)
        self._stash(n)
        self.retries += 1
        delay = min(self.ctx.config().retry_delay_s * (2 ** (self.retries - 1)), MAX_RETRY_DELAY_S)
        log.info("job.retrying", attempt=n + 1, delay_s=delay, reason=reason)
        self.waiting_retry = True
        try:
            aborted = _wait(self.abort, delay)
        finally:
            self.waiting_retry = False
        if aborted:
            if self.abort.reason == STOPPED:
                return STOPPED
            return self._finish("failed", CANCELLED, [])
        return None

    def _stash(self, n: int) -> None:
        """Move attempt n's receipt.json and outbox/ into attempts/<n>/ (again after a crash: idempotent)."""
        folder = self.folder / "attempts" / str(n)
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("receipt.json", "outbox"):
            src = self.work / name
            if os.path.lexists(src):
                dst = folder / name
                k = 2
                while os.path.lexists(dst):
                    dst, k = folder / f"{name}.{k}", k + 1
                os.rename(src, dst)

    def _write_feedback(self, checks: list[CheckResult]) -> None:
        failed = [c.to_json() for c in checks if c.ok is False]
        data = fsutil.dump_json({"job_id": self.job_id, "attempt": self.attempts[-1]["n"], "failed_checks": failed})
        target = self.work / "feedback.json"
        if os.path.lexists(target) and not target.is_dir():
            target.unlink()  # never write through a link the agent left there
        fsutil.write_new(target, data)
        given = dict(self.spec["given"])
        given["feedback.json"] = digest(data)
        self.spec["given"] = given
        fsutil.write_atomic(self.folder / JOB_FILE, fsutil.dump_json(self.spec), sync=False)

    def _checks(self, exit_: Exit) -> list[CheckResult]:
        cfg = self.ctx.config()
        ledger = self.ctx.ledger

        def known(ids: list[str]) -> frozenset[str]:
            found = ledger.known(ids)
            return frozenset(
                i for i, e in found.items() if e.parent != self.job_id or e.state not in ("reserved", "released")
            )

        ev, self._followups = gather(
            order=self.order,
            agent=self.agent.name,
            writes=tuple(self.spec["writes"]),
            exit=exit_,
            work=self.work,
            given=self.spec["given"],
            agents=cfg.agents,
            max_timeout_s=cfg.max_timeout_s,
            max_order_bytes=cfg.max_order_bytes,
            known=known,
            hops=int(self.spec["hops"]),
            max_hops=cfg.max_hops,
        )
        results = run_checks(ev)
        log.info(
            "job.verified",
            passed=sum(1 for c in results if c.ok),
            failed=[c.name for c in results if c.ok is False],
        )
        return results

    # -- finishing -------------------------------------------------------------
    def _finish_done(self, checks: list[CheckResult]) -> str:
        children = [(f.order.job_id, f.order.to, f.name) for f, _ in self._followups if f.order is not None]
        if children:
            taken = self.ctx.ledger.reserve(self.job_id, int(self.spec["hops"]) + 1, children)
            if taken:
                checks = [
                    c
                    if c.name != "followups_valid"
                    else CheckResult(c.name, False, f"job_id {', '.join(taken)} is already known")
                    for c in checks
                ]
                return self._finish("failed", verdict(checks) or "followups_valid", checks)
        return self._finish("done", None, checks, children=[c for c, _, _ in children])

    def _finish(
        self,
        state: str,
        reason: str | None,
        checks: list[CheckResult],
        children: list[str] | None = None,
    ) -> str:
        result = {
            "job_id": self.job_id,
            "state": state,
            "agent": self.agent.name,
            "reason": reason,
            "checks": [c.to_json() for c in checks],
            "attempts": [{k: v for k, v in a.items() if k != "next"} for a in self.attempts],
            "received": iso(float(self.spec["received"])),
            "finished": iso(time.time()),
            "parent": self.spec["parent"],
            "children": children if children is not None else self.ctx.ledger.children(self.job_id),
        }
        # the file is fsynced; its folder entry is made durable by the fsync of done/ or failed/
        # after the move below (one journal commit on ext4 and xfs)
        fsutil.write_atomic(self.folder / "result.json", fsutil.dump_json(result), sync_dir=False)
        return self._place(result)

    def _place(self, result: dict[str, Any]) -> str:
        """Move the finished job to done/ or failed/, record it, and release its follow-ups.

        The event is logged just before the move, so that whoever sees the folder in
        done/ or failed/ also finds its job.done or job.failed line.
        """
        state = result["state"]
        if state == "done":
            log.info("job.done", attempts=len(result["attempts"]), children=result["children"] or None)
        else:
            log.warning("job.failed", reason=result["reason"], attempts=len(result["attempts"]))
        fsutil.rename_noreplace(self.folder, self.ctx.layout.job(State(state), self.job_id))
        fsutil.fsync_dir(self.ctx.layout.folder(State(state)))
        # the ledger's final state is also in the folders, so this commit needs no fsync of its own
        self.ctx.ledger.finish(self.job_id, DONE if state == "done" else FAILED)
        if state == "done":
            release_followups(self.ctx.layout, self.ctx.ledger, self.ctx.owner, self.job_id, self.ctx.released)
        return str(state)


def _wait(abort: runner.Abort, delay: float) -> bool:
    """Sleep for delay unless aborted; return True if aborted."""
    if abort.reason is not None:
        return True
    ready = runner.wait_readable([abort.fileno()], delay)
    return bool(ready) or abort.reason is not None


def _receipt_invalid(checks: list[CheckResult]) -> bool:
    """A receipt that is present but unusable is never retried."""
    present = next(c for c in checks if c.name == "receipt_present")
    return present.ok is False and present.detail != "no receipt.json"


def _read_attempts(folder: Path) -> list[dict[str, Any]]:
    out = []
    attempts = folder / "attempts"
    if attempts.is_dir():
        for p in sorted((p for p in attempts.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
            rec = _read_json(p / "attempt.json")
            if rec is not None:
                out.append(rec)
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _write(path: Path, value: Any) -> None:
    """Write a bookkeeping file in place: a torn one reads as missing (the attempt as interrupted)."""
    path.write_bytes(fsutil.dump_json(value))
