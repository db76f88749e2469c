"""An agent's own checks (``checks:``, contract section 14) run by a real daemon after the agent passed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order, wait_until
from git_helpers import code_order, coder, git, make_repo
from helpers_faults import processes_with

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"


def agent(env: Env, checks: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "command": [sys.executable, str(HEADLESS), "--count", str(env.count_file)],
        "timeout": 30,
        "writes": ["out.csv"],
        "checks": checks,
        "env": {"SUITE": "unit"},
    }
    spec.update(settings)
    return spec


def by_name(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in result["checks"] if c["name"] == name)


def test_a_passing_check_is_recorded_with_its_last_line_and_log(env: Env) -> None:
    """A check that exits 0 passes the job; result.json has its exit, duration and last line; its log is kept."""
    script = "import os; print('collected 3 items'); print('3 passed in 0.01s', os.environ['DISPATCH_JOB_ID'])"
    env.configure(agents={"worker": agent(env, [{"name": "tests", "command": [sys.executable, "-c", script]}])})
    env.daemon().wait_ready()
    env.drop(order("CHK-OK"))
    result = env.wait_job("CHK-OK", "done")
    check = by_name(result, "tests")
    assert check["ok"] is True
    assert check["detail"].startswith("exit 0 in ") and check["detail"].endswith(": 3 passed in 0.01s CHK-OK")
    assert [c["name"] for c in result["checks"]][-1] == "tests"
    log = env.root / "done" / "CHK-OK" / "attempts" / "1" / "checks" / "tests.log"
    assert log.read_text() == "collected 3 items\n3 passed in 0.01s CHK-OK\n"


def test_a_check_whose_log_was_cut_keeps_its_own_last_line_in_the_detail(env: Env) -> None:
    """A check printing past max_log_bytes: its detail ends with the last line it printed (section 14), not with
    the daemon's cut notice; the log itself is cut and says so."""
    script = "import sys\nfor i in range(1000): print(i)\nprint('3 failed, 997 passed')\nsys.exit(1)"
    checks = [{"name": "tests", "command": [sys.executable, "-c", script]}]
    env.configure(agents={"worker": agent(env, checks)}, max_log_bytes=1000)
    env.daemon().wait_ready()
    env.drop(order("CHK-CUT"))
    result = env.wait_job("CHK-CUT", "failed")
    assert result["reason"].startswith("tests: exit 1 in ") and result["reason"].endswith(": 3 failed, 997 passed")
    log = (env.root / "failed" / "CHK-CUT" / "attempts" / "1" / "checks" / "tests.log").read_text()
    assert "3 failed" not in log and log.rstrip().endswith("stdout and stderr cut at 2000 bytes (2 x max_log_bytes)]")


def test_a_checks_log_and_last_line_keep_the_order_of_its_stdout_and_stderr(env: Env) -> None:
    """A check writing stdout and stderr in turn: its log holds them as they came and its detail ends with the line
    it printed last (section 14), every time (one pipe for both, as ``2>&1``)."""
    script = "echo one; echo two >&2; echo three; echo four >&2; echo 'FAILED: totals'; exit 1"
    checks = [{"name": "tests", "command": ["sh", "-c", script]}]
    env.configure(agents={"worker": agent(env, checks)}, max_jobs=3)
    env.daemon().wait_ready()
    ids = [f"CHK-ORDER-{i}" for i in range(6)]
    for job_id in ids:
        env.drop(order(job_id))
    for job_id in ids:
        result = env.wait_job(job_id, "failed")
        assert by_name(result, "tests")["detail"].endswith(": FAILED: totals"), (job_id, result["checks"])
        log = env.root / "failed" / job_id / "attempts" / "1" / "checks" / "tests.log"
        assert log.read_text() == "one\ntwo\nthree\nfour\nFAILED: totals\n", job_id


def test_a_checks_one_log_keeps_what_two_logs_of_max_log_bytes_would(env: Env) -> None:
    """max_log_bytes is per stream (README): a check writing 880 bytes on stdout and 880 on stderr, in turn, with
    max_log_bytes 1000, has its whole output in its one log, nothing cut."""
    script = "for i in $(seq 10 49); do echo out-line-$i-xxxxxxxxx; echo err-line-$i-xxxxxxxxx >&2; done; echo FINAL"
    checks = [{"name": "tests", "command": ["sh", "-c", script]}]
    env.configure(agents={"worker": agent(env, checks)}, max_log_bytes=1000)
    env.daemon().wait_ready()
    env.drop(order("CHK-BOTH"))
    result = env.wait_job("CHK-BOTH", "done")
    assert by_name(result, "tests")["detail"].endswith(": FINAL")
    log = (env.root / "done" / "CHK-BOTH" / "attempts" / "1" / "checks" / "tests.log").read_text()
    assert "cut at" not in log and log.count("err-line-") == 40 and log.count("out-line-") == 40, log[-300:]


def test_files_a_check_left_in_work_are_not_charged_to_the_next_attempt(env: Env) -> None:
    """A check that leaves a cache in work/ (as pytest does) and fails once: the repaired attempt passes
    writes_scope (section 14: the checks are not the agent's work); a leftover the agent rewrites is its own."""
    flag = env.tmp / "second-time"
    script = (
        "import os, sys; os.makedirs('.cache/v', exist_ok=True)\n"
        "open('.cache/v/lastfailed', 'w').write(str(os.path.exists(sys.argv[1])))\n"
        "if os.path.exists(sys.argv[1]): print('1 passed'); sys.exit(0)\n"
        "open(sys.argv[1], 'w').close(); print('1 failed'); sys.exit(1)"
    )
    checks = [{"name": "tests", "command": [sys.executable, "-c", script, str(flag)]}]
    env.configure(agents={"worker": agent(env, checks, repair=True, retry_safe=True, max_attempts=2)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CHK-LEFT"))
    result = env.wait_job("CHK-LEFT", "done")
    assert len(result["attempts"]) == 2
    assert by_name(result, "writes_scope")["ok"] is True and by_name(result, "tests")["ok"] is True
    assert (env.root / "done" / "CHK-LEFT" / "work" / ".cache" / "v" / "lastfailed").read_text() == "True"

    assert d.stop() == 0
    flag.unlink()  # the same, but the agent rewrites the check's cache on its second attempt
    touch = "import pathlib; p = pathlib.Path('.cache/v/lastfailed'); p.exists() and p.write_text('agent')"
    spec = agent(env, checks, repair=True, retry_safe=True, max_attempts=2, before=None)
    spec["command"] = ["sh", "-c", f'{sys.executable} -c "{touch}"; exec "$0" "$@"', *spec["command"]]
    env.configure(agents={"worker": spec})
    env.daemon().wait_ready()
    env.drop(order("CHK-LEFT-2"))
    result = env.wait_job("CHK-LEFT-2", "failed")
    assert result["reason"].startswith("writes_scope: .cache/v/lastfailed is outside writes"), result["reason"]


def test_a_failing_check_fails_the_job_and_feeds_the_repair(env: Env) -> None:
    """A check that exits 1 fails the attempt; with repair the next attempt gets it in feedback.json, then passes."""
    flag = env.tmp / "second-time"
    script = (
        "import os, sys; p = sys.argv[1]\n"
        "if os.path.exists(p): print('all good'); sys.exit(0)\n"
        "open(p, 'w').close(); print('FAILED test_totals - assert 3 == 4', file=sys.stderr); sys.exit(1)"
    )
    checks = [{"name": "tests", "command": [sys.executable, "-c", script, str(flag)], "timeout": 20}]
    env.configure(agents={"worker": agent(env, checks, repair=True, retry_safe=True, max_attempts=2)})
    env.daemon().wait_ready()
    env.drop(order("CHK-REPAIR"))
    result = env.wait_job("CHK-REPAIR", "done")
    folder = env.root / "done" / "CHK-REPAIR"
    feedback = json.loads((folder / "work" / "feedback.json").read_text())
    failed = {c["name"]: c for c in feedback["failed_checks"]}
    assert failed["tests"]["ok"] is False and failed["tests"]["detail"].endswith(": FAILED test_totals - assert 3 == 4")
    assert by_name(result, "tests")["detail"].endswith(": all good")


def test_a_failing_check_without_repair_fails_the_job(env: Env) -> None:
    """A check that exits 1: the job fails and its reason names the check, its exit and its last line."""
    script = "import sys; print('FAILED test_totals', file=sys.stderr); sys.exit(1)"
    env.configure(agents={"worker": agent(env, [{"name": "tests", "command": [sys.executable, "-c", script]}])})
    env.daemon().wait_ready()
    env.drop(order("CHK-FAIL"))
    result = env.wait_job("CHK-FAIL", "failed")
    assert result["reason"].startswith("tests: exit 1 in ") and result["reason"].endswith(": FAILED test_totals")
    assert by_name(result, "exit_ok")["ok"] is True


def test_a_hanging_check_is_ended_at_its_timeout_with_its_group(env: Env) -> None:
    """A check that hangs is ended after its timeout (its whole process group) and fails the job."""
    marker = f"hang-{os.getpid()}-{time.monotonic_ns()}"
    child = f"[{sys.executable!r}, '-c', 'import time; time.sleep(60)', '{marker}']"
    script = f"import subprocess, time; subprocess.Popen({child}); print('{marker}', flush=True); time.sleep(60)"
    checks = [{"name": "lint", "command": [sys.executable, "-c", script], "timeout": 1}]
    env.configure(agents={"worker": agent(env, checks)})
    env.daemon().wait_ready()
    env.drop(order("CHK-HANG"))
    result = env.wait_job("CHK-HANG", "failed")
    assert result["reason"].startswith(f"lint: timed out after 1 s: {marker}")
    wait_until(lambda: not processes_with(marker), 15, "the check's group to be gone")


def test_checks_do_not_run_when_the_agent_failed(env: Env) -> None:
    """An agent that exits 1 with no receipt: its checks are recorded ok null, 'not run'."""
    plan = env.tmp / "plan.json"
    plan.write_text(json.dumps({"limit": {"times": 1, "stderr": "boom", "exit": 1}}))
    spec = agent(env, [{"name": "tests", "command": ["false"]}])
    spec["command"] += ["--plan", str(plan)]
    env.configure(agents={"worker": spec})
    env.daemon().wait_ready()
    env.drop(order("CHK-NOTRUN"))
    result = env.wait_job("CHK-NOTRUN", "failed")
    check = by_name(result, "tests")
    assert check["ok"] is None and check["detail"].startswith("not run: the agent did not pass")
    assert result["reason"].startswith("exit_ok: exit 1")


def test_a_check_named_like_a_built_in_one_is_a_config_error(env: Env) -> None:
    """checks: [{name: exit_ok}] is refused with one line naming the file and the field (exit 2)."""
    env.configure(agents={"worker": agent(env, [{"name": "exit_ok", "command": ["true"]}])})
    proc = env.cli("validate")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{env.config_path}: agents.worker.checks[0].name: exit_ok is a built-in check's name"


def test_checks_run_in_the_agents_worktree(env: Env, tmp_path: Path) -> None:
    """With a git workspace, a check runs in the job's worktree (where the agent changed the files)."""
    repo = make_repo(tmp_path / "shop")
    script = "import os; print(os.getcwd()); raise SystemExit(0 if os.path.exists('src/C1.txt') else 1)"
    agent = coder(
        env,
        repo,
        "--write",
        "src/{job}.txt=done",
        checks=[{"name": "built", "command": [sys.executable, "-c", script]}],
    )
    env.configure(agents={"coder": agent})
    env.daemon().wait_ready()
    env.drop(code_order("C1"))
    result = env.wait_job("C1", "done")
    worktree = env.root / ".state" / "worktrees" / "C1"
    assert by_name(result, "built")["detail"].endswith(f": {worktree}")


def test_files_a_check_leaves_in_the_worktree_are_not_the_jobs_work(env: Env, tmp_path: Path) -> None:
    """A check that writes a cache outside writes: the branch and `changed` hold only what writes_scope judged."""
    repo = make_repo(tmp_path / "shop")
    script = "open('OUTSIDE.txt', 'w').write('cache'); open('src/C2.txt', 'a').write('more')"
    check = {"name": "t", "command": [sys.executable, "-c", script]}
    agent = coder(env, repo, "--write", "src/{job}.txt=done", checks=[check])
    env.configure(agents={"coder": agent})
    env.daemon().wait_ready()
    env.drop(code_order("C2"))
    result = env.wait_job("C2", "done")
    assert result["workspace"]["changed"] == ["src/C2.txt"]
    assert git(repo, "diff", "--name-only", "main", "dispatch/C2") == "src/C2.txt"
    assert git(repo, "show", "dispatch/C2:src/C2.txt") == "done"  # as the agent left it, before the check


def test_a_job_cancelled_before_any_attempt_records_its_checks_not_run(env: Env) -> None:
    """Paused agent, order queued, then cancelled: result.json names every check, the agent's own too, ok null."""
    env.configure(agents={"worker": agent(env, [{"name": "tests", "command": ["true"]}])})
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "worker", check=True)
    env.drop(order("CHK-CANCEL"))
    env.cli("cancel", "CHK-CANCEL", check=True)
    result = env.wait_job("CHK-CANCEL", "failed")
    assert result["reason"] == "cancelled"
    check = by_name(result, "tests")
    assert check["ok"] is None and check["detail"].startswith("not run"), check
    assert result["checks"][-1]["name"] == "tests"


@pytest.mark.parametrize("settings", [{}, {"repair": True, "retry_safe": True, "max_attempts": 2}])
def test_a_job_cancelled_while_its_check_runs_fails_cancelled_and_is_not_retried(
    env: Env, settings: dict[str, Any]
) -> None:
    """Cancel during a check: reason exactly `cancelled`, no job.retrying even with repair, the check ok null."""
    script = "import time; print('running tests', flush=True); time.sleep(30)"
    checks = [
        {"name": "tests", "command": [sys.executable, "-c", script], "timeout": 60},
        {"name": "lint", "command": ["true"]},
    ]
    env.configure(agents={"worker": agent(env, checks, **settings)}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CHK-CUT"))
    log = env.root / "active" / "CHK-CUT" / "attempts" / "1" / "checks" / "tests.log"
    wait_until(lambda: log.exists() and log.read_text() == "running tests\n", what="the check to run")
    env.cli("cancel", "CHK-CUT", check=True)
    result = env.wait_job("CHK-CUT", "failed")
    assert result["reason"] == "cancelled"
    tests, lint = by_name(result, "tests"), by_name(result, "lint")
    assert tests["ok"] is None and tests["detail"].startswith("cancelled after "), tests
    assert tests["detail"].endswith(": running tests"), tests
    assert lint["ok"] is None and lint["detail"] == "not run: the job was cancelled", lint
    assert [a["n"] for a in result["attempts"]] == [1]
    assert not [e for e in d.events() if e.get("event") == "job.retrying"]


def test_a_check_run_again_after_a_crash_keeps_the_interrupted_runs_log(env: Env) -> None:
    """kill -9 during a check, restart: it runs again; its log keeps the first run, the detail is the new run's."""
    flag = env.tmp / "first-run"
    script = (
        "import os, sys, time; p = sys.argv[1]\n"
        "if os.path.exists(p): sys.exit(0)\n"
        "open(p, 'w').close(); print('first run', flush=True); time.sleep(60)"
    )
    checks = [{"name": "tests", "command": [sys.executable, "-c", script, str(flag)], "timeout": 90}]
    env.configure(agents={"worker": agent(env, checks)}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CHK-CRASH"))
    log = env.root / "active" / "CHK-CRASH" / "attempts" / "1" / "checks" / "tests.log"
    wait_until(lambda: log.exists() and log.read_text() == "first run\n", what="the check's first run")
    d.kill()
    env.daemon()
    result = env.wait_job("CHK-CRASH", "done")
    log = env.root / "done" / "CHK-CRASH" / "attempts" / "1" / "checks" / "tests.log"
    assert log.read_text() == "first run\n"
    detail = by_name(result, "tests")["detail"]
    assert detail.startswith("exit 0 in ") and "first run" not in detail, detail


def test_files_a_check_left_in_the_worktree_are_not_charged_to_the_repaired_attempt(env: Env, tmp_path: Path) -> None:
    """A check that writes a cache in the worktree (not ignored) and fails once, and changes a tracked file: the
    repaired attempt passes writes_scope (section 14), and the branch holds only the agent's change."""
    repo = make_repo(tmp_path / "shop")
    flag = env.tmp / "second-time"
    script = (
        "import os, sys; open('chk_cache.txt', 'w').write(str(os.path.exists(sys.argv[1])))\n"
        "open('README.md', 'a').write('formatted\\n')\n"
        "if os.path.exists(sys.argv[1]): print('1 passed'); sys.exit(0)\n"
        "open(sys.argv[1], 'w').close(); print('1 failed'); sys.exit(1)"
    )
    check = {"name": "t", "command": [sys.executable, "-c", script, str(flag)]}
    agent = coder(env, repo, "--write", "src/{job}.txt=done", checks=[check], repair=True, retry_safe=True,
                  max_attempts=2)  # fmt: skip
    env.configure(agents={"coder": agent})
    env.daemon().wait_ready()
    env.drop(code_order("CL2"))
    result = env.wait_job("CL2", "done")
    assert len(result["attempts"]) == 2
    assert by_name(result, "writes_scope")["ok"] is True, result["checks"]
    assert result["workspace"]["changed"] == ["src/CL2.txt"]
    assert git(repo, "diff", "--name-only", "main", "dispatch/CL2") == "src/CL2.txt"


def test_a_job_recovered_with_its_receipt_runs_its_checks_and_a_failing_one_fails_it(env: Env) -> None:
    """kill -9 after the receipt: the next daemon checks the receipt with exit_ok null ("exit status lost", section
    6) and the agent's own checks run too and decide: a crash never lets work pass that a check fails."""
    fails = [{"name": "tests", "command": [sys.executable, "-c", "print('1 failed'); raise SystemExit(1)"]}]
    env.configure(agents={"worker": env.agent("--sleep-after", "30", checks=fails)}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CHK-REC"))
    receipt = env.root / "active" / "CHK-REC" / "work" / "receipt.json"
    wait_until(receipt.exists, 30, "the agent's receipt")
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("CHK-REC", "failed", timeout=40)
    assert by_name(result, "exit_ok")["ok"] is None and "lost" in by_name(result, "exit_ok")["detail"]
    tests = by_name(result, "tests")
    assert tests["ok"] is False and tests["detail"].endswith(": 1 failed"), tests
    assert result["reason"].startswith("tests: exit 1 in "), result["reason"]
    assert d2.stop() == 0


def test_a_checks_relative_paths_resolve_as_the_config_says(env: Env) -> None:
    """Relative paths in the config resolve against the config's folder (contract section 3): a check script beside
    the config (`[sh, checks/ok.sh]`) is run from there, while a path that names nothing there (`out/x.txt`) is the
    workspace's own, where the check runs."""
    from seam_fixtures import GOOD, sh
    from seam_fixtures import order as seam_order

    folder = env.config_path.parent
    (folder / "checks").mkdir(parents=True, exist_ok=True)
    (folder / "checks" / "ok.sh").write_text('echo "beside the config in $PWD"\n')
    checks = [
        {"name": "script", "command": ["sh", "checks/ok.sh"]},
        {"name": "made", "command": ["test", "-f", "out/x.txt"]},
    ]
    make = "mkdir -p out; echo x > out/x.txt; "
    env.configure(agents={"worker": sh(make + GOOD, writes=["out/x.txt"], checks=checks)})
    env.daemon().wait_ready()
    env.drop(seam_order("CHK-PATHS"))
    result = env.wait_job("CHK-PATHS", "done")
    work = env.root / "active" / "CHK-PATHS" / "work"  # where it ran, before the job moved to done/
    assert by_name(result, "script")["detail"].endswith(f": beside the config in {work}")
    assert by_name(result, "made")["ok"] is True
