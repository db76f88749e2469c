"""Power cuts: the daemon on a filesystem that keeps only what was fsynced (tests/powercut/lazyfs.py).

The first tests prove the test filesystem itself: data without its file's fsync and
names without their folder's fsync are gone after a cut, gently (any fsync commits every
name) or strictly (per folder), and SQLite's WAL works on it. Then the daemon runs a
workload of plain, retry-safe, review, handing-off, flaky and slow agents with an
operator who approves, retries and cancels; the power is cut at each cut point, the
durable state is written back, `run --once` recovers it, and every promise of the README's
Guarantees is checked (tests/powercut/harness.py, `broken_promises`). The default run has
the short list of cut points; `pytest --powercut-long` runs every one in both modes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from powercut.harness import FAKE_AGENT, CutPoint, LazyMount, Trial, broken_promises, cut_points, fsync_path, report

GENTLE_SHORT = {"claim", "finish", "followup", "review"}  # the gentle mode's share of the short run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cut" not in metafunc.fixturenames:
        return
    long = bool(metafunc.config.getoption("--powercut-long"))
    params = []
    for mode in ("strict", "gentle"):
        for point in cut_points(long):
            if mode == "gentle" and not long and (point.phase not in GENTLE_SHORT or point.after != 0):
                continue
            params.append(pytest.param((mode, point), id=f"{mode}-{point.name}"))
    metafunc.parametrize("cut", params)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[LazyMount]:
    """A strict lazyfs mount on tmp_path/mnt over tmp_path/backing."""
    fs = LazyMount(tmp_path / "backing", tmp_path / "mnt", "strict")
    fs.start()
    yield fs
    fs.unmount()


def gentle(tmp_path: Path) -> LazyMount:
    fs = LazyMount(tmp_path / "gbacking", tmp_path / "gmnt", "gentle")
    fs.start()
    return fs


def write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def after_cut(fs: LazyMount, dest: Path) -> Path:
    """Cut the power and return the folder holding what survived."""
    fs.cmd(cmd="cut")
    fs.cmd(cmd="dump", dest=str(dest))
    return dest


def tree(root: Path) -> dict[str, bytes | None]:
    """Map each path under root to its bytes (None for a folder)."""
    out: dict[str, bytes | None] = {}
    for here, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), root)] = None
        for f in files:
            out[os.path.relpath(os.path.join(here, f), root)] = Path(here, f).read_bytes()
    return out


def test_lazyfs_strict_keeps_only_fsynced_data_and_fsynced_names(mount: LazyMount, tmp_path: Path) -> None:
    """Strict mode: a name needs its folder's fsync, data its file's; a durable name without synced data is empty."""
    m = mount.mountpoint
    (m / "d").mkdir()
    fsync_path(m)
    write_synced(m / "d" / "synced", b"kept")
    (m / "d" / "unsynced").write_bytes(b"lost")
    write_synced(m / "d" / "tmp", b"renamed")
    fsync_path(m / "d")
    (m / "d" / "late").write_bytes(b"name never synced")
    os.rename(m / "d" / "tmp", m / "renamed")  # the rename reaches disk only with a folder fsync
    (m / "e").mkdir()  # never synced in its parent
    got = tree(after_cut(mount, tmp_path / "out"))
    assert got == {"d": None, "d/synced": b"kept", "d/unsynced": b"", "d/tmp": b"renamed"}, got


def test_lazyfs_strict_keeps_hard_links_and_refuses_to_replace_with_noreplace(mount: LazyMount, tmp_path: Path) -> None:
    """Two durable names of one file come back hard-linked; RENAME_NOREPLACE onto an existing name fails."""
    from dispatcher.fsutil import rename_noreplace

    m = mount.mountpoint
    write_synced(m / "a", b"one")
    os.link(m / "a", m / "b")
    assert os.stat(m / "a").st_ino == os.stat(m / "b").st_ino
    (m / "c").write_bytes(b"other")
    with pytest.raises(FileExistsError):
        rename_noreplace(m / "c", m / "a")
    assert (m / "a").read_bytes() == b"one"
    fsync_path(m)
    out = after_cut(mount, tmp_path / "out")
    assert os.stat(out / "a").st_ino == os.stat(out / "b").st_ino
    assert (out / "b").read_bytes() == b"one"
    with pytest.raises(OSError):
        (m / "after").write_bytes(b"x")  # frozen: nothing more reaches the disk


def test_lazyfs_gentle_commits_every_name_on_any_fsync(tmp_path: Path) -> None:
    """Gentle mode: one file's fsync makes every folder's names durable; other files' data still comes back empty."""
    fs = gentle(tmp_path)
    try:
        m = fs.mountpoint
        (m / "d").mkdir()
        (m / "d" / "unsynced").write_bytes(b"lost")
        write_synced(m / "synced", b"kept")
        got = tree(after_cut(fs, tmp_path / "out"))
    finally:
        fs.unmount()
    assert got == {"d": None, "d/unsynced": b"", "synced": b"kept"}, got


def test_sqlite_wal_works_on_lazyfs_and_keeps_commits_across_a_cut(mount: LazyMount, tmp_path: Path) -> None:
    """SQLite in WAL mode (two connections, synchronous=FULL) runs on the mount; committed rows survive a cut."""
    db = mount.mountpoint / "t.db"
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE t (x INTEGER)")
    con.commit()
    fsync_path(mount.mountpoint)  # the database's and the WAL's names
    for i in range(50):
        con.execute("INSERT INTO t VALUES (?)", (i,))
        con.commit()
    other = sqlite3.connect(db)
    assert other.execute("SELECT count(*) FROM t").fetchone() == (50,)
    other.close()
    con.execute("INSERT INTO t VALUES (999)")  # not committed
    out = after_cut(mount, tmp_path / "out")
    con.close()
    back = sqlite3.connect(out / "t.db")
    assert back.execute("SELECT count(*), max(x) FROM t").fetchone() == (50, 49)
    back.close()


def test_sqlite_ledger_runs_on_lazyfs_only_when_it_is_vouched_local(mount: LazyMount, tmp_path: Path) -> None:
    """DISPATCHER_LOCAL_FUSE=lazyfs lets the SQLite ledger use the mount; without it the root is a network one."""
    root = mount.mountpoint / "dispatch"
    root.mkdir()
    cfg = tmp_path / "dispatcher.yaml"
    agent = {"command": [sys.executable, str(FAKE_AGENT)], "timeout": 30, "writes": ["out.csv"]}
    cfg.write_text(json.dumps({"root": str(root), "agents": {"worker": agent}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCHER_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    argv = [sys.executable, "-m", "dispatcher", "--config", str(cfg), "run", "--once"]
    refused = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and "network filesystem (FUSE)" in refused.stderr, refused.stderr
    allowed = subprocess.run(argv, capture_output=True, text=True, env=env | {"DISPATCHER_LOCAL_FUSE": "x,lazyfs"})
    assert allowed.returncode == 0, allowed.stderr
    assert (root / ".state" / "ledger.sqlite3").exists()


def test_power_cut(cut: tuple[str, CutPoint], tmp_path: Path) -> None:
    """After a power cut at this point and a recovery, every job and follow-up keeps every promise of the Guarantees."""
    mode, point = cut
    trial = Trial(tmp_path / "trial", point, mode)
    trial.run()
    broken = broken_promises(trial)
    assert trial.cut_reached, report(trial, broken)
    assert not broken, report(trial, broken)
