"""Reading commands need no write access: a member of the service's group reads a root it cannot write.

The root is made by root (the daemon runs as root here, umask 027) in a folder whose
group is `nogroup` with the setgid bit, so every file the daemon makes is readable by
that group and writable by nobody else. `status`, `list` and `show` then run as the
user `nobody` (whose group is `nogroup`), while the daemon runs and after it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Env, order, wait_until
from helpers_faults import reap
from helpers_users import GROUP, USER, as_user, interpreter

pytest_plugins = ["pg_fixtures"]


def _reachable_env(tmp_path: Path) -> Env:
    """Return an Env whose root lies in a new folder under /tmp that every user may pass through."""
    assert shutil.which("runuser"), "runuser not found: install util-linux"
    base = Path(tempfile.mkdtemp(prefix="readers-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the reader must reach the root
    root = base / "dispatch"
    root.mkdir()
    return Env(tmp=base, root=root, config_path=base / "dispatcher.yaml", count_file=tmp_path / "starts.txt")


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Env]:
    """A root in a world-traversable folder, group nogroup (setgid), with its config readable by that group."""
    e = _reachable_env(tmp_path)
    shutil.chown(e.root, group=GROUP)
    os.chmod(e.root, 0o2750)  # noqa: S103 - setgid: the daemon's files get the group
    e.configure()
    shutil.chown(e.config_path, group=GROUP)
    os.chmod(e.config_path, 0o640)
    yield e
    reap(e)
    shutil.rmtree(e.tmp, ignore_errors=True)


def _as_reader(env: Env, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = as_user(python, "--config", str(env.config_path), *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=env.tmp)


def test_a_group_member_reads_status_list_and_show_without_write_access(shared: Env) -> None:
    """status, list and show work as a group member who cannot write the root, daemon running or stopped."""
    python = interpreter()
    d = shared.daemon()
    d.wait_ready()
    shared.drop(order("READ-1"))
    shared.wait_job("READ-1", "done")

    for running in (True, False):
        status = _as_reader(shared, python, "status", "--json")
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["counts"]["done"] == 1
        assert [dm["alive"] for dm in info["daemons"]] == [running]
        listed = _as_reader(shared, python, "list")
        assert listed.returncode == 0 and "READ-1" in listed.stdout and "done" in listed.stdout, listed.stderr
        shown = _as_reader(shared, python, "show", "READ-1")
        assert shown.returncode == 0 and shown.stdout.startswith("READ-1  done"), shown.stderr
        if running:
            assert d.stop() == 0
    touch = ["runuser", "-u", USER, "--", "touch", str(shared.root / "inbox" / "x")]
    write = subprocess.run(touch, capture_output=True)
    assert write.returncode != 0  # the reader really has no write access


def test_a_postgresql_role_with_select_only_reads_status_list_and_show(env: Env, pg_server: Any, pg_db: str) -> None:
    """On a shared ledger reading needs SELECT alone: nothing is created or written; a fresh ledger reads empty."""
    import secrets

    import psycopg

    reader, password = f"reader_{secrets.token_hex(4)}", secrets.token_hex(8)
    database = pg_db.rsplit("/", 1)[1]
    pg_server._sql(f"CREATE ROLE {reader} LOGIN PASSWORD '{password}'")
    reader_url = pg_db.replace(pg_db.split("//", 1)[1].split("@", 1)[0], f"{reader}:{password}")
    env.configure(ledger=reader_url)
    fresh = env.cli("status", "--json")  # no daemon has made the ledger yet: it reads as empty, creates nothing
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["daemons"] == []
    with psycopg.connect(pg_db) as conn:
        assert conn.execute("SELECT to_regclass('jobs')").fetchone() == (None,)
    env.configure(ledger=pg_db)
    env.drop(order("PGR-1"))
    assert env.cli("run", "--once").returncode == 0
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader}")
    env.configure(ledger=reader_url)
    status = env.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counts"]["done"] == 1
    listed = env.cli("list")
    assert listed.returncode == 0 and "PGR-1" in listed.stdout, listed.stderr
    shown = env.cli("show", "PGR-1")
    assert shown.returncode == 0 and shown.stdout.startswith("PGR-1  done"), shown.stderr
    assert database  # the reader's URL names the same database


def test_logs_of_a_file_the_reader_cannot_read_is_one_line_not_a_traceback(shared: Env) -> None:
    """`logs FILE` and `logs` of a log_file the user may not read: one line naming the file, exit 1."""
    private = shared.tmp / "private.log"
    private.write_text('{"event": "x"}\n')
    os.chmod(private, 0o600)
    body = yaml.safe_load(shared.config_path.read_text()) | {"log_file": str(private)}
    shared.config_path.write_text(yaml.safe_dump(body))
    for args in (("logs", str(private)), ("logs",)):
        got = _as_reader(shared, interpreter(), *args)
        assert got.returncode == 1, (args, got.returncode, got.stderr)
        assert got.stderr.count("\n") == 1 and "Traceback" not in got.stderr, got.stderr
        assert str(private) in got.stderr and "Permission denied" in got.stderr, got.stderr


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Env]:
    """A root of root's own group made readable by all (`chmod -R o+rX`) before a daemon starts on it."""
    e = _reachable_env(tmp_path)
    e.configure({"worker": e.agent("--sleep", "30")}, kill_grace=0.5)
    os.chmod(e.config_path, 0o644)
    yield e
    reap(e)
    shutil.rmtree(e.tmp, ignore_errors=True)


def test_status_of_a_reader_who_cannot_open_the_daemons_lock_tells_by_its_process(world: Env) -> None:
    """A daemon's lock and info closed to the reader (640, made after `chmod -R o+rX`): status tells by its process."""
    python = interpreter()
    assert world.cli("run", "--once").returncode == 0  # the ledger exists before the root is opened to all
    subprocess.run(["chmod", "-R", "o+rX", str(world.root)], check=True)
    d = world.daemon()
    d.wait_ready()
    assert d.proc is not None
    lock = next((world.root / ".state" / "daemons").glob(f"*-{d.proc.pid}-*.lock"))
    assert lock.stat().st_mode & 0o004 == 0  # closed to the reader
    for running in (False, True):
        if running:
            world.drop(order("SLOW-1"))
            wait_until(lambda: world.starts(), what="the job running")
        status = _as_reader(world, python, "status", "--json")
        assert status.returncode == 0 and status.stderr == "", status.stderr
        info = json.loads(status.stdout)
        mine = [dm for dm in info["daemons"] if dm["pid"] == d.proc.pid]
        assert [dm["alive"] for dm in mine] == [True], info["daemons"]
        assert [a["daemon_alive"] for a in info["active"]] == ([True] if running else [])
        text = _as_reader(world, python, "status")
        assert text.returncode == 0 and "no daemon is running" not in text.stdout, text.stdout + text.stderr
        assert f"running  pid {d.proc.pid}" in text.stdout, text.stdout
    assert d.stop() == 0
    info = json.loads(_as_reader(world, python, "status", "--json").stdout)
    assert [dm["alive"] for dm in info["daemons"] if dm["pid"] == d.proc.pid] == [False]
    assert "no daemon is running" in _as_reader(world, python, "status").stdout


def test_a_user_who_may_not_read_the_ledger_gets_one_line_not_a_traceback(shared: Env) -> None:
    """The root is reachable but its .state/ is not: `status`, `list`, `show` and `retry` each say so in one line
    naming the file, never with a traceback."""
    shared.drop(order("PRIV-1"))
    assert shared.cli("run", "--once", timeout=60).returncode == 0
    os.chmod(shared.root / ".state", 0o700)  # as a root made before the group was given: .state/ out of reach
    for args in (("status",), ("list",), ("show", "PRIV-1"), ("retry", "PRIV-1")):
        got = _as_reader(shared, interpreter(), *args)
        assert got.returncode == 1, (args, got.returncode, got.stderr)
        assert got.stderr.count("\n") == 1 and "Traceback" not in got.stderr, (args, got.stderr)
        assert "ledger.sqlite3: Permission denied" in got.stderr, (args, got.stderr)
