"""Section 15 sandbox: bubblewrap keeps an agent's writes to its workspace, work/, /tmp and sandbox_writable."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, order, wait_until
from git_helpers import code_order, coder, git, make_repo, need
from helpers_faults import ENV_DUMP, alive, env_under, processes_with, wait_start

EROFS = "Read-only file system"


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Env]:
    """A dispatch root, config and home outside /tmp (under /var/tmp): the sandbox's /tmp is its own."""
    with env_under("/var/tmp", "dispatcher-sandbox-") as e:
        yield e


def _sandboxed(e: Env, repo: Path, *flags: str, **settings: Any) -> dict[str, Any]:
    """Return the coding agent under the sandbox; its start records (one file each) stay writable."""
    need("bwrap", "bubblewrap")
    counts = [e.count_file, Path(f"{e.count_file}.cwd")]
    for f in counts:
        f.touch()  # bound one file at a time: the test's folder holds the dispatch root
    writable = [*map(str, counts), *settings.pop("sandbox_writable", [])]
    return coder(e, repo, *flags, sandbox=True, sandbox_writable=writable, **settings)


def _one_job(env: Env, repo: Path, job_id: str, flags: list[str], out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Run one job of the sandboxed coding agent with flags (its report in out/, writable); return result and report."""
    report = out / "r.json"
    env.configure(agents={"coder": _sandboxed(env, repo, *flags, "--report", str(report), sandbox_writable=[str(out)])})
    env.drop(code_order(job_id))
    d = env.daemon()
    result = env.wait_job(job_id, "done")
    d.stop()
    return result, json.loads(report.read_text())


def test_writes_outside_fail_inside_the_agent_and_workspace_writes_succeed(outside: Env) -> None:
    """Writes to /etc, the root's done/ and $HOME fail with EROFS and leave no file; workspace writes succeed."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    home = env.tmp / "home"
    (home / ".agent").mkdir(parents=True)
    out = env.tmp / "out"
    out.mkdir()
    strays = ["/etc/dispatcher-stray", str(env.root / "done" / "stray"), str(home / "stray")]
    strays.append(str(repo / ".git" / "config"))  # the agent commits on its branch, never configures git
    flags = [f"--try-write={p}" for p in strays] + ["--try-write", str(home / ".agent" / "state")]
    flags += ["--try-write", "/tmp/private", "--write", "src/{job}.txt=inside", "--report", str(out / "report.json")]
    flags += ["--commit"]
    agent = _sandboxed(env, repo, *flags, sandbox_writable=["~/.agent", str(out)], env={"HOME": str(home)})
    env.configure(agents={"coder": agent})
    env.drop(code_order("S1"))
    d = env.daemon()
    result = env.wait_job("S1", "done")
    d.stop()
    report = json.loads((out / "report.json").read_text())
    assert report == {p: EROFS for p in strays} | {str(home / ".agent" / "state"): "written", "/tmp/private": "written"}
    assert [os.path.exists(p) for p in strays[:3]] == [False, False, False]
    assert "stray" not in (repo / ".git" / "config").read_text()
    assert not os.path.exists("/tmp/private")  # the agent's /tmp was its own
    assert result["workspace"]["changed"] == ["src/S1.txt"]
    assert git(repo, "show", f"{result['workspace']['head']}:src/S1.txt") == "inside"
    assert git(repo, "log", "-1", "--format=%s", result["workspace"]["head"]) == "S1: work"  # its own commit
    assert result["attempts"][0]["argv"][:2] == [sys.executable, str(Path(__file__).parent / "agents" / "coder.py")]


def test_a_sandboxed_agent_moves_only_its_own_branch(outside: Env) -> None:
    """Its commit lands on its branch; main, another branch, the objects folder and the tags stay as they were."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    git(repo, "branch", "keep-me")
    main, kept = git(repo, "rev-parse", "main"), git(repo, "rev-parse", "keep-me")
    objects = sorted(p.name for p in (repo / ".git" / "objects").iterdir())
    out = env.tmp / "out"
    out.mkdir()
    moves = ["update-ref refs/heads/main HEAD", "branch -D keep-me", "tag stray HEAD", "update-ref -d refs/heads/main"]
    stray = str(repo / ".git" / "objects" / "stray")
    flags = ["--write", "src/{job}.txt=inside", "--commit", "--try-write", stray]
    flags += [arg for move in moves for arg in ("--git", move)]
    result, report = _one_job(env, repo, "S2", flags, out)
    # in its own view the agent may move refs and write objects (deleting one needs packed-refs, which stays read-only)
    assert [report[stray], report[f"git {moves[0]}"], report[f"git {moves[2]}"]] == ["written", "ok", "ok"]
    assert git(repo, "rev-parse", "main") == main
    assert git(repo, "rev-parse", "keep-me") == kept
    assert git(repo, "tag", "--list") == ""
    assert sorted(p.name for p in (repo / ".git" / "objects").iterdir() if len(p.name) != 2) == [
        n for n in objects if len(n) != 2
    ]  # no stray file there: only the commit's objects came in, in their folders
    head = result["workspace"]["head"]
    assert git(repo, "rev-parse", "dispatch/S2") == head != main
    assert git(repo, "show", f"{head}:src/S2.txt") == "inside"
    assert git(repo, "log", "-1", "--format=%s", head) == "S2: work"
    assert git(repo, "fsck", "--no-dangling").strip() == ""
    assert not list((env.root / ".state" / "worktrees").glob("*.gitview*"))


def test_a_commit_made_in_the_sandbox_before_a_daemon_crash_reaches_the_branch(outside: Env) -> None:
    """kill -9 while the sandboxed agent has committed in its view: the next daemon takes the commit onto the branch."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    out = env.tmp / "out"
    out.mkdir()
    flags = ["--write", "src/{job}.txt=inside", "--commit", "--report", str(out / "r.json"), "--sleep-after", "60"]
    env.configure(agents={"coder": _sandboxed(env, repo, *flags, sandbox_writable=[str(out)])})
    env.drop(code_order("S3"))
    d = env.daemon()
    wait_until(lambda: (out / "r.json").exists(), 60, "the agent's commit")
    view = env.root / ".state" / "worktrees" / ".S3.gitview"
    assert view.is_dir() and git(repo, "rev-parse", "dispatch/S3") == git(repo, "rev-parse", "main")
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("S3")
    d2.stop()
    head = result["workspace"]["head"]
    assert git(repo, "rev-parse", "dispatch/S3") == head
    assert git(repo, "log", "--format=%s", f"main..{head}").splitlines()[-1] == "S3: work"  # the agent's own commit
    assert git(repo, "show", f"{head}:src/S3.txt") == "inside"
    assert git(repo, "fsck", "--no-dangling").strip() == ""
    assert not view.exists()


def test_a_sandboxed_agent_commits_in_a_worktree_of_a_bare_repository(outside: Env) -> None:
    """A bare repository keeps no logs/: the view still gives the agent one, and its commit lands on its branch."""
    env = outside
    src = make_repo(env.tmp / "src")
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(env.tmp / "shop.git")], check=True)
    repo = env.tmp / "shop.git"
    out = env.tmp / "out"
    out.mkdir()
    result, _ = _one_job(env, repo, "S5", ["--write", "src/{job}.txt=inside", "--commit"], out)
    head = result["workspace"]["head"]
    assert git(repo, "log", "-1", "--format=%s", head) == "S5: work"
    assert git(repo, "show", f"{head}:src/S5.txt") == "inside"


def test_a_view_half_removed_by_a_crash_does_not_stop_the_jobs_next_attempt(outside: Env) -> None:
    """kill -9 mid-attempt, the view then left half removed (as a crash in its removal leaves it): the
    restart still runs attempt 2 in a fresh view, and the job is done with that attempt's commit."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    flags = ["--sleep-first", "60", "--write", "src/{job}.txt=inside", "--commit"]
    env.configure(agents={"coder": _sandboxed(env, repo, *flags, retry_safe=True, max_attempts=2)})
    env.drop(code_order("S6"))
    d = env.daemon()
    wait_until(env.starts, what="the agent to start")
    view = env.root / ".state" / "worktrees" / ".S6.gitview"
    d.kill()
    # the agent slept: nothing to take back; its removal then stopped half-way, the folder still there
    (view / "view.json").unlink()
    shutil.rmtree(view / "refs")
    assert view.is_dir() and (view / "objects").is_dir()
    d2 = env.daemon()
    result = env.wait_job("S6", "done")
    d2.stop()
    assert env.starts() == [("S6", 1), ("S6", 2)]
    head = result["workspace"]["head"]
    assert git(repo, "rev-parse", "dispatch/S6") == head
    assert git(repo, "log", "-1", "--format=%s", head) == "S6: work"  # attempt 2's own commit, from its view
    assert git(repo, "show", f"{head}:src/S6.txt") == "inside"
    assert not list(view.parent.glob("*.gitview*"))


def test_a_cancelled_retry_keeps_its_commit_not_the_first_attempts_tree(outside: Env) -> None:
    """Attempt 1 fails and leaves src/first.txt; attempt 2 starts from base, commits, and is cancelled:
    the branch ends at attempt 2's commit, with no commit of attempt 1's files over it."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    out = env.tmp / "out"
    out.mkdir()
    flags = ["--fail-first", "src/first.txt", "--write", "src/{job}.txt=second", "--commit"]
    flags += ["--report", str(out / "r.json"), "--sleep-after", "60"]
    agent = _sandboxed(env, repo, *flags, retry_safe=True, max_attempts=2, sandbox_writable=[str(out)])
    env.configure(agents={"coder": agent})
    env.drop(code_order("S7"))
    d = env.daemon()
    wait_until(lambda: (out / "r.json").exists(), 60, "attempt 2's commit")
    assert json.loads((out / "r.json").read_text()) == {"fail_first": "absent"}  # attempt 2 started from base
    env.cli("cancel", "S7", check=True)
    result = env.wait_job("S7", "failed")
    d.stop()
    assert env.starts() == [("S7", 1), ("S7", 2)]
    head = result["workspace"]["head"]
    assert git(repo, "rev-parse", "dispatch/S7") == head
    assert result["workspace"]["changed"] == ["src/S7.txt"]  # not src/first.txt, attempt 1's
    assert git(repo, "log", "--format=%s", f"main..{head}").splitlines() == ["S7: work"]
    assert git(repo, "show", f"{head}:src/S7.txt") == "second"


def test_sandbox_network_false_blocks_a_connection_to_a_local_listener(env: Env, tmp_path: Path) -> None:
    """With sandbox_network: false the agent cannot reach a listener on 127.0.0.1; with the network it can."""
    repo = make_repo(tmp_path / "shop")
    out = tmp_path / "out"
    out.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as listener:  # closed whatever the outcome
        port = listener.getsockname()[1]
        report = ("--report", str(out / "cut.json"))
        cut = _sandboxed(env, repo, "--connect", str(port), *report, sandbox_writable=[str(out)])
        net = _sandboxed(
            env, repo, "--connect", str(port), "--report", str(out / "net.json"), sandbox_writable=[str(out)]
        )
        env.configure(agents={"cut": cut | {"sandbox_network": False}, "net": net})
        env.drop(code_order("N1", to="cut"))
        env.drop(code_order("N2", to="net"))
        d = env.daemon()
        env.wait_job("N1", "done")
        env.wait_job("N2", "done")
        d.stop()
    assert json.loads((out / "cut.json").read_text())["connect"] in ("Connection refused", "Network is unreachable")
    assert json.loads((out / "net.json").read_text())["connect"] == "connected"


def test_the_probe_runs_under_the_sandbox_in_the_workspace(env: Env, tmp_path: Path) -> None:
    """The probe (as the checks) sees the workspace as the agent left it and cannot write outside."""
    repo = make_repo(tmp_path / "shop")
    out = tmp_path / "out"
    out.mkdir()
    probe = ["sh", "-c", 'pwd > "$0"; ls src >> "$0"; touch /etc/probe-stray 2>> "$0"; exit 1', str(out / "probe.txt")]
    agent = _sandboxed(
        env, repo, "--fail-first", "src/first.txt", probe=probe, max_attempts=2, sandbox_writable=[str(out)]
    )
    env.configure(agents={"coder": agent})
    env.drop(code_order("P1"))
    d = env.daemon()
    env.wait_job("P1", "done")
    d.stop()
    lines = (out / "probe.txt").read_text().splitlines()
    assert lines[0] == str(env.root / ".state" / "worktrees" / "P1")
    assert lines[1:3] == ["app.py", "first.txt"]
    assert EROFS in lines[3] and not os.path.exists("/etc/probe-stray")


def test_timeout_ends_the_agent_inside_the_sandbox(env: Env, tmp_path: Path) -> None:
    """The agent's group is bwrap's: a timeout ends the agent inside it, and the job fails as timed out."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": _sandboxed(env, repo, "--sleep", "60", timeout=1)})
    env.drop(code_order("T1"))
    d = env.daemon()
    wait_start(env, "T1")  # the pid it records is its own pid namespace's: found by its command line instead
    pids = processes_with(str(env.count_file))
    assert pids, "the sandboxed agent is not running"
    result = env.wait_job("T1", "failed")
    d.stop()
    assert result["reason"].startswith("exit_ok: timed out")
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the sandboxed agent to be gone")


def test_a_process_the_agent_left_behind_in_another_session_ends_with_it(outside: Env) -> None:
    """`setsid` takes a child out of the agent's group, not out of its sandbox: it ends when the agent ends."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    marker = "time.sleep(91.3)"
    stray = [sys.executable, "-c", f"import time; {marker}"]  # in a session of its own (start_new_session)
    leave = f"import subprocess; subprocess.Popen({stray!r}, start_new_session=True)"
    agent = _sandboxed(env, repo, "--write", "src/{job}.txt=x")
    agent["before"] = None
    agent["command"] = ["sh", "-c", f'{sys.executable} -c {shlex.quote(leave)}; exec "$@"', "sh", *agent["command"]]
    env.configure(agents={"coder": agent})
    env.drop(code_order("T2"))
    d = env.daemon()
    try:
        env.wait_job("T2", "done")
        d.stop()
        wait_until(lambda: not processes_with(marker), 10, "the process left behind to be gone")
    finally:
        for pid in processes_with(marker):  # never outlive the test, whatever it found
            os.kill(pid, signal.SIGKILL)


def test_sandbox_without_bubblewrap_is_a_config_error_naming_the_package(env: Env, tmp_path: Path) -> None:
    """A config with sandbox: true on a machine without bwrap is refused (exit 2), naming the bubblewrap package."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, sandbox=True)})
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "validate", "--config", str(env.config_path)],
        capture_output=True,
        text=True,
        env=cli_env() | {"PATH": str(empty)},
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"{env.config_path}: agents.coder.sandbox: sandbox: true needs bwrap, "
        "which is not installed (install the bubblewrap package)\n"
    )


def test_a_sandboxed_agent_has_no_capability_and_cannot_remount_the_root_writable(outside: Env) -> None:
    """A daemon run as root (a root shell, a container): its sandboxed agent has no capability left, so
    `mount -o remount,rw /` is refused and a write outside what it may write still fails (with every capability
    of root kept, the remount made the whole filesystem writable to it)."""
    env = outside
    need("bwrap", "bubblewrap")
    env.count_file.touch()
    out, escaped = env.tmp / "out", env.tmp / "ESCAPED"
    out.mkdir()
    probe = (
        f"grep CapEff /proc/self/status > {out}/caps; mount -o remount,rw / 2>/dev/null; echo $? > {out}/mount.rc;"
        f" echo x > {escaped} 2>/dev/null; echo $? > {out}/write.rc"
    )
    agent = env.agent(sandbox=True, sandbox_writable=[str(env.count_file), str(out)])
    agent["command"] = ["sh", "-c", probe + '; exec "$@"', "sh", *agent["command"]]
    env.configure(agents={"worker": agent})
    env.drop(order("CAPS"))
    d = env.daemon()
    env.wait_job("CAPS", "done")
    d.stop()
    assert (out / "caps").read_text().split() == ["CapEff:", "0000000000000000"]
    assert (out / "mount.rc").read_text().strip() != "0"
    assert (out / "write.rc").read_text().strip() != "0" and not escaped.exists()


def test_a_sandboxed_agent_without_a_workspace_works_in_work(env: Env, tmp_path: Path) -> None:
    """sandbox: true without a workspace: the agent writes its output in work/ and the job is done as before."""
    need("bwrap", "bubblewrap")
    env.count_file.touch()
    env.configure(agents={"worker": env.agent(sandbox=True, sandbox_writable=[str(env.count_file)])})
    env.drop(order("PLAIN"))
    d = env.daemon()
    result = env.wait_job("PLAIN", "done")
    d.stop()
    assert "workspace" not in result
    assert (env.job_dir("PLAIN", "done") / "work" / "out.csv").exists()
    assert env.starts() == [("PLAIN", 1)]


def test_a_sandboxed_agent_gets_the_same_environment_names_as_without_the_sandbox(env: Env) -> None:
    """Section 3's environment, nothing else, under bubblewrap too: no PWD (bwrap sets one after its --chdir)."""
    need("bwrap", "bubblewrap")
    script, dump = env.tmp / "env_dump.py", env.tmp / "env.jsonl"
    script.write_text(ENV_DUMP)
    dump.touch()
    plain = {"command": [sys.executable, str(script), str(dump)], "timeout": 30}
    boxed = {**plain, "sandbox": True, "sandbox_writable": [str(dump)]}
    env.configure(agents={"plain": plain, "boxed": boxed})
    env.drop(order("ENV-PLAIN", to="plain", accept={}))
    env.drop(order("ENV-BOXED", to="boxed", accept={}))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    seen = [json.loads(line) for line in dump.read_text().splitlines()]
    by_job = {e["DISPATCH_JOB_ID"]: e for e in seen}
    assert sorted(by_job["ENV-BOXED"]) == sorted(by_job["ENV-PLAIN"]), (
        sorted(by_job["ENV-BOXED"]),
        sorted(by_job["ENV-PLAIN"]),
    )
    assert "PWD" not in by_job["ENV-BOXED"]


def test_a_sandboxed_agent_keeps_a_pwd_its_env_gives_it(env: Env) -> None:
    """An agent whose `env` sets PWD gets that PWD under the sandbox as without it (bwrap sets its own)."""
    need("bwrap", "bubblewrap")
    script, dump = env.tmp / "env_dump.py", env.tmp / "env.jsonl"
    script.write_text(ENV_DUMP)
    dump.touch()
    boxed = {
        "command": [sys.executable, str(script), str(dump)],
        "timeout": 30,
        "env": {"PWD": "/custom"},
        "sandbox": True,
        "sandbox_writable": [str(dump)],
    }
    env.configure(agents={"boxed": boxed})
    env.drop(order("ENV-PWD", to="boxed", accept={}))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    (seen,) = [json.loads(line) for line in dump.read_text().splitlines()]
    assert seen["PWD"] == "/custom"  # noqa: S105 - a folder, not a password


def test_a_sandboxed_agent_cannot_point_the_daemons_git_at_its_own_config(outside: Env) -> None:
    """commondir and gitdir are read-only to it; a config.worktree it writes (a filter) is gone before git runs."""
    env = outside
    repo = make_repo(env.tmp / "shop")
    git(repo, "config", "core.repositoryformatversion", "1")
    git(repo, "config", "extensions.worktreeConfig", "true")  # git reads the worktree's config.worktree
    marker = env.tmp / "filter-ran"
    admin = repo / ".git" / "worktrees" / "S4"
    out = env.tmp / "out"
    out.mkdir()
    clean = f"sh -c 'echo ran >> {marker}; cat'"
    flags = ["--write", "src/.gitattributes=* filter=x", "--write", "src/{job}.txt=inside"]
    flags += [arg for name in ("commondir", "gitdir", "config.worktree") for arg in ("--try-write", f"{admin}/{name}")]
    flags += ["--git", f"config --file {admin}/config.worktree filter.x.clean {shlex.quote(clean)}"]
    result, report = _one_job(env, repo, "S4", flags, out)
    assert {k: v for k, v in report.items() if not k.startswith("git ")} == dict.fromkeys(
        (f"{admin}/commondir", f"{admin}/gitdir", f"{admin}/config.worktree"), EROFS
    )
    assert not marker.exists()  # the daemon's seal (git add -A) ran no filter of the agent's
    assert not (admin / "config.worktree").exists()
    assert sorted(result["workspace"]["changed"]) == ["src/.gitattributes", "src/S4.txt"]


def test_a_job_named_like_another_jobs_view_keeps_its_own_worktree(env: Env, tmp_path: Path) -> None:
    """Jobs X.gitview (a plain worktree, a valid job id) and X (sandboxed) at once on one repository: X's view of the
    repository is not X.gitview's worktree, so neither job disturbs the other (section 15)."""
    repo = make_repo(tmp_path / "shop")
    plain = coder(env, repo, "--write", "src/{job}.txt=mine", "--sleep-after", "3")
    sandboxed = _sandboxed(env, repo, "--write", "src/{job}.txt=boxed", "--commit")
    env.configure(agents={"coder": plain, "boxed": sandboxed}, max_jobs=2)
    d = env.daemon()
    d.wait_ready()
    env.drop(code_order("X.gitview"))
    wait_until(lambda: any(j == "X.gitview" for j, _a in env.starts()), 60, "X.gitview's agent")
    env.drop(code_order("X", to="boxed"))
    for job in ("X.gitview", "X"):
        result = env.wait_job(job, "done")
        assert result["workspace"]["changed"] == [f"src/{job}.txt"], result
    assert git(repo, "show", "dispatch/X.gitview:src/X.gitview.txt") == "mine"
    assert git(repo, "show", "dispatch/X:src/X.txt") == "boxed"
