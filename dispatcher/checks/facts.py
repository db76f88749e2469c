"""What the checks read: how the agent ended, the documents and entries it left in work/, its follow-ups.

``evidence.py`` gathers an ``Evidence`` from the job folder once after an attempt;
the checks (``builtin.py``) are pure functions of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dispatcher.spec.order import Order


@dataclass(frozen=True, slots=True)
class Exit:
    """How the agent process ended (``lost`` when a crash hid it)."""

    code: int | None = None
    timed_out: bool = False
    aborted: str | None = None
    seconds: float = 0.0
    timeout_s: float = 0.0
    lost: bool = False
    idle_s: float | None = None  # ended for no output and no workspace change for this long (idle_timeout)
    started: bool = True  # with ``lost``: False when its attempt holds no agent logs (only a before hook ran, if any)


@dataclass(frozen=True, slots=True)
class Doc:
    """A document read from work/: ``missing``, ``error`` (why unusable), or ``value``.

    For the receipt, ``value`` is the parsed JSON; for accept.output, an OutputSummary.
    """

    missing: bool = False
    error: str | None = None
    value: Any = None


@dataclass(frozen=True, slots=True)
class Entry:
    """One filesystem entry left in work/ (path relative to work/, POSIX style)."""

    path: str
    kind: str  # file, dir, symlink, fifo, socket, device
    nlink: int = 1
    target_inside: bool = True
    digest: str | None = None
    stamp: str | None = None  # a file the agent's checks left: its stamp now (``checks.leftovers``)


@dataclass(frozen=True, slots=True)
class Followup:
    """One entry of work/outbox/: a parsed order, or the reason it is not one."""

    name: str
    order: Order | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Evidence:
    """Everything the checks look at, gathered once after an attempt."""

    order: Order
    agent: str
    writes: tuple[str, ...]
    exit: Exit
    receipt: Doc
    output: Doc | None
    work_exists: bool
    entries: tuple[Entry, ...]
    given: Mapping[str, str]
    outbox_exists: bool
    followups: tuple[Followup, ...]
    known_ids: frozenset[str] = field(default_factory=frozenset)
    hops: int = 0
    max_hops: int = 5
    max_followups: int = 100
    changed: tuple[str, ...] | None = None  # paths the job changed in its git workspace (None: it has none)
    changed_unknown: str | None = None  # why the workspace's change could not be read
    left: Mapping[str, str] = field(default_factory=dict)  # files earlier checks left in work/ -> stamp
