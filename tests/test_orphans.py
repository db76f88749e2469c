"""Finding a dead daemon's agents by their environment (``procs.job_groups``, ``store.orphans``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Env, cli_env, order, wait_until
from helpers_faults import alive

from dispatcher import procs
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.orphans import leftover_groups

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
needs_ns_last_pid = pytest.mark.skipif(
    not os.access(NS_LAST_PID, os.W_OK), reason="giving a process a chosen pid writes ns_last_pid (root)"
)
# runs argv[1:] as its child, as a child subreaper: the orphans below it come to it and are reaped, then it exits
REAPER = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = os.fork()
if child == 0:
    os.execv(sys.argv[1], sys.argv[1:])
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""
# takes pid argv[1] for a new session's leader that starts one member (no DISPATCH_* variable, traps SIGTERM into
# the file argv[2]) and exits: the usual double fork. Prints the member's pid (nothing if the pid could not be had).
TAKE_PID = """
import os, signal, sys, time
target = int(sys.argv[1])
for _ in range(100):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(target - 1))
    leader = os.fork()
    if leader == 0:
        if os.getpid() != target:
            os._exit(1)
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[2], "a").write("TERM\\n"))
            print(os.getpid(), flush=True)
            while True:
                time.sleep(60)
        os._exit(0)
    os.waitpid(leader, 0)
    if leader == target:
        break
"""


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs_: list[subprocess.Popen[bytes]] = []
    yield procs_
    for p in procs_:
        p.kill()
        p.wait()


def agent(
    spawned: list[subprocess.Popen[bytes]],
    work: Path,
    job_id: str,
    n: int,
    *,
    cwd: Path | None = None,
    clear: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a sleeping process in its own group, with an attempt's DISPATCH_* variables (or none)."""
    env = {"PATH": os.environ["PATH"]}
    if not clear:
        env |= {
            "DISPATCH_JOB_ID": job_id,
            "DISPATCH_ATTEMPT": str(n),
            "DISPATCH_ORDER": f"{work}/order.json",
            "DISPATCH_RECEIPT": f"{work}/receipt.json",
            "DISPATCH_WORKSPACE": str(work),
        }
    p = subprocess.Popen(SLEEP, cwd=cwd or "/", env=env, start_new_session=True)
    spawned.append(p)
    wait_until(lambda: b"time.sleep(60)" in Path(f"/proc/{p.pid}/cmdline").read_bytes(), 10, "the exec")
    return p


def job_folder(root: Path, job_id: str) -> JobFolder:
    path = root / "active" / job_id
    (path / "work").mkdir(parents=True)
    (path / "attempts" / "1").mkdir(parents=True)
    return JobFolder(path)


def test_the_jobs_processes_are_found_by_their_environment_and_not_another_roots_namesake(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """Two roots hold a job J-1: only the processes of the root asked about are its orphans, wherever they run."""
    mine, other = job_folder(tmp_path / "a", "J-1"), job_folder(tmp_path / "b", "J-1")
    ours = agent(spawned, mine.work, "J-1", 1)
    hook = agent(spawned, mine.work, "J-1", 0)  # a before hook gets DISPATCH_ATTEMPT=0: the job's all the same
    agent(spawned, other.work, "J-1", 1)
    agent(spawned, mine.work, "J-9", 1)  # another job id with this folder's path: not J-1's
    found = procs.job_groups({"J-1": os.fspath(mine.work)})
    assert found == {"J-1": sorted([ours.pid, hook.pid])}


def test_a_work_folder_reached_through_a_link_is_the_same_folder(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The agent was started with the root's path through a symlink: still the same job's agent."""
    folder = job_folder(tmp_path / "real", "J-2")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ours = agent(spawned, tmp_path / "link" / "active" / "J-2" / "work", "J-2", 1)
    assert procs.job_groups({"J-2": os.fspath(folder.work)}) == {"J-2": [ours.pid]}


def test_a_process_in_the_work_folder_without_the_variables_is_left_alone(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """A person's shell or editor in work/ is not one of the job's processes: recovery must not end it."""
    folder = job_folder(tmp_path, "J-3")
    (folder.work / "sub").mkdir()
    agent(spawned, folder.work, "J-3", 1, cwd=folder.work / "sub", clear=True)
    agent(spawned, folder.work, "J-3", 1, cwd=folder.work, clear=True)
    assert leftover_groups([(folder, 1)]) == {"J-3": []}


def test_an_agent_that_cleared_its_environment_is_found_by_the_pid_noted_at_its_start(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """`env -i` leaves no DISPATCH_* variable; the pid noted on attempts/<n>/stdout.log at its start finds it.

    A note whose process has ended, or whose pid now names another process (started later), finds nothing.
    """
    folder = job_folder(tmp_path, "J-5")
    folder.make_logs(1)
    cleared = agent(spawned, folder.work, "J-5", 1, clear=True)
    folder.note_agent(1, cleared.pid)
    assert leftover_groups([(folder, 1)]) == {"J-5": [cleared.pid]}
    other = job_folder(tmp_path, "J-6")
    other.make_logs(1)
    os.setxattr(other.path / "attempts" / "1" / "stdout.log", "user.dispatcher.agent", f"{cleared.pid} 1.000".encode())
    assert leftover_groups([(other, 1)]) == {"J-6": []}  # started long after boot + 1 s: another process


@pytest.mark.parametrize("leader_names", ["J-B", None], ids=["another-jobs-agent", "no-job"])
def test_a_group_that_took_the_pid_is_ended_only_if_none_of_it_names_another_job(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]], leader_names: str | None
) -> None:
    """J-A's agent is gone; a group now has its pid, with a member that cleared its environment and holds one of the
    root's slot locks open. If the group's leader is another job's agent (its environment names J-B), the group is
    J-B's and is never ended for J-A; if nothing in it names a job, it is what J-A's agent left behind."""
    folder = job_folder(tmp_path, "J-A")
    folder.make_logs(1)
    slots = tmp_path / ".state" / "slots"
    slots.mkdir(parents=True)
    (slots / "worker.0.lock").write_text("")
    env = {"PATH": os.environ["PATH"]} | ({"DISPATCH_JOB_ID": leader_names} if leader_names else {})
    script = (
        f"exec 7<{slots / 'worker.0.lock'}; env -i {sys.executable} -c 'import time; time.sleep(60)' & exec sleep 60"
    )
    leader = subprocess.Popen(["/bin/sh", "-c", script], env=env, start_new_session=True)
    spawned.append(leader)
    members = lambda: [m for m, state, _ in procs.group_members(leader.pid) if state not in ("Z", "X")]  # noqa: E731
    wait_until(lambda: len(members()) == 2 and not any(b"/bin/sh" in Path(f"/proc/{m}/cmdline").read_bytes()
                                                      for m in members()), 10, "the two members")  # fmt: skip
    os.setxattr(folder.path / "attempts" / "1" / "stdout.log", "user.dispatcher.agent", f"{leader.pid} 1.000".encode())
    try:
        want = [] if leader_names else [leader.pid]
        assert leftover_groups([(folder, 1)], slots) == {"J-A": want}
    finally:
        os.killpg(leader.pid, signal.SIGKILL)


def test_an_ended_agent_is_not_found(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    folder = job_folder(tmp_path, "J-4")
    p = agent(spawned, folder.work, "J-4", 1)
    p.kill()
    p.wait()
    assert leftover_groups([(folder, 1)]) == {"J-4": []}


def at_pid(pid: int, spawned: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """Start a sleeping session leader as process pid (through ns_last_pid), once that pid is free."""
    for _ in range(100):
        NS_LAST_PID.write_text(str(pid - 1))
        p = subprocess.Popen(SLEEP, env={"PATH": os.environ["PATH"]}, start_new_session=True)
        spawned.append(p)
        if p.pid == pid:
            return p
    raise AssertionError(f"another process took pid {pid} each time")


def test_a_recorded_agent_that_is_only_a_zombie_has_nothing_left_to_end(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """Its group holds no live process: no group to signal, no orphan to report."""
    folder = job_folder(tmp_path, "J-8")
    folder.make_logs(1)
    p = agent(spawned, folder.work, "J-8", 1, clear=True)
    folder.note_agent(1, p.pid)
    p.kill()
    wait_until(lambda: not alive(p.pid), 10, "the agent to be a zombie")
    assert Path(f"/proc/{p.pid}").exists(), "the zombie was reaped"
    assert leftover_groups([(folder, 1)]) == {"J-8": []}


@needs_ns_last_pid
def test_a_session_that_took_the_recorded_pid_at_once_is_not_the_agent(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The agent ended and was reaped; a new session leader got its pid well within a second of the agent's start
    (and more than a tick of /proc's clock after it was noted): not the agent, whose start a tolerance covers."""
    folder = job_folder(tmp_path, "J-9")
    folder.make_logs(1)
    p = agent(spawned, folder.work, "J-9", 1, clear=True)
    folder.note_agent(1, p.pid)
    time.sleep(0.1)  # more than a clock tick of /proc's start times (10 ms) after the note
    p.kill()
    p.wait()
    other = at_pid(p.pid, spawned)
    record = folder.pid_record(1)
    fields = procs.stat_fields(other.pid)
    assert record is not None and fields is not None
    assert abs(procs.start_boot_s(fields) - record["boot_started"]) < 1.5, "the pid was not taken soon enough"
    assert leftover_groups([(folder, 1)]) == {"J-9": []}
    assert alive(other.pid)


def daemon_under_reaper(env: Env) -> subprocess.Popen[bytes]:
    """Start `dispatcher run` as the child of a subreaper (REAPER), which reaps the agents it leaves behind."""
    argv = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run"]
    with (env.tmp / "daemon.log").open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", REAPER, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=env.tmp, env=cli_env()
        )


def noted_agent(env: Env, job_id: str) -> int:
    """Wait for the pid the daemon notes on attempt 1's stdout.log at its agent's start; return it."""
    log = env.root / "active" / job_id / "attempts" / "1" / "stdout.log"

    def noted() -> int:
        try:
            return int(os.getxattr(log, "user.dispatcher.agent").split()[0])
        except OSError:
            return 0

    return wait_until(noted, 30, "the agent's note on its stdout.log")


def kill_the_daemon(reaper: subprocess.Popen[bytes]) -> None:
    """kill -9 the daemon that runs under the reaper (its only child at first)."""
    children = Path(f"/proc/{reaper.pid}/task/{reaper.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGKILL)


@needs_ns_last_pid
def test_recovery_leaves_alone_a_group_that_took_a_dead_agents_pid(env: Env) -> None:
    """kill -9 of the daemon, then of the agent's group (reaped by a subreaper while no daemon runs); a new session
    takes the agent's pid, starts a member without DISPATCH_* variables and exits. `run --once` must not signal
    that member nor report it as the job's orphan: the job fails, interrupted and not retried."""
    agent_ = {"command": ["sleep", "60"], "retry_safe": False, "max_attempts": 1, "timeout": 100}
    env.configure(agents={"worker": agent_}, kill_grace=1)
    reaper = daemon_under_reaper(env)
    termed = env.tmp / "termed.txt"
    taker: subprocess.Popen[str] | None = None
    pid = member = 0
    try:
        env.drop(order("REUSED-1"))
        pid = noted_agent(env, "REUSED-1")
        kill_the_daemon(reaper)
        os.killpg(pid, signal.SIGKILL)
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, "the agent to be reaped")
        reaper.wait(10)

        taker = subprocess.Popen(
            [sys.executable, "-c", REAPER, sys.executable, "-c", TAKE_PID, str(pid), str(termed)],
            stdout=subprocess.PIPE,
            text=True,
            env=cli_env(),
        )
        assert taker.stdout is not None
        member = int(taker.stdout.readline() or 0)
        assert member, f"another process took pid {pid} each time"
        assert os.getpgid(member) == pid
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, "the new leader to exit (the member prints first)")

        proc = env.cli("run", "--once", timeout=60)
        ended = [line for line in (proc.stdout + proc.stderr).splitlines() if "orphan_ended" in line]
        assert ended == [], ended
        assert alive(member) and not termed.exists(), "recovery signalled a process that is not the job's"
        result = json.loads((env.root / "failed" / "REUSED-1" / "result.json").read_text())
        assert "interrupted" in json.dumps(result)
    finally:
        if reaper.poll() is None:  # cut short before the kills: the daemon and the agent go now, reaped by it
            for child in Path(f"/proc/{reaper.pid}/task/{reaper.pid}/children").read_text().split():
                os.kill(int(child), signal.SIGKILL)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            reaper.wait(10)
        if member:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)
        if taker is not None:
            taker.wait(10)
            assert taker.stdout is not None
            taker.stdout.close()


@pytest.mark.parametrize("slots", [True, False], ids=["slot-lock", "no-slot-lock"])
def test_recovery_ends_an_env_cleared_child_the_gone_agent_left_behind(env: Env, slots: bool) -> None:
    """kill -9 of the daemon; the agent then exits and is reaped, leaving a child that cleared its environment
    (`env -i sleep`) in its group. `run --once` ends that child (section 6: a leftover agent process is ended
    before the job is looked at), found by the slot lock it inherited; the job fails, interrupted. Without the
    lock (closed by the child), nothing marks it as the job's: it is left alone and the job still ends."""
    keep = "" if slots else "os.closerange(3, 65536); "
    child = f"{sys.executable} -c 'import os, time; {keep}time.sleep(300)'"
    script = f"env -i {child} </dev/null >/dev/null 2>&1 & sleep 3; exit 0"
    agent_ = {"command": ["/bin/sh", "-c", script], "retry_safe": False, "max_attempts": 1, "timeout": 100}
    env.configure(agents={"worker": agent_}, kill_grace=1)
    reaper = daemon_under_reaper(env)
    pid = 0
    left: list[int] = []
    try:
        env.drop(order("LEFT-1"))
        pid = noted_agent(env, "LEFT-1")
        kill_the_daemon(reaper)  # its agent goes on, then exits and is reaped
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 20, "the agent to exit and be reaped")
        left = [m for m, state, _ in procs.group_members(pid) if state not in ("Z", "X")]
        assert len(left) == 1 and procs.job_id_of(left[0]) is None, left
        proc = env.cli("run", "--once", timeout=60)
        ended = [line for line in (proc.stdout + proc.stderr).splitlines() if "agent.orphan_ended" in line]
        result = json.loads((env.root / "failed" / "LEFT-1" / "result.json").read_text())
        assert "interrupted" in json.dumps(result)
        if slots:
            assert len(ended) == 1 and str(pid) in ended[0], ended
            wait_until(lambda: not alive(left[0]), 10, "the left-behind child to be ended")
        else:
            assert ended == [] and alive(left[0]), ended
    finally:
        for m in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(m, signal.SIGKILL)
        if reaper.poll() is None:
            for child in Path(f"/proc/{reaper.pid}/task/{reaper.pid}/children").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child), signal.SIGKILL)
            reaper.wait(10)


def test_a_running_record_of_an_older_daemon_is_still_honoured(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """attempts/<n>/attempt.json with a pid and its boot-clock start: that group, only if the start matches."""
    folder = job_folder(tmp_path, "J-5")
    p = agent(spawned, tmp_path, "OTHER", 1, clear=True)  # nothing in its environment or folder names J-5
    fields = procs.stat_fields(p.pid)
    assert fields is not None
    boot = procs.start_boot_s(fields)
    record = folder.path / "attempts" / "1" / "attempt.json"
    record.write_text(json.dumps({"n": 1, "pid": p.pid, "boot_started": boot, "started": time.time()}))
    assert leftover_groups([(folder, 1)]) == {"J-5": [p.pid]}
    record.write_text(json.dumps({"n": 1, "pid": p.pid, "boot_started": boot - 3600, "started": time.time()}))
    assert leftover_groups([(folder, 1)]) == {"J-5": []}, "a reused pid was taken for the recorded agent"


def test_when_an_attempt_started_without_a_record(tmp_path: Path) -> None:
    """Without a running record, an interrupted attempt's start is when its folder got its logs."""
    folder = job_folder(tmp_path, "J-6")
    before = time.time()
    folder.begin_attempt(2)
    started = folder.attempt_started(2)
    assert started is not None and before - 1 <= started <= time.time() + 1
    assert folder.attempt_started(9) is None


def test_an_attempt_noted_at_its_start_keeps_that_start_when_its_folder_changes_later(tmp_path: Path) -> None:
    """The boot-clock start noted on stdout.log is read back as wall time: a file added to attempts/<n>/ later
    (the attempt's record written after a full disk let it) does not move the start to then."""
    folder = job_folder(tmp_path, "J-7")
    folder.begin_attempt(1)
    folder.make_logs(1)
    noted_at = time.time()
    folder.note_agent(1, os.getpid())
    assert folder.pid_record(1) is not None, "tmp_path's filesystem keeps no user extended attributes"
    time.sleep(1.5)
    (folder.path / "attempts" / "1" / "attempt.json").write_text("{}")  # the folder changes 1.5 s later
    started = folder.attempt_started(1)
    assert started is not None and abs(started - noted_at) < 0.3, (started, noted_at)


def test_a_pid_noted_in_another_pid_namespace_is_never_taken_for_the_agent_here() -> None:
    """A dead daemon's agent noted in another pid namespace under this host's name (a container), or on another
    host: the pid means another process in this /proc, which recovery must never end as the agent. The same
    note in this namespace and host names the agent's group."""
    import socket

    from dispatcher import procs
    from dispatcher.store import orphans

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        fields = procs.stat_fields(proc.pid)
        assert fields is not None
        note = {"pid": proc.pid, "boot_started": procs.start_boot_s(fields), "host": socket.gethostname()}
        here = orphans._recorded({**note, "pidns": procs.pid_namespace()}, "J1", None)
        elsewhere = orphans._recorded({**note, "pidns": "1"}, "J1", None)
        other_host = orphans._recorded({**note, "host": "another-host"}, "J1", None)
    finally:
        proc.kill()
        proc.wait()
    assert here == [proc.pid]
    assert elsewhere == [] and other_host == []
