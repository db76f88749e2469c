"""What every job needs from its daemon, handed over once at start (``JobContext``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dispatcher.job.finish import Finisher
from dispatcher.job.starting import Starts
from dispatcher.lanes import Lanes
from dispatcher.layout import Layout
from dispatcher.ledger.base import Gate, Ledger
from dispatcher.spec.settings import Config

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics  # prometheus_client is imported only when metrics_file is set


@dataclass
class JobContext:
    """What every job needs from its daemon."""

    layout: Layout
    ledger: Ledger
    lanes: Lanes
    finisher: Finisher
    config: Callable[[], Config]
    stopping: Callable[[], bool]
    fenced: Callable[[], bool] = lambda: False  # no lease renewal for lease/2: write nothing into job folders
    metrics: Metrics | None = None
    gates: Callable[[], Sequence[Gate]] = lambda: ()  # the daemon's snapshot of the ledger's gates
    note_gate: Callable[[Gate], None] = lambda gate: None  # a gate this daemon just set: into the snapshot now
    starts: Starts = field(default_factory=Starts)  # agents being started now: work that can wait, waits
    #: ids of jobs adopted at start whose recovery has not decided yet (READY=1 waits for them)
    unrecovered: set[str] = field(default_factory=set)
    recovered: Callable[[str], None] = lambda job_id: None  # a job's recovery decided (or it ended)
    # the descriptor of the agent slot a job holds (job_id, agent), for its agent to inherit (``Ledger.slot_fd``)
    slot_fd: Callable[[str, str], int | None] = lambda job_id, agent: None
