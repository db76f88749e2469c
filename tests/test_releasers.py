"""Who may take over a follow-up's release turn (``releasers.holder_gone``), against real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import time

from dispatcher import procs
from dispatcher.ledger.releasers import COMMAND, RELEASE_GRACE_S, holder_gone, releaser


def _command_id(pid: int) -> str:
    fields = procs.stat_fields(pid)
    assert fields is not None
    return f"{COMMAND}{socket.gethostname()}:{pid}:{fields[19]}"


def test_a_daemon_holder_is_gone_when_the_ledger_says_it_is_not_alive() -> None:
    now = time.time()
    assert holder_gone("vm-1-abc", lambda owner: False, now, now) is True
    assert holder_gone("vm-1-abc", lambda owner: True, now - 3600, now) is False  # alive: no grace applies


def test_a_command_on_this_host_is_gone_when_its_process_ended() -> None:
    with subprocess.Popen(["sleep", "30"]) as child:
        holder = _command_id(child.pid)
        now = time.time()
        assert holder_gone(holder, lambda owner: True, now - 3600, now) is False
        child.kill()
        child.wait()
    assert holder_gone(holder, lambda owner: True, time.time(), time.time()) is True


def test_a_command_whose_pid_was_reused_is_gone() -> None:
    with subprocess.Popen(["sleep", "30"]) as child:
        pid, ticks = child.pid, _command_id(child.pid).rsplit(":", 1)[1]
        holder = f"{COMMAND}{socket.gethostname()}:{pid}:{int(ticks) - 100}"  # same pid, another start
        assert holder_gone(holder, lambda owner: True, time.time(), time.time()) is True
        child.kill()


def test_a_command_on_another_host_keeps_its_turn_for_the_grace() -> None:
    holder = f"{COMMAND}elsewhere.example:4242:123"
    now = time.time()
    assert holder_gone(holder, lambda owner: False, now - RELEASE_GRACE_S + 5, now) is False
    assert holder_gone(holder, lambda owner: False, now - RELEASE_GRACE_S - 1, now) is True


def test_a_daemon_releases_under_its_owner_id_and_a_command_under_its_own() -> None:
    assert releaser("vm-1-abc") == "vm-1-abc"
    mine = releaser("")
    assert mine == _command_id(os.getpid())
    assert holder_gone(mine, lambda owner: False, time.time(), time.time()) is False  # this very process
