"""`dispatcher submit`: validate orders, refuse known job ids, drop them into inbox/ atomically.

Two submits of one file at once must give one job and one clear refusal, so the
check ("is this id known to the ledger or queued in inbox/?") and the drop happen
under one exclusive flock, ``<root>/.state/submit.lock``. A drop writes a hidden
temporary file with a name no other process can pick and renames it to a name
that replaces nothing; the temporary file is removed on every failure, and an
OSError (a full disk, a read-only folder) is one line naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from dispatcher import fsutil
from dispatcher.clock import iso
from dispatcher.errors import OrderError, UsageError
from dispatcher.layout import Layout
from dispatcher.ledger.base import Ledger, LedgerUnavailable
from dispatcher.ledger.cycles import find_cycle
from dispatcher.ledger.records import Request
from dispatcher.ops.sharing import hand_over
from dispatcher.spec.order import Order
from dispatcher.spec.orders import (
    LATEST_S,
    LATEST_TIME,
    TimeOutOfRange,
    parse_order,
    parse_time,
    time_text_ok,
    to_json,
)
from dispatcher.spec.settings import Config
from dispatcher.store.ledgers import LedgerUnreachable, open_ledger
from dispatcher.store.queued import queued_afters, queued_ids

LOCK_TIMEOUT_S = 30.0

Submission = tuple[str, Order, bytes, str]  # name as given, order, the bytes to drop, their suffix
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def read_order(name: str, cfg: Config, *, not_before: float | None = None) -> Submission:
    """Read and validate one file; return (name as given, order, the bytes to drop, their suffix).

    With ``not_before`` (``submit --at`` / ``--in``) the order is dropped as JSON
    with that ``not_before`` set (any earlier one replaced).
    """
    try:
        data = fsutil.read_given(name)
    except OSError as exc:
        raise OrderError(f"cannot read: {exc.strerror}", file=name) from None
    except fsutil.NotRegular as exc:
        raise OrderError(f"a {exc.kind} is not a work order", file=name) from None
    order = _parse(data, name, cfg)
    if not_before is None:
        _refuse_expired(order, name)
        return name, order, data, Path(name).suffix.lower()
    data = to_json(dict(order.body) | {"not_before": iso(not_before)})
    try:
        order = _parse(data, "order.json", cfg)
    except OrderError as exc:
        raise OrderError(exc.message, file=name, field=exc.field) from None
    _refuse_expired(order, name)
    return name, order, data, ".json"


def _refuse_expired(order: Order, name: str) -> None:
    """Raise OrderError for an order the daemon is sure to refuse as expired: its ``expires`` has passed, or comes
    no later than its ``not_before`` (it could never start). `validate` checks the file alone, not the clock."""
    if order.expires is None:
        return
    if order.expires <= time.time():
        raise OrderError(f"{iso(order.expires)} has passed: the daemon would refuse it as expired", file=name,
                         field="expires")  # fmt: skip
    if order.not_before is not None and order.expires <= order.not_before:
        raise OrderError(f"{iso(order.expires)} is not after not_before ({iso(order.not_before)}): it could never"
                         " start", file=name, field="expires")  # fmt: skip


def _parse(data: bytes, name: str, cfg: Config) -> Order:
    return parse_order(data, name, agents=cfg.agents, max_timeout_s=cfg.max_timeout_s, max_bytes=cfg.max_order_bytes)


def parse_when(at: str | None, within: str | None, now: float) -> float | None:
    """Return the epoch time of ``--at TIME`` (ISO 8601) or ``--in DURATION`` (90s, 15m, 2h, 1d); UsageError if bad."""
    if at is not None and within is not None:
        raise UsageError("submit: give --at or --in, not both")
    if at is not None:
        try:
            if not time_text_ok(at):  # the forms an order's not_before takes, no other (week dates are not)
                raise ValueError(at)
            return parse_time(at)
        except TimeOutOfRange as exc:
            raise UsageError(f"submit: --at: {at!r} {exc}") from None
        except ValueError:
            raise UsageError(f"submit: --at: {at!r} is not an ISO 8601 time such as 2026-12-01T08:00:00Z") from None
    if within is not None:
        text = within.strip()
        unit = _UNITS.get(text[-1:].lower())
        try:
            amount = float(text[:-1] if unit else text)
        except ValueError:
            amount = -1.0
        if amount < 0 or amount != amount or amount == float("inf"):
            raise UsageError(f"submit: --in: {within!r} is not a duration such as 90s, 15m, 2h or 1d")
        when = now + amount * (unit or 1)
        if when > LATEST_S:
            raise UsageError(f"submit: --in: {within!r} from now is later than {LATEST_TIME}")
        return when
    return None


def submit(cfg: Config, orders: list[Submission]) -> Iterator[str]:
    """Drop each order into inbox/, yielding its job id once it is there.

    Raises OrderError when one job id is given twice (nothing is dropped then), or when a job id is
    already known (ledger or inbox/) or a file cannot be written. Orders dropped
    before a failure stay dropped (their ids were yielded).
    """
    layout = Layout(cfg.root)
    ids = [o.job_id for _, o, _, _ in orders]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        first, second = [name for name, o, _, _ in orders if o.job_id == dup][:2]
        raise OrderError(f"{dup} is given twice (also in {first})", file=second, field="job_id")
    lock_path = layout.state_dir / "submit.lock"
    current = orders[0][0]
    try:
        fsutil.make_dirs(layout.inbox, layout.state_dir)  # durable: the drop's fsync of inbox/ needs its name kept
        _hand_over_state(layout)  # inbox/ first: a dropped file takes inbox/'s owner
        with FileLock(lock_path, timeout=LOCK_TIMEOUT_S, thread_local=False, preserve_lock_file=True):
            _refuse_known(cfg, layout, orders)
            for name, order, data, ext in orders:
                current = name
                _drop(layout, order.job_id, ext, data)
                yield order.job_id
    except Timeout:
        raise UsageError(f"{lock_path}: another submit held the lock for {LOCK_TIMEOUT_S:g} s") from None
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno in (errno.EACCES, errno.EPERM) and exc.filename:  # which of the root's files is not the user's
            why = f"{exc.filename}: {why}"
        raise OrderError(f"cannot submit: {why}", file=current) from None
    finally:
        _hand_over_state(layout)


def _hand_over_state(layout: Layout) -> None:
    """Leave what this submit created (inbox/, .state/, its lock, a new ledger) usable by the daemon and others."""
    ledger = layout.ledger
    made = [layout.state_dir / "submit.lock", ledger, *(ledger.with_name(ledger.name + s) for s in ("-wal", "-shm"))]
    hand_over(layout, made, folders=[layout.inbox, layout.state_dir])


def _refuse_known(cfg: Config, layout: Layout, orders: list[Submission]) -> None:
    """Raise OrderError for the first order whose job id the ledger knows or an order in inbox/ or held/ holds.

    A cancel still open for a new id is dropped: its order is gone (removed by hand, or
    refused), and the request must not fail the unrelated order submitted now.
    """
    try:
        ledger = open_ledger(cfg, layout, patience_s=LOCK_TIMEOUT_S)
    except (LedgerUnreachable, LedgerUnavailable) as exc:
        raise OrderError(f"cannot submit: {exc}", file=orders[0][0]) from None
    try:
        known = {o.job_id: e.state for _, o, _, _ in orders if (e := ledger.get(o.job_id)) is not None}
        _refuse_queued(layout, orders, known)
        _refuse_cycles(layout, ledger, orders)
        for job_id in set(ledger.requests(Request.CANCEL)) & {o.job_id for _, o, _, _ in orders}:
            ledger.clear_request(job_id, Request.CANCEL)
    except LedgerUnavailable as exc:
        raise OrderError(f"cannot submit: {exc}", file=orders[0][0]) from None
    finally:
        ledger.close()


def _refuse_queued(layout: Layout, orders: list[Submission], known: dict[str, str]) -> None:
    """Raise OrderError for the first order whose id ``known`` (the ledger), a job folder, inbox/ or held/ holds."""
    for _, order, _, _ in orders:
        found = layout.find(order.job_id)  # a job folder the ledger lost still makes the id known
        if order.job_id not in known and found is not None:
            known[order.job_id] = found[0].value
    rest = {o.job_id for _, o, _, _ in orders} - set(known)
    queued = queued_ids(layout.inbox, rest)
    held = queued_ids(layout.held, rest - queued)  # a held order is a submitted one that an operator paused
    for name, order, _, _ in orders:
        recorded = known.get(order.job_id)  # worded as a refusal from inbox/ words it: the same text
        state = f"state {recorded}" if recorded else (
            "queued in inbox/" if order.job_id in queued else "held in held/" if order.job_id in held else None
        )  # fmt: skip
        if state is not None:
            raise OrderError(
                f"{order.job_id} is already known ({state}); a job id is never run twice", file=name, field="job_id"
            )


def _refuse_cycles(layout: Layout, ledger: Ledger, orders: list[Submission]) -> None:
    """Raise OrderError for the first order whose ``after`` would close a cycle, as its claim would refuse it.

    Through the jobs that wait in the ledger, the other orders of this submit, and the orders
    queued in inbox/ or held/ that name ``after`` (each waits from its claim on; read in one pass).
    """
    pending: dict[str, Sequence[str]] = {o.job_id: o.after for _, o, _, _ in orders if o.after}
    if not pending:
        return
    pending = {**queued_afters((layout.inbox, layout.held)), **pending}
    for name, order, _, _ in orders:
        if order.after:
            others = {job_id: after for job_id, after in pending.items() if job_id != order.job_id}
            cycle = find_cycle(ledger, order.job_id, order.after, others)
            if cycle is not None:
                raise OrderError(f"would make a cycle ({' -> '.join(cycle)})", file=name, field="after")


def _drop(layout: Layout, job_id: str, ext: str, data: bytes) -> None:
    """Write data under a unique hidden name in inbox/, then rename it to a free visible name.

    The temporary file never outlives a failure: it is removed before the error is raised.
    """
    tmp = layout.inbox / f".submit-{job_id}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fsutil.write_new(tmp, data, sync=True)
        _hand_over(tmp, layout.inbox)
        n = 1
        while True:
            final = layout.inbox / (f"{job_id}{ext}" if n == 1 else f"{job_id}-{n}{ext}")
            try:
                fsutil.rename_noreplace(tmp, final)
                break
            except FileExistsError:
                n += 1  # never replace a file: take the next free name
        fsutil.fsync_dir(layout.inbox)
    finally:
        with contextlib.suppress(OSError):  # FileNotFoundError once renamed; nothing better to do otherwise
            tmp.unlink()


def _hand_over(path: Path, inbox: Path) -> None:
    """Give the file inbox/'s owner and group (root), or its group (a member), so the daemon can read it.

    Raise OSError (one line for the caller) when neither is possible: a file the daemon
    cannot read would only be refused later.
    """
    st = os.stat(inbox)
    mine = os.lstat(path)
    if os.geteuid() == 0:
        os.chown(path, st.st_uid, st.st_gid)
    elif mine.st_uid != st.st_uid and mine.st_gid != st.st_gid:
        try:
            os.chown(path, -1, st.st_gid)
        except PermissionError:
            raise PermissionError(
                errno.EPERM,
                f"inbox/ belongs to group {_group(st.st_gid)}, which you are not in: the daemon could not read it",
            ) from None
    os.chmod(path, 0o640)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
