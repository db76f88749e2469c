"""Drive the real daemon from outside: configs, orders, the `run` process, its log and /proc.

Everything here goes through the contract only (the `python -m dispatcher` CLI, the config
file, the dispatch folders, JSON log lines on stdout, `$NOTIFY_SOCKET`), so the benchmark
runs unchanged whatever the daemon looks like inside.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
AGENT = HERE / "agent.sh"
SLEEP_AGENT = HERE / "sleep_agent.sh"
AGENT_NAME = "bench"
ITEM_ID = "R1"
READY_TIMEOUT_S = 60.0
POLL_S = 0.02


class BenchError(Exception):
    """A section could not produce its figures; the message says what was seen."""


# -- numbers -------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Return the nearest-rank percentile p (0..100) of values."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def parse_ts(text: Any) -> float | None:
    """Return a log line's ISO 8601 timestamp as epoch seconds, or None."""
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def ts_digits(text: Any) -> int:
    """Return how many digits follow the seconds' decimal point in an ISO timestamp."""
    s = str(text)
    dot = s.find(".", s.find("T"))
    if dot < 0:
        return 0
    n = 0
    for ch in s[dot + 1 :]:
        if not ch.isdigit():
            break
        n += 1
    return n


def children_cpu_s() -> float:
    """Return user+sys CPU seconds of every reaped child of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def children_ctx() -> int:
    """Return voluntary+involuntary context switches of every reaped child of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_nvcsw + ru.ru_nivcsw


# -- fresh folders -------------------------------------------------------------------


def fresh_folder(parent: Path, label: str) -> Path:
    """Return a brand-new folder under parent for one run: no earlier run created or deleted anything in it.

    ext4 skips recently deleted inodes when it allocates (`recently_deleted`), so a create
    in a folder that saw many deletions costs 200-1,000 us of CPU instead of 27-45 us; a
    run in such a folder measures the filesystem, not the program.
    """
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=parent))


def create_cost_us(folder: Path, n: int = 200) -> float:
    """Return the CPU (this thread's, in us) of creating one empty file in a new subfolder of folder.

    The files stay: deleting them would make the next creates there slower.
    """
    probe = folder / "create-probe"
    probe.mkdir()
    t0 = time.thread_time()
    for i in range(n):
        os.close(os.open(probe / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return (time.thread_time() - t0) / n * 1e6


def filesystem(path: Path) -> str:
    """Return the filesystem type that holds path (from /proc/mounts), or '?'."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


# -- environment, orders, config -----------------------------------------------------


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment the daemon gives an agent (PATH, HOME, LANG), for baselines."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(extra or {})
    return env


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment for `python -m dispatcher`: this tree first, no inherited config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def order_bytes(job_id: str, agent: str = AGENT_NAME) -> bytes:
    """Return a valid work order for the bench agents, as JSON."""
    body = {
        "job_id": job_id,
        "from": "bench",
        "to": agent,
        "task": "Copy the one item id to out.csv.",
        "items": [{"id": ITEM_ID}],
        "accept": {"output": "out.csv"},
    }
    return json.dumps(body).encode()


def job_ids(prefix: str, n: int) -> list[str]:
    """Return n job ids that sort in the order they were made."""
    return [f"{prefix}-{i:07d}" for i in range(1, n + 1)]


def write_config(
    base: Path,
    *,
    max_jobs: int,
    command: list[str] | None = None,
    concurrency: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 60,
    root: Path | None = None,
    extra: dict[str, Any] | None = None,
    agent_extra: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write base/dispatcher.yaml and return (config, root).

    The root is base/dispatch unless given (several hosts share one); it is made here.
    Only what the benchmark needs is set; every check, fsync and other setting keeps its
    default. `extra` adds top-level keys (`ledger`, `lease`), `agent_extra` keys of the
    agent (`retry_safe`). JSON is valid YAML, so no YAML writer is needed.
    """
    root = root or base / "dispatch"
    root.mkdir(parents=True, exist_ok=True)
    cfg = {
        "root": str(root),
        "max_jobs": max_jobs,
        "agents": {
            AGENT_NAME: {
                "command": command or ["sh", str(AGENT)],
                "concurrency": concurrency or max_jobs,
                "timeout": timeout_s,
                "writes": ["out.csv"],
                "env": env or {},
                **(agent_extra or {}),
            }
        },
        **(extra or {}),
    }
    path = base / "dispatcher.yaml"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path, root


def safe_drop(inbox: Path, job_id: str, data: bytes) -> float:
    """Write inbox/.<id>.json.tmp, rename it in; return time.time() just before the rename."""
    name = f"{job_id}.json"
    tmp = inbox / f".{name}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    t0 = time.time()
    os.rename(tmp, inbox / name)
    return t0


def write_backlog(inbox: Path, ids: list[str]) -> None:
    """Write one order per id straight into inbox/, as if dropped while no daemon ran.

    Modification times start an hour back (older than any `settle`) and rise by 1 ms per
    file, so "oldest first" has one right answer: ids[0].
    """
    inbox.mkdir(parents=True, exist_ok=True)
    old = time.time() - 3600
    for i, job_id in enumerate(ids):
        path = inbox / f"{job_id}.json"
        path.write_bytes(order_bytes(job_id))
        t = old + i / 1000
        os.utime(path, (t, t))


def make_workdirs(base: Path, ids: list[str]) -> Path:
    """Make base/work/<id>/ for each id (for baselines that run the agent by hand)."""
    work = base / "work"
    work.mkdir(parents=True)
    for job_id in ids:
        (work / job_id).mkdir()
    return work


def missing_receipts(work: Path, ids: list[str]) -> list[str]:
    """Return the ids whose work/<id>/receipt.json is missing."""
    return [j for j in ids if not (work / j / "receipt.json").exists()]


# -- systemd's notify socket, played by the benchmark --------------------------------


class Notify:
    """An abstract unix datagram socket in `$NOTIFY_SOCKET` form; a thread drains it.

    The daemon sends READY=1 once recovery and the first inbox scan are done (contract,
    section 9). The socket is drained for the daemon's whole life: a full socket buffer
    would block the daemon's next send.
    """

    def __init__(self) -> None:
        self.name = f"dispatcher-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.ready = threading.Event()
        self.messages: list[str] = []
        self._thread = threading.Thread(target=self._drain, name="notify", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """Return the value for `$NOTIFY_SOCKET` (`@` stands for the abstract namespace)."""
        return "@" + self.name

    def _drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return  # closed
            text = data.decode(errors="replace")
            if len(self.messages) < 100:
                self.messages.append(text)
            if "READY=1" in text.split("\n"):
                self.ready.set()

    def close(self) -> None:
        """Close the socket; the drain thread ends."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# -- the daemon process --------------------------------------------------------------


class Daemon:
    """A real `python -m dispatcher --config CFG run [...]`, stdout+stderr in a log file.

    `cpu_s` and `wall_s` are set once the process is reaped: its rusage (user+sys, its
    agents included, since it waits for them) and spawn-to-reap time.
    """

    def __init__(
        self,
        config: Path,
        base: Path,
        args: list[str],
        *,
        notify: bool = False,
        label: str | None = None,
        prefix: list[str] | None = None,
        popen: Callable[..., subprocess.Popen[bytes]] | None = None,
    ) -> None:
        # `popen` starts the process elsewhere, e.g. a simulated host's `Host.run`, which
        # runs it inside a network namespace under the same pid
        self.config = config
        self._popen = popen or subprocess.Popen
        self.log_path = base / f"daemon-{label or '-'.join(a.strip('-') for a in args) or 'run'}.log"
        main = prefix or ["-m", "dispatcher"]
        self.argv = [sys.executable, *main, "--config", str(config), "run", *args]
        self.notify = Notify() if notify else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.t_spawn = 0.0  # time.time() just before Popen
        self.cpu_s: float | None = None
        self.wall_s: float | None = None
        self._perf0 = 0.0
        self._cpu0 = 0.0
        self._fh: Any = None
        self._offset = 0
        self._events: list[dict[str, Any]] = []
        self._junk: list[str] = []

    @property
    def pid(self) -> int:
        """Return the daemon's pid."""
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Spawn the daemon."""
        self._fh = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        extra = {"NOTIFY_SOCKET": self.notify.address} if self.notify else None
        env = child_env(extra)
        self._cpu0 = children_cpu_s()
        self.t_spawn = time.time()
        self._perf0 = time.perf_counter()
        self.proc = self._popen(
            self.argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.config.parent,
            env=env,
        )

    def running(self) -> bool:
        """Return True while the process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def _reaped(self) -> None:
        if self.cpu_s is None:
            self.wall_s = time.perf_counter() - self._perf0
            self.cpu_s = children_cpu_s() - self._cpu0

    def exit_code(self) -> int | None:
        """Return the exit code once the process has exited, else None."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is not None:
            self._reaped()
        return code

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for READY=1 on the notify socket."""
        assert self.notify is not None, "started without notify=True"
        deadline = time.monotonic() + timeout
        while not self.notify.ready.wait(0.05):
            if not self.running():
                raise BenchError(f"daemon exited ({self.exit_code()}) before READY=1\n{self.symptoms()}")
            if time.monotonic() > deadline:
                raise BenchError(f"no READY=1 on $NOTIFY_SOCKET within {timeout:.0f} s\n{self.symptoms()}")

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to exit by itself; return its exit code."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"daemon still running after {timeout:g} s\n{self.symptoms()}") from None
        self._reaped()
        return code

    def events(self) -> list[dict[str, Any]]:
        """Return every JSON log line printed so far (read incrementally)."""
        with open(self.log_path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n")
        if end >= 0:
            self._offset += end + 1
            for raw in chunk[: end + 1].decode(errors="replace").splitlines():
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    self._junk.append(raw)
                    continue
                if isinstance(event, dict):
                    self._events.append(event)
                else:
                    self._junk.append(raw)
        return self._events

    def named(self, name: str) -> list[dict[str, Any]]:
        """Return the log lines whose event is name, so far."""
        return [e for e in self.events() if e.get("event") == name]

    def wait_finished(self, n: int, timeout: float, interval: float = POLL_S) -> float:
        """Wait for n `job.done` lines; return time.perf_counter() when they were seen.

        Fails at the first `job.failed` or `job.refused` line, or when the daemon exits.
        """
        deadline = time.monotonic() + timeout
        seen = 0
        done = 0
        while True:
            events = self.events()
            for e in events[seen:]:
                name = e.get("event")
                if name == "job.done":
                    done += 1
                elif name in ("job.failed", "job.refused"):
                    raise BenchError(f"a job did not end in done/: {json.dumps(e)[:400]}\n{self.symptoms()}")
            seen = len(events)
            if done >= n:
                return time.perf_counter()
            if not self.running():
                raise BenchError(f"daemon exited ({self.exit_code()}) with {done}/{n} jobs done\n{self.symptoms()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{done}/{n} jobs done after {timeout:.0f} s\n{self.symptoms()}")
            time.sleep(interval)

    def symptoms(self, limit: int = 12) -> str:
        """Return the log lines a reader needs to see why the daemon misbehaved."""
        events = self.events()
        bad = [
            e
            for e in events
            if str(e.get("level", "")).lower() in ("warning", "error", "critical", "exception")
            or e.get("event") in ("job.failed", "job.refused", "config.rejected")
        ]
        lines = [f"  daemon: {shlex.join(self.argv)} (log {self.log_path}, kept with --keep)"]
        lines += ["  " + json.dumps(e)[:400] for e in bad[:limit]]
        if not bad:
            lines += ["  (no warning/error lines) last lines:"]
            lines += ["  " + json.dumps(e)[:400] for e in events[-5:]]
        lines += ["  " + j[:400] for j in self._junk[-limit:]]
        return "\n".join(lines)

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; always close the log file and the notify socket."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            return self.exit_code()
        finally:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
            if self.notify is not None:
                self.notify.close()


@contextlib.contextmanager
def running_daemon(config: Path, base: Path, args: list[str], **kw: Any) -> Iterator[Daemon]:
    """Start a daemon, yield it, always stop it."""
    d = Daemon(config, base, args, **kw)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def ensure_program(program: str, package: str) -> tuple[str | None, str]:
    """Return (the path of program or None, a note saying what was done).

    A missing program is installed from Debian's package when the benchmark runs as
    root where `apt-get` exists (the package lists are updated once if the first try
    fails), so that every section runs on a fresh machine from one command.
    """
    path = shutil.which(program)
    if path:
        return path, ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, f"{program} not found (Debian package {package}), and not root with apt-get to install it"
    print(f"installing {package} with apt-get ...", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", package]
    last = ""
    # The package lists may be missing or stale on a fresh machine: update once, then retry.
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            proc = subprocess.run(cmd, capture_output=True, env=env, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(cmd)}` timed out"
        lines = (proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exit {proc.returncode}"
        if cmd is install and proc.returncode == 0 and (path := shutil.which(program)):
            return path, f"{package} installed with apt-get for this run"
    return None, f"{program} not found and `apt-get install {package}` failed: {last}"
