"""The test infrastructure for many hosts: a real PostgreSQL server and simulated hosts.

These prove the fixtures of ``pgserver.py`` and ``netns.py`` before any ledger test leans
on them: the server answers from the root namespace and through a host's veth link, a
partition cuts a host off and a heal brings it back, an immediate restart drops every
connection and keeps committed data, and a host's whole process tree can be paused or
killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from netns import Host, Hosts, clean_leftovers
from pgserver import BASE_PREFIX, PgServer, PgUnavailable, find_bindir, running_server
from pgserver import clean_leftovers as pgserver_clean_leftovers

pytestmark = pytest.mark.postgres
pytest_plugins = ["pg_fixtures"]

# connects, prints the client address the server sees, exits 0; any failure exits non-zero
CLIENT = """
import sys, psycopg
with psycopg.connect(sys.argv[1], connect_timeout=2) as conn:
    print(conn.execute("select host(inet_client_addr())").fetchone()[0])
"""

# holds one idle connection open and prints its backend pid
HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], connect_timeout=2, autocommit=True)
print(conn.info.backend_pid, flush=True)
time.sleep(120)
"""


def client(host: Host, dsn: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the CLIENT script inside ``host`` and return its result."""
    proc = host.run([sys.executable, "-c", CLIENT, dsn], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def state(pid: int) -> str | None:
    """Return the one-letter state of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # it ended between the listing and the read
        return None
    return raw[raw.rindex(")") + 2]


def wait_for(predicate, timeout: float = 20.0, what: str = ""):
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value


def tree(host: Host) -> tuple[int, int, int]:
    """Start a child with a grandchild, and an orphan that left its parent, in ``host``.

    Returns (child, grandchild, orphan) pids once all three are running.
    """
    script = "sleep 300 & (sleep 302 &); echo $!; exec sleep 301"
    proc = host.run(["sh", "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())

    def orphan() -> int | None:
        found = [p for p in host.pids() if Path(f"/proc/{p}/cmdline").read_bytes() == b"sleep\x00302\x00"]
        return found[0] if found else None

    return proc.pid, grandchild, wait_for(orphan, what="the orphan sleep")


def test_server_answers_from_the_root_namespace(pg_dsn: str) -> None:
    """The session server starts and a psycopg connection from the test runs a query."""
    with psycopg.connect(pg_dsn, connect_timeout=5) as conn:
        assert conn.execute("select 1 + 1").fetchone() == (2,)


def test_server_settings_follow_pitfalls(pg_dsn: str) -> None:
    """The server runs with fsync on and lock-releasing timeouts of a few seconds."""
    names = ["fsync", "synchronous_commit", "idle_in_transaction_session_timeout"]
    names += ["tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"]
    with psycopg.connect(pg_dsn, connect_timeout=5) as conn:
        got = {name: conn.execute(f"show {name}").fetchone()[0] for name in names}
    assert got == {
        "fsync": "on",
        "synchronous_commit": "on",
        "idle_in_transaction_session_timeout": "2s",
        "tcp_keepalives_idle": "1",
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
    }


def test_pg_db_is_a_fresh_database_owned_by_the_role(pg_db: str, pg_dsn: str) -> None:
    """pg_db yields an empty database of its own, where the role may create tables."""
    assert pg_db.rsplit("/", 1)[1] != pg_dsn.rsplit("/", 1)[1]
    with psycopg.connect(pg_db, connect_timeout=5) as conn:
        assert conn.execute("select count(*) from pg_tables where schemaname = 'public'").fetchone() == (0,)
        conn.execute("create table t (id int primary key)")


def test_client_in_a_host_connects_through_its_veth(pg_server: PgServer, hosts: Hosts) -> None:
    """A client inside a namespace reaches the server at its gateway, from the host's own address."""
    host = hosts.add()
    result = client(host, pg_server.dsn_for(host.gateway))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == host.address


def test_two_hosts_have_their_own_subnets(pg_server: PgServer, hosts: Hosts) -> None:
    """Two hosts get distinct subnets and both reach the server at the same time."""
    one, two = hosts.add(), hosts.add()
    assert one.address != two.address
    procs = [
        h.run([sys.executable, "-c", CLIENT, pg_server.dsn_for(h.gateway)], stdout=subprocess.PIPE, text=True)
        for h in (one, two)
    ]
    assert [p.communicate(timeout=30)[0].strip() for p in procs] == [one.address, two.address]


@pytest.mark.parametrize(("how", "error"), [("drop", "timeout"), ("down", "unreachable")])
def test_partition_fails_a_connect_and_heal_restores_it(
    pg_server: PgServer, hosts: Hosts, how: str, error: str
) -> None:
    """partition() makes a host's connection attempt fail (drop: timeout, down: unreachable); heal() undoes it."""
    host = hosts.add()
    dsn = pg_server.dsn_for(host.gateway)
    assert client(host, dsn).returncode == 0
    host.partition(how)
    cut = client(host, dsn)
    assert cut.returncode != 0
    assert error in cut.stderr.lower(), cut.stderr
    host.heal()
    healed = client(host, dsn)
    assert healed.returncode == 0, healed.stderr
    assert healed.stdout.strip() == host.address


def test_server_ends_a_partitioned_hosts_session_within_seconds(pg_server: PgServer, hosts: Hosts) -> None:
    """The keepalive settings make the server drop an idle session of a cut-off host in seconds."""
    host = hosts.add()
    holder = host.run(
        [sys.executable, "-c", HOLDER, pg_server.dsn_for(host.gateway)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    backend = int(holder.stdout.readline())
    with psycopg.connect(pg_server.dsn, connect_timeout=5, autocommit=True) as conn:

        def sessions() -> int:
            row = conn.execute("select count(*) from pg_stat_activity where pid = %s", (backend,)).fetchone()
            return row[0] if row else 0

        assert sessions() == 1
        host.partition()
        t0 = time.monotonic()
        wait_for(lambda: sessions() == 0, timeout=30, what="the server to end the cut-off session")
        # 1 s idle + 3 probes 1 s apart, plus scheduling slack on a shared machine
        assert time.monotonic() - t0 < 15


def test_restart_immediate_drops_connections_and_keeps_data(pg_server: PgServer, pg_db: str) -> None:
    """restart("immediate") breaks open connections, the server comes back with committed rows."""
    with psycopg.connect(pg_db, connect_timeout=5, autocommit=True) as conn:
        conn.execute("create table t (id int primary key)")
        conn.execute("insert into t values (1)")
        pg_server.restart("immediate")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        assert conn.broken
    with psycopg.connect(pg_db, connect_timeout=5) as conn:
        assert conn.execute("select id from t").fetchall() == [(1,)]


def test_pause_and_resume_stop_the_whole_tree(hosts: Hosts) -> None:
    """pause() stops a host's child, grandchild and orphan alike; resume() lets them run again."""
    host = hosts.add()
    pids = tree(host)
    assert set(pids) <= host.pids()
    host.pause()
    assert [state(p) for p in pids] == ["T", "T", "T"]
    host.resume()
    wait_for(lambda: all(state(p) == "S" for p in pids), what="the tree to run again")


def test_kill_all_ends_every_process_of_a_host(hosts: Hosts) -> None:
    """kill_all() SIGKILLs a host's child, grandchild and orphan, even while they are stopped."""
    host, bystander = hosts.add(), hosts.add()
    pids = tree(host)
    spared = tree(bystander)
    host.pause()
    host.kill_all(signal.SIGKILL)
    assert host.pids() == set()
    assert all(state(p) in (None, "Z") for p in pids)
    assert all(state(p) == "S" for p in spared)


def test_close_removes_namespaces_links_and_processes() -> None:
    """Closing the factory leaves no namespace, link or process of its hosts behind."""
    factory = Hosts()
    host = factory.add()
    pids = tree(host)
    factory.close()
    assert all(state(p) in (None, "Z") for p in pids)
    assert host.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert host.veth_root not in links


def crashed_run(code: str) -> str:
    """Run ``code`` in a child Python that prints one line and waits; SIGKILL it; return the line."""
    here = Path(__file__).resolve().parent
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=here,
        env={**os.environ, "PYTHONPATH": str(here)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    assert line, "the child printed nothing"
    return line


def test_hosts_of_a_crashed_run_are_removed_and_a_live_runs_are_kept(hosts: Hosts) -> None:
    """Namespaces (and their processes) of a run killed by SIGKILL go at the next start; live ones stay."""
    live = hosts.add()
    code = (
        "import time, netns\n"
        "h = netns.Hosts().add()\n"
        "p = h.run(['sleep', '300'])\n"
        "print(h.name, p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    # the child printed the name only once the namespace existed; a parallel run may
    # clean it up first, so only its absence afterwards is asserted
    name, pid = crashed_run(code).split()
    clean_leftovers()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed
    assert live.name in listed
    wait_for(lambda: state(int(pid)) in (None, "Z"), what="the crashed run's sleep to die")


def test_a_server_of_a_crashed_run_is_stopped_and_removed() -> None:
    """The server and data folder of a run killed by SIGKILL go at the next clean-up."""
    code = (
        "import time, pgserver\n"
        "s = pgserver.PgServer().start()\n"
        "print(s.base, (s.base / 'data' / 'postmaster.pid').read_text().split()[0], flush=True)\n"
        "time.sleep(300)\n"
    )
    segments = set(Path("/dev/shm").glob("PostgreSQL.*"))
    base_text, pid = crashed_run(code).split()
    base, postmaster = Path(base_text), int(pid)
    pgserver_clean_leftovers()
    assert not base.exists()
    wait_for(lambda: state(postmaster) in (None, "Z"), what="the orphaned postmaster to die")
    # other tests' servers (and their initdb's probe) make and remove segments of their own meanwhile:
    # one that the killed server left stays for good, theirs go within seconds
    new = set(Path("/dev/shm").glob("PostgreSQL.*")) - segments
    deadline = time.monotonic() + 30
    while (left := {p for p in new if p.exists()}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the killed server left shared memory behind: {sorted(left)}"


def test_missing_binaries_fail_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without PostgreSQL binaries the server refuses to start with a message that says what to install."""
    monkeypatch.delenv("DISPATCHER_PG_BINDIR", raising=False)
    monkeypatch.setattr("pgserver.shutil.which", lambda name: None)
    monkeypatch.setattr("pgserver.glob.glob", lambda pattern: [])
    with pytest.raises(PgUnavailable, match=r"not found.*apt-get install postgresql"):
        find_bindir()


def test_close_stops_every_server_process_and_removes_the_data() -> None:
    """A server's close leaves no postgres process of it and no data folder behind."""
    with running_server() as server:
        assert server.base is not None
        base = server.base
        assert base.name.startswith(BASE_PREFIX)
        with psycopg.connect(server.dsn, connect_timeout=5) as conn:
            conn.execute("select 1")
    assert not base.exists()
    mine = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and state(int(entry)) not in (None, "Z"):
            try:
                if str(base).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    mine.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    assert mine == []
