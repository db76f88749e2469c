"""`dispatcher status` (contract 7): counts, the daemons on the root, active jobs and whose they are, spend."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, namespaced_daemon, order, wait_until

from dispatcher.layout import Layout
from dispatcher.store.counts import queue_counts

COUNT_KEYS = {"inbox", "held", "active", "waiting", "review", "done", "failed", "refused"}


def status(env: Env) -> dict[str, Any]:
    """Return `status --json` as data (it must exit 0)."""
    proc = env.cli("status", "--json", check=True)
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def costing(env: Env, usd: float) -> dict[str, Any]:
    """Return the fake agent reporting usd as its total_cost_usd, as headless agent CLIs do."""
    return env.agent("--json-result", json.dumps({"total_cost_usd": usd, "num_turns": 1}))


def test_fresh_root_shows_zero_counts_no_daemons_and_says_none_is_running(env: Env) -> None:
    """On a root no daemon ever ran on, every count is 0, `daemons` is empty and the text says no daemon runs."""
    (env.root / "inbox").mkdir()
    data = status(env)
    assert data["counts"] == dict.fromkeys(COUNT_KEYS, 0)
    assert data["daemons"] == []
    assert data["active"] == []
    text = env.cli("status", check=True).stdout
    assert "no daemon is running" in text, text


def test_live_daemon_is_listed_and_a_killed_one_flags_its_active_job(env: Env) -> None:
    """A running daemon is listed alive with pid and host; killed, it is listed dead and its active job is flagged."""
    env.configure(agents={"slow": env.agent("--sleep", "60")}, stop_timeout=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SLOW-1", to="slow"))
    wait_until(lambda: any(job == "SLOW-1" for job, _ in env.starts()), 30, "the slow agent to start")
    assert d.proc is not None
    pid = d.proc.pid

    live = status(env)
    assert [(x["pid"], x["host"], x["alive"]) for x in live["daemons"]] == [(pid, socket.gethostname(), True)]
    assert set(live["daemons"][0]) == {"owner", "pid", "host", "alive", "started"}
    (job,) = live["active"]
    assert set(job) == {"job_id", "agent", "pid", "host", "age_s", "daemon_alive"}
    assert (job["job_id"], job["agent"], job["pid"], job["daemon_alive"]) == ("SLOW-1", "slow", pid, True)
    text = env.cli("status", check=True).stdout
    assert "no daemon is running" not in text and "not running" not in text, text
    shown = json.loads(env.cli("show", "SLOW-1", "--json", check=True).stdout)
    [under_way] = shown["attempts"]  # no record yet: it is written when the attempt ends
    assert (under_way["n"], under_way["running"]) == (1, True) and under_way["started"].endswith("Z"), under_way
    assert under_way["logs"]["stderr"].endswith("/attempts/1/stderr.log")
    assert f"#1  {under_way['started']}  running as pid {under_way['pid']}" in env.cli("show", "SLOW-1").stdout

    d.kill()
    dead = status(env)
    assert [(x["pid"], x["alive"]) for x in dead["daemons"]] == [(pid, False)]
    (job,) = dead["active"]
    assert (job["job_id"], job["pid"], job["daemon_alive"]) == ("SLOW-1", pid, False)
    text = env.cli("status", check=True).stdout
    assert "no daemon is running" in text, text
    job_line = next(line for line in text.splitlines() if line.startswith("SLOW-1"))
    assert "daemon not running" in job_line and str(pid) in job_line, text


def test_show_of_a_running_attempt_gives_the_argv_it_runs_and_its_host(env: Env) -> None:
    """`show` lists each attempt with the argv it ran (section 7), the one under way too: the resumed session's."""
    base = env.agent()["command"]
    spec = env.agent("--fail-attempts", "1", "--json-result", json.dumps({"session_id": "S-7"}))
    spec |= {"resume": [*base, "--sleep", "60", "--field", "session={session_id}"], "max_attempts": 2}
    spec |= {"retry_safe": True}
    env.configure(agents={"worker": spec}, stop_timeout=1)
    env.daemon().wait_ready()
    env.drop(order("ARGV-1"))
    wait_until(lambda: ("ARGV-1", 2) in env.starts(), 30, "the second attempt to start")
    agent_pid = int(env.count_file.read_text().splitlines()[-1].split()[2])
    ran = Path(f"/proc/{agent_pid}/cmdline").read_bytes().decode().split("\0")[:-1]

    shown = json.loads(env.cli("show", "ARGV-1", "--json", check=True).stdout)
    first, under_way = shown["attempts"]
    assert first["argv"] == spec["command"] and first["host"] == socket.gethostname()
    assert under_way["running"] is True and under_way["pid"] == agent_pid
    assert under_way["argv"] == ran == [*base, "--sleep", "60", "--field", "session=S-7"], under_way
    assert under_way["host"] == socket.gethostname()
    text = env.cli("show", "ARGV-1").stdout
    assert f"running as pid {agent_pid}  host {socket.gethostname()}" in text, text
    assert "argv: " + " ".join([*base, "--sleep", "60", "--field", "session=S-7"]) in text, text


def test_show_of_an_attempt_under_way_in_another_pid_namespace_says_it_runs(env: Env) -> None:
    """A daemon in a pid namespace of its own (a container under this host's name, or another host: this /proc
    holds none of its processes) runs an agent: `show` from here says it runs, as long as its daemon lives, and
    never that its agent is gone; once that daemon is dead, it says so."""
    import signal

    from conftest import namespaced_daemon

    env.configure(agents={"worker": env.agent("--sleep", "60")})
    other = namespaced_daemon(env.config_path, env.tmp / "other.log", env.tmp)
    try:
        env.drop(order("NS-1"))
        wait_until(lambda: ("NS-1", 1) in env.starts(), 30, "the agent to start")

        def under_way() -> dict[str, Any]:
            attempts = json.loads(env.cli("show", "NS-1", "--json", check=True).stdout)["attempts"]
            return attempts[-1]  # type: ignore[no-any-return]

        wait_until(lambda: under_way().get("pid") is not None, 30, "the agent's note")
        assert under_way()["running"] is True, under_way()
        text = env.cli("show", "NS-1").stdout
        assert "running as pid" in text and "its agent gone" not in text, text
    finally:
        other.send_signal(signal.SIGKILL)  # its daemon and its agent, the whole namespace
        other.wait(30)
    assert under_way()["running"] is False


def test_a_stray_file_in_a_state_folder_is_no_job(env: Env) -> None:
    """A file put by hand into active/ (or review/, done/, failed/) is no job (section 1: those folders hold jobs):
    `run --once` neither recovers nor waits for it, its name is not claimed in the ledger, and `status` and `list`
    count and list none of them. A job folder beside them is all they show."""
    env.drop(order("REAL-1"))
    assert env.cli("run", "--once", timeout=60).returncode == 0
    strays = {state: env.root / state / "README.txt" for state in ("active", "review", "done", "failed")}
    for path in strays.values():
        path.write_text("a note\n")
    once = env.cli("run", "--once", timeout=60)
    assert once.returncode == 0, once.stdout + once.stderr
    assert "README.txt" not in once.stdout, once.stdout
    assert all(path.read_text() == "a note\n" for path in strays.values())
    data = status(env)
    assert data["counts"]["active"] == 0 and data["counts"]["done"] == 1 and data["active"] == []
    assert data["counts"]["failed"] == 0 and data["counts"]["refused"] == 0 and data["counts"]["review"] == 0
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert [(row["job_id"], row["state"]) for row in listed] == [("REAL-1", "done")]
    unknown = env.cli("show", "README.txt")  # the stray's name was never claimed as a job id in the ledger
    assert unknown.returncode == 1 and "no such job" in unknown.stderr, (unknown.stdout, unknown.stderr)


def test_spend_of_the_last_24_hours_per_agent(env: Env) -> None:
    """`status` sums the cost the agents reported for jobs finished in the last 24 h, per agent."""
    env.configure(agents={"worker": costing(env, 0.25), "other": costing(env, 0.125)})
    env.drop(order("PAY-1"))
    env.drop(order("PAY-2"))
    env.drop(order("PAY-3", to="other"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert status(env)["spend_24h"] == {"other": 0.125, "worker": 0.5}
    text = env.cli("status", check=True).stdout
    assert "worker 0.5 USD" in text and "other 0.125 USD" in text, text


def test_a_tiny_reported_spend_is_not_rounded_away(env: Env) -> None:
    """A cost of 1e-10 USD is spend: `status` shows it as `list` and `show` do, never as 0."""
    env.configure(agents={"worker": costing(env, 1e-10)})
    env.drop(order("TINY-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert status(env)["spend_24h"] == {"worker": 1e-10}
    assert "worker 0.0000000001 USD" in env.cli("status", check=True).stdout


def test_held_orders_and_jobs_in_review_are_counted(env: Env) -> None:
    """Orders in held/ count as `held` (not inbox), job folders in review/ as `review`."""
    env.drop(order("DONE-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0  # a ledger that knows a job, as on any used root
    env.drop(order("Q-1"))
    held = env.root / "held"
    (held / "H-1.json").write_text(json.dumps(order("H-1")))
    (held / ".H-2.json.tmp").write_text("{}")
    (env.root / "review" / "R-1").mkdir()
    counts = status(env)["counts"]
    assert (counts["inbox"], counts["held"], counts["review"]) == (1, 1, 1)


def test_status_text_has_no_python_notation(env: Env) -> None:
    """`status` text for a person never shows None, True/False or a Python list, also for a job with no cost."""
    env.configure(agents={"worker": env.agent(), "bad": env.agent("--exit", "3")})
    env.drop(order("FINE-1"))
    env.drop(order("BAD-1", to="bad"))
    assert env.cli("run", "--once", timeout=120).returncode == 1
    text = env.cli("status", check=True).stdout
    assert "stopped" in text and "done 1" in text and "failed 1" in text, text
    for python in ("None", "True", "False", "['", "{'"):
        assert python not in text, text


def test_queue_counts_counts_orders_and_jobs_without_temp_names(tmp_path: Path) -> None:
    """`queue_counts` counts orders in inbox/ and held/ (no hidden or temp name), jobs in active/, waiting/, review/."""
    layout = Layout(tmp_path)
    layout.create()
    for name in ("a.json", "b.yaml", ".c.json", "d.json.tmp", "e.part"):
        (layout.inbox / name).write_text("{}")
    (layout.held / "f.json").write_text("{}")
    for job in ("J1", "J2"):
        (layout.root / "active" / job).mkdir()
    (layout.root / "review" / "J3").mkdir()
    os.mkdir(layout.root / "active" / ".staging-leftover")
    (layout.root / "waiting" / "J4").mkdir()
    assert queue_counts(layout) == {"inbox": 2, "held": 1, "active": 2, "waiting": 1, "review": 1}


def test_a_file_name_with_control_characters_never_reaches_the_terminal_raw(env: Env) -> None:
    """`show` and `hold` of a queued order, and `show` of a refused file, print a name's ESC and BEL escaped."""
    title = "\x1b]0;OWNED\x07"
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    (env.root / "inbox" / f"q{title}.json").write_text(json.dumps(order("QUEUED-1")))  # no daemon: it stays queued
    outputs = [env.cli("show", "QUEUED-1", check=True).stdout, env.cli("hold", "QUEUED-1", check=True).stdout]
    outputs.append(env.cli("show", "QUEUED-1", check=True).stdout)  # now in held/
    env.drop(b"{not json", name=f"r{title}.json")
    assert env.cli("run", "--once", timeout=120).returncode == 1
    [refused] = [p.name for p in (env.root / "failed").iterdir()]
    outputs.append(env.cli("show", refused, check=True).stdout)
    outputs.append(env.cli("show", f"r{title}.json", check=True).stdout)  # by its file's name, as given
    for text in outputs:
        assert "\x1b" not in text and "\x07" not in text, text
        assert "\\x1b]0;OWNED\\x07" in text, text


def test_an_unread_orders_agent_with_control_characters_never_reaches_the_terminal_raw(env: Env) -> None:
    """`show` and `show --tree` of a queued order whose `to` holds an ESC and a line break print them escaped,
    as `list` does: no screen cleared, no forged line."""
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    bad = {**order("ESC-1"), "to": "ev\x1b[2Jil\nFAKE"}
    (env.root / "inbox" / "ESC-1.json").write_text(json.dumps(bad))  # no daemon: it stays queued, unread
    for args in (["show", "ESC-1"], ["show", "--tree", "ESC-1"], ["list"]):
        text = env.cli(*args, check=True).stdout
        assert "\x1b" not in text and "\nFAKE" not in text, (args, text)
        assert "ev\\x1b[2Jil\\nFAKE" in text, (args, text)


def test_status_and_list_read_a_ledger_of_an_older_schema_before_any_daemon_upgraded_it(env: Env) -> None:
    """A ledger of an older schema (version 3: no gates, no gate waits, no spend index), as an older release left
    it: `status`, `list` and `show` read it through an upgraded copy in memory, leaving the file as it is; they
    failed with a traceback (no such table: gate_waits) until a daemon or a writing command had opened it."""
    import sqlite3

    env.configure()
    env.drop(order("OLD-1"))
    assert env.cli("run", "--once").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    with contextlib.closing(sqlite3.connect(ledger, isolation_level=None)) as db:
        db.execute("DROP TABLE gates")
        db.execute("DROP TABLE gate_waits")
        db.execute("DROP INDEX jobs_spent")
        db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = ledger.read_bytes()
    info = status(env)
    assert info["counts"]["done"] == 1 and info["gates"] == [] and info["waiting"] == [], info
    assert env.cli("status").returncode == 0
    for args in (["list"], ["list", "--json"], ["show", "OLD-1"]):
        proc = env.cli(*args)
        assert proc.returncode == 0 and "OLD-1" in proc.stdout, (args, proc.stderr)
    assert ledger.read_bytes() == before  # a reader changed nothing
    env.drop(order("NEW-1"))
    assert env.cli("run", "--once").returncode == 0  # the daemon upgrades it for good
    with contextlib.closing(sqlite3.connect(ledger)) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("4",)


@pytest.mark.parametrize("how", ["removed", "damaged"])
def test_a_daemons_info_file_removed_or_damaged_under_it_is_written_again(env: Env, how: str) -> None:
    """The daemon's own info file in the state folder removed (or its bytes damaged) while it runs: at its next
    rescan it is written again, so that `status` lists the daemon alive and `reload` reaches it; they said that no
    daemon was running for as long as it ran."""
    env.configure(rescan_interval=0.5)
    d = env.daemon()
    d.wait_ready()
    [info] = (env.root / ".state" / "daemons").glob("*.json")
    if how == "removed":
        info.unlink()
    else:
        info.write_text("garbage{")
    assert d.proc is not None
    pid = d.proc.pid

    def written_again() -> bool:
        try:
            return bool(json.loads(info.read_text())["pid"] == pid)
        except (OSError, ValueError):
            return False

    wait_until(written_again, 15, "the info file written again")
    daemons = status(env)["daemons"]
    assert [(x["pid"], x["alive"]) for x in daemons] == [(pid, True)], daemons
    proc = env.cli("reload")
    assert proc.returncode == 0, proc.stderr
    assert d.stop() == 0


def test_lock_files_deleted_under_a_running_daemon_are_locked_again(env: Env) -> None:
    """Its liveness lock and a slot's lock deleted (by hand, a tmp cleaner): at its next rescan the daemon locks
    both again and logs lock.lost; `status` still sees it alive, and a second daemon neither takes its running
    job over nor runs a second agent past `concurrency: 1`."""
    env.configure(agents={"slow": env.agent("--sleep", "8", concurrency=1)}, rescan_interval=0.5)
    first = env.daemon()
    first.wait_ready()
    env.drop(order("HELD-ON", to="slow"))
    wait_until(lambda: any(job == "HELD-ON" for job, _ in env.starts()), 30, "the slow agent to start")
    state = env.root / ".state"
    [life] = (state / "daemons").glob("*.lock")
    [slot] = (state / "slots").glob("slow.*.lock")
    life.unlink()
    slot.unlink()
    wait_until(lambda: len([e for e in first.events() if e.get("event") == "lock.lost"]) == 2, 15, "both locks again")
    assert life.exists() and slot.exists()
    assert [d["alive"] for d in status(env)["daemons"]] == [True]
    second = env.daemon()
    second.wait_ready()
    env.drop(order("NEXT-ONE", to="slow"))
    time.sleep(2.0)  # both daemons' turns: a slot past concurrency would start NEXT-ONE now
    assert [job for job, _ in env.starts()] == ["HELD-ON"]
    assert not [e for e in second.events() if e.get("event") in ("agent.orphan_ended", "job.recovered")]
    env.wait_job("HELD-ON", "done")
    env.wait_job("NEXT-ONE", "done")
    assert first.stop() == 0 and second.stop() == 0


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_daemon_whose_lock_file_was_deleted_is_alive_to_others_before_it_locks_it_again(env: Env, how: str) -> None:
    """Its liveness lock deleted (or replaced by a new empty file) under it, long before its next rescan locks it
    again: its info file still names its running process, so `status` lists it alive, `ledger rebuild` refuses,
    and a second daemon started then takes nothing over (it ended the healthy agent as an orphan and ran the job a
    second time beside it)."""
    env.configure(agents={"slow": env.agent("--sleep", "6")}, rescan_interval=60)
    first = env.daemon()
    first.wait_ready()
    env.drop(order("KEEP-ON", to="slow"))
    wait_until(lambda: any(job == "KEEP-ON" for job, _ in env.starts()), 30, "the slow agent to start")
    [life] = (env.root / ".state" / "daemons").glob("*.lock")
    life.unlink()
    if how == "replaced":
        life.touch()
    assert [d["alive"] for d in status(env)["daemons"]] == [True]
    rebuilt = env.cli("ledger", "rebuild")
    assert rebuilt.returncode == 2 and "a daemon is running" in rebuilt.stderr, rebuilt.stderr
    second = env.daemon()
    second.wait_ready()
    env.wait_job("KEEP-ON", "done")
    assert [job for job, _ in env.starts()] == ["KEEP-ON"]
    assert not [e for e in second.events() if e.get("event") in ("agent.orphan_ended", "job.recovered")]
    assert first.stop() == 0 and second.stop() == 0


def test_a_crashed_daemons_lock_file_left_free_is_dead_whoever_has_its_pid_now(env: Env) -> None:
    """A daemon that crashed leaves its lock file in place, held by no one: it is dead, even when its pid now names
    another live dispatcher started within a second of it (a container restarted at once is pid 1 again, often in a
    pid namespace of the same number). Its info file notes the lock file it made; a free lock that is that file is
    a crash, never asked about by process."""
    import socket as _socket

    env.configure()
    live = env.daemon()
    live.wait_ready()
    assert live.proc is not None
    folder = env.root / ".state" / "daemons"
    host = _socket.gethostname().replace(".", "_")
    dead = f"{host}-{live.proc.pid}-dead00"
    lock = folder / f"{dead}.lock"
    lock.touch()
    pidns = os.readlink("/proc/self/ns/pid").rpartition("[")[2].rstrip("]")
    info = {"pid": live.proc.pid, "host": _socket.gethostname(), "started": time.time(), "config_digest": None,
            "pidns": pidns, "lock_ino": lock.stat().st_ino}  # fmt: skip
    (folder / f"{dead}.json").write_text(json.dumps(info))
    alive = {d["owner"]: d["alive"] for d in status(env)["daemons"]}
    assert alive[dead] is False and list(alive.values()).count(True) == 1, alive
    assert live.stop() == 0


@pytest.mark.parametrize("lock", ["deleted", "left"])
def test_a_dead_daemon_of_another_pid_namespace_whose_lock_was_deleted_is_dead(env: Env, lock: str) -> None:
    """Two daemons in pid namespaces of their own under this host's name are both pid 1, the second started at once
    (a container restarted: the kernel may give its new namespace the dead one's number). The first is killed (-9)
    with a job running, its lock file deleted or left as a crash leaves it: the second does not take the dead one's
    pid for its own live process (pid 1 in its /proc is itself), so it recovers the job (it waited for ever)."""
    env.configure(agents={"slow": env.agent("--sleep", "30")}, rescan_interval=0.5)
    env.drop(order("NS-LEFT", to="slow"))  # claimed at the first daemon's start: it is killed within a second
    first = namespaced_daemon(env.config_path, env.tmp / "ns-a.log", env.tmp)
    second = None
    try:
        wait_until((env.root / "active" / "NS-LEFT").exists, 30, "the claim")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        [life] = (env.root / ".state" / "daemons").glob("*.lock")
        if lock == "deleted":
            life.unlink()
        time.sleep(0.2)
        second = namespaced_daemon(env.config_path, env.tmp / "ns-b.log", env.tmp)

        def recovered() -> bool:
            lines = (env.tmp / "ns-b.log").read_text(errors="replace").splitlines()
            return any('"job.recovered"' in line and '"NS-LEFT"' in line for line in lines)

        wait_until(recovered, 60, "the second daemon to recover the dead one's job")
        assert "daemon.shared" not in (env.tmp / "ns-b.log").read_text(errors="replace")
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)


def test_status_tells_apart_two_daemons_with_one_pid_under_one_host_name(env: Env) -> None:
    """Two daemons in pid namespaces of their own under this host's name (containers sharing it) are both pid 1:
    plain `status` names each one's owner on its line, as `status --json` does, so the two lines differ."""
    others = [namespaced_daemon(env.config_path, env.tmp / f"ns{i}.log", env.tmp) for i in (1, 2)]
    try:

        def entries() -> list[dict[str, Any]]:
            return [d for d in json.loads(env.cli("status", "--json").stdout)["daemons"] if d["alive"]]

        wait_until(lambda: [d["pid"] for d in entries()] == [1, 1], 30, "both daemons' entries")
        owners = sorted(d["owner"] for d in entries())
        text = env.cli("status", check=True).stdout
        lines = sorted(line for line in text.splitlines() if line.startswith("  running  pid 1 "))
        assert len(lines) == 2 and lines[0] != lines[1], text
        assert sorted(line.rsplit("  (", 1)[1].rstrip(")") for line in lines) == owners, text
    finally:
        for p in others:
            p.send_signal(signal.SIGKILL)
            p.wait(30)


def test_status_and_list_while_the_first_daemon_waits_to_make_the_ledger(env: Env) -> None:
    """A daemon's first start made the ledger file but not yet its tables (another process holds the file locked,
    or the two daemons of a fresh root start together): `status` and `list` answer for a root with nothing
    recorded yet; they failed with exit 2, calling the ledger unreadable (no such table: meta) and naming
    `ledger rebuild`. The daemon makes every table in one commit once the lock is gone."""
    import sqlite3

    env.configure()
    ledger = env.root / ".state" / "ledger.sqlite3"
    ledger.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(ledger, isolation_level=None)) as holder:
        holder.execute("PRAGMA journal_mode=WAL")
        holder.execute("BEGIN IMMEDIATE")
        d = env.daemon()
        time.sleep(1.5)  # the daemon is past making the file, waiting for the lock
        assert d.proc is not None and d.proc.poll() is None
        for args in (["status", "--json"], ["list", "--json"], ["status"]):
            proc = env.cli(*args)
            assert proc.returncode == 0, (args, proc.stderr)
        assert status(env)["counts"] == dict.fromkeys(COUNT_KEYS, 0)
        assert env.cli("list", "--json", check=True).stdout == ""  # JSON lines: no job, no line
        holder.execute("ROLLBACK")
    d.wait_ready()
    env.drop(order("FIRST-1"))
    env.wait_job("FIRST-1", "done")
    assert status(env)["counts"]["done"] == 1
    assert d.stop() == 0


def test_a_ledger_file_with_no_tables_beside_job_folders_is_an_empty_ledger(env: Env) -> None:
    """A ledger file with no tables (its schema never made) while job folders exist: the reading commands say what
    `run` says of it, that the ledger is empty but job folders exist, naming `ledger rebuild` (exit 2)."""
    import sqlite3

    env.configure()
    env.drop(order("KEPT-1"))
    assert env.cli("run", "--once").returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(ledger, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode=WAL")
    said = []
    for args in (["status"], ["list"], ["show", "KEPT-1"], ["run", "--once"]):
        proc = env.cli(*args)
        assert proc.returncode == 2 and "ledger rebuild" in proc.stderr, (args, proc.stderr)
        said.append(proc.stderr.split(": ", 1)[1].split(";")[0])
    assert set(said) == {"the ledger is empty but job folders exist"}, said
