"""The Ledger contract, run against both engines (SQLite and PostgreSQL) so that they cannot drift.

Each test drives one or two ledger objects ("daemons") on one store: a SQLite file
with its flocks in tmp_path, or a fresh database of the session's real PostgreSQL
server. A daemon dies by ``close()`` (its flock goes, or its row is marked stopped).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dispatcher.layout import Layout
from dispatcher.ledger.base import Busy, Child, Claimed, ClaimRequest, DaemonInfo, Entry, Finish, Known, Ledger, Request
from dispatcher.ledger.postgres import PostgresLedger
from dispatcher.ledger.sqlite import SqliteLedger
from dispatcher.lifecycle import Row

pytestmark = pytest.mark.postgres
pytest_plugins = ["pg_fixtures"]


@dataclass
class Engine:
    """Makes ledger objects on one store; ``daemon(name)`` also registers it."""

    name: str
    open: Callable[[], Ledger]
    made: list[Ledger] = field(default_factory=list)

    def ledger(self) -> Ledger:
        led = self.open()
        self.made.append(led)
        return led

    def daemon(self, owner: str) -> Ledger:
        led = self.ledger()
        led.register(DaemonInfo(owner, os.getpid(), f"host-{owner}", time.time()))
        return led


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """Yield an Engine on a fresh store of each kind."""
    if request.param == "sqlite":
        state = tmp_path / "state"
        state.mkdir()
        (state / "slots").mkdir()
        eng = Engine("sqlite", lambda: SqliteLedger(state / "l.sqlite3", state, patience_s=30))
    else:
        dsn = request.getfixturevalue("pg_db")
        eng = Engine("postgres", lambda: PostgresLedger(dsn, Layout(tmp_path), lease_s=30, patience_s=30))
    try:
        yield eng
    finally:
        for led in eng.made:
            led.close()


def req(job_id: str, source: str | None = None, digest: str = "d", agent: str = "w", **kw: bool) -> ClaimRequest:
    """A claim request for the file ``source`` (default ``<job_id>.yaml``)."""
    return ClaimRequest(job_id, agent, source or f"{job_id}.yaml", digest, **kw)


def eventually(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll predicate until it is true; fail after timeout."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def claimed_token(answer: object) -> int:
    """Return the token of a Claimed answer (and fail on anything else)."""
    assert isinstance(answer, Claimed), answer
    return answer.token


def test_a_new_id_is_claimed_with_token_1_and_a_second_file_with_it_is_known(engine: Engine) -> None:
    """A new id is Claimed (token 1); another file with that id, or a finished id, is Known."""
    a = engine.daemon("A")
    assert a.claim([req("J1")]) == [Claimed("J1", 1)]
    (again,) = a.claim([req("J1", "other.yaml", "d2")])
    assert isinstance(again, Known) and again.entry.state == Row.CLAIMED
    assert a.finish([Finish("J1", 1, Row.DONE)]) == [True]
    (later,) = a.claim([req("J1")])
    assert isinstance(later, Known) and later.entry.state == Row.DONE
    entry = a.get("J1")
    assert entry is not None and (entry.owner, entry.agent, entry.source, entry.digest) == ("A", "w", "J1.yaml", "d")


def test_one_batch_with_one_id_twice_gives_one_claim(engine: Engine) -> None:
    """Two files with one id in one batch: the first is Claimed, the same file again Busy, another Known."""
    a = engine.daemon("A")
    answers = a.claim([req("J1"), req("J1"), req("J1", "b.yaml", "d2"), req("J2")])
    assert answers[0] == Claimed("J1", 1)
    assert isinstance(answers[1], Busy)
    assert isinstance(answers[2], Known)
    assert answers[3] == Claimed("J2", 1)


def test_the_same_file_claimed_by_a_live_daemon_is_busy(engine: Engine) -> None:
    """The very file another live daemon is claiming is Busy for a second daemon; a different file Known."""
    a, b = engine.daemon("A"), engine.daemon("B")
    claimed_token(a.claim([req("J1")])[0])
    (busy,) = b.claim([req("J1")])
    assert isinstance(busy, Busy) and busy.entry.owner == "A"
    assert isinstance(b.claim([req("J1", digest="other")])[0], Known)


def test_a_dead_daemons_claim_on_the_same_file_is_taken_over(engine: Engine) -> None:
    """After its daemon died, the claim of the same file is taken over (token 2) when allowed, else Known."""
    a, b = engine.daemon("A"), engine.daemon("B")
    claimed_token(a.claim([req("J1"), req("J2")])[0])
    a.close()
    engine.made.remove(a)
    assert not b.alive("A")
    assert isinstance(b.claim([req("J2", may_take_over=False)])[0], Known)
    assert isinstance(b.claim([req("J1", digest="changed")])[0], Known)
    (taken,) = b.claim([req("J1")])
    assert taken == Claimed("J1", 2, previous="claimed", previous_owner="A")
    entry = b.get("J1")
    assert entry is not None and (entry.owner, entry.token) == ("B", 2)


def test_unclaiming_a_takeover_gives_the_claim_back_to_the_daemon_it_was_taken_from(engine: Engine) -> None:
    """A takeover whose folder could not be placed (the first daemon placed it) is undone, not deleted."""
    a, b = engine.daemon("A"), engine.daemon("B")
    claimed_token(a.claim([req("J1")])[0])
    a.close()
    engine.made.remove(a)
    (taken,) = b.claim([req("J1")])
    assert isinstance(taken, Claimed) and taken.previous_owner == "A"
    b.unclaim("J1", taken.token, taken.previous, taken.previous_owner)
    entry = b.get("J1")
    assert entry is not None and (entry.state, entry.owner, entry.token) == ("claimed", "A", 1)


def test_a_released_followup_is_claimed_with_its_lineage_when_the_digest_matches(engine: Engine) -> None:
    """Reserve, finish the parent, release: the follow-up's file is Claimed with parent, hops and chain cost."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C1", "w2", "C1.json"), Child("C2", "w2", "C2.json")]) == []
    assert a.pending_releases() == []  # the parent is not done yet
    assert a.finish([Finish("P", 1, Row.DONE, cost_usd=0.25, chain_cost_usd=0.75)]) == [True]
    pending = a.pending_releases("P")
    assert [e.job_id for e in pending] == ["C1", "C2"]
    assert {(e.owner, e.chain_cost_usd, e.hops, e.parent) for e in pending} == {("A", 0.75, 1, "P")}
    a.set_digest("C1", "sha-c1")
    assert a.get("C1").digest == "sha-c1"  # type: ignore[union-attr]
    assert a.mark_released("C1", "C1@A.json", "sha-c1") is True
    assert a.mark_released("C1", "C1@A.json", "sha-c1") is False  # no longer reserved
    assert [e.job_id for e in a.pending_releases()] == ["C2"]
    assert isinstance(a.claim([req("C1", "C1-copy.json", "wrong")])[0], Known)  # another file with its id
    (got,) = a.claim([req("C1", "C1@A.json", "sha-c1")])
    assert got == Claimed("C1", 1, parent="P", hops=1, previous="released", parent_chain_cost_usd=0.75)
    # the released file is its bytes under any name, or whatever file has the name it was released under (edited)
    a.set_digest("C2", "sha-c2")
    assert a.mark_released("C2", "C2@A.json", "sha-c2") is True
    (moved,) = a.claim([req("C2", "C2-renamed.json", "sha-c2")])
    assert moved == Claimed("C2", 1, parent="P", hops=1, previous="released", parent_chain_cost_usd=0.75)


def test_a_released_followup_edited_under_its_name_is_claimed_with_its_lineage(engine: Engine) -> None:
    """A released follow-up's file rewritten under the name it was released under (other bytes) is the follow-up:
    Claimed with the row's lineage; the same bytes under another name would be too, other bytes under another name
    are Known."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 2, [Child("C1", "w2", "C1.json")]) == []
    assert a.finish([Finish("P", 1, Row.DONE, cost_usd=0.1, chain_cost_usd=0.1)]) == [True]
    a.set_digest("C1", "sha-c1")
    assert a.mark_released("C1", "C1.json", "sha-c1") is True
    assert isinstance(a.claim([req("C1", "C1-2.json", "edited")])[0], Known)
    (got,) = a.claim([req("C1", "C1.json", "edited")])
    assert got == Claimed("C1", 1, parent="P", hops=2, previous="released", parent_chain_cost_usd=0.1)


def test_a_release_turn_is_taken_once_while_its_holder_lives(engine: Engine) -> None:
    """take_release: one live process at a time per reserved row; taken over from a daemon that died."""
    a, b = engine.daemon("A"), engine.daemon("B")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C1", "w2", "C1.json")]) == []
    assert a.finish([Finish("P", 1, Row.DONE)]) == [True]
    assert a.take_release("C1", "sha-1", "A") is True
    assert b.take_release("C1", "sha-1", "B") is False  # A lives and holds it
    assert a.take_release("C1", "sha-1", "A") is True  # its own turn again (a retried step)
    assert a.get("C1").digest == "sha-1"  # type: ignore[union-attr]
    a.close()
    engine.made.remove(a)
    deadline = time.monotonic() + 10  # a live daemon's lease may be remembered for up to a second
    while not b.take_release("C1", "sha-1", "B"):
        assert time.monotonic() < deadline, "the turn of a dead daemon was never taken over"
        time.sleep(0.1)
    assert b.mark_released("C1", "C1.json", "sha-1") is True
    assert b.take_release("C1", "sha-1", "B") is False  # released: no turn is left to take


def test_a_commands_release_turn_is_kept_while_its_process_lives(engine: Engine) -> None:
    """A command (no daemon) takes the turn under its host, pid and start; a daemon takes it once that process ended."""
    import subprocess
    import sys

    from dispatcher.ledger.releasers import releaser

    a = engine.daemon("A")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C1", "w2", "C1.json")]) == []
    assert a.finish([Finish("P", 1, Row.DONE)]) == [True]
    code = "from dispatcher.ledger.releasers import releaser; print(releaser(''), flush=True); input()"
    argv = [sys.executable, "-c", code]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as cmd:
        assert cmd.stdout is not None and cmd.stdin is not None
        command_id = cmd.stdout.readline().strip()
        assert command_id.startswith("cmd:") and command_id != releaser("")
        assert a.take_release("C1", "sha", command_id) is True
        assert a.take_release("C1", "sha", "A") is False  # the command lives
        cmd.stdin.close()
    assert a.take_release("C1", "sha", "A") is True  # it ended: its turn is taken over
    assert a.get("C1").owner == "A"  # type: ignore[union-attr]


def test_a_reserved_followup_can_be_held_and_set_state_moves_it(engine: Engine) -> None:
    """mark_released(held=True) puts the row in held; set_state moves it only from the expected state."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C1", "w", "C1.json")]) == []
    assert a.finish([Finish("P", 1, Row.DONE)]) == [True]
    assert a.mark_released("C1", "C1.json", "x", held=True) is True
    assert a.get("C1").state == Row.HELD  # type: ignore[union-attr]
    assert a.set_state("C1", Row.RELEASED, expect=Row.RESERVED) is False  # type: ignore[attr-defined]
    assert a.set_state("C1", Row.RELEASED, expect=Row.HELD) is True  # type: ignore[attr-defined]
    assert a.get("C1").state == Row.RELEASED  # type: ignore[union-attr]


def test_unclaim_gives_the_id_back_only_with_the_claims_token(engine: Engine) -> None:
    """unclaim deletes a new claim, puts a released follow-up back, and does nothing with a wrong token."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("J1")])[0])
    a.unclaim("J1", 7, None)
    assert a.get("J1") is not None
    a.unclaim("J1", 1, None)
    assert a.get("J1") is None
    assert a.claim([req("J1")]) == [Claimed("J1", 1)]  # free again
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C", "w", "C.json")]) == []
    assert a.finish([Finish("P", 1, Row.DONE)]) == [True]
    assert a.mark_released("C", "C.json", "dc") is True
    token = claimed_token(a.claim([req("C", "C.json", "dc")])[0])
    a.unclaim("C", token, Row.RELEASED)
    entry = a.get("C")
    assert entry is not None and (entry.state, entry.owner, entry.token) == (Row.RELEASED, None, token)


def test_adopt_takes_a_dead_daemons_claim_once(engine: Engine) -> None:
    """adopt moves the token on by one for the first adopter; a second adopt with the old token gets None."""
    a, b, c = engine.daemon("A"), engine.daemon("B"), engine.daemon("C")
    claimed_token(a.claim([req("J1")])[0])
    a.close()
    engine.made.remove(a)
    assert b.adopt("J1", "A", 1) == 2
    assert c.adopt("J1", "A", 1) is None
    entry = c.get("J1")
    assert entry is not None and (entry.owner, entry.token, entry.state) == ("B", 2, Row.CLAIMED)
    assert b.finish([Finish("J1", 1, Row.DONE)]) == [False]  # the old token is fenced
    assert b.finish([Finish("J1", 2, Row.DONE)]) == [True]


def test_take_retry_turns_only_a_failed_job_into_a_new_claim(engine: Engine) -> None:
    """take_retry claims a failed job with an open retry request, with the next token; anything else gets None."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("J1")])[0])
    assert a.take_retry("J1") is None  # still claimed
    assert a.take_retry("nope") is None
    assert a.finish([Finish("J1", 1, Row.FAILED)]) == [True]
    assert a.take_retry("J1") is None  # nobody asked for a retry
    a.request("J1", Request.RETRY)
    assert a.take_retry("J1") == 2
    entry = a.get("J1")
    assert entry is not None and (entry.state, entry.owner, entry.token) == (Row.CLAIMED, "A", 2)
    assert a.finish([Finish("J1", 1, Row.DONE)]) == [False]
    assert a.finish([Finish("J1", 2, Row.DONE)]) == [True]


def test_take_retry_of_a_join_starts_its_wait_again(engine: Engine) -> None:
    """A join that waited, failed (max_wait), and is retried: its waits count from the retry, not the first claim."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("J1")])[0])
    assert a.wait("J1", 1, ["X"], "all_done") is True
    [first] = a.waits(["J1"])
    token = a.take_waiting("J1")
    assert token is not None and a.finish([Finish("J1", token, Row.FAILED)]) == [True]
    time.sleep(0.05)
    a.request("J1", Request.RETRY)
    retried = a.take_retry("J1")
    assert retried is not None and a.wait("J1", retried, ["X"], "all_done") is True
    [again] = a.waits(["J1"])
    assert again.since > first.since + 0.04, (first, again)


def test_finish_is_conditional_on_the_token_and_idempotent(engine: Engine) -> None:
    """finish needs the claim's token; repeating it answers True; a finished row takes no other end."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("J1"), req("J2")])[0])
    assert a.finish([Finish("J1", 2, Row.DONE), Finish("J2", 1, Row.REVIEW)]) == [False, True]
    assert a.finish([Finish("J1", 1, Row.DONE, 1.5, 2.5)]) == [True]
    assert a.finish([Finish("J1", 1, Row.DONE, 1.5, 2.5)]) == [True]
    assert a.finish([Finish("J1", 1, Row.FAILED)]) == [False]
    entry = a.get("J1")
    assert entry is not None and (entry.state, entry.cost_usd, entry.chain_cost_usd) == (Row.DONE, 1.5, 2.5)
    assert a.finish([Finish("J2", 1, Row.DONE)]) == [True]  # approved out of review


def test_a_failed_parents_reservations_are_deleted(engine: Engine) -> None:
    """When a parent fails, its reserved (never released) follow-ups are deleted."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("P")])[0])
    assert a.reserve("P", 1, 1, [Child("C1", "w", "C1.json"), Child("C2", "w", "C2.json")]) == []
    assert a.children("P") == ["C1", "C2"]
    assert a.finish([Finish("P", 1, Row.FAILED)]) == [True]
    assert a.children("P") == []
    assert a.known(["C1", "C2", "P"]).keys() == {"P"}


def test_reserve_is_all_or_nothing_repeatable_and_fenced(engine: Engine) -> None:
    """reserve: again after a crash reserves nothing new; a taken id reserves nothing; a stale token gets None."""
    a = engine.daemon("A")
    claimed_token(a.claim([req("P"), req("X")])[0])
    assert a.reserve("P", 2, 1, [Child("C1", "w", "C1.json")]) is None
    assert a.reserve("P", 1, 1, [Child("C1", "w", "C1.json")]) == []
    assert a.reserve("P", 1, 1, [Child("C1", "w", "C1.json"), Child("C2", "w", "C2.json")]) == []
    assert a.reserve("P", 1, 1, [Child("C3", "w", "C3.json"), Child("X", "w", "X.json")]) == ["X"]
    assert a.get("C3") is None
    assert a.children("P") == ["C1", "C2"]
    assert a.get("C2").hops == 1 and a.get("C2").state == Row.RESERVED  # type: ignore[union-attr]


def test_requests_are_listed_oldest_first_and_cleared(engine: Engine) -> None:
    """request / requests / clear_request: per kind, oldest first, a repeat does not duplicate."""
    a = engine.ledger()
    a.request("J2", Request.RETRY)
    time.sleep(0.01)
    a.request("J1", Request.RETRY)
    a.request("J3", Request.CANCEL)
    a.request("J1", Request.RETRY)
    assert a.requests(Request.RETRY) in (["J2", "J1"],)
    assert a.requests(Request.CANCEL) == ["J3"]
    a.clear_request("J2", Request.RETRY)
    a.clear_request("J3", Request.RETRY)  # not open: nothing happens
    assert a.requests(Request.RETRY) == ["J1"]
    assert a.requests(Request.CANCEL) == ["J3"]


def test_slots_over_two_daemons_never_exceed_concurrency(engine: Engine) -> None:
    """Two daemons taking slots of one agent hold at most `concurrency` together; a freed slot is free to all."""
    a, b = engine.daemon("A"), engine.daemon("B")
    held: list[tuple[Ledger, int]] = []
    for _ in range(4):
        for led in (a, b):
            slot = led.take_slot("w", 3)
            if slot is not None:
                held.append((led, slot))
    assert len(held) == 3
    assert sorted(s for _, s in held) == [0, 1, 2]
    assert a.take_slot("w", 3) is None and b.take_slot("w", 3) is None
    assert a.take_slot("other", 1) == 0  # another agent has its own slots
    led, slot = held[0]
    led.free_slot("w", slot)
    other = b if led is a else a
    assert other.take_slot("w", 3) == slot
    assert led.take_slot("w", 3) is None


def test_a_closed_daemons_slots_are_free(engine: Engine) -> None:
    """When a daemon ends, the slots it held are free for the others."""
    a, b = engine.daemon("A"), engine.daemon("B")
    assert a.take_slot("w", 1) == 0
    assert b.take_slot("w", 1) is None
    a.close()
    engine.made.remove(a)
    assert b.take_slot("w", 1) == 0


def test_bulk_rows_load_count_and_states(engine: Engine) -> None:
    """load_rows keeps existing rows and counts new ones; rows, count, is_empty, in_state agree."""
    a = engine.ledger()
    assert a.is_empty() and a.count() == 0 and list(a.rows()) == []
    entries = [
        Entry("b", "done", "w", None, 1, "b.yaml", "db", None, 0, 0.5, 0.5, 1000.25),
        Entry("a", "failed", "w", "X", 3, None, None, "b", 1, None, None, 1001.5),
        Entry("c", "reserved", "w2", None, 0, "c.json", None, "b", 1, None, None, 1002.0),
    ]
    assert a.load_rows(entries) == 3
    assert a.load_rows([entries[0], Entry("d", "done", None, None, 1, None, None, None, 0, None, None, 5.0)]) == 1
    assert [e.job_id for e in a.rows()] == ["a", "b", "c", "d"]
    assert list(a.rows())[:3] == sorted(entries, key=lambda e: e.job_id)
    assert a.count() == 4 and not a.is_empty()
    assert {e.job_id for e in a.in_state(Row.DONE, Row.RESERVED)} == {"b", "c", "d"}
    assert a.known(["a", "zz"]) == {"a": entries[1]}


def test_daemons_are_listed_alive_then_dead(engine: Engine) -> None:
    """daemons() lists each registered daemon with host and pid, alive until it ends."""
    a, b = engine.daemon("A"), engine.daemon("B")
    found = {d.owner: d for d in b.daemons()}
    assert found.keys() >= {"A", "B"}
    assert found["A"].alive and found["A"].host == "host-A" and found["A"].pid == os.getpid()
    assert b.alive("A") and a.alive("A")
    assert a.lease_ok() and not a.lost  # a fresh daemon need not fence itself
    a.close()
    engine.made.remove(a)
    eventually(lambda: not b.alive("A"), "A dead")  # a live answer may be cached for a second
    assert not {d.owner: d for d in b.daemons()}["A"].alive


def test_a_running_jobs_noted_spend_counts_in_the_daily_window_and_its_finish_keeps_one_cost(engine: Engine) -> None:
    """note_spend on a claimed job puts its cost so far in costs_since (a daily cap sees it); a stale token is
    ignored; the finish records the whole cost once, never beside the noted part."""
    a = engine.daemon("A")
    token = claimed_token(a.claim([req("S1")])[0])
    start = time.time() - 1
    assert a.costs_since(start) == []
    a.note_spend("S1", token, 0.6)
    a.note_spend("S1", token + 1, 9.0)  # not its claim: nothing
    assert [(agent, cost) for _, agent, cost in a.costs_since(start)] == [("w", 0.6)]
    assert a.finish([Finish("S1", token, Row.FAILED, 0.9)]) == [True]
    assert [(agent, cost) for _, agent, cost in a.costs_since(start)] == [("w", 0.9)]


def test_a_lowered_concurrency_starts_no_copy_beside_those_still_holding_slots_beyond_it(engine: Engine) -> None:
    """A holds slots 0, 1 and 2 under concurrency 3; a reload lowers it to 1 and A's copy on slot 0 ends: B gets no
    slot while the copies on 1 and 2 run (it took slot 0: three copies under concurrency 1), and gets one after."""
    a, b = engine.daemon("A"), engine.daemon("B")
    assert [a.take_slot("w", 3) for _ in range(3)] == [0, 1, 2]
    a.free_slot("w", 0)
    assert b.take_slot("w", 1) is None
    assert b.take_slot("w", 2) is None
    a.free_slot("w", 2)
    assert b.take_slot("w", 1) is None  # slot 1 still held
    a.free_slot("w", 1)
    assert b.take_slot("w", 1) == 0
    assert a.take_slot("w", 1) is None
