"""Claimed jobs a gate holds (contract section 14), kept without slots until the gate lets their agent go.

A job that meets a gate before an attempt ends its run as ``Outcome.GATED``; its
wait stays recorded in the ledger (``waiting`` in `status`), and the scheduler gives
its ``max_jobs`` slot and its concurrency slot back and keeps the job object here.
When the daemon's snapshot of the gates lets the agent go, the scheduler parks it again,
oldest first, and takes slots like any parked work; the same object runs on (its
own usage limit and retry count kept), and it asks the ledger before its attempt.
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Generic, TypeVar

Job = TypeVar("Job")
RECHECK_S = 1.0  # a job set aside for a gate the daemon's snapshot did not show is taken back after this


class SetAside(Generic[Job]):
    """The jobs a gate holds (``held``), and those taken back that wait for their slots (``back``)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[Job, str, tuple[float, str], float, float]] = {}  # job, agent, age, due, expires
        self.back: dict[str, Job] = {}

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.held

    def put(
        self, job_id: str, agent: str, received: float, job: Job, *, shown: bool, expires: float | None = None
    ) -> None:
        """Keep a job a gate holds until it lifts or ``expires`` (epoch seconds) comes.

        ``shown``: the daemon's snapshot holds the agent (else the job is looked at again in a while).
        """
        due = 0.0 if shown else time.monotonic() + RECHECK_S
        self.held[job_id] = (job, agent, (received, job_id), due, float("inf") if expires is None else expires)

    def take_back(self, gated: frozenset[str], now: float, wall: float) -> tuple[list[Job], bool]:
        """Return the jobs the gates let go (or whose expires came), oldest first, and if others wait for a recheck.

        ``now`` is the monotonic clock, ``wall`` the epoch time.
        """
        free = [(h[2], h[0]) for h in self.held.values() if (h[1] not in gated and h[3] <= now) or h[4] <= wall]
        free.sort(key=lambda x: x[0])
        later = len(free) < sum(h[1] not in gated or h[4] <= wall for h in self.held.values())
        for (_, job_id), job in free:
            del self.held[job_id]
            self.back[job_id] = job
        return [job for _, job in free], later

    def due(self, gated: Container[str], now: float, wall: float) -> bool:
        """Return True if ``take_back`` would give a job back now (its gate lifted, or its expires came)."""
        return any((h[1] not in gated and h[3] <= now) or h[4] <= wall for h in self.held.values())

    def held_for(self, agents: Container[str]) -> int:
        """Return how many held jobs a gate of one of these agents holds."""
        return sum(h[1] in agents for h in self.held.values())

    def take(self, job_id: str) -> Job | None:
        """Take one held job back at once (a cancel); None if it is not held."""
        held = self.held.pop(job_id, None)
        if held is None:
            return None
        self.back[job_id] = held[0]
        return held[0]

    def launch(self, job_id: str) -> Job | None:
        """Return the job taken back that a launch continues (None: not one of these)."""
        return self.back.pop(job_id, None)
