"""The lease keeper (contract section 12): a renewal answered only after an outage does not end the fence.

A renewal counts from when it was sent. One sent just before the network went silent
and answered when it came back leaves the lease good for a few milliseconds; if that
ended the fence, an agent started then would be ended again at once and its job, not
retry-safe, would fail as interrupted (once seen in the PostgreSQL outage test:
`lease.renewed`, `agent.started`, `lease.fenced` 16 ms apart).
"""

from __future__ import annotations

import threading
import time

from dispatcher.core.lease import LeaseKeeper
from dispatcher.ledger.base import Leases

LEASE_S = 6.0  # renew_every = 1 s


class _Leases(Leases):
    """Leases whose remaining good time the test sets; each renewal takes the next value of ``after_renew``."""

    def __init__(self, left: float | None, after_renew: list[float | None] | None = None) -> None:
        self.left = left
        self.after_renew = after_renew or []
        self.renewals: list[float] = []
        self.lock = threading.Lock()

    def renew(self) -> bool:
        with self.lock:
            self.renewals.append(time.monotonic())
            if self.after_renew:
                self.left = self.after_renew.pop(0)
            return self.left is not None

    def reap(self) -> list[str]:
        return []

    def may_reap(self) -> bool:
        return False

    def lease_ok(self) -> bool:
        return self.left is not None

    def ok_for_s(self) -> float | None:
        return self.left

    @property
    def lost(self) -> bool:
        return False


def test_a_renewal_that_leaves_the_lease_good_for_an_instant_does_not_end_the_fence() -> None:
    leases = _Leases(left=LEASE_S / 2)
    keeper = LeaseKeeper(leases, LEASE_S, on_lost=lambda owners: None)
    assert not keeper.fenced, "a fresh lease"
    leases.left = 0.01  # about to run out, not yet: not fenced before it does
    assert not keeper.fenced
    leases.left = None  # no renewal for lease/2
    assert keeper.fenced
    leases.left = 0.016  # a renewal sent before the outage, answered after it
    assert keeper.fenced, "a renewal good for 16 ms ended the fence"
    leases.left = LEASE_S / 2 - 0.01  # a renewal sent and answered now
    assert not keeper.fenced


def test_the_keeper_renews_again_at_once_after_a_renewal_good_for_too_short_a_time() -> None:
    leases = _Leases(left=LEASE_S / 2, after_renew=[0.016, LEASE_S / 2])
    changes: list[bool] = []
    keeper = LeaseKeeper(leases, LEASE_S, on_lost=lambda owners: None, on_change=lambda: changes.append(keeper.fenced))
    leases.left = None
    assert keeper.fenced
    keeper.start()
    try:
        deadline = time.monotonic() + 5
        while len(leases.renewals) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        keeper.stop()
    assert len(leases.renewals) >= 2
    gap = leases.renewals[1] - leases.renewals[0]
    assert gap < keeper.renew_every / 2, f"the second renewal came {gap:.3f} s after a renewal good for 16 ms"
    assert not keeper.fenced and changes == [False], "the fence ended with the second renewal, and the loop was told"
