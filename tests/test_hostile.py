"""A hostile world against a real daemon: FIFOs left by agents, huge outputs, full disks,
clock steps, a busy or lost ledger. No hang, no double run, no lost job.

Each test names the numbered case it proves. Disks are small tmpfs mounts the test
makes itself (the tests run as root); a clock step is simulated through the start
time an attempt recorded, since the machine's clock cannot be stepped here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, order, wait_until
from helpers_faults import NotifyListener, env_daemon, wait_start, write_script

# An agent that, on attempt 1, replaces a file it was given with something hostile, then fails
# (exit 1, no receipt); on later attempts it does the job right. argv: COUNT WHAT NAME
HOSTILE_AGENT = r"""import json, os, sys
count, what, name = sys.argv[1], sys.argv[2], sys.argv[3]
attempt = os.environ["DISPATCH_ATTEMPT"]
with open(count, "a") as f:
    f.write(f"{os.environ['DISPATCH_JOB_ID']} {attempt} {os.getpid()}\n")
if attempt == "1":
    os.unlink(name)
    if what == "fifo":
        os.mkfifo(name)
    else:
        os.symlink("/dev/zero", name)
    sys.exit(1)
ids = [i["id"] for i in json.load(open(os.environ["DISPATCH_ORDER"]))["items"]] if os.path.isfile("order.json") else []
json.dump({"job_id": os.environ["DISPATCH_JOB_ID"], "input_ids": ids, "output_ids": [], "status": "done"},
          open("receipt.json", "w"))
"""

# Writes its start, then sleeps; with argv[2] = "receipt" writes a good receipt first.
SLEEPER = r"""import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['DISPATCH_JOB_ID']} {os.environ['DISPATCH_ATTEMPT']} {os.getpid()}\n")
ids = [i["id"] for i in json.load(open(os.environ["DISPATCH_ORDER"]))["items"]]
time.sleep(float(sys.argv[2]))
json.dump({"job_id": os.environ["DISPATCH_JOB_ID"], "input_ids": ids, "output_ids": [], "status": "done"},
          open("receipt.json", "w"))
"""


def plain(job_id: str, to: str = "worker", **extra: Any) -> dict[str, Any]:
    """Return an order without accept.output (the receipt alone decides)."""
    body = order(job_id, to=to, **extra)
    body.pop("accept")
    return body


def starts(env: Env, job_id: str) -> int:
    """Return how many times an agent recorded a start of job_id."""
    return sum(1 for j, _ in env.starts() if j == job_id)


def rss_peak_kib(pid: int) -> int:
    """Return a process's peak resident memory (VmHWM) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def cpu_s(pid: int) -> float:
    """Return a process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of this size at path for the test (root only), and unmount it after."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=False)
    if done.returncode != 0:
        pytest.fail("cannot mount a tmpfs (the tests need root for the disk-full cases)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path, leave: int) -> Path:
    """Fill the filesystem of folder until about `leave` bytes are free; return the filler file."""
    filler = folder / ".filler"
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(0, free - leave))
    return filler


def hostile_agent(env: Env, what: str, name: str, **settings: Any) -> dict[str, Any]:
    script = write_script(env.tmp, "hostile.py", HOSTILE_AGENT)
    spec: dict[str, Any] = {"command": [sys.executable, str(script), str(env.count_file), what, name], "timeout": 30}
    spec.update(settings)
    return spec


def sleeper(env: Env, seconds: float, **settings: Any) -> dict[str, Any]:
    script = write_script(env.tmp, "sleeper.py", SLEEPER)
    spec: dict[str, Any] = {"command": [sys.executable, str(script), str(env.count_file), str(seconds)], "timeout": 60}
    spec.update(settings)
    return spec


# -- hangs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["fifo", "zero"])
def test_1_prompt_left_as_a_fifo_or_dev_zero_does_not_hang_the_retry(env: Env, what: str) -> None:
    """(1) prompt.md left as a FIFO or a link to /dev/zero: the retry runs, the job ends, SIGTERM still works."""
    agent = hostile_agent(env, what, "prompt.md", prompt="Do {task}", retry_safe=True, max_attempts=2)
    agent["command"].append("{prompt}")
    env.configure(agents={"worker": agent})
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("HOST-1"))
    result = env.wait_job("HOST-1", timeout=30)
    assert starts(env, "HOST-1") == 2, "the retry did not run"
    assert result["state"] == "failed" and result["reason"].startswith("writes_scope: prompt.md was given")
    assert d.stop(timeout=15) == 0
    assert rss_peak_kib(os.getpid()) > 0  # the test process itself stayed sane


@pytest.mark.parametrize("how", ["retry", "recovery"])
def test_2_order_json_left_as_a_fifo_does_not_freeze_the_daemon(env: Env, how: str) -> None:
    """(2) work/order.json left as a FIFO: retry or recovery reads nothing from work/, the daemon stays live."""
    agent = hostile_agent(env, "fifo", "order.json", retry_safe=(how == "recovery"), max_attempts=2)
    if how == "recovery":  # attempt 1 plants the FIFO, then hangs until the daemon is killed
        agent["command"] = [
            "sh",
            "-c",
            f'echo "$DISPATCH_JOB_ID $DISPATCH_ATTEMPT $$" >> {env.count_file}; '
            'if [ "$DISPATCH_ATTEMPT" = 1 ]; then rm order.json; mkfifo order.json; sleep 60; fi; '
            'printf \'{"job_id": "%s", "input_ids": ["R1", "R2", "R3"], "output_ids": [], "status": "done"}\' '
            '"$DISPATCH_JOB_ID" > receipt.json',
        ]
    env.configure(agents={"worker": agent})
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("HOST-2"))
    if how == "retry":
        first = env.wait_job("HOST-2", timeout=30)
        assert first["state"] == "failed"
        assert env.cli("retry", "HOST-2").returncode == 0
        wait_until(lambda: starts(env, "HOST-2") == 2, 30, "the retried attempt")
    else:
        wait_start(env, "HOST-2")
        wait_until(lambda: (env.root / "active" / "HOST-2" / "work" / "order.json").is_fifo(), 10, "the FIFO")
        d.kill()
        d = env.daemon()
        d.wait_event("daemon.ready", timeout=20)
    result = env.wait_job("HOST-2", timeout=30)
    assert result["attempts"][-1]["n"] == 2
    assert env.cli("status").returncode == 0
    assert d.stop(timeout=15) == 0


def test_3_many_young_files_do_not_stall_pickup_or_the_watchdog(env: Env) -> None:
    """(3) 3,000 young files still settling: the first claim is quick, watchdog pings stay regular, SIGTERM acts."""
    env.configure(agents={"worker": sleeper(env, 0, concurrency=2)}, settle=1.0)
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    listener = NotifyListener(env.tmp / "notify.sock")
    try:
        d = env_daemon(env, {"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "1000000"})
        d.wait_ready()
        body = json.dumps(plain("X")).encode()
        for i in range(3000):  # written in place: no close event reaches the daemon before they settle
            (inbox / f"Y-{i:05d}.json").write_bytes(body.replace(b'"X"', f'"Y-{i:05d}"'.encode()))
        t0 = time.monotonic()
        d.wait_event("job.claimed", timeout=30)
        first_claim = time.monotonic() - t0
        wait_until(lambda: len(list((env.root / "done").iterdir())) >= 20, 60, "20 jobs done")
        wait_until(lambda: len(listener.times("WATCHDOG=1")) >= 6, 30, "three seconds of watchdog pings")
        pings = listener.times("WATCHDOG=1")
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        t1 = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait(timeout=30) == 0
        stop_s = time.monotonic() - t1
    finally:
        listener.close()
    assert first_claim < 10, first_claim
    assert gaps and max(gaps) < 2.0, max(gaps)
    assert stop_s < 15, stop_s


def test_4_cancel_with_a_big_backlog_keeps_memory_flat(env: Env) -> None:
    """(4) cancel of a queued job behind 60 orders of 1 MiB: done within seconds, the daemon's RSS stays small."""
    env.configure(agents={"worker": sleeper(env, 30, concurrency=1)}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("BUSY"))
    wait_start(env, "BUSY")
    pad = "x" * ((1 << 20) - 600)
    for i in range(60):
        env.drop(plain(f"Q-{i:02d}", meta={"pad": pad}))
    assert env.cli("cancel", "Q-59").returncode == 0
    t0 = time.monotonic()
    result = env.wait_job("Q-59", "failed", timeout=20)
    assert result["reason"] == "cancelled"
    assert time.monotonic() - t0 < 10
    assert rss_peak_kib(d.proc.pid) < 200_000  # type: ignore[union-attr]
    assert starts(env, "Q-59") == 0


def test_5_a_pathological_stdout_costs_little_daemon_cpu(env: Env) -> None:
    """(5) 4 MiB of `{"a":[` lines ending in `}` on stdout: the job ends at once, the daemon spends < 2 s of CPU."""
    code = (
        "import json, os, sys; sys.stdout.write('{\"a\":[\\n' * 600000 + '}\\n'); sys.stdout.flush(); "
        "o = json.load(open(os.environ['DISPATCH_ORDER'])); "
        "json.dump({'job_id': o['job_id'], 'input_ids': [i['id'] for i in o['items']], 'output_ids': [], "
        "'status': 'done'}, open('receipt.json', 'w'))"
    )
    env.configure(agents={"worker": {"command": [sys.executable, "-c", code], "timeout": 60}})
    d = env.daemon()
    d.wait_ready()
    before = cpu_s(d.proc.pid)  # type: ignore[union-attr]
    env.drop(plain("FLOOD-1"))
    result = env.wait_job("FLOOD-1", "done", timeout=60)
    assert "agent_result" not in result["attempts"][0]
    assert cpu_s(d.proc.pid) - before < 2.0  # type: ignore[union-attr]


# -- double runs and lost jobs ------------------------------------------------------------------


@pytest.mark.parametrize("kill", [False, True])
def test_6_a_full_disk_during_an_attempt_never_runs_it_twice(env: Env, kill: bool) -> None:
    """(6) the root's disk fills while the agent runs: the job waits (or is recovered) and runs exactly once."""
    with tmpfs(env.tmp / "disk", "2m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        agent = sleeper(env, 2)
        env.root = root
        env.configure(agents={"worker": agent}, root=str(root))
        d = env.daemon()
        d.wait_ready()
        env.drop(plain("FULL-1"))
        wait_start(env, "FULL-1")
        filler = fill(disk, 0)
        wait_until(lambda: any(e.get("event") == "agent.exited" for e in d.events()), 20, "the agent's end")
        time.sleep(1.0)
        if kill:
            d.kill()
        filler.unlink()
        if kill:
            d = env.daemon()
        result = env.wait_job("FULL-1", timeout=40)
        assert starts(env, "FULL-1") == 1, "the agent ran twice"
        folder = root / result["state"] / "FULL-1"
        assert (folder / "attempts" / "1" / "stdout.log").exists()
        assert d.stop(timeout=15) == 0


def test_7_a_claim_that_cannot_build_its_folder_leaves_no_claim_behind(env: Env) -> None:
    """(7) with almost no space a claim fails whole: no stale claim, no staging left; the job runs when space frees."""
    with tmpfs(env.tmp / "disk", "2m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(agents={"worker": sleeper(env, 0)}, root=str(root), rescan_interval=0.5)
        d = env.daemon()
        d.wait_ready()
        filler = fill(disk, 16 * 1024)
        env.drop(plain("TIGHT-1"))
        time.sleep(2.0)
        filler.unlink()
        result = env.wait_job("TIGHT-1", "done", timeout=40)
        assert starts(env, "TIGHT-1") == 1
        assert not [p for p in (root / "failed").iterdir()], "a copy was refused as a duplicate"
        assert not list((root / ".state" / "staging").iterdir())
        assert result["attempts"] and d.stop(timeout=15) == 0


def test_7_an_order_with_a_lone_surrogate_is_refused_in_inbox(env: Env) -> None:
    """(7) an order holding a lone surrogate is refused (it cannot be written as UTF-8), naming the field."""
    d = env.daemon()
    d.wait_ready()
    env.drop(json.dumps(order("SURR-1")).replace("Assign", "\\ud800 Assign"), name="surr.json")
    refused = env.wait_refused("surr")
    assert refused["reason"].startswith("task:") and "surrogate" in refused["reason"]


@pytest.mark.parametrize(("name", "data"), [
    ("nul.json", b'{"job_id": "A\\u0000B", "from": "me", "to": "worker", "task": "t", "items": [{"id": "R1"}]}'),
    ("nul.yaml", b'job_id: "J\\0x"\nfrom: me\nto: worker\ntask: t\nitems:\n  - id: R1\n'),
])  # fmt: skip
def test_an_order_whose_job_id_holds_a_nul_is_refused_and_run_once_ends(env: Env, name: str, data: bytes) -> None:
    """A job_id with a NUL (a JSON or YAML escape) is refused like any id that breaks the pattern: the file goes to
    failed/<stem>@<time>/ byte for byte, the reason names job_id, and `run --once` exits 1. It stayed in inbox/
    with a daemon.error line every second, and `run --once` never ended."""
    env.configure()
    env.drop(data, name=name)
    env.drop(order("OK-1"))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert not [line for line in proc.stdout.splitlines() if '"daemon.error"' in line]
    stem = name.rsplit(".", 1)[0]
    [folder] = (env.root / "failed").glob(f"{stem}@*")
    assert (folder / f"order.{name.rsplit('.', 1)[1]}").read_bytes() == data
    result = json.loads((folder / "result.json").read_text())
    assert result["state"] == "failed" and result["reason"].startswith("job_id: must match"), result
    assert not list((env.root / "inbox").iterdir())
    assert env.result("OK-1", "done")["state"] == "done"


def test_a_refused_orders_unwritable_id_is_null_and_a_named_agent_is_kept(env: Env) -> None:
    """A refused file whose job_id is a lone surrogate records job_id null (result.json stays UTF-8); one that names
    a configured agent in `to` is logged and counted under it, one naming an unknown agent under none."""
    d = env.daemon()
    d.wait_ready()
    env.drop(json.dumps(order("X")).replace('"X"', '"\\ud800"'), name="surrid.json")
    refused = env.wait_refused("surrid")
    assert refused["job_id"] is None and refused["reason"].startswith("job_id:"), refused
    [folder] = (env.root / "failed").glob("surrid@*")
    (folder / "result.json").read_bytes().decode("utf-8")  # strict UTF-8, no escaped lone surrogate
    assert not re.search(r"(?<!\\)\\ud800", (folder / "result.json").read_text())  # as a JSON escape
    env.drop(json.dumps({**order("NO-ITEMS"), "items": []}), name="noitems.json")
    env.drop(json.dumps({**order("ELSEWHERE", to="nobody"), "items": []}), name="nobody.json")
    env.wait_refused("noitems")
    env.wait_refused("nobody")
    d.stop()
    agents = {e["job_id"]: e["agent"] for e in d.events() if e.get("event") == "job.refused"}
    assert agents["NO-ITEMS"] == "worker" and agents["ELSEWHERE"] is None, agents


def test_8_a_clock_step_does_not_hide_an_orphaned_agent(env: Env) -> None:
    """(8) an orphan is found whatever the clocks did since it started, and wherever it moved to.

    No pid, start time or clock is recorded when an agent starts: recovery finds the
    orphan by the DISPATCH_* variables of its environment. This agent also leaves its
    working folder (``cd /``), so a search by folder would miss it; and the wall clock's
    view of its start plays no part (nothing to step).
    """
    script = write_script(
        env.tmp,
        "wanderer.py",
        "import os, sys\nos.chdir('/')\n"
        + SLEEPER.replace('open("receipt.json"', "open(os.environ['DISPATCH_RECEIPT']"),
    )
    env.configure(
        agents={"worker": {"command": [sys.executable, str(script), str(env.count_file), "60"], "timeout": 60}}
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("STEP-1"))
    pid = wait_start(env, "STEP-1")
    wait_until(lambda: os.readlink(f"/proc/{pid}/cwd") == "/", 10, "the agent to leave its folder")
    record = env.root / "active" / "STEP-1" / "attempts" / "1" / "attempt.json"
    assert not record.exists(), "a running record was written when the agent started"
    d.kill()
    d = env.daemon()
    d.wait_ready()
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    result = env.wait_job("STEP-1", "failed", timeout=30)
    assert "interrupted" in result["reason"]
    assert starts(env, "STEP-1") == 1


def test_9_a_ledger_locked_by_another_process_is_waited_for(env: Env) -> None:
    """(9) another process holds the ledger's write lock for 8 s: jobs wait, then end done; nothing crashes."""
    env.configure(agents={"worker": sleeper(env, 0, concurrency=2)})
    d = env.daemon()
    d.wait_ready()
    ledger = env.root / ".state" / "ledger.sqlite3"
    held = threading.Event()

    def hold() -> None:
        db = sqlite3.connect(ledger, timeout=30, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(8)
        db.execute("ROLLBACK")
        db.close()

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    for i in range(4):
        env.drop(plain(f"LOCK-{i}"))
    t.join()
    for i in range(4):
        assert env.wait_job(f"LOCK-{i}", "done", timeout=60)
    events = [e["event"] for e in d.events()]
    assert "ledger.waiting" in events
    assert "job.crashed" not in events and "daemon.error" not in events
    assert d.stop() == 0


def test_10_a_lost_ledger_stops_the_daemon_until_it_is_rebuilt(env: Env) -> None:
    """(10) a deleted ledger: run refuses with one line naming `ledger rebuild`; after it, old ids are refused."""
    assert env.cli("submit", str(_write(env, plain("LOST-1")))).returncode == 0
    assert env.cli("run", "--once").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    proc = env.cli("run", "--once")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "dispatcher ledger rebuild" in proc.stderr
    sub = env.cli("submit", str(_write(env, plain("LOST-1"), "again.json")))
    assert sub.returncode == 2
    states = ("inbox", "held", "active", "waiting", "review", "done", "failed", "refused")
    listing = [["list"], *(["list", "--state", s] for s in states)]
    for command in (
        ["init"],
        ["land", "LOST-1"],
        ["status"],
        ["show", "LOST-1"],
        ["cancel", "LOST-1"],
        ["retry", "LOST-1"],
        *listing,
    ):
        proc = env.cli(*command)  # every command: one line naming the rebuild, nothing done
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc)
        assert "dispatcher ledger rebuild" in proc.stderr, (command, proc.stderr)
    rebuilt = env.cli("ledger", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    again = env.cli("submit", str(_write(env, plain("LOST-1"), "again2.json")))
    assert again.returncode == 2 and "already known" in again.stderr
    env.drop(plain("LOST-1"), name="dup.json")
    assert env.cli("run", "--once").returncode == 1  # the duplicate is refused, not run
    assert starts(env, "LOST-1") == 1


def test_10_a_damaged_ledger_page_stops_commands_and_the_daemon_with_one_line_until_rebuilt(env: Env) -> None:
    """(10) the jobs table's page of the ledger zeroed, its header intact (it opens, and breaks at the first read):
    `run` and every command answer with one line naming `ledger rebuild` and exit 2, never a traceback; the
    rebuild refuses the old id again."""
    import sqlite3

    assert env.cli("submit", str(_write(env, plain("DMG-1")))).returncode == 0
    assert env.cli("run", "--once").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        [(page,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchall()
        size = db.execute("PRAGMA page_size").fetchone()[0]
    with open(ledger, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\0" * size)
    for command in (["status"], ["list"], ["show", "DMG-1"], ["retry", "DMG-1"], ["run", "--once"], ["run"]):
        proc = env.cli(*command, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr[-3000:])
        assert "the ledger cannot be read" in proc.stderr and "dispatcher ledger rebuild" in proc.stderr, proc.stderr
    rebuilt = env.cli("ledger", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    again = env.cli("submit", str(_write(env, plain("DMG-1"), "again.json")))
    assert again.returncode == 2 and "already known" in again.stderr


HOLD_LEDGER = """import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
db.execute("SELECT count(*) FROM jobs").fetchall()
print("held", flush=True)
time.sleep(120)
"""


def test_10_a_ledger_another_process_holds_locked_is_not_called_damaged_and_rebuild_keeps_it(env: Env) -> None:
    """Another process holds the SQLite ledger in an exclusive lock (a backup tool, a `sqlite3` shell): the reading
    commands say it is locked, with no advice to rebuild it, and `ledger rebuild` refuses, naming the lock, and sets
    nothing aside. Once the lock is gone, the ledger is as it was: a pause recorded only there is still in place."""
    assert env.cli("submit", str(_write(env, plain("LCK-1")))).returncode == 0
    assert env.cli("run", "--once").returncode == 0
    assert env.cli("pause", "worker").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LEDGER, str(ledger)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        for command in (["status"], ["list"], ["show", "LCK-1"]):
            proc = env.cli(*command, timeout=60)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr[-3000:])
            assert "locked" in proc.stderr and "rebuild" not in proc.stderr, (command, proc.stderr)
        rebuilt = env.cli("ledger", "rebuild", timeout=60)
        assert rebuilt.returncode == 2 and "locked by another process, not damaged" in rebuilt.stderr, rebuilt.stderr
        assert sorted(p.name for p in ledger.parent.iterdir() if "damaged" in p.name) == []
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    status = env.cli("status", "--json", check=True)
    assert "paused" in status.stdout, status.stdout


def test_10_a_rebuilt_ledger_keeps_a_finished_jobs_age_and_says_one_job_id(env: Env) -> None:
    """After `ledger rebuild` a done job's age in `list` still counts from its finish, not from the rebuild."""
    env.drop(plain("AGED-1"))
    assert env.cli("run", "--once").returncode == 0
    time.sleep(3.0)
    for f in env.root.glob(".state/ledger.sqlite3*"):
        f.unlink()
    rebuilt = env.cli("ledger", "rebuild", check=True)
    assert "rebuilt with 1 job id (" in rebuilt.stdout, rebuilt.stdout
    [row] = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert row["job_id"] == "AGED-1" and row["state"] == "done" and row["age_s"] >= 3.0, row


def test_10_a_lock_held_a_moment_is_waited_out_by_the_reading_commands(env: Env) -> None:
    """A lock held for a second (a daemon switching its new ledger to WAL, a backup's quick copy): `status`, `list`
    and `show` wait it out and answer (exit 0), where they said "locked" (exit 2) after a quarter of a second."""
    assert env.cli("submit", str(_write(env, plain("BRIEF-1")))).returncode == 0
    assert env.cli("run", "--once").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    brief = HOLD_LEDGER.replace("time.sleep(120)", "time.sleep(1.0)")
    for command in (["status", "--json"], ["list"], ["show", "BRIEF-1"]):
        holder = subprocess.Popen([sys.executable, "-c", brief, str(ledger)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            proc = env.cli(*command, timeout=60)
            assert proc.returncode == 0, (command, proc.stderr)
            said = (
                json.loads(proc.stdout)["counts"]["done"] == 1 if command[0] == "status" else "BRIEF-1" in proc.stdout
            )
            assert said, (command, proc.stdout)
        finally:
            holder.kill()
            holder.communicate(timeout=30)


def test_10_rebuild_refuses_a_config_whose_ledger_is_postgresql(env: Env) -> None:
    """`ledger rebuild` makes the SQLite ledger only: with a PostgreSQL ledger it refuses and leaves every file."""
    env.drop(plain("PG-1"))
    assert env.cli("run", "--once").returncode == 0
    state = env.root / ".state"
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    env.configure(ledger="postgresql://dispatcher@127.0.0.1:9/dispatcher")  # never reached: refused first
    proc = env.cli("ledger", "rebuild")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"{env.config_path}: ledger: `ledger rebuild` makes the SQLite ledger again")
    assert "dispatcher ledger migrate URL" in proc.stderr
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()} == before


def test_10_rebuild_with_an_argument_is_bad_usage_and_changes_nothing(env: Env) -> None:
    """`ledger rebuild URL` (an argument only migrate takes) exits 2 with one line; the ledger stays as it was."""
    env.drop(plain("ARG-1"))
    assert env.cli("run", "--once").returncode == 0
    state = env.root / ".state"
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    proc = env.cli("ledger", "rebuild", "extra")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "ledger rebuild: takes no argument, got extra; it rebuilds from the job folders\n"
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()} == before


def test_10_rebuild_after_state_was_removed_makes_it_again(env: Env) -> None:
    """(10) `rm -rf .state` beside finished jobs: every command names `ledger rebuild`, and that command makes
    .state/ and the ledger again from the folders (it ended in a traceback, exit 1, on the missing folder)."""
    import shutil

    env.drop(plain("GONE-STATE-1"))
    assert env.cli("run", "--once").returncode == 0
    shutil.rmtree(env.root / ".state")
    status = env.cli("status")
    assert status.returncode == 2 and "dispatcher ledger rebuild" in status.stderr
    proc = env.cli("ledger", "rebuild")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert env.cli("status").returncode == 0
    env.drop(plain("GONE-STATE-1"), name="again.json")  # a known id is still refused
    assert env.cli("run", "--once").returncode == 1
    assert "already" in env.wait_refused("again")["reason"]


def test_10_rebuild_where_state_is_a_file_says_so_in_one_line(env: Env) -> None:
    """(10) .state replaced by a regular file: `ledger rebuild` cannot make the ledger there and says so in one
    line with exit 2, as every command does (it ended with exit 1 on `.state/daemons: Not a directory`)."""
    import shutil

    env.drop(plain("FILE-STATE-1"))
    assert env.cli("run", "--once").returncode == 0
    shutil.rmtree(env.root / ".state")
    (env.root / ".state").write_text("not a folder\n")
    proc = env.cli("ledger", "rebuild")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{env.root / '.state' / 'ledger.sqlite3'}: the ledger cannot be made ("), proc.stderr
    assert (env.root / ".state").read_text() == "not a folder\n"


def test_10_an_emptied_ledger_is_refused_like_a_lost_one(env: Env) -> None:
    """(10) a ledger truncated to nothing over existing jobs: the daemon refuses to start on it."""
    env.drop(plain("TRUNC-1"))
    assert env.cli("run", "--once").returncode == 0
    (env.root / ".state" / "ledger.sqlite3").write_bytes(b"")
    for suffix in ("-wal", "-shm"):
        Path(f"{env.root}/.state/ledger.sqlite3{suffix}").unlink(missing_ok=True)
    proc = env.cli("run", "--once")
    assert proc.returncode == 2 and "ledger rebuild" in proc.stderr


def test_10_a_lost_wal_after_kill_still_recovers_the_active_job(env: Env) -> None:
    """(10) kill -9, then the WAL lost (the claim row with it): the job in active/ is recovered, not run twice."""
    env.configure(agents={"worker": sleeper(env, 60), "quick": sleeper(env, 0)})
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("WAL-0", to="quick"))
    env.wait_job("WAL-0", "done")
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the schema is in the main file; the claim will be in the WAL
    db.close()
    env.drop(plain("WAL-1"))
    wait_start(env, "WAL-1")
    d.kill()
    wal = env.root / ".state" / "ledger.sqlite3-wal"
    wal.unlink(missing_ok=True)
    (env.root / ".state" / "ledger.sqlite3-shm").unlink(missing_ok=True)
    order_file = env.root / "active" / "WAL-1" / "order.json"
    assert order_file.exists()
    d = env.daemon()
    d.wait_ready()
    result = env.wait_job("WAL-1", "failed", timeout=30)
    assert "interrupted" in result["reason"]
    assert (env.root / "failed" / "WAL-1" / order_file.name).exists()
    assert starts(env, "WAL-1") == 1
    assert any(e.get("event") == "ledger.repaired" and e.get("job_id") == "WAL-1" for e in d.events())


def test_10b_a_done_job_whose_row_was_lost_is_refused_again_and_its_row_repaired(env: Env) -> None:
    """(10b) kill -9, then the WAL lost with a done job's rows: the same id dropped again is refused (never run
    twice), and ``ledger.repaired`` names the job's agent, as lines about a job do (section 8)."""
    env.configure(agents={"quick": sleeper(env, 0)})
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("WAL-A", to="quick"))
    env.wait_job("WAL-A", "done")
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # WAL-B's rows will be in the WAL only
    db.close()
    env.drop(plain("WAL-B", to="quick"))
    env.wait_job("WAL-B", "done")
    d.kill()
    (env.root / ".state" / "ledger.sqlite3-wal").unlink(missing_ok=True)
    (env.root / ".state" / "ledger.sqlite3-shm").unlink(missing_ok=True)
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("WAL-B", to="quick"), name="again.json")
    refused = env.wait_refused("again")
    repaired = d.wait_event("ledger.repaired", job_id="WAL-B")
    d.stop()
    assert "WAL-B" in refused["reason"] and starts(env, "WAL-B") == 1
    assert (repaired["agent"], repaired["state"]) == ("quick", "done")


def _write(env: Env, body: dict[str, Any], name: str | None = None) -> Path:
    path = env.tmp / (name or f"{body['job_id']}.json")
    path.write_text(json.dumps(body))
    return path


# -- wrong answers --------------------------------------------------------------------------------


def test_11_a_follow_up_may_not_take_the_id_of_a_queued_order(env: Env) -> None:
    """(11) a follow-up whose id a queued user order holds fails followups_valid; the user's order runs."""
    handoff = {"job_id": "QUEUED-1", "from": "worker", "to": "slow", "task": "t", "items": [{"id": "R1"}]}
    agent = env.agent("--followup", json.dumps(handoff))
    env.configure(agents={"worker": agent, "slow": sleeper(env, 3, concurrency=1)}, max_jobs=3)
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("BLOCK", to="slow"))
    wait_start(env, "BLOCK")
    env.drop(plain("QUEUED-1", to="slow"))  # waits in inbox/: slow's one slot is busy
    env.drop(order("PARENT-1"))
    parent = env.wait_job("PARENT-1", "failed", timeout=30)
    assert parent["reason"].startswith("followups_valid:") and "already known" in parent["reason"]
    user = env.wait_job("QUEUED-1", "done", timeout=30)
    assert user["parent"] is None


def test_13_a_ledger_that_is_not_a_database_is_one_line(env: Env) -> None:
    """(13) a ledger file that is not a database: one line and exit 2, for run, submit and status."""
    (env.root / ".state").mkdir(parents=True, exist_ok=True)
    (env.root / ".state" / "ledger.sqlite3").write_bytes(b"this is not a database" * 100)
    for args in (["run", "--once"], ["submit", str(_write(env, plain("NDB-1")))], ["status"]):
        proc = env.cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_13_a_read_only_root_is_one_line(env: Env) -> None:
    """(13) a read-only root: `run` exits 2 with one line, no traceback."""
    with tmpfs(env.tmp / "ro", "1m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(root=str(root))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        proc = env.cli("run", "--once")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_14_huge_outputs_and_receipts_are_bounded(env: Env) -> None:
    """(14) a 40 MB CSV output and a 14 MB receipt: the daemon's memory, result.json and log lines stay small."""
    code = (
        "import json, os; o = json.load(open(os.environ['DISPATCH_ORDER'])); ids = [i['id'] for i in o['items']]\n"
        "with open('out.csv', 'w') as f:\n"
        "    f.write('id\\n'); f.write(''.join(f'X{i}\\n' for i in range(4_000_000)))\n"
        "json.dump({'job_id': o['job_id'], 'input_ids': ids + [f'Z{i}' for i in range(1_200_000)],"
        " 'output_ids': [], 'status': 'done'}, open('receipt.json', 'w'))"
    )
    env.configure(agents={"worker": {"command": [sys.executable, "-c", code], "timeout": 120, "writes": ["out.csv"]}})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HUGE-1"))
    result = env.wait_job("HUGE-1", "failed", timeout=120)
    assert os.path.getsize(env.root / "failed" / "HUGE-1" / "result.json") < 64 * 1024
    assert all(len(c["detail"]) < 3000 for c in result["checks"])
    assert max(len(line) for line in d.out.read_text().splitlines()) < 32 * 1024
    assert rss_peak_kib(d.proc.pid) < 250_000  # type: ignore[union-attr]


def test_14_attempts_and_follow_ups_have_ceilings(env: Env) -> None:
    """(14) max_attempts above 100 is refused; 500 follow-ups fail followups_valid and a stop stays prompt."""
    bad = env.tmp / "bad.json"
    bad.write_text(json.dumps(plain("CEIL-1", max_attempts=101)))
    proc = env.cli("validate", str(bad))
    assert proc.returncode == 2 and "max_attempts" in proc.stderr
    code = (
        "import json, os; o = json.load(open(os.environ['DISPATCH_ORDER'])); os.mkdir('outbox')\n"
        "for i in range(500):\n"
        "    json.dump({'job_id': f'F-{i}', 'from': 'worker', 'to': 'worker', 'task': 't', 'items': [{'id': 'R1'}]},"
        " open(f'outbox/F-{i}.json', 'w'))\n"
        "json.dump({'job_id': o['job_id'], 'input_ids': [i['id'] for i in o['items']], 'output_ids': [],"
        " 'status': 'done'}, open('receipt.json', 'w'))"
    )
    env.configure(agents={"worker": {"command": [sys.executable, "-c", code], "timeout": 60}}, stop_timeout=5)
    d = env.daemon()
    d.wait_ready()
    env.drop(plain("MANY-1"))
    result = env.wait_job("MANY-1", "failed", timeout=60)
    assert result["reason"].startswith("followups_valid:") and "max_followups" in result["reason"]
    t0 = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - t0 < 6


def test_14_a_feedback_link_to_a_folder_does_not_crash_a_repair(env: Env) -> None:
    """(14) a repair agent that leaves feedback.json as a link to a folder: the job goes on, no crash."""
    agent = env.agent("--fail-checks-attempts", "1", retry_safe=True, repair=True, max_attempts=2)
    agent["command"] = [
        "sh",
        "-c",
        'ln -sfn /tmp feedback.json 2>/dev/null; exec "$@"',
        "sh",
        *agent["command"],
    ]
    env.configure(agents={"worker": agent})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FEED-1"))
    result = env.wait_job("FEED-1", timeout=60)
    assert len(result["attempts"]) == 2
    assert "job.crashed" not in [e["event"] for e in d.events()]


def test_an_impossible_timestamp_is_refused_and_the_order_beside_it_is_claimed(env: Env) -> None:
    """`expires: 2026-13-01T00:00:00Z` goes to failed/ with a one-line reason; the other order runs."""
    env.configure()
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    bad = b"job_id: TS-1\nfrom: a\nto: worker\ntask: t\nitems: [{id: R1}]\nexpires: 2026-13-01T00:00:00Z\n"
    (env.root / "inbox" / "TS-1.yaml").write_bytes(bad)
    env.drop(order("TS-2"))
    env.cli("run", "--once", timeout=60)  # exits 1: a file was refused
    assert env.result("TS-2", "done")["state"] == "done"
    (refused,) = [p for p in (env.root / "failed").iterdir() if p.name.startswith("TS-1@")]
    result = json.loads((refused / "result.json").read_text())
    assert result["job_id"] == "TS-1"
    assert "2026-13-01T00:00:00Z is not a valid date or time" in result["reason"], result["reason"]
    assert (refused / "order.yaml").read_bytes() == bad


def test_a_valid_order_whose_file_name_is_not_utf8_is_refused_with_its_bytes(env: Env) -> None:
    """inbox/bad<0xff>.json holding a good order: refused at once (the name cannot be recorded), bytes kept, and its
    result.json names the job id the order holds, so that `show ID` finds it."""
    data = json.dumps(plain("NAME-1")).encode()
    inbox = os.fsencode(env.root / "inbox")
    os.makedirs(inbox, exist_ok=True)
    with open(inbox + b"/.tmp", "wb") as fh:
        fh.write(data)
    os.rename(inbox + b"/.tmp", inbox + b"/bad\xff.json")
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1  # a refused file
    assert os.listdir(inbox) == []
    refused = [p for p in os.listdir(os.fsencode(env.root / "failed")) if p.startswith(b"bad\xff@")]
    assert len(refused) == 1
    folder = os.fsencode(env.root / "failed") + b"/" + refused[0]
    with open(folder + b"/order.json", "rb") as fh:
        assert fh.read() == data
    with open(folder + b"/result.json", "rb") as fh:
        result = json.loads(fh.read())
    assert result["reason"].startswith("the file name is not valid UTF-8")
    assert result["job_id"] == "NAME-1"  # read from the order inside: the refusal is found by its id
    assert starts(env, "NAME-1") == 0
    shown = env.cli("show", "NAME-1")
    assert shown.returncode == 0 and shown.stdout.startswith("NAME-1  refused"), shown.stdout + shown.stderr


# -- one file that cannot be taken -------------------------------------------------------------


def test_a_name_whose_extension_fills_the_name_limit_is_refused_and_holds_up_nothing(env: Env) -> None:
    """`x.yyy...` (a 251-byte extension): refused as not a work order, its bytes kept under a cut `order.yyy...`
    name; an older valid order runs, `run --once` ends (exit 1), and no staging folder is left."""
    ok = env.drop(plain("OLDER-1"))
    os.utime(ok, (1_600_000_000, 1_600_000_000))  # the oldest: claimed first
    name = "x." + "y" * 250
    (env.root / "inbox" / name).write_bytes(b"hi\n")  # no daemon runs yet (a hidden temp name would be too long)
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert env.result("OLDER-1", "done")["state"] == "done"
    (folder,) = env.refusals()
    assert folder.name.startswith("x@")
    kept = folder / ("order." + "y" * 200)  # the extension's first 200 bytes after its dot (README: limits)
    assert kept.read_bytes() == b"hi\n" and sorted(p.name for p in folder.iterdir()) == sorted(
        [kept.name, "result.json"]
    )
    result = json.loads((folder / "result.json").read_text())
    assert result["file"] == name and "not a work order" in result["reason"]
    assert list((env.root / ".state" / "staging").iterdir()) == []
    assert "daemon.error" not in proc.stdout


def test_one_file_the_daemon_cannot_move_does_not_hold_up_the_others(env: Env) -> None:
    """An order made immutable (`chattr +i`: it can be neither linked nor moved) stays in inbox/ and its error is
    logged, without a line every second; every other order runs. Once it can be moved, it is claimed."""
    stuck = env.drop(plain("STUCK-1"))
    os.utime(stuck, (1_600_000_000, 1_600_000_000))  # the oldest, first in every batch
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        d = env.daemon()
        d.wait_ready()
        for i in range(3):
            env.drop(plain(f"FREE-{i}"))
        for i in range(3):
            env.wait_job(f"FREE-{i}", "done", timeout=60)
        time.sleep(3.5)  # three retries or so of the stuck file
        errors = [e for e in d.events() if e["event"] == "daemon.error"]
        assert errors and all(e["file"] == "STUCK-1.json" and e["step"] == "claim" for e in errors), errors
        assert [e["tries"] for e in errors] in ([1, 2], [1, 2, 4]), errors  # not one a second
        assert stuck.exists() and not (env.root / "active" / "STUCK-1").exists()
        assert list((env.root / ".state" / "staging").iterdir()) == []  # no folder left by each try
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    env.wait_job("STUCK-1", "done", timeout=60)
    assert d.stop() == 0


def test_run_once_ends_without_a_file_it_can_never_take(env: Env) -> None:
    """`run --once` with an immutable order beside a valid one: the valid one runs, and after a few tries the
    daemon gives the stuck file up, logs `order.stuck` naming it, and exits 1; the file is left in inbox/ whole."""
    stuck = env.drop(plain("STUCK-2"))
    data = stuck.read_bytes()
    env.drop(plain("FREE-9"))
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        t0 = time.monotonic()
        proc = env.cli("run", "--once", timeout=60)
        took = time.monotonic() - t0
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert took < 30, took
    assert env.result("FREE-9", "done")["state"] == "done"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (given_up,) = [e for e in events if e["event"] == "order.stuck"]
    assert given_up["file"] == "STUCK-2.json" and given_up["level"] == "error" and given_up["tries"] >= 4
    assert stuck.read_bytes() == data and not (env.root / "active" / "STUCK-2").exists()
    assert list((env.root / ".state" / "staging").iterdir()) == []
    # taken once it can be: a second run claims it
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert env.result("STUCK-2", "done")["state"] == "done"


# -- orders that arrive by hard link ---------------------------------------------------------------


def test_a_jobs_order_linked_back_into_inbox_under_another_name_is_refused_as_known(env: Env) -> None:
    """`ln done/ID/order.json inbox/again.json` is a known id dropped again: refused with its bytes kept, never
    taken for the leftover of a crash (that is only ever the name the job was claimed from); the record untouched."""
    d = env.daemon()
    d.wait_ready()
    data = json.dumps(plain("LINKED-1")).encode()
    env.drop(data, "LINKED-1.json")
    env.wait_job("LINKED-1", "done")
    record = env.root / "done" / "LINKED-1" / "order.json"
    os.link(record, env.root / "inbox" / "again.json")
    refusal = env.wait_refused("again")
    assert "already known" in refusal["reason"] and refusal["file"] == "again.json"
    (folder,) = [p for p in env.refusals() if p.name.startswith("again@")]
    assert (folder / "order.json").read_bytes() == data and record.read_bytes() == data
    assert not (env.root / "inbox" / "again.json").exists()
    assert d.stop() == 0


def test_a_crash_before_a_hard_linked_orders_inbox_name_goes_drops_that_twin_at_the_next_start(env: Env) -> None:
    """kill -9 right after the job folder is placed, before the inbox name is unlinked (an order dropped with `ln`):
    the next start runs the job once and drops the name left in inbox/ as the claimed file's twin, refusing nothing."""
    draft = env.tmp / "draft.json"
    data = json.dumps(plain("TWIN-1")).encode()
    draft.write_bytes(data)
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    os.link(draft, env.root / "inbox" / "TWIN-1.json")
    run = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"]
    crashed = subprocess.run(
        run, env={**cli_env(), "DISPATCHER_FAULT": "claim.placed"}, capture_output=True, timeout=60
    )
    assert crashed.returncode == -signal.SIGKILL
    assert (env.root / "active" / "TWIN-1").is_dir() and (env.root / "inbox" / "TWIN-1.json").exists()
    again = env.cli("run", "--once", timeout=60)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    assert env.result("TWIN-1", "done")["state"] == "done" and env.refusals() == []
    assert not (env.root / "inbox" / "TWIN-1.json").exists() and draft.read_bytes() == data
    assert [e for e in again.stdout.splitlines() if "order.twin_dropped" in e]


# -- inbox/ itself removed or moved away ------------------------------------------------------------


@pytest.mark.parametrize("how", ["removed and made again", "moved away and made again", "removed"])
def test_inbox_removed_or_moved_away_is_watched_again_at_once(env: Env, how: str) -> None:
    """inbox/ removed (and made again by hand, or not) or moved away under a running daemon: the watch says so
    (`watcher.restarted`), inbox/ is there again, and an order renamed in is picked up in seconds, not at the
    next rescan (30 s here); a file written into the folder moved away is never taken for one in inbox/."""
    env.configure(rescan_interval=30)
    d = env.daemon()
    d.wait_ready()
    inbox = env.root / "inbox"
    if how == "moved away and made again":
        inbox.rename(env.root / "inbox.old")
        inbox.mkdir(exist_ok=True)  # the daemon may have made it again first: it does so at once
    else:
        shutil.rmtree(inbox)
        if how == "removed and made again":
            inbox.mkdir(exist_ok=True)
    wait_until(inbox.is_dir, 10, "inbox/ made again")
    d.wait_event("watcher.restarted", timeout=10)
    if how == "moved away and made again":
        (env.root / "inbox.old" / "WATCH-1.json").write_text("junk\n")  # an event of the old folder: no file here
    t0 = time.monotonic()
    env.drop(plain("WATCH-1"))
    env.wait_job("WATCH-1", "done", timeout=60)
    assert time.monotonic() - t0 < 10, "picked up only by a rescan"
    assert d.stop() == 0


HOG = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while (fd := libc.inotify_init1(os.O_CLOEXEC)) >= 0:
    fds.append(fd)
print(len(fds), flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


@pytest.mark.alone  # every inotify instance of the user is taken: another test's daemon would poll meanwhile
def test_a_daemon_short_of_inotify_instances_lists_inbox_every_poll_interval(env: Env) -> None:
    """Every inotify instance of the user taken: `run` logs `watcher.failed` once and picks orders up by listing
    inbox/ every poll_interval, instead of exiting; once instances are free again, it watches (`watcher.restarted`)."""
    env.configure(poll_interval=0.5)
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and int(hog.stdout.readline()) > 0
        d = env.daemon()
        d.wait_ready()
        failed = [e for e in d.events() if e["event"] == "watcher.failed"]
        assert len(failed) == 1 and failed[0]["level"] == "error", failed
        env.drop(plain("POLLED-1"))
        env.wait_job("POLLED-1", "done", timeout=60)
    finally:
        assert hog.stdin is not None and hog.stdout is not None
        hog.stdin.close()
        hog.stdout.close()
        hog.wait(10)
    d.wait_event("watcher.restarted", timeout=30)
    assert len([e for e in d.events() if e["event"] == "watcher.failed"]) == 1  # said once, not at every rescan
    assert d.stop() == 0


def test_a_staging_folder_removed_by_hand_is_made_again_at_the_next_claim(env: Env) -> None:
    """`rm -rf .state/staging` while the daemon runs: the next orders are claimed and done, not refused
    and not left in inbox/ with a `daemon.error` at every try."""
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ST-0"))
    env.wait_job("ST-0", "done")
    shutil.rmtree(env.root / ".state" / "staging")
    env.drop(order("ST-1"))
    env.wait_job("ST-1", "done")
    assert d.stop() == 0
    assert not [e for e in d.events() if e.get("event") == "daemon.error"]


def test_active_removed_by_hand_is_made_again_at_the_next_claim(env: Env) -> None:
    """`rmdir active/` while the daemon is idle: the next order is claimed and done, not left in inbox/ with a
    `daemon.error` every second."""
    d = env.daemon()
    d.wait_ready()
    (env.root / "active").rmdir()
    env.drop(order("AC-1"))
    env.wait_job("AC-1", "done")
    assert d.stop() == 0
    assert not [e for e in d.events() if e.get("event") == "daemon.error"]


@pytest.mark.parametrize("how", ["join", "retry", "revise", "retried join"])
def test_a_folder_removed_by_hand_is_made_again_for_a_join_a_retry_and_a_revision(env: Env, how: str) -> None:
    """`rmdir active/` (or `waiting/`) while the daemon is idle, then a join's parent is approved, a failed job is
    retried or a job in review/ is revised: the folder is made again and the job runs. Before, each logged one
    `daemon.error` and stayed where it was until the daemon restarted."""
    env.configure(
        agents={
            "worker": env.agent(),
            "rev": env.agent(review=True),
            "bad": env.agent("--fail-attempts", "1", max_attempts=1),
        }
    )
    d = env.daemon()
    d.wait_ready()
    if how == "join":
        env.drop(order("V1", to="rev"))
        env.drop(order("C1", after=["V1"]))
        d.wait_event("job.review", job_id="V1")  # logged once the folder is in review/
        wait_until(lambda: not any((env.root / "active").iterdir()), 30, "V1 out of active/")
        (env.root / "active").rmdir()
        env.cli("approve", "V1", check=True)
        d.wait_event("job.done", job_id="C1", timeout=30)
    elif how == "retry":
        env.drop(order("X2", to="bad"))
        env.wait_job("X2", "failed")
        (env.root / "active").rmdir()
        env.cli("retry", "X2", check=True)
        d.wait_event("job.done", job_id="X2", timeout=30)
    elif how == "revise":
        env.drop(order("X3", to="rev"))
        d.wait_event("job.review", job_id="X3")
        wait_until(lambda: not any((env.root / "active").iterdir()), 30, "X3 out of active/")
        (env.root / "active").rmdir()
        env.cli("revise", "X3", "--note", "again", check=True)
        d.wait_event("job.revised", job_id="X3", timeout=30)
        wait_until(lambda: (env.root / "review" / "X3" / "attempts" / "2").is_dir(), 30, "X3 in review/ again")
    else:
        env.drop(order("P1"))
        env.drop(order("J1", to="bad", after=["P1"]))
        env.wait_job("J1", "failed")
        (env.root / "waiting").rmdir()
        env.cli("retry", "J1", check=True)
        d.wait_event("job.done", job_id="J1", timeout=30)
    assert d.stop() == 0
    assert not [e for e in d.events() if e.get("event") == "daemon.error"]


@pytest.mark.parametrize("removed", ["done", "failed"])
def test_a_state_folder_removed_by_hand_is_made_again_and_nothing_stays_behind(env: Env, removed: str) -> None:
    """`rm -rf done/` (or `failed/`) while a job runs: the job still lands there, the folder made again, and a bad
    file dropped then is refused into failed/ with its bytes, not left in .state/staging/."""
    env.configure(agents={"worker": env.agent("--sleep", "1")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RM-1"))
    d.wait_event("agent.started", job_id="RM-1")
    shutil.rmtree(env.root / removed)
    bad = env.root / "inbox" / "BAD-1.json"
    bad.write_bytes(b'{"job_id": "BAD-1"')
    env.wait_job("RM-1", "done")
    wait_until(lambda: env.refusals(), 30, "the refusal of BAD-1")
    assert d.stop() == 0
    assert (env.root / "done" / "RM-1" / "result.json").exists() and not (env.root / "active" / "RM-1").exists()
    (refused,) = [p for p in (env.root / "failed").iterdir() if p.name.startswith("BAD-1@")]
    assert (refused / "order.json").read_bytes() == b'{"job_id": "BAD-1"'
    assert os.listdir(env.root / ".state" / "staging") == []


@pytest.mark.parametrize("crashed", [False, True])
def test_7_a_daemon_started_on_a_full_disk_waits_for_room(env: Env, crashed: bool) -> None:
    """(7) a daemon started on a full disk (its root made and used before, by a daemon that stopped or was killed)
    waits, saying so, and starts when there is room; after a crash (the ledger's -wal and -shm kept) it opened the
    ledger, exited 1 with a traceback where its info file could not be written, and left that file's .tmp in
    .state/daemons/ for good."""
    with tmpfs(env.tmp / "disk", "2m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(agents={"worker": sleeper(env, 0)}, root=str(root))
        if crashed:
            first = env.daemon()
            first.wait_ready()
            env.drop(plain("BEFORE-1"))
            env.wait_job("BEFORE-1", "done", timeout=40)
            first.kill()
        else:
            assert env.cli("run", "--once").returncode == 0  # the ledger and the layout, made while there was room
        filler = fill(disk, 0)
        d = env.daemon()
        waits = ("daemon.short_of", "ledger.waiting")  # the info file's write, or SQLite's own at the ledger's open

        def waiting() -> list[dict[str, Any]]:
            return [e for e in d.events() if e.get("event") in waits]

        wait_until(waiting, 30, "the daemon to say it waits")
        time.sleep(1.5)
        assert d.proc is not None and d.proc.poll() is None, d.post_mortem()
        filler.unlink()
        d.wait_ready()
        env.drop(plain("ROOM-1"))
        env.wait_job("ROOM-1", "done", timeout=40)
        short = [e for e in waiting() if e["event"] == "daemon.short_of"]
        assert all((e["resource"], e["step"]) == ("disk space", "start") for e in short) and len(short) <= 1
        assert d.stop(timeout=15) == 0
        assert [n for n in os.listdir(root / ".state" / "daemons") if n.endswith(".tmp")] == []


def test_7_registering_on_a_full_disk_is_tried_again_until_there_is_room(env: Env) -> None:
    """(7) the start's register step (the liveness lock, then the info file) on a full disk, as the daemon runs it
    (``startup.while_short``): it is tried again, holding its own lock, until the disk has room; then the info file
    is there and no .tmp is left. It raised ENOSPC, which ended the daemon's start with a traceback."""
    import asyncio
    import threading

    from dispatcher.core import startup
    from dispatcher.ledger.base import DaemonInfo
    from dispatcher.ledger.sqlite import SqliteLedger

    with tmpfs(env.tmp / "disk", "2m") as disk:
        state = disk / ".state"
        state.mkdir()
        ledger = SqliteLedger(state / "ledger.sqlite3", state)
        try:
            filler = fill(disk, 0)
            info = DaemonInfo("host-1-abcdef", os.getpid(), "host", time.time())
            threading.Timer(1.5, filler.unlink).start()
            began = time.monotonic()
            asyncio.run(startup.while_short(lambda: asyncio.to_thread(ledger.register, info), lambda: False))
            assert time.monotonic() - began >= 1.0, "the disk was full: the first try cannot have passed"
            assert sorted(os.listdir(state / "daemons")) == ["host-1-abcdef.json", "host-1-abcdef.lock"]
            assert [d.owner for d in ledger.daemons() if d.alive] == ["host-1-abcdef"]
        finally:
            ledger.close()


def test_7_a_reload_on_a_full_disk_is_recorded_once_there_is_room(env: Env) -> None:
    """(7) a reload met a full disk where the daemon records the config it loaded (its info file): once the disk
    has room it is recorded at the next rescan, so `status` does not say the file changed since the daemon loaded
    it (it said so for as long as the daemon ran, and a .tmp stayed in .state/daemons/)."""
    with tmpfs(env.tmp / "disk", "2m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(agents={"worker": sleeper(env, 0)}, root=str(root), rescan_interval=0.5)
        d = env.daemon()
        d.wait_ready()
        filler = fill(disk, 0)
        env.configure(agents={"worker": sleeper(env, 0)}, root=str(root), rescan_interval=0.5, max_jobs=3)
        d.signal(signal.SIGHUP)
        d.wait_event("config.reloaded")
        time.sleep(1.0)
        filler.unlink()

        def noted() -> bool:
            proc = env.cli("status")
            assert proc.returncode == 0, proc.stderr
            return "has changed since" in proc.stdout + proc.stderr

        wait_until(lambda: not noted(), 20, "status to see the config the daemon loaded")
        assert [n for n in os.listdir(root / ".state" / "daemons") if n.endswith(".tmp")] == []
        assert d.stop(timeout=15) == 0


def test_7_reading_commands_work_on_a_full_disk_with_no_daemon(env: Env) -> None:
    """(7) reading commands (status, list, show) on a full disk with no daemon running read the ledger, which is
    whole in its file then; they exited 2, "the ledger cannot be opened (disk I/O error)"."""
    with tmpfs(env.tmp / "disk", "2m") as disk:
        root = disk / "dispatch"
        root.mkdir()
        env.root = root
        env.configure(agents={"worker": sleeper(env, 0)}, root=str(root))
        env.drop(plain("READ-1"))
        assert env.cli("run", "--once").returncode == 0
        filler = fill(disk, 0)
        try:
            status = env.cli("status", "--json")
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["counts"]["done"] == 1
            listed = env.cli("list")
            assert listed.returncode == 0 and "READ-1" in listed.stdout, listed.stderr
            shown = env.cli("show", "READ-1")
            assert shown.returncode == 0 and "done" in shown.stdout, shown.stderr
        finally:
            filler.unlink()
