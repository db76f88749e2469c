"""In-process tests of ``core.claiming.Claims``: the claim phase's one trip, as data for the loop."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml
from seam_fixtures import Seam, open_seam, order, sh

from dispatcher.core import claiming
from dispatcher.core.claiming import BIG_ORDER_BYTES, BIG_YAML_BYTES, Claims
from dispatcher.core.work import Big, Dropped, Gone, Handover, Kind, Launch, NoSlot, Parked
from dispatcher.job import intake
from dispatcher.ledger.base import Request
from dispatcher.shortage import Shortage

ONE_AT_A_TIME = {"worker": sh("true", concurrency=1)}


def claims_of(s: Seam) -> Claims:
    """Return the claim phase of the seam's daemon."""
    return Claims(s.layout, s.ledger, lambda: s.config, s.finisher, lambda folder, refusal: s.refused.append(refusal))


def test_new_names_are_read_and_claimed_each_with_a_slot(tmp_path: Path) -> None:
    """Two names in one trip come back as two Launches holding slots, their jobs in active/."""
    with open_seam(tmp_path, {"worker": sh("true", concurrency=2)}) as s:
        answers = claims_of(s).run([s.drop(order("J1")), s.drop(order("J2"))], Handover())
    assert [type(a) for a in answers] == [Launch, Launch]
    launched = [a for a in answers if isinstance(a, Launch)]
    assert [a.spec.job_id for a in launched] == ["J1", "J2"]
    assert all(a.slot is not None for a in launched)
    assert sorted(os.listdir(s.layout.root / "active")) == ["J1", "J2"]


def test_an_agent_at_its_concurrency_gets_no_slot_and_its_order_stays_in_inbox(tmp_path: Path) -> None:
    """With concurrency 1, the second order of the trip is NoSlot: parked, not claimed, its file still in inbox/."""
    with open_seam(tmp_path, ONE_AT_A_TIME) as s:
        answers = claims_of(s).run([s.drop(order("J1")), s.drop(order("J2"))], Handover())
        row = s.ledger.get("J2")
    by_id = {a.parked.job_id: a for a in answers if isinstance(a, Launch | NoSlot)}  # not in batch order
    assert isinstance(by_id["J1"], Launch) and isinstance(by_id["J2"], NoSlot)
    assert by_id["J2"].parked.kind is Kind.NEW
    assert os.listdir(s.layout.inbox) == ["J2.json"]
    assert row is None


def test_a_blocked_agent_takes_no_slot(tmp_path: Path) -> None:
    """An order for an agent the loop knows is blocked is NoSlot at once, and no slot of it is held."""
    with open_seam(tmp_path, ONE_AT_A_TIME) as s:
        [answer] = claims_of(s).run([s.drop(order("J1"))], Handover(), blocked=frozenset({"worker"}))
        free = s.ledger.take_slot("worker", 1)
    assert isinstance(answer, NoSlot)
    assert free is not None


def test_a_handed_over_slot_is_used_and_an_unused_one_is_given_back(tmp_path: Path) -> None:
    """A slot handed over by an ended job goes to the next job of its agent; a left-over one is freed at the end."""
    with open_seam(tmp_path, {"worker": sh("true", concurrency=2)}) as s:
        kept = s.ledger.take_slot("worker", 2)
        spare = s.ledger.take_slot("worker", 2)
        assert kept is not None and spare is not None
        [answer] = claims_of(s).run([s.drop(order("J1"))], Handover({"worker": [spare, kept]}))
        again = s.ledger.take_slot("worker", 2)
    assert isinstance(answer, Launch) and answer.slot == kept
    assert again == spare


def test_a_bad_file_is_refused_in_the_trip_and_a_vanished_name_is_gone(tmp_path: Path) -> None:
    """A file that is no valid order is refused into failed/ (Gone, refused); a name with no file is just Gone."""
    with open_seam(tmp_path) as s:
        bad, vanished = claims_of(s).run([s.drop(b"not: [an order", "bad.yaml"), "vanished.json"], Handover())
        refusals = [p.name.split("@")[0] for p in (s.layout.root / "failed").iterdir()]
    assert bad == Gone("bad.yaml", refused=True)
    assert vanished == Gone("vanished.json")
    assert refusals == ["bad"]


def test_an_order_too_large_for_the_lane_is_handed_back_unread(tmp_path: Path) -> None:
    """A file above BIG_ORDER_BYTES comes back as Big, to be read in the scan lane; nothing is claimed."""
    with open_seam(tmp_path) as s:
        name = s.drop(order("J1", meta={"notes": "x" * (BIG_ORDER_BYTES + 1)}))
        [answer] = claims_of(s).run([name], Handover())
        row = s.ledger.get("J1")
    assert answer == Big(name)
    assert os.listdir(s.layout.inbox) == [name] and row is None


def test_a_yaml_order_above_big_yaml_bytes_is_handed_back_but_json_of_that_size_is_claimed(tmp_path: Path) -> None:
    """A 20 KiB YAML order comes back as Big (YAML parses slowly); the same order as JSON is claimed in the trip."""
    notes = "x" * (BIG_YAML_BYTES + 4096)
    with open_seam(tmp_path) as s:
        as_yaml = s.drop(yaml.safe_dump(order("Y1", meta={"notes": notes})).encode(), "Y1.yaml")
        as_json = s.drop(order("J1", meta={"notes": notes}))
        big, claimed = claims_of(s).run([as_yaml, as_json], Handover())
        rows = s.ledger.get("Y1"), s.ledger.get("J1")
    assert big == Big(as_yaml)
    assert isinstance(claimed, Launch) and claimed.spec.job_id == "J1"
    assert rows[0] is None and rows[1] is not None


def test_a_slotless_claim_under_a_cancel_request_is_dropped_as_cancelled(tmp_path: Path) -> None:
    """Parked work claimed for a cancel takes no slot; with the request open it is Dropped, cancelled, in failed/."""
    with open_seam(tmp_path, ONE_AT_A_TIME) as s:
        busy = s.ledger.take_slot("worker", 1)  # every slot of the agent is in use
        claims = claims_of(s)
        parked = claims.read(s.drop(order("J1")), s.config)
        assert isinstance(parked, Parked)
        s.ledger.request("J1", Request.CANCEL)
        [answer] = claims.run([parked], Handover(), slotless=True)
        result = s.result("failed", "J1")
    assert busy is not None
    assert isinstance(answer, Dropped) and answer.cancelled
    assert result["reason"] == "cancelled" and result["attempts"] == []


def test_a_retry_without_an_open_request_is_dropped(tmp_path: Path) -> None:
    """Reloading a retry that no request asks for (carried out already) drops it and leaves nothing claimed."""
    with open_seam(tmp_path) as s:
        [answer] = claims_of(s).run([Parked(Kind.RETRY, "J9", "worker")], Handover())
        free = s.ledger.take_slot("worker", 1)
    assert isinstance(answer, Dropped) and not answer.cancelled
    assert free is not None  # the slot the retry took was given back


def test_a_shortage_met_in_the_trip_claims_nothing_more_and_every_order_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Section 13: the second read is short of descriptors; the first order, read, is not claimed either.

    Every order stays in inbox/ to be read again after the pause (the daemon stops claiming
    while short), no slot stays taken, and the ledger has no row of any of them.
    """
    monkeypatch.setattr(claiming, "SHORT", Shortage())  # this test's shortage, not the process's
    real = intake.inspect

    def inspect(layout, name, config, **kw):  # type: ignore[no-untyped-def]
        if name == "J2.json":
            raise OSError(errno.EMFILE, "Too many open files")
        return real(layout, name, config, **kw)

    monkeypatch.setattr(intake, "inspect", inspect)
    with open_seam(tmp_path, {"worker": sh("true", concurrency=3)}) as s:
        names = [s.drop(order(f"J{i}")) for i in (1, 2, 3)]
        answers = claims_of(s).run(names, Handover())
        rows = [s.ledger.get(f"J{i}") for i in (1, 2, 3)]
        slot = s.ledger.take_slot("worker", 1)
    assert not any(isinstance(a, Launch) for a in answers), answers
    assert [a.name for a in answers if isinstance(a, Gone)] == ["J2.json", "J3.json"]
    assert all(a.later for a in answers if isinstance(a, Gone)), "read again after the pause"
    assert [a.parked.job_id for a in answers if isinstance(a, Dropped) and a.retry_later] == ["J1"]
    assert sorted(os.listdir(s.layout.inbox)) == ["J1.json", "J2.json", "J3.json"]
    assert os.listdir(s.layout.root / "active") == []
    assert rows == [None, None, None]
    assert slot == 0, "the slot J1 took was given back"
