"""Section 15 hooks: before (each attempt, in the workspace), after (once final), land (exactly once after done)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, namespaced_daemon, order, wait_until
from git_helpers import code_order, coder, git, make_repo, starts
from helpers_faults import alive, count_events, env_daemon

from dispatcher.job import afterowed, hooks, landing, owed
from dispatcher.layout import Layout

LAND = 'echo "{job_id} {branch} {head} $(pwd)" >> "$0"'


def _land(log: Path, *extra: str) -> list[str]:
    """Return a land hook that appends `job_id branch head cwd` to log."""
    return ["sh", "-c", LAND + "".join(extra), str(log)]


def test_before_runs_in_the_workspace_each_attempt_and_its_failure_fails_the_attempt(env: Env, tmp_path: Path) -> None:
    """A before hook that fails gives the attempt its reason; with attempts left the job runs again."""
    repo = make_repo(tmp_path / "shop")
    seen = tmp_path / "before.txt"
    # fails on its first run (no mark yet), passes on the second; records where it ran
    script = 'pwd >> "$0"; echo "$DISPATCH_ATTEMPT" >> "$0.n"; '
    script += '[ -e "$0.mark" ] || { touch "$0.mark" src/hooked.txt; echo "no deps" >&2; exit 3; }'
    hook = ["sh", "-c", script, str(seen)]
    agent = coder(env, repo, "--write", "src/{job}.txt=x", before=hook, max_attempts=2)
    env.configure(agents={"coder": agent})
    env.drop(code_order("B1"))
    d = env.daemon()
    result = env.wait_job("B1", "done")
    d.stop()
    tree = str(env.root / ".state" / "worktrees" / "B1")
    assert seen.read_text().split() == [tree, tree]
    assert Path(f"{seen}.n").read_text().split() == ["1", "2"], "DISPATCH_ATTEMPT is the attempt the hook serves"
    assert [(j, n) for j, n, _ in starts(env)] == [("B1", 2)]  # the agent never ran in attempt 1
    assert result["attempts"][0]["before"] == "before hook exited 3: no deps"
    first = env.job_dir("B1", "done") / "attempts" / "1"
    assert (first / "before-stderr.log").read_text() == "no deps\n"
    # an attempt like any other (sections 1 and 15): its two logs (empty: no agent ran) and its change
    assert (first / "stdout.log").read_text() == (first / "stderr.log").read_text() == ""
    assert (first / "changed.txt").read_text().split() == ["src/hooked.txt"]
    assert "src/hooked.txt" in (first / "diff.patch").read_text()


def test_show_gives_an_attempt_its_before_hook_failed_its_reason_the_hooks_logs_and_stderr(
    env: Env, tmp_path: Path
) -> None:
    """`show` counts an attempt whose before hook failed as failed: the hook's reason, its log paths, its stderr."""
    repo = make_repo(tmp_path / "shop")
    hook = ["sh", "-c", '[ "$DISPATCH_ATTEMPT" = 1 ] || exit 0; echo "no deps" >&2; exit 1']
    agent = coder(env, repo, "--write", "src/{job}.txt=x", before=hook, max_attempts=2, retry_safe=True)
    env.configure(agents={"coder": agent})
    env.drop(code_order("S1"))
    d = env.daemon()
    env.wait_job("S1", "done")
    d.stop()
    first = env.job_dir("S1", "done") / "attempts" / "1"
    one, two = json.loads(env.cli("show", "S1", "--json", check=True).stdout)["attempts"]
    assert one["before"] == "before hook exited 1: no deps"
    assert one["logs"]["before_stderr"] == str(first / "before-stderr.log")
    assert one["logs"]["before_stdout"] == str(first / "before-stdout.log")
    assert one["stderr_tail"] == ["no deps"]
    assert "stderr_tail" not in two and "before_stderr" not in two["logs"]
    text = env.cli("show", "S1", check=True).stdout
    assert "        before: before hook exited 1: no deps\n" in text, text
    assert f"        logs: {first / 'before-stdout.log'}\n              {first / 'before-stderr.log'}\n" in text, text
    assert "        before hook's stderr, the last line:\n          | no deps\n" in text, text


@pytest.mark.parametrize(
    ("hook", "reason"),
    [
        (["sh", "-c", "echo missing tool >&2; exit 1"], "before hook exited 1: missing tool"),
        (["sh", "-c", "kill -KILL $$"], "before hook killed by SIGKILL"),  # a signal is named, never `exited -9`
    ],
    ids=["exit-1", "sigkill"],
)
def test_a_before_hook_failure_with_no_attempt_left_fails_the_job_with_its_reason(
    env: Env, tmp_path: Path, hook: list[str], reason: str
) -> None:
    """With one attempt, a failing before hook fails the job; the reason says which hook and how it ended (a signal
    by its name, as an agent's exit_ok names one)."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, before=hook)
    env.configure(agents={"coder": agent})
    env.drop(code_order("B2"))
    d = env.daemon()
    result = env.wait_job("B2", "failed")
    d.wait_event("hook.failed", hook="before", job_id="B2")
    d.stop()
    assert result["reason"] == f"{reason}; not retried: no attempts left"
    assert starts(env) == []


def test_a_hook_a_stop_or_cancel_ended_says_so() -> None:
    """A hook the daemon's stop ended says so (a land hook: how to run it again); a cancel too; a hook that ended
    itself by a signal names the signal."""
    run = hooks.HookRun("land", ("sleep", "60"), -15, False, 0.0, 1.0, "", aborted="stopped")
    assert run.why == "land hook ended by the daemon's stop (killed by SIGTERM); `dispatcher land ID` runs it again"
    run = hooks.HookRun("before", ("sleep", "60"), -9, False, 0.0, 1.0, "", aborted="cancelled")
    assert run.why == "before hook ended by a cancel (killed by SIGKILL)"
    run = hooks.HookRun("after", ("x",), -15, False, 0.0, 1.0, "bye")
    assert run.why == "after hook killed by SIGTERM: bye"
    assert hooks.HookRun("after", ("x",), 4, False, 0.0, 1.0, "").why == "after hook exited 4"


def test_a_before_hook_failing_the_last_attempt_records_its_checks_as_not_run(env: Env, tmp_path: Path) -> None:
    """Attempt 1 runs and fails its checks; attempt 2's before hook fails: the job fails with the hook's reason,
    and result.json says every check was not run on attempt 2 (null, with why), so that no false check of attempt 1
    stands beside a reason that names none (section 5: the reason starts with the first failing check)."""
    repo = make_repo(tmp_path / "shop")
    hook = ["sh", "-c", '[ "$DISPATCH_ATTEMPT" = 1 ] || { echo gone >&2; exit 4; }']
    agent = coder(env, repo, "--exit", "1", before=hook, max_attempts=2, retry_safe=True)
    env.configure(agents={"coder": agent})
    env.drop(code_order("B9"))
    d = env.daemon()
    result = env.wait_job("B9", "failed")
    d.stop()
    assert result["reason"] == "before hook exited 4: gone; not retried: no attempts left"
    assert {c["ok"] for c in result["checks"]} == {None}
    assert {c["detail"] for c in result["checks"]} == {"not run: attempt 2 ran no agent: its before hook failed"}
    assert len(result["checks"]) == 10


def test_after_runs_once_when_final_and_never_changes_the_state(env: Env, tmp_path: Path) -> None:
    """An after hook that fails is recorded and logged (hook.failed); the job stays done."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "after.txt"
    hook = ["sh", "-c", 'echo "{job_id} {branch} {head} {result} $(pwd)" >> "$0"; exit 4', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=hook)})
    env.drop(code_order("A1"))
    d = env.daemon()
    result = env.wait_job("A1", "done")
    record = wait_until(lambda: list((env.job_dir("A1", "done") / "hooks").glob("after-*.json")), what="after record")
    d.wait_event("hook.failed", hook="after", job_id="A1")
    d.stop()
    head = result["workspace"]["head"]
    done = env.job_dir("A1", "done")
    tree = env.root / ".state" / "worktrees" / "A1"
    assert log.read_text().split() == ["A1", "dispatch/A1", head, str(done / "result.json"), str(tree)]
    assert [p.name for p in record] == ["after-1.json"]
    assert json.loads(record[0].read_text())["detail"] == "after hook exited 4"
    assert env.result("A1", "done")["state"] == "done"


def test_an_after_hook_cut_short_by_a_kill_is_recorded_as_interrupted_and_not_run_again(
    env: Env, tmp_path: Path
) -> None:
    """kill -9 while a done job's after hook runs: the next start records it as failed (interrupted), once."""
    repo = make_repo(tmp_path / "shop")
    count = tmp_path / "after.count"
    hook = ["sh", "-c", 'echo run >> "$0"; sleep 5', str(count)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=hook)})
    env.drop(code_order("K1"))
    d = env.daemon()
    env.wait_job("K1", "done")
    wait_until(count.exists, 30, "the after hook to start")
    d.kill()
    proc = env.cli("run", "--once", timeout=60)
    assert '"hook.failed"' in proc.stdout and "interrupted" in proc.stdout, proc.stdout[-2000:]
    records = sorted((env.job_dir("K1", "done") / "hooks").glob("after-*.json"))
    assert [p.name for p in records] == ["after-1.json"]
    record = json.loads(records[0].read_text())
    assert record["ok"] is False and "interrupted" in record["detail"] and record["state"] == "done", record
    assert count.read_text() == "run\n", "the after hook ran twice"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = next(e for e in lines if e["event"] == "hook.failed")
    ended = next(e for e in lines if e["event"] == "hook.orphan_ended")  # its sleep ended, not left to run on
    assert (failed["agent"], ended["hook"], ended["agent"]) == ("coder", "after", "coder")
    events = [e["event"] for e in lines]  # the worktree it ran in goes only once the hook is ended
    assert "workspace.removed" in events and events.index("hook.orphan_ended") < events.index("workspace.removed")


AFTER = 'echo "{job_id} [{branch}] [{head}] {result} $(pwd)" >> "$0"'


def test_after_runs_in_work_for_a_job_cancelled_while_it_was_claimed(env: Env, tmp_path: Path) -> None:
    """A job cancelled in its claim never gets a workspace, but its after hook still runs once, in its work/ folder."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "after.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=["sh", "-c", AFTER, str(log)])})
    env.drop(code_order("C1"))
    assert env.cli("cancel", "C1").returncode == 0  # no daemon yet: the claim's transaction meets the request
    assert env.cli("run", "--once", timeout=120).returncode == 1
    failed = env.job_dir("C1", "failed")
    assert env.result("C1", "failed")["reason"] == "cancelled"
    assert log.read_text().split() == ["C1", "[]", "[]", str(failed / "result.json"), str(failed / "work")]
    record = sorted((failed / "hooks").glob("after-*.json"))
    assert [p.name for p in record] == ["after-1.json"] and json.loads(record[0].read_text())["ok"] is True
    assert starts(env) == [] and not (env.root / ".state" / "worktrees" / "C1").exists()
    assert "dispatch/C1" not in git(repo, "branch", "--list")


def _join_whose_parent_fails(env: Env, tmp_path: Path, job_id: str, parent: str) -> Path:
    """Queue a join (coder, with an after hook that logs to the returned file) whose parent's agent exits 1."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "after.txt"
    agents = {
        "worker": env.agent("--exit", "1"),
        "coder": coder(env, repo, "--write", "src/a.txt=x", after=["sh", "-c", AFTER, str(log)]),
    }
    env.configure(agents=agents)
    env.drop(code_order(job_id, after=[parent]))
    env.drop({**code_order(parent, to="worker"), "accept": {"output": "out.csv"}})
    return log


def test_after_runs_for_a_join_that_fails_because_its_parent_failed(env: Env, tmp_path: Path) -> None:
    """A joined job failed in waiting/ (`after: P failed`) is final: its after hook runs once, in its work/ folder."""
    log = _join_whose_parent_fails(env, tmp_path, "J2", "P2")
    assert env.cli("run", "--once", timeout=120).returncode == 1
    failed = env.job_dir("J2", "failed")
    assert env.result("J2", "failed")["reason"] == "after: P2 failed"
    assert log.read_text().split() == ["J2", "[]", "[]", str(failed / "result.json"), str(failed / "work")]
    assert [p.name for p in (failed / "hooks").glob("after-*.json")] == ["after-1.json"]


def test_a_kill_before_the_after_hook_of_a_failed_join_leaves_it_owed_to_the_next_start(
    env: Env, tmp_path: Path
) -> None:
    """kill -9 once a join failed in waiting/ (its parent failed) and before its after hook started: the next start
    runs the hook once (section 15: once the job is final), and a later start runs it no more."""
    log = _join_whose_parent_fails(env, tmp_path, "J3", "P3")
    d = env_daemon(env, {"DISPATCHER_FAULT": "after.before"})
    assert d.wait(120) == -signal.SIGKILL
    assert env.result("J3", "failed")["reason"] == "after: P3 failed" and not log.exists()
    for _ in range(2):
        d2 = env.daemon()
        d2.wait_ready()
        wait_until(lambda: log.exists(), 60, "the after hook")
        assert d2.stop() == 0
    failed = env.job_dir("J3", "failed")
    assert log.read_text().split() == ["J3", "[]", "[]", str(failed / "result.json"), str(failed / "work")]
    records = sorted((failed / "hooks").glob("after-*.json"))
    assert [json.loads(r.read_text())["ok"] for r in records] == [True]


def test_land_runs_once_after_done_in_the_repository(env: Env, tmp_path: Path) -> None:
    """A done job's land hook runs exactly once, in the repository, with the branch and head; job.landed is logged."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=_land(log))})
    env.drop(code_order("L1"))
    env.drop(code_order("L2", to="coder"))
    d = env.daemon()
    heads = {j: env.wait_job(j, "done")["workspace"]["head"] for j in ("L1", "L2")}
    d.wait_event("job.landed", job_id="L1")
    d.wait_event("job.landed", job_id="L2")
    d.stop()
    lines = sorted(log.read_text().splitlines())
    assert lines == [f"{j} dispatch/{j} {heads[j]} {repo}" for j in ("L1", "L2")]
    assert git(repo, "rev-parse", "dispatch/L1") == heads["L1"]


def test_land_names_the_repository_as_its_workspace(env: Env, tmp_path: Path) -> None:
    """The worktree is gone when land runs in the repository: {workspace} and DISPATCH_WORKSPACE name the repository."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    hook = ["sh", "-c", 'echo "$1 $DISPATCH_WORKSPACE $(pwd)" >> "$0"', str(log), "{workspace}"]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)})
    env.drop(code_order("L1"))
    d = env.daemon()
    env.wait_job("L1", "done")
    d.wait_event("job.landed", job_id="L1")
    d.stop()
    assert log.read_text().split() == [str(repo)] * 3


def test_land_exactly_once_across_a_kill_between_done_and_landed(env: Env, tmp_path: Path) -> None:
    """Killed after the job is done and before its land hook ran: the next start lands it, once, and never again."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=_land(log))})
    env.drop(code_order("X1"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "land.before"})
    assert d.wait() == -signal.SIGKILL
    assert (env.job_dir("X1", "done") / "result.json").exists() and not log.exists()
    d2 = env.daemon()
    d2.wait_event("job.landed", job_id="X1")
    d2.stop()
    d3 = env.daemon()
    d3.wait_ready()
    d3.stop()
    assert len(log.read_text().splitlines()) == 1
    assert count_events(d3, "job.landed") == 0


@pytest.mark.parametrize("point", ["landing.ended", "landing.recorded"])
def test_a_kill_after_the_land_hook_ended_keeps_its_one_record(env: Env, tmp_path: Path, point: str) -> None:
    """Killed once the land hook ended, before its marker went: the restart keeps the one ok landing record,
    lands nothing again, logs no land.failed, and logs the job.landed line the dead daemon never wrote."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=_land(log))})
    env.drop(code_order("X3"))
    d = env_daemon(env, {"DISPATCHER_FAULT": point})
    assert d.wait() == -signal.SIGKILL
    d2 = env.daemon()
    d2.wait_ready()
    d2.stop()
    records = sorted((env.job_dir("X3", "done") / "land").glob("*.json"))
    assert [json.loads(r.read_text())["ok"] for r in records] == [True]
    assert count_events(d2, "land.failed") == 0 and len(log.read_text().splitlines()) == 1
    assert list((env.root / ".state" / "landing").iterdir()) == []
    landed = [e for e in d2.events() if e["event"] == "job.landed"]
    head = env.result("X3", "done")["workspace"]["head"]
    assert [(e["job_id"], e["agent"], e["head"]) for e in landed] == [("X3", "coder", head)]


@pytest.mark.parametrize("point", ["after.ended", "after.recorded"])
def test_a_kill_after_a_failed_after_hook_ended_logs_its_hook_failed_once(env: Env, tmp_path: Path, point: str) -> None:
    """Killed once a failing after hook ended, before its marker went: the restart keeps its one record and logs
    the hook.failed line the dead daemon never wrote, once; the hook does not run again."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "after.txt"
    hook = ["sh", "-c", 'echo ran >> "$0"; exit 4', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=hook)})
    env.drop(code_order("X4"))
    d = env_daemon(env, {"DISPATCHER_FAULT": point})
    assert d.wait() == -signal.SIGKILL
    assert count_events(d, "hook.failed") == 0
    d2 = env.daemon()
    d2.wait_ready()
    d2.stop()
    failed = [e for e in d2.events() if e["event"] == "hook.failed"]
    assert [(e["hook"], e["job_id"], e["agent"], e["reason"]) for e in failed] == [
        ("after", "X4", "coder", "after hook exited 4")
    ]
    records = sorted((env.job_dir("X4", "done") / "hooks").glob("after-*.json"))
    assert [json.loads(r.read_text())["ok"] for r in records] == [False]
    assert log.read_text().split() == ["ran"] and list((env.root / ".state" / "after").iterdir()) == []


def test_a_land_cut_short_is_not_run_again_but_land_runs_it(env: Env, tmp_path: Path) -> None:
    """Killed as the land hook starts: the restart records land.failed (never a second run); `land ID` runs it."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=_land(log))})
    env.drop(code_order("X2"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "land.started"})
    assert d.wait() == -signal.SIGKILL
    d2 = env.daemon()
    event = d2.wait_event("land.failed", job_id="X2")
    d2.stop()
    assert "interrupted" in event["reason"] and not log.exists()
    proc = env.cli("land", "X2")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "X2: landed\n", "")
    assert len(log.read_text().splitlines()) == 1


def test_an_attempt_a_crash_cut_in_its_before_hook_keeps_its_start_and_ran_no_argv(env: Env, tmp_path: Path) -> None:
    """kill -9 while the before hook runs: attempt 1 is interrupted, started when its hook did, and ran no agent."""
    repo = make_repo(tmp_path / "shop")
    mark = tmp_path / "before.txt"
    hook = ["sh", "-c", 'date +%s.%N >> "$0"; [ "$DISPATCH_ATTEMPT" = 1 ] && sleep 60; exit 0', str(mark)]
    agent = coder(env, repo, "--write", "src/a.txt=x", before=hook, max_attempts=2, retry_safe=True)
    env.configure(agents={"coder": agent}, retry_delay=0.1)
    env.drop(code_order("BC"))
    d = env.daemon()
    wait_until(lambda: mark.exists() and mark.read_text().strip(), what="the before hook's start")
    hook_started = float(mark.read_text().split()[0])
    time.sleep(2.0)  # the restart comes well after the hook's start
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("BC", "done")
    d2.stop()
    first = result["attempts"][0]
    assert first["interrupted"] is True and first["argv"] == []  # its agent never ran
    at = datetime.fromisoformat(first["started"].replace("Z", "+00:00")).timestamp()
    assert abs(at - hook_started) < 1.0, (first["started"], hook_started)
    assert [(j, n) for j, n, _ in starts(env)] == [("BC", 2)]


def test_a_land_hook_a_crash_left_running_is_ended_before_land_can_run_it_again(env: Env, tmp_path: Path) -> None:
    """kill -9 while the land hook runs: the next start ends its group first, so `land ID` never runs beside it."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    first = 'echo "start $$" >> "$0"; [ -e "$0.once" ] && exit 0; : > "$0.once"; sleep 60; echo end >> "$0"'
    hook = ["sh", "-c", first, str(log)]  # the first run sleeps, a later one ends at once
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)})
    env.drop(code_order("X4"))
    d = env.daemon()
    wait_until(lambda: log.exists() and log.read_text().startswith("start "))
    pid = int(log.read_text().split()[1])
    d.kill()
    assert alive(pid)  # the hook outlived its daemon
    d2 = env.daemon()
    ended = d2.wait_event("hook.orphan_ended", job_id="X4")
    d2.wait_event("land.failed", job_id="X4")
    d2.stop()
    assert (ended["hook"], ended["agent"], ended["pid"]) == ("land", "coder", pid)
    mine = [e for e in d2.events() if e.get("job_id") == "X4"]
    assert all(e.get("agent") == "coder" for e in mine), mine  # section 8: lines about a job carry its agent
    assert not alive(pid)
    proc = env.cli("land", "X4")
    assert (proc.returncode, proc.stdout) == (0, "X4: landed\n")
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["start", "start"], lines  # the first run never went on to its end


def test_a_land_hook_whose_daemon_died_is_not_taken_for_cut_short_by_a_daemon_that_cannot_see_it(
    env: Env, tmp_path: Path
) -> None:
    """Two daemons, the second in a pid namespace of its own (another host, or a container, sees none of the
    first's processes). kill -9 of the first while its land hook runs: the hook runs on, and the second neither
    records it as cut short nor lets `land ID` start beside it until it has ended; then it records it (once) and
    `land ID` runs it again, never beside the first run."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    first = 'echo "start $$" >> "$0"; [ -e "$0.once" ] && { echo end >> "$0"; exit 0; }; : > "$0.once"; sleep 8; '
    hook = ["sh", "-c", first + 'echo end >> "$0"', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)}, rescan_interval=1)
    d = env.daemon()
    env.drop(code_order("XH"))
    wait_until(lambda: log.exists() and log.read_text().startswith("start "), 60, "the land hook to start")
    pid = int(log.read_text().split()[1])
    other_log = tmp_path / "other.log"
    other = namespaced_daemon(env.config_path, other_log, tmp_path)
    try:

        def other_events(name: str) -> list[dict[str, Any]]:
            lines = [json.loads(x) for x in other_log.read_text().splitlines() if x.startswith("{")]
            return [e for e in lines if e.get("event") == name]

        wait_until(lambda: other_events("daemon.started"), 30, "the second daemon's start")
        d.kill()
        assert alive(pid)  # the hook outlived its daemon
        records = env.job_dir("XH", "done") / "land"
        landed = False
        while alive(pid):
            assert not list(records.glob("*.json")), "recorded as cut short while it still ran"
            assert not other_events("land.failed")
            proc = env.cli("land", "XH")
            if proc.returncode == 0:  # the hook ended just now: `land` recorded the cut run itself, then ran it
                assert proc.stdout == "XH: landed\n" and not alive(pid), (proc.stdout, proc.stderr)
                landed = True
                break
            assert proc.returncode == 1 and "is landing now" in proc.stderr, (proc.returncode, proc.stderr)
            time.sleep(0.3)
        if not landed:
            wait_until(lambda: other_events("land.failed"), 30, "the run recorded once it ended")
            proc = env.cli("land", "XH")
            assert (proc.returncode, proc.stdout) == (0, "XH: landed\n"), proc.stderr
        record, last = [json.loads((records / f"{k}.json").read_text()) for k in (1, 2)]
        assert record["ok"] is False and "interrupted" in record["detail"], record
        assert last["ok"] is True and not (records / "3.json").exists()  # recorded once, by the daemon or `land`
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(30)
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["start", "end", "start", "end"]


def test_a_land_command_killed_with_no_daemon_running_is_recorded_by_the_next_land_which_runs_it(
    env: Env, tmp_path: Path
) -> None:
    """`dispatcher land ID` killed with its hook while no daemon runs: the next `land ID` records that run as cut
    short (its land.failed line, in the log as a daemon's pass would write it) and runs the hook again, instead of
    answering "is landing now" until a daemon starts."""
    repo = make_repo(tmp_path / "shop")
    log, gate, daemon_log = tmp_path / "land.txt", tmp_path / "fixed", tmp_path / "d.log"
    script = f'echo "start $$" >> "$0"; [ -e {gate} ] || exit 1; [ -e "$0.once" ] && exit 0; : > "$0.once"; sleep 60'
    hook = ["sh", "-c", script, str(log)]  # fails until fixed; then its first run sleeps, the next lands at once
    notified = tmp_path / "notify.txt"
    notify = ["sh", "-c", 'echo "{event} {job_id} {reason}" >> "$0"', str(notified)]
    env.configure(
        agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)},
        log_file=str(daemon_log),
        notify=notify,
    )
    env.drop(code_order("LK"))
    d = env.daemon()
    d.wait_event("land.failed", job_id="LK")
    assert d.stop() == 0
    gate.touch()
    cmd = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "land", "LK"]
    land = subprocess.Popen(cmd, cwd=env.tmp, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: log.read_text().count("start") == 2, 60, "the land command's hook to start")
    hook_pid = int(log.read_text().split()[-1])
    land.kill()
    land.wait(30)
    os.killpg(hook_pid, signal.SIGKILL)  # the hook runs in a process group of its own
    wait_until(lambda: not alive(hook_pid), 30, "the hook's end")
    again = env.cli("land", "LK")
    assert (again.returncode, again.stdout, again.stderr) == (0, "LK: landed\n", "")
    records = env.job_dir("LK", "done") / "land"
    runs = [json.loads((records / f"{k}.json").read_text()) for k in (1, 2, 3)]
    assert [r["ok"] for r in runs] == [False, False, True] and "interrupted" in runs[1]["detail"], runs
    assert not (records / "4.json").exists()
    lines = [json.loads(x) for x in daemon_log.read_text().splitlines()]
    mine = [
        (e["event"], e.get("agent"))
        for e in lines
        if e.get("job_id") == "LK" and e["event"].startswith(("land", "job.landed"))
    ]
    assert mine == [("land.failed", "coder"), ("land.failed", "coder"), ("job.landed", "coder")], mine
    assert "interrupted" in [e for e in lines if e["event"] == "land.failed"][1]["reason"]
    assert log.read_text().count("start") == 3
    wait_until(
        lambda: notified.exists() and notified.read_text().count("\n") == 2,
        what="the cut run notified as a daemon's pass does",
    )
    first, cut = notified.read_text().splitlines()
    assert first == "land.failed LK land hook exited 1" and cut.startswith("land.failed LK ") and "interrupted" in cut


def test_a_land_hook_that_waits_for_a_child_in_a_session_of_its_own_lands(env: Env, tmp_path: Path) -> None:
    """A live daemon's land hook whose child runs in a session of its own (`setsid`, Python's
    `start_new_session`), waited for across the daemon's passes: nothing of it is ended, no `hook.orphan_ended`,
    and the job lands."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    child = "import subprocess; subprocess.run(['sleep', '3'], start_new_session=True, check=True)"
    hook = [
        "sh",
        "-c",
        f'"{sys.executable}" -c "{child}" || {{ echo killed >> "$0"; exit 1; }}; echo ok >> "$0"',
        str(log),
    ]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)}, rescan_interval=1)
    d = env.daemon()
    env.drop(code_order("SS1"))
    landed = d.wait_event("job.landed", job_id="SS1", timeout=60)
    assert landed["job_id"] == "SS1"
    assert log.read_text() == "ok\n"
    assert count_events(d, "hook.orphan_ended") == 0
    assert d.stop() == 0


def test_a_cut_land_hook_whose_child_cleared_its_environment_is_recorded_and_lands_again(
    env: Env, tmp_path: Path
) -> None:
    """kill -9 while the land hook runs, its child started as `setsid env -i` (no DISPATCH_* variables to find it
    by, and holding the hook's lock): the next start ends the hook's group and records the run as cut short
    at once, without waiting for that child, and `land ID` then runs the hook again."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    first = 'echo "start $$" >> "$0"; [ -e "$0.once" ] && exit 0; : > "$0.once"; setsid env -i sleep 60 & '
    first += 'echo "child $!" >> "$0"; sleep 60'
    hook = ["sh", "-c", first, str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)})
    env.drop(code_order("EI1"))
    d = env.daemon()
    wait_until(lambda: log.exists() and "child " in log.read_text(), 60, "the land hook and its child to start")
    child = int(log.read_text().split("child ")[1].split()[0])
    d.kill()
    d2 = env.daemon()
    try:
        d2.wait_event("land.failed", job_id="EI1", timeout=30)
        assert alive(child)  # recorded without waiting for it
        proc = env.cli("land", "EI1")
        assert (proc.returncode, proc.stdout) == (0, "EI1: landed\n"), proc.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert d2.stop() == 0


def test_a_failed_land_is_logged_and_notified_and_land_runs_it_again(env: Env, tmp_path: Path) -> None:
    """A land hook that fails logs land.failed and notifies; once fixed, `dispatcher land ID` lands the job."""
    repo = make_repo(tmp_path / "shop")
    log, gate, notified = tmp_path / "land.txt", tmp_path / "fixed", tmp_path / "notify.txt"
    hook = ["sh", "-c", f'[ -e {gate} ] || {{ echo "push rejected" >&2; exit 1; }}; ' + LAND, str(log)]
    results = tmp_path / "results.txt"
    notify = ["sh", "-c", 'echo "{event} {job_id} {reason}" >> "$0"; echo "{result}" >> "$1"', str(notified),
              str(results)]  # fmt: skip
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)}, notify=notify)
    env.drop(code_order("F1"))
    d = env.daemon()
    d.wait_event("land.failed", job_id="F1")
    wait_until(lambda: notified.exists() and "land.failed" in notified.read_text(), what="the notification")
    d.stop()
    assert notified.read_text() == "land.failed F1 land hook exited 1: push rejected\n"
    assert env.result("F1", "done")["state"] == "done"
    proc = env.cli("land", "F1")
    assert proc.returncode == 1 and proc.stderr == "F1: land failed: land hook exited 1: push rejected\n"
    wait_until(lambda: notified.read_text().count("\n") == 2, what="the failed `land` run notified too")
    assert notified.read_text() == "land.failed F1 land hook exited 1: push rejected\n" * 2
    wait_until(lambda: results.exists() and results.read_text().count("\n") == 2, what="both {result}s")
    assert results.read_text() == f"{env.job_dir('F1', 'done') / 'result.json'}\n" * 2  # the daemon's, then land's
    gate.touch()
    proc = env.cli("land", "F1")
    assert (proc.returncode, proc.stdout) == (0, "F1: landed\n")
    assert len(log.read_text().splitlines()) == 1
    assert sorted(p.name for p in (env.job_dir("F1", "done") / "land").glob("*.json")) == ["1.json", "2.json", "3.json"]
    again = env.cli("land", "F1")  # landed: the hook runs once, again only after it failed
    assert again.returncode == 1 and again.stderr.startswith("F1: landed already"), again.stderr
    assert len(log.read_text().splitlines()) == 1
    bad = env.cli("land", "NOPE")
    assert bad.returncode == 1 and bad.stderr == "NOPE: no such job\n"


def test_land_after_the_hook_was_fixed_in_the_config_runs_the_fixed_hook(env: Env, tmp_path: Path) -> None:
    """`dispatcher land ID` runs the land hook as the config has it now, as `retry` takes an agent's settings: a
    hook fixed after its landing failed takes effect (it ran the hook saved at the claim, failing again)."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "landed.log"
    broken = ["sh", "-c", 'echo "no such remote" >&2; exit 5']
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=broken)})
    env.drop(code_order("FX1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    proc = env.cli("land", "FX1")
    assert proc.returncode == 1 and proc.stderr == "FX1: land failed: land hook exited 5: no such remote\n"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=_land(log))})
    proc = env.cli("land", "FX1")
    assert (proc.returncode, proc.stdout) == (0, "FX1: landed\n"), proc.stderr
    head = env.result("FX1", "done")["workspace"]["head"]
    assert log.read_text() == f"FX1 dispatch/FX1 {head} {repo}\n"
    records = sorted((env.job_dir("FX1", "done") / "land").glob("*.json"), key=lambda p: int(p.stem))
    assert [json.loads(p.read_text())["ok"] for p in records] == [False, False, True]


def test_land_of_what_is_no_job_id_is_one_escaped_line_and_exit_1_as_retry(env: Env, tmp_path: Path) -> None:
    """`land` checks the id as `retry` does: a path to a done job, an odd byte or an escape is one line, exit 1."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    hook = ["sh", "-c", 'echo "$0" >> "$0"; exit 1', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=hook)})
    env.drop(code_order("L1"))
    d = env.daemon()
    d.wait_event("land.failed", job_id="L1")
    d.stop()
    for bad in ("L1/../../done/L1", ".", "\udcff", "a\x1b[31mred"):
        retry = env.cli("retry", bad)
        proc = env.cli("land", bad)
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", retry.stderr), bad
        assert retry.returncode == 1 and "not a job id" in retry.stderr and "\x1b[" not in retry.stderr, retry.stderr
    assert len(log.read_text().splitlines()) == 1, "the hook ran only once, by the daemon"


def test_land_of_a_done_job_whose_job_json_is_damaged_is_one_line_and_the_next_ids_go_on(
    env: Env, tmp_path: Path
) -> None:
    """`land L1 NOPE` with L1's job.json damaged or gone: one line for each id, exit 1, no traceback."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", land=["sh", "-c", "exit 1"])})
    env.drop(code_order("L1"))
    d = env.daemon()
    d.wait_event("land.failed", job_id="L1")
    d.stop()
    spec = env.root / "done" / "L1" / "job.json"
    for damage in ('"str"', None):
        if damage is None:
            spec.unlink()
        else:
            spec.write_text(damage)
        proc = env.cli("land", "L1", "NOPE")
        assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
        assert proc.stderr == "L1: its job.json is damaged; it cannot be landed\nNOPE: no such job\n", proc.stderr


def test_land_waits_for_review_and_runs_once_after_approve(env: Env, tmp_path: Path) -> None:
    """A job with review lands only after approve, exactly once."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    agent = coder(env, repo, "--write", "src/a.txt=x", land=_land(log), review=True)
    env.configure(agents={"coder": agent}, rescan_interval=0.5)
    env.drop(code_order("R1"))
    d = env.daemon()
    wait_until(lambda: (env.root / "review" / "R1" / "result.json").exists(), what="the job in review/")
    assert not log.exists()
    env.cli("approve", "R1", check=True)
    d.wait_event("job.landed", job_id="R1")
    d.stop()
    assert len(log.read_text().splitlines()) == 1


def _slow_after_in_review(env: Env, tmp_path: Path, job_id: str) -> Path:
    """Configure a reviewed coder whose after hook takes 3 s and whose land hook is quick, drop job_id; return the
    file both hooks append to (after-start, after-end, land)."""
    log = tmp_path / "hooks.txt"
    after = ["sh", "-c", 'echo after-start >> "$0"; sleep 3; echo after-end >> "$0"', str(log)]
    land = ["sh", "-c", 'echo land >> "$0"', str(log)]
    agent = coder(env, make_repo(tmp_path / "shop"), "--write", "src/a.txt=x", after=after, land=land, review=True)
    env.configure(agents={"coder": agent}, rescan_interval=0.5)
    env.drop(code_order(job_id))
    return log


def test_an_approved_jobs_landing_waits_for_its_after_hook_across_rescans(env: Env, tmp_path: Path) -> None:
    """README, Hooks: the after hook runs before the landing of an approved job. Rescans every 0.5 s during a 3 s
    after hook start passes of their own: none of them lands the job while its hook runs."""
    log = _slow_after_in_review(env, tmp_path, "R2")
    d = env.daemon()
    wait_until(lambda: (env.root / "review" / "R2" / "result.json").exists(), what="the job in review/")
    env.cli("approve", "R2", check=True)
    d.wait_event("job.landed", job_id="R2", timeout=60)
    d.stop()
    assert log.read_text().split() == ["after-start", "after-end", "land"]


def test_with_two_daemons_an_approved_jobs_landing_waits_for_its_after_hook(env: Env, tmp_path: Path) -> None:
    """Two daemons on one root: the one that does not run the after hook does not land the job meanwhile."""
    log = _slow_after_in_review(env, tmp_path, "R3")
    d1 = env.daemon()
    wait_until(lambda: (env.root / "review" / "R3" / "result.json").exists(), what="the job in review/")
    d2 = env.daemon()
    d2.wait_ready()
    env.cli("approve", "R3", check=True)
    wait_until(lambda: "land" in (log.read_text() if log.exists() else ""), 60, "the landing")
    assert d1.stop() == 0 and d2.stop() == 0
    assert log.read_text().split() == ["after-start", "after-end", "land"]


@pytest.mark.parametrize("review", [True, False])
def test_with_two_daemons_one_killed_in_the_after_hook_the_other_ends_and_records_it_before_landing(
    env: Env, tmp_path: Path, review: bool
) -> None:
    """Two daemons on one root; the one running a job's after hook (approved, or done at once) is killed (-9). The
    other one ends what that hook left running and records it as failed (hook.failed, hooks/after-*.json), removes
    the job's worktree (section 15: when final), and only then lands the job: the landing never runs beside the
    cut-short hook (README, Hooks), and none of it waits for a restart."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "hooks.txt"
    after = ["sh", "-c", 'echo after-start >> "$0"; sleep 8; echo after-end >> "$0"', str(log)]
    land = ["sh", "-c", 'echo land >> "$0"', str(log)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=after, land=land, review=review)
    env.configure(agents={"coder": agent}, rescan_interval=0.5)
    d1 = env.daemon()
    d1.wait_ready()
    if review:
        env.drop(code_order("R4"))
        wait_until(lambda: (env.root / "review" / "R4" / "result.json").exists(), what="the job in review/")
    d2 = env.daemon()
    d2.wait_ready()
    if review:
        env.cli("approve", "R4", check=True)
    else:
        env.drop(code_order("R4"))
    wait_until(lambda: "after-start" in (log.read_text() if log.exists() else ""), 60, "the after hook")
    hook_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _runs(int(p), "after-start", str(log))]
    assert hook_pids, "the after hook's shell"
    parent = int(Path(f"/proc/{hook_pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    killed, other = (d1, d2) if d1.proc is not None and d1.proc.pid == parent else (d2, d1)
    assert killed.proc is not None and killed.proc.pid == parent, (parent, d1.proc, d2.proc)
    killed.kill()
    wait_until(lambda: "land" in log.read_text(), 60, "the landing by the daemon left")
    time.sleep(8.5)  # the hook would have ended by now had it been left running
    assert log.read_text().split() == ["after-start", "land"], log.read_text()
    assert any(e["event"] == "hook.failed" and e.get("job_id") == "R4" for e in other.events())
    assert [p.name for p in (env.root / "done" / "R4" / "hooks").glob("after-*.json")], "the cut run's record"
    worktrees = env.root / ".state" / "worktrees"
    assert not [n for n in (os.listdir(worktrees) if worktrees.exists() else []) if "R4" in n]
    assert "R4" not in git(repo, "worktree", "list")
    assert other.stop() == 0


@pytest.mark.parametrize(
    ("verb", "point"),
    [
        ("approve", "review.decided"),
        ("approve", "review.named"),
        ("reject", "review.decided"),
        ("reject", "review.named"),
    ],
)
def test_after_a_decision_killed_partway_run_once_runs_the_after_hook_and_the_landing(
    env: Env, tmp_path: Path, verb: str, point: str
) -> None:
    """approve (or reject) killed between its steps; the next `run --once` finishes the decision and, before it
    exits, runs the after hook and (approved) the land hook it made owed: not only a later start or rescan."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "hooks.txt"
    after = ["sh", "-c", 'echo after >> "$0"', str(log)]
    land = ["sh", "-c", 'echo land >> "$0"', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=after, land=land, review=True)})
    env.drop(code_order("K5"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert (env.root / "review" / "K5" / "result.json").exists()
    args = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), verb, "K5"]
    killed = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=env.tmp,
                            env=cli_env() | {"DISPATCHER_FAULT": point})  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    once = env.cli("run", "--once", timeout=120)
    assert once.returncode == 0, once.stderr  # it ran no job of its own
    assert log.read_text().split() == (["after", "land"] if verb == "approve" else ["after"])


def _runs(pid: int, *texts: str) -> bool:
    """Return True if process pid's command line holds every one of texts (False once it is gone)."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return all(text in line for text in texts)


def test_a_before_hook_has_its_own_timeout_and_a_cancel_ends_it(env: Env, tmp_path: Path) -> None:
    """A hook given {command, timeout} is ended at its timeout; a cancel ends a running hook at once."""
    repo = make_repo(tmp_path / "shop")
    slow = {"command": ["sleep", "60"], "timeout": 1}
    hang = ["sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(tmp_path / "hook.pid")]
    env.configure(agents={"coder": coder(env, repo, before=slow), "hang": coder(env, repo, before=hang)})
    env.drop(code_order("H1"))
    env.drop(code_order("H2", to="hang"))
    d = env.daemon()
    assert env.wait_job("H1", "failed")["reason"] == "before hook timed out; not retried: no attempts left"
    pid = int(wait_until(lambda: (tmp_path / "hook.pid").exists() and (tmp_path / "hook.pid").read_text(), what="hook"))
    env.cli("cancel", "H2", check=True)
    cancelled = env.wait_job("H2", "failed", timeout=15)
    assert cancelled["reason"] == "cancelled"
    # the attempt the cancel cut is recorded as one (section 5), with its two logs (section 1)
    [cut] = cancelled["attempts"]
    assert (cut["n"], cut["aborted"], cut["before"]) == (1, "cancelled", "cut by a cancel"), cut
    first = env.job_dir("H2", "failed") / "attempts" / "1"
    assert (first / "stdout.log").read_text() == (first / "stderr.log").read_text() == ""
    d.stop()
    wait_until(lambda: not alive(pid), 10, "the hook to be ended")
    assert starts(env) == []


def test_a_marker_being_written_is_left_alone_by_a_pass_over_the_markers(tmp_path: Path) -> None:
    """A pass over the owed hooks' markers never takes a marker's temp name (``.<id>.running.<pid>.tmp``) for a job.

    Such a pass runs whenever a daemon finishes a review or is told to look; one that dropped the
    temp file of a marker being written made that job's after hook fail to start (a lost rename).
    """
    layout = Layout(tmp_path / "dispatch")
    layout.create()
    for markers in (afterowed, landing):
        folder = markers.MARKERS.folder(layout)
        folder.mkdir(parents=True, exist_ok=True)
        temp = folder / ".CX5.running.4242.tmp"
        temp.write_bytes(b"")
        owed = markers.look(layout)
        assert (owed.ready, owed.interrupted) == ([], [])
        assert temp.exists()


def _sigterm_while_the_hook_runs(d: Any, started: Path) -> tuple[int, float]:
    """Wait for the hook to write its pid into started, SIGTERM the daemon, wait for its exit 0.

    Return the hook's pid and how long the stop took."""
    wait_until(lambda: started.exists() and started.read_text().strip(), 30, "the after hook to start")
    pid = int(started.read_text())
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(60) == 0
    return pid, time.monotonic() - sent


def test_a_stop_ends_a_running_after_hook_at_stop_timeout_as_it_ends_agents(env: Env, tmp_path: Path) -> None:
    """SIGTERM while a done job's after hook sleeps 120 s: the daemon ends the hook's group at stop_timeout
    (plus kill_grace) and exits 0, instead of waiting out the hook's own 300 s; the run is recorded failed."""
    repo = make_repo(tmp_path / "shop")
    started = tmp_path / "after.started"
    hook = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(started)]
    env.configure(
        agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=hook)}, stop_timeout=2, kill_grace=1
    )
    d = env.daemon()
    env.drop(code_order("S1"))
    env.wait_job("S1", "done")
    pid, took = _sigterm_while_the_hook_runs(d, started)
    assert took < 2 + 1 + 5, f"the stop took {took:.1f} s with stop_timeout 2 and kill_grace 1"
    assert not alive(pid), "the after hook's shell outlived the stop"
    (record,) = [json.loads(p.read_text()) for p in (env.job_dir("S1", "done") / "hooks").glob("after-*.json")]
    assert record["ok"] is False, record


def test_a_before_hook_a_stop_ended_is_not_taken_for_an_agent_that_ran(env: Env, tmp_path: Path) -> None:
    """SIGTERM while attempt 1's before hook runs: no agent started. The next start fails the job (not retry-safe)
    as interrupted, and its exit_ok says the daemon stopped before the agent was seen to start, not while it ran."""
    repo = make_repo(tmp_path / "shop")
    started = tmp_path / "before.started"
    hook = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(started)]
    env.configure(agents={"coder": coder(env, repo, before=hook)}, stop_timeout=1, kill_grace=1)
    d = env.daemon()
    env.drop(code_order("BS1"))
    _sigterm_while_the_hook_runs(d, started)
    assert starts(env) == []
    assert env.cli("run", "--once", timeout=120).returncode == 1
    result = env.result("BS1", "failed")
    exit_ok = next(c for c in result["checks"] if c["name"] == "exit_ok")
    assert exit_ok["ok"] is False and "before its agent was seen to start" in exit_ok["detail"], exit_ok
    assert "while the agent ran" not in result["reason"], result["reason"]
    assert starts(env) == []


def test_a_stop_during_the_after_hook_leaves_the_landing_owed_for_the_next_start(env: Env, tmp_path: Path) -> None:
    """SIGTERM while a done job's after hook runs: the hook is ended at stop_timeout, and the land hook, not started
    yet, is not started then (it would be ended at once and recorded failed, never to run on its own): it stays
    owed, and the next start lands the job, once (section 15: exactly once after done)."""
    repo = make_repo(tmp_path / "shop")
    started = tmp_path / "after.started"
    log = tmp_path / "land.txt"
    after = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(started)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=after, land=_land(log))
    env.configure(agents={"coder": agent}, stop_timeout=2, kill_grace=1)
    d = env.daemon()
    env.drop(code_order("S2"))
    env.wait_job("S2", "done")
    _sigterm_while_the_hook_runs(d, started)
    assert not log.exists(), "the land hook ran during the stop"
    records = env.job_dir("S2", "done") / "land"
    assert not records.exists() or not any(records.iterdir()), "a landing was recorded during the stop"
    assert count_events(d, "land.failed") == 0
    d2 = env.daemon()
    d2.wait_event("job.landed", job_id="S2")
    d2.stop()
    assert len(log.read_text().splitlines()) == 1


def test_a_landing_owed_at_start_runs_beside_the_loop_and_a_stop_ends_it_at_stop_timeout(
    env: Env, tmp_path: Path
) -> None:
    """A landing a stop left owed (section 15), with a land hook of 120 s: the next start says READY=1 and claims
    other agents' orders while the hook runs, and a SIGTERM ends the hook at stop_timeout (plus kill_grace), as
    for agents (section 13). The start ran the hook before daemon.ready: no claim, and a stop waited for it."""
    repo = make_repo(tmp_path / "shop")
    after_started, land_started = tmp_path / "after.started", tmp_path / "land.started"
    after = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(after_started)]
    land = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(land_started)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=after, land=land)
    env.configure(agents={"coder": agent, "plain": env.agent()}, stop_timeout=2, kill_grace=1)
    d = env.daemon()
    env.drop(code_order("OW1"))
    env.wait_job("OW1", "done")
    _sigterm_while_the_hook_runs(d, after_started)  # the after hook is ended: the landing stays owed
    assert not land_started.exists()
    d2 = env.daemon()
    wait_until(lambda: land_started.exists() and land_started.read_text().strip(), 60, "the owed land hook's start")
    d2.wait_event("daemon.ready", timeout=30)
    env.drop(order("PL1", to="plain"))
    env.wait_job("PL1", "done", timeout=30)  # claimed and run while the landing goes on
    pid, took = _sigterm_while_the_hook_runs(d2, land_started)
    assert took < 2 + 1 + 5, f"the stop took {took:.1f} s with stop_timeout 2 and kill_grace 1"
    assert not alive(pid), "the land hook outlived the stop"
    assert count_events(d2, "job.landed") == 0


def test_a_rescan_during_the_after_hook_does_not_land_before_the_worktree_is_gone(env: Env, tmp_path: Path) -> None:
    """rescan_interval 0.5 and an after hook of 3 s: land still runs once, after the after hook and after the
    worktree's removal (the land hook checks that the worktree is gone), never from a rescan beside the hook."""
    repo = make_repo(tmp_path / "shop")
    order_of = tmp_path / "order.txt"
    after = ["sh", "-c", 'sleep 3; echo after >> "$0"', str(order_of)]
    tree = env.root / ".state" / "worktrees" / "{job_id}"
    land = ["sh", "-c", f'test ! -e "{tree}" && echo land >> "$0"', str(order_of)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=after, land=land)
    env.configure(agents={"coder": agent}, rescan_interval=0.5)
    d = env.daemon()
    env.drop(code_order("R1"))
    env.wait_job("R1", "done")
    d.wait_event("job.landed", job_id="R1", timeout=60)
    assert order_of.read_text().split() == ["after", "land"]
    assert count_events(d, "land.failed") == 0
    d.stop()


@pytest.mark.parametrize("kind", ["after", "land"])
def test_a_daemon_starting_beside_a_running_hook_leaves_it_alone(env: Env, tmp_path: Path, kind: str) -> None:
    """A second daemon started on the root while the first runs a done job's after (or land) hook: it neither
    ends that hook as a dead daemon's leftover nor records it as interrupted, nor removes the worktree the after
    hook runs in (it did: the hook found its folder gone); the hook runs once, recorded ok."""
    repo = make_repo(tmp_path / "shop")
    log, started, go = tmp_path / "hook.txt", tmp_path / "hook.started", tmp_path / "go"
    # runs until the test says go (at most 60 s): the second daemon's start, however slow, falls within it
    wait = 'i=0; while [ ! -e "$2" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'
    # and it says whether its folder (an after hook's: the job's worktree) is still there at its end
    said = 'if [ -d "$PWD" ]; then echo ran >> "$0"; else echo "its folder was removed" >> "$0"; fi'
    hook = ["sh", "-c", f'echo $$ > "$1"; {wait}; {said}', str(log), str(started), str(go)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", **{kind: hook})})
    env.drop(code_order("B1"))
    first = env.daemon()
    wait_until(lambda: started.exists() and started.read_text().strip(), 60, f"the {kind} hook's start")
    pid = int(started.read_text())
    second = env.daemon()
    second.wait_ready()
    assert alive(pid), f"the second daemon ended the first one's {kind} hook"
    go.touch()
    wait_until(lambda: log.exists(), 30, f"the {kind} hook's end")
    wait_until(lambda: not list((env.root / ".state" / ("after" if kind == "after" else "landing")).iterdir()), 30)
    second.stop()
    first.stop()
    records = sorted((env.job_dir("B1", "done") / ("hooks" if kind == "after" else "land")).glob("*.json"))
    assert log.read_text() == "ran\n"
    assert [json.loads(r.read_text())["ok"] for r in records] == [True]
    for d in (first, second):
        assert count_events(d, "hook.orphan_ended") == count_events(d, "hook.failed") == 0
        assert count_events(d, "land.failed") == 0


def test_a_stop_ends_the_after_hook_of_a_job_cancelled_in_its_claim_at_stop_timeout(env: Env, tmp_path: Path) -> None:
    """The after hook of a job failed without ever running (cancelled in its claim) runs like an agent: SIGTERM
    while it sleeps 120 s ends it at stop_timeout (plus kill_grace), as for any job's hook. The stop waited for
    the hook's own 300 s timeout."""
    repo = make_repo(tmp_path / "shop")
    started = tmp_path / "after.started"
    hook = ["sh", "-c", 'echo $$ > "$0"; sleep 120', str(started)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=hook)
    env.configure(agents={"coder": agent}, stop_timeout=2, kill_grace=1)
    env.drop(code_order("C2"))
    assert env.cli("cancel", "C2").returncode == 0  # no daemon yet: the claim's transaction meets the request
    d = env.daemon()
    pid, took = _sigterm_while_the_hook_runs(d, started)
    assert took < 2 + 1 + 5, f"the stop took {took:.1f} s with stop_timeout 2 and kill_grace 1"
    assert not alive(pid) and env.result("C2", "failed")["reason"] == "cancelled"


def test_a_run_that_ends_while_a_starting_daemon_looks_at_its_marker_is_not_taken_for_one_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starting daemon opens a `.running` marker just as the run's own process renames its record over it and lets
    the old, empty file go: the marker at the path is the one to judge (it took the old file for a run cut short)."""
    layout = Layout(tmp_path / "dispatch")
    layout.create()
    markers = landing.MARKERS
    folder = markers.folder(layout)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "R1").write_bytes(b"")
    assert markers.claim(layout, "R1")  # the live run: its empty marker, locked
    marker = folder / "R1.running"
    real_open = os.open

    def open_as_the_run_ends(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, *args, **kwargs)
        if os.fspath(path) == os.fspath(marker) and marker.read_bytes() == b"":
            monkeypatch.setattr(owed.os, "open", real_open)
            markers._hold("R1", owed._write_locked(marker, b'{"ok": true}\n'))  # its record, and the old file let go
        return fd

    monkeypatch.setattr(owed.os, "open", open_as_the_run_ends)
    other = owed.Markers("landing", ready_in=markers.ready_in, settled_in=markers.settled_in, records=markers.records)
    assert other.look(layout).interrupted == []
    assert marker.read_bytes() == b'{"ok": true}\n'
    markers.settle(layout, "R1")


def test_a_run_cut_short_stays_locked_until_it_is_recorded(tmp_path: Path) -> None:
    """Two daemons starting together find one run a crash cut short: the first keeps its marker locked until it
    records the run, so the second leaves it alone (both recorded it as interrupted)."""
    layout = Layout(tmp_path / "dispatch")
    layout.create()
    markers = landing.MARKERS
    folder = markers.folder(layout)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "R2.running").write_bytes(b"")  # a dead daemon's run: empty, no lock
    first = owed.Markers("landing", ready_in=markers.ready_in, settled_in=markers.settled_in, records=markers.records)
    second = owed.Markers("landing", ready_in=markers.ready_in, settled_in=markers.settled_in, records=markers.records)
    assert first.look(layout).interrupted == ["R2"]
    assert second.look(layout).interrupted == []
    first.settle(layout, "R2")  # recorded (``record_interrupted``): the marker and its lock go
    assert not (folder / "R2.running").exists()
    assert second.look(layout).interrupted == []


@pytest.mark.parametrize("second", [False, True])
def test_a_kill_between_the_finish_and_the_after_hook_runs_it_once_then_lands(
    env: Env, tmp_path: Path, second: bool
) -> None:
    """kill -9 once a job is done and before its after hook starts: the next start (or the second daemon running on
    the root, at its next pass) runs the after hook once, records it, and only then lands the job (section 15: after
    once the job is final, land exactly once after done); a later start runs neither again."""
    repo = make_repo(tmp_path / "shop")
    log, where = tmp_path / "hooks.txt", tmp_path / "where.txt"
    after = [
        "sh",
        "-c",
        'echo after-start >> "$0"; pwd > "$1"; sleep 0.5; echo after-end >> "$0"',
        str(log),
        str(where),
    ]
    tree = env.root / ".state" / "worktrees" / "AB1"
    land = ["sh", "-c", 'echo land >> "$0"; [ -d "$1" ] && echo tree-left >> "$0"; true', str(log), str(tree)]
    env.configure(
        agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=after, land=land)}, rescan_interval=0.5
    )
    daemons = [env_daemon(env, {"DISPATCHER_FAULT": "after.before"}) for _ in range(2 if second else 1)]
    for d in daemons:
        d.wait_ready()
    env.drop(code_order("AB1"))  # the daemon that claims it dies at the point; the other one lives on
    dead = wait_until(lambda: [d for d in daemons if d.proc is not None and d.proc.poll() is not None], 60, "a kill")
    assert [d.wait() for d in dead] == [-signal.SIGKILL]
    assert (env.job_dir("AB1", "done") / "result.json").exists()
    left = [d for d in daemons if d not in dead]
    if not left:
        assert not log.exists()
        proc = env.cli("land", "AB1")  # not before the after hook: the next daemon runs both, in their order
        line = "AB1: its after hook has not run yet; a daemon lands the job once it has\n"
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", line)
        left = [env.daemon()]
    left[0].wait_event("job.landed", job_id="AB1", timeout=60)
    assert left[0].stop() == 0
    assert log.read_text().split() == ["after-start", "after-end", "land"]  # the worktree gone before the landing
    assert where.read_text().strip() == str(tree)  # the after hook ran in the job's worktree (section 15)
    assert not tree.exists() and "AB1" not in git(repo, "worktree", "list")
    records = sorted((env.job_dir("AB1", "done") / "hooks").glob("after-*.json"))
    assert [json.loads(r.read_text())["ok"] for r in records] == [True]
    d3 = env.daemon()
    d3.wait_ready()
    assert d3.stop() == 0
    assert log.read_text().split() == ["after-start", "after-end", "land"]
    assert count_events(d3, "job.landed") == 0 and count_events(d3, "hook.failed") == 0


def test_land_refuses_a_job_whose_after_hook_a_crash_cut_until_a_daemon_records_it_and_lands(
    env: Env, tmp_path: Path
) -> None:
    """kill -9 once the after hook ended, before its record: the job's worktree and the after hook's marker are still
    there, so `dispatcher land` refuses it (exit 1, one line): the landing never runs beside the worktree or before
    the after hook's record. The next start records the hook, removes the worktree and lands the job once."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "hooks.txt"
    after = ["sh", "-c", 'echo after >> "$0"', str(log)]
    land = ["sh", "-c", 'echo land >> "$0"', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=after, land=land)})
    env.drop(code_order("AB3"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "after.ended"})
    assert d.wait(60) == -signal.SIGKILL
    proc = env.cli("land", "AB3")
    line = "AB3: its after hook runs, or a crash cut it and it is not recorded yet; a daemon lands the job after it\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", line)
    (env.root / ".state" / "after" / "AB3.running").unlink()  # as if it were recorded: the worktree still stands
    proc = env.cli("land", "AB3")
    line = "AB3: its worktree is still there; a daemon removes it, then lands the job\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", line)
    assert log.read_text().split() == ["after"]
    d2 = env.daemon()
    d2.wait_event("job.landed", job_id="AB3", timeout=60)
    assert d2.stop() == 0
    assert log.read_text().split() == ["after", "land"]
    assert not (env.root / ".state" / "worktrees" / "AB3").exists()


def test_a_done_jobs_hooks_are_held_by_its_own_daemon_from_before_its_finish(tmp_path: Path) -> None:
    """Between a done job's finish and its after hook, a pass of a second daemon on the root finds the after hook
    owed but not its to run, and does not land the job: the landing waits for the after hook (README, Hooks)."""
    import asyncio
    from types import SimpleNamespace

    from dispatcher.job.repowork import JobRepo
    from dispatcher.lanes import Lanes
    from dispatcher.lifecycle import Row, State

    layout = Layout(tmp_path / "dispatch")
    layout.create()
    lanes = Lanes()
    hooks = SimpleNamespace(after=["true"], land=["true"], workspace=None)
    spec = SimpleNamespace(job_id="AB2", agent=SimpleNamespace(name="coder", repo=hooks))
    repo = JobRepo(layout, lanes, spec, None)  # type: ignore[arg-type]
    try:
        asyncio.run(repo.owe_landing(Row.DONE))
        layout.job(State.DONE, "AB2").mkdir(parents=True)  # the finish committed: the job is in done/
        pass_after = owed.Markers(
            "after", ready_in=afterowed.MARKERS.ready_in, settled_in=frozenset(), records=("hooks", "after-")
        )
        pass_land = owed.Markers(
            "landing", ready_in=landing.MARKERS.ready_in, settled_in=landing.MARKERS.settled_in, records=("land", "")
        )
        assert pass_after.look(layout).ready == ["AB2"] and pass_land.look(layout).ready == ["AB2"]
        assert not pass_after.claim(layout, "AB2")  # owed, and held by the job's own daemon
        assert pass_after.busy(layout, "AB2")  # so the pass lands nothing (``housekeep`` asks before a claim)
        repo.let_go()  # the job's daemon gave up (a stop): the next pass runs both, in their order
        assert pass_after.claim(layout, "AB2")
        pass_after.settle(layout, "AB2")
        assert not pass_after.busy(layout, "AB2") and pass_land.claim(layout, "AB2")
        pass_land.settle(layout, "AB2")
    finally:
        repo.let_go()
        lanes.shutdown(wait=True)
