"""`status` counts (and the queue gauge) while jobs move between the folders they list one after another."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order
from helpers_faults import run_once_killed_at

from dispatcher.layout import Layout
from dispatcher.store import counts

Move = Callable[[Layout], None]


def _root(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path / "dispatch")
    layout.create()
    for job in ("A", "B", "C"):
        (layout.root / "active" / job / "work").mkdir(parents=True)
    (layout.root / "done" / "D" / "work").mkdir(parents=True)
    (layout.root / "failed" / "x@20261201T000000.000000Z").mkdir(parents=True)
    (layout.root / "inbox" / "Q1.json").write_text("{}")
    (layout.root / "inbox" / "Q2.json").write_text("{}")
    return layout


def _moving(monkeypatch: pytest.MonkeyPatch, after: str, move: Callable[[], None]) -> None:
    """Make the given rename once, right after the folder named ``after`` has been listed."""
    real = os.scandir
    done = []

    class Listing:
        def __init__(self, path: Any) -> None:
            self.path = Path(path)
            self.it = real(path)

        def __enter__(self) -> Iterator[os.DirEntry[str]]:
            return iter(list(self.it))

        def __exit__(self, *exc: object) -> None:
            self.it.close()
            if self.path.name == after and not done:
                done.append(True)
                move()

    monkeypatch.setattr(counts.os, "scandir", Listing)


@pytest.mark.parametrize(
    ("after", "src", "dst", "state"),
    [
        ("active", "active/A", "done/A", "done"),  # a job that finished between the two listings
        ("active", "active/B", "failed/B", "failed"),
        ("active", "active/C", "review/C", "review"),
        ("inbox", "inbox/Q1.json", "active/Q1", "active"),  # an order claimed between inbox/ and active/
        ("inbox", "inbox/Q1.json", "active/JOB-7", "active"),  # ... from a file named otherwise than its job
        ("inbox", "inbox/Q1.json", "waiting/JOB-8", "waiting"),  # ... a join, claimed into waiting/
    ],
)
def test_a_job_that_moves_between_two_listings_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: str, src: str, dst: str, state: str
) -> None:
    """A job renamed from active/ into a later folder (an order claimed from inbox/) while `status` lists the folders
    one after another: the counts still add up to the jobs there are, the job counted where it is now."""
    layout = _root(tmp_path)
    before = counts.state_counts(layout)
    jobs = sum(v for k, v in before.items() if k != "refused")
    assert jobs == 6 and before["refused"] == 1

    def move() -> None:
        if src.startswith("inbox/"):  # as a claim does: the job's folder gets a link of the file, then the name goes
            (layout.root / dst / "work").mkdir(parents=True)
            os.link(layout.root / src, layout.root / dst / "order.json")
            (layout.root / src).unlink()
        else:
            os.rename(layout.root / src, layout.root / dst)

    _moving(monkeypatch, after, move)
    during = counts.state_counts(layout)
    assert sum(v for k, v in during.items() if k != "refused") == jobs, during
    assert during[state] == before[state] + 1 and during["refused"] == 1, during
    monkeypatch.undo()
    assert counts.state_counts(layout) == during  # what a listing made after the move says too


def test_the_queue_gauge_counts_a_claimed_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dispatcher_queue: an order claimed between the listing of inbox/ and of active/ is one active job."""
    layout = _root(tmp_path)

    def claim() -> None:
        (layout.root / "active" / "Q2" / "work").mkdir(parents=True)
        os.link(layout.root / "inbox" / "Q2.json", layout.root / "active" / "Q2" / "order.json")
        (layout.root / "inbox" / "Q2.json").unlink()

    _moving(monkeypatch, "inbox", claim)
    assert counts.queue_counts(layout) == {"inbox": 1, "held": 0, "active": 4, "waiting": 0, "review": 0}


def test_an_order_named_like_a_running_job_is_counted_as_the_order_it_is(tmp_path: Path) -> None:
    """inbox/A.json and held/B.yaml hold other orders than the jobs A and B in active/ (a file's name says nothing
    of its job id): each is counted where it is."""
    layout = _root(tmp_path)
    (layout.root / "active" / "A" / "order.json").write_text("{}")
    (layout.root / "inbox" / "A.json").write_text("{}")
    (layout.root / "held" / "B.yaml").write_text("{}")
    got = counts.state_counts(layout)
    assert (got["inbox"], got["held"], got["active"]) == (3, 1, 3), got
    assert counts.queue_counts(layout)["inbox"] == 3


def test_a_claim_cut_short_is_listed_once_in_its_folder(env: Env) -> None:
    """The daemon is killed after placing a claim and before removing the inbox name (both names of one file stay
    until a daemon starts): `list --json` lists the job once, active, as `status` counts it."""
    env.configure()
    env.drop(order("TWIN-1"), name="other-name.json")
    run_once_killed_at(env, "claim.placed")
    assert (env.root / "inbox" / "other-name.json").exists() and (env.root / "active" / "TWIN-1").is_dir()
    rows = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert [(r["job_id"], r["state"]) for r in rows] == [("TWIN-1", "active")], rows
    counts_now = json.loads(env.cli("status", "--json", check=True).stdout)["counts"]
    assert (counts_now["inbox"], counts_now["active"]) == (0, 1), counts_now
    inbox = [json.loads(line) for line in env.cli("list", "--state", "inbox", "--json", check=True).stdout.splitlines()]
    assert inbox == [], inbox
