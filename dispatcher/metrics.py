"""The daemon's Prometheus metrics, kept in a text file for node_exporter (contract section 10).

``prometheus_client`` holds the values (thread-safe) and writes the file in the
text format 0.0.4, atomically: it writes a temporary file beside the target and
renames it over the target, so a reader never sees half a file. The daemon
updates the values as things happen (cheap, from any thread) and calls
``write`` from a worker thread at least every 10 seconds and at stop.

Metrics (labels in braces):

- ``dispatcher_jobs_finished_total{state,agent}``: jobs done or failed and files
  refused, since this daemon started;
- ``dispatcher_queue{state}``: orders in inbox/ and held/, jobs in active/,
  waiting/ and review/, over the whole root (every daemon's);
- ``dispatcher_agents_running{agent}``: agents this daemon runs now;
- ``dispatcher_job_duration_seconds{agent}``: claim to finish, a histogram;
- ``dispatcher_cost_usd_total{agent}``: the cost the agents reported;
- ``dispatcher_last_loop_timestamp_seconds``: the loop's last turn (a stuck loop shows).

``metrics_labels`` (config) adds labels to every series, so that node_exporter can serve
the files of several daemons at once: it refuses a series that two files repeat.
"""

from __future__ import annotations

import contextlib
import glob as globmod
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, write_to_textfile
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from dispatcher import fsutil, procs

FINISHED_STATES = ("done", "failed", "refused")
QUEUE_STATES = ("inbox", "held", "active", "waiting", "review")
#: from a quick script to an agent that works for an hour or two
DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf"))
#: how much later than its metrics file's last write a process may look started and still be its writer
_START_TOLERANCE_S = 1.5

# `_created` series (one per counter and label set) say when this daemon started
# counting; node_exporter has no use for them and they double the file.
disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client


def metrics_path(template: str | os.PathLike[str], host: str, pid: int) -> Path:
    """Return the metrics file's path: ``{host}`` and ``{pid}`` in the template replaced."""
    return Path(expand(str(template), host, pid))


def expand(text: str, host: str, pid: int) -> str:
    """Return text with ``{host}`` and ``{pid}`` replaced."""
    return text.replace("{host}", host).replace("{pid}", str(pid))


class _Labelled(Collector):
    """A registry's series with labels of the whole file added (``metrics_labels``)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.registry, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family


def stale_files(
    template: str | os.PathLike[str], host: str, pid: int, elsewhere: frozenset[int] = frozenset()
) -> list[Path]:
    """Return the files of template's ``{pid}`` pattern on this host whose daemon has stopped.

    A pid counts as a live daemon while its process runs (not a zombie), its command
    line names dispatcher, and it started before the file was last written (a daemon
    writes its file after its start; a pid reused since, even by ``tail -f
    dispatcher.log``, started after); any other pid left a stale file, which
    node_exporter would keep serving. ``elsewhere``: the pids of the other live daemons
    the ledger knows; a pid of another host, or of another pid namespace under this host's
    name (a container), means nothing in this /proc: their files stay.
    """
    text = str(template).replace("{host}", host)
    if "{pid}" not in text:
        return []
    glob_pattern = "*".join(globmod.escape(part) for part in text.split("{pid}"))  # a `[` in the path is itself
    pattern = re.compile(re.escape(text).replace(re.escape("{pid}"), r"(\d+)"))
    out = []
    for name in globmod.glob(glob_pattern):
        found = pattern.fullmatch(name)
        if found is None or int(found.group(1)) in (pid, *elsewhere) or _is_daemon(int(found.group(1)), name):
            continue
        out.append(Path(name))
    return sorted(out)


def _is_daemon(pid: int, path: str) -> bool:
    """Return True if pid may be the live daemon that wrote the metrics file at path."""
    fields = procs.stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"dispatcher" not in f.read():
                return False
        written = os.stat(path).st_mtime
    except OSError:
        return False
    # /proc/stat's boot time has whole seconds: a start within that of the last write is given the benefit
    return procs.started_at(fields) <= written + _START_TOLERANCE_S


class Metrics:
    """One daemon's metrics, written to one file.

    ``agents`` (the configured agent names) start every per-agent series at 0,
    so that a rate over the first finished job is not lost.
    """

    def __init__(
        self,
        path_template: str | os.PathLike[str],
        host: str,
        pid: int,
        agents: Iterable[str] = (),
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.path = metrics_path(path_template, host, pid)
        self.template, self.host, self.pid = path_template, host, pid
        self.labels: dict[str, str] = {}
        self.set_labels(labels or {})
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._running_agents: set[str] = set()
        self.finished = Counter(
            "dispatcher_jobs_finished",
            "Jobs done or failed and files refused since this daemon started.",
            ("state", "agent"),
            registry=self.registry,
        )
        self.queue = Gauge(
            "dispatcher_queue",
            "Orders in inbox/ and held/, jobs in active/, waiting/ and review/, over the whole root.",
            ("state",),
            registry=self.registry,
        )
        self.running = Gauge(
            "dispatcher_agents_running", "Agents this daemon runs now.", ("agent",), registry=self.registry
        )
        self.duration = Histogram(
            "dispatcher_job_duration_seconds",
            "Seconds from a job's claim to its finish.",
            ("agent",),
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.cost = Counter(
            "dispatcher_cost_usd", "Cost in USD the agents reported.", ("agent",), registry=self.registry
        )
        self.last_loop = Gauge(
            "dispatcher_last_loop_timestamp_seconds",
            "Unix time of the daemon loop's last turn.",
            registry=self.registry,
        )
        self.gated = Gauge(
            "dispatcher_agent_gated",
            "1 while a gate (usage limit, pause, daily cap) holds the agent, else 0.",
            ("agent",),
            registry=self.registry,
        )
        for state in QUEUE_STATES:
            self.queue.labels(state=state).set(0)
        for agent in agents:
            self._touch(agent)

    def add_agents(self, agents: Iterable[str]) -> None:
        """Make the per-agent series of agents a reload added exist (at 0); known ones are left as they are."""
        with self._lock:
            new = [a for a in agents if a not in self._running_agents]
        for agent in new:
            self._touch(agent)

    def _touch(self, agent: str) -> None:
        """Make every per-agent series of agent exist (at 0)."""
        for state in FINISHED_STATES:
            self.finished.labels(state=state, agent=agent)
        self.running.labels(agent=agent)
        self.duration.labels(agent=agent)
        self.cost.labels(agent=agent)
        self.gated.labels(agent=agent)
        with self._lock:
            self._running_agents.add(agent)

    def seed_finished(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Start ``dispatcher_jobs_finished_total`` from what this daemon finished before these metrics existed."""
        for (state, agent), n in counts.items():
            self.finished.labels(state=state, agent=agent).inc(n)

    def job_finished(self, state: str, agent: str | None, duration_s: float | None, cost_usd: float | None) -> None:
        """Count one job done or failed (with its claim-to-finish seconds and cost), or one file refused.

        ``agent`` is None (label "") for a refused file whose order named none.
        A review is not a finish: it is counted when approved or rejected.
        """
        label = agent or ""
        self.finished.labels(state=state, agent=label).inc()
        if duration_s is not None and duration_s >= 0:
            self.duration.labels(agent=label).observe(duration_s)
        if cost_usd is not None and cost_usd > 0:
            self.cost.labels(agent=label).inc(cost_usd)

    def set_running(self, counts: Mapping[str, int]) -> None:
        """Set how many copies of each agent this daemon runs; agents left out are set to 0."""
        with self._lock:
            known = self._running_agents | set(counts)
            self._running_agents = known
        for agent in known:
            self.running.labels(agent=agent).set(counts.get(agent, 0))

    def set_gated(self, held: Mapping[str, int]) -> None:
        """Set ``dispatcher_agent_gated`` per agent (1 while a gate holds it)."""
        for agent, value in held.items():
            self.gated.labels(agent=agent).set(value)

    def set_queue(self, counts: Mapping[str, int]) -> None:
        """Set the queue gauge from ``report.queue_counts(layout)`` (inbox, held, active, review)."""
        for state in QUEUE_STATES:
            if state in counts:
                self.queue.labels(state=state).set(counts[state])

    def loop_turn(self, ts: float) -> None:
        """Record a turn of the daemon's loop at Unix time ts (cheap: call it every turn)."""
        self.last_loop.set(ts)

    def set_labels(self, labels: Mapping[str, str]) -> None:
        """Add these labels (values may hold ``{host}`` and ``{pid}``) to every series from the next write on."""
        self.labels = {name: expand(value, self.host, self.pid) for name, value in labels.items()}

    def move_to(self, path_template: str | os.PathLike[str]) -> None:
        """Write to another file from now on (a reload moved metrics_file): the counters go on; the old file goes."""
        old = self.path
        self.path = metrics_path(path_template, self.host, self.pid)
        self.template = path_template
        if old != self.path:
            self.remove_file(old)

    def remove_file(self, path: Path | None = None) -> None:
        """Remove the file this daemon kept (a reload unset metrics_file): nothing serves frozen values."""
        with contextlib.suppress(OSError):
            (path or self.path).unlink()

    def has_pid_pattern(self) -> bool:
        """Return True if this file's name holds ``{pid}``: other daemons' files may share its pattern."""
        return "{pid}" in str(self.template)

    def write(self, elsewhere: frozenset[int] | None = frozenset()) -> None:
        """Write the file atomically (a temporary file beside it, then a rename); raise OSError if it cannot.

        Blocking (a file write): call it from a worker thread, never the loop. Then
        remove the files that stopped daemons of this host left under the ``{pid}`` pattern,
        never those of ``elsewhere``, the other live daemons' pids (None: not known now, none
        is removed).
        The file is created with the process's umask (the daemon's 027 leaves
        it readable by its group: put node_exporter's user in that group). A missing
        folder is made, as log_file's is.
        """
        path = self.path
        fsutil.make_dir(os.fspath(path.parent))
        write_to_textfile(str(path), _Labelled(self.registry, self.labels) if self.labels else self.registry)
        if path != self.path:  # moved by a reload while this write ran: the old file goes
            self.remove_file(path)
        if elsewhere is None:
            return
        for stale in stale_files(self.template, self.host, self.pid, elsewhere):
            with contextlib.suppress(FileNotFoundError):  # another daemon removed it first
                stale.unlink()
