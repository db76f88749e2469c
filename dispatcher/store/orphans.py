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


def leftover_groups(
    attempts: Sequence[tuple[JobFolder, int]], slots: str | os.PathLike[str] | None = None
) -> dict[str, list[int]]:
    """Return, by job id, the process groups still running of each job (blocking: scan lane).

    ``n``: the job's last attempt, whose running record an older daemon may have written.
    ``slots``: the root's slot-lock folder, whose lock every agent inherits (``_recorded``).
    """
    out: dict[str, list[int]] = {}
    wanted: dict[str, str] = {}
    slot_dir = os.fspath(slots) if slots is not None else None
    for folder, n in attempts:
        info = folder.pid_record(n)
        if info is not None:
            out[folder.job_id] = _recorded(info, folder.job_id, slot_dir)
        wanted[folder.job_id] = os.fspath(folder.work)
    if wanted:
        for job_id, groups in procs.job_groups(wanted).items():
            out[job_id] = sorted(set(out.get(job_id, [])) | set(groups))
    return out


def _recorded(info: dict[str, object], job_id: str, slots: str | None) -> list[int]:
    """The group of a recorded pid, while a process of it runs that is the job's agent or came from it.

    While the agent is there (its start as recorded, running or a zombie) the group is its own:
    a pid that names a process group is not given to a new process. Once the agent is gone, a
    group with that number may be someone else's that took the pid since: it is the job's only
    while a live member holds one of the root's slot locks, the descriptor the agent was given
    and its children inherit (an `env -i` child left behind), and no member names another job
    in its environment (another job's agent that took the pid, and its children). Members with
    the job's environment are found by ``procs.job_groups`` anyway.
    """
    if not procs.seen_here(info.get("host"), info.get("pidns")):
        return []  # noted on another host or in another pid namespace: that pid is another process here
    pid = int(str(info["pid"]))
    boot = info.get("boot_started")
    started = info.get("started")
    fields = procs.stat_fields(pid)
    live = [m for m, state, _ppid in procs.group_members(pid) if state not in ("Z", "X")]
    if fields is not None and procs.is_recorded(
        fields,
        float(str(started)) if started is not None else None,
        boot_started=float(str(boot)) if boot is not None else None,
    ):
        return [pid] if live else []  # only zombies: nothing is left to end
    if slots is None or not live or any(procs.job_id_of(m) not in (None, job_id) for m in live):
        return []  # a member names another job: the group is that job's (its agent took the pid), never ended here
    return [pid] if any(procs.holds_open_under(m, slots) for m in live) else []
