"""What a new operator tripped over, each fixed and proved against the real CLI and daemon."""

from __future__ import annotations

import json
import sys
import time

from conftest import Env, order, wait_until


def simple(job_id: str, to: str = "worker") -> dict[str, object]:
    body = order(job_id, to=to)
    body.pop("accept")
    return body


def test_retry_after_fixing_the_agent_command_runs_the_fixed_command(env: Env) -> None:
    """A job failed by a broken command runs the fixed command on `retry`, also across a restart."""
    broken = env.agent()
    broken["command"] = [str(env.tmp / "no-such-agent")]
    env.configure(agents={"worker": broken})
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("FIX-1"))
    failed = env.wait_job("FIX-1", "failed")
    assert failed["reason"].startswith("config: agent worker cannot start")
    assert d.stop() == 0
    env.configure()  # the fixed command
    d = env.daemon()
    d.wait_ready()
    assert env.cli("retry", "FIX-1").returncode == 0
    done = env.wait_job("FIX-1", "done", after=failed)  # the daemon carries the retry out
    assert done["attempts"][-1]["argv"][0] == sys.executable


def test_repair_without_retry_safe_or_probe_says_why_it_did_nothing(env: Env) -> None:
    """repair: true on an agent that may not run again: the job's reason says why it was not repaired."""
    env.configure(agents={"worker": env.agent("--bad-value", repair=True, max_attempts=3)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("REP-1", accept={"output": "out.csv", "allowed": {"team": ["orders"]}}))
    result = env.wait_job("REP-1", "failed")
    assert "not repaired" in result["reason"] and "not retry_safe and has no probe" in result["reason"]
    assert len(result["attempts"]) == 1


def test_submit_of_several_files_names_every_bad_one_and_submits_nothing(env: Env) -> None:
    """`submit a b c` with bad files: one `<file>: ...` line each, the last saying nothing was submitted, exit 2
    (no line beside them: each failure is one line)."""
    good = env.tmp / "good.json"
    good.write_text(json.dumps(simple("SUB-1")))
    bad1 = env.tmp / "bad1.json"
    bad1.write_text(json.dumps({**simple("SUB-2"), "task": ""}))
    bad2 = env.tmp / "bad2.json"
    bad2.write_text("{not json")
    proc = env.cli("submit", str(good), str(bad1), str(bad2))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{bad1}: task:") and lines[1].startswith(f"{bad2}: ")
    assert lines[1].endswith("; nothing was submitted: 2 of 3 files are invalid"), lines
    assert not [p for p in (env.root / "inbox").iterdir()] if (env.root / "inbox").exists() else True


def test_submit_of_one_id_twice_names_the_file(env: Env) -> None:
    """Two files with one job id in one submit: the error line starts with the second file's name."""
    a, b = env.tmp / "a.json", env.tmp / "b.json"
    a.write_text(json.dumps(simple("TWICE-1")))
    b.write_text(json.dumps(simple("TWICE-1")))
    proc = env.cli("submit", str(a), str(b))
    assert proc.returncode == 2
    assert proc.stderr == f"{b}: job_id: TWICE-1 is given twice (also in {a}); nothing was submitted (2 files given)\n"


def test_retry_and_cancel_leave_no_hint_files_behind(env: Env) -> None:
    """The daemon removes the hint files that retry and cancel leave in .state/control/ once it acted."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("HINT-1"))
    env.wait_job("HINT-1", "failed")
    assert env.cli("retry", "HINT-1").returncode == 0
    wait_until(lambda: len(env.result("HINT-1", "failed")["attempts"]) == 2 if (env.root / "failed" / "HINT-1" /
               "result.json").exists() else False, 30, "the retried attempt")  # fmt: skip
    control = env.root / ".state" / "control"
    wait_until(lambda: not list(control.iterdir()), 20, "the hint files to be removed")


def test_one_retry_request_runs_the_job_again_once(env: Env) -> None:
    """`retry` once: the job gets one more round of attempts, not one per hint the daemon noticed."""
    env.configure(agents={"worker": env.agent("--exit", "3")})
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("ONCE-1"))
    env.wait_job("ONCE-1", "failed")
    assert env.cli("retry", "ONCE-1").returncode == 0
    wait_until(lambda: [j for j, _ in env.starts()].count("ONCE-1") >= 2, 30, "the retried attempt")
    wait_until(lambda: len(env.result("ONCE-1", "failed")["attempts"]) >= 2 if (env.root / "failed" / "ONCE-1" /
               "result.json").exists() else False, 30, "the retry to end")  # fmt: skip
    time.sleep(2.0)
    assert [j for j, _ in env.starts()].count("ONCE-1") == 2
    assert [e["event"] for e in d.events() if e.get("job_id") == "ONCE-1"].count("job.claimed") == 2


def test_retry_takes_the_agents_new_timeout(env: Env) -> None:
    """A job that timed out runs with the timeout the config has when it is retried."""
    env.configure(agents={"worker": env.agent("--sleep", "2", timeout=1)}, kill_grace=0.2)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("SLOWFIX-1"))
    first = env.wait_job("SLOWFIX-1", "failed")
    assert first["attempts"][0]["timed_out"] is True
    assert d.stop() == 0
    env.configure(agents={"worker": env.agent("--sleep", "2", timeout=20)})
    d = env.daemon()
    d.wait_ready()
    assert env.cli("retry", "SLOWFIX-1").returncode == 0
    wait_until(lambda: (env.root / "done" / "SLOWFIX-1" / "result.json").exists(), 30, "the retried job done")


def test_repair_applies_to_the_first_attempt_of_a_retry(env: Env) -> None:
    """repair: the first attempt after `retry` gets work/feedback.json with the checks that failed."""
    agent = env.agent("--fail-checks-attempts", "1", repair=True, retry_safe=True, max_attempts=1)
    env.configure(agents={"worker": agent})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FEEDRETRY-1"))
    first = env.wait_job("FEEDRETRY-1", "failed")
    assert "not repaired: no attempts left" in first["reason"]
    assert env.cli("retry", "FEEDRETRY-1").returncode == 0
    wait_until(lambda: (env.root / "done" / "FEEDRETRY-1" / "result.json").exists(), 30, "the repaired job done")
    feedback = json.loads((env.root / "done" / "FEEDRETRY-1" / "work" / "feedback.json").read_text())
    assert feedback["attempt"] == 1 and feedback["failed_checks"]


def test_work_for_a_free_agent_is_not_starved_by_a_busy_one(env: Env) -> None:
    """Orders waiting for a busy agent's slot never hold up a retry (or an order) of another agent."""
    slow = env.agent("--sleep", "20", concurrency=1)
    env.configure(agents={"worker": env.agent("--exit", "3"), "slow": slow}, max_jobs=2)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("BAD-1"))
    env.wait_job("BAD-1", "failed")
    busy = order("BUSY-1", to="slow")
    busy.pop("accept")
    env.drop(busy)
    waiting = order("WAITING-1", to="slow")
    waiting.pop("accept")
    env.drop(waiting)
    wait_until(lambda: ("BUSY-1", 1) in env.starts(), 30, "the slow agent busy")
    time.sleep(1.0)  # WAITING-1 is parked behind BUSY-1's slot
    assert env.cli("retry", "BAD-1").returncode == 0
    wait_until(lambda: ("BAD-1", 2) in env.starts(), 15, "the retry of BAD-1 to start")


def test_retry_and_revise_of_a_folder_the_ledger_does_not_say_failed_exit_1_and_ask_nothing(env: Env) -> None:
    """A failed folder renamed by hand, a done job moved into failed/ by hand, a failed job whose job.json is
    damaged: `retry` and `revise` say why in one line and exit 1 (no daemon would carry the request out),
    where they said `retry requested` and the request vanished; a plain failed job is still retried."""
    env.configure(agents={"worker": env.agent("--exit", "3"), "ok": env.agent()})
    d = env.daemon()
    d.wait_ready()
    for job_id, to in (("RN-1", "worker"), ("MV-1", "ok"), ("DM-1", "worker"), ("PLAIN-1", "worker")):
        env.drop(simple(job_id, to=to))
    for job_id, state in (("RN-1", "failed"), ("MV-1", "done"), ("DM-1", "failed"), ("PLAIN-1", "failed")):
        env.wait_job(job_id, state)
    (env.root / "failed" / "RN-1").rename(env.root / "failed" / "RN-1-old")
    (env.root / "done" / "MV-1").rename(env.root / "failed" / "MV-1")
    (env.root / "failed" / "DM-1" / "job.json").write_text("[1]")
    expected = {
        "RN-1-old": "RN-1-old: its ledger row is missing, not failed",
        "MV-1": "MV-1: its ledger row is done, not failed",
        "DM-1": "DM-1: its job.json is damaged; it cannot be retried",
    }
    for job_id, line in expected.items():
        proc = env.cli("retry", job_id)
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", line + "\n")
    for job_id in ("RN-1-old", "MV-1"):
        proc = env.cli("revise", job_id, "--note", "again")
        assert proc.returncode == 1 and "its ledger row is" in proc.stderr and proc.stderr.count("\n") == 1
    assert env.cli("retry", "PLAIN-1").returncode == 0
    wait_until(lambda: [j for j, _ in env.starts()].count("PLAIN-1") >= 2, 30, "the retried attempt")
    assert env.cli("status", "--json", check=True).returncode == 0
    time.sleep(1.0)
    assert [j for j, _ in env.starts()].count("RN-1") == 1 and [j for j, _ in env.starts()].count("DM-1") == 1
    assert d.stop() == 0
