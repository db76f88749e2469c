"""A daemon's lease on a shared ledger (contract section 12): renew, reap, fence itself.

Only engines with leases (PostgreSQL) need this; on SQLite a daemon's liveness is
its flock and none of it runs. A dedicated thread renews the lease every lease/6
(one try each, on its own connection: never behind the ledger lane's queue) and
reaps daemons whose lease ran out every lease/3. The loop reads ``fenced``: a
daemon that has not renewed for lease/2 ends its agents' groups and claims
nothing until it renews again, so that by the time another daemon may take its
jobs over (a full lease), nothing of it runs any more. An idle loop may sleep for
a whole rescan interval, so it is woken for this: at the moment the lease would
turn fenced (``next_check_s``, a deadline of the loop's own, which holds while a
renewal hangs on the network), and by this thread when a renewal changes what the
loop reads (fenced again, renewed, declared lost: ``on_change``).

A renewal counts from the moment it was sent, so one sent just before an outage and
answered when the network came back may leave the lease good for a few milliseconds
only. Such a renewal does not end a fence (an agent started then would be ended again at
once, and fail as interrupted if it is not retry-safe): ``fenced`` holds until a renewal
leaves the lease good for a renewal period at least, and the thread renews again at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from dispatcher.ledger.base import Leases

log = structlog.get_logger("dispatcher")
_JOIN_S = 2.0


class LeaseKeeper:
    """The thread that renews this daemon's lease and reaps dead daemons."""

    def __init__(
        self,
        leases: Leases,
        lease_s: float,
        on_lost: Callable[[list[str]], None],
        on_change: Callable[[], object] | None = None,
    ) -> None:
        self.leases = leases
        self.lease_s = lease_s
        self.on_lost = on_lost  # called (from this thread) with owners newly found dead
        self.on_change = on_change  # called (from this thread) when fenced or lost changed
        self.renew_every = lease_s / 6
        self._fenced = False  # what ``fenced`` last said: once True, a renewal must leave renew_every to end it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def fenced(self) -> bool:
        """Return True while this daemon must not run agents or claim.

        Fenced once no renewal succeeded for lease/2; no longer fenced once a renewal leaves
        the lease good for ``renew_every`` at least (not one that is about to run out again).
        """
        left = self.leases.ok_for_s()
        if left is None:
            self._fenced = True
        elif self._fenced and left >= self.renew_every:
            self._fenced = False
        return self._fenced

    @property
    def lost(self) -> bool:
        """Return True once another daemon declared this one dead: it must stop for good."""
        return self.leases.lost

    def next_check_s(self) -> float | None:
        """Return when the loop must look at ``fenced`` again at the latest, in seconds (None: no need).

        While the lease is good: when it turns fenced if no renewal succeeds. While fenced,
        this thread's ``on_change`` says when a renewal ends it.
        """
        return self.leases.ok_for_s()

    def _run(self) -> None:
        renew_every = self.renew_every
        reap_every = self.lease_s / 3
        next_reap = time.monotonic() + reap_every
        seen = (self.fenced, self.lost)
        while not self._stop.is_set():
            ok = self.leases.renew()
            now_seen = (self.fenced, self.lost)
            if now_seen != seen and self.on_change is not None:
                self.on_change()
            seen = now_seen
            now = time.monotonic()
            if ok and now >= next_reap:
                next_reap = now + reap_every
                try:
                    dead = self.leases.reap()
                except Exception as exc:  # noqa: BLE001 - a failed reap is tried again next time
                    log.warning("lease.reap_failed", error=str(exc))
                    dead = []
                if dead:
                    self.on_lost(dead)
            if ok and (self.leases.ok_for_s() or 0.0) < renew_every:
                continue  # sent long before it was answered (an outage): good for too short a time, renew again now
            self._stop.wait(renew_every if ok else min(1.0, renew_every))

    def stop(self, *, wait: bool = True) -> None:
        """End the thread: at once, or after the renewal under way (``wait``; at most ``_JOIN_S``).

        A stop whose ledger waits have given up (its deadline is near) does not wait: a renewal
        hung on a silent server would hold the stop past ``stop_timeout``, and one that lands
        after the daemon's row is closed changes nothing (it renews only a lease not ended).
        """
        self._stop.set()
        if wait:
            self._thread.join(timeout=min(self.lease_s, _JOIN_S))
