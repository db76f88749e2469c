"""Many hosts, one stream of work: daemons in their own network namespaces on one PostgreSQL ledger.

Each "host" is a network namespace reaching a real PostgreSQL server over a veth
pair (tests/netns.py, tests/pgserver.py); all hosts share one dispatch folder, as
an NFS mount would give them. Faults are real: kill -9 of every process of a host,
its link cut for longer than the lease, every process of it stopped (SIGSTOP) for
longer than the lease, and the database restarted in the middle of claims. After
each, the outcome is checked the way an operator would: every job in exactly one
of done/ and failed/, no job that is not retry-safe started twice, no follow-up
released twice, `concurrency: 1` never exceeded across hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from conftest import Env, cli_env, wait_until
from helpers_faults import write_script
from netns import Host, Hosts
from pgserver import PgServer

pytest_plugins = ["pg_fixtures"]
pytestmark = pytest.mark.postgres

LEASE = 2.0
# Records "job attempt pid host" at its start, and "+ job t" / "- job t" around its work in a
# shared file (for overlaps), sleeps $2 seconds, hands off one follow-up when $3 names an agent.
AGENT = r"""#!/bin/sh
addr=$(ip -o -4 addr show scope global 2>/dev/null | awk '{print $4}' | head -n 1)
printf '%s %s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$$" "$addr" >> "$1"
printf '+ %s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$(date +%s.%N)" >> "$1.spans"
sleep "$2"
if [ -n "$3" ]; then
  mkdir -p outbox
  printf '{"job_id": "%s-fu", "from": "%s", "to": "%s", "task": "Follow up.", "items": [{"id": "R1"}]}' \
    "$DISPATCH_JOB_ID" "$4" "$3" > outbox/.fu.tmp
  mv outbox/.fu.tmp "outbox/$DISPATCH_JOB_ID-fu.json"
fi
printf -- '- %s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$(date +%s.%N)" >> "$1.spans"
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": [], "status": "done", "outputs": []}' \
  "$DISPATCH_JOB_ID" > .receipt.tmp
mv .receipt.tmp receipt.json
"""


class Cluster:
    """Hosts running daemons on one shared root and one PostgreSQL database."""

    def __init__(self, env: Env, server: PgServer, db_dsn: str, hosts: Hosts) -> None:
        self.env = env
        self.server = server
        self.database = db_dsn.rsplit("/", 1)[1]
        self.hosts = hosts
        self.script = write_script(env.tmp, "host_agent.sh", AGENT)
        self.starts_file = env.tmp / "host_starts.txt"  # job attempt pid address, one line a start
        self.daemons: dict[str, list[tuple[subprocess.Popen[bytes], Path]]] = {}
        self.created = time.monotonic()  # wait_settled ends in time for its message, inside pytest's limit
        env.root.mkdir(parents=True, exist_ok=True)

    def agents(self, sleep: float) -> dict[str, Any]:
        def agent(*extra: str, **settings: Any) -> dict[str, Any]:
            spec = {"command": ["/bin/sh", str(self.script), str(self.starts_file), str(sleep), *extra]}
            spec.update(timeout=60, **settings)
            return spec

        return {
            "once": agent(concurrency=4),
            "safe": agent(concurrency=4, retry_safe=True, max_attempts=5),
            "chain": agent("next", "chain", concurrency=4),
            "next": agent(concurrency=4, retry_safe=True, max_attempts=5),
            "solo": agent(concurrency=1, retry_safe=True, max_attempts=5),
        }

    def config_for(self, host: Host, sleep: float) -> Path:
        cfg = {
            "root": str(self.env.root),
            "ledger": self.server.dsn_for(host.gateway, self.database),
            "lease": LEASE,
            "max_jobs": 4,
            "settle": 0.2,
            "rescan_interval": 0.5,
            "retry_delay": 0.1,
            "kill_grace": 0.5,
            "stop_timeout": 5,
            "agents": self.agents(sleep),
        }
        path = self.env.tmp / f"{host.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self, host: Host, sleep: float = 0.05) -> Path:
        log = self.env.tmp / f"{host.name}-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            proc = host.run(
                [sys.executable, "-m", "dispatcher", "--config", str(self.config_for(host, sleep)), "run"],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.env.tmp,
                env=cli_env() | {"PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread (explain)
            )
        self.daemons.setdefault(host.name, []).append((proc, log))
        wait_until(lambda: "daemon.ready" in log.read_text(errors="replace"), 60, f"{host.name} ready")
        return log

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for host, runs in self.daemons.items():
            if name is not None and host != name:
                continue
            for _proc, log in runs:
                for line in log.read_text(errors="replace").splitlines():
                    try:
                        out.append(json.loads(line) | {"_host": host})
                    except ValueError:
                        continue
        return out

    def drop(self, job_id: str, to: str) -> None:
        inbox = self.env.root / "inbox"
        body = {"job_id": job_id, "from": "tester", "to": to, "task": "Do it.", "items": [{"id": "R1"}]}
        tmp = inbox / f".{job_id}.tmp"
        tmp.write_text(json.dumps(body))
        os.rename(tmp, inbox / f"{job_id}.json")

    def settled(self, ids: list[str]) -> bool:
        """Every id has a result; a follow-up (id ending -fu) whose parent failed was never written."""
        root = self.env.root

        def ended(j: str) -> bool:
            return any((root / state / j / "result.json").exists() for state in ("done", "failed"))

        return all(ended(j) or (j.endswith("-fu") and (root / "failed" / j[: -len("-fu")]).is_dir()) for j in ids)

    def wait_settled(self, ids: list[str], timeout: float, what: str) -> None:
        """Wait for settled(ids); on a timeout, fail with where each unsettled job is and what the daemons said.

        The wait ends by 150 s after the cluster was made, well inside pytest's own timeout
        (180 s for the whole test), so that the message is printed.
        """
        end = min(time.monotonic() + timeout, self.created + 150)
        while not self.settled(ids):
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.explain(ids)}")
            time.sleep(0.05)

    def explain(self, ids: list[str]) -> str:
        """Describe the unsettled jobs: their folders, their ledger rows and every log line that names them."""
        root = self.env.root
        lines = []
        stuck = [j for j in ids if not self.settled([j])]
        for j in stuck[:10]:
            places = [s for s in ("inbox", "active", "review", "done", "failed") if (root / s / j).exists()]
            places += ["inbox (file)"] if (root / "inbox" / f"{j}.json").exists() else []
            lines.append(f"{j}: in {places}")
            for host, runs in self.daemons.items():
                for proc, log in runs:
                    said = [ln for ln in log.read_text(errors="replace").splitlines() if j in ln]
                    lines += [f"  {host} pid {proc.pid} (rc {proc.poll()}): {ln[:400]}" for ln in said[-12:]]
        try:
            with psycopg.connect(self.server.dsn_for(self.server.host, self.database), connect_timeout=5) as conn:
                rows = conn.execute(
                    "SELECT job_id, state, owner, token FROM jobs WHERE job_id = ANY(%s)", (stuck[:10],)
                ).fetchall()
                lines += [f"ledger row: {r}" for r in rows]
                lines += [
                    f"daemon row: {r}" for r in conn.execute("SELECT owner, host, lease_until, ended FROM daemons")
                ]
        except psycopg.Error as exc:
            lines.append(f"ledger not read: {exc}")
        lines.append(self.server.log_tail(20))  # crash recovery, refused logins, too many clients
        live = []
        for host, runs in self.daemons.items():
            for proc, log in runs:
                tail = log.read_text(errors="replace").splitlines()[-8:]
                lines += [f"{host} pid {proc.pid} last lines:"] + [f"  {ln[:400]}" for ln in tail]
                if proc.poll() is None:  # what each thread of a live daemon is doing (it ends with the dump)
                    live.append((host, proc, log, len(log.read_text(errors="replace").splitlines())))
                    proc.send_signal(signal.SIGABRT)
        for host, proc, log, before in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            dump = log.read_text(errors="replace").splitlines()[before:]
            lines += [f"{host} pid {proc.pid} threads at SIGABRT:"] + [f"  {ln[:300]}" for ln in dump[:200]]
        return "\n".join(lines)

    def stop_all(self) -> None:
        for runs in self.daemons.values():
            for proc, _ in runs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for runs in self.daemons.values():
            for proc, _ in runs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    def starts(self) -> list[tuple[str, int, str]]:
        if not self.starts_file.exists():
            return []
        out = []
        for line in self.starts_file.read_text().splitlines():
            parts = line.split()
            out.append((parts[0], int(parts[1]), parts[3] if len(parts) > 3 else ""))
        return out

    def check(self, ids: list[str], *, retry_safe: set[str]) -> None:
        """Assert what an operator would check after any fault."""
        root = self.env.root
        for j in ids:
            places = [s for s in ("active", "review", "done", "failed") if (root / s / j).is_dir()]
            assert places in (["done"], ["failed"]), f"{j} is in {places}"
        started = Counter(j for j, _a, _h in self.starts())
        twice = {j: n for j, n in started.items() if n > 1 and j not in retry_safe}
        assert not twice, f"jobs that are not retry-safe started twice: {twice}"
        for j in retry_safe & set(ids):
            assert (root / "done" / j).is_dir(), f"retry-safe {j} did not end done"
        refused = [p.name for p in (root / "failed").iterdir() if "@" in p.name]
        assert not refused, f"a copy was refused (released twice?): {refused[:3]}"
        assert not [n for n in os.listdir(root / "inbox") if not n.startswith(".")], "files left in inbox/"


def overlaps(spans_file: Path, jobs: set[str]) -> int:
    """Return the most agents of these jobs that ran at the same moment.

    Only whole runs count (a "+" with its "-"): an agent killed with its host has
    no end mark, and it is dead before any other host may take its job over.
    """
    starts: dict[tuple[str, str], float] = {}
    runs = []
    for line in spans_file.read_text().splitlines():
        sign, job, attempt, t = line.split()
        if job not in jobs:
            continue
        if sign == "+":
            starts[(job, attempt)] = float(t)
        elif (job, attempt) in starts:
            runs.append((starts[(job, attempt)], float(t)))
    marks = sorted([(a, 1) for a, _ in runs] + [(b, -1) for _, b in runs], key=lambda m: (m[0], m[1]))
    level = peak = 0
    for _t, step in marks:
        level += step
        peak = max(peak, level)
    return peak


@pytest.fixture
def cluster(env: Env, pg_server: PgServer, pg_db: str, hosts: Hosts) -> Any:
    c = Cluster(env, pg_server, pg_db, hosts)
    yield c
    c.stop_all()


def test_crashes_of_whole_hosts_lose_nothing_and_run_nothing_twice(cluster: Cluster) -> None:
    """Three hosts, 240 jobs and follow-ups; every process of a host kill -9ed three times: nothing lost or doubled."""
    hosts = [cluster.hosts.add() for _ in range(3)]
    for h in hosts:
        cluster.start(h)
    rng = random.Random(8)
    ids: list[str] = []
    safe: set[str] = set()
    for i in range(240):
        to = ("once", "safe", "chain", "solo")[i % 4]
        job_id = f"H{i:03d}"
        cluster.drop(job_id, to)
        ids.append(job_id)
        if to in ("safe", "solo"):
            safe.add(job_id)
        if to == "chain":
            ids.append(f"{job_id}-fu")
        if i in (50, 120, 190):
            victim = hosts[rng.randrange(3)]
            time.sleep(rng.uniform(0.2, 0.8))
            victim.kill_all()
            cluster.start(victim)
    cluster.wait_settled(ids, 165, "every job to end")
    cluster.stop_all()
    # follow-ups of chain jobs that failed never existed: only check those whose parent is done
    done_parents = {j for j in ids if j.endswith("-fu") is False and (cluster.env.root / "done" / j).is_dir()}
    expected = [j for j in ids if not j.endswith("-fu") or j[: -len("-fu")] in done_parents]
    cluster.check(expected, retry_safe=safe | {f"{j}-fu" for j in done_parents})
    spans = Path(f"{cluster.starts_file}.spans")
    solo = {f"H{i:03d}" for i in range(240) if i % 4 == 3}
    assert overlaps(spans, solo) == 1, "concurrency 1 was exceeded across hosts"
    assert overlaps(spans, set(ids) - solo) >= 2  # the rest really ran side by side
    hosts_used = {h for _j, _a, h in cluster.starts() if h}
    assert len(hosts_used) >= 2, hosts_used
    assert any(e.get("event") == "host.lost" for e in cluster.events())


def test_a_partitioned_host_fences_itself_and_another_takes_over(cluster: Cluster) -> None:
    """A host cut off for longer than the lease ends its agents; another host recovers its jobs; nothing runs twice."""
    a, b = cluster.hosts.add(), cluster.hosts.add()
    cluster.start(a, sleep=6)
    ids = ["P-ONCE", "P-SAFE"]
    cluster.drop("P-ONCE", "once")
    cluster.drop("P-SAFE", "safe")
    wait_until(lambda: len(cluster.starts()) == 2, 30, "both agents started on host a")
    cluster.start(b, sleep=0.05)
    a.partition()
    time.sleep(LEASE * 3)
    a.heal()
    cluster.wait_settled(ids, 60, "both jobs to end")
    time.sleep(LEASE)
    cluster.stop_all()
    cluster.check(ids, retry_safe={"P-SAFE"})
    once = json.loads((cluster.env.root / "failed" / "P-ONCE" / "result.json").read_text())
    assert "host was lost" in once["reason"]
    a_events = {e["event"] for e in cluster.events(a.name)}
    assert "lease.fenced" in a_events
    started = next(e for e in cluster.events(a.name) if e.get("event") == "daemon.started")
    lost = [e for e in cluster.events(b.name) if e.get("event") == "host.lost"]
    assert [(e["owner"], e["pid"]) for e in lost] == [(started["owner"], started["pid"])]  # once, naming host a
    assert lost[0]["host"] == socket.gethostname()  # as its row in the ledger says (status lists it so)


def test_a_paused_host_that_comes_back_changes_nothing(cluster: Cluster) -> None:
    """Every process of a host stopped for longer than the lease, then continued: it is fenced and changes nothing."""
    a, b = cluster.hosts.add(), cluster.hosts.add()
    cluster.start(a, sleep=4)
    cluster.drop("Z-SAFE", "safe")
    wait_until(lambda: len(cluster.starts()) == 1, 30, "the agent started on host a")
    cluster.start(b, sleep=0.05)
    a.pause()
    wait_until(lambda: (cluster.env.root / "done" / "Z-SAFE" / "result.json").exists(), 60, "host b to finish it")
    done_before = (cluster.env.root / "done" / "Z-SAFE" / "result.json").read_bytes()
    a.resume()
    time.sleep(LEASE * 2)
    cluster.stop_all()
    cluster.check(["Z-SAFE"], retry_safe={"Z-SAFE"})
    assert (cluster.env.root / "done" / "Z-SAFE" / "result.json").read_bytes() == done_before
    a_events = [e["event"] for e in cluster.events(a.name)]
    assert "job.fenced" in a_events or "lease.fenced" in a_events
    attempts = json.loads(done_before)["attempts"]
    assert [x["n"] for x in attempts] == [1, 2] and attempts[0].get("interrupted")


def test_a_database_restart_in_the_middle_of_claims_loses_nothing(cluster: Cluster) -> None:
    """The database restarted (immediate) while two hosts claim 120 jobs: every job ends once."""
    a, b = cluster.hosts.add(), cluster.hosts.add()
    cluster.start(a)
    cluster.start(b)
    ids = []
    for i in range(120):
        to = "once" if i % 2 else "safe"
        cluster.drop(f"D{i:03d}", to)
        ids.append(f"D{i:03d}")
        if i == 40:
            cluster.server.restart("immediate")
    cluster.wait_settled(ids, 150, "every job to end")
    cluster.stop_all()
    cluster.check(ids, retry_safe={j for i, j in enumerate(ids) if i % 2 == 0})
    assert any(e.get("event") in ("ledger.reconnecting", "ledger.reconnected") for e in cluster.events())


def test_ledger_migrate_keeps_every_refusal_when_switching_to_postgresql(env: Env, pg_db: str) -> None:
    """`ledger migrate URL` copies a SQLite ledger into an empty PostgreSQL one; known ids stay refused."""
    env.configure()
    for i in range(3):
        env.drop(env_order(f"MIG-{i}"))
    assert env.cli("run", "--once").returncode == 0
    moved = env.cli("ledger", "migrate", "-", input=pg_db + "\n")  # the URL holds a password: never on argv
    assert moved.returncode == 0, moved.stderr
    assert "3 job ids copied" in moved.stdout
    again = env.cli("ledger", "migrate", "-", input=pg_db + "\n")
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "not empty" in again.stderr
    env.configure(ledger=pg_db)
    path = env.tmp / "dup.json"
    path.write_text(json.dumps(env_order("MIG-1")))
    refused = env.cli("submit", str(path))
    assert refused.returncode == 2 and "already known" in refused.stderr
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert status["counts"]["done"] == 3


def test_status_lists_the_daemons_of_every_host(cluster: Cluster) -> None:
    """`status --json` on a shared ledger lists each host's daemons, alive or not, with their host."""
    a, b = cluster.hosts.add(), cluster.hosts.add()
    cluster.start(a)
    cluster.start(b)
    cfg = cluster.config_for(a, 0.05)
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(cfg), "status", "--json"],
        capture_output=True, text=True, timeout=60, cwd=cluster.env.tmp, env=cli_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    daemons = json.loads(proc.stdout)["daemons"]
    assert len([d for d in daemons if d["alive"]]) == 2
    assert all(d["host"] for d in daemons)


def env_order(job_id: str) -> dict[str, Any]:
    from conftest import order

    return order(job_id)
