"""In-process tests of ``job.job.Job``: one claimed job driven on an event loop with a real tiny agent."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from seam_fixtures import GOOD, Seam, open_seam, run, sh, until

from dispatcher.job.job import Job
from dispatcher.lifecycle import Outcome, Row, Stop


def job_of(s: Seam, job_id: str) -> Job:
    """Claim a new order for `worker` and return its Job (not started)."""
    started = s.started(job_id)
    return Job(s.ctx, started.folder, started.spec, started.order, started.token)


def test_an_agent_that_exits_0_with_a_good_receipt_ends_done(tmp_path: Path) -> None:
    """Exit 0 and a receipt that passes every check: the job returns DONE and lands in done/ with one attempt."""
    with open_seam(tmp_path) as s:
        outcome = run(job_of(s, "J1").run)
        result = s.result("done", "J1")
        row = s.ledger.get("J1")
    assert outcome is Outcome.DONE
    assert result["state"] == "done" and result["reason"] is None
    assert len(result["attempts"]) == 1 and result["attempts"][0]["exit_code"] == 0
    assert all(c["ok"] is not False for c in result["checks"])
    assert row is not None and row.state == Row.DONE
    assert os.listdir(s.layout.root / "active") == []


def test_a_retry_safe_agent_that_exits_1_is_run_again_and_can_end_done(tmp_path: Path) -> None:
    """A retry_safe agent failing attempt 1 gets attempt 2 (after retry_delay); its good receipt ends the job done."""
    script = f'[ "$DISPATCH_ATTEMPT" = 1 ] && exit 1; {GOOD}'
    with open_seam(tmp_path, {"worker": sh(script, retry_safe=True, max_attempts=2)}) as s:
        outcome = run(job_of(s, "J1").run)
        result = s.result("done", "J1")
    assert outcome is Outcome.DONE
    assert [a["exit_code"] for a in result["attempts"]] == [1, 0]


def test_an_agent_that_is_not_retry_safe_fails_on_exit_1_with_the_reason(tmp_path: Path) -> None:
    """Exit 1 of an agent that is neither retry_safe nor probed fails the job at once, saying why."""
    with open_seam(tmp_path, {"worker": sh("exit 1", max_attempts=3)}) as s:
        outcome = run(job_of(s, "J1").run)
        result = s.result("failed", "J1")
    assert outcome is Outcome.FAILED
    assert "not retried: agent worker is not retry_safe and has no probe" in result["reason"]
    assert len(result["attempts"]) == 1


def test_the_last_attempt_of_a_retry_safe_agent_fails_with_no_attempts_left(tmp_path: Path) -> None:
    """A retry_safe agent that fails every attempt ends failed after max_attempts, with no attempts left."""
    with open_seam(tmp_path, {"worker": sh("exit 3", retry_safe=True, max_attempts=2)}) as s:
        outcome = run(job_of(s, "J1").run)
        result = s.result("failed", "J1")
    assert outcome is Outcome.FAILED
    assert result["reason"].endswith("not retried: no attempts left")
    assert [a["exit_code"] for a in result["attempts"]] == [3, 3]


def test_a_cancel_through_control_ends_the_running_agent_and_fails_the_job_cancelled(tmp_path: Path) -> None:
    """Control.abort(CANCELLED) while the agent runs: the agent is ended and the job lands in failed/ as cancelled."""
    script = 'touch "$DISPATCH_WORKSPACE/started"; exec sleep 30'
    with open_seam(tmp_path, {"worker": sh(script, writes=["started"])}) as s:
        job = job_of(s, "J1")

        async def body() -> Outcome:
            task = asyncio.create_task(job.run())
            await until(lambda: (job.folder.work / "started").exists(), "the agent to start")
            job.control.abort(Stop.CANCELLED)
            return await task

        outcome = run(body)
        result = s.result("failed", "J1")
    assert outcome is Outcome.FAILED
    assert result["reason"] == "cancelled"
    assert len(result["attempts"]) == 1


def test_a_cancel_that_comes_right_after_the_agents_exit_fails_the_job_cancelled(tmp_path: Path) -> None:
    """A cancel the daemon takes between the agent's exit 0 (with a good receipt) and the job's finish: `cancel`
    said it was requested, so the job ends failed as cancelled, its attempt recorded, never done."""
    with open_seam(tmp_path) as s:
        job = job_of(s, "J1")

        def exited(ok: bool) -> bool:  # called on the loop at the agent's exit, before the post-exit trip
            job.control.abort(Stop.CANCELLED)
            return False

        job.on_exit = exited
        outcome = run(job.run)
        result = s.result("failed", "J1")
        row = s.ledger.get("J1")
    assert outcome is Outcome.FAILED
    assert result["reason"] == "cancelled"
    assert [a["exit_code"] for a in result["attempts"]] == [0]
    assert row is not None and row.state == Row.FAILED
    assert not (s.layout.root / "done" / "J1").exists()


def test_a_cancel_before_the_first_attempt_fails_the_job_without_starting_its_agent(tmp_path: Path) -> None:
    """A job whose Control was aborted before it ran ends failed, cancelled, with no attempt."""
    with open_seam(tmp_path) as s:
        job = job_of(s, "J1")
        job.control.abort(Stop.CANCELLED)
        outcome = run(job.run)
        result = s.result("failed", "J1")
    assert outcome is Outcome.FAILED
    assert result["reason"] == "cancelled" and result["attempts"] == []


def test_a_job_started_while_the_daemon_stops_is_left_in_active(tmp_path: Path) -> None:
    """While the daemon stops, a job runs no new attempt: it returns LEFT and stays in active/ for the next start."""
    with open_seam(tmp_path) as s:
        job = job_of(s, "J1")
        s.stopping = True
        outcome = run(job.run)
        row = s.ledger.get("J1")
    assert outcome is Outcome.LEFT
    assert os.listdir(s.layout.root / "active") == ["J1"]
    assert row is not None and row.state == Row.CLAIMED


def test_an_agent_that_cannot_start_fails_the_job_with_a_config_reason(tmp_path: Path) -> None:
    """An agent command that does not exist fails the job at once, naming the agent and the missing program."""
    missing = str(tmp_path / "no-such-agent")
    with open_seam(tmp_path, {"worker": {"command": [missing], "timeout": 20}}) as s:
        outcome = run(job_of(s, "J1").run)
        result = s.result("failed", "J1")
    assert outcome is Outcome.FAILED
    assert result["reason"].startswith("config: agent worker cannot start:")
    assert result["attempts"] == []
