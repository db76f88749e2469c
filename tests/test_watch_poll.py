"""Roots on shared filesystems: `watch: poll`, and the SQLite ledger refusing a network filesystem.

A FUSE mount (bindfs, from the system packages) stands for a network filesystem: it
has FUSE's statfs magic number, as sshfs and other network FUSE mounts do.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest
from conftest import Env, order


def test_watch_poll_finds_files_by_listing(env: Env) -> None:
    """With watch: poll (no inotify), files dropped and written in place are found by listing inbox/."""
    env.configure(watch="poll", poll_interval=0.2, settle=0.3)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("POLL-1"))
    (env.root / "inbox" / "POLL-2.json").write_text(json.dumps(order("POLL-2")))
    env.wait_job("POLL-1", "done", timeout=30)
    env.wait_job("POLL-2", "done", timeout=30)
    assert d.stop() == 0


def test_sqlite_ledger_refuses_a_network_filesystem(env: Env) -> None:
    """A root on a FUSE mount: `run` exits 2 with one line saying to use the PostgreSQL ledger."""
    if shutil.which("bindfs") is None:
        pytest.fail("bindfs is needed (Debian package bindfs; .ci/run installs it)")
    source, mounted = env.tmp / "src", env.tmp / "fuse"
    source.mkdir()
    mounted.mkdir()
    subprocess.run(["bindfs", str(source), str(mounted)], check=True)
    try:
        root = mounted / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(root=str(root))
        proc = env.cli("run", "--once")
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "network filesystem (FUSE)" in proc.stderr
        assert "postgresql" in proc.stderr
        # nor does `ledger rebuild` make one there (a job folder copied in, as after a move): the same line
        job = root / "done" / "MOVED-1"
        job.mkdir(parents=True)
        (job / "result.json").write_text(json.dumps({"job_id": "MOVED-1", "state": "done"}))
        rebuilt = env.cli("ledger", "rebuild")
        assert rebuilt.returncode == 2 and rebuilt.stderr.count("\n") == 1, rebuilt.stderr
        assert "network filesystem (FUSE)" in rebuilt.stderr and "postgresql" in rebuilt.stderr
        assert not (root / ".state" / "ledger.sqlite3").exists()
    finally:
        subprocess.run(["fusermount", "-u", str(mounted)], check=False)
        subprocess.run(["umount", "-l", str(mounted)], check=False)


def test_a_reloaded_poll_interval_and_watch_take_effect_at_once(env: Env) -> None:
    """A reload that shortens poll_interval is followed at once, not at the old listing's time; one that turns
    `watch: poll` into inotify watches from then on (`watcher.changed`, no error line), and back again."""
    env.configure(watch="poll", poll_interval=600, rescan_interval=600, settle=0.3)
    d = env.daemon()
    d.wait_ready()
    env.configure(watch="poll", poll_interval=0.2, rescan_interval=600, settle=0.3)
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(order("POLL-FAST"))
    env.wait_job("POLL-FAST", "done", timeout=30)  # the old interval would list inbox/ again in ten minutes
    env.configure(watch="inotify", poll_interval=600, rescan_interval=600, settle=0.3)
    d.signal(signal.SIGHUP)
    assert d.wait_event("watcher.changed", watch="inotify")["level"] == "info"
    env.drop(order("WATCHED"))
    env.wait_job("WATCHED", "done", timeout=30)
    env.configure(watch="poll", poll_interval=0.2, rescan_interval=600, settle=0.3)
    d.signal(signal.SIGHUP)
    d.wait_event("watcher.changed", watch="poll")
    env.drop(order("POLLED-AGAIN"))
    env.wait_job("POLLED-AGAIN", "done", timeout=30)
    assert not [e for e in d.events() if e["level"] == "error"]
    assert d.stop() == 0
