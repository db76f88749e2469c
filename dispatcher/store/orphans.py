"""Agents a dead daemon left running: which process groups belong to which job's last attempt.

Recovery ends these groups before it looks at a job's evidence (README, "Guarantees").
A job's processes are found by the environment every agent, probe and hook of the job
gets (``DISPATCH_JOB_ID``, and ``DISPATCH_ORDER`` in its work/ folder), whatever their
attempt, in one walk of /proc for all the jobs being recovered, and by the agent's pid
and start noted on its stdout.log (``JobFolder.note_agent``: an agent that cleared its
environment). An attempt of an older version of the daemon may hold that record in
``attempts/<n>/attempt.json``: it is used as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dispatcher import procs
from dispatcher.store.jobstore import JobFolder


def leftover_groups(attempts: Sequence[tuple[JobFolder, int]]) -> dict[str, list[int]]:
    """Return, by job id, the process groups still running of each job (blocking: scan lane).

    ``n``: the job's last attempt, whose running record an older daemon may have written.
    """
    out: dict[str, list[int]] = {}
    wanted: dict[str, str] = {}
    for folder, n in attempts:
        info = folder.pid_record(n)
        if info is not None:
            out[folder.job_id] = _recorded(info)
        wanted[folder.job_id] = os.fspath(folder.work)
    if wanted:
        for job_id, groups in procs.job_groups(wanted).items():
            out[job_id] = sorted(set(out.get(job_id, [])) | set(groups))
    return out


def _recorded(info: dict[str, object]) -> list[int]:
    """The group of a recorded pid, while that pid is still the agent's (running, or a zombie) and a member runs.

    A pid that leads or names a process group is not given to a new process, so while the
    agent is there (its start as recorded) the group is its own. Once the agent is gone, or
    its pid names a process that started after it, a group with that number may be someone
    else's that took the pid: its members are the job's only by their environment
    (``procs.job_groups``), never by the number.
    """
    pid = int(str(info["pid"]))
    boot = info.get("boot_started")
    started = info.get("started")
    fields = procs.stat_fields(pid)
    if fields is None or not procs.is_recorded(
        fields,
        float(str(started)) if started is not None else None,
        boot_started=float(str(boot)) if boot is not None else None,
    ):
        return []
    if any(state not in ("Z", "X") for _pid, state, _ppid in procs.group_members(pid)):
        return [pid]
    return []  # only zombies: nothing is left to end
