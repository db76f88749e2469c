"""Decide when each file in inbox/ may be read: the settle rule of contract section 1.

Filesystem events (``core.fsevents``: inotify on the loop, or a watchdog observer)
are hints; the folder is the truth. A queue overflow, a scan at start and a periodic
rescan (or, with ``watch: poll``, a listing every ``poll_interval``) find whatever
events missed.

``Inbox`` decides when a name may be read:

- moved in (a rename) or closed after writing: ready now;
- created, or seen by a listing, with no close seen: ready once its size and
  mtime have not changed for ``settle`` seconds and no process holds it open
  for writing (that check walks /proc, so the daemon makes it off the loop).
"""

from __future__ import annotations

import collections
import heapq
import math
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dispatcher import fsutil
from dispatcher.layout import is_ignored
from dispatcher.spec.orders import Glance, deferred_until, peek_schedule

ORDER_SUFFIXES = (".yaml", ".yml", ".json")  # other names are refused, never claimed: they hold nothing back
PEEK_BYTES = 1 << 20  # an order's priority and not_before are read at a glance from at most this much
#: a listed file still settling holds back ready orders of lower priority until it is read, for at most its first
#: settle period and this much more (the open-writer check's answer comes in between)
HOLD_SLACK_S = 1.0


class Listed(NamedTuple):
    """One inbox entry as a listing saw it (a tuple: a backlog's listing makes one per file)."""

    name: str
    size: int
    mtime_ns: int
    regular: bool


def list_inbox(inbox: Path) -> list[Listed]:
    """List inbox/ with each entry's size and mtime, without following links (blocking: io pool)."""
    out = []
    is_reg = stat.S_ISREG
    try:
        with os.scandir(inbox) as it:
            for de in it:
                name = de.name
                if is_ignored(name):
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append(Listed(name, st.st_size, st.st_mtime_ns, is_reg(st.st_mode)))
    except FileNotFoundError:
        pass
    return out


class _Ready(NamedTuple):
    """A ready name in the heap: higher priority first, then older; its agent and expires at a glance."""

    neg_priority: int
    mtime_ns: int
    name: str
    agent: str = ""
    expires: float = float("inf")


@dataclass
class _Pending:
    size: int
    mtime_ns: int
    changed_at: float


class Inbox:
    """Which inbox names are waiting to settle, ready to read, or taken up by the daemon."""

    def __init__(
        self, inbox: Path, settle_s: float, *, wait_for_writers: bool = True, wake: Callable[[], None] | None = None
    ) -> None:
        self.inbox = inbox
        self._inbox_str = os.fspath(inbox)  # a name's path is joined as text: inbox/ is read per event
        self.wake = wake  # called after each hint: the loop takes a turn
        self.settle_s = settle_s
        self.wait_for_writers = wait_for_writers  # off for `run --once`: at most settle s after the last change
        self._pending: dict[str, _Pending] = {}
        self._ready: list[_Ready] = []
        self._ready_names: set[str] = set()
        self._later: list[tuple[float, int, int, str]] = []  # (due, -priority, mtime_ns, name): not_before
        self._later_names: set[str] = set()
        self._joins: collections.deque[str] = collections.deque()  # ready orders naming `after`
        self._known: set[str] = set()  # pending, ready, or being handled by the daemon
        self._taken: dict[str, _Ready] = {}  # names being handled -> their place when they were ready
        self._aside: dict[str, list[_Ready]] = {}  # agent -> its orders left unread while a gate holds it
        self._aside_names: set[str] = set()
        self._aside_best: dict[str, tuple[int, int, str]] = {}  # agent -> best (-priority, mtime_ns, name) set aside
        self._expiring: list[tuple[float, _Ready]] = []  # (expires, entry) of ready orders with expires
        self._aside_due: list[tuple[float, _Ready]] = []  # (expires, entry): read again then, to be refused
        self._unsure: set[str] = set()  # ready at a close event, with no look for other writers: see ``recheck``
        # (-priority at a glance, until, name) of files a listing found settling: ready orders of lower priority wait
        # for them while they are as many as the free slots, or as their agent's (``make_room``: the scheduler's turn)
        self._holds: list[tuple[int, float, str, str]] = []  # (..., the file's agent at a glance)
        self.spare = 1 << 30
        self._room_of: Callable[[str], int] | None = None
        self._gated: frozenset[str] = frozenset()  # agents gated at the scheduler's last turn: their orders wait anyway
        self._popped: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        """How many names wait to settle, are ready, set aside for a gate or being handled (not those due later)."""
        return len(self._known) - len(self._later_names)

    def tracked(self, names: Iterable[str]) -> list[str]:
        """Return those of names ``len(self)`` counts: waiting to settle, ready or being handled (not due later
        and not set aside for a gate, which callers count on their own)."""
        return [
            name
            for name in names
            if name in self._known and name not in self._later_names and name not in self._aside_names
        ]

    def hint(self, kind: str, name: str) -> None:
        """Take one filesystem event into account; wake the loop when a turn may act on it.

        Not for an ignored name (``.tmp``), nor one gone without settling (each claim removes its order)."""
        if kind == "gone":  # an ignored name is never pending: nothing to ask of it
            if name not in self._pending:
                return
            del self._pending[name]
            self._known.discard(name)
        elif not name or is_ignored(name):
            return
        elif kind in ("moved", "closed"):
            self._pending.pop(name, None)
            self._make_ready(name)
            if kind == "closed" and self.wait_for_writers and name in self._ready_names:
                self._unsure.add(name)
        elif kind == "created" and name not in self._known:
            try:
                st = os.lstat(f"{self._inbox_str}/{name}")
            except FileNotFoundError:
                return
            self.add(Listed(name, st.st_size, st.st_mtime_ns, stat.S_ISREG(st.st_mode)), fresh=True)
        else:
            return
        if self.wake is not None:
            self.wake()

    def add(self, entry: Listed, *, fresh: bool = False) -> None:
        """Track a listed entry: ready now if it is old enough or not a regular file, else pending."""
        self._track(entry, fresh, time.time_ns(), time.monotonic(), None)

    def merge(self, listing: Iterable[Listed]) -> None:
        """Track every listed entry not known yet (a scan, a rescan, a poll).

        A backlog of thousands is read here at start, each order at a glance for its
        priority: one clock reading and one descriptor of inbox/ serve them all.
        """
        now_ns, now_mono = time.time_ns(), time.monotonic()
        try:
            dir_fd: int | None = os.open(self.inbox, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            dir_fd = None  # inbox/ is gone or unreadable: each name is looked at by its path
        try:
            # oldest first, then by name (section 1): joins keep this order in their own queue
            for entry in sorted(listing, key=_by_age):
                self._track(entry, False, now_ns, now_mono, dir_fd)
        finally:
            if dir_fd is not None:
                os.close(dir_fd)

    def _track(self, entry: Listed, fresh: bool, now_ns: int, now_mono: float, dir_fd: int | None) -> None:
        name = entry.name
        if name in self._known:
            return
        self._known.add(name)
        if not entry.regular or (not fresh and now_ns - entry.mtime_ns >= self.settle_s * 1e9):
            if entry.regular and self.wait_for_writers:  # settled by its age, but a writer may hold it open still
                self._pending[name] = _Pending(entry.size, entry.mtime_ns, -math.inf)  # the next turn's check
                return
            self._push(name, entry.mtime_ns, dir_fd)  # links, FIFOs, folders: refused at once, never opened
            return
        self._pending[name] = _Pending(entry.size, entry.mtime_ns, now_mono)
        if not fresh and name.endswith(ORDER_SUFFIXES):  # found by a listing (at start, a rescan): its priority
            until = now_mono + self.settle_s + HOLD_SLACK_S
            glance = self._peek(name, dir_fd)
            heapq.heappush(self._holds, (-glance.priority, until, name, glance.agent or ""))

    def unsure(self, batch: Iterable[object]) -> frozenset[str]:
        """Return the names of batch made ready by a close event alone: refused only after ``recheck``."""
        if not self._unsure:
            return frozenset()
        return frozenset(n for n in batch if isinstance(n, str) and n in self._unsure)

    def recheck(self, name: str) -> None:
        """Look for other writers before an order read at a close event is refused.

        The close event says that one writer closed the file; another may still write it
        (a second process opened and closed it meanwhile). So an order that does not
        validate then goes back to wait as a file being written, and the open-writer check
        runs at once: a file no process holds open is read again and refused; one held open
        waits until its writer closes it (section 1). A valid order never pays for the look.
        """
        self._unsure.discard(name)
        self._taken.pop(name, None)
        self._ready_names.discard(name)
        try:
            st = os.lstat(f"{self._inbox_str}/{name}")
        except FileNotFoundError:
            self.forget(name)
            return
        self._known.add(name)
        self._pending[name] = _Pending(st.st_size, st.st_mtime_ns, -math.inf)  # checked at the next turn
        if self.wake is not None:
            self.wake()

    def _make_ready(self, name: str) -> None:
        self._unsure.discard(name)
        self._aside_names.discard(name)  # a new event on an order set aside: it is read again
        self._taken.pop(name, None)
        if name in self._ready_names or name in self._later_names:
            return
        try:
            st = os.lstat(f"{self._inbox_str}/{name}")
        except FileNotFoundError:
            self._known.discard(name)
            return
        self._known.add(name)
        self._push(name, st.st_mtime_ns)

    def _push(self, name: str, mtime_ns: int, dir_fd: int | None = None) -> None:
        glance = self._peek(name, dir_fd)
        if (until := deferred_until(glance.not_before, glance.expires, time.time())) is not None:
            self.defer(name, until, glance.priority, mtime_ns)
            return
        self._ready_names.add(name)
        if glance.joins:
            self._joins.append(name)
        else:
            expires = float("inf") if glance.expires is None else glance.expires
            entry = _Ready(-glance.priority, mtime_ns, name, glance.agent, expires)
            heapq.heappush(self._ready, entry)
            if glance.expires is not None:
                heapq.heappush(self._expiring, (expires, entry))

    def _peek(self, name: str, dir_fd: int | None = None) -> Glance:
        """Read an order's priority, not_before and `after` at a glance (a small bounded read; no link followed)."""
        try:
            if dir_fd is None:
                data = fsutil.read_regular(f"{self._inbox_str}/{name}", PEEK_BYTES)
            else:
                data = fsutil.read_regular(name, PEEK_BYTES, dir_fd=dir_fd)
        except (OSError, ValueError, MemoryError, fsutil.NotRegular):
            return Glance()  # unreadable here: the daemon reads it as usual (and refuses it, or waits out a shortage)
        return peek_schedule(data, name)

    def pop_join(self) -> str | None:
        """Return a ready order that names `after` (claimed at once, whatever slots are free), or None."""
        while self._joins:
            name = self._joins.popleft()
            if name in self._ready_names:
                self._ready_names.discard(name)
                return name
        return None

    def defer(self, name: str, due: float, priority: int = 5, mtime_ns: int = 0) -> None:
        """Keep an order unclaimed in inbox/ until its not_before time (``due``, epoch seconds)."""
        self._ready_names.discard(name)
        self._known.add(name)
        self._later_names.add(name)
        heapq.heappush(self._later, (due, -priority, mtime_ns, name))

    def _promote_due(self) -> None:
        if not self._later and not self._aside_due:  # nothing held back (most turns): no clock reading
            return
        now = time.time()
        while self._later and self._later[0][0] <= now:
            _due, _neg, mtime_ns, name = heapq.heappop(self._later)
            if name in self._later_names:
                self._later_names.discard(name)
                self._push(name, mtime_ns)  # due now: a join goes to its own queue
        while self._aside_due and self._aside_due[0][0] <= now:
            entry = heapq.heappop(self._aside_due)[1]
            if entry.name in self._aside_names:  # expired while its agent was gated: read, and refused
                self._aside_names.discard(entry.name)
                self._ready_names.add(entry.name)
                heapq.heappush(self._ready, entry._replace(agent=""))
                heapq.heappush(self._expiring, (entry.expires, entry._replace(agent="")))  # slot or not

    def deferred(self) -> list[str]:
        """Return the names held back unread until their not_before."""
        return sorted(self._later_names)

    def next_due_s(self) -> float | None:
        """Return seconds until the next order held back by not_before is due, or one set aside expires (or None)."""
        while self._later and self._later[0][3] not in self._later_names:
            heapq.heappop(self._later)
        while self._aside_due and self._aside_due[0][1].name not in self._aside_names:
            heapq.heappop(self._aside_due)
        due = min([h[0][0] for h in (self._later, self._aside_due) if h], default=None)
        return None if due is None else max(0.0, due - time.time())

    def promote_settled(self) -> tuple[list[str], float | None]:
        """Move settled names to ready; return (names that need the open-writer check, seconds to next check)."""
        if not self._pending:
            return [], None
        now = time.monotonic()
        wait: float | None = None
        check = []
        for name, p in list(self._pending.items()):
            try:
                st = os.lstat(f"{self._inbox_str}/{name}")
            except FileNotFoundError:
                del self._pending[name]
                self._known.discard(name)
                continue
            if (st.st_size, st.st_mtime_ns) != (p.size, p.mtime_ns):
                p.size, p.mtime_ns, p.changed_at = st.st_size, st.st_mtime_ns, now
            left = p.changed_at + self.settle_s - now
            if left <= 0:
                if self.wait_for_writers:
                    check.append(name)
                    p.changed_at = float("inf")  # until the check answers
                else:
                    del self._pending[name]
                    self._make_ready(name)
                continue
            left = max(left, 0.05)
            wait = left if wait is None else min(wait, left)
        if self._holds:  # a hold that ends before its file settles: the orders it held back go on then
            ends = [until - now for _, until, name, _a in self._holds if until > now and name in self._pending]
            if ends:
                wait = min(ends) if wait is None else min(wait, min(ends))
        return check, wait

    def make_room(self, free: int, room_of: Callable[[str], int], gated: frozenset[str]) -> None:
        """Take the scheduler's turn: ``free`` slots, ``room_of(agent)`` (the slots of an agent free here), and the
        agents whose orders are left unread (gated): these neither take a slot nor hold one back."""
        self.spare = free
        self._room_of = room_of
        self._gated = gated
        self._popped.clear()

    def _held_back(self, entry: _Ready) -> bool:
        """Return True if files found settling that rank higher need the slots entry would take.

        That is when they are as many as the free slots or more, or those of entry's agent
        (at a glance) as many as its free slots or more. A ready order then waits for them
        (contract section 16: higher priority first); with slots to spare for both it goes
        at once, as it always did.
        """
        now = time.monotonic()
        while self._holds and not (self._holds[0][1] > now and self._holds[0][2] in self._pending):
            heapq.heappop(self._holds)  # ended, read or gone: the best ones are looked at first
        if not self._holds or self._holds[0][0] >= entry.neg_priority:
            return False
        higher = {
            (name, agent)
            for rank, until, name, agent in self._holds
            if rank < entry.neg_priority and until > now and name in self._pending and agent not in self._gated
        }
        if len(higher) >= self.spare:
            return True
        mine = sum(1 for _name, agent in higher if agent == entry.agent)
        if not mine or self._room_of is None:
            return False
        return mine >= self._room_of(entry.agent) - self._popped[entry.agent]

    def writers_checked(self, names: list[str], held: set[str]) -> None:
        """Take the open-writer check's answer: held names wait another settle period."""
        now = time.monotonic()
        for name in names:
            p = self._pending.get(name)
            if p is None:
                continue
            if os.path.abspath(self.inbox / name) in held:
                p.changed_at = now
            else:
                del self._pending[name]
                self._make_ready(name)

    def has_ready(self) -> bool:
        """Return True if a file is ready to be read (and not held back for a settling file of higher priority)."""
        self._promote_due()
        if self._joins:
            return True
        if not self._ready:
            return False
        if not self._holds:
            return True
        while self._ready and self._ready[0].name not in self._ready_names:
            heapq.heappop(self._ready)  # taken or forgotten meanwhile
        if not self._ready:
            return False
        top = self._ready[0]  # a gated agent's order: the scheduler sets it aside and reads on, so it is ready
        return top.agent in self._gated or not self._held_back(top)

    def has_pending(self) -> bool:
        """Return True while some file waits to settle (it may still become an order)."""
        return bool(self._pending)

    def pop(self, gated: frozenset[str] = frozenset()) -> str | None:
        """Return the ready name of highest priority, then oldest (by mtime, then name), or None.

        A name whose order names a ``gated`` agent at a glance is set aside on the way, unread.
        """
        entry = self._head(gated)
        if entry is None:
            return None
        heapq.heappop(self._ready)
        self._ready_names.discard(entry.name)
        self._taken[entry.name] = entry
        self.spare -= 1
        self._popped[entry.agent] += 1
        return entry.name

    def pop_expired(self, at: float) -> list[str]:
        """Take the ready names whose order expired by ``at`` (at a glance), slot or not: each is refused then.

        Orders set aside for a gated agent whose ``expires`` came are among them (``_promote_due``).
        """
        self._promote_due()
        out = []
        while self._expiring and self._expiring[0][0] <= at:
            _, entry = heapq.heappop(self._expiring)
            if entry.name in self._ready_names:
                self._ready_names.discard(entry.name)  # its place in the ready heap is skipped from now on
                self._taken[entry.name] = entry
                out.append(entry.name)
        return out

    def next_expiry(self) -> float | None:
        """Return when the next ready order expires (at a glance), or None."""
        while self._expiring and self._expiring[0][1].name not in self._ready_names:
            heapq.heappop(self._expiring)  # taken, forgotten or set aside meanwhile
        return self._expiring[0][0] if self._expiring else None

    def next_agent(self, gated: frozenset[str] = frozenset()) -> tuple[str, bool] | None:
        """Return the agent (at a glance) of the order ``pop`` would return next, and whether it has ``expires``.

        Nothing is taken; gated agents' orders are set aside on the way, as ``pop`` does.
        """
        entry = self._head(gated)
        return None if entry is None else (entry.agent, entry.expires != float("inf"))

    def head_rank(self, gated: frozenset[str] = frozenset()) -> tuple[int, float, str] | None:
        """Return (-priority, mtime in epoch seconds, name) of the order ``pop`` would return next (as
        ``parked_rank``)."""
        entry = self._head(gated)
        return None if entry is None else (entry.neg_priority, entry.mtime_ns / 1e9, entry.name)

    def _head(self, gated: frozenset[str]) -> _Ready | None:
        """Return the entry ``pop`` takes next, left in place; names taken or forgotten are dropped and
        gated agents' orders set aside on the way."""
        self._promote_due()
        while self._ready:
            entry = self._ready[0]
            if entry.name in self._ready_names and entry.agent not in gated:
                if self._holds and self._held_back(entry):
                    return None  # files found settling rank higher and need the free slots: they are read first
                return entry
            heapq.heappop(self._ready)
            if entry.name in self._ready_names:  # a gated agent's: unread in inbox/ until taken back
                self._ready_names.discard(entry.name)
                self._put_aside(entry, entry.agent)
        return None

    def set_aside(self, name: str, agent: str, expires: float | None = None) -> None:
        """Leave an order of a gated agent unread in inbox/ (its name kept) until ``take_back`` or its expires.

        Orders set aside are never ready, so the daemon reads past them to other agents' orders.
        """
        if name not in self._known or name in self._aside_names:
            return
        self._ready_names.discard(name)
        entry = self._taken.pop(name, _Ready(0, 0, name))  # 0: an order naming `after`, looked at again
        self._put_aside(entry._replace(expires=float("inf") if expires is None else expires), agent)

    def _put_aside(self, entry: _Ready, agent: str) -> None:
        self._aside_names.add(entry.name)
        self._aside.setdefault(agent, []).append(entry)
        if entry.mtime_ns:  # (0: an order naming `after`, ranked when looked at again)
            rank = (entry.neg_priority, entry.mtime_ns, entry.name)
            best = self._aside_best.get(agent)
            if best is None or rank < best:
                self._aside_best[agent] = rank
        if entry.expires != float("inf"):
            heapq.heappush(self._aside_due, (entry.expires, entry))

    def aside_rank(self, agent: str) -> tuple[int, float, str] | None:
        """Return the best (-priority, mtime in epoch seconds, name) of the orders set aside, unread, for ``agent``.

        Kept as orders are set aside, so it may name one since cancelled or held: the caller then takes the
        agent's orders back once for nothing, which clears it.
        """
        best = self._aside_best.get(agent)
        return None if best is None else (best[0], best[1] / 1e9, best[2])

    def aside_for(self, agents: set[str]) -> int:
        """Return how many orders are set aside, unread, for these agents."""
        return len({e.name for agent in agents for e in self._aside.get(agent, ()) if e.name in self._aside_names})

    def take_back(self, gated: frozenset[str]) -> None:
        """Make the orders set aside for agents no longer in ``gated`` ready again, in their first order."""
        for agent in [a for a in self._aside if a not in gated]:
            self._aside_best.pop(agent, None)
            for entry in self._aside.pop(agent):
                name = entry.name
                if name not in self._aside_names:
                    continue  # forgotten (cancelled, held) or made ready by an event since
                self._aside_names.discard(name)
                if entry.mtime_ns == 0:
                    self._make_ready(name)
                else:
                    self._ready_names.add(name)
                    heapq.heappush(self._ready, entry)
                    if entry.expires != float("inf"):  # refused at its expires, slot or not, as before it was set aside
                        heapq.heappush(self._expiring, (entry.expires, entry))

    def any_aside(self) -> bool:
        """Return True if orders of some agent were left unread for a gate (``take_back`` has work)."""
        return bool(self._aside)

    def aside(self) -> int:
        """Return how many orders are left unread while a gate holds their agents."""
        return len(self._aside_names)

    def push_back(self, name: str) -> None:
        """Make a name ready again (a file left in place to be tried later)."""
        self._known.add(name)
        self._make_ready(name)

    def forget(self, name: str) -> None:
        """Forget a name the daemon has finished with (claimed, refused or gone)."""
        self._known.discard(name)
        self._pending.pop(name, None)
        self._ready_names.discard(name)
        self._later_names.discard(name)
        self._aside_names.discard(name)
        self._taken.pop(name, None)
        self._unsure.discard(name)


def _by_age(entry: Listed) -> tuple[int, str]:
    return entry.mtime_ns, entry.name
