"""`dispatcher revise ID --note TEXT` (contract section 14) with real daemons and real kill -9s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, order, wait_until
from helpers_faults import env_daemon
from structlog.testing import capture_logs

from dispatcher.job import recovery
from dispatcher.layout import Layout
from dispatcher.ledger.base import DaemonInfo, Request
from dispatcher.spec.config import load_config
from dispatcher.store.ledgers import open_ledger

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"
NOTE = "Use team B for R2,\nas agreed on Monday."  # a line break is part of the text (section 14)


def agent(env: Env, plan: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    plan_file = env.tmp / "plan.json"
    plan_file.write_text(json.dumps(plan or {}))
    spec: dict[str, Any] = {
        "command": [sys.executable, str(HEADLESS), "--count", str(env.count_file), "--plan", str(plan_file)],
        "timeout": 30,
        "writes": ["out.csv"],
        "review": True,
    }
    spec.update(settings)
    return spec


def cli(env: Env, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    extra = {"DISPATCHER_FAULT": fault} if fault else {}
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env() | extra,
    )


def in_review(env: Env, job_id: str, attempts: int) -> dict[str, Any]:
    path = env.root / "review" / job_id / "result.json"

    def ready() -> dict[str, Any] | None:
        try:
            result = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return result if len(result["attempts"]) == attempts else None

    return wait_until(ready, 60, f"{job_id} in review/ after {attempts} attempts")


def test_a_reviewed_job_is_revised_with_the_note_and_the_last_checks(env: Env) -> None:
    """revise from review/: one more attempt with work/feedback.json {from, note, checks}; job.revised; then approve."""
    env.configure(agents={"worker": agent(env)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("REVISE-1"))
    first = in_review(env, "REVISE-1", 1)
    proc = env.cli("revise", "REVISE-1", "--note", NOTE)
    assert (proc.returncode, proc.stdout) == (0, "REVISE-1: revision requested\n")
    second = in_review(env, "REVISE-1", 2)
    folder = env.root / "review" / "REVISE-1"
    feedback = json.loads((folder / "work" / "feedback.json").read_text())
    assert feedback == {"from": "review", "note": NOTE, "checks": first["checks"]}
    assert second["state"] == "review" and [a["n"] for a in second["attempts"]] == [1, 2]
    assert (folder / "attempts" / "1" / "result.json").exists()
    revised = d.wait_event("job.revised", job_id="REVISE-1")
    assert revised["note"] == NOTE and revised["revision"] == 1
    env.cli("approve", "REVISE-1", check=True)
    assert json.loads((env.root / "done" / "REVISE-1" / "result.json").read_text())["state"] == "done"


def test_an_approval_after_a_revision_logs_the_jobs_cost_as_its_result_says(env: Env) -> None:
    """job.approved carries job.done's figures: cost_usd and chain_cost_usd as result.json has them (both
    attempts), and counted_cost_usd, the part since the rejection (what the metrics count)."""
    log_file = env.tmp / "events.jsonl"
    env.configure(agents={"worker": agent(env, {"cost_usd": 0.05})}, log_file=str(log_file))
    d = env.daemon()
    d.wait_ready()
    env.drop(order("COST-R1"))
    in_review(env, "COST-R1", 1)
    env.cli("reject", "COST-R1", "--reason", "not yet", check=True)
    env.cli("revise", "COST-R1", "--note", "again", check=True)
    in_review(env, "COST-R1", 2)
    env.cli("approve", "COST-R1", check=True)
    assert d.stop() == 0
    result = json.loads((env.root / "done" / "COST-R1" / "result.json").read_text())
    assert result["cost_usd"] == pytest.approx(0.1) and result["chain_cost_usd"] == pytest.approx(0.1)
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    (approved,) = [e for e in events if e["event"] == "job.approved"]
    assert approved["agent"] == "worker"
    assert approved["cost_usd"] == pytest.approx(0.1) and approved["chain_cost_usd"] == pytest.approx(0.1)
    assert approved["counted_cost_usd"] == pytest.approx(0.05)
    assert approved["duration_s"] >= approved["counted_duration_s"] > 0  # received to finished; the revision alone


@pytest.mark.parametrize("first", ["retry", "revise"])
def test_a_failed_job_takes_a_retry_or_a_revision_not_both(env: Env, first: str) -> None:
    """Both would run the job once more, and only one could: the second request is refused (exit 1, one line),
    so a revision's note is never dropped for a plain retry."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    env.drop(order("BOTH-1"))
    assert env.cli("run", "--once", timeout=60).returncode == 1
    asks = {"retry": ("retry", "BOTH-1"), "revise": ("revise", "BOTH-1", "--note", "use team B")}
    second = "revise" if first == "retry" else "retry"
    assert cli(env, *asks[first]).returncode == 0
    proc = cli(env, *asks[second])
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "already requested" in proc.stderr, proc.stderr


def test_cancel_withdraws_a_revision_of_a_failed_job(env: Env) -> None:
    """`cancel` of a failed job with a revision requested withdraws it, as it withdraws a retry: no attempt runs."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    env.drop(order("WD-1"))
    env.cli("run", "--once", timeout=60)
    env.cli("revise", "WD-1", "--note", "again", check=True)
    proc = cli(env, "cancel", "WD-1")
    assert (proc.returncode, proc.stdout) == (0, "WD-1: revision withdrawn; it stays failed\n")
    env.cli("run", "--once", timeout=60)
    result = env.result("WD-1", "failed")
    assert len(result["attempts"]) == 1 and not (env.root / "failed" / "WD-1" / "work" / "feedback.json").exists()


def test_approve_after_revisions_releases_only_the_last_attempts_follow_ups(env: Env) -> None:
    """Each attempt hands off `<id>-c<attempt>`: after two revisions, approve releases V1-c3 alone, once."""
    script = env.tmp / "parent.sh"
    script.write_text(
        "#!/bin/sh\nmkdir -p outbox\n"
        'printf \'{"job_id":"%s-c%s","from":"parent","to":"child","task":"t","items":[{"id":"R1"}]}\' '
        '"$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" > outbox/next.json\n'
        'printf \'{"job_id":"%s","input_ids":["A"],"output_ids":[],"status":"done"}\' "$DISPATCH_JOB_ID"'
        ' > "$DISPATCH_RECEIPT"\n'
    )
    script.chmod(0o755)
    log_file = env.tmp / "events.jsonl"
    env.configure(
        agents={"parent": {"command": [str(script)], "review": True}, "child": env.agent()}, log_file=str(log_file)
    )
    d = env.daemon()
    env.drop({"job_id": "V1", "from": "tester", "to": "parent", "task": "Hand on.", "items": [{"id": "A"}]})
    in_review(env, "V1", 1)
    for n in (2, 3):
        env.cli("revise", "V1", "--note", f"round {n}", check=True)
        in_review(env, "V1", n)
    approved = env.cli("approve", "V1", check=True)
    env.wait_job("V1-c3", "done")
    assert d.stop() == 0
    assert approved.stdout == "V1: approved; done\n"
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [e["job_id"] for e in events if e["event"] == "followup.released"] == ["V1-c3"]
    assert [e for e in events if e["event"] == "job.refused"] == []
    assert json.loads(env.cli("show", "V1-c3", "--json", check=True).stdout)["state"] == "done"
    for stale in ("V1-c1", "V1-c2"):
        assert env.cli("show", stale).returncode == 1  # never a job, never reserved


@pytest.mark.parametrize("decision", ["reject", "approve"])
def test_a_decision_after_a_revise_request_withdraws_it(env: Env, decision: str) -> None:
    """revise, then reject (or approve) before any daemon carried it out: the decision stands, no revision runs.

    A rejected job's follow-ups are never released (section 11), not even by a revision asked before.
    """
    script = env.tmp / "parent.sh"
    script.write_text(
        "#!/bin/sh\nmkdir -p outbox\n"
        'printf \'{"job_id":"%s-c","from":"parent","to":"child","task":"t","items":[{"id":"R1"}]}\' '
        '"$DISPATCH_JOB_ID" > outbox/next.json\n'
        'printf \'{"job_id":"%s","input_ids":["A"],"output_ids":[],"status":"done"}\' "$DISPATCH_JOB_ID"'
        ' > "$DISPATCH_RECEIPT"\n'
    )
    script.chmod(0o755)
    env.configure(agents={"parent": {"command": [str(script)], "review": True}, "child": env.agent()})
    env.drop({"job_id": "W1", "from": "tester", "to": "parent", "task": "Hand on.", "items": [{"id": "A"}]})
    env.cli("run", "--once", timeout=60)
    assert (env.root / "review" / "W1").is_dir()
    env.cli("revise", "W1", "--note", "again", check=True)
    decided = env.cli(decision, "W1", check=True)
    state = "failed" if decision == "reject" else "done"
    assert decided.stdout == f"W1: {decision.rstrip('e')}ed; {state}; its requested revision is withdrawn\n"
    env.cli("run", "--once", timeout=60)
    result = json.loads((env.root / state / "W1" / "result.json").read_text())
    assert result["state"] == state and len(result["attempts"]) == 1  # no revision ran
    assert (env.root / "done" / "W1-c").is_dir() is (decision == "approve")  # released once only when approved
    assert not (env.root / "review" / "W1").exists()


def test_a_failed_job_is_revised_and_max_revisions_bounds_it(env: Env) -> None:
    """revise from failed/ runs it once more; past max_revisions, and for a done job, revise exits 1."""
    plan = {"limit": {"times": 1, "stderr": "Error: the API answered 500", "exit": 1}}
    env.configure(agents={"worker": agent(env, plan, review=False, max_revisions=1)})
    env.daemon().wait_ready()
    env.drop(order("REVISE-2"))
    env.wait_job("REVISE-2", "failed")
    env.cli("revise", "REVISE-2", "--note", "try again, the API is back", check=True)
    # the running daemon carries the request out a moment after the command returns: until then
    # failed/REVISE-2/ still holds the first result
    wait_until(lambda: not (env.root / "failed" / "REVISE-2").exists(), 60, "the revision to reopen REVISE-2")
    result = env.wait_job("REVISE-2", "done")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    again = env.cli("revise", "REVISE-2", "--note", "once more")
    assert again.returncode == 1
    assert again.stderr.strip() == "REVISE-2: is done, only a job in review or failed can be revised"
    env.drop(order("REVISE-3"))
    env.wait_job("REVISE-3", "done")
    assert env.cli("revise", "NOPE", "--note", "x").stderr.strip() == "NOPE: no such job"
    assert env.cli("revise", "REVISE-2").returncode == 2  # --note is required


def test_revise_reads_ids_from_stdin_and_counts_revisions(env: Env) -> None:
    """`revise - --note` takes ids from stdin; a second revision past max_revisions 1 is refused."""
    env.configure(agents={"worker": agent(env, max_revisions=1)})
    env.daemon().wait_ready()
    env.drop(order("REVISE-4"))
    in_review(env, "REVISE-4", 1)
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "revise", "-", "--note", "shorter"],
        input="REVISE-4\n", capture_output=True, text=True, timeout=60, cwd=env.tmp, env=cli_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    in_review(env, "REVISE-4", 2)
    refused = env.cli("revise", "REVISE-4", "--note", "again")
    assert refused.returncode == 1 and refused.stderr.strip() == "REVISE-4: has had 1 revisions (max_revisions 1)"


@pytest.mark.parametrize("fault", ["revise.noted", "revise.requested"])
def test_a_revise_command_killed_midway(env: Env, fault: str) -> None:
    """kill -9 of `revise` after its note / after its request: a new revise (or the daemon) finishes it, once."""
    env.configure(agents={"worker": agent(env)})
    env.daemon().wait_ready()
    env.drop(order("CRASH-1"))
    in_review(env, "CRASH-1", 1)
    assert cli(env, "revise", "CRASH-1", "--note", NOTE, fault=fault).returncode == -9
    if fault == "revise.noted":  # no request was recorded: nothing happens until the person tries again
        assert env.cli("revise", "CRASH-1", "--note", NOTE).returncode == 0
    result = in_review(env, "CRASH-1", 2)
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    feedback = json.loads((env.root / "review" / "CRASH-1" / "work" / "feedback.json").read_text())
    assert feedback["note"] == NOTE


@pytest.mark.parametrize("fault", ["revise.claimed", "revise.feedback", "revise.moved"])
def test_a_daemon_killed_while_carrying_out_a_revise(env: Env, fault: str) -> None:
    """kill -9 of the daemon at each step of a revision: the next daemon carries it out exactly once."""
    env.configure(agents={"worker": agent(env)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CRASH-2"))
    in_review(env, "CRASH-2", 1)
    d.stop()
    crashing = env_daemon(env, {"DISPATCHER_FAULT": fault})
    crashing.wait_ready()
    env.cli("revise", "CRASH-2", "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    row = next(r for r in listed if r["job_id"] == "CRASH-2")  # between the steps: still the agent's job, of an age
    assert row["agent"] == "worker" and row["age_s"] is not None, row
    again = env.daemon()
    again.wait_ready()
    result = in_review(env, "CRASH-2", 2)
    # one job.revised line for the revision, whichever daemon carried it out (section 14: job.revised is logged)
    revised = [e for e in crashing.events() + again.events() if e.get("event") == "job.revised"]
    assert [(e["job_id"], e["note"]) for e in revised] == [("CRASH-2", NOTE)], revised
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert [s for s in env.starts() if s[0] == "CRASH-2"] == [("CRASH-2", 1), ("CRASH-2", 2)]
    folder = env.root / "review" / "CRASH-2"
    assert json.loads((folder / "work" / "feedback.json").read_text())["note"] == NOTE
    assert (folder / "attempts" / "1" / "revision.json").exists()
    assert cli(env, "revise", "CRASH-2", "--note", "x").returncode == 0  # max_revisions 5: one more is fine


def test_a_revision_cut_before_its_request_was_cleared_and_adopted_by_a_live_daemon_runs_once(env: Env) -> None:
    """kill -9 at `revise.moved` (the job in active/, its request still open), then a live daemon adopts the job
    before its request pass looks at it: the adoption clears the request and logs the revision, so the job runs
    one attempt more and not two (the request was taken again once the job was back in review/)."""
    env.configure(agents={"worker": agent(env)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CRASH-3"))
    in_review(env, "CRASH-3", 1)
    d.stop()
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "revise.moved"})
    crashing.wait_ready()
    env.cli("revise", "CRASH-3", "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    cfg = load_config(env.config_path)
    ledger = open_ledger(cfg, Layout(cfg.root), patience_s=10)
    try:  # the live daemon's recovery pass: it adopts the dead daemon's job in active/
        ledger.register(DaemonInfo("vm-live", os.getpid(), "localhost", time.time()))
        with capture_logs() as logs:
            [(job_id, _, _)] = recovery.orphans(Layout(cfg.root), ledger, ledger.alive)
        assert job_id == "CRASH-3" and ledger.requests(Request.REVISE) == []
    finally:
        ledger.close()
    assert [(e["event"], e["note"], e["step"]) for e in logs] == [("job.revised", NOTE, "recovered")]
    again = env.daemon()
    again.wait_ready()
    result = in_review(env, "CRASH-3", 2)
    time.sleep(1.5)  # a second revision, if the request were still open, would start within a rescan
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert [s for s in env.starts() if s[0] == "CRASH-3"] == [("CRASH-3", 1), ("CRASH-3", 2)]
    assert not [e for e in again.events() if e.get("event") == "job.revised"]
    assert (env.root / "review" / "CRASH-3").is_dir()


def test_revise_of_a_failed_job_whose_retry_a_dead_daemon_cut_short_is_refused_for_the_retry(env: Env) -> None:
    """A failed job takes one of retry and revise at a time. The daemon carrying out a retry is killed right after it
    claimed the job (the folder still in failed/, the request open): `revise` is refused for the retry, exit 1, and
    the next start carries out the retry alone (the revision was recorded and ran a third attempt)."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=1)})
    env.drop(order("BOTH-1"))
    assert env.cli("run", "--once").returncode == 1
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "retry.claimed"})
    crashing.wait_ready()
    env.cli("retry", "BOTH-1", check=True)
    assert crashing.wait(60) == -9
    assert (env.root / "failed" / "BOTH-1").is_dir()
    refused = env.cli("revise", "BOTH-1", "--note", NOTE)
    assert refused.returncode == 1, refused.stdout
    assert refused.stderr == "BOTH-1: a retry is already requested; cancel it first to revise with a note\n"
    assert env.cli("run", "--once").returncode == 0
    result = env.result("BOTH-1", "done")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert [s for s in env.starts() if s[0] == "BOTH-1"] == [("BOTH-1", 1), ("BOTH-1", 2)]


def _revision_cut_at_its_claim(env: Env, job_id: str) -> None:
    """A reviewed job whose revision a daemon claimed and then died (its row claimed, the folder still in review/)."""
    env.configure(agents={"worker": agent(env)})
    env.drop(order(job_id))
    assert env.cli("run", "--once").returncode == 0
    in_review(env, job_id, 1)
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "revise.claimed"})
    crashing.wait_ready()
    env.cli("revise", job_id, "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    assert (env.root / "review" / job_id).is_dir()


def test_approve_of_a_job_whose_revision_a_dead_daemon_had_claimed_withdraws_it(env: Env) -> None:
    """With no daemon started since the revision's daemon died, `approve` withdraws the revision as for any job in
    review/ (it was refused: its ledger row is claimed, not review; and the revision then ran)."""
    _revision_cut_at_its_claim(env, "CUT-2")
    proc = env.cli("approve", "CUT-2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "CUT-2: approved; done; its requested revision is withdrawn\n"
    assert env.cli("run", "--once").returncode == 0
    assert (env.root / "done" / "CUT-2").is_dir()
    assert [s for s in env.starts() if s[0] == "CUT-2"] == [("CUT-2", 1)]


def test_a_revision_a_dead_daemon_cut_after_setting_the_result_aside_is_finished_by_a_daemon_whole(env: Env) -> None:
    """The daemon carrying out a revision died after it set result.json (and the outbox) aside (`revise.feedback`):
    with no daemon running `approve` says the revision is half done (exit 1: it landed the job with no checks, no
    attempts and no cost); the next daemon carries the revision out, and the job is whole, cost counted once."""
    env.configure(agents={"worker": agent(env)})
    env.drop(order("CUT-4"))
    assert env.cli("run", "--once").returncode == 0
    before = in_review(env, "CUT-4", 1)
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "revise.feedback"})
    crashing.wait_ready()
    env.cli("revise", "CUT-4", "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    assert not (env.root / "review" / "CUT-4" / "result.json").exists()
    proc = env.cli("approve", "CUT-4")
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr == "CUT-4: a revision its daemon died carrying out is half done; a daemon finishes it\n"
    assert env.cli("run", "--once").returncode == 0
    after = in_review(env, "CUT-4", 2)
    assert [a["n"] for a in after["attempts"]] == [1, 2]
    kept = json.loads((env.root / "review" / "CUT-4" / "attempts" / "1" / "result.json").read_text())
    assert kept["checks"] == before["checks"] and kept["received"] == before["received"]
    assert env.cli("approve", "CUT-4").returncode == 0
    assert [s for s in env.starts() if s[0] == "CUT-4"] == [("CUT-4", 1), ("CUT-4", 2)]


@pytest.mark.parametrize("fault", ["revise.claimed", "revise.feedback"])
def test_approve_after_a_revision_cut_short_releases_the_reviewed_attempts_follow_up(env: Env, fault: str) -> None:
    """The reviewed attempt wrote a follow-up (reserved); a daemon carrying out a revision died before it moved the
    job: `approve` with no daemon running withdraws the revision and releases that follow-up, which runs (its row
    was deleted when the revision was claimed, and it was lost). Cut after the outbox was set aside, a daemon first
    carries the revision out; the new attempt's follow-up is released then."""
    child = json.dumps({"job_id": "CUT-6-C", "from": "worker", "to": "next", "task": "Go on.", "items": [{"id": "a"}]})
    env.configure(agents={"worker": env.agent("--followup", child, review=True), "next": env.agent()})
    env.drop(order("CUT-6"))
    assert env.cli("run", "--once").returncode == 0
    in_review(env, "CUT-6", 1)
    crashing = env_daemon(env, {"DISPATCHER_FAULT": fault})
    crashing.wait_ready()
    env.cli("revise", "CUT-6", "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    runs = [("CUT-6", 1)]
    if fault == "revise.feedback":  # the outbox was set aside: a daemon carries the revision out first
        assert env.cli("approve", "CUT-6").returncode == 1
        assert env.cli("run", "--once").returncode == 0
        in_review(env, "CUT-6", 2)
        runs.append(("CUT-6", 2))
    proc = env.cli("approve", "CUT-6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CUT-6: approved; done"), proc.stdout
    assert os.listdir(env.root / "inbox") == ["CUT-6-C.json"]
    assert env.cli("run", "--once").returncode == 0
    assert env.result("CUT-6-C", "done")["parent"] == "CUT-6"
    assert [s for s in env.starts() if s[0] == "CUT-6"] == runs


def test_a_cancel_asked_while_a_daemon_carried_out_a_revision_it_then_died_in_withdraws_it(env: Env) -> None:
    """`cancel` is recorded while a live daemon carries out a revision (it has claimed the job); that daemon then
    dies: the next start withdraws the revision, as the cancel asked, and the job stays in review/ (the cancel was
    dropped and the revision ran)."""
    env.configure(agents={"worker": agent(env)})
    env.drop(order("CUT-5"))
    assert env.cli("run", "--once").returncode == 0
    in_review(env, "CUT-5", 1)
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "revise.claimed"})
    crashing.wait_ready()
    env.cli("revise", "CUT-5", "--note", NOTE, check=True)
    assert crashing.wait(60) == -9
    cfg = load_config(env.config_path)
    ledger = open_ledger(cfg, Layout(cfg.root), patience_s=10)
    try:  # the cancel as it is recorded while the claiming daemon lives (it is dead here: recorded directly)
        ledger.request("CUT-5", Request.CANCEL)
    finally:
        ledger.close()
    assert env.cli("run", "--once").returncode == 0
    assert (env.root / "review" / "CUT-5").is_dir()
    assert [s for s in env.starts() if s[0] == "CUT-5"] == [("CUT-5", 1)]


def test_cancel_of_a_reviewed_job_whose_revision_a_dead_daemon_had_claimed_exits_1(env: Env) -> None:
    """`cancel` of a job in review/ exits 1 (approve or reject it), also when a dead daemon had claimed its revision:
    it said `cancel requested` and the revision ran all the same."""
    _revision_cut_at_its_claim(env, "CUT-3")
    proc = env.cli("cancel", "CUT-3")
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr == "CUT-3: is in review, only a queued or running job can be cancelled: approve or reject it\n"


@pytest.mark.parametrize(("action", "option"), [("revise", "--note"), ("reject", "--reason")])
def test_a_note_or_reason_that_is_no_utf8_is_refused_in_one_line(env: Env, action: str, option: str) -> None:
    """`--note $'\\xff'` (bytes that are no UTF-8) is bad input: exit 2, one line naming the option, and nothing
    recorded: it would reach feedback.json and the log as a lone surrogate no UTF-8 reader takes (section 2)."""
    env.configure(agents={"worker": agent(env)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BYTES-1"))
    in_review(env, "BYTES-1", 1)
    argv = [os.fsencode(sys.executable), b"-m", b"dispatcher", b"--config", os.fsencode(env.config_path)]
    proc = subprocess.run(
        [*argv, action.encode(), b"BYTES-1", option.encode(), b"bad \xff byte"],
        capture_output=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode() == f"{action}: {option}: is not valid UTF-8 text\n"
    time.sleep(1.0)
    assert (env.root / "review" / "BYTES-1").is_dir()  # nothing was done
    assert not [e for e in d.events() if e.get("event") in ("job.revised", "job.rejected")]


def test_a_revision_under_way_on_a_slow_disk_logs_job_revised_once(env: Env) -> None:
    """Revisions carried out while every fsync takes 100 ms (a slow disk, by strace's fault injection): the
    daemon's own revision, moved into active/ but its request not yet cleared, is not taken for one a crash cut
    short: one `job.revised` line per revision (section 14), never a second `step: recovered` one."""
    env.configure(agents={"worker": agent(env)}, rescan_interval=1)
    d = env.daemon()
    d.wait_ready()
    jobs = [f"SLOW-{i}" for i in range(6)]
    for job_id in jobs:
        env.drop(order(job_id))
    for job_id in jobs:
        in_review(env, job_id, 1)
    assert d.stop() == 0
    out = env.tmp / "slow.log"
    with out.open("wb") as fh:
        slow = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync,fdatasync",
             "-e", "inject=fsync,fdatasync:delay_exit=100000",
             sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run"],
            stdout=fh, stderr=subprocess.STDOUT, cwd=env.tmp, env=cli_env(),
        )  # fmt: skip

    def events() -> list[dict[str, Any]]:
        return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]

    try:
        wait_until(lambda: any(e["event"] == "daemon.ready" for e in events()), 60, "the slow daemon")
        for job_id in jobs:
            env.cli("revise", job_id, "--note", NOTE, check=True)
            time.sleep(0.3)
        for job_id in jobs:
            in_review(env, job_id, 2)
    finally:
        daemon = subprocess.run(["pgrep", "-P", str(slow.pid)], capture_output=True, text=True).stdout.split()
        for pid in daemon:
            os.kill(int(pid), 15)  # the daemon under strace
        slow.wait(60)
    revised = [e["job_id"] for e in events() if e["event"] == "job.revised"]
    assert sorted(revised) == jobs, revised


SPENDS_AND_FAILS = """import json, os, sys
order = json.load(open(os.environ["DISPATCH_ORDER"]))
ids = [i["id"] for i in order["items"]]
json.dump({"job_id": order["job_id"], "input_ids": ids, "output_ids": [], "status": "done"}, open("receipt.json", "w"))
print(json.dumps({"type": "result", "total_cost_usd": 0.1}))
sys.exit(1)
"""


def test_max_revisions_counts_revisions_that_ran_no_attempt(env: Env) -> None:
    """A revision of a job whose budget is spent fails at once, without an attempt: it still counts, so the
    revise past max_revisions exits 1 (each revision was logged as revision 1 and accepted for ever)."""
    script = env.tmp / "spends.py"
    script.write_text(SPENDS_AND_FAILS)
    spec = {"command": [sys.executable, str(script)], "max_attempts": 1, "max_revisions": 2, "max_cost_usd": 0.05}
    env.configure(agents={"coder": spec})
    d = env.daemon()
    d.wait_ready()
    body = order("SPENT")
    del body["accept"]
    env.drop({**body, "to": "coder"})
    env.wait_job("SPENT", "failed")
    for n in (1, 2):
        env.cli("revise", "SPENT", "--note", f"revision {n}", check=True)
        wait_until(lambda n=n: sum(e.get("event") == "job.revised" for e in d.events()) == n, 60, f"revision {n}")
        wait_until(lambda: (env.root / "failed" / "SPENT" / "result.json").exists(), 60, "SPENT failed again")
    third = env.cli("revise", "SPENT", "--note", "revision 3")
    assert (third.returncode, third.stderr) == (1, "SPENT: has had 2 revisions (max_revisions 2)\n")
    assert [e["revision"] for e in d.events() if e.get("event") == "job.revised"] == [1, 2]
    assert d.stop() == 0


def test_retry_of_a_failed_job_whose_revision_a_dead_daemon_cut_short_is_refused_for_the_revision(env: Env) -> None:
    """A daemon killed right after it claimed a revision of a failed job leaves the folder in failed/ with its row
    claimed: `retry` of it is refused because the revision is asked already (a failed job takes one of the two), not
    for the row, and the next start carries out the revision, one run more."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    crashing = env_daemon(env, {"DISPATCHER_FAULT": "revise.claimed"})
    crashing.wait_ready()
    env.drop(order("CUT-1"))
    env.wait_job("CUT-1", "failed")
    env.cli("revise", "CUT-1", "--note", "again", check=True)
    assert crashing.wait(60) == -9
    assert (env.root / "failed" / "CUT-1").is_dir()
    retried = env.cli("retry", "CUT-1")
    assert retried.returncode == 1, retried.stdout
    assert retried.stderr == "CUT-1: a revision is already requested; it runs the job again\n"
    again = env.daemon()
    again.wait_ready()
    wait_until(lambda: [j for j, _ in env.starts()].count("CUT-1") >= 2, 60, "CUT-1 run again")
    assert again.stop() == 0


SEES_FEEDBACK = """import json, os, sys
from pathlib import Path
n = int(os.environ["DISPATCH_ATTEMPT"])
given = Path("feedback.json")
with open(sys.argv[1], "a") as log:
    log.write(json.dumps([n, json.loads(given.read_text()) if given.exists() else None]) + "\\n")
plan = json.loads(sys.argv[2])
if plan.get(str(n)) == "bad-output":  # a receipt whose outputs fail their checks: a repair follows
    Path("receipt.json").write_text(json.dumps({"job_id": os.environ["DISPATCH_JOB_ID"], "status": "done",
                                                "inputs": ["i1"], "outputs": ["nope"]}))
    sys.exit(0)
if plan.get(str(n)) == "sleep":  # to be cut short by its daemon's crash
    import time
    time.sleep(60)
sys.exit(3)
"""


def _seen(env: Env) -> list[tuple[int, Any]]:
    """Return, per attempt, the feedback.json the agent found in work/ (None: none)."""
    path = env.tmp / "seen.log"
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def _sees_feedback(env: Env, plan: dict[str, str], **settings: Any) -> dict[str, Any]:
    script = env.tmp / "sees_feedback.py"
    script.write_text(SEES_FEEDBACK)
    return {"command": [sys.executable, str(script), str(env.tmp / "seen.log"), json.dumps(plan)], "timeout": 30,
            **settings}  # fmt: skip


def test_a_retry_after_a_revision_gets_no_feedback_json_and_the_note_is_kept_with_its_attempt(env: Env) -> None:
    """revise gives attempt 2 the note in work/feedback.json; a later `retry` (the agent has no repair) gives
    attempt 3 none: the note is kept in attempts/2/ (section 6: earlier leftovers are moved aside before an attempt).
    Attempt 3 found the reviewer's old note."""
    env.configure(agents={"worker": _sees_feedback(env, {})})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FB-1", items=[{"id": "i1"}]))
    env.wait_job("FB-1", "failed")
    env.cli("revise", "FB-1", "--note", "use the 2026 rates", check=True)
    wait_until(lambda: len(_seen(env)) == 2 and (env.root / "failed" / "FB-1").is_dir(), 60, "the revision's end")
    env.cli("retry", "FB-1", check=True)
    wait_until(lambda: len(_seen(env)) == 3, 60, "the retry's attempt")
    result = env.wait_job("FB-1", "failed")
    seen = _seen(env)
    assert seen[0] == (1, None) and seen[1][1]["note"] == "use the 2026 rates", seen
    assert seen[2] == (3, None), seen
    kept = json.loads((env.root / "failed" / "FB-1" / "attempts" / "2" / "feedback.json").read_text())
    assert kept["note"] == "use the 2026 rates"
    assert {c["name"]: c["ok"] for c in result["checks"]}["writes_scope"] is True, result["checks"]
    assert d.stop() == 0


@pytest.mark.parametrize("repair", [True, False])
def test_a_retry_after_an_exit_gets_the_failed_checks_in_feedback_json_with_repair(env: Env, repair: bool) -> None:
    """Section 3's repair: "on a retry after failed checks, give the agent work/feedback.json". A non-zero exit fails
    exit_ok, a check like the others: with repair, attempt 2 after attempt 1's exit 3 finds feedback.json naming it
    (and the receipt's own failures); without repair it finds none."""
    env.configure(agents={"worker": _sees_feedback(env, {}, repair=repair, retry_safe=True, max_attempts=2)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FB-X", items=[{"id": "i1"}]))
    env.wait_job("FB-X", "failed")
    seen = _seen(env)
    assert [n for n, _ in seen] == [1, 2] and seen[0][1] is None, seen
    if not repair:
        assert seen[1][1] is None, seen
    else:
        assert seen[1][1]["attempt"] == 1 and seen[1][1]["job_id"] == "FB-X", seen
        failed = {c["name"]: c for c in seen[1][1]["failed_checks"]}
        assert failed["exit_ok"]["ok"] is False and "3" in failed["exit_ok"]["detail"], failed
    assert d.stop() == 0


def test_a_retry_after_an_attempt_a_crash_cut_short_gets_no_feedback_json_with_repair(env: Env) -> None:
    """repair gives feedback "on a retry after failed checks": an attempt cut short by its daemon's kill -9 failed no
    check of its agent's doing, so the attempt the next daemon runs finds no feedback.json blaming it for the receipt
    it had no time to write."""
    env.configure(agents={"worker": _sees_feedback(env, {"1": "sleep"}, repair=True, retry_safe=True, max_attempts=2)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FB-CUT", items=[{"id": "i1"}]))
    wait_until(lambda: len(_seen(env)) == 1, 60, "attempt 1's start")
    d.kill()
    d2 = env.daemon()
    env.wait_job("FB-CUT", "failed")
    seen = _seen(env)
    assert seen == [(1, None), (2, None)], seen
    assert d2.stop() == 0


def test_a_repair_agent_retried_after_its_repair_attempt_exits_1_gets_no_stale_feedback(env: Env) -> None:
    """repair: attempt 1's outputs fail their checks, attempt 2 gets feedback.json and exits 3, attempt 3 (a retry
    after failed checks: exit_ok) gets a new one naming attempt 2's checks, never attempt 1's again."""
    accept = {"output": "out.csv"}
    env.configure(agents={"worker": _sees_feedback(env, {"1": "bad-output"}, repair=True, retry_safe=True,
                                                   max_attempts=3)}, retry_delay=0.1)  # fmt: skip
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FB-2", items=[{"id": "i1"}], accept=accept))
    result = env.wait_job("FB-2", "failed")
    seen = _seen(env)
    assert [n for n, _ in seen] == [1, 2, 3], seen
    assert seen[0][1] is None and seen[1][1] is not None and seen[1][1]["attempt"] == 1, seen
    assert seen[2][1] is not None and seen[2][1]["attempt"] == 2, seen
    assert "exit_ok" in [c["name"] for c in seen[2][1]["failed_checks"]], seen
    assert {c["name"]: c["ok"] for c in result["checks"]}["writes_scope"] is True, result["checks"]
    assert d.stop() == 0
