"""Where the root lives (``dispatcher.storage``), and a daemon whose root is on tmpfs.

On a filesystem held in memory a job with a small work/ does its post-exit file work on
the loop (no trip to the io pool); everything a user sees is the same as on a disk.
``stat -f -c %T`` (coreutils) is the independent judge of a path's filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Env, order

from dispatcher import storage

SHM = Path("/dev/shm")

MOUNTINFO = "\n".join(
    [
        "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
        "30 22 0:26 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw",
        "31 22 0:27 / /mnt/a rw shared:6 - xfs /dev/vdb rw",
        "32 22 0:28 / /mnt/a\\040b rw shared:7 - tmpfs none rw",
        "33 31 0:29 / /mnt/a/deep rw shared:8 master:2 - ramfs none rw",
        # a tmpfs with a tmpfs under it, then an ext4 mounted over both: /srv/data is hidden
        "40 22 0:40 / /srv rw - tmpfs none rw",
        "41 40 0:41 / /srv/data rw - tmpfs none rw",
        "42 40 252:2 / /srv rw - ext4 /dev/vdc rw",
        "garbage line",
        "50 22 0:50 / /odd\\9zz rw - tmpfs none rw",
        "51 22 0:51 / /broken rw -",
    ]
)


@pytest.mark.parametrize(
    ("path", "dev", "kind"),
    [
        ("/", "252:1", "ext4"),
        ("/home/me/dispatch", "252:1", "ext4"),
        ("/dev/shm", "0:26", "tmpfs"),
        ("/dev/shm/dispatch/inbox", "0:26", "tmpfs"),
        ("/mnt/a b/dispatch", "0:28", "tmpfs"),  # mountinfo writes a space as \040
        ("/mnt/a/deep/x", "0:29", "ramfs"),
        ("/srv/data/dispatch", "252:2", "ext4"),  # the device decides: the tmpfs there is hidden
        ("/odd\\9zz/x", "0:50", "tmpfs"),  # not an octal escape: kept as written
        # no line has the device (a btrfs subvolume): the longest mount point, the last of equals
        ("/dev/shmx/dispatch", None, "ext4"),  # a sibling whose name starts the same is not inside
        ("/mnt/a/deep/x", None, "ramfs"),
        ("/mnt/a/x", "9:9", "xfs"),
        ("/srv/x", None, "ext4"),  # mounted over /srv later: the later line wins
    ],
)
def test_the_filesystem_of_a_path_is_its_devices_mount(path: str, dev: str | None, kind: str) -> None:
    assert storage.filesystem_of(path, MOUNTINFO, dev) == kind


def stat_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True).stdout


def test_in_memory_agrees_with_stat_f(tmp_path: Path) -> None:
    for path in (SHM, tmp_path, Path("/")):
        assert storage.in_memory(path) == (stat_type(path).strip() in {"tmpfs", "ramfs"}), path
    assert storage.in_memory(SHM), "these tests need /dev/shm on tmpfs, as on Linux and in CI containers"


def test_a_small_folder_holds_only_small_regular_files(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "order.json").write_text("{}")
    (work / "out.csv").write_bytes(b"x" * 1000)
    assert storage.small_folder(str(work))
    (work / "big.bin").write_bytes(b"x" * storage.SMALL_FOLDER_BYTES)
    assert not storage.small_folder(str(work)), "over 1 MiB in all"
    (work / "big.bin").unlink()
    (work / "outbox").mkdir()
    assert not storage.small_folder(str(work)), "a subfolder (outbox/ asks the ledger)"
    (work / "outbox").rmdir()
    os.symlink("/etc/passwd", work / "link")
    assert not storage.small_folder(str(work)), "a link"
    (work / "link").unlink()
    for i in range(storage.SMALL_FOLDER_ENTRIES):
        (work / f"f{i}").write_text("")
    assert not storage.small_folder(str(work)), "too many entries"
    assert not storage.small_folder(str(tmp_path / "missing"))


def env_in(top: Path) -> Env:
    """An Env with its root and config in top (conftest's ``env`` fixture keeps them in tmp_path)."""
    e = Env(tmp=top, root=top / "dispatch", config_path=top / "dispatcher.yaml", count_file=top / "starts.txt")
    e.configure()
    return e


@pytest.fixture
def shm_env() -> Iterator[Env]:
    """An Env whose root and config live on /dev/shm (tmpfs)."""
    top = Path(tempfile.mkdtemp(prefix="dispatcher-test-", dir=SHM))
    e = env_in(top)
    try:
        yield e
    finally:
        from helpers_faults import reap

        reap(e)
        shutil.rmtree(top, ignore_errors=True)


def events(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_root_on_tmpfs_runs_jobs_as_on_a_disk(shm_env: Env) -> None:
    """Passed, failed, a follow-up (an outbox/: the io pool) and a repeated id: each ends as it would on a disk."""
    e = shm_env
    e.configure(
        {
            "worker": e.agent(),
            "broken": e.agent("--missing-row"),
            "parent": e.agent("--followup", json.dumps(order("KID-1", **{"from": "parent"}))),
        }
    )
    e.drop(order("OK-1"))
    e.drop(order("BAD-1", to="broken"))
    e.drop(order("PARENT-1", to="parent"))
    proc = e.cli("run", "--once")
    assert proc.returncode == 1, proc.stderr  # BAD-1 failed
    started = next(x for x in events(proc.stdout) if x["event"] == "daemon.started")
    assert started["files"] == "memory"
    ok = e.wait_job("OK-1", "done")
    assert ok["state"] == "done" and all(c["ok"] is not False for c in ok["checks"])
    bad = e.wait_job("BAD-1", "failed")
    assert any(c["ok"] is False for c in bad["checks"]), bad
    assert e.wait_job("PARENT-1", "done")["state"] == "done"
    assert e.wait_job("KID-1", "done")["state"] == "done"
    # the ledger still refuses an id it has seen, before any agent runs
    starts = len(e.starts())
    e.drop(order("OK-1"), name="OK-1-again.json")
    assert e.cli("run", "--once").returncode == 1  # a refused file
    assert "already" in e.wait_refused("OK-1-again")["reason"]
    assert len(e.starts()) == starts


def on_disk(tmp_path: Path) -> Path:
    """Return a fresh folder on a disk: tmp_path, else under /var/tmp, else beside this file."""
    for parent in (tmp_path, Path("/var/tmp"), Path(__file__).parent):
        if parent.is_dir() and not storage.in_memory(parent):
            return Path(tempfile.mkdtemp(prefix="dispatcher-disk-", dir=parent))
    pytest.fail("no folder on a disk to test with: tmp_path, /var/tmp and tests/ are all held in memory")


def test_a_root_on_disk_says_so(tmp_path: Path) -> None:
    top = on_disk(tmp_path)
    try:
        e = env_in(top)
        e.drop(order("DISK-1"))
        proc = e.cli("run", "--once", check=True)
        started = next(x for x in events(proc.stdout) if x["event"] == "daemon.started")
        assert started["files"] == "disk"
        assert e.wait_job("DISK-1", "done")["state"] == "done"
    finally:
        shutil.rmtree(top, ignore_errors=True)
