"""Cost, budgets, review and notifications (contract section 11) with real daemons.

Agents report their cost the way headless CLIs do (a final JSON object on stdout
with ``total_cost_usd``). Crashes inside `approve` and `reject` are real kill -9s at
named steps (``$DISPATCHER_FAULT``), followed by what a user would do next.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, Env, cli_env, namespaced_daemon, order, wait_until
from helpers_faults import run_once_killed_at, write_script
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
FOLLOWUP = {"job_id": "CHILD-1", "from": "worker", "to": "next", "task": "Go on.", "items": [{"id": "R1"}]}


def costly(env: Env, cost: float, *flags: str, **settings: Any) -> dict[str, Any]:
    """Return the fake agent reporting `cost` USD per attempt, as a CLI's final JSON does."""
    return env.agent("--json-result", json.dumps({"type": "result", "total_cost_usd": cost}), *flags, **settings)


def test_the_cost_of_a_final_json_longer_than_the_stdout_kept_is_recorded(env: Env) -> None:
    """A final JSON of 4.5 MB whose cost and is_error come before a long field: only its last 4 MiB are kept in
    memory, and its start is read from stdout.log, so the attempt's cost and is_error are recorded (section 5)."""
    big = {"total_cost_usd": 0.5, "is_error": False, "padding": "x" * 4_500_000, "num_turns": 3}
    work = env.agent()["command"]  # the fake agent does the job; the wrapper then prints the long final JSON
    text = f"import json, subprocess\nsubprocess.run({work!r}, check=True)\nprint(json.dumps({big!r}))\n"
    wrapper = write_script(env.tmp, "big-final.py", text)
    env.configure(agents={"worker": {**env.agent(), "command": [sys.executable, str(wrapper)]}})
    env.drop(simple("BIG-FINAL"))
    assert env.cli("run", "--once", timeout=90).returncode == 0
    result = env.result("BIG-FINAL", "done")
    assert result["cost_usd"] == 0.5, result
    kept = result["attempts"][0]["agent_result"]
    assert kept == {"total_cost_usd": 0.5, "is_error": False, "num_turns": 3}, kept


def simple(job_id: str, to: str = "worker") -> dict[str, Any]:
    body = order(job_id, to=to)
    body.pop("accept")
    return body


def test_costs_are_summed_over_attempts_and_the_chain(env: Env) -> None:
    """cost_usd sums a job's attempts; chain_cost_usd adds its ancestors'; both on job.done and in show."""
    worker = costly(env, 0.25, "--fail-attempts", "1", "--followup", json.dumps(FOLLOWUP), retry_safe=True)
    worker["max_attempts"] = 2
    env.configure(agents={"worker": worker, "next": costly(env, 0.1)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PARENT-1", accept={"output": "out.csv", "followups": ["next"]}))
    parent = env.wait_job("PARENT-1", "done")
    child = env.wait_job("CHILD-1", "done")
    assert [a["cost_usd"] for a in parent["attempts"]] == [0.25, 0.25]
    assert parent["cost_usd"] == pytest.approx(0.5) and parent["chain_cost_usd"] == pytest.approx(0.5)
    assert child["cost_usd"] == pytest.approx(0.1) and child["chain_cost_usd"] == pytest.approx(0.6)
    done = [e for e in d.events() if e["event"] == "job.done" and e["job_id"] == "CHILD-1"]
    assert done[0]["chain_cost_usd"] == pytest.approx(0.6) and done[0]["duration_s"] >= 0
    exited = [e for e in d.events() if e["event"] == "agent.exited" and e["job_id"] == "PARENT-1"]
    assert all(e["cost_usd"] == 0.25 for e in exited)
    shown = env.cli("show", "CHILD-1", "--json", check=True)
    assert json.loads(shown.stdout)["cost_usd"] == pytest.approx(0.1)
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert {r["job_id"]: r["cost_usd"] for r in listed}["PARENT-1"] == pytest.approx(0.5)


def test_a_cost_beyond_a_float_or_below_zero_is_no_cost_and_every_file_stays_json(env: Env) -> None:
    """total_cost_usd of 1e400 (valid JSON, no float), an integer of 1,100 bits, 1.7e308 (a float, but two of them
    overflow a chain's sum) or -5 is not a cost: null, the job is checked as any other, and result.json and logs
    parse."""

    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text[:200]}"))

    report = {
        "huge": '{"type": "result", "total_cost_usd": 1e400}',
        "bigint": '{"type": "result", "total_cost_usd": ' + str(2**1100) + "}",
        "absurd": '{"type": "result", "total_cost_usd": 1.7e308}',
        "negative": '{"total_cost_usd": -5}',
    }
    env.configure(agents={name: env.agent("--json-result", text) for name, text in report.items()})
    d = env.daemon()
    for name in report:
        env.drop(order(f"{name}-1", to=name))
    results = {name: env.wait_job(f"{name}-1", "done") for name in report}
    assert d.stop() == 0
    for name, result in results.items():
        assert result["cost_usd"] is None and result["attempts"][0]["cost_usd"] is None, name
        assert all(c["ok"] is not False for c in result["checks"]) and result["attempts"][0]["exit_code"] == 0, name
        strict((env.job_dir(f"{name}-1", "done") / "result.json").read_text())
    lines = [line for line in d.out.read_text().splitlines() if line.startswith("{")]
    assert any('"agent.exited"' in line for line in lines)
    for line in lines:
        strict(line)
    shown = strict(env.cli("show", "huge-1", "--json", check=True).stdout)
    assert shown["cost_usd"] is None


def test_max_cost_usd_stops_further_attempts(env: Env) -> None:
    """Once a job's attempts cost more than max_cost_usd it gets no further attempt; the reason says so."""
    agent = costly(env, 0.25, "--exit", "1", retry_safe=True, max_attempts=5, max_cost_usd=0.3)
    env.configure(agents={"worker": agent})
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("SPEND-1"))
    result = env.wait_job("SPEND-1", "failed")
    assert len(result["attempts"]) == 2
    assert "budget is spent" in result["reason"] and "max_cost_usd" in result["reason"]


def test_a_last_attempt_over_the_budget_says_so_beside_no_attempts_left(env: Env) -> None:
    """A job whose one allowed attempt costs more than max_cost_usd fails saying both: none left, budget spent."""
    agent = costly(env, 1.0, "--exit", "1", retry_safe=True, max_attempts=1, max_cost_usd=0.5)
    env.configure(agents={"worker": agent})
    env.drop(simple("LAST-SPEND"))
    env.cli("run", "--once", timeout=60)
    result = env.result("LAST-SPEND", "failed")
    assert result["reason"].startswith("exit_ok: "), result["reason"]
    assert result["reason"].endswith(
        "not retried: no attempts left, and the budget is spent (1 USD of max_cost_usd 0.5)"
    ), result["reason"]


@pytest.mark.parametrize("repair", [False, True])
def test_a_job_failed_by_its_checks_over_the_budget_says_the_budget_was_spent(env: Env, repair: bool) -> None:
    """Exit 0, a receipt saying `failed`, and attempts that cost more than max_cost_usd: whether or not a repair was
    possible, the reason says the budget was spent (section 11: if it then fails, its reason says so)."""
    settings: dict[str, Any] = {"max_attempts": 3, "max_cost_usd": 0.5}
    if repair:
        settings.update(repair=True, retry_safe=True)
    env.configure(agents={"worker": costly(env, 0.7, "--status", "failed", **settings)})
    env.drop(simple("CHECK-SPEND"))
    env.cli("run", "--once", timeout=60)
    result = env.result("CHECK-SPEND", "failed")
    assert len(result["attempts"]) == 1
    assert result["reason"].startswith("receipt_status: "), result["reason"]
    assert "the budget is spent (0.7 USD of max_cost_usd 0.5)" in result["reason"], result["reason"]


def test_a_session_id_repeated_without_resume_costs_each_attempt_what_it_reported(env: Env) -> None:
    """An agent without `resume` that names the same session_id in each attempt: each attempt costs the
    total it reported (only a resumed session's total is a running one), so max_cost_usd stops it after two."""
    final = json.dumps({"type": "result", "total_cost_usd": 1.5, "session_id": "s-1"})
    agent = env.agent("--json-result", final, "--exit", "1", retry_safe=True, max_attempts=3, max_cost_usd=2.5)
    env.configure(agents={"worker": agent})
    env.drop(simple("SAME-SESSION"))
    env.cli("run", "--once", timeout=60)
    result = env.result("SAME-SESSION", "failed")
    assert [a["cost_usd"] for a in result["attempts"]] == [1.5, 1.5], result["attempts"]
    assert result["cost_usd"] == 3.0
    assert result["reason"].endswith("not retried: the budget is spent (3 USD of max_cost_usd 2.5)"), result["reason"]


def test_a_retry_of_a_job_whose_budget_is_spent_gets_no_further_attempt(env: Env) -> None:
    """`dispatcher retry` of a job whose attempts cost more than max_cost_usd runs no attempt: it fails again at
    once, its reason led by its last failing check; once the budget is raised, the next retry runs."""
    agent = costly(env, 0.4, "--exit", "1", retry_safe=True, max_cost_usd=0.5)
    env.configure(agents={"worker": agent})
    env.drop(simple("SPENT-1"))
    env.cli("run", "--once", timeout=60)
    assert env.result("SPENT-1", "failed")["cost_usd"] == 0.4  # not over the budget yet
    env.cli("retry", "SPENT-1", check=True)
    env.cli("run", "--once", timeout=60)
    assert len(env.result("SPENT-1", "failed")["attempts"]) == 2  # 0.8 USD now: over it
    env.cli("retry", "SPENT-1", check=True)
    env.cli("run", "--once", timeout=60)
    result = env.result("SPENT-1", "failed")
    assert len(result["attempts"]) == 2, "an attempt ran after the budget was spent"
    assert result["reason"].startswith("exit_ok: exit 1 in "), result["reason"]
    assert result["reason"].endswith("; not retried: the budget is spent (0.8 USD of max_cost_usd 0.5)")
    env.configure(agents={"worker": costly(env, 0.4, "--exit", "1", retry_safe=True, max_cost_usd=2)})
    env.cli("retry", "SPENT-1", check=True)
    env.cli("run", "--once", timeout=60)
    assert len(env.result("SPENT-1", "failed")["attempts"]) == 3


def test_a_retry_refused_by_the_spent_budget_keeps_the_checks_its_reason_names(env: Env) -> None:
    """The retry that fails at once (budget spent) keeps the last checked attempt's checks in result.json: its
    reason says `exit_ok: exit 1`, so exit_ok is false there, not "not run"."""
    env.configure(agents={"worker": costly(env, 0.8, "--exit", "1", retry_safe=True, max_cost_usd=0.5)})
    env.drop(simple("SPENT-2"))
    env.cli("run", "--once", timeout=60)
    before = env.result("SPENT-2", "failed")["checks"]
    assert {c["name"]: c["ok"] for c in before}["exit_ok"] is False
    env.cli("retry", "SPENT-2", check=True)
    env.cli("run", "--once", timeout=60)
    result = env.result("SPENT-2", "failed")
    assert len(result["attempts"]) == 1 and result["reason"].startswith("exit_ok: exit 1 in "), result["reason"]
    assert result["checks"] == before


def held_follow_up(env: Env, parent: str) -> Daemon:
    """Run `parent` (1 USD, chain budget 0.5) under a daemon until its follow-up CHILD-1 waits in held/."""
    worker = costly(env, 1.0, "--followup", json.dumps(FOLLOWUP))
    env.configure(agents={"worker": worker, "next": costly(env, 0.1)}, max_chain_cost_usd=0.5)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple(parent))
    env.wait_job(parent, "done")
    wait_until((env.root / "held" / "CHILD-1.json").exists, 20, "the held follow-up")
    return d


def test_a_follow_up_over_the_chain_budget_is_held_until_released(env: Env) -> None:
    """A follow-up whose chain already cost more than max_chain_cost_usd waits in held/; release lets it run."""
    d = held_follow_up(env, "BIG-1")
    event = d.wait_event("budget.held", job_id="CHILD-1")
    assert event["chain_cost_usd"] == pytest.approx(1.0)
    time.sleep(1.0)
    assert not (env.root / "done" / "CHILD-1").exists(), "a held follow-up ran"
    assert env.cli("release", "CHILD-1").returncode == 0
    child = env.wait_job("CHILD-1", "done")
    assert child["parent"] == "BIG-1" and child["chain_cost_usd"] == pytest.approx(1.1)


@pytest.mark.parametrize(("before", "after"), [(0.5, 10.0), (10.0, 0.5)])
def test_a_follow_up_placed_before_a_crash_stays_one_copy_when_the_budget_changed_since(
    env: Env, before: float, after: float
) -> None:
    """kill -9 right after the follow-up was linked into held/ (or inbox/), then max_chain_cost_usd changed so that
    it now belongs in the other folder: the next start keeps the copy that was placed and makes no second one (a
    copy in inbox/ was refused as already known, the held one left behind, and `run --once` exited 1)."""
    worker = costly(env, 1.0, "--followup", json.dumps(FOLLOWUP))
    agents = {"worker": worker, "next": costly(env, 0.1)}
    env.configure(agents=agents, max_chain_cost_usd=before)
    env.drop(simple("BIG-9"))
    run_once_killed_at(env, "followup.placed")
    placed = "held" if before < 1.0 else "inbox"
    assert os.listdir(env.root / placed) == ["CHILD-1.json"]
    env.configure(agents=agents, max_chain_cost_usd=after)
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert os.listdir(env.root / "failed") == []
    if placed == "held":
        assert os.listdir(env.root / "held") == ["CHILD-1.json"] and os.listdir(env.root / "inbox") == []
        assert env.cli("release", "CHILD-1").returncode == 0
        assert env.cli("run", "--once", timeout=120).returncode == 0
    assert os.listdir(env.root / "held") == [] and os.listdir(env.root / "inbox") == []
    assert env.result("CHILD-1", "done")["parent"] == "BIG-9"


def test_show_of_a_held_follow_up_gives_the_chain_cost_that_held_it(env: Env) -> None:
    """A follow-up held by max_chain_cost_usd: `show` gives its chain's cost so far, the one budget.held reported,
    not `-` (section 11: a chain of paid agents shows its cost)."""
    d = held_follow_up(env, "BIG-4")
    event = d.wait_event("budget.held", job_id="CHILD-1")
    shown = json.loads(env.cli("show", "CHILD-1", "--json", check=True).stdout)
    assert shown["state"] == "held" and shown["chain_cost_usd"] == pytest.approx(event["chain_cost_usd"]), shown
    assert "chain cost: -" not in env.cli("show", "CHILD-1", check=True).stdout


def test_a_held_follow_up_stays_held_through_a_ledger_rebuild(env: Env) -> None:
    """The ledger lost while a follow-up waits in held/ over the chain budget: `ledger rebuild` records it held, so
    `release` runs it, once, and no daemon releases it a second time (section 12: ids, states, lineage)."""
    d = held_follow_up(env, "BIG-5")
    assert d.stop() == 0
    for path in (env.root / ".state").glob("ledger.sqlite3*"):
        path.unlink()
    assert "1 held" in env.cli("ledger", "rebuild", check=True).stdout
    assert json.loads(env.cli("show", "CHILD-1", "--json", check=True).stdout)["state"] == "held"
    assert env.cli("run", "--once", timeout=60).returncode == 0  # held stays held: nothing released again
    assert sorted(p.name for p in (env.root / "held").iterdir()) == ["CHILD-1.json"]
    assert not (env.root / "done" / "CHILD-1").exists()
    assert env.cli("release", "CHILD-1").returncode == 0
    env.cli("run", "--once", timeout=60)
    assert env.result("CHILD-1", "done")["parent"] == "BIG-5"
    assert list((env.root / "held").iterdir()) == [] and [j for j, _ in env.starts() if j == "CHILD-1"] == ["CHILD-1"]


@pytest.mark.parametrize("how", [["cancel", "--tree", "BIG-2"], ["cancel", "CHILD-1"]])
def test_a_follow_up_held_by_the_chain_budget_is_cancelled_at_once(env: Env, how: list[str]) -> None:
    """`cancel --tree` of its parent (or `cancel` of it) fails a held follow-up as cancelled; its agent never runs."""
    d = held_follow_up(env, "BIG-2")
    proc = env.cli(*how)
    assert (proc.returncode, proc.stdout) == (0, "CHILD-1: cancel requested\n"), proc.stderr
    child = env.wait_job("CHILD-1", "failed")
    assert child["reason"] == "cancelled" and child["attempts"] == []
    assert list((env.root / "held").iterdir()) == []
    assert [j for j, _ in env.starts() if j == "CHILD-1"] == []
    assert d.stop() == 0


def test_a_follow_up_that_an_approval_holds_is_notified(env: Env) -> None:
    """approve releases a follow-up over max_chain_cost_usd into held/: notify runs for its budget.held."""
    events = env.tmp / "events.txt"
    append = str(REPO / "examples" / "notify" / "append.sh")
    worker = costly(env, 1.0, "--followup", json.dumps(FOLLOWUP), review=True)
    env.configure(
        agents={"worker": worker, "next": costly(env, 0.1)},
        max_chain_cost_usd=0.5,
        notify=["sh", append, str(events), "{event}", "{job_id}", "{agent}", "{reason}"],
    )
    env.drop(simple("BIG-2"))
    env.cli("run", "--once", timeout=60)
    assert (env.root / "review" / "BIG-2").is_dir()
    assert decide(env, "approve", "BIG-2").returncode == 0  # no daemon runs: the command notifies
    assert (env.root / "held" / "CHILD-1.json").exists()
    wait_until(lambda: events.exists() and "\tbudget.held\tCHILD-1\t" in events.read_text(), 20, "the notification")
    assert "\tchain cost 1 USD is above max_chain_cost_usd" in events.read_text()  # a person's number: 1, not 1.0


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_an_approvals_notify_that_fails_or_hangs_is_logged_and_ended(env: Env, how: str) -> None:
    """The budget.held notify an approve starts gets the daemon's rules: 30 s, then ended; notify.failed logged."""
    marks = env.tmp / "marks.txt"
    script = {
        "fails": '#!/bin/sh\necho "start $1" >> "$2"\necho boom >&2\nexit 7\n',
        "hangs": '#!/bin/sh\necho "start $1" >> "$2"\nsleep 40\necho "end $1" >> "$2"\n',
    }[how]
    script = '#!/bin/sh\n[ "$1" = CHILD-1 ] || exit 0\n' + script.removeprefix("#!/bin/sh\n")  # the review's own: fine
    notify = write_script(env.tmp, "notify.sh", script)
    log_file = env.tmp / "dispatcher.jsonl"
    worker = costly(env, 1.0, "--followup", json.dumps(FOLLOWUP), review=True)
    env.configure(
        agents={"worker": worker, "next": costly(env, 0.1)},
        max_chain_cost_usd=0.5,
        notify=["sh", str(notify), "{job_id}", str(marks)],
        log_file=str(log_file),
    )
    env.drop(simple("BIG-3"))
    env.cli("run", "--once", timeout=60)
    began = time.monotonic()
    approved = decide(env, "approve", "BIG-3")
    assert approved.returncode == 0 and time.monotonic() - began < 10  # the command does not wait for it

    def failed() -> dict[str, Any] | None:
        lines = [json.loads(line) for line in log_file.read_text().splitlines()]
        return next((e for e in lines if e["event"] == "notify.failed" and e["job_id"] == "CHILD-1"), None)

    line = wait_until(failed, 60, "notify.failed in log_file")
    took = time.monotonic() - began
    assert (line["event_name"], line["job_id"], line["level"]) == ("budget.held", "CHILD-1", "warning")
    if how == "fails":
        assert (line["error"], line["stderr"]) == ("exit 7", "boom")
    else:
        assert line["error"] == "timed out after 30 s" and 29 < took < 50
        time.sleep(12)  # past the 40 s the script asked for: it was ended, its last line never written
        assert marks.read_text() == "start CHILD-1\n"
    assert (env.root / "held" / "CHILD-1.json").exists()  # the notify changes nothing about the job
    assert (env.root / "done" / "BIG-3").is_dir()


def reviewed(env: Env) -> Env:
    worker = env.agent("--followup", json.dumps(FOLLOWUP), review=True)
    env.configure(agents={"worker": worker, "next": env.agent()}, rescan_interval=0.5)
    return env


def decide(env: Env, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    extra = {"DISPATCHER_FAULT": fault} if fault else {}
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env() | extra,
    )


def test_a_reviewed_job_waits_and_its_follow_ups_wait_with_it(env: Env) -> None:
    """review: true: a job that passes waits in review/ (state review); approve moves it and releases its follow-up."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("REV-1"))
    result_path = env.root / "review" / "REV-1" / "result.json"
    wait_until(result_path.exists, 30, "the job in review/")
    assert json.loads(result_path.read_text())["state"] == "review"
    d.wait_event("job.review", job_id="REV-1")
    time.sleep(1.0)
    assert not list((env.root / "inbox").iterdir()), "a follow-up was released before approval"
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert status["counts"]["review"] == 1
    assert decide(env, "approve", "REV-1").returncode == 0
    assert env.result("REV-1", "done")["state"] == "done"
    line = d.wait_event("job.approved", job_id="REV-1")  # the job's end: the figures job.done would carry
    assert {"duration_s", "cost_usd", "chain_cost_usd"} <= line.keys(), line
    env.wait_job("CHILD-1", "done")
    assert decide(env, "approve", "REV-1").returncode == 1  # not waiting any more


def test_a_reviewed_job_keeps_its_follow_ups_through_a_ledger_rebuild(env: Env) -> None:
    """The ledger lost while a job waits in review/: `ledger rebuild`, then approve releases its follow-up once."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("REV-R"))
    d.wait_event("job.review", job_id="REV-R")
    assert d.stop() == 0
    for suffix in ("", "-wal", "-shm"):
        Path(f"{env.root}/.state/ledger.sqlite3{suffix}").unlink(missing_ok=True)
    rebuilt = env.cli("ledger", "rebuild", check=True)
    assert "1 review" in rebuilt.stdout, rebuilt.stdout
    assert decide(env, "approve", "REV-R").returncode == 0
    again = env.daemon()
    env.wait_job("CHILD-1", "done")
    assert [e["job_id"] for e in again.events() if e["event"] == "followup.released"] == ["CHILD-1"]
    assert again.stop() == 0


def test_a_rejected_job_fails_and_its_follow_ups_never_run(env: Env) -> None:
    """reject --reason: the job ends in failed/ with reason `rejected: TEXT`; its follow-ups are never released,
    and its result.json names no child."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("REV-2"))
    wait_until((env.root / "review" / "REV-2").exists, 30, "the job in review/")
    assert decide(env, "reject", "REV-2", "--reason", "wrong team").returncode == 0
    result = env.result("REV-2", "failed")
    assert result["reason"] == "rejected: wrong team"
    # its follow-up never became a job: `children` names none (section 5: a list of job ids), as `show` says
    assert result["children"] == [] and env.cli("show", "CHILD-1").returncode == 1, result
    assert json.loads(env.cli("show", "REV-2", "--json", check=True).stdout)["children"] == []
    line = d.wait_event("job.rejected", job_id="REV-2")  # the job's end: the figures job.failed would carry
    assert {"duration_s", "cost_usd", "chain_cost_usd"} <= line.keys(), line
    time.sleep(2.0)
    assert not (env.root / "done" / "CHILD-1").exists() and not list((env.root / "inbox").iterdir())


def test_a_blank_reject_reason_reads_as_no_reason_given(env: Env) -> None:
    """reject --reason '   ' (blanks only) records `rejected: no reason given`, as no --reason does."""
    reviewed(env)
    env.drop(simple("REV-BLANK"))
    env.cli("run", "--once", timeout=60)
    assert decide(env, "reject", "REV-BLANK", "--reason", "   ").returncode == 0
    assert env.result("REV-BLANK", "failed")["reason"] == "rejected: no reason given"


def test_a_reject_reason_that_starts_with_a_dash_is_the_reason(env: Env) -> None:
    """reject --reason -WIP: a one-word value that starts with a dash is taken as the reason, not as an option."""
    reviewed(env)
    env.drop(simple("REV-DASH"))
    env.cli("run", "--once", timeout=60)
    proc = decide(env, "reject", "REV-DASH", "--reason", "-WIP")
    assert proc.returncode == 0, proc.stderr
    assert env.result("REV-DASH", "failed")["reason"] == "rejected: -WIP"


def test_a_job_reusing_a_rejected_follow_ups_id_is_not_shown_as_its_child(env: Env) -> None:
    """After a reject, its follow-up's id is free: a person's own order with that id runs, and `show --tree` of the
    rejected job lists no child, while `show` of the new job names no parent (one story, not two)."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("REV-5"))
    wait_until((env.root / "review" / "REV-5").exists, 30, "the job in review/")
    assert decide(env, "reject", "REV-5").returncode == 0
    env.drop(simple("CHILD-1", to="next"))
    env.wait_job("CHILD-1", "done")
    tree = json.loads(env.cli("show", "REV-5", "--tree", "--json", check=True).stdout)["tree"]
    assert tree["job_id"] == "REV-5" and tree["children"] == [], tree
    assert json.loads(env.cli("show", "CHILD-1", "--json", check=True).stdout)["parent"] is None
    assert d.stop() == 0


def test_cancel_of_a_job_in_review_exits_1_and_leaves_it_waiting(env: Env) -> None:
    """A job in review/ is neither queued nor running: `cancel` says to approve or reject it, exit 1."""
    reviewed(env)
    env.drop(simple("REV-3"))
    env.cli("run", "--once", check=True)
    assert (env.root / "review" / "REV-3" / "result.json").exists()
    proc = decide(env, "cancel", "REV-3")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "review" in proc.stderr, proc.stderr
    env.cli("run", "--once", check=True)
    assert env.result("REV-3", "review")["state"] == "review"
    assert decide(env, "approve", "REV-3").returncode == 0
    assert env.result("REV-3", "done")["state"] == "done"


KILL_POINTS = [
    (True, "review.staged"),
    (True, "review.decided"),
    (True, "review.named"),
    (True, "review.landed"),
    (True, "followup.placed"),
    (False, "review.staged"),
    (False, "review.decided"),
    (False, "review.named"),
    (False, "review.landed"),  # a reject releases nothing: it has no followup.placed step
]


def decision_killed_at(env: Env, job_id: str, approve: bool, fault: str) -> Daemon:
    """Run a review agent's job into review/, kill its approve (or reject) at ``fault``, and wait until the daemon's
    rescan has landed it in done/ (or failed/); return that daemon."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple(job_id))
    wait_until((env.root / "review" / job_id).exists, 30, "the job in review/")
    action = ["approve", job_id] if approve else ["reject", job_id, "--reason", "no"]
    assert decide(env, *action, fault=fault).returncode == -9
    want = "done" if approve else "failed"
    wait_until(lambda: (env.root / want / job_id / "result.json").exists(), 30, f"{job_id} landed in {want}/")
    return d


def test_a_follow_up_an_approve_placed_before_it_was_killed_is_logged_released_once(env: Env) -> None:
    """approve killed after placing the follow-up in inbox/, before marking it released, a daemon running: the
    daemon claims and runs it, and `followup.released` is logged once (by the claim that found the row still
    reserved). It was never logged: the claim took the row, so no later release had it to mark."""
    worker = env.agent("--followup", json.dumps(FOLLOWUP), review=True)
    env.configure(agents={"worker": worker, "next": env.agent()}, rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("PLACED-1"))
    wait_until((env.root / "review" / "PLACED-1").exists, 30, "the job in review/")
    assert decide(env, "approve", "PLACED-1", fault="followup.placed").returncode == -9
    env.wait_job("CHILD-1", "done")
    assert decide(env, "approve", "PLACED-1").returncode in (0, 1)
    time.sleep(1)
    released = [e for e in d.events() if e.get("event") == "followup.released" and e.get("job_id") == "CHILD-1"]
    assert len(released) == 1, released
    assert released[0]["parent"] == "PLACED-1" and released[0]["agent"] == "next", released
    assert [j for j, _ in env.starts()].count("CHILD-1") == 1
    assert d.stop() == 0


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_killed_after_naming_its_result_is_landed_by_the_daemon(env: Env, approve: bool) -> None:
    """approve/reject killed between naming result.json and moving the folder: with no command run again, the
    daemon's rescan lands the job in done/ (releasing its follow-up once) or failed/ (section 11)."""
    d = decision_killed_at(env, "KILL-1", approve, "review.named")
    want = "done" if approve else "failed"
    assert not (env.root / "review" / "KILL-1").exists()
    assert env.result("KILL-1", want)["state"] == want
    if approve:
        env.wait_job("CHILD-1", "done")
    time.sleep(1.5)
    assert [j for j, _ in env.starts() if j == "CHILD-1"] == (["CHILD-1"] if approve else [])
    assert not [e for e in d.events() if e.get("event") == "followup.lost"]


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_is_logged_once_its_job_is_in_done_or_failed(env: Env, approve: bool) -> None:
    """`job.approved` and `job.rejected` mean what `job.done` and `job.failed` mean: the job is in done/ or failed/.
    An approve (reject) killed after naming the result, the folder still in review/, has logged nothing; the same
    command run again lands the job and logs the decision, once (it was logged while the job sat in review/)."""
    log_file = env.tmp / "d.log"
    worker = env.agent("--followup", json.dumps(FOLLOWUP), review=True)
    env.configure(agents={"worker": worker, "next": env.agent()}, log_file=str(log_file))
    env.drop(simple("LOGD-1"))
    env.cli("run", "--once", timeout=60)
    assert (env.root / "review" / "LOGD-1").is_dir()
    event, want = ("job.approved", "done") if approve else ("job.rejected", "failed")
    action = ["approve", "LOGD-1"] if approve else ["reject", "LOGD-1", "--reason", "no"]

    def lines() -> list[dict[str, Any]]:
        found = [json.loads(line) for line in log_file.read_text().splitlines()]
        return [e for e in found if e["event"] == event and e.get("job_id") == "LOGD-1"]

    assert decide(env, *action, fault="review.named").returncode == -9
    assert (env.root / "review" / "LOGD-1" / "result.json").is_file()  # named, not moved
    assert lines() == []
    assert decide(env, *action).returncode == 0
    assert env.result("LOGD-1", want)["state"] == want
    assert len(lines()) == 1, lines()


def test_a_cut_short_approval_whose_place_in_done_is_taken_leaves_the_daemon_running(env: Env) -> None:
    """An approve killed after naming the result, and done/<id> taken by a stray folder: the daemon starts, says
    `job.stuck` for that job (it waits in review/, nothing removed) and runs other orders. Every start died with
    FileExistsError, so nothing on the root ran."""
    reviewed(env)
    env.drop(simple("STRAY-1"))
    env.cli("run", "--once", timeout=60)
    assert decide(env, "approve", "STRAY-1", fault="review.named").returncode == -9
    (env.root / "done" / "STRAY-1").mkdir(parents=True)
    (env.root / "done" / "STRAY-1" / "a person's file").write_text("kept")
    d = env.daemon()
    d.wait_ready()
    assert "STRAY-1" in d.wait_event("job.stuck", job_id="STRAY-1")["reason"]
    env.drop(simple("AFTER-1", to="next"))
    env.wait_job("AFTER-1", "done")
    assert (env.root / "review" / "STRAY-1" / "result.json").is_file()
    assert (env.root / "done" / "STRAY-1" / "a person's file").read_text() == "kept"
    assert d.stop() == 0


@pytest.mark.parametrize("rescan_gets_there_first", [False, True])
def test_a_rescan_during_a_live_decision_leaves_the_landing_to_it(
    env: Env, monkeypatch: pytest.MonkeyPatch, rescan_gets_there_first: bool
) -> None:
    """A daemon's rescan that comes between an approve's ledger write and its move does not land the job (the
    approve holds the review lock): the approve lands it and says `approved; done`. Where the job is landed
    meanwhile all the same (a rescan on another host, which this host's lock does not hold off), the approve
    still says `approved; done`: the decision was its own. It said `was already approved` under load."""
    import threading

    from dispatcher import faults
    from dispatcher.job import review
    from dispatcher.layout import Layout
    from dispatcher.lifecycle import Row
    from dispatcher.spec.config import load_config
    from dispatcher.store.jobstore import JobFolder
    from dispatcher.store.ledgers import open_ledger

    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("RACE-1"))
    wait_until((env.root / "review" / "RACE-1").exists, 30, "the job in review/")
    assert d.stop() == 0
    cfg = load_config(env.config_path)
    layout = Layout(cfg.root)
    ledger = open_ledger(cfg, layout, patience_s=10)
    decided, go_on = threading.Event(), threading.Event()
    point = faults.point

    def pause_at_the_decision(name: str) -> None:
        point(name)
        if name == "review.decided":
            decided.set()
            assert go_on.wait(30)

    monkeypatch.setattr(faults, "point", pause_at_the_decision)
    said: list[str] = []
    approve = threading.Thread(target=lambda: said.append(review.decide(layout, ledger, "RACE-1", approve=True)))
    approve.start()
    try:
        assert decided.wait(30), "the approve never wrote its decision"
        review.settle_reviews(layout, open_ledger(cfg, layout, patience_s=10))  # a daemon's rescan, this host
        assert (env.root / "review" / "RACE-1").is_dir(), "the rescan landed a decision under way"
        if rescan_gets_there_first:  # as a rescan on another host would
            review.land(layout, JobFolder(env.root / "review" / "RACE-1"), Row.DONE)
    finally:
        go_on.set()
        approve.join(30)
    assert said == ["RACE-1: approved; done"]
    assert env.result("RACE-1", "done")["state"] == "done"
    assert not (env.root / "review" / "RACE-1").exists()


@pytest.mark.parametrize(("approve", "fault"), KILL_POINTS)
def test_a_decision_killed_at_any_step_ends_in_one_place(env: Env, approve: bool, fault: str) -> None:
    """kill -9 of approve/reject at each step: the job ends in exactly one place; follow-ups run at most once."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("KILL-1"))
    wait_until((env.root / "review" / "KILL-1").exists, 30, "the job in review/")
    action = ["approve", "KILL-1"] if approve else ["reject", "KILL-1", "--reason", "no"]
    killed = decide(env, *action, fault=fault)
    # the daemon's housekeeping (rescans 0.5 s apart) may take the follow-up's release turn first: the
    # approve then places nothing, never reaches followup.placed, and ends as a whole approve does
    daemon_released = fault == "followup.placed" and killed.stdout == "KILL-1: approved; done\n"
    assert killed.returncode == -9 or (daemon_released and killed.returncode == 0), (killed.returncode, killed.stdout)
    again = decide(env, *action)  # what the person does next: the same command again
    assert again.returncode in (0, 1), again.stderr
    want = "done" if approve else "failed"
    wait_until(lambda: (env.root / want / "KILL-1" / "result.json").exists(), 20, f"KILL-1 in {want}/")
    places = [s for s in ("review", "done", "failed", "active") if (env.root / s / "KILL-1").exists()]
    assert places == [want]
    if approve:
        env.wait_job("CHILD-1", "done")
    time.sleep(1.5)
    child_starts = [j for j, _ in env.starts() if j == "CHILD-1"]
    assert len(child_starts) == (1 if approve else 0)
    assert not [p for p in (env.root / "failed").iterdir() if "@" in p.name], "a follow-up copy was refused"
    event = "job.approved" if approve else "job.rejected"  # logged once, by the command or by the daemon that
    decided = [e for e in d.events() if e.get("event") == event and e.get("job_id") == "KILL-1"]  # landed it
    assert len(decided) == 1, decided
    assert decided[0]["reason"] == (None if approve else "rejected: no"), decided  # the decision's own result


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_cut_short_before_its_line_is_logged_by_the_daemon_that_lands_it(env: Env, approve: bool) -> None:
    """approve/reject killed right after the ledger took the decision, before it logged it: the daemon's rescan
    lands the job and logs job.approved or job.rejected once, with its figures (sections 8 and 11)."""
    d = decision_killed_at(env, "CUT-1", approve, "review.decided")
    event = "job.approved" if approve else "job.rejected"
    line = d.wait_event(event, job_id="CUT-1")
    assert line["agent"] == "worker" and {"duration_s", "cost_usd", "chain_cost_usd"} <= set(line), line
    assert line["reason"] == (None if approve else "rejected: no")
    time.sleep(1.5)  # a few rescans more
    assert [e.get("job_id") for e in d.events() if e.get("event") == event] == ["CUT-1"]


def test_notify_runs_for_failures_and_its_own_failures_change_nothing(env: Env) -> None:
    """notify: a working command gets the event; a failing one and a hanging one are logged, jobs unchanged."""
    events = env.tmp / "events.txt"
    append = str(REPO / "examples" / "notify" / "append.sh")
    hang = write_script(env.tmp, "hang.sh", "#!/bin/sh\nsleep 600\n")
    for notify, expect in (
        (["sh", append, str(events), "{event}", "{job_id}", "{agent}", "{reason}"], "works"),
        (["sh", "-c", "echo nope >&2; exit 3"], "fails"),
        (["sh", str(hang)], "hangs"),
    ):
        env.configure(agents={"worker": env.agent("--exit", "2")}, notify=notify)
        d = env.daemon()
        d.wait_ready()
        job = f"NOTE-{expect}"
        env.drop(simple(job))
        result = env.wait_job(job, "failed")
        assert result["reason"].startswith("exit_ok")
        if expect == "works":
            wait_until(lambda j=job: events.exists() and j in events.read_text(), 20, "the notify line")
            fields = events.read_text().splitlines()[0].split("\t")
            assert fields[1:4] == ["job.failed", job, "worker"] and fields[4].startswith("exit_ok")
        else:
            failed = d.wait_event("notify.failed", timeout=45, job_id=job)
            assert ("timed out" in failed["error"]) == (expect == "hangs")
        assert env.result(job, "failed") == result  # the job's state and result are untouched
        assert d.stop() == 0


def test_notify_failed_logs_the_end_of_a_long_stderr(env: Env) -> None:
    """A failing notify that prints a long body, then its error: `notify.failed` keeps the end of its stderr,
    where the error is (it kept the first 8,192 characters of the body and lost the error line)."""
    loud = write_script(
        env.tmp,
        "loud.sh",
        '#!/bin/sh\nprintf "body: %010000d\\n" 0 >&2\necho "error: webhook answered 500" >&2\nexit 1\n',
    )
    env.configure(agents={"worker": env.agent("--exit", "2")}, notify=["sh", str(loud)])
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("LOUD-1"))
    env.wait_job("LOUD-1", "failed")
    failed = d.wait_event("notify.failed", timeout=45, job_id="LOUD-1")
    assert failed["stderr"].endswith("error: webhook answered 500"), failed["stderr"][-200:]
    assert len(failed["stderr"]) < 2100
    assert d.stop() == 0


def test_run_once_runs_every_queued_notification_before_it_exits(env: Env) -> None:
    """`run --once` is not a stop: notifications beyond notify_max_running wait and then run, in order, before it
    exits (section 13); none is dropped."""
    events = env.tmp / "events.txt"
    slow = write_script(env.tmp, "slow_notify.sh", '#!/bin/sh\nsleep 1\necho "$2" >> "$1"\n')
    env.configure(
        agents={"worker": env.agent("--exit", "2", concurrency=4)},
        notify=["sh", str(slow), str(events), "{job_id}"],
        notify_max_running=2,
        max_jobs=4,
    )
    jobs = [f"QUEUED-{i}" for i in range(6)]
    for job in jobs:
        env.drop(simple(job))
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 1  # its jobs failed
    assert "notify.dropped" not in proc.stdout, proc.stdout[-2000:]
    assert sorted(events.read_text().split()) == jobs


def test_metrics_file_parses_while_jobs_run(env: Env) -> None:
    """metrics_file: a Prometheus text file, rewritten while jobs run, that prometheus_client parses."""
    env.configure(agents={"worker": env.agent("--sleep", "3")}, metrics_file=str(env.tmp / "m-{pid}.prom"))
    d = env.daemon()
    d.wait_ready()
    path = env.tmp / f"m-{d.proc.pid}.prom"  # type: ignore[union-attr]
    for i in range(4):
        env.drop(simple(f"MET-{i}"))
    seen_running = False
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if path.exists():
            families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
            running = sum(s.value for s in families["dispatcher_agents_running"].samples)
            seen_running = seen_running or running > 0
            done = [s for s in families["dispatcher_jobs_finished"].samples if s.labels.get("state") == "done"]
            if sum(s.value for s in done) >= 4:
                break
        time.sleep(0.2)
    assert d.stop() == 0
    families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    assert {"dispatcher_queue", "dispatcher_job_duration_seconds", "dispatcher_cost_usd",
            "dispatcher_last_loop_timestamp_seconds"} <= set(families)  # fmt: skip
    finished = {(s.labels["state"], s.labels["agent"]): s.value for s in families["dispatcher_jobs_finished"].samples
                if s.name.endswith("_total")}  # fmt: skip
    assert finished[("done", "worker")] == 4
    assert seen_running, "never saw an agent running in the file"
    assert os.stat(path).st_mode & 0o007 == 0


def test_a_stop_counts_every_dropped_notification_the_summary_included(env: Env) -> None:
    """At a stop, notify.dropped counts each waiting event, those counted into the queued summary too (section 13):
    every event is either notified or counted as dropped, none vanishes."""
    started = env.tmp / "started.txt"
    hang = write_script(env.tmp, "hang_notify.sh", '#!/bin/sh\necho "$1" >> "$2"\nsleep 100\n')
    env.configure(
        agents={"worker": env.agent("--exit", "2", concurrency=4)},
        notify=["sh", str(hang), "{job_id}", str(started)],
        notify_max_running=1,
        max_jobs=4,
        stop_timeout=3,
    )
    jobs = [f"DROP-{i:03d}" for i in range(110)]
    for job in jobs:
        env.drop(simple(job))
    d = env.daemon()
    d.wait_ready()
    wait_until(lambda: len(list((env.root / "failed").iterdir())) == len(jobs), 120, "every job failed")
    assert d.stop() == 0
    ran = started.read_text().split()
    dropped = sum(e["count"] for e in d.events() if e.get("event") == "notify.dropped")
    assert len(ran) + dropped == len(jobs), (len(ran), dropped)


@pytest.mark.parametrize("fault", ["review.landed", "followup.placed"])
def test_an_approve_cut_short_is_finished_by_the_same_command_again_without_a_daemon(env: Env, fault: str) -> None:
    """approve killed once the job is in done/ but before its follow-ups are all out, no daemon running: the same
    command again releases what is left (README: "run the same command again") and says so; a third says the job
    is done; the follow-up then runs once."""
    reviewed(env)
    d = env.daemon()
    d.wait_ready()
    env.drop(simple("CUT-1"))
    wait_until((env.root / "review" / "CUT-1").exists, 30, "the job in review/")
    assert d.stop() == 0
    assert decide(env, "approve", "CUT-1", fault=fault).returncode == -9
    assert (env.root / "done" / "CUT-1").is_dir()
    again = decide(env, "approve", "CUT-1")
    if fault == "review.landed":  # nothing was released yet
        assert (again.returncode, again.stdout) == (
            0, "CUT-1: approved; done; 1 follow-up released now (the approval was cut short)\n"
        ), again  # fmt: skip
    assert [p.name for p in (env.root / "inbox").iterdir()] == ["CHILD-1.json"]
    third = decide(env, "approve", "CUT-1")
    assert (third.returncode, third.stderr) == (1, "CUT-1: is done, not waiting for review\n"), third
    d2 = env.daemon()
    env.wait_job("CHILD-1", "done")
    time.sleep(1.0)
    assert [j for j, _ in env.starts() if j == "CHILD-1"] == ["CHILD-1"]
    assert d2.stop() == 0


@pytest.mark.parametrize(
    ("cost", "cap", "said"),
    [
        (1_500_000, 1_000_000, "1500000 USD of max_cost_usd 1000000"),
        (0.00002, 0.00001, "0.00002 USD of max_cost_usd 0.00001"),
    ],
)
def test_a_spent_budget_is_said_in_plain_numbers(env: Env, cost: float, cap: float, said: str) -> None:
    """The budget's reason shows costs as a person writes them (section 7: never Python notation); it read
    1.5e+06 USD of max_cost_usd 1e+06, and 2e-05 USD of max_cost_usd 1e-05."""
    env.configure(
        agents={"worker": costly(env, cost, "--exit", "1", retry_safe=True, max_attempts=3, max_cost_usd=cap)}
    )
    env.drop(simple("PLAIN-SPEND"))
    env.cli("run", "--once", timeout=60)
    result = env.result("PLAIN-SPEND", "failed")
    assert result["reason"].endswith(f"not retried: the budget is spent ({said})"), result["reason"]


@pytest.mark.parametrize(
    ("hostname", "template"),
    [("other-host", "m-{pid}.prom"), (None, "m-{host}-{pid}.prom")],
    ids=["another-host", "a-container-under-this-hosts-name"],
)
def test_a_metrics_file_of_a_daemon_on_another_host_under_the_same_pid_pattern_is_left_alone(
    env: Env, hostname: str | None, template: str
) -> None:
    """metrics_file m-{pid}.prom shared by two hosts (section 10: a daemon removes only the files its host's stopped
    daemons left): a second daemon in a host of its own (its own host name and pid namespace, as a container is)
    keeps its file beside this one's for two rewrites and more; a file this host's stopped daemon left still goes.
    The same for a daemon in a pid namespace of its own under this host's name (a container sharing it): its pid
    means another process here, even with {host} in the name."""
    folder = env.tmp / "m"
    env.configure(agents={"worker": env.agent()}, metrics_file=str(folder / template))
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    folder.mkdir()
    stale = folder / template.replace("{host}", host).replace("{pid}", str(gone.pid))
    stale.write_text("# left by a daemon of this host that stopped\n")
    here = env.daemon()
    here.wait_ready()
    mine = folder / template.replace("{host}", host).replace("{pid}", str(here.proc.pid))  # type: ignore[union-attr]
    other = namespaced_daemon(env.config_path, env.tmp / "other-host.log", env.tmp, hostname=hostname)
    try:
        theirs = folder / template.replace("{host}", hostname or host).replace("{pid}", "1")  # pid 1 of its namespace
        wait_until(lambda: mine.exists() and theirs.exists(), 30, "both daemons' metrics files")
        wait_until(lambda: not stale.exists(), 15, "this host's stale file removed")
        deadline = time.monotonic() + 12  # more than two rewrites of each file (every 5 s)
        while time.monotonic() < deadline:
            assert mine.exists() and theirs.exists(), sorted(os.listdir(folder))
            time.sleep(0.02)
    finally:
        other.send_signal(signal.SIGKILL)  # its namespace's init: every process of it goes
        other.wait(30)
    assert here.stop() == 0


def test_show_of_a_job_waiting_for_its_retry_gives_its_chain_cost_so_far(env: Env) -> None:
    """A job whose first attempt cost 0.3 USD waits for its retry (retry_delay): `show` gives its cost so far and
    the chain's so far too (0.3: no parent), not a chain cost of `-` beside a known cost."""
    agent = costly(env, 0.3, "--fail-attempts", "1", retry_safe=True, max_attempts=2)
    env.configure(agents={"worker": agent}, retry_delay=30)
    d = env.daemon()
    env.drop(simple("WAIT-COST"))
    d.wait_event("agent.exited", job_id="WAIT-COST")
    wait_until(lambda: json.loads(env.cli("show", "WAIT-COST", "--json", check=True).stdout)["cost_usd"] == 0.3)
    shown = json.loads(env.cli("show", "WAIT-COST", "--json", check=True).stdout)
    assert (shown["state"], shown["cost_usd"], shown["chain_cost_usd"]) == ("active", 0.3, 0.3), shown
    assert "chain cost: 0.3 USD" in env.cli("show", "WAIT-COST", check=True).stdout
    assert d.stop() == 0


@pytest.mark.parametrize("decided", [True, False])
def test_a_rebuilt_ledger_dates_a_jobs_cost_as_the_lost_ledger_did(env: Env, decided: bool) -> None:
    """A job approved today whose agent's work passed its checks 30 hours ago: after `ledger rebuild` its cost is
    outside the 24-hour spend, as in the ledger that was lost (the rebuilt row dated it at the decision, so a daily
    cap counted the night's spend again). A job with no review whose last attempt ended as long ago (a `retry`
    that failed at once today, with no new attempt) counts at its finish, before and after the rebuild."""
    worker = costly(env, 1.0, review=True) if decided else costly(env, 1.0, "--exit", "3")
    env.configure(agents={"worker": worker})
    env.drop(simple("OLD-WORK"))
    assert env.cli("run", "--once", timeout=60).returncode == (0 if decided else 1)  # 1: a job failed
    if decided:
        assert env.cli("approve", "OLD-WORK").returncode == 0
    path = env.root / ("done" if decided else "failed") / "OLD-WORK" / "result.json"
    result = json.loads(path.read_text())
    then = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(time.time() - 30 * 3600))
    result["attempts"][-1]["started"] = result["attempts"][-1]["ended"] = then
    if decided:
        assert "review_since" in result, result
        result["review_since"] = then
    path.write_text(json.dumps(result))  # the folder as a decision (or a retry) made today would leave it
    for suffix in ("", "-wal", "-shm"):
        Path(f"{env.root}/.state/ledger.sqlite3{suffix}").unlink(missing_ok=True)
    env.cli("ledger", "rebuild", check=True)
    spend = json.loads(env.cli("status", "--json", check=True).stdout)["spend_24h"]
    assert spend == ({} if decided else {"worker": 1.0}), spend
