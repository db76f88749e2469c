"""A daemon that runs as a service user, not root (the shipped unit's `User=dispatcher`).

Root ignores file modes; a service user does not. An agent runs as the daemon's user
and may leave its own folders without write or read access: the checks still run and are
recorded (section 5), and a retry still gets its next attempt (section 6).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import order, wait_until
from helpers_users import USER, as_user, interpreter, readable

# attempt 1 writes its receipt, then takes a right away from a folder it owns; attempt 2 works
AGENT = """\
import json, os, sys
order = json.load(open(os.environ["DISPATCH_ORDER"]))
ids = [i["id"] for i in order["items"]]
receipt = {"job_id": order["job_id"], "input_ids": ids, "output_ids": [], "status": "done", "outputs": []}
json.dump(receipt, open("receipt.json", "w"))
mode, attempt = order["meta"]["mode"], int(os.environ["DISPATCH_ATTEMPT"])
if mode == "outbox-unreadable":
    os.mkdir("outbox")
    os.chmod("outbox", 0)
elif mode == "work-read-only" and attempt == 1:
    os.chmod(".", 0o555)
    sys.exit(1)
elif mode == "outbox-read-only" and attempt == 1:
    os.mkdir("outbox")
    os.chmod("outbox", 0o555)
    sys.exit(1)
elif mode == "job-read-only":
    os.chmod("..", 0o555)
elif mode == "attempts-read-only" and attempt == 1:
    os.chmod("../attempts", 0o555)
    os.chmod(f"../attempts/{attempt}", 0)
    sys.exit(1)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder under /tmp that the service user owns, with the agent in it."""
    assert shutil.which("runuser"), "runuser not found: install util-linux"
    folder = Path(tempfile.mkdtemp(prefix="service-user-", dir="/tmp"))
    os.chmod(folder, 0o755)  # noqa: S103 - the service user must reach it
    (folder / "agent.py").write_text(AGENT)
    (folder / "dispatch").mkdir()
    yield folder
    subprocess.run(["chmod", "-R", "u+rwx", str(folder)], check=False)
    shutil.rmtree(folder, ignore_errors=True)


def setpriv(uid: int, gid: int | None = None, groups: str = "--clear-groups") -> list[str]:
    """Return the argv prefix that runs a program as uid (no passwd entry needed), as itself: no capability."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", groups]


def dispatcher_as(uid: int, *args: str, gid: int | None = None, groups: str = "--clear-groups",
                  limit: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """Return the argv of `dispatcher ARGS` as uid, with this checkout (``limit``: `prlimit` options first)."""
    checkout, site = readable()
    wrap = ["prlimit", *limit] if limit else []
    return [*setpriv(uid, gid, groups), *wrap, "env", f"PYTHONPATH={checkout}:{site}", "HOME=/tmp", python(), "-m",
            "dispatcher", *args]  # fmt: skip


@functools.cache
def python() -> str:
    """Return a Python the other users may run (asked once)."""
    return interpreter()


@contextlib.contextmanager
def started(argv: list[str], out: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run argv with its output into out; kill it at the end if it is still running."""
    with out.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_an_agent_that_takes_rights_from_its_own_folders_still_gets_its_checks_and_its_retry(base: Path) -> None:
    """An unreadable work/outbox/ fails writes_scope and followups_valid (every check recorded); a work/, outbox/,
    attempts/ or job folder left read-only (or unreadable) by the agent does not stop its next attempt nor its
    finish: each job ends as its checks say, none as `crashed` (a read-only job folder never finished)."""
    config = base / "dispatcher.yaml"
    agent = {"command": [python(), str(base / "agent.py")], "writes": [], "retry_safe": True, "max_attempts": 2}
    config.write_text(
        yaml.safe_dump({"root": str(base / "dispatch"), "settle": 0.2, "retry_delay": 0.1, "agents": {"ro": agent}})
    )
    modes = ("outbox-unreadable", "work-read-only", "outbox-read-only", "job-read-only", "attempts-read-only")
    for mode in modes:
        body = order(mode, to="ro", meta={"mode": mode})
        del body["accept"]  # no output file: only the receipt and the folders are in play
        (base / f"{mode}.json").write_text(json.dumps(body))
    subprocess.run(["chown", "-R", f"{USER}:", str(base)], check=True)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = as_user(python(), "--config", str(config), *args)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=base)

    submitted = run("submit", *(str(base / f"{m}.json") for m in modes))
    assert submitted.returncode == 0, submitted.stderr
    ran = run("run", "--once")
    assert "job.crashed" not in ran.stdout, ran.stdout

    unreadable = json.loads((base / "dispatch" / "failed" / "outbox-unreadable" / "result.json").read_text())
    checks = {c["name"]: c for c in unreadable["checks"]}
    # writes_scope comes first in the checks' order: what is in an unlistable folder cannot be vouched for
    assert unreadable["reason"].startswith("writes_scope: outbox cannot be listed"), unreadable["reason"]
    assert checks["followups_valid"]["ok"] is False and "Permission denied" in checks["followups_valid"]["detail"]
    assert checks["exit_ok"]["ok"] is True and checks["receipt_status"]["ok"] is True
    for mode in ("work-read-only", "outbox-read-only", "attempts-read-only", "job-read-only"):
        done = json.loads((base / "dispatch" / "done" / mode / "result.json").read_text())
        assert done["state"] == "done" and len(done["attempts"]) == (1 if mode == "job-read-only" else 2), done
        if mode == "job-read-only":
            continue
        kept = base / "dispatch" / "done" / mode / "attempts" / "1" / "receipt.json"
        assert json.loads(kept.read_text())["job_id"] == mode  # attempt 1's receipt set aside, not lost


def test_a_stop_while_short_of_processes_is_answered(base: Path) -> None:
    """SIGTERM while the service user may start no process or thread (RLIMIT_NPROC reached): the daemon
    logs daemon.stopping and exits 0 within stop_timeout; no order is lost or failed (section 13).
    Before, the signal handler failed to start its watch thread and the stop was lost."""
    uid = 40000 + os.getpid() % 20000  # a uid no one else runs processes as: the limit counts only the daemon's
    config = base / "dispatcher.yaml"
    agent = {"command": ["/bin/sh", "-c", "exit 0"], "writes": []}
    settings = {"root": str(base / "dispatch"), "settle": 0.2, "stop_timeout": 5, "agents": {"worker": agent}}
    config.write_text(yaml.safe_dump(settings))
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(base)], check=True)
    out = base / "daemon.log"
    with started(dispatcher_as(uid, "--config", str(config), "run"), out) as proc:
        wait_until(lambda: '"daemon.ready"' in out.read_text(), 60, "daemon.ready")
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        subprocess.run([*setpriv(uid), "prlimit", "--pid", str(proc.pid), f"--nproc={threads}:"], check=True)
        for n in range(2):
            body = order(f"NP-{n}", to="worker")
            del body["accept"]
            staged = base / "dispatch" / "inbox" / f".NP-{n}.tmp"
            staged.write_text(json.dumps(body))
            staged.rename(base / "dispatch" / "inbox" / f"NP-{n}.json")
        wait_until(lambda: '"daemon.short_of"' in out.read_text(), 60, "daemon.short_of")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, out.read_text()
    events = [json.loads(line)["event"] for line in out.read_text().splitlines() if line.startswith("{")]
    assert "daemon.stopping" in events and "daemon.stopped" in events, events
    root = base / "dispatch"
    queued = [p.stem for p in (root / "inbox").iterdir()]
    claimed = [p.name for state in ("active", "done") for p in (root / state).iterdir()]  # active/: recovered next
    assert sorted(queued + claimed) == ["NP-0", "NP-1"] and not list((root / "failed").iterdir())


def test_a_config_in_a_folder_the_user_may_not_enter_is_one_line_and_exit_2(base: Path) -> None:
    """`./config/` at 0750 of another user (as a service user's `init` makes it): every command of a user outside
    its group says `config/dispatcher.yaml: cannot read: Permission denied` in one line and exits 2; `run` and
    `web` ended in a traceback, the others exited 1."""
    (base / "config").mkdir()
    (base / "config" / "dispatcher.yaml").write_text(yaml.safe_dump({"root": "../dispatch", "agents": {}}))
    subprocess.run(["chown", "-R", "4801:4801", str(base / "config")], check=True)
    os.chmod(base / "config", 0o750)  # noqa: S103 - as `init` makes it: the group may enter
    for command in (["status"], ["validate"], ["run", "--once"], ["web"], ["list"]):
        proc = subprocess.run(dispatcher_as(4803, *command), capture_output=True, text=True, timeout=60, cwd=base)
        assert (proc.returncode, proc.stderr) == (2, "config/dispatcher.yaml: cannot read: Permission denied\n"), (
            command,
            proc.stderr,
        )


def test_a_group_member_who_submits_or_reads_first_leaves_the_daemon_its_ledger(base: Path) -> None:
    """A root shared with a group for writing (setgid, group-writable): a member's `submit` before any daemon
    ran, or a member's `status` while none runs, leaves no file of the member's that the service user cannot
    write (the ledger, its -wal/-shm, the submit lock): the daemon starts and runs the order, and the service
    user and a second member submit after them (before, `run` exited 2 and every later submit failed)."""
    svc, member, other = (4801, "--clear-groups"), (4802, "--groups=4801"), (4804, "--groups=4801")

    def as_(who: tuple[int, str], *args: str) -> subprocess.CompletedProcess[str]:
        argv = dispatcher_as(who[0], "--config", str(base / "dispatcher.yaml"), *args, groups=who[1])
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=base)

    root = base / "dispatch"
    receipt = 'printf \'{"job_id": "%s", "input_ids": ["R1", "R2", "R3"], "status": "done"}\' "$DISPATCH_JOB_ID"'
    agent = {"command": ["/bin/sh", "-c", f'{receipt} > "$DISPATCH_RECEIPT"'], "writes": []}
    (base / "dispatcher.yaml").write_text(yaml.safe_dump({"root": str(root), "settle": 0.2, "agents": {"w": agent}}))
    subprocess.run(["chown", "-R", "4801:4801", str(base)], check=True)
    os.chmod(root, 0o2770)  # noqa: S103 - the group shares the root
    assert as_(svc, "init").returncode == 0
    subprocess.run(["chmod", "-R", "g+w", str(root)], check=True)
    for n, who in enumerate((member, svc, other)):
        body = order(f"G-{n}", to="w")
        del body["accept"]
        path = base / f"G-{n}.json"
        path.write_text(json.dumps(body))
        os.chmod(path, 0o644)
        submitted = as_(who, "submit", str(path))
        assert submitted.returncode == 0, (who, submitted.stderr)
        if n == 0:
            assert as_(member, "status").returncode == 0
        ran = as_(svc, "run", "--once")
        assert ran.returncode == 0, ran.stderr + ran.stdout[-2000:]
        assert (root / "done" / f"G-{n}" / "result.json").exists()


def test_the_web_view_of_a_group_reader_starts_when_log_file_is_the_daemons(base: Path) -> None:
    """A member of the root's group who may read but not write the daemon's log_file starts `dispatcher web`
    (a warning says its lines go to stdout) and reads /api/status, as `status` does; it exited 2."""
    import socket
    import urllib.request

    config = base / "dispatcher.yaml"
    (base / "log").mkdir()
    config.write_text(
        yaml.safe_dump({"root": str(base / "dispatch"), "log_file": str(base / "log" / "d.log"), "agents": {}})
    )
    subprocess.run(["chown", "-R", "4801:4801", str(base)], check=True)
    os.chmod(config, 0o640)
    ran = subprocess.run(dispatcher_as(4801, "--config", str(config), "run", "--once"), capture_output=True, timeout=60)
    assert ran.returncode == 0
    assert (base / "log" / "d.log").stat().st_mode & 0o777 == 0o640
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = base / "web.out"
    argv = dispatcher_as(4802, "--config", str(config), "web", "--listen", f"127.0.0.1:{port}", groups="--groups=4801")
    with started(argv, out) as web:
        wait_until(lambda: '"web.started"' in out.read_text() or web.poll() is not None, 60, "web.started")
        assert web.poll() is None, out.read_text()
        assert '"web.log_file"' in out.read_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=30) as answer:
            assert answer.status == 200 and isinstance(json.loads(answer.read()), dict)


def test_a_daemon_short_of_processes_at_its_start_waits_then_starts(base: Path) -> None:
    """RLIMIT_NPROC reached before the daemon's threads start: it logs daemon.short_of (step start) and waits
    instead of exiting with a traceback, becomes ready once the limit is raised, and stops with exit 0."""
    uid = 40000 + (os.getpid() + 7) % 20000
    config = base / "dispatcher.yaml"
    config.write_text(yaml.safe_dump({"root": str(base / "dispatch"), "agents": {}}))
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(base)], check=True)
    out = base / "daemon.log"
    with started(dispatcher_as(uid, "--config", str(config), "run", limit=("--nproc=3:200",)), out) as proc:
        wait_until(lambda: '"daemon.short_of"' in out.read_text() or proc.poll() is not None, 60, "daemon.short_of")
        assert proc.poll() is None, out.read_text()
        assert '"step": "start"' in out.read_text() and '"daemon.ready"' not in out.read_text()
        subprocess.run([*setpriv(uid), "prlimit", "--pid", str(proc.pid), "--nproc=200:200"], check=True)
        wait_until(lambda: '"daemon.ready"' in out.read_text(), 60, "daemon.ready once processes are back")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, out.read_text()
    assert "Traceback" not in out.read_text()
