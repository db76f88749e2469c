"""Agents that misbehave: stray children, hangs, ignored SIGTERM, log floods, a deleted work/.

After each, no process of the agent's group may be left (read from /proc), and the job
ends the way the contract says.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

import pytest
from conftest import Env, order, wait_until
from helpers_faults import (
    agent_starts,
    alive,
    check,
    first_failing,
    processes_with,
    started_s,
    uptime_s,
    wait_gone,
    wait_start,
)


def assert_nothing_left(env: Env, marker: str | None = None) -> None:
    """No agent recorded by the fake agent, no member of its group, no marked child lives."""
    pids = [pid for _j, _a, pid in agent_starts(env)]
    extra = processes_with(marker) if marker else []
    wait_gone(pids + extra, pids, timeout=10)
    if marker:
        assert processes_with(marker) == []


def test_child_left_behind_is_killed_and_job_is_done(env: Env) -> None:
    """An agent that forks a child and exits: the child is ended, the job is done."""
    marker = "time.sleep(61.91)"
    env.configure(agents={"worker": env.agent("--fork-child", "61.91")}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FORK-1"))
    env.wait_job("FORK-1", "done")
    assert_nothing_left(env, marker)
    assert d.stop() == 0


def test_hanging_agent_times_out_and_its_group_is_killed(env: Env) -> None:
    """An agent that hangs past its timeout fails with an exit_ok reason; its group is ended."""
    marker = "time.sleep(62.07)"
    env.configure(
        agents={"worker": env.agent("--sleep", "60", "--fork-child", "62.07", timeout=1)},
        kill_grace=1,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HANG-1"))
    result = env.wait_job("HANG-1", "failed", timeout=30)
    assert result["reason"].startswith("exit_ok"), result["reason"]
    assert result["attempts"][0]["timed_out"] is True
    assert check(result, "exit_ok")["ok"] is False
    assert_nothing_left(env, marker)
    assert d.stop() == 0


def test_agent_ignoring_sigterm_gets_sigkill_after_kill_grace(env: Env) -> None:
    """An agent that ignores SIGTERM is SIGKILLed kill_grace after its timeout."""
    env.configure(agents={"worker": env.agent("--ignore-term", "--sleep", "60", timeout=1)}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("DEAF-1"))
    pid = wait_start(env, "DEAF-1")
    born = started_s(pid)  # the kernel's start time: the agent's own start can lag its spawn on a busy machine
    wait_until(lambda: not alive(pid), 30, "the agent to be killed")
    lived = uptime_s() - born
    # timeout 1 s, then SIGTERM (ignored), then SIGKILL after kill_grace 1 s
    assert 1.7 <= lived <= 8, f"the agent died {lived:.2f} s after its start, want about 2 s"
    result = env.wait_job("DEAF-1", "failed", timeout=30)
    assert result["attempts"][0]["timed_out"] is True
    assert result["reason"].startswith("exit_ok")
    wait_gone([pid], [pid], timeout=5)
    assert d.stop() == 0


def test_stdout_flood_is_capped_and_job_is_done(env: Env) -> None:
    """50 MB on stdout with a small max_log_bytes: the log is capped, says so, the job is done."""
    cap = 65536
    env.configure(agents={"worker": env.agent("--flood", str(50 * 1024 * 1024))}, max_log_bytes=cap)
    d = env.daemon()
    d.wait_ready()
    started = time.monotonic()
    env.drop(order("FLOOD-1"))
    env.wait_job("FLOOD-1", "done", timeout=60)
    log = env.root / "done" / "FLOOD-1" / "attempts" / "1" / "stdout.log"
    size = log.stat().st_size
    assert cap // 2 <= size <= cap + 4096, f"stdout.log is {size} bytes with max_log_bytes {cap}"
    last = log.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1].decode(errors="replace")
    assert re.search(r"cut|truncat|limit|max_log_bytes|dropped|omitted", last, re.I), last[-200:]
    assert time.monotonic() - started < 50
    assert_nothing_left(env)
    assert d.stop() == 0


def test_agent_deleting_its_work_folder_fails_writes_scope(env: Env) -> None:
    """An agent that removes its own work/ fails; writes_scope fails because work/ is gone."""
    env.configure(agents={"worker": env.agent("--delete-work")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("GONE-1"))
    result = env.wait_job("GONE-1", "failed")
    scope = check(result, "writes_scope")
    assert scope["ok"] is False, scope
    # the receipt went with work/, so receipt_present is the first check to fail
    assert result["reason"].startswith(first_failing(result) or "?"), result["reason"]
    assert_nothing_left(env)
    assert d.stop() == 0


def test_a_retry_safe_agent_that_deleted_its_work_folder_is_not_retried(env: Env) -> None:
    """With attempts left, no attempt can run without work/: the job fails with its checks and says why."""
    env.configure(agents={"worker": env.agent("--delete-work", retry_safe=True, max_attempts=3)})
    env.drop(order("GONE-2"))
    env.cli("run", "--once", timeout=60)
    result = env.result("GONE-2", "failed")
    assert [a["n"] for a in result["attempts"]] == [1]
    assert check(result, "writes_scope")["ok"] is False
    assert result["reason"].startswith(first_failing(result) or "?"), result["reason"]
    assert "not retried: work/ is gone" in result["reason"], result["reason"]
    assert not result["reason"].startswith("config:"), result["reason"]


def test_a_retry_of_a_job_whose_agent_deleted_its_work_folder_says_work_is_gone(env: Env) -> None:
    """`dispatcher retry` of such a job is taken (exit 0, section 6), but no attempt can run: it fails again with no
    attempt and a reason that says work/ is gone, not a missing file the config would have to name."""
    env.configure(agents={"worker": env.agent("--delete-work", retry_safe=True, max_attempts=3)})
    env.drop(order("GONE-3"))
    env.cli("run", "--once", timeout=60)
    assert env.cli("retry", "GONE-3").returncode == 0
    env.cli("run", "--once", timeout=60)
    result = env.result("GONE-3", "failed")
    assert [a["n"] for a in result["attempts"]] == [1], result["attempts"]
    assert result["reason"] == "config: agent worker cannot start: work/ is gone (its agent removed it), so no " \
        "attempt can run in it", result["reason"]  # fmt: skip


SWAP_WORK = """
import json, os, shutil
work, moved = os.getcwd(), os.environ["MOVED"]
job = os.environ["DISPATCH_JOB_ID"]
with open("receipt.json", "w") as f:
    json.dump({"job_id": job, "input_ids": [], "output_ids": [], "status": "done", "outputs": []}, f)
shutil.copytree(work, moved)
os.chdir("/")
shutil.rmtree(work)
os.symlink(moved, work)
"""


def test_a_retry_safe_agent_that_replaced_its_work_folder_by_a_link_is_not_retried_and_says_why(env: Env) -> None:
    """work/ swapped for a link to a copy holding a receipt is gone like a removed one: the receipt behind the
    link is not the job's, and the reason says why no attempt followed."""
    moved = env.tmp / "moved"
    agent = {"command": [sys.executable, "-c", SWAP_WORK], "env": {"MOVED": str(moved)}, "timeout": 30}
    env.configure(agents={"worker": {**agent, "retry_safe": True, "max_attempts": 3}})
    env.drop(order("SWAP-1"))
    env.cli("run", "--once", timeout=60)
    result = env.result("SWAP-1", "failed")
    assert [a["n"] for a in result["attempts"]] == [1]
    assert check(result, "writes_scope")["ok"] is False
    assert result["reason"].startswith("receipt_present: "), result["reason"]
    assert "not retried: work/ is gone" in result["reason"], result["reason"]
    assert (moved / "receipt.json").exists()  # what the link pointed at is left alone


TAKES_RESULT = """
import json, os, sys
o = json.load(open(os.environ["DISPATCH_ORDER"]))
if sys.argv[1] == "result":
    os.mkdir("../result.json")  # the job folder's own result.json, taken by a folder
elif sys.argv[1] == "result-file":
    with open("../result.json", "w") as fh:  # taken by a file of the agent's: never replaced
        fh.write("the agent's own")
else:
    for state in ("done", "failed"):  # its place in done/ (and failed/), taken
        os.mkdir(os.path.join("..", "..", "..", state, o["job_id"]))
ids = [i["id"] for i in o["items"]]
json.dump({"job_id": o["job_id"], "input_ids": ids, "output_ids": [], "status": "done", "outputs": []},
          open("receipt.json", "w"))
"""


def test_a_failed_job_that_cannot_land_is_logged_and_notified_by_whoever_lands_it(env: Env) -> None:
    """An agent without a sandbox that makes `../result.json` a folder and exits 1: its job stays in active/ with
    `job.stuck`. No `job.failed` line and no notification name a failed/<id>/result.json that is not there; the
    ledger's verdict counts, so `run --once` exits 1. Once a person moves the stray folder away, the next start lands
    the job and logs `job.recovered` and `job.failed`, and notify runs once, with the result's path."""
    marks = env.tmp / "notified.txt"
    agent = {"command": [sys.executable, "-c", "import os, sys; os.mkdir('../result.json'); sys.exit(1)"]}
    env.configure(
        agents={"bad": {**agent, "timeout": 30, "max_attempts": 1}},
        notify=["sh", "-c", 'echo "$1 $2 $3" >> "$0"', str(marks), "{event}", "{job_id}", "{result}"],
    )
    env.drop(order("STUCK-1", to="bad"))
    proc = env.cli("run", "--once", timeout=60)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e.get("job_id") == "STUCK-1"][-1] == "job.stuck", proc.stdout
    assert not [e for e in events if e["event"] == "job.failed"], proc.stdout
    assert proc.returncode == 1, proc.stdout
    assert (env.root / "active" / "STUCK-1").is_dir() and not (env.root / "failed" / "STUCK-1").exists()
    time.sleep(1)  # a notification runs apart from the daemon
    assert not marks.exists(), marks.read_text()
    (env.root / "active" / "STUCK-1" / "result.json").rmdir()  # the person moves the stray entry away
    proc = env.cli("run", "--once", timeout=60)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e.get("job_id") == "STUCK-1"] == ["job.recovered", "job.failed"], proc.stdout
    where = env.root / "failed" / "STUCK-1" / "result.json"
    assert json.loads(where.read_text())["state"] == "failed"
    wait_until(marks.exists, 20, "the notification")
    assert marks.read_text() == f"job.failed STUCK-1 {where}\n"


def test_a_stuck_done_jobs_follow_up_is_not_released_from_what_stands_in_its_place(env: Env) -> None:
    """A done job whose place done/<id> a stray folder took (with a work/outbox/ of its own, holding an order of the
    follow-up's file name): the job waits in active/ (`job.stuck`) and its follow-up is not released from the stray's
    outbox (it was, with the stranger's task). Once the stray is moved away, the next start lands the job and releases
    the follow-up the agent wrote."""
    followup = {"job_id": "FU-1", "from": "worker", "to": "next", "task": "the real task", "items": [{"id": "x"}]}
    stranger = dict(followup, task="a stranger's task")
    env.configure(agents={"worker": env.agent("--sleep", "2", "--followup", json.dumps(followup)), "next": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PAR-1"))
    d.wait_event("agent.started", job_id="PAR-1")
    stray = env.root / "done" / "PAR-1"  # made while the agent runs
    (stray / "work" / "outbox").mkdir(parents=True)
    (stray / "work" / "outbox" / "FU-1.json").write_text(json.dumps(stranger))
    d.wait_event("job.stuck", job_id="PAR-1")
    time.sleep(1.5)  # a release would come now
    assert d.stop() == 0
    assert not [e for e in d.events() if e["event"] in ("followup.released", "followup.lost")], d.events()
    assert not (env.root / "inbox" / "FU-1.json").exists() and not list((env.root / "done").glob("FU-1*"))
    shutil.move(str(stray), str(env.tmp / "stray"))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout
    assert env.result("PAR-1", "done")["state"] == "done"
    assert json.loads((env.root / "done" / "FU-1" / "order.json").read_text())["task"] == "the real task"


def test_a_stuck_jobs_after_hook_waits_for_its_landing_and_runs_once_in_its_own_folder(env: Env) -> None:
    """A job whose place done/<id> a stray folder took while its agent ran (`job.stuck`): its `after` hook does not
    run against the stray (it ran with the stray's work/ as its folder and wrote its record there); once the stray
    is moved away, the start that lands the job runs the hook once, in the job's own folder, and records it there."""
    marks = env.tmp / "after.txt"
    hook = ["sh", "-c", 'echo "{job_id} {result} $(pwd)" >> "$0"', str(marks)]
    env.configure(agents={"worker": {**env.agent("--sleep", "2"), "after": hook}}, rescan_interval=0.5)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("AFT-1"))
    d.wait_event("agent.started", job_id="AFT-1")
    stray = env.root / "done" / "AFT-1"
    (stray / "work").mkdir(parents=True)
    d.wait_event("job.stuck", job_id="AFT-1")
    time.sleep(1.5)  # the hook would run now
    assert d.stop() == 0
    assert not marks.exists(), marks.read_text()
    assert sorted(p.name for p in stray.iterdir()) == ["work"]  # nothing written into the stray
    shutil.move(str(stray), str(env.tmp / "stray"))
    d2 = env.daemon()
    d2.wait_ready()
    wait_until(marks.exists, 30, "the after hook")
    time.sleep(1.5)  # a second run would come now
    assert d2.stop() == 0
    done = env.root / "done" / "AFT-1"
    assert marks.read_text() == f"AFT-1 {done / 'result.json'} {done / 'work'}\n"
    assert [p.name for p in sorted((done / "hooks").glob("after-*.json"))] == ["after-1.json"]


@pytest.mark.parametrize("takes", ["result", "result-file", "done"])
def test_an_agent_that_takes_its_jobs_own_names_outside_work_leaves_it_stuck_not_the_daemon(
    env: Env, takes: str
) -> None:
    """An agent without a sandbox that makes `../result.json` (a folder or a file) or `done/<id>` a folder: its job
    cannot land and stays in active/ with one `job.stuck` error saying why; nothing is removed or overwritten (a
    file there was replaced by the daemon's result), and the daemon goes on: the next order runs, and a restart
    starts and runs orders too (it used to crash at start-up or claim nothing)."""
    env.configure(agents={"bad": {"command": [sys.executable, "-c", TAKES_RESULT, takes], "timeout": 30},
                          "worker": env.agent()})  # fmt: skip
    d = env.daemon()
    d.wait_ready()
    env.drop(order("TAKE-1", to="bad"))
    stuck = d.wait_event("job.stuck", job_id="TAKE-1")
    assert stuck["level"] == "error" and stuck["agent"] == "bad", stuck
    env.drop(order("AFTER-1"))
    env.wait_job("AFTER-1", "done")
    assert (env.root / "active" / "TAKE-1").is_dir()
    assert d.stop() == 0
    d2 = env.daemon()
    d2.wait_ready()
    env.drop(order("AFTER-2"))
    env.wait_job("AFTER-2", "done")
    assert d2.wait_event("job.stuck", job_id="TAKE-1")["agent"] == "bad"
    assert (env.root / "active" / "TAKE-1").is_dir()
    assert not [e for e in d.events() + d2.events() if e["event"] in ("job.crashed", "daemon.error")]
    # it is not in done/ or failed/: no end line names it (its job.stuck line does)
    assert not [
        e for e in d.events() + d2.events() if e["event"] in ("job.done", "job.failed") and e["job_id"] == "TAKE-1"
    ]
    if takes == "result-file":
        assert (env.root / "active" / "TAKE-1" / "result.json").read_text() == "the agent's own"
    assert d2.stop() == 0
