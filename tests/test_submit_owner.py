"""`submit` hands the dropped file to inbox/'s owner: a root submit is readable by a daemon that runs as its user."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FAKE_AGENT, Env, order, wait_until
from helpers_users import GROUP, USER, as_user, interpreter, user_path


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Env, str]]:
    """A root owned by the service user (nobody) in a world-traversable folder; (env, its python)."""
    python = interpreter()
    base = Path(tempfile.mkdtemp(prefix="owner-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the service user must reach the root
    data = base / "agent"
    data.mkdir()
    shutil.chown(data, USER, GROUP)
    e = Env(tmp=base, root=base / "dispatch", config_path=base / "dispatcher.yaml", count_file=data / "starts.txt")
    agent = e.agent()
    agent["command"] = [python, str(user_path(FAKE_AGENT)), "--count", str(e.count_file)]
    e.configure({"worker": agent})
    shutil.chown(e.root, USER, GROUP)
    os.chmod(e.config_path, 0o644)
    yield e, python
    shutil.rmtree(base, ignore_errors=True)


def test_a_file_submitted_by_root_is_run_by_a_daemon_running_as_the_service_user(service: tuple[Env, str]) -> None:
    """As root, `submit` gives the file inbox/'s owner and group; the daemon (as nobody) runs the job to done."""
    env, python = service
    init = subprocess.run(as_user(python, "--config", str(env.config_path), "init"), capture_output=True, text=True)
    assert init.returncode == 0, init.stderr
    log = (env.tmp / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        as_user(python, "--config", str(env.config_path), "run"), stdout=log, stderr=subprocess.STDOUT, cwd=env.tmp
    )
    try:
        wait_until(lambda: b"daemon.ready" in (env.tmp / "daemon.log").read_bytes(), what="the daemon to be ready")
        (env.tmp / "o.json").write_text(json.dumps(order("ROOT-1")))
        os.chmod(env.tmp / "o.json", 0o600)  # root's own file, as an editor would leave it
        sub = env.cli("submit", str(env.tmp / "o.json"))
        assert sub.returncode == 0 and sub.stdout == "ROOT-1\n", sub.stderr
        wait_until(lambda: (env.root / "done" / "ROOT-1").exists() or env.refusals(), what="ROOT-1 to finish")
        assert (env.root / "done" / "ROOT-1" / "result.json").exists(), (env.tmp / "daemon.log").read_text()[-2000:]
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()


def test_a_first_submit_by_root_leaves_the_root_to_its_service_user(service: tuple[Env, str]) -> None:
    """Root submits before any daemon ran: inbox/, .state/ and the new ledger get the root's owner; the job runs."""
    env, python = service
    (env.tmp / "o.json").write_text(json.dumps(order("FIRST-1")))
    sub = env.cli("submit", str(env.tmp / "o.json"))
    assert sub.returncode == 0, sub.stderr
    owner = (env.root.stat().st_uid, env.root.stat().st_gid)
    state = env.root / ".state"
    for path in (env.root / "inbox", state, state / "submit.lock", state / "ledger.sqlite3"):
        assert (path.stat().st_uid, path.stat().st_gid) == owner, path
    run = subprocess.run(
        as_user(python, "--config", str(env.config_path), "run", "--once"), capture_output=True, text=True, cwd=env.tmp
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (env.root / "done" / "FIRST-1" / "result.json").exists()


def test_a_submit_the_daemon_could_not_read_fails_in_one_line(tmp_path: Path) -> None:
    """A user not in inbox/'s group (inbox/ writable by all) gets exit 2 and one line; nothing is dropped."""
    python = interpreter()
    base = Path(tempfile.mkdtemp(prefix="owner-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the user must reach the root
        env = Env(tmp=base, root=base / "dispatch", config_path=base / "dispatcher.yaml", count_file=base / "c.txt")
        env.configure()
        os.chmod(env.config_path, 0o644)
        env.cli("init", check=True)
        for folder, _dirs, files in os.walk(env.root):  # all of it writable by anyone, group root
            os.chmod(folder, 0o1777)  # noqa: S103 - only group membership is missing
            for f in files:
                os.chmod(os.path.join(folder, f), 0o666)  # noqa: S103 - the ledger and the submit lock
        (base / "o.json").write_text(json.dumps(order("NOPE-1")))
        os.chmod(base / "o.json", 0o644)
        sub = subprocess.run(
            as_user(python, "--config", str(env.config_path), "submit", str(base / "o.json")),
            capture_output=True, text=True, cwd=base,
        )  # fmt: skip
        assert sub.returncode == 2
        assert sub.stderr == (
            f"{base / 'o.json'}: cannot submit: inbox/ belongs to group root, which you are not in:"
            " the daemon could not read it\n"
        )
        assert sorted(os.listdir(env.root / "inbox")) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_order_another_user_moved_into_inbox_is_claimed_though_it_cannot_be_linked(
    service: tuple[Env, str],
) -> None:
    """Root `mv`s its own 0644 order into the inbox of a daemon running as nobody (the safe drop, not `submit`):
    fs.protected_hardlinks refuses the daemon a link to a file it neither owns nor may write, so the claim keeps
    a copy of the bytes it read; the job runs to done with its order byte for byte, and the inbox name goes."""
    env, python = service
    assert Path("/proc/sys/fs/protected_hardlinks").read_text().strip() == "1", "the case needs protected_hardlinks"
    init = subprocess.run(as_user(python, "--config", str(env.config_path), "init"), capture_output=True, text=True)
    assert init.returncode == 0, init.stderr
    log = (env.tmp / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        as_user(python, "--config", str(env.config_path), "run"), stdout=log, stderr=subprocess.STDOUT, cwd=env.tmp
    )
    try:
        wait_until(lambda: b"daemon.ready" in (env.tmp / "daemon.log").read_bytes(), what="the daemon to be ready")
        data = json.dumps(order("MOVED-1")).encode()
        (env.tmp / "o.json").write_bytes(data)
        os.chmod(env.tmp / "o.json", 0o644)
        os.rename(env.tmp / "o.json", env.root / "inbox" / "MOVED-1.json")  # root's file, owned by root
        wait_until(lambda: (env.root / "done" / "MOVED-1").exists() or env.refusals(), what="MOVED-1 to finish")
        text = (env.tmp / "daemon.log").read_text()
        assert (env.root / "done" / "MOVED-1" / "result.json").exists(), text[-2000:]
        assert (env.root / "done" / "MOVED-1" / "order.json").read_bytes() == data
        assert not (env.root / "inbox" / "MOVED-1.json").exists()
        assert "daemon.error" not in text, text[-2000:]
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()


def test_a_hold_by_root_leaves_hold_release_and_cancel_to_the_service_user(service: tuple[Env, str]) -> None:
    """Root submits and holds: the moves lock it makes under .state/ goes to the root's owner, so the service user
    then releases, holds and cancels (an order put back from held/ by its cancel), each exit 0; the job ends
    cancelled in the service user's `run --once`."""
    env, python = service
    init = subprocess.run(as_user(python, "--config", str(env.config_path), "init"), capture_output=True, text=True)
    assert init.returncode == 0, init.stderr  # the layout is the service user's, as its daemon leaves it
    (env.tmp / "o.json").write_text(json.dumps(order("HELD-1")))
    assert env.cli("submit", str(env.tmp / "o.json")).returncode == 0
    assert env.cli("hold", "HELD-1").returncode == 0
    lock = env.root / ".state" / "moves.lock"
    assert (lock.stat().st_uid, lock.stat().st_gid) == (env.root.stat().st_uid, env.root.stat().st_gid)
    base = as_user(python, "--config", str(env.config_path))
    for step in ("release", "hold", "cancel"):
        proc = subprocess.run([*base, step, "HELD-1"], capture_output=True, text=True, cwd=env.tmp)
        assert proc.returncode == 0, (step, proc.stderr)
    run = subprocess.run([*base, "run", "--once"], capture_output=True, text=True, cwd=env.tmp)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((env.root / "failed" / "HELD-1" / "result.json").read_text())["reason"] == "cancelled"
