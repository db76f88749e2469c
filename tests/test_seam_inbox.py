"""In-process tests of ``core.watcher.Inbox``: which inbox names are ready, when, and in what order."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from dispatcher.core.watcher import Inbox, Listed, list_inbox

SETTLE = 0.1


def inbox_at(tmp_path: Path, *, settle: float = SETTLE, writers: bool = True) -> Inbox:
    """Return an Inbox on tmp_path/inbox (made here)."""
    (tmp_path / "inbox").mkdir()
    return Inbox(tmp_path / "inbox", settle, wait_for_writers=writers)


def write(inbox: Inbox, name: str, data: bytes = b"job_id: J1\n", *, age: float | None = None) -> None:
    """Write inbox/<name>, with an mtime age seconds in the past if given."""
    path = inbox.inbox / name
    path.write_bytes(data)
    if age is not None:
        then = time.time() - age
        os.utime(path, (then, then))


def settle(inbox: Inbox, done: Callable[[list[str]], bool], timeout: float = 10.0) -> list[str]:
    """Call promote_settled until done(names to check) holds; fail after timeout (polls, never a fixed sleep)."""
    end = time.monotonic() + timeout
    while True:
        check, wait = inbox.promote_settled()
        if done(check):
            return check
        assert time.monotonic() < end, f"nothing settled within {timeout} s"
        time.sleep(min(wait or 0.01, 0.05))


def no_writers(inbox: Inbox) -> None:
    """Answer the open-writer check the settled files ask for: no process holds any of them open."""
    check, _ = inbox.promote_settled()
    inbox.writers_checked(check, set())


def drain(inbox: Inbox) -> list[str]:
    """Pop every ready name, in order."""
    out = []
    while (name := inbox.pop()) is not None:
        out.append(name)
    return out


def test_a_file_moved_or_closed_in_is_ready_at_once(tmp_path: Path) -> None:
    """A rename into inbox/ or a close after writing makes the name ready without waiting to settle."""
    inbox = inbox_at(tmp_path)
    write(inbox, "a.json")
    write(inbox, "b.json")
    inbox.hint("moved", "a.json")
    inbox.hint("closed", "b.json")
    assert inbox.has_ready() and not inbox.has_pending()
    assert sorted(drain(inbox)) == ["a.json", "b.json"]


def test_hidden_and_temporary_names_are_never_ready(tmp_path: Path) -> None:
    """Names starting with a dot or ending in .tmp or .part are ignored by hints and by listings."""
    inbox = inbox_at(tmp_path)
    for name in (".a.json.tmp", "b.json.tmp", "c.json.part", ".hidden.json"):
        write(inbox, name, age=60)
        inbox.hint("moved", name)
    inbox.merge(list_inbox(inbox.inbox))
    assert len(inbox) == 0
    assert inbox.pop() is None


def test_a_created_file_is_ready_only_after_it_settles_and_no_writer_holds_it(tmp_path: Path) -> None:
    """A created file waits settle seconds unchanged, then the open-writer check; with no writer it is ready."""
    inbox = inbox_at(tmp_path)
    write(inbox, "a.json")
    inbox.hint("created", "a.json")
    check, wait = inbox.promote_settled()
    assert check == [] and wait is not None and 0 < wait <= SETTLE
    assert not inbox.has_ready() and inbox.has_pending()
    check = settle(inbox, lambda names: names == ["a.json"])
    assert not inbox.has_ready()  # until the check answers
    inbox.writers_checked(check, held=set())
    assert drain(inbox) == ["a.json"] and not inbox.has_pending()


def test_a_file_still_held_open_for_writing_waits_another_settle_period(tmp_path: Path) -> None:
    """When the open-writer check finds the file held, it stays pending and is checked again later."""
    inbox = inbox_at(tmp_path)
    write(inbox, "a.json")
    inbox.hint("created", "a.json")
    check = settle(inbox, lambda names: names == ["a.json"])
    inbox.writers_checked(check, held={os.path.abspath(inbox.inbox / "a.json")})
    assert not inbox.has_ready() and inbox.has_pending()
    again = settle(inbox, lambda names: names == ["a.json"])
    inbox.writers_checked(again, held=set())
    assert drain(inbox) == ["a.json"]


def test_a_write_while_settling_starts_the_settle_period_again(tmp_path: Path) -> None:
    """A change of size or mtime while pending restarts the clock: the file waits a full settle from the change."""
    inbox = inbox_at(tmp_path, settle=0.3)
    write(inbox, "a.json")
    inbox.hint("created", "a.json")
    end = time.monotonic() + 10
    while (left := inbox.promote_settled()[1]) is not None and left > 0.15:  # half the settle period has passed
        assert time.monotonic() < end, "the settle clock never ran"
        time.sleep(0.01)
    write(inbox, "a.json", b"job_id: J1\nfrom: tester\n")  # grown
    check, wait = inbox.promote_settled()
    assert check == [] and wait is not None and wait > 0.25
    assert not inbox.has_ready()


def test_without_the_writer_check_a_settled_file_is_ready_directly(tmp_path: Path) -> None:
    """With wait_for_writers off (`run --once`), a file is ready once it settled, with no check to make."""
    inbox = inbox_at(tmp_path, writers=False)
    write(inbox, "a.json")
    inbox.hint("created", "a.json")
    settle(inbox, lambda names: inbox.has_ready())
    assert drain(inbox) == ["a.json"]


def test_listed_files_are_ready_oldest_first_then_by_name(tmp_path: Path) -> None:
    """Old files found by a listing are ready once the open-writer check says no process holds them (at once
    without that check), and pop by mtime, oldest first, ties by name."""
    inbox = inbox_at(tmp_path)
    write(inbox, "new.json", age=10)
    write(inbox, "old.json", age=30)
    write(inbox, "b-mid.json", age=20)
    write(inbox, "a-mid.json")
    mid = os.stat(inbox.inbox / "b-mid.json").st_mtime_ns
    os.utime(inbox.inbox / "a-mid.json", ns=(mid, mid))  # the same mtime as b-mid.json
    inbox.merge(list_inbox(inbox.inbox))
    assert drain(inbox) == []  # settled by their age, but a writer may hold one open still
    no_writers(inbox)
    assert drain(inbox) == ["old.json", "a-mid.json", "b-mid.json", "new.json"]


def test_a_fresh_file_found_by_a_listing_waits_to_settle(tmp_path: Path) -> None:
    """A listing that finds a file younger than settle keeps it pending; a scan twice does not add it twice."""
    inbox = inbox_at(tmp_path, settle=5)
    write(inbox, "a.json")
    inbox.merge(list_inbox(inbox.inbox))
    inbox.merge(list_inbox(inbox.inbox))
    assert inbox.has_pending() and not inbox.has_ready() and len(inbox) == 1


def test_a_folder_or_link_is_ready_at_once_to_be_refused(tmp_path: Path) -> None:
    """Entries that are not regular files skip settling: they are ready at once (and refused, never opened)."""
    inbox = inbox_at(tmp_path, settle=5)
    (inbox.inbox / "dir.json").mkdir()
    os.symlink("/etc/passwd", inbox.inbox / "link.json")
    inbox.hint("created", "dir.json")
    inbox.hint("created", "link.json")
    assert sorted(drain(inbox)) == ["dir.json", "link.json"]


def test_a_pending_file_that_goes_away_is_forgotten(tmp_path: Path) -> None:
    """A pending name whose file is removed (a gone hint, or found missing on promote) is dropped."""
    inbox = inbox_at(tmp_path, settle=5)
    write(inbox, "a.json")
    write(inbox, "b.json")
    inbox.hint("created", "a.json")
    inbox.hint("created", "b.json")
    os.unlink(inbox.inbox / "a.json")
    os.unlink(inbox.inbox / "b.json")
    inbox.hint("gone", "a.json")
    assert inbox.promote_settled() == ([], None)
    assert len(inbox) == 0 and not inbox.has_pending()


def test_push_back_makes_a_name_ready_again_and_forget_drops_it(tmp_path: Path) -> None:
    """push_back re-queues a name left in place; forget removes a ready name so pop no longer returns it."""
    inbox = inbox_at(tmp_path)
    write(inbox, "a.json")
    write(inbox, "b.json")
    inbox.hint("moved", "a.json")
    assert inbox.pop() == "a.json"
    inbox.push_back("a.json")
    assert inbox.pop() == "a.json"
    inbox.hint("moved", "b.json")
    inbox.forget("b.json")
    assert inbox.pop() is None
    inbox.forget("a.json")
    assert len(inbox) == 0


def test_a_hint_wakes_the_loop(tmp_path: Path) -> None:
    """Each hint for a real name calls wake; an ignored name does not."""
    (tmp_path / "inbox").mkdir()
    woken: list[int] = []
    inbox = Inbox(tmp_path / "inbox", SETTLE, wake=lambda: woken.append(1))
    write(inbox, "a.json")
    inbox.hint("moved", ".a.json.tmp")
    inbox.hint("moved", "a.json")
    assert woken == [1]


def test_a_name_gone_wakes_the_loop_only_while_it_settles(tmp_path: Path) -> None:
    """A gone hint wakes for a name that was settling; not for one already taken (each claim removes its order)."""
    (tmp_path / "inbox").mkdir()
    woken: list[str] = []
    inbox = Inbox(tmp_path / "inbox", 5.0, wake=lambda: woken.append("woken"))
    write(inbox, "a.json")
    inbox.hint("created", "a.json")
    os.unlink(inbox.inbox / "a.json")
    inbox.hint("gone", "a.json")
    assert woken == ["woken", "woken"] and len(inbox) == 0
    write(inbox, "b.json")
    inbox.hint("moved", "b.json")
    assert inbox.pop() == "b.json" and len(woken) == 3
    os.unlink(inbox.inbox / "b.json")  # what a claim does
    inbox.hint("gone", "b.json")
    inbox.hint("created", ".c.json.tmp")
    assert len(woken) == 3


def test_orders_set_aside_for_a_gate_are_skipped_and_come_back_in_their_order(tmp_path: Path) -> None:
    """Names set aside for a gated agent are never ready; take_back makes them ready again, oldest first."""
    inbox = inbox_at(tmp_path)
    for i, name in enumerate(["a1.json", "a2.json", "b1.json", "a3.json"]):
        write(inbox, name, age=10 - i)
        inbox.hint("moved", name)
    taken = [inbox.pop() for _ in range(4)]
    assert taken == ["a1.json", "a2.json", "b1.json", "a3.json"]
    for name in ("a3.json", "a1.json", "a2.json"):
        inbox.set_aside(name, "A")  # read, and found to be orders of a gated agent
    inbox.forget("b1.json")
    assert not inbox.has_ready() and inbox.aside() == 3 and len(inbox) == 3
    inbox.take_back(frozenset({"A"}))  # still gated: nothing comes back
    assert inbox.pop() is None
    inbox.forget("a2.json")  # cancelled or held meanwhile
    inbox.take_back(frozenset())
    assert drain(inbox) == ["a1.json", "a3.json"] and inbox.aside() == 0


def test_pop_sets_aside_unread_the_orders_a_glance_shows_for_a_gated_agent(tmp_path: Path) -> None:
    """pop(gated) skips orders whose `to` (JSON or YAML) names a gated agent; take_back returns them in order."""
    inbox = inbox_at(tmp_path)
    bodies = {
        "a1.json": b'{"job_id": "A1", "to": "A"}',
        "b1.yaml": b"job_id: B1\nto: B\n",
        "a2.yaml": b"job_id: A2\nto: 'A'  # paused\n",
        "b2.json": b'{"job_id": "B2", "to": "B"}',
    }
    for i, (name, data) in enumerate(bodies.items()):
        write(inbox, name, data, age=10 - i)
        inbox.hint("moved", name)
    gated = frozenset({"A"})
    assert [inbox.pop(gated), inbox.pop(gated), inbox.pop(gated)] == ["b1.yaml", "b2.json", None]
    assert inbox.aside() == 2 and len(inbox) == 4
    inbox.take_back(frozenset())
    assert drain(inbox) == ["a1.json", "a2.yaml"]


def test_an_order_set_aside_twice_counts_once(tmp_path: Path) -> None:
    """A set-aside order written again and set aside again is one order for `run --once`, not two."""
    (tmp_path / "a1.json").write_text(json.dumps({"job_id": "a1", "to": "A", "items": []}))
    old = time.time_ns() - 10**11
    os.utime(tmp_path / "a1.json", ns=(old, old))
    inbox = Inbox(tmp_path, settle_s=2.0)
    inbox.merge([Listed("a1.json", os.path.getsize(tmp_path / "a1.json"), old, True)])
    no_writers(inbox)
    assert inbox.pop(frozenset({"A"})) is None and inbox.aside_for({"A"}) == 1
    inbox.hint("closed", "a1.json")  # written again (a touch, an editor's save): ready, then set aside again
    assert inbox.pop(frozenset({"A"})) is None
    assert inbox.aside_for({"A"}) == 1 == len(inbox)
