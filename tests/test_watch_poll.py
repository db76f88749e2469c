"""Roots on shared filesystems: `watch: poll`, and the SQLite ledger refusing a network filesystem.

A FUSE mount (bindfs, from the system packages) stands for a network filesystem: it
has FUSE's statfs magic number, as sshfs and other network FUSE mounts do.
"""

from __future__ import annotations

import json
import shutil
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
    finally:
        subprocess.run(["fusermount", "-u", str(mounted)], check=False)
        subprocess.run(["umount", "-l", str(mounted)], check=False)
