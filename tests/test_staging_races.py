"""Two live daemons clean up after the same dead daemon at once (contract sections 1 and 6: exactly once).

Each live daemon, at its start and at each rescan, finishes what dead daemons left: their
staging folders, a join's landing cut short, a follow-up linked into inbox/ but not yet
recorded as released. Two of them may take the same leftover in the same moment. These
tests put the second daemon's whole step inside the first one's, at the point where the
first has just decided to act: the first then finds the work done, goes on, and the job is
claimed, run, landed or released once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order
from helpers_faults import run_once_killed_at
from test_joins import join_agents, merger

from dispatcher.job import joins as joins_module
from dispatcher.job.followups import release_followups
from dispatcher.job.joins import ALL_DONE, WAIT, Joins
from dispatcher.job.recovery import finish_staging
from dispatcher.layout import Layout
from dispatcher.ledger.base import ClaimRequest, DaemonInfo, Wait
from dispatcher.lifecycle import Row
from dispatcher.spec.config import load_config
from dispatcher.store import refusals
from dispatcher.store.ledgers import open_ledger
from dispatcher.store.refusals import Refusal, refuse


def _ledger(env: Env, owner: str) -> Any:
    cfg = load_config(env.config_path)
    ledger = open_ledger(cfg, Layout(cfg.root), patience_s=10)
    ledger.register(DaemonInfo(owner, os.getpid(), "localhost", time.time()))
    return ledger


def _both_at_once(layout: Layout, first: Any, second: Any) -> None:
    """Run the first daemon's pass; the second's runs whole as the first learns the owner is dead."""

    def dead(owner: str) -> bool:
        if owner == "vm-dead":
            finish_staging(layout, second, lambda o: o == "vm-b")
        return owner == "vm-a"

    finish_staging(layout, first, dead)


def test_a_dead_daemons_unfinished_claim_finished_by_two_daemons_at_once_is_put_back_once(env: Env) -> None:
    """A claim cut before its folder was whole: both daemons go on, the order is back in inbox/ once, the id free."""
    env.configure()
    assert env.cli("run", "--once").returncode == 0  # makes the layout and the ledger
    layout = Layout(env.root)
    inbox_file = env.drop(order("STAGE-1"))
    data = inbox_file.read_bytes()
    dead = _ledger(env, "vm-dead")
    [answer] = dead.claim([ClaimRequest("STAGE-1", "worker", inbox_file.name, "x")])
    assert answer.token is not None
    stage = layout.staging / "vm-dead.claim-STAGE-1-1"
    stage.mkdir()
    os.link(inbox_file, stage / "order.json")  # the claim's second name, then the inbox name went: no job.json yet
    inbox_file.unlink()
    dead.close()  # its liveness lock goes with it: the daemon is dead
    first, second = _ledger(env, "vm-a"), _ledger(env, "vm-b")
    try:
        _both_at_once(layout, first, second)
        assert os.listdir(layout.staging) == []
        assert os.listdir(layout.inbox) == [inbox_file.name]
        assert inbox_file.read_bytes() == data and os.stat(inbox_file).st_nlink == 1
        entry = first.get("STAGE-1")
        assert entry is None or entry.state != Row.CLAIMED, entry
    finally:
        first.close()
        second.close()
    assert env.cli("run", "--once").returncode == 0
    env.wait_job("STAGE-1", "done")
    assert env.starts() == [("STAGE-1", 1)]


def test_a_dead_daemons_refusal_finished_by_two_daemons_at_once_is_placed_once(env: Env) -> None:
    """A refusal built but not placed: both daemons go on, failed/ holds one folder with the file's bytes."""
    env.configure()
    assert env.cli("run", "--once").returncode == 0
    layout = Layout(env.root)
    junk = env.drop(b"not an order\n", name="junk.txt")
    judged = (os.stat(junk).st_dev, os.stat(junk).st_ino)

    class Cut(Exception):
        """The daemon's death, after the refusal's folder is durable and before the inbox name goes."""

    def dies(src: Path, kept: Path) -> bool:
        raise Cut

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(refusals, "_take_name", dies)
        with pytest.raises(Cut):
            refuse(layout, Refusal("junk.txt", "not a work order", inode=judged), "vm-dead")
    first, second = _ledger(env, "vm-a"), _ledger(env, "vm-b")
    try:
        _both_at_once(layout, first, second)
    finally:
        first.close()
        second.close()
    assert os.listdir(layout.staging) == []
    assert not junk.exists()
    [folder] = os.listdir(layout.root / "failed")
    kept = [p for p in (layout.root / "failed" / folder).iterdir() if p.name.startswith("order")]
    assert [p.read_bytes() for p in kept] == [b"not an order\n"]


def test_a_join_landing_cut_short_landed_by_two_daemons_at_once_lands_once(env: Env) -> None:
    """A join failed in waiting/ whose move into failed/ was cut short: the daemon that finds it landed by the
    other one goes on (it stopped with FileNotFoundError, at start with exit 1)."""
    env.configure(join_agents(env))
    env.drop(order("P", to="bad"))
    assert env.cli("run", "--once").returncode == 1
    env.drop(merger("J", after=["P"]))
    run_once_killed_at(env, "finish.recorded")
    layout = Layout(env.root)
    assert (layout.root / "waiting" / "J").is_dir()
    cfg = load_config(env.config_path)
    first, second = _ledger(env, "vm-a"), _ledger(env, "vm-b")
    try:
        assert first.get("J").state == Row.FAILED
        mine = Joins(layout, first, None, lambda: cfg)  # type: ignore[arg-type]
        other = Joins(layout, second, None, lambda: cfg)  # type: ignore[arg-type]
        read = first.get

        def get(job_id: str) -> Any:  # the first daemon has read J's row: the second's whole pass runs now
            entry = read(job_id)
            if job_id == "J":
                other.recover(second.alive)
            return entry

        first.get = get
        mine.recover(first.alive)
    finally:
        first.close()
        second.close()
    assert os.listdir(layout.root / "waiting") == []
    result = json.loads((layout.root / "failed" / "J" / "result.json").read_text())
    assert result["reason"] == "after: P failed"
    assert sorted(os.listdir(layout.root / "failed")) == ["J", "P"]


def test_a_followup_a_dead_daemon_linked_in_and_another_claimed_is_not_released_twice(env: Env) -> None:
    """A dead daemon linked a follow-up into inbox/ but did not record it; a live daemon takes the release's turn,
    and before it links its copy another daemon claims and runs the first one: no second copy is left in inbox/
    (it was refused as a known id into failed/, and `run --once` exited 1)."""
    follow = json.dumps(order("F", **{"from": "parent"}))
    env.configure({"worker": env.agent(), "parent": env.agent("--followup", follow)})
    env.drop(order("P", to="parent"))
    run_once_killed_at(env, "followup.placed")
    layout = Layout(env.root)
    assert os.listdir(layout.inbox) == ["F.json"] and (layout.root / "done" / "P").is_dir()
    releasing = _ledger(env, "vm-a")
    take = releasing.take_release
    others: list[int] = []

    def taken(job_id: str, digest: str, who: str) -> bool:
        ok = take(job_id, digest, who)
        if ok and not others:  # the turn is this daemon's: another daemon claims and runs the file in inbox/ now
            others.append(env.cli("run", "--once").returncode)
        return ok

    releasing.take_release = taken
    try:
        assert release_followups(layout, releasing, "P") == 0
    finally:
        releasing.close()
    assert others == [0]
    assert os.listdir(layout.inbox) == []
    assert env.cli("run", "--once").returncode == 0
    assert sorted(os.listdir(layout.root / "done")) == ["F", "P"] and os.listdir(layout.root / "failed") == []
    assert [s for s in env.starts() if s[0] == "F"] == [("F", 1)]


def _join_past_max_wait(env: Env) -> tuple[Layout, Any, Joins, Wait]:
    """A root whose parent P is queued in inbox/, and the wait of a join on P begun long before max_wait."""
    env.configure(join_agents(env), max_wait=1)
    assert env.cli("run", "--once").returncode == 0
    layout = Layout(env.root)
    cfg = load_config(env.config_path)
    ledger = _ledger(env, "vm-a")
    return layout, ledger, Joins(layout, ledger, None, lambda: cfg), Wait("J", ("P",), ALL_DONE, time.time() - 100)  # type: ignore[arg-type]


def test_a_join_past_max_wait_whose_parent_another_daemon_claims_meanwhile_waits_for_it(env: Env) -> None:
    """The join's daemon finds no row for P; before it looks in inbox/, another daemon claims P (its row written,
    its inbox name gone): P was queued all along and is now running, so the join waits (it failed with
    `after: P never finished`)."""
    _, ledger, joins, wait = _join_past_max_wait(env)
    parent = env.drop(order("P"))
    other = _ledger(env, "vm-b")
    known = ledger.known

    def claimed_after_the_read(ids: Any) -> Any:
        rows = known(ids)
        if "P" in list(ids) and parent.exists():  # the other daemon's claim, between this read and the inbox look
            [answer] = other.claim([ClaimRequest("P", "worker", parent.name, "x")])
            assert answer.token is not None
            parent.unlink()
        return rows

    ledger.known = claimed_after_the_read
    try:
        assert joins._decide(wait, time.time(), 1.0) is WAIT
    finally:
        ledger.close()
        other.close()


def test_a_join_past_max_wait_whose_parent_is_released_from_held_between_the_looks_waits_for_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's order is in held/; a `release` renames it into inbox/ after the join's daemon looked in inbox/ and before
    it looks in held/: P was queued all along, so the join waits (it failed with `after: P never finished`)."""
    layout, ledger, joins, wait = _join_past_max_wait(env)
    layout.held.mkdir(exist_ok=True)
    held = env.drop(order("P"), name="P.json")
    os.rename(held, layout.held / "P.json")
    looks: list[Path] = []
    find = joins_module.find_queued

    def released_between(folder: Path, ids: Any) -> Any:
        looks.append(folder)
        found = find(folder, ids)
        if folder == layout.inbox and len(looks) == 1:  # the release, right after the first look in inbox/
            os.rename(layout.held / "P.json", layout.inbox / "P.json")
        return found

    monkeypatch.setattr(joins_module, "find_queued", released_between)
    try:
        assert joins._decide(wait, time.time(), 1.0) is WAIT
    finally:
        ledger.close()
