"""Find which job ids wait in inbox/ as orders not read yet, without loading the backlog.

Used by `submit` (a queued id is known), by `cancel` (find the file of a queued
job) and by the follow-up check (a follow-up may not take the id of a queued
order). Files are read one at a time; a file whose bytes hold neither the
wanted id nor a backslash (an id can hide only behind an escape) is skipped
unparsed, and what was parsed is remembered by (inode, size, mtime).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from dispatcher import fsutil
from dispatcher.errors import OrderError
from dispatcher.layout import is_ignored
from dispatcher.spec.orders import order_format, parse_order

_MAX_BYTES = 1 << 24
_CACHE_MAX = 200_000
_cache: dict[tuple[int, int, int], str | None] = {}
_lock = threading.Lock()


def _job_id(path: Path, key: tuple[int, int, int], data: bytes) -> str | None:
    with _lock:
        if key in _cache:
            return _cache[key]
    try:
        job_id: str | None = parse_order(data, path.name).job_id
    except (OrderError, RecursionError, ValueError):
        job_id = None
    with _lock:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = job_id
    return job_id


def _orders_in(
    folder: Path, needles: list[bytes] | None = None
) -> Iterator[tuple[os.DirEntry[str], os.stat_result, str | None]]:
    """Yield each order file of folder with its stat and the job id it carries (None: not a valid order).

    With ``needles``, a file not parsed before whose bytes hold none of them (nor a backslash,
    behind which an id can hide) is skipped unread into a job id. What was parsed is remembered
    by (inode, size, mtime).
    """
    for de, st, key in _order_files(folder):
        try:
            with _lock:
                job_id = _cache.get(key, "")
            if job_id == "":
                data = fsutil.read_regular(Path(de.path), _MAX_BYTES)
                if needles is not None and b"\\" not in data and not any(n in data for n in needles):
                    continue
                job_id = _job_id(Path(de.path), key, data)
        except (OSError, ValueError, fsutil.NotRegular):
            continue
        yield de, st, job_id


def _order_files(folder: Path) -> Iterator[tuple[os.DirEntry[str], os.stat_result, tuple[int, int, int]]]:
    """Yield each entry of folder named as an order (not a hidden or temp name), its lstat and its cache key."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for de in entries:
        if is_ignored(de.name) or order_format(de.name) is None:
            continue
        try:
            st = de.stat(follow_symlinks=False)
        except OSError:
            continue
        yield de, st, (st.st_ino, st.st_size, st.st_mtime_ns)


def find_queued(inbox: Path, job_ids: Iterable[str]) -> dict[str, str]:
    """Return {job_id: file name} for the wanted ids that a valid order in inbox/ carries."""
    wanted = set(job_ids)
    found: dict[str, str] = {}
    if not wanted:
        return found
    for de, _, job_id in _orders_in(inbox, [j.encode() for j in wanted]):
        if job_id in wanted and job_id not in found:
            found[job_id] = de.name
            if len(found) == len(wanted):
                break
    return found


def ids_of(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """Return {file name: job id} for those of the names that are valid orders in folder (each parsed once)."""
    found: dict[str, str] = {}
    for name in names:
        path = folder / name
        try:
            st = os.lstat(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            with _lock:
                job_id = _cache.get(key, "")
            if job_id == "":
                job_id = _job_id(path, key, fsutil.read_regular(path, _MAX_BYTES))
        except (OSError, ValueError, fsutil.NotRegular):
            continue
        if job_id is not None:
            found[name] = job_id
    return found


_afters: dict[tuple[int, int, int], tuple[str | None, tuple[str, ...]]] = {}


def queued_afters(folders: Iterable[Path]) -> dict[str, tuple[str, ...]]:
    """Return {job_id: its ``after``} for every valid order naming ``after`` in folders (inbox/, held/).

    The orders not read yet wait for their parents from their claim on: a new ``after`` through
    them may close a cycle (``submit``). One pass over each folder; a file whose bytes hold
    neither ``after`` nor a backslash is skipped unparsed, and what was parsed is remembered
    by (inode, size, mtime).
    """
    found: dict[str, tuple[str, ...]] = {}
    for folder in folders:
        for de, _, key in _order_files(folder):
            with _lock:
                known = _afters.get(key)
            if known is None:
                try:
                    data = fsutil.read_regular(Path(de.path), _MAX_BYTES)
                except (OSError, ValueError, fsutil.NotRegular):
                    continue
                if b"after" not in data and b"\\" not in data:
                    continue
                try:
                    order = parse_order(data, de.name)
                    known = (order.job_id, tuple(order.after))
                except (OrderError, RecursionError, ValueError):
                    known = (None, ())
                with _lock:
                    if len(_afters) >= _CACHE_MAX:
                        _afters.clear()
                    _afters[key] = known
            job_id, after = known
            if job_id is not None and after and job_id not in found:
                found[job_id] = after
    return found


_held: tuple[tuple[int, int], dict[str, frozenset[tuple[int, int]]]] | None = None  # held/'s (inode, mtime), ids


def held_ids(held: Path) -> dict[str, frozenset[tuple[int, int]]]:
    """Return the job ids that valid orders in held/ carry, each with its files' (st_dev, st_ino).

    A held order is a submitted one an operator paused: its id is known, so that a copy
    dropped into inbox/ meanwhile is refused rather than run in its place (the very file
    under both names is a hold or release cut short, not a copy). Read again only once
    held/ changed: one stat while it is unchanged.
    """
    global _held
    try:
        st = os.stat(held)
    except FileNotFoundError:
        return {}
    key = (st.st_ino, st.st_mtime_ns)
    cached = _held
    if cached is not None and cached[0] == key:
        return cached[1]
    ids: dict[str, set[tuple[int, int]]] = {}
    for _, est, job_id in _orders_in(held):
        if job_id is not None:
            ids.setdefault(job_id, set()).add((est.st_dev, est.st_ino))
    found = {job_id: frozenset(inodes) for job_id, inodes in ids.items()}
    _held = (key, found)
    return found


def queued_ids(inbox: Path, job_ids: Iterable[str]) -> set[str]:
    """Return those of job_ids that a valid order waiting in inbox/ carries."""
    return set(find_queued(inbox, job_ids))
