"""Retries (backoff, probe, attempts folders), `dispatcher retry` and `dispatcher cancel`."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, Env, order, wait_until
from helpers_faults import (
    agent_starts,
    alive,
    env_daemon,
    first_failing,
    processes_with,
    run_once_killed_at,
    ts,
    wait_gone,
    wait_start,
)
from seam_fixtures import GOOD, sh
from seam_fixtures import order as seam_order

from dispatcher.errors import WrongState
from dispatcher.layout import Layout
from dispatcher.ledger.base import Request
from dispatcher.ops.actions import Operator
from dispatcher.spec.config import load_config


def starts_of(env: Env, job_id: str) -> list[int]:
    return [a for j, a, _p in agent_starts(env) if j == job_id]


def probe(env: Env, exit_code: int) -> list[str]:
    """Return a probe argv that records its call outside the root and exits exit_code."""
    script = f"import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); sys.exit({exit_code})"
    return [sys.executable, "-c", script, str(env.tmp / "probe-calls.txt"), "{job_id}"]


def probe_calls(env: Env) -> list[str]:
    path = env.tmp / "probe-calls.txt"
    return path.read_text().split() if path.exists() else []


def run_once(env: Env) -> tuple[int, str]:
    proc = env.cli("run", "--once", timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def failing_three_times(env: Env, job_id: str, retry_delay: float) -> Daemon:
    """Start a daemon whose retry-safe agent fails its first 3 attempts (of 4), and drop job_id for it."""
    env.configure(
        agents={"worker": env.agent("--fail-attempts", "3", retry_safe=True, max_attempts=4)},
        retry_delay=retry_delay,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order(job_id))
    return d


def test_retries_wait_retry_delay_doubling_and_number_attempts(env: Env) -> None:
    """A retry-safe agent failing 3 times is retried with 0.3, 0.6, 1.2 s waits, attempts 1..4."""
    d = failing_three_times(env, "RETRY-1", 0.3)
    result = env.wait_job("RETRY-1", "done")
    attempts = result["attempts"]
    assert [a["n"] for a in attempts] == [1, 2, 3, 4]
    assert [a["exit_code"] for a in attempts] == [1, 1, 1, 0]
    assert starts_of(env, "RETRY-1") == [1, 2, 3, 4]
    gaps = [ts(b["started"]) - ts(a["ended"]) for a, b in itertools.pairwise(attempts)]
    for gap, want in zip(gaps, [0.3, 0.6, 1.2], strict=True):
        assert want - 0.05 <= gap <= want + 2.0, f"waits {gaps}, want 0.3, 0.6, 1.2"
    retrying = [e for e in d.events() if e.get("event") == "job.retrying"]
    assert len(retrying) == 3
    assert all(e.get("job_id") == "RETRY-1" for e in retrying)
    for n in (1, 2, 3):
        assert (env.root / "done" / "RETRY-1" / "attempts" / str(n) / "stdout.log").exists()
    assert d.stop() == 0


def test_the_retry_wait_goes_on_doubling_after_the_daemon_is_started_again(env: Env) -> None:
    """Stopped during its first retry wait and started again, the job waits 2 and 4 x retry_delay, not 1 x again."""
    d = failing_three_times(env, "RETRY-R", 1)
    wait_until(lambda: any(e.get("event") == "job.retrying" for e in d.events()), 60, "the first retry wait")
    assert d.stop() == 0  # the wait is cut; attempt 2 runs at the next start
    d2 = env.daemon()
    d2.wait_ready()
    env.wait_job("RETRY-R", "done")
    delays = [e["delay_s"] for e in d.events() + d2.events() if e.get("event") == "job.retrying"]
    assert delays == [1, 2, 4], f"retry waits {delays}: the back-off started over after the restart"
    assert d2.stop() == 0


def test_receipt_and_outbox_of_previous_attempt_move_to_attempts_folder(env: Env) -> None:
    """Before attempt 2, attempt 1's receipt.json and outbox/ move into attempts/1/."""
    follow = json.dumps(order("RETRY-FU-1", to="sink", **{"from": "worker"}))
    worker = env.agent("--fail-attempts", "1", "--followup", follow, retry_safe=True, max_attempts=2)
    env.configure(agents={"worker": worker, "sink": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RETRY-2"))
    result = env.wait_job("RETRY-2", "done")
    job = env.root / "done" / "RETRY-2"
    assert (job / "attempts" / "1" / "receipt.json").is_file()
    assert (job / "attempts" / "1" / "outbox" / "RETRY-FU-1.json").is_file()
    assert (job / "work" / "receipt.json").is_file()
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    env.wait_job("RETRY-FU-1", "done")
    assert env.result("RETRY-2", "done")["children"] == ["RETRY-FU-1"]
    assert starts_of(env, "RETRY-FU-1") == [1], "the follow-up was released twice"
    assert d.stop() == 0


@pytest.mark.parametrize(
    ("probe_exit", "retried"),
    [(1, True), (0, False), (None, False)],
    ids=["probe-says-not-done", "probe-says-done", "probe-cannot-run"],
)
def test_probe_decides_the_retry(env: Env, probe_exit: int | None, retried: bool) -> None:
    """Probe exit non-zero: retry; exit 0 or a probe that cannot run: no retry, reason says so."""
    argv = probe(env, probe_exit) if probe_exit is not None else ["/nonexistent/probe-program"]
    worker = env.agent("--fail-attempts", "1", probe=argv, max_attempts=2)
    env.configure(agents={"worker": worker})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PROBE-1"))
    if retried:
        env.wait_job("PROBE-1", "done")
        assert starts_of(env, "PROBE-1") == [1, 2]
        assert probe_calls(env) == ["PROBE-1"]
    else:
        result = env.wait_job("PROBE-1", "failed")
        assert starts_of(env, "PROBE-1") == [1]
        assert result["reason"].startswith("exit_ok")
        reason = result["reason"].lower()
        assert "probe" in reason or "may have" in reason, result["reason"]
        if probe_exit == 0:
            assert probe_calls(env) == ["PROBE-1"]
    assert d.stop() == 0


@pytest.mark.parametrize(
    ("flags", "settings", "check_name", "n_starts"),
    [
        (["--exit", "1"], {"max_attempts": 3}, "exit_ok", 1),
        (["--no-receipt"], {"max_attempts": 3}, "receipt_present", 1),
        (["--invalid-receipt"], {"max_attempts": 3, "retry_safe": True}, "receipt_present", 1),
        (["--no-receipt"], {"max_attempts": 2, "retry_safe": True}, "receipt_present", 2),
    ],
    ids=[
        "not-retry-safe-exit",
        "not-retry-safe-no-receipt",
        "invalid-receipt",
        "retry-safe-missing",
    ],
)
def test_failures_that_are_not_retried(
    env: Env, flags: list[str], settings: dict[str, Any], check_name: str, n_starts: int
) -> None:
    """Without probe only retry-safe agents rerun; an invalid receipt never reruns."""
    env.configure(agents={"worker": env.agent(*flags, **settings)})
    env.drop(order("NR-1"))
    code, out = run_once(env)
    assert code == 1, out
    result = env.result("NR-1", "failed")
    assert starts_of(env, "NR-1") == list(range(1, n_starts + 1))
    assert first_failing(result) == check_name
    assert result["reason"].startswith(check_name)
    if check_name == "exit_ok" or not settings.get("retry_safe"):
        assert "retr" in result["reason"].lower(), result["reason"]


def test_retry_command_reruns_a_failed_job_with_attempts_numbered_on(env: Env) -> None:
    """`retry` of a failed job exits 0 and gives max_attempts more attempts (3, 4), history kept."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "3", retry_safe=True, max_attempts=2)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("AGAIN-1"))
    first = env.wait_job("AGAIN-1", "failed")
    assert [a["n"] for a in first["attempts"]] == [1, 2]
    proc = env.cli("retry", "AGAIN-1")
    assert proc.returncode == 0, proc.stderr
    result = env.wait_job("AGAIN-1", "done", after=first)
    job = env.root / "done" / "AGAIN-1"
    kept = json.loads((job / "attempts" / "2" / "result.json").read_text())
    assert kept["state"] == "failed"
    assert kept["reason"] == first["reason"]
    assert [a["n"] for a in result["attempts"]][-2:] == [3, 4]
    assert starts_of(env, "AGAIN-1") == [1, 2, 3, 4]
    assert not (env.root / "failed" / "AGAIN-1").exists()
    assert d.stop() == 0


def test_retry_recorded_while_no_daemon_runs_is_done_at_next_start(env: Env) -> None:
    """`retry` with no daemon running is carried out by the next `run --once`."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "1")})
    env.drop(order("AGAIN-2"))
    code, _ = run_once(env)
    assert code == 1
    assert env.result("AGAIN-2", "failed")["state"] == "failed"
    assert env.cli("retry", "AGAIN-2").returncode == 0
    code, out = run_once(env)
    assert code == 0, out
    result = env.result("AGAIN-2", "done")
    assert [a["n"] for a in result["attempts"]][-1] == 2
    assert (env.root / "done" / "AGAIN-2" / "attempts" / "1" / "result.json").is_file()
    assert starts_of(env, "AGAIN-2") == [1, 2]


def test_a_retry_whose_daemon_died_before_clearing_its_request_is_carried_out_once(env: Env) -> None:
    """kill -9 of the daemon after a retry moved the job into active/ and before it cleared the request: the next
    daemon recovers the job and runs the retry's attempt once; the request is not taken a second time when the
    job fails again (one `retry`, one more attempt: it ran attempts 2 and 3)."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "5")})
    env.drop(order("AGAIN-5"))
    assert run_once(env)[0] == 1
    assert env.cli("retry", "AGAIN-5").returncode == 0
    run_once_killed_at(env, "retry.moved")
    assert (env.root / "active" / "AGAIN-5").is_dir()
    code, out = run_once(env)
    assert code == 1, out
    result = env.result("AGAIN-5", "failed")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert starts_of(env, "AGAIN-5") == [1, 2]
    assert run_once(env)[0] == 0  # the next start finds nothing to do: the request is not taken again
    assert starts_of(env, "AGAIN-5") == [1, 2]
    assert [a["n"] for a in env.result("AGAIN-5", "failed")["attempts"]] == [1, 2]


@pytest.mark.parametrize("command", ["retry", "revise"])
def test_cancel_withdraws_a_request_a_dead_daemon_was_carrying_out(env: Env, command: str) -> None:
    """The daemon carrying out a retry (or revise) is killed right after it claimed the job, its folder still in
    failed/: `cancel` withdraws the request as for any failed job queued to run again, and the next start leaves the
    job failed as it was (the cancel was only recorded, and the retry ran)."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    env.drop(order("AGAIN-6"))
    assert run_once(env)[0] == 1
    crashing = env_daemon(env, {"DISPATCHER_FAULT": f"{command}.claimed"})
    crashing.wait_ready()
    env.cli(command, "AGAIN-6", *(["--note", "again"] if command == "revise" else []), check=True)
    assert crashing.wait(60) == -9
    what = "retry" if command == "retry" else "revision"
    proc = env.cli("cancel", "AGAIN-6")
    assert (proc.returncode, proc.stdout) == (0, f"AGAIN-6: {what} withdrawn; it stays failed\n"), proc.stderr
    # it is a failed job with no request now, before any daemon started: as such it is answered
    again = env.cli("cancel", "AGAIN-6")
    assert (again.returncode, again.stderr) == (
        1,
        "AGAIN-6: is failed, only a queued or running job can be cancelled\n",
    )
    assert run_once(env)[0] == 0
    assert starts_of(env, "AGAIN-6") == [1]
    result = env.result("AGAIN-6", "failed")
    assert [a["n"] for a in result["attempts"]] == [1] and result["reason"].startswith("exit_ok: exit 1 in ")


def test_retry_of_a_failed_job_whose_withdrawn_retry_a_dead_daemon_had_claimed_is_recorded(env: Env) -> None:
    """A daemon died carrying out a retry (its row claimed, the folder still in failed/) and `cancel` withdrew it:
    with no daemon started since, a new `retry` is recorded and runs (it was refused: its ledger row is claimed)."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    env.drop(order("AGAIN-7"))
    assert run_once(env)[0] == 1
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "retry.claimed"})
    crashing.wait_ready()
    env.cli("retry", "AGAIN-7", check=True)
    assert crashing.wait(60) == -9
    env.cli("cancel", "AGAIN-7", check=True)
    proc = env.cli("retry", "AGAIN-7")
    assert (proc.returncode, proc.stdout) == (0, "AGAIN-7: retry requested\n"), proc.stderr
    assert run_once(env)[0] == 1
    assert starts_of(env, "AGAIN-7") == [1, 2]


def test_cancel_after_a_retry_withdraws_the_retry_and_the_job_stays_failed(env: Env) -> None:
    """A failed job queued to run again by `retry` is queued: `cancel` takes the retry back (exit 0)."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "1")})
    env.drop(order("AGAIN-3"))
    assert run_once(env)[0] == 1
    before = env.result("AGAIN-3", "failed")
    assert env.cli("retry", "AGAIN-3").returncode == 0
    proc = env.cli("cancel", "AGAIN-3")
    assert (proc.returncode, proc.stdout.strip()) == (0, "AGAIN-3: retry withdrawn; it stays failed"), proc
    assert run_once(env)[0] == 0  # nothing to do
    assert env.result("AGAIN-3", "failed") == before
    assert starts_of(env, "AGAIN-3") == [1]
    proc = env.cli("cancel", "AGAIN-3")  # failed, nothing queued: as for any finished job
    assert proc.returncode == 1 and "only a queued or running job can be cancelled" in proc.stderr, proc


def test_retry_of_done_or_unknown_job_exits_1(env: Env) -> None:
    """`retry` of a done job or an unknown id exits 1 with a one-line error."""
    env.drop(order("FINE-1"))
    code, out = run_once(env)
    assert code == 0, out
    for job_id in ("FINE-1", "NO-SUCH-JOB"):
        proc = env.cli("retry", job_id)
        assert proc.returncode == 1, (job_id, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (env.root / "done" / "FINE-1" / "result.json").exists()


def slow_and_worker(env: Env) -> None:
    """Configure one slot, a `slow` agent (60 s, with a child) and the normal `worker`."""
    env.configure(
        agents={
            "slow": env.agent("--sleep", "60", "--fork-child", "65.5"),
            "worker": env.agent(),
        },
        max_jobs=1,
        kill_grace=1,
    )


CONTRACT_CHECKS = [
    "exit_ok", "receipt_present", "receipt_job_id", "receipt_status", "receipt_inputs", "output_rows",
    "receipt_outputs", "allowed_values", "writes_scope", "followups_valid",
]  # fmt: skip


def assert_not_run(result: dict[str, Any]) -> None:
    """Every check of section 5 is recorded by name, in order, as null "not run" (no attempt was checked)."""
    assert [c["name"] for c in result["checks"]] == CONTRACT_CHECKS
    assert all(c["ok"] is None and c["detail"].startswith("not run") for c in result["checks"]), result["checks"]


def test_cancel_queued_job_with_no_free_slot(env: Env) -> None:
    """cancel of a queued job while the only slot is busy: failed `cancelled` within seconds."""
    slow_and_worker(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LONG-1", to="slow"))
    pid = wait_start(env, "LONG-1")
    env.drop(order("QUEUED-1"))
    sent = time.monotonic()
    proc = env.cli("cancel", "QUEUED-1")
    assert proc.returncode == 0, proc.stderr
    result = env.wait_job("QUEUED-1", "failed", timeout=15)
    assert time.monotonic() - sent < 10
    assert result["reason"] == "cancelled"
    assert result["attempts"] == []
    assert_not_run(result)
    assert starts_of(env, "QUEUED-1") == []
    assert alive(pid), "cancelling the queued job touched the running one"


def test_cancel_running_job_ends_its_group_and_finished_or_unknown_exit_1(env: Env) -> None:
    """cancel of a running job ends its agent's group; cancel of a finished or unknown job exits 1."""
    slow_and_worker(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LONG-1", to="slow"))
    pid = wait_start(env, "LONG-1")
    child = wait_until(lambda: processes_with("time.sleep(65.5)"), 10, "the agent's child")
    assert env.cli("cancel", "LONG-1").returncode == 0
    result = env.wait_job("LONG-1", "failed", timeout=15)
    assert result["reason"] == "cancelled"
    # the attempt ran, so every check ran on it and is recorded (section 5), none "not run"
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["exit_ok"]["ok"] is False and checks["exit_ok"]["detail"].startswith("cancelled after "), checks
    assert checks["receipt_present"]["ok"] is False, checks["receipt_present"]
    assert not [c for c in result["checks"] if c["detail"].startswith("not run")], result["checks"]
    wait_gone([pid, *child], [pid], timeout=5)

    assert env.cli("cancel", "LONG-1").returncode == 1, "a finished job was cancelled twice"
    env.drop(order("DONE-1"))
    env.wait_job("DONE-1", "done")
    for job_id in ("DONE-1", "NO-SUCH-JOB"):
        proc = env.cli("cancel", job_id)
        assert proc.returncode == 1, (job_id, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (env.root / "done" / "DONE-1" / "result.json").exists()
    assert d.stop() == 0


def cancelled_while_no_daemon_runs(env: Env, job_id: str) -> dict[str, Any]:
    """`cancel` with no daemon running exits 0; the next `run --once` fails the job as cancelled (exit 1)."""
    proc = env.cli("cancel", job_id)
    assert proc.returncode == 0, proc.stderr
    code, _ = run_once(env)
    assert code == 1
    result = env.result(job_id, "failed")
    assert result["reason"] == "cancelled"
    return result


def test_cancel_of_an_order_waiting_in_inbox_with_no_daemon(env: Env) -> None:
    """A job is queued once its order is in inbox/: cancel works before any daemon sees it."""
    env.drop(order("INBOX-1"))
    result = cancelled_while_no_daemon_runs(env, "INBOX-1")
    assert result["attempts"] == []
    assert starts_of(env, "INBOX-1") == []


def test_an_order_whose_prompt_makes_the_command_line_too_long_says_so_and_what_to_pass_instead(env: Env) -> None:
    """An agent given its prompt as an argument (`claude -p "{prompt}"`) and an order of 1,500 long items (195 KB,
    valid): the start fails E2BIG, as a config error with no attempt (section 6), and the reason says that this
    order's command line is too long and to pass {prompt_file}. It said only "Argument list too long"."""
    agent = {"command": ["sh", "-c", "exit 0", "{prompt}"], "prompt": "Do these items: {items_json}", "timeout": 30}
    env.configure(agents={"worker": agent})
    body = order("LONG-1") | {"items": [{"id": f"R{i:06d}", "text": "x" * 100} for i in range(1500)]}
    env.drop(body)
    assert env.cli("run", "--once", timeout=60).returncode == 1
    result = env.result("LONG-1", "failed")
    assert result["reason"].startswith("config: agent worker cannot start: Argument list too long: "), result
    assert "(this order makes its command line 19" in result["reason"], result["reason"]
    assert "give it {prompt_file}, not {prompt}" in result["reason"], result["reason"]
    assert result["attempts"] == []


@pytest.mark.parametrize("how", ["missing", "not-executable"])
def test_agent_that_cannot_start_fails_as_config_error_without_attempt(env: Env, how: str) -> None:
    """An agent that cannot start fails `config: agent NAME cannot start: ...` with no attempt."""
    program = Path("/nonexistent/agent-program")
    if how == "not-executable":
        program = env.tmp / "agent-not-executable"
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o644)
    env.configure(agents={"broken": {"command": [str(program)], "timeout": 30}, "worker": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BROKEN-1", to="broken"))
    result = env.wait_job("BROKEN-1", "failed")
    assert result["reason"].startswith("config: agent broken cannot start: "), result["reason"]
    assert result["attempts"] == []
    assert_not_run(result)
    [exited] = [e for e in d.events() if e.get("event") == "agent.exited" and e.get("job_id") == "BROKEN-1"]
    assert exited["level"] == "error" and "attempt" not in exited, exited  # not an attempt
    env.drop(order("AFTER-1"))
    env.wait_job("AFTER-1", "done")
    assert d.stop() == 0


def test_an_agent_that_cannot_start_on_a_retry_does_not_deny_the_attempt_that_ran(env: Env) -> None:
    """Attempt 1 runs (and deletes its own program), attempt 2 cannot start: the job fails as a config error, and
    each check says attempt 2 ran no agent, not "the job ended before any attempt was checked" (attempt 1 was);
    as when a before hook fails, no false check of attempt 1 stands beside a reason that names none."""
    program = env.tmp / "self-deleting-agent"
    program.write_text('#!/bin/sh\nrm -f "$0"\nexit 1\n')
    program.chmod(0o755)
    env.configure(
        agents={"selfdel": {"command": [str(program)], "timeout": 30, "retry_safe": True, "max_attempts": 3}},
        retry_delay=0.2,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SELFDEL-1", to="selfdel"))
    result = env.wait_job("SELFDEL-1", "failed")
    assert result["reason"].startswith("config: agent selfdel cannot start: "), result["reason"]
    assert [a["n"] for a in result["attempts"]] == [1] and result["attempts"][0]["exit_code"] == 1
    assert [c["name"] for c in result["checks"]] == CONTRACT_CHECKS
    assert {(c["ok"], c["detail"]) for c in result["checks"]} == {
        (None, "not run: attempt 2 ran no agent: it could not start")
    }
    # `dispatcher retry`: attempt 2 (numbered on) cannot start either; attempt 1's result is kept
    assert env.cli("retry", "SELFDEL-1").returncode == 0
    wait_until(lambda: (env.root / "failed" / "SELFDEL-1" / "attempts" / "1" / "result.json").exists(), timeout=30)
    again = env.wait_job("SELFDEL-1", "failed")
    assert again["reason"].startswith("config: agent selfdel cannot start: "), again["reason"]
    assert {c["detail"] for c in again["checks"]} == {"not run: attempt 2 ran no agent: it could not start"}
    assert d.stop() == 0


def test_cancel_cuts_a_retry_wait(env: Env) -> None:
    """cancel of a job waiting 30 s for its retry fails it `cancelled` within seconds."""
    env.configure(
        agents={"worker": env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=2)},
        retry_delay=30,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PAUSE-2"))
    d.wait_event("job.retrying", job_id="PAUSE-2")
    sent = time.monotonic()
    assert env.cli("cancel", "PAUSE-2").returncode == 0
    result = env.wait_job("PAUSE-2", "failed", timeout=20)
    assert time.monotonic() - sent < 10
    assert result["reason"] == "cancelled"
    assert starts_of(env, "PAUSE-2") == [1]
    checks = {c["name"]: c for c in result["checks"]}  # attempt 1's checks, as they ran: not "not run"
    assert checks["exit_ok"]["ok"] is False and checks["receipt_present"]["ok"] is not None, checks
    assert not [c for c in result["checks"] if "not run" in (c["detail"] or "")], result["checks"]
    assert d.stop() == 0


def test_cancel_of_an_order_removed_before_any_daemon_does_not_outlive_it(env: Env) -> None:
    """A cancel whose order was removed from inbox/ is dropped; a later order with that id runs."""
    dropped = env.drop(order("GONE-1"))
    assert env.cli("cancel", "GONE-1").returncode == 0
    dropped.unlink()
    code, _ = run_once(env)
    assert code == 0
    assert not (env.root / "failed" / "GONE-1").exists()
    env.drop(order("GONE-1"))
    code, _ = run_once(env)
    assert code == 0, "the order that reuses the id must not be cancelled by the old request"
    assert env.result("GONE-1", "done")["reason"] is None
    assert starts_of(env, "GONE-1") == [1]


def test_a_cancel_whose_order_was_removed_does_not_fail_the_next_submit_of_its_id(env: Env) -> None:
    """No daemon runs between: cancel of a queued order, the file removed by hand, then `submit` of a new order
    with that id (accepted: the id is unknown). The new order runs; the old request does not cancel it."""
    dropped = env.drop(order("GONE-2"))
    assert env.cli("cancel", "GONE-2").returncode == 0
    dropped.unlink()
    assert env.cli("cancel", "GONE-2").returncode == 1  # no such job now
    path = env.tmp / "GONE-2.json"
    path.write_text(json.dumps(order("GONE-2")))
    assert env.cli("submit", str(path), check=True).stdout == "GONE-2\n"
    code, _ = run_once(env)
    assert code == 0, "the submitted order was cancelled by the request of the removed one"
    assert env.result("GONE-2", "done")["reason"] is None
    assert starts_of(env, "GONE-2") == [1]


def test_cancel_of_a_running_job_whose_daemon_died_holds_even_with_a_receipt(env: Env) -> None:
    """kill -9 while the agent has written its receipt: `cancel` exits 0, and recovery fails the job as cancelled."""
    env.configure(agents={"worker": env.agent("--sleep-after", "60")})
    d = env.daemon()
    env.drop(order("DEAD-1"))
    wait_until(lambda: (env.root / "active" / "DEAD-1" / "work" / "receipt.json").exists(), 30, "the receipt")
    d.kill()
    result = cancelled_while_no_daemon_runs(env, "DEAD-1")
    assert not (env.root / "done" / "DEAD-1").exists()
    # its agent ran: the attempt the crash cut is in the record, as a live cancel's is (section 5: every attempt)
    [cut] = result["attempts"]
    assert (cut["n"], cut["interrupted"], cut["argv"]) == (1, True, env.agent("--sleep-after", "60")["command"])
    shown = json.loads(env.cli("show", "DEAD-1", "--json", check=True).stdout)
    assert [a["n"] for a in shown["attempts"]] == [1]


def test_a_retry_or_revision_of_an_agent_no_longer_in_the_config_waits_for_it(env: Env) -> None:
    """retry and revise of a job whose agent the config no longer has: nothing runs (section 6: the agent's settings
    as the config has them; section 13: a removed agent's work waits, logged once); with the agent back, it runs."""
    ran = env.tmp / "ran.txt"
    gone = {"command": ["sh", "-c", f"echo ran >> {ran}; exit 1"], "timeout": 30}
    env.configure(agents={"gone": gone, "other": env.agent()})
    env.drop(order("GONE-1", to="gone"))
    assert env.cli("run", "--once").returncode == 1
    assert ran.read_text() == "ran\n"
    env.configure(agents={"other": env.agent()})
    assert env.cli("retry", "GONE-1").returncode == 0
    once = env.cli("run", "--once")
    assert once.returncode == 0, once.stderr
    assert ran.read_text() == "ran\n"  # the removed agent's old command did not run
    waiting = [json.loads(line) for line in once.stdout.splitlines() if '"order.waiting"' in line]
    assert [(w["job_id"], w["agent"]) for w in waiting] == [("GONE-1", "gone")]
    assert (env.root / "failed" / "GONE-1").is_dir()
    env.configure(agents={"gone": gone, "other": env.agent()})
    assert env.cli("run", "--once").returncode == 1  # the agent is back: the retry runs, and fails again
    assert ran.read_text() == "ran\nran\n"
    assert len(env.result("GONE-1", "failed")["attempts"]) == 2
    env.configure(agents={"other": env.agent()})
    assert env.cli("revise", "GONE-1", "--note", "once more").returncode == 0
    once = env.cli("run", "--once")
    assert once.returncode == 0, once.stderr
    assert ran.read_text() == "ran\nran\n" and (env.root / "failed" / "GONE-1").is_dir()
    assert '"order.waiting"' in once.stdout


def test_cancels_recorded_together_never_hand_a_freed_slot_to_a_job_claimed_ahead(env: Env) -> None:
    """Two cancels in the ledger at once (as `cancel --tree` records them): the running job and the one claimed
    ahead behind it. Ending the first gives its slot back; the second must not start on it: it fails `cancelled`
    with no attempt, its agent never run."""
    starts = env.tmp / "starts"
    script = f'echo "$DISPATCH_JOB_ID" >> "{starts}"; case "$DISPATCH_JOB_ID" in S*) sleep 20;; *) sleep 0.1;; esac; '
    env.configure(agents={"worker": sh(script + GOOD, concurrency=1)}, max_jobs=1, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    for i in range(4):  # quick runs: the agent's next orders are claimed ahead of a free slot
        env.drop(seam_order(f"Q{i}"))
        env.wait_job(f"Q{i}", "done")
    env.drop(seam_order("S1"))
    d.wait_event("agent.started", job_id="S1")
    env.drop(seam_order("S2"))
    wait_until(lambda: (env.root / "active" / "S2" / "job.json").exists(), 30, "S2 to be claimed ahead")
    cfg = load_config(env.config_path)
    op = Operator(cfg, Layout(cfg.root))
    try:
        # both recorded before the daemon hears of either, with others between them (a tree's joins, say)
        for job_id in ("S1", *[f"S1-{i:02}" for i in range(20)], "S2"):
            op.ledger.request(job_id, Request.CANCEL)
        op._poke("cancel", "S1")
    finally:
        op.close()
    for job_id in ("S1", "S2"):
        assert env.wait_job(job_id, "failed")["reason"] == "cancelled"
    assert env.result("S2", "failed")["attempts"] == []
    assert "S2" not in starts.read_text().split(), starts.read_text()
    assert d.stop() == 0


def test_a_waiting_retry_runs_at_the_reload_that_brings_its_agent_back(env: Env) -> None:
    """A live daemon: the retry of a job whose agent a reload removed waits (order.waiting with its job_id); the
    reload that brings the agent back runs it at once, as it runs the agent's queued orders. It waited for the
    next rescan (rescan_interval, 60 s here)."""
    ok = env.tmp / "ok"
    gone = {"command": ["sh", "-c", f"test -e {ok} || exit 1; " + GOOD], "timeout": 30}
    env.configure(agents={"gone": gone, "other": env.agent()}, rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    env.drop(seam_order("GONE-2", to="gone"))
    env.wait_job("GONE-2", "failed")
    env.configure(agents={"other": env.agent()}, rescan_interval=60)
    assert env.cli("reload").returncode == 0
    d.wait_event("config.reloaded")
    ok.touch()
    assert env.cli("retry", "GONE-2").returncode == 0
    d.wait_event("order.waiting", job_id="GONE-2")
    env.configure(agents={"gone": gone, "other": env.agent()}, rescan_interval=60)
    assert env.cli("reload").returncode == 0
    wait_until(lambda: (env.root / "done" / "GONE-2" / "result.json").exists(), 20, "the retry to run")
    assert env.result("GONE-2", "done")["state"] == "done"
    assert d.stop() == 0


@pytest.mark.parametrize("command", ["retry", "cancel"])
def test_retry_and_cancel_go_through_when_the_log_file_cannot_be_opened(env: Env, command: str) -> None:
    """A `log_file` the operator cannot open (here a folder stands at its path) does not stop `retry` or `cancel`:
    the request is recorded, exit 0, with one warning line on stderr naming the file; their lines go to a running
    daemon only. (A cancel of a runaway job must not wait for the log's rights.) `hold` still refuses (exit 2)."""
    log_file = env.tmp / "logs" / "d.log"
    env.configure(agents={"worker": env.agent("--exit", "1", max_attempts=1)}, log_file=str(log_file))
    env.drop(order("LOGX-1"))
    env.cli("run", "--once")
    log_file.unlink()
    log_file.mkdir()
    if command == "cancel":  # a failed job's queued retry, which the cancel withdraws
        assert env.cli("retry", "LOGX-1").returncode == 0
    proc = env.cli(command, "LOGX-1")
    assert proc.returncode == 0, proc.stderr
    want = "LOGX-1: retry requested\n" if command == "retry" else "LOGX-1: retry withdrawn; it stays failed\n"
    assert proc.stdout == want
    assert proc.stderr.splitlines() == [
        f"warning: {env.config_path}: log_file: cannot open {log_file}: Is a directory; its lines go to a running"
        " daemon only"
    ], proc.stderr
    assert env.cli("hold", "LOGX-1").returncode == 2


def test_a_cancel_whose_first_look_at_the_ledger_came_before_the_claim_still_cancels_the_job(env: Env) -> None:
    """`cancel` read the ledger before a daemon claimed the order, and looked in inbox/ after the claim took it
    away (the order was in neither place it looked): it answered "no such job", exit 1, and the job ran to done.
    The row is read again after the look: the cancel is requested and the running job fails `cancelled`."""
    env.configure(agents={"worker": env.agent("--sleep", "30")}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RACED"))
    d.wait_event("agent.started", job_id="RACED")  # claimed: its row written, its inbox name gone
    cfg = load_config(env.config_path)
    op = Operator(cfg, Layout(cfg.root))
    real_get = op.ledger.get
    reads: list[str] = []

    def get_before_the_claim(job_id: str) -> Any:
        if sys._getframe(1).f_code.co_name == "cancel":  # the command's own look, not its settling of a cut job
            reads.append(job_id)
            if len(reads) == 1:
                return None  # its first read came before the claim's row
        return real_get(job_id)

    op.ledger.get = get_before_the_claim  # type: ignore[method-assign]
    try:
        assert op.cancel("RACED") == "RACED: cancel requested"
        assert reads[0] == "RACED"
    finally:
        op.close()
    assert env.wait_job("RACED", "failed")["reason"] == "cancelled"
    assert d.stop() == 0


def test_a_cancel_whose_held_order_a_release_hands_to_a_daemon_that_finishes_it_says_it_came_too_late(
    env: Env,
) -> None:
    """`cancel` finds the order in held/ (no row yet); before its request is written, a `release` moves the order
    to inbox/ and the daemon claims and finishes it. The cancel reached nothing: it says the job ended done, exit 1
    (as for a running job that finished first). It said "cancel requested", exit 0, of a job done."""
    env.configure(agents={"worker": env.agent()})
    d = env.daemon()
    d.wait_ready()
    (env.root / "held").mkdir(exist_ok=True)
    (env.root / "held" / "LATE.json").write_text(json.dumps(order("LATE")))
    cfg = load_config(env.config_path)
    op = Operator(cfg, Layout(cfg.root))
    real_request = op.ledger.request

    def release_first(job_id: str, kind: Request) -> None:
        assert env.cli("release", "LATE").returncode == 0  # between the look and the request
        env.wait_job("LATE", "done")
        real_request(job_id, kind)

    op.ledger.request = release_first  # type: ignore[method-assign]
    try:
        with pytest.raises(WrongState, match="it ended done before the cancel reached it"):
            op.cancel("LATE")
    finally:
        op.close()
    assert env.result("LATE", "done")["state"] == "done"
    assert d.stop() == 0
