"""Sections `pg`, `hosts`, `roundtrips` and `takeover`: the PostgreSQL ledger, on one host and many.

- `pg`: `run --once` over the same backlog with the SQLite ledger and with a PostgreSQL
  ledger, on this host: throughput and CPU per job, the server's CPU counted too.
- `hosts`: one daemon in each of 1, 2 and 3 simulated hosts (network namespaces) on one
  dispatch root and one database, fed by safe drops: throughput against one host.
- `roundtrips`: the ledger's transactions and statements per job, from the server's own
  counters (`pg_stat_database`, `pg_stat_statements`).
- `takeover`: every process of a host killed while it runs a job; the time until another
  host logs `host.lost` and starts the job again, against the lease.

The PostgreSQL server (`tests/pgserver.py`) and the hosts (`tests/netns.py`) are the test
suite's helpers, used outside pytest; each section starts its own server and removes it,
and its hosts, however it ends. The daemon is still driven only from outside: config
files, the dispatch folders, its JSON log lines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import (
    AGENT,
    READY_TIMEOUT_S,
    REPO,
    SLEEP_AGENT,
    BenchError,
    Daemon,
    children_cpu_s,
    job_ids,
    make_workdirs,
    missing_receipts,
    order_bytes,
    parse_ts,
    running_daemon,
    safe_drop,
    write_backlog,
    write_config,
)
from report import Result, Row
from throughput import steady_rate, xargs_run

# The server and host helpers live with the tests; they need nothing from pytest.
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))

from netns import Host, Hosts, NetnsUnavailable  # noqa: E402 - found through the path set above
from pgserver import PgServer, PgUnavailable, running_server  # noqa: E402

try:
    import psycopg
except ImportError:  # the SQLite-only install: the sections say so instead of failing
    psycopg = None  # type: ignore[assignment]

STARTUP_RUNS = 3
POLL_S = 0.02
# pg_stat_statements must be loaded when the server starts; only `roundtrips` needs it.
STATEMENT_SETTINGS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "top",
    "pg_stat_statements.track_utility": "on",
    "pg_stat_statements.max": "10000",
}
# Attempt 1 sleeps a minute (the host is killed meanwhile); a later attempt runs at once.
TAKEOVER_AGENT = 'if [ "$DISPATCH_ATTEMPT" = 1 ]; then sleep 60; fi; exec sh "$1"'
# The default `retry_delay`, written out: a recovered job's next attempt waits for it.
RETRY_DELAY_S = 2.0
# Slack for a log line, a ledger step and an agent's spawn on a busy 2-CPU machine.
TAKEOVER_SLACK_S = 0.5


# -- the server ------------------------------------------------------------------------


@contextlib.contextmanager
def pg_server(settings: dict[str, str] | None = None) -> Iterator[PgServer]:
    """Start a throwaway PostgreSQL server, yield it, always remove it.

    Raises BenchError with the helper's reason when no server can run here (no binaries).
    """
    if psycopg is None:
        raise BenchError("psycopg is not installed (pip install 'folder-dispatcher[postgres]')")
    try:
        server_cm = running_server(settings=settings or {})
        server = server_cm.__enter__()
    except PgUnavailable as exc:
        raise BenchError(f"no PostgreSQL server: {exc}") from None
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


@contextlib.contextmanager
def admin(server: PgServer) -> Iterator[Any]:
    """Yield an autocommit superuser connection to the `postgres` database over the unix socket."""
    assert server.base is not None and psycopg is not None
    conn = psycopg.connect(
        host=str(server.base / "sockets"), port=server.port, user="postgres", dbname="postgres", autocommit=True
    )
    try:
        yield conn
    finally:
        conn.close()


def server_cpu_s(server: PgServer) -> float:
    """Return user+sys CPU seconds of the server so far: the postmaster, its live children, its reaped ones.

    Backends that ended are in the postmaster's cutime/cstime (it reaps them); live ones are
    read one by one. Clock ticks (1/100 s): good for runs of seconds.
    """
    assert server.data is not None
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        pid, ppid = int(entry), int(fields[1])
        if pid == postmaster:
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        elif ppid == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def db_name(dsn: str) -> str:
    """Return the database name at the end of a DSN."""
    return dsn.rsplit("/", 1)[1]


def xacts(conn: Any, database: str) -> tuple[int, int]:
    """Return (commits, rollbacks) of database from pg_stat_database."""
    row = conn.execute(
        "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", (database,)
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def wait_sessions_gone(conn: Any, database: str, timeout: float = 30.0) -> None:
    """Wait until no session is connected to database.

    A backend flushes its counters to pg_stat_database when it exits; after a daemon's
    exit its backends end a moment later, and only then are its transactions counted.
    """
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)).fetchone()[0]:
        if time.monotonic() > deadline:
            raise BenchError(f"sessions on {database} still open {timeout:.0f} s after the daemon exited")
        time.sleep(0.05)


def statements(conn: Any, database: str) -> dict[str, int]:
    """Return {query text: calls} from pg_stat_statements for database."""
    rows = conn.execute(
        "SELECT s.query, sum(s.calls) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = %s GROUP BY s.query",
        (database,),
    ).fetchall()
    return {" ".join(str(q).split()): int(c) for q, c in rows}


# -- daemons ---------------------------------------------------------------------------


def wait_event(d: Daemon, name: str, timeout: float, job_id: str | None = None) -> dict[str, Any]:
    """Wait for d's first log line `name` (for job_id, when given); return it."""
    deadline = time.monotonic() + timeout
    while True:
        for e in d.named(name):
            if job_id is None or e.get("job_id") == job_id:
                return e
        if not d.running():
            raise BenchError(f"daemon exited ({d.exit_code()}) before logging {name}\n{d.symptoms()}")
        if time.monotonic() > deadline:
            raise BenchError(f"no {name} line within {timeout:.0f} s\n{d.symptoms()}")
        time.sleep(POLL_S)


def run_once(config: Path, root: Path, base: Path, ids: list[str], label: str, timeout: float) -> Daemon:
    """Write ids as a backlog into root, run `run --once` to its exit; return the reaped Daemon.

    Every id must end in done/.
    """
    write_backlog(root / "inbox", ids)
    d = Daemon(config, base, ["--once"], label=label)
    d.start()
    try:
        code = d.wait_exit(timeout)
    finally:
        d.stop()
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if code != 0 or done != len(ids):
        raise BenchError(f"run --once exited {code} with {done}/{len(ids)} jobs in done/\n{d.symptoms()}")
    return d


def startup(config: Path, root: Path, base: Path, label: str) -> tuple[float, float]:
    """Return the median (CPU s, wall s) of STARTUP_RUNS `run --once` on an empty inbox."""
    runs = [run_once(config, root, base, [], f"{label}-{k}", 120) for k in range(STARTUP_RUNS)]
    return statistics.median(d.cpu_s or 0.0 for d in runs), statistics.median(d.wall_s or 0.0 for d in runs)


def wait_all_done(daemons: list[Daemon], n: int, timeout: float) -> None:
    """Wait until the daemons together logged n `job.done` lines.

    Fails at the first `job.failed` or `job.refused`, or when a daemon exits.
    """
    deadline = time.monotonic() + timeout
    while True:
        done = 0
        for d in daemons:
            for e in d.events():
                if e.get("event") in ("job.failed", "job.refused"):
                    raise BenchError(f"a job did not end in done/: {e}\n{d.symptoms()}")
                done += e.get("event") == "job.done"
            if not d.running():
                raise BenchError(f"daemon exited ({d.exit_code()}) with {done}/{n} jobs done\n{d.symptoms()}")
        if done >= n:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{done}/{n} jobs done after {timeout:.0f} s\n{daemons[0].symptoms()}")
        time.sleep(POLL_S)


@contextlib.contextmanager
def cluster(
    base: Path,
    hosts: list[Host],
    server: PgServer,
    database: str,
    *,
    max_jobs: int,
    concurrency: int,
    command: list[str],
    extra: dict[str, Any] | None = None,
    agent_extra: dict[str, Any] | None = None,
    root: Path | None = None,
) -> Iterator[tuple[Path, list[Daemon]]]:
    """Start one `run` per host on one root and one database; wait until all are ready; yield (root, daemons).

    The root is base/dispatch unless given. Each host reaches the server at its own
    gateway address. Readiness is the `daemon.ready` log line: the notify socket is an
    abstract unix socket, which belongs to one network namespace. Every daemon is stopped
    at the end; the namespaces belong to the caller's Hosts.
    """
    root = root or base / "dispatch"
    daemons: list[Daemon] = []
    try:
        for i, host in enumerate(hosts, 1):
            hb = base / f"host{i}"
            hb.mkdir(parents=True)
            config, _ = write_config(
                hb,
                root=root,
                max_jobs=max_jobs,
                concurrency=concurrency,
                command=command,
                extra={"ledger": server.dsn_for(host.gateway, database), **(extra or {})},
                agent_extra=agent_extra,
                timeout_s=120,
            )
            d = Daemon(config, hb, [], label=f"host{i}", popen=host.run)
            d.start()
            daemons.append(d)
        for d in daemons:
            wait_event(d, "daemon.ready", READY_TIMEOUT_S)
        yield root, daemons
    finally:
        for d in daemons:
            d.stop()


def make_hosts(hosts: Hosts, k: int) -> list[Host]:
    """Return k new simulated hosts."""
    return [hosts.add() for _ in range(k)]


@contextlib.contextmanager
def simulated_hosts() -> Iterator[Hosts]:
    """Yield a Hosts factory; every namespace it made is removed at the end.

    Raises BenchError when namespaces cannot be made here (not root, no `ip`).
    """
    try:
        factory = Hosts()
    except NetnsUnavailable as exc:
        raise BenchError(f"no simulated hosts: {exc}") from None
    try:
        yield factory
    finally:
        factory.close()


# -- pg ----------------------------------------------------------------------------------


def section_pg(base: Path, opts: argparse.Namespace) -> Result:
    """`run --once` over N orders with the SQLite ledger, then a PostgreSQL one: throughput, CPU per job."""
    n, mj, timeout = opts.pg_orders, opts.max_jobs, opts.timeout
    res = Result()

    xb = base / "xargs"
    xb.mkdir()
    xids = job_ids("XARG", n)
    work = make_workdirs(xb, xids)
    wall_x, cpu_x = xargs_run(xb, ["sh", str(AGENT)], [[j, str(work / j)] for j in xids], mj, timeout)
    if missing := missing_receipts(work, xids):
        raise BenchError(f"xargs baseline: {len(missing)} receipts missing, e.g. {work / missing[0]}")

    sb = base / "sqlite"
    s_config, s_root = write_config(sb, max_jobs=mj)
    s_start_cpu, s_start_wall = startup(s_config, s_root, sb, "startup")
    s = run_once(s_config, s_root, sb, job_ids("SQLT", n), "once", timeout)

    with pg_server() as server:
        dsn = server.create_database()
        pb = base / "pg"
        p_config, p_root = write_config(pb, max_jobs=mj, extra={"ledger": dsn})
        # the first start-up creates the schema; the median of three leaves it out
        p_start_cpu, p_start_wall = startup(p_config, p_root, pb, "startup")
        srv0 = server_cpu_s(server)
        p = run_once(p_config, p_root, pb, job_ids("PGSQ", n), "once", timeout)
        srv_cpu = server_cpu_s(server) - srv0

    assert s.cpu_s is not None and s.wall_s is not None and p.cpu_s is not None and p.wall_s is not None
    agent_ms = cpu_x / n * 1000
    s_ms = (s.cpu_s - cpu_x) / n * 1000
    p_ms = (p.cpu_s - cpu_x) / n * 1000
    p_srv_ms = p_ms + srv_cpu / n * 1000
    rate_s, rate_p = n / s.wall_s, n / p.wall_s
    res.rows += [
        Row("throughput_pg_vs_sqlite", "throughput, run --once, PostgreSQL vs SQLite", rate_p, rate_s,
            "jobs/s", "-", None, 1),
        Row("cpu_per_job_pg_vs_sqlite", "daemon CPU/job beyond the agent, PG vs SQLite", p_ms, s_ms,
            "ms", "-", None, 3),
        Row("cpu_per_job_pg_server_vs_sqlite", "daemon+server CPU/job beyond agent, PG vs SQLite", p_srv_ms,
            s_ms, "ms", "-", None, 3),
    ]  # fmt: skip
    steady_s, steady_p = steady_rate(s, n), steady_rate(p, n)
    res.notes += [
        f"N = {n} orders as a backlog, `run --once` to its exit, max_jobs {mj}, agent `sh agent.sh`, "
        "on this host (root namespace, inotify); the SQLite run is the baseline of each row",
        f"PostgreSQL {server.major}: a fresh database on a server started for this section (fsync and "
        "synchronous_commit on), reached over TCP on 127.0.0.1",
        f"the agent's own cost: `xargs -0 -P {mj} -n 2 sh agent.sh ID WORK`, {cpu_x:.2f} s CPU = "
        f"{agent_ms:.3f} ms/job, subtracted from both daemons' CPU (user+sys of the daemon and its agents)",
        f"CPU whole run: SQLite daemon {s.cpu_s:.2f} s; PostgreSQL daemon {p.cpu_s:.2f} s + server "
        f"{srv_cpu:.2f} s (postmaster and its backends, /proc, 1/100 s ticks) = {srv_cpu / n * 1000:.3f} ms/job",
        f"start-up (empty inbox, median of {STARTUP_RUNS}): SQLite {s_start_cpu * 1000:.0f} ms CPU, "
        f"{s_start_wall * 1000:.0f} ms wall; PostgreSQL {p_start_cpu * 1000:.0f} ms CPU, "
        f"{p_start_wall * 1000:.0f} ms wall; daemon CPU/job beyond the agent without it: SQLite "
        f"{(s.cpu_s - s_start_cpu - cpu_x) / n * 1000:.3f} ms, PostgreSQL "
        f"{(p.cpu_s - p_start_cpu - cpu_x) / n * 1000:.3f} ms",
        f"wall spawn to exit: SQLite {s.wall_s:.2f} s, PostgreSQL {p.wall_s:.2f} s; first agent.started -> "
        f"last job.done: SQLite {steady_s or 0:.1f} jobs/s, PostgreSQL {steady_p or 0:.1f} jobs/s",
    ]
    res.data = {
        "orders": n,
        "max_jobs": mj,
        "xargs_cpu_s": cpu_x,
        "xargs_wall_s": wall_x,
        "sqlite_cpu_s": s.cpu_s,
        "sqlite_wall_s": s.wall_s,
        "pg_cpu_s": p.cpu_s,
        "pg_wall_s": p.wall_s,
        "pg_server_cpu_s": srv_cpu,
        "sqlite_startup_cpu_s": s_start_cpu,
        "pg_startup_cpu_s": p_start_cpu,
    }
    return res


# -- hosts -------------------------------------------------------------------------------


def hosts_run(
    base: Path, hosts: list[Host], server: PgServer, n: int, opts: argparse.Namespace, concurrency: int
) -> dict[str, Any]:
    """Safe-drop n orders into a ready cluster on these hosts; return what was measured.

    The clock runs from just before the first rename to the last `job.done` line of any
    host (log timestamps: one machine, one clock).
    """
    dsn = server.create_database()
    database = db_name(dsn)
    ids = job_ids(f"H{len(hosts)}", n)
    payloads = [order_bytes(j) for j in ids]
    command = ["sh", str(SLEEP_AGENT), f"{opts.hosts_sleep:g}"]
    cpu0 = children_cpu_s()
    srv0 = server_cpu_s(server)
    with cluster(base, hosts, server, database, max_jobs=opts.max_jobs, concurrency=concurrency, command=command) as (
        root,
        daemons,
    ):
        t0 = time.time()
        for job_id, data in zip(ids, payloads, strict=True):
            safe_drop(root / "inbox", job_id, data)
        wait_all_done(daemons, n, opts.timeout)
    # the daemons are stopped and reaped here: their CPU and their agents' is counted
    cpu = children_cpu_s() - cpu0
    srv = server_cpu_s(server) - srv0
    dones = [[parse_ts(e.get("timestamp")) for e in d.named("job.done")] for d in daemons]
    stamps = [t for per_host in dones for t in per_host if t is not None]
    if len(stamps) < n:
        raise BenchError(f"{len(stamps)}/{n} job.done lines carry a timestamp")
    if missing := [j for j in ids if not (root / "done" / j / "result.json").exists()]:
        raise BenchError(f"{len(missing)} jobs logged done but not in done/, e.g. {missing[0]}")
    with admin(server) as conn:
        wait_sessions_gone(conn, database)
        commits, rollbacks = xacts(conn, database)
    wall = max(stamps) - t0
    return {
        "hosts": len(hosts),
        "wall_s": wall,
        "jobs_per_s": n / wall,
        "per_host": [len(x) for x in dones],
        "cpu_s": cpu,
        "server_cpu_s": srv,
        "commits": commits,
        "rollbacks": rollbacks,
    }


def section_hosts(base: Path, opts: argparse.Namespace) -> Result:
    """N orders over 1, 2 and 3 hosts on one root and one database: throughput against one host."""
    n, mj = opts.pg_orders, opts.max_jobs
    counts = opts.hosts
    # `concurrency` counts every host: set so that only max_jobs limits each daemon
    concurrency = mj * max(counts)
    runs: dict[int, dict[str, Any]] = {}
    with pg_server() as server, simulated_hosts() as factory:
        pool = make_hosts(factory, max(counts))
        for k in counts:
            kb = base / f"hosts-{k}"
            kb.mkdir()
            print(f"  hosts: {k} ...", file=sys.stderr, flush=True)
            runs[k] = hosts_run(kb, pool[:k], server, n, opts, concurrency)
        major = server.major

    # what the agent itself allows on max_jobs slots: the same sleep agent run by `xargs -P`
    # (its sh and sleep start in a few ms beside the sleep, which no daemon can win back)
    xb = base / "xargs"
    xb.mkdir()
    xids = job_ids("XARG", n)
    work = make_workdirs(xb, xids)
    command = ["sh", str(SLEEP_AGENT), f"{opts.hosts_sleep:g}"]
    wall_x, _ = xargs_run(xb, command, [[j, str(work / j)] for j in xids], mj, opts.timeout)
    if missing := missing_receipts(work, xids):
        raise BenchError(f"xargs baseline: {len(missing)} receipts missing, e.g. {work / missing[0]}")
    rate_x = n / wall_x

    res = Result()
    first = counts[0]
    one = runs[first]["jobs_per_s"]
    ceiling = mj / opts.hosts_sleep
    res.rows.append(
        Row("hosts_xargs", f"the agent alone: xargs -P {mj} (baseline: max_jobs / sleep)",
            rate_x, ceiling, "jobs/s", "-", None, 1)
    )  # fmt: skip
    res.rows.append(
        Row(f"hosts_{first}_vs_xargs", f"{first} host{'s' if first > 1 else ''}: throughput vs xargs -P {mj}",
            one, rate_x, "jobs/s", "-", None, 1)
    )  # fmt: skip
    for k in counts:
        r = runs[k]
        if k == first:
            res.rows.append(
                Row(f"hosts_{k}", f"{k} host{'s' if k > 1 else ''}: throughput (baseline: max_jobs / sleep)",
                    r["jobs_per_s"], ceiling, "jobs/s", "-", None, 1)
            )  # fmt: skip
        else:
            res.rows.append(
                Row(f"hosts_{k}", f"{k} hosts: throughput vs {first} host{'s' if first > 1 else ''}",
                    r["jobs_per_s"], one, "jobs/s", "-", None, 1)
            )  # fmt: skip
    res.notes += [
        f"N = {n} orders safe-dropped (write .tmp, rename) from the root namespace into one shared root "
        f"(a local folder; every daemon watches it with inotify) as fast as one Python loop can; clock from "
        "the first rename to the last job.done line of any host",
        f"each host a network namespace with one `run` (max_jobs {mj}) reaching one PostgreSQL {major} "
        f"database over its veth link; agent `sh sleep_agent.sh {opts.hosts_sleep:g}` (sleeps, then writes "
        f"like agent.sh), `concurrency: {concurrency}` so that only max_jobs limits a daemon; a fresh root "
        f"and database per run; one host's ceiling is max_jobs / sleep = {ceiling:.0f} jobs/s",
        f"the machine has {os.cpu_count()} CPUs for every daemon, agent and the server: more hosts add "
        "agent slots, not CPUs",
    ]
    for k in counts:
        r = runs[k]
        res.notes.append(
            f"{k} host{'s' if k > 1 else ''}: {r['wall_s']:.2f} s, jobs per host {r['per_host']}; CPU per job: "
            f"daemons and agents {r['cpu_s'] / n * 1000:.2f} ms (start-up and stop included), server "
            f"{r['server_cpu_s'] / n * 1000:.2f} ms; transactions {(r['commits'] + r['rollbacks']) / n:.2f} "
            f"per job ({r['rollbacks']} rollbacks in all)"
        )
    res.notes.append(
        f"xargs -P {mj}: the same agent over {n} work folders in the root namespace, no daemon and no ledger: "
        f"{wall_x:.2f} s; it shows what the agent's own start (sh, then sleep) leaves of the ceiling"
    )
    res.data = {
        "orders": n,
        "max_jobs": mj,
        "sleep_s": opts.hosts_sleep,
        "xargs_jobs_per_s": rate_x,
        "runs": {str(k): runs[k] for k in counts},
    }
    return res


# -- roundtrips --------------------------------------------------------------------------


def measured(conn: Any, database: str, step: Any) -> tuple[int, dict[str, int], Any]:
    """Run step() between two reads of the server's counters; return (transactions, statements, its value).

    pg_stat_statements is reset first; transactions are the growth of xact_commit +
    xact_rollback, read once every session of the database has ended.
    """
    wait_sessions_gone(conn, database)
    c0, r0 = xacts(conn, database)
    conn.execute("SELECT pg_stat_statements_reset()")
    value = step()
    wait_sessions_gone(conn, database)
    c1, r1 = xacts(conn, database)
    return (c1 - c0) + (r1 - r0), statements(conn, database), value


def per_job(stmts: dict[str, int], fixed: dict[str, int], n: int) -> dict[str, float]:
    """Return {statement: calls per job} beyond the fixed run's calls, largest first."""
    out = {q: (c - fixed.get(q, 0)) / n for q, c in stmts.items()}
    return dict(sorted(((q, v) for q, v in out.items() if v > 0), key=lambda kv: -kv[1]))


def top_statements(stmts: dict[str, float], limit: int = 8) -> str:
    """Return the statements run at least once per 200 jobs, most frequent first, for a note."""
    shown = [(q, v) for q, v in stmts.items() if v >= 0.005][:limit]
    return "; ".join(f"{v:.2f} x `{short(q, 70)}`" for q, v in shown)


def short(query: str, width: int = 90) -> str:
    """Return a statement's text cut to width, for a note."""
    return query if len(query) <= width else query[: width - 3] + "..."


def section_roundtrips(base: Path, opts: argparse.Namespace) -> Result:
    """The ledger's transactions and statements per job and per refused duplicate, from the server's counters."""
    n, mj, timeout = opts.pg_orders, opts.max_jobs, opts.timeout
    res = Result()
    with pg_server(STATEMENT_SETTINGS) as server, admin(server) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        dsn = server.create_database()
        database = db_name(dsn)
        config, root = write_config(base, max_jobs=mj, extra={"ledger": dsn})
        # creates the schema, which is not the cost of any job
        run_once(config, root, base, [], "warm-up", 120)
        t_fixed, s_fixed, _ = measured(conn, database, lambda: run_once(config, root, base, [], "empty", 120))
        ids = job_ids("TRIP", n)
        t_jobs, s_jobs, _ = measured(conn, database, lambda: run_once(config, root, base, ids, "jobs", timeout))

        def duplicates() -> Daemon:
            # the same ids again: every one is refused as already known
            write_backlog(root / "inbox", ids)
            d = Daemon(config, base, ["--once"], label="duplicates")
            d.start()
            try:
                d.wait_exit(timeout)
            finally:
                d.stop()
            return d

        t_dup, s_dup, dup = measured(conn, database, duplicates)
        refused = [p for p in (root / "failed").iterdir() if "@" in p.name]
        if len(refused) != n:
            raise BenchError(f"{len(refused)}/{n} duplicates refused into failed/\n{dup.symptoms()}")

        live_ids = job_ids("LIVE", n)

        def live() -> None:
            # a ready `run` fed one safe drop at a time: claims come in smaller batches
            with running_daemon(config, base, [], notify=True, label="live") as d:
                d.wait_ready()
                for job_id in live_ids:
                    safe_drop(root / "inbox", job_id, order_bytes(job_id))
                d.wait_finished(n, timeout)

        t_live, s_live, _ = measured(conn, database, live)
        major = server.major

    rows = [
        ("tx_per_job_backlog", "transactions per job, backlog (run --once)", (t_jobs - t_fixed) / n),
        ("tx_per_job_live", "transactions per job, live drops (run)", (t_live - t_fixed) / n),
        ("tx_per_duplicate", "transactions per refused duplicate, backlog", (t_dup - t_fixed) / n),
        ("stmts_per_job_backlog", "statements per job, backlog (run --once)",
         (sum(s_jobs.values()) - sum(s_fixed.values())) / n),
        ("stmts_per_job_live", "statements per job, live drops (run)",
         (sum(s_live.values()) - sum(s_fixed.values())) / n),
        ("stmts_per_duplicate", "statements per refused duplicate, backlog",
         (sum(s_dup.values()) - sum(s_fixed.values())) / n),
    ]  # fmt: skip
    res.rows += [Row(key, figure, value, None, "", "-", None, 2) for key, figure, value in rows]
    fixed_stmts = sum(s_fixed.values())
    res.notes += [
        f"N = {n} jobs, max_jobs {mj}, agent `sh agent.sh`, one daemon on this host, PostgreSQL {major} "
        "(no pipeline mode in the ledger: every statement is one round trip to the server)",
        "transactions: growth of pg_stat_database xact_commit + xact_rollback for the ledger's database, read "
        "once its sessions ended; statements: pg_stat_statements calls (top level, BEGIN and COMMIT "
        "included), reset before each run",
        f"each figure is (run - empty run) / N; the empty `run --once` (register, recover, lease, stop) took "
        f"{t_fixed} transactions, {fixed_stmts} statements; runs that last longer also renew the lease "
        "(every lease/6 = 5 s) a few more times, counted in the figures",
        "backlog: N orders waiting before `run --once` starts; live: N safe drops into a ready `run`; "
        "duplicates: the same N ids written again after the backlog run, each refused into failed/",
        f"whole runs, transactions / statements: empty {t_fixed} / {fixed_stmts}, backlog {t_jobs} / "
        f"{sum(s_jobs.values())}, live {t_live} / {sum(s_live.values())}, duplicates {t_dup} / "
        f"{sum(s_dup.values())}",
    ]
    for label, stmts in (("backlog", s_jobs), ("duplicate", s_dup), ("live", s_live)):
        res.notes.append(
            f"per {'job' if label != 'duplicate' else 'refused duplicate'} ({label}): "
            + top_statements(per_job(stmts, s_fixed, n))
        )
    res.data = {
        "orders": n,
        "fixed_transactions": t_fixed,
        "fixed_statements": fixed_stmts,
        "backlog_statements": per_job(s_jobs, s_fixed, n),
        "duplicate_statements": per_job(s_dup, s_fixed, n),
        "live_statements": per_job(s_live, s_fixed, n),
    }
    return res


# -- takeover ----------------------------------------------------------------------------


def takeover_run(base: Path, factory: Hosts, server: PgServer, lease: float) -> dict[str, Any]:
    """Host A runs a long retry-safe job, host B idles; every process of A is killed; time B's steps.

    B is started only after A's agent runs (so that A, not B, claims the job), and the kill
    waits until B has renewed its own lease for a full lease (the reaper's precondition),
    so that the figures are the time to notice a dead host, not B's own warm-up.
    """
    a, b = make_hosts(factory, 2)
    database = db_name(server.create_database())
    job_id = "TAKEOVER-1"
    common: dict[str, Any] = {
        "max_jobs": 1,
        "concurrency": 2,
        "command": ["sh", "-c", TAKEOVER_AGENT, "takeover", str(AGENT)],
        # a stop at the end must not wait the default minute for B's agent
        "extra": {"lease": lease, "retry_delay": RETRY_DELAY_S, "stop_timeout": 5, "kill_grace": 0.5},
        "agent_extra": {"retry_safe": True, "max_attempts": 3},
    }
    with cluster(base / "a", [a], server, database, **common) as (root, (da,)):
        safe_drop(root / "inbox", job_id, order_bytes(job_id))
        wait_event(da, "agent.started", 60, job_id)
        with cluster(base / "b", [b], server, database, root=root, **common) as (_, (db,)):
            t_ready = parse_ts(db.named("daemon.ready")[0].get("timestamp")) or time.time()
            # a full lease of B's own renewals, plus one renewal interval and a margin
            time.sleep(max(0.0, t_ready + lease * 7 / 6 + 0.2 - time.time()))
            t_kill = time.time()
            a.kill_all()
            limit = lease * 3 + 60
            lost = wait_event(db, "host.lost", limit)
            recovered = wait_event(db, "job.recovered", limit, job_id)
            started = wait_event(db, "agent.started", limit, job_id)
            done = wait_event(db, "job.done", 60, job_id)
    if not (root / "done" / job_id / "result.json").exists():
        raise BenchError(f"{job_id} did not end in done/ on host B")

    def since_kill(e: dict[str, Any]) -> float:
        t = parse_ts(e.get("timestamp"))
        if t is None:
            raise BenchError(f"log line without a timestamp: {e}")
        return t - t_kill

    return {
        "lease_s": lease,
        "b_up_before_kill_s": t_kill - t_ready,
        "host_lost_s": since_kill(lost),
        "job_recovered_s": since_kill(recovered),
        "agent_started_s": since_kill(started),
        "job_done_s": since_kill(done),
        "attempt": started.get("attempt"),
    }


def section_takeover(base: Path, opts: argparse.Namespace) -> Result:
    """Kill every process of a host running a job: time until another host notices and runs it again."""
    runs: list[dict[str, Any]] = []
    with pg_server() as server, simulated_hosts() as factory:
        for lease in opts.lease:
            print(f"  takeover: lease {lease:g} s ...", file=sys.stderr, flush=True)
            lb = base / f"lease-{lease:g}"
            lb.mkdir()
            runs.append(takeover_run(lb, factory, server, lease))
    res = Result()
    for r in runs:
        lease = r["lease_s"]
        lost, started = r["host_lost_s"], r["agent_started_s"]
        res.rows += [
            Row(f"host_lost_lease_{lease:g}", f"lease {lease:g} s: kill -> host.lost on the other host", lost,
                lease, "s", "5/6 to 4/3 x lease", lease * 5 / 6 <= lost <= lease * 4 / 3, 2),
            Row(f"agent_started_lease_{lease:g}", f"lease {lease:g} s: kill -> its job's agent.started there",
                started, lease, "s", f"<= 4/3 x lease + {RETRY_DELAY_S + TAKEOVER_SLACK_S:g} s",
                started <= lease * 4 / 3 + RETRY_DELAY_S + TAKEOVER_SLACK_S, 2),
        ]  # fmt: skip
    res.notes += [
        "2 hosts (network namespaces) on one shared root and one PostgreSQL database; host A runs one "
        "retry-safe job whose first attempt sleeps 60 s; B, started after A's agent, idles until it has "
        "renewed its own lease for 7/6 of a lease; then every process of A gets SIGKILL (Host.kill_all); "
        "the clock starts just before the kill, and stops at B's log lines (its JSON lines on stdout)",
        "the lease is the baseline: a daemon that has not renewed for `lease` seconds is dead. Renewals come "
        "every lease/6, so A's lease runs out 5/6 to 1 lease after the kill; B reaps every lease/3, so "
        "host.lost is due within 5/6 and 4/3 of a lease; then B recovers the job (job.recovered) and, "
        f"the job being retry-safe, starts attempt 2 after `retry_delay` ({RETRY_DELAY_S:g} s, the default); "
        f"the targets add {TAKEOVER_SLACK_S:g} s for the steps in between",
    ]
    for r in runs:
        res.notes.append(
            f"lease {r['lease_s']:g} s: host.lost {r['host_lost_s']:.2f} s, job.recovered "
            f"{r['job_recovered_s']:.2f} s, agent.started (attempt {r['attempt']}) {r['agent_started_s']:.2f} s, "
            f"job.done {r['job_done_s']:.2f} s after the kill; B up {r['b_up_before_kill_s']:.1f} s before it"
        )
    res.data = {"runs": runs}
    return res
