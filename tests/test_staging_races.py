"""Two live daemons finish the same dead daemon's staging folder at once (contract section 1: exactly once).

Each live daemon lists ``.state/staging/`` at its rescan and finishes the folders of dead
daemons. Two of them may pick the same folder in the same moment. These tests put the
second daemon's whole pass inside the first one's, at the point where the first has just
learnt that the folder's owner is dead: the first then finds the folder gone, goes on,
and the job is claimed, run or refused once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order

from dispatcher.job.recovery import finish_staging
from dispatcher.layout import Layout
from dispatcher.ledger.base import ClaimRequest, DaemonInfo
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
