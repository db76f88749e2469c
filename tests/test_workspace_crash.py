"""Section 15 across crashes: kill -9 in the middle of `git worktree add`, of a job, and between done and land."""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import Env, wait_until
from git_helpers import code_order, coder, git, make_repo, starts
from helpers_faults import alive, env_daemon, wait_start


def _stale(repo: Path) -> list[str]:
    """Return what a crash could leave that blocks git: lock files and locked or prunable worktrees."""
    gitdir = repo / ".git"
    found = [str(p.relative_to(gitdir)) for p in gitdir.rglob("*.lock")]
    found += [str(p.relative_to(gitdir)) for p in (gitdir / "worktrees").glob("*/locked")]
    porcelain = git(repo, "worktree", "list", "--porcelain")
    return found + [line for line in porcelain.splitlines() if line.startswith(("locked", "prunable"))]


def test_kill_in_the_middle_of_worktree_add_then_restart_leaves_nothing_stale(env: Env, tmp_path: Path) -> None:
    """A daemon killed while git adds the worktree: the next start finishes the job once, with no stale lock."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/{job}.txt=x")})
    env.drop(code_order("W1"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "workspace.add"})
    assert d.wait() == -signal.SIGKILL
    assert starts(env) == [] and (env.root / "active" / "W1").is_dir()
    assert list((repo / ".git" / "worktrees").glob("*/locked"))  # git died mid-add: its new worktree is locked
    d2 = env.daemon()
    result = env.wait_job("W1", "done")
    env.drop(code_order("W2"))
    env.wait_job("W2", "done")
    d2.stop()
    assert [(j, n) for j, n, _ in starts(env)] == [("W1", 1), ("W2", 1)]
    assert result["workspace"]["changed"] == ["src/W1.txt"]
    assert _stale(repo) == []
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    assert not list((env.root / ".state" / "worktrees").iterdir())


def test_kill_in_the_middle_of_a_job_then_restart_runs_it_again_from_base_once(env: Env, tmp_path: Path) -> None:
    """kill -9 while the agent works: the restart ends it, runs attempt 2 from base, and nothing is stuck or doubled."""
    repo = make_repo(tmp_path / "shop")
    slow = coder(env, repo, "--write", "src/{job}.txt=x", "--sleep-first", "60", retry_safe=True, max_attempts=2)
    env.configure(agents={"coder": slow})
    env.drop(code_order("K1"))
    d = env.daemon()
    wait_until(lambda: starts(env), what="the agent to start")
    tree = env.root / ".state" / "worktrees" / "K1"
    (tree / "src" / "leftover.txt").write_text("from the killed attempt\n")
    d.kill()
    first = wait_start(env, "K1")
    d2 = env.daemon()
    result = env.wait_job("K1", "done")
    d2.stop()
    assert not alive(first)  # the killed daemon's agent was ended before attempt 2 ran
    assert [(j, n) for j, n, _ in starts(env)] == [("K1", 1), ("K1", 2)]
    assert result["workspace"]["changed"] == ["src/K1.txt"]  # the leftover went with the reset to base
    assert _stale(repo) == []
    assert not tree.exists()
