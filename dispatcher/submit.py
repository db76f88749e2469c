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
import os
import secrets
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from dispatcher import fsutil
from dispatcher.config import Config
from dispatcher.errors import OrderError, UsageError
from dispatcher.evidence import is_ignored
from dispatcher.fsutil import NotRegular, read_regular
from dispatcher.layout import Layout
from dispatcher.ledger import Ledger
from dispatcher.orders import Order, order_format, parse_order

LOCK_TIMEOUT_S = 30.0

Submission = tuple[str, Order, bytes]


def read_order(name: str, cfg: Config) -> Submission:
    """Read and validate one file; return (name as given, order, the bytes to drop)."""
    try:
        data = Path(name).read_bytes()
    except OSError as exc:
        raise OrderError(f"cannot read: {exc.strerror}", file=name) from None
    order = parse_order(data, name, agents=cfg.agents, max_timeout_s=cfg.max_timeout_s, max_bytes=cfg.max_order_bytes)
    return name, order, data


def submit(layout: Layout, orders: list[Submission], max_bytes: int) -> Iterator[str]:
    """Drop each order into inbox/, yielding its job id once it is there.

    Raises UsageError when one job id is given twice, OrderError when a job id is
    already known (ledger or inbox/) or a file cannot be written. Orders dropped
    before a failure stay dropped (their ids were yielded).
    """
    ids = [o.job_id for _, o, _ in orders]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise UsageError(f"job_id: {dup} is given twice")
    lock_path = layout.state_dir / "submit.lock"
    current = orders[0][0]
    try:
        layout.inbox.mkdir(parents=True, exist_ok=True)
        layout.state_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(lock_path, timeout=LOCK_TIMEOUT_S, thread_local=False, preserve_lock_file=True):
            _refuse_known(layout, orders, max_bytes)
            for name, order, data in orders:
                current = name
                _drop(layout, order.job_id, Path(name).suffix.lower(), data)
                yield order.job_id
    except Timeout:
        raise UsageError(f"{lock_path}: another submit held the lock for {LOCK_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise OrderError(f"cannot submit: {exc.strerror or exc}", file=current) from None


def _refuse_known(layout: Layout, orders: list[Submission], max_bytes: int) -> None:
    """Raise OrderError for the first order whose job id the ledger knows or an inbox/ order holds."""
    try:
        ledger = Ledger(layout.ledger)
        try:
            known = {o.job_id: e.state for _, o, _ in orders if (e := ledger.get(o.job_id)) is not None}
        finally:
            ledger.close()
    except sqlite3.Error as exc:
        raise OrderError(f"cannot submit: the ledger cannot be read ({exc})", file=orders[0][0]) from None
    queued = queued_among(layout, {o.job_id for _, o, _ in orders} - set(known), max_bytes)
    for name, order, _ in orders:
        state = known.get(order.job_id) or ("queued in inbox/" if order.job_id in queued else None)
        if state is not None:
            raise OrderError(
                f"{order.job_id} is already known ({state}); a job id is never run twice", file=name, field="job_id"
            )


def queued_among(layout: Layout, wanted: set[str], max_bytes: int) -> set[str]:
    """Return the ids among wanted that valid orders waiting in inbox/ hold.

    Files are read one at a time and parsed only when their bytes hold one of the
    ids literally or a backslash: a job id can hide only behind an escape. A file
    larger than ``max_bytes`` is skipped (the daemon refuses it, so it is no job).
    """
    found: set[str] = set()
    if not wanted:
        return found
    needles = [i.encode() for i in wanted]
    try:
        names = os.listdir(layout.inbox)
    except FileNotFoundError:
        return found
    for name in names:
        if is_ignored(name) or order_format(name) is None:
            continue
        try:
            data = read_regular(layout.inbox / name, max_bytes)
        except (OSError, NotRegular, ValueError):
            continue  # gone since the listing, not a regular file, or too large
        if b"\\" not in data and not any(n in data for n in needles):
            continue
        try:
            job_id = parse_order(data, name).job_id
        except OrderError:
            continue
        if job_id in wanted:
            found.add(job_id)
    return found


def _drop(layout: Layout, job_id: str, ext: str, data: bytes) -> None:
    """Write data under a unique hidden name in inbox/, then rename it to a free visible name.

    The temporary file never outlives a failure: it is removed before the error is raised.
    """
    tmp = layout.inbox / f".submit-{job_id}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fsutil.write_new(tmp, data, sync=True)
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
