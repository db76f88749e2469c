"""Opening the SQLite ledger of a fresh root while other daemons make it (contract sections 12 and 13).

A ledger missing while job folders exist was lost: every command and daemon refuses it
with one line naming `dispatcher ledger rebuild`. Daemons that start together on a fresh
root must not take each other's young ledger for a lost one.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Env

from dispatcher.layout import Layout
from dispatcher.ledger import sqlite
from dispatcher.lifecycle import State
from dispatcher.spec.config import load_config
from dispatcher.store.ledgers import LedgerLost, open_ledger


def test_a_ledger_another_daemon_makes_meanwhile_is_not_taken_for_a_lost_one(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One daemon finds no ledger file; while it opens it, another makes the ledger and claims its first order
    into active/. That daemon starts (it exited 2: "the ledger is empty but job folders exist")."""
    cfg = load_config(env.config_path)
    layout = Layout(cfg.root)
    layout.create()
    assert not layout.ledger.exists()
    real = sqlite.SqliteLedger

    def another_daemon_first(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs).close()  # the other daemon makes the ledger...
        (layout.folder(State.ACTIVE) / "FIRST").mkdir()  # ...and claims its first order
        return real(*args, **kwargs)

    monkeypatch.setattr(sqlite, "SqliteLedger", another_daemon_first)
    ledger = open_ledger(cfg, layout)
    ledger.close()


def test_a_ledger_missing_beside_job_folders_is_still_refused(env: Env) -> None:
    """The reordered look (folders first, then the file) still refuses a ledger that is gone for real."""
    cfg = load_config(env.config_path)
    layout = Layout(cfg.root)
    layout.create()
    (layout.folder(State.DONE) / "OLD").mkdir()
    with pytest.raises(LedgerLost, match="the ledger is missing but job folders exist"):
        open_ledger(cfg, layout)
