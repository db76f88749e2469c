"""Section 15: the after hook of an agent with review waits in review/, runs once when approved or rejected."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, wait_until
from git_helpers import code_order, coder, make_repo
from helpers_faults import alive, count_events, env_daemon

AFTER = 'echo "{job_id} {branch} {head} {result}" >> "$0"'


def _setup(env: Env, tmp_path: Path) -> Path:
    """Configure a review agent on a real repository with an after hook that appends to a log; return the log."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "after.txt"
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=["sh", "-c", AFTER, str(log)],
                                        review=True)})  # fmt: skip
    return log


def _in_review(env: Env, job_id: str, attempts: int) -> dict[str, Any]:
    """Wait until job_id waits in review/ after this many attempts, its worktree removed (its end fully handled)."""
    path = env.root / "review" / job_id / "result.json"
    tree = env.root / ".state" / "worktrees" / job_id

    def ready() -> dict[str, Any] | None:
        try:
            result = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return result if len(result["attempts"]) == attempts and not tree.exists() else None

    return wait_until(ready, 60, f"{job_id} in review/ after {attempts} attempts")


def _records(folder: Path) -> list[dict[str, Any]]:
    """Return the job's after records, in order."""
    paths = sorted((folder / "hooks").glob("after-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in paths]


def _wait_records(folder: Path, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait for the job's first after record; return them all."""
    return wait_until(lambda: _records(folder), timeout, f"an after record in {folder}")


def test_after_waits_in_review_and_runs_once_on_approve(env: Env, tmp_path: Path) -> None:
    """No after hook while the job sits in review/; approve runs it once (state done), a restart never again."""
    log = _setup(env, tmp_path)
    env.drop(code_order("AR1"))
    d = env.daemon()
    result = _in_review(env, "AR1", 1)
    assert not log.exists() and _records(env.root / "review" / "AR1") == []
    assert env.cli("approve", "AR1").stdout == "AR1: approved; done\n"
    done = env.root / "done" / "AR1"
    records = _wait_records(done, 15)  # on the approve's hint, not at the 30 s rescan
    d.stop()
    assert [(r["hook"], r["ok"], r["state"]) for r in records] == [("after", True, "done")]
    head = result["workspace"]["head"]
    assert log.read_text().split() == ["AR1", "dispatch/AR1", head, str(done / "result.json")]
    d2 = env.daemon()
    d2.wait_ready()
    d2.stop()
    assert len(_records(done)) == 1 and len(log.read_text().splitlines()) == 1


def test_reject_with_no_daemon_runs_after_once_at_the_next_start(env: Env, tmp_path: Path) -> None:
    """reject with no daemon running leaves the after hook owed; the next daemon runs it once, with state failed."""
    log = _setup(env, tmp_path)
    env.drop(code_order("AR2"))
    d = env.daemon()
    _in_review(env, "AR2", 1)
    d.stop()
    proc = env.cli("reject", "AR2", "--reason", "wrong file")
    assert (proc.returncode, proc.stdout) == (0, "AR2: rejected; failed\n")
    failed = env.root / "failed" / "AR2"
    assert not log.exists() and _records(failed) == []  # the command leaves it to a daemon
    d2 = env.daemon()
    records = _wait_records(failed)
    d2.stop()
    assert [(r["ok"], r["state"]) for r in records] == [(True, "failed")]
    assert log.read_text().split()[0] == "AR2" and len(log.read_text().splitlines()) == 1
    assert env.result("AR2", "failed")["reason"] == "rejected: wrong file"


def test_revise_then_approve_runs_after_exactly_once(env: Env, tmp_path: Path) -> None:
    """A job revised from review/ and back in review/ runs no after hook until approved, then exactly one."""
    log = _setup(env, tmp_path)
    env.drop(code_order("AR3"))
    d = env.daemon()
    _in_review(env, "AR3", 1)
    env.cli("revise", "AR3", "--note", "name it better", check=True)
    _in_review(env, "AR3", 2)
    assert not log.exists() and _records(env.root / "review" / "AR3") == []
    env.cli("approve", "AR3", check=True)
    done = env.root / "done" / "AR3"
    records = _wait_records(done)
    d.stop()
    assert [(r["ok"], r["state"]) for r in records] == [(True, "done")]
    assert len(_records(done)) == 1 and len(log.read_text().splitlines()) == 1


def test_an_after_hook_cut_short_after_approve_is_recorded_and_never_run_twice(env: Env, tmp_path: Path) -> None:
    """Killed as the after hook of an approved job starts: the restart records it as interrupted, never runs it."""
    log = _setup(env, tmp_path)
    env.drop(code_order("AR4"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "after.started"})
    _in_review(env, "AR4", 1)
    env.cli("approve", "AR4", check=True)
    assert d.wait() == -signal.SIGKILL
    d2 = env.daemon()
    done = env.root / "done" / "AR4"
    records = _wait_records(done)
    d2.wait_event("hook.failed", hook="after", job_id="AR4")
    d2.stop()
    assert [(r["ok"], r["state"]) for r in records] == [(False, "done")]
    assert "interrupted" in records[0]["detail"] and not log.exists()
    assert len(_records(done)) == 1


@pytest.mark.parametrize("point", ["after.ended", "after.recorded"])
def test_a_kill_after_the_after_hook_ended_keeps_its_one_record(env: Env, tmp_path: Path, point: str) -> None:
    """Killed once the approved job's after hook ended, before its marker went: the restart keeps the one
    ok record (put in place if missing), runs nothing again and logs no hook.failed."""
    log = _setup(env, tmp_path)
    env.drop(code_order("AR5"))
    d = env_daemon(env, {"DISPATCHER_FAULT": point})
    _in_review(env, "AR5", 1)
    env.cli("approve", "AR5", check=True)
    assert d.wait() == -signal.SIGKILL
    done = env.root / "done" / "AR5"
    assert len(log.read_text().splitlines()) == 1
    d2 = env.daemon()
    d2.wait_ready()
    records = _wait_records(done)
    d2.stop()
    assert [(r["hook"], r["ok"], r["state"]) for r in records] == [("after", True, "done")]
    assert count_events(d2, "hook.failed") == 0 and len(log.read_text().splitlines()) == 1
    assert list((env.root / ".state" / "after").iterdir()) == []


def _stop_during_the_after_hook(env: Env, tmp_path: Path, sleep: float, **settings: Any) -> tuple[Path, int, float]:
    """Approve a reviewed job whose after hook sleeps, stop the daemon while it runs; return the hook's log,
    the daemon's exit code and how long the stop took."""
    repo = make_repo(tmp_path / "shop")
    log, started = tmp_path / "after.txt", tmp_path / "started"
    hook = ["sh", "-c", f'echo $$ > "$1"; sleep {sleep}; echo ran >> "$0"', str(log), str(started)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x", after=hook, review=True)}, **settings)
    env.drop(code_order("AS1"))
    d = env.daemon()
    _in_review(env, "AS1", 1)
    env.cli("approve", "AS1", check=True)
    wait_until(lambda: started.exists() and started.read_text().strip(), 30, "the after hook's start")
    sent = time.monotonic()
    code = d.stop()
    return log, code, time.monotonic() - sent


def test_a_stop_lets_an_approved_jobs_after_hook_finish(env: Env, tmp_path: Path) -> None:
    """SIGTERM while the after hook of an approved job runs: the stop waits for it as for an agent (section 9), so
    it runs to its end and is recorded ok; the next start finds nothing cut short (it was left running, cut off,
    and recorded as interrupted at the next start)."""
    log, code, _took = _stop_during_the_after_hook(env, tmp_path, 2, stop_timeout=30)
    assert code == 0 and log.read_text() == "ran\n"  # the hook ran to its end (it was cut off at once)
    d2 = env.daemon()
    d2.wait_ready()
    d2.stop()
    records = _records(env.root / "done" / "AS1")
    assert [(r["ok"], r["state"]) for r in records] == [(True, "done")]
    assert count_events(d2, "hook.failed") == 0 and count_events(d2, "hook.orphan_ended") == 0


def test_a_stop_ends_an_after_hook_that_outlasts_stop_timeout(env: Env, tmp_path: Path) -> None:
    """An after hook still running at the stop's deadline is ended with its group, as an agent is, and recorded as
    failed by this daemon: no process is left behind for the next start to find."""
    log, code, took = _stop_during_the_after_hook(env, tmp_path, 60, stop_timeout=2, kill_grace=1)
    pid = int((tmp_path / "started").read_text())
    assert code == 0 and took < 2 + 1 + 5 and not alive(pid) and not log.exists()
    records = _records(env.root / "done" / "AS1")
    assert [(r["ok"], r["state"]) for r in records] == [(False, "done")]
    d2 = env.daemon()
    d2.wait_ready()
    d2.stop()
    assert count_events(d2, "hook.orphan_ended") == 0 and len(_records(env.root / "done" / "AS1")) == 1
