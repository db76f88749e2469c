"""A job's lifecycle in one vocabulary: ledger rows, folder states, outcomes, and how they map.

The ledger records a job's ``Row``; the dispatch root shows its ``State`` (a
folder); the daemon sees how a run ended as an ``Outcome``; a job asked to end
early carries a ``Stop``. Every conversion between them is a function here,
so that no module writes its own table.
"""

from __future__ import annotations

import enum


class Row(enum.StrEnum):
    """A ledger row's state. A row is never deleted, except a failed parent's reservations."""

    RESERVED = "reserved"  # a follow-up waiting for its parent to be done
    HELD = "held"  # a follow-up put in held/ (over budget); released by an operator
    RELEASED = "released"  # its file is in inbox/
    CLAIMED = "claimed"  # a daemon owns it: its folder is in active/ (or being built)
    WAITING = "waiting"  # claimed, no owner: its folder is in waiting/ until the jobs it names are final
    REVIEW = "review"  # passed its checks, waiting in review/ for a person
    DONE = "done"
    FAILED = "failed"


class State(enum.StrEnum):
    """Where a job is; each state is a folder of the dispatch root."""

    ACTIVE = "active"
    WAITING = "waiting"  # claimed, waiting for the jobs its order names in `after` (contract section 16)
    REVIEW = "review"
    DONE = "done"
    FAILED = "failed"


class Outcome(enum.StrEnum):
    """How a job's run ended, for the daemon."""

    DONE = "done"
    FAILED = "failed"
    REVIEW = "review"
    LEFT = "left"  # stopped: stays in active/ and is recovered at the next start
    FENCED = "fenced"  # its claim was taken over: nothing was changed
    SHORT = "short"  # its agent could not start for a shortage: queued again, its slot given back
    GATED = "gated"  # a gate holds its agent (section 14): set aside without slots until the gate lifts
    AGAIN = "again"  # another attempt is due, and its slot went to other work when its agent exited: queued again


class Stop(enum.StrEnum):
    """Why a job was asked to end early (the one channel that stops a job)."""

    CANCELLED = "cancelled"
    STOPPED = "stopped"


#: rows of jobs that have not ended (no folder outside active/ and waiting/)
OPEN = (Row.RESERVED, Row.HELD, Row.RELEASED, Row.CLAIMED, Row.WAITING)
#: rows of jobs that ended for good
FINISHED = (Row.DONE, Row.FAILED)
#: rows whose job folder left active/ (or is about to): finished, or waiting for a person
LANDED = (Row.REVIEW, Row.DONE, Row.FAILED)


def spoken(row: str) -> str:
    """Return a ledger state as an operator reads it (a released follow-up waiting in inbox/ is queued)."""
    return {"claimed": "active", "released": "queued", "reserved": "waiting for its parent"}.get(row, row)


def is_final(row: str) -> bool:
    """Return True for a job that ended for good (done or failed)."""
    return row in FINISHED


def is_landed(row: str) -> bool:
    """Return True for a row whose job belongs in review/, done/ or failed/."""
    return row in LANDED


def row_to_state(row: str) -> State | None:
    """Return the folder a job with this row lives in; None while it has no folder (queued, held)."""
    if row == Row.CLAIMED:
        return State.ACTIVE
    if row == Row.WAITING:
        return State.WAITING
    return State(row) if row in LANDED else None


_LANDED_STATE: dict[str, State] = {Row.REVIEW: State.REVIEW, Row.DONE: State.DONE, Row.FAILED: State.FAILED}
_OUTCOME: dict[str, Outcome] = {Row.REVIEW: Outcome.REVIEW, Row.DONE: Outcome.DONE, Row.FAILED: Outcome.FAILED}


def landed_state(row: str) -> State:
    """Return the folder a job lands in when its row is review, done or failed (ValueError otherwise)."""
    try:
        return _LANDED_STATE[row]  # a str equal to a Row finds it too
    except KeyError:
        raise ValueError(f"row {row} has no landed folder") from None


_NOTIFIED: dict[str, str] = {Row.FAILED: "job.failed", Row.REVIEW: "job.review"}


def notified_event(state: str) -> str | None:
    """Return the event ``notify`` is run for when a job lands in this row or folder (None: none is)."""
    return _NOTIFIED.get(state)  # Row and State values are the same strings


def state_to_row(state: State, result_state: str | None = None) -> Row:
    """Return the row a job folder in ``state`` stands for.

    ``result_state`` is the ``state`` its result.json records: a folder found
    in failed/ whose result says done was done (a crash between two renames).
    """
    if state in (State.ACTIVE, State.WAITING):  # waiting/ without a wait row: recorded again (``Joins.recover``)
        return Row.CLAIMED
    if state is State.FAILED and result_state == Row.DONE:
        return Row.DONE
    return Row(state.value)


def outcome_of(row: Row) -> Outcome:
    """Return the outcome of a run that ended with this row recorded (done, failed or review)."""
    try:
        return _OUTCOME[row]
    except KeyError:
        raise ValueError(f"row {row} has no landed folder") from None
