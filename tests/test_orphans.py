"""Finding a dead daemon's agents by their environment (``procs.job_groups``, ``store.orphans``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until

from dispatcher import procs
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.orphans import leftover_groups

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


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


def test_an_ended_agent_is_not_found(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    folder = job_folder(tmp_path, "J-4")
    p = agent(spawned, folder.work, "J-4", 1)
    p.kill()
    p.wait()
    assert leftover_groups([(folder, 1)]) == {"J-4": []}


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
