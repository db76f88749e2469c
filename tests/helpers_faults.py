"""Helpers for the fault-injection tests: processes, log tailing, notify socket, tiny agents.

Everything here looks at the system from outside, the way an operator would: /proc
for processes, the daemon's JSON log lines, the folders of the dispatch root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import FAKE_AGENT, Daemon, Env, cli_env, wait_until

STATES = ("inbox", "active", "done", "failed")

# A cheap agent: /bin/sh, records its start like the fake agent, sleeps a pseudo-random
# 0-50 ms (from its pid), and writes the receipt atomically (temp name, then rename), so
# that a kill at any moment leaves either no receipt or a whole one. With argv TO FROM it
# also hands off one follow-up `<job_id>-fu` to agent TO (FROM: its own agent name).
TINY_AGENT = r"""#!/bin/sh
printf '%s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$$" >> "$1"
ms=$(( ($$ * 7919) % 51 ))
sleep "$(printf '0.%03d' "$ms")"
if [ -n "$2" ]; then
  mkdir -p outbox
  printf '{"job_id": "%s-fu", "from": "%s", "to": "%s", "task": "Follow up.", "items": [{"id": "R1"}]}' \
    "$DISPATCH_JOB_ID" "$3" "$2" > outbox/.fu.tmp
  mv outbox/.fu.tmp "outbox/$DISPATCH_JOB_ID-fu.json"
fi
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": [], "status": "done", "outputs": []}' \
  "$DISPATCH_JOB_ID" > .receipt.tmp
mv .receipt.tmp receipt.json
"""

# Runs the fake agent, adding `--sleep 30` on attempt 1 only (same pid: exec).
SLOW_FIRST = f"""import os, sys
args = sys.argv[1:]
if os.environ.get("DISPATCH_ATTEMPT") == "1":
    args += ["--sleep", "30"]
os.execv(sys.executable, [sys.executable, {str(FAKE_AGENT)!r}, *args])
"""

# Dumps its environment as JSON to argv[1] (outside the root), then writes a good receipt.
ENV_DUMP = """import json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(dict(os.environ)) + "\\n")
order = json.load(open(os.environ["DISPATCH_ORDER"]))
ids = [i["id"] for i in order["items"]]
receipt = {"job_id": order["job_id"], "input_ids": ids, "output_ids": [], "status": "done"}
open(os.environ["DISPATCH_RECEIPT"], "w").write(json.dumps(receipt))
"""


def run_once_killed_at(env: Env, point: str) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher run --once` with the fault point armed (the daemon kills itself there, SIGKILL); assert it
    died there and return the finished process."""
    crashed = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env() | {"DISPATCHER_FAULT": point},
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    return crashed


def write_script(folder: Path, name: str, text: str) -> Path:
    """Write an executable helper script and return its path."""
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return path


# A shell agent that holds its pipes open for a while: it records its start,
# sleeps SECONDS ($2), then writes a good receipt atomically.
HOLD_AGENT = r"""#!/bin/sh
printf '%s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$$" >> "$1"
sleep "$2"
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": [], "status": "done", "outputs": []}' \
  "$DISPATCH_JOB_ID" > .receipt.tmp
mv .receipt.tmp receipt.json
"""


def hold_agent(env: Env, seconds: float, **settings: Any) -> dict[str, Any]:
    """Return an agent definition running HOLD_AGENT for `seconds`."""
    script = write_script(env.tmp, "hold_agent.sh", HOLD_AGENT)
    spec: dict[str, Any] = {
        "command": ["/bin/sh", str(script), str(env.count_file), str(seconds)],
        "timeout": 60,
        "writes": [".receipt.tmp"],
    }
    spec.update(settings)
    return spec


def tiny_agent(env: Env, handoff: tuple[str, str] | None = None, **settings: Any) -> dict[str, Any]:
    """Return an agent definition running TINY_AGENT (orders without accept).

    handoff=(to, own_name) makes each job hand off one follow-up to agent `to`.
    """
    script = write_script(env.tmp, "tiny_agent.sh", TINY_AGENT)
    spec: dict[str, Any] = {
        "command": ["/bin/sh", str(script), str(env.count_file), *(handoff or ())],
        "timeout": 30,
        "writes": [".receipt.tmp"],
    }
    spec.update(settings)
    return spec


def tiny_order(job_id: str, to: str = "tiny") -> dict[str, Any]:
    """Return a minimal valid order with one item and no accept section."""
    return {
        "job_id": job_id,
        "from": "tester",
        "to": to,
        "task": "Do one small thing.",
        "items": [{"id": "R1"}],
    }


# -- processes -----------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Return /proc/PID/stat fields after the command name (state first), or None."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return data[data.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """Return True if the process exists and is not a zombie (state read from /proc)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X", "x")


def started_s(pid: int) -> float:
    """Return when the process started, in seconds since boot (field 22 of /proc/PID/stat)."""
    fields = _stat(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def uptime_s() -> float:
    """Return seconds since boot, on the clock /proc/PID/stat's start times use."""
    return float(Path("/proc/uptime").read_text().split()[0])


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def group_members(pgid: int) -> list[int]:
    """Return the live (non-zombie) processes whose process group is pgid."""
    out = []
    for pid in _pids():
        fields = _stat(pid)
        if fields and fields[0] not in ("Z", "X", "x") and int(fields[2]) == pgid:
            out.append(pid)
    return out


def processes_with(marker: str) -> list[int]:
    """Return live processes whose command line contains marker (not this process)."""
    me = os.getpid()
    return [p for p in _pids() if p != me and marker in cmdline(p) and alive(p)]


def agent_starts(env: Env) -> list[tuple[str, int, int]]:
    """Return (job_id, attempt, pid) for every start the agents recorded."""
    if not env.count_file.exists():
        return []
    out = []
    for line in env.count_file.read_text().splitlines():
        job, attempt, pid = line.split()
        out.append((job, int(attempt), int(pid)))
    return out


def pids_of(env: Env, job_id: str) -> list[int]:
    return [pid for job, _a, pid in agent_starts(env) if job == job_id]


def wait_start(env: Env, job_id: str, attempt: int = 1, timeout: float = 30) -> int:
    """Wait until the agent recorded this start; return its pid."""

    def found() -> int | None:
        for job, a, pid in agent_starts(env):
            if job == job_id and a == attempt:
                return pid
        return None

    return int(wait_until(found, timeout, f"start of {job_id} attempt {attempt}"))


def wait_gone(pids: list[int], groups: list[int], timeout: float = 15) -> None:
    """Wait until none of the pids is alive and the groups are empty."""

    def gone() -> bool:
        return not any(alive(p) for p in pids) and not any(group_members(g) for g in groups)

    wait_until(gone, timeout, f"processes {pids} / groups {groups} to be gone")


def kill_strays(env: Env) -> None:
    """SIGKILL what is left of the agents' groups (test cleanup only)."""
    groups = {pid for _job, _a, pid in agent_starts(env)}
    for pid in _pids():
        fields = _stat(pid)
        if not fields or fields[0] in ("Z", "X", "x") or int(fields[2]) not in groups:
            continue
        cmd = cmdline(pid)
        if str(env.tmp) not in cmd and str(FAKE_AGENT) not in cmd and "time.sleep(" not in cmd:
            continue  # a reused group id: not ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def env_under(folder: str, prefix: str, side: Path | None = None) -> Iterator[Env]:
    """An Env whose dispatch root lives in a fresh folder under ``folder`` (another filesystem than tmp_path's).

    Its config and count file are there too, or in ``side`` if given. Afterwards its daemons
    are reaped and the folder is removed.
    """
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
    home = side or base
    e = Env(tmp=home, root=base / "dispatch", config_path=home / "dispatcher.yaml", count_file=home / "starts.txt")
    try:
        yield e
    finally:
        reap(e)
        shutil.rmtree(base, ignore_errors=True)


def reap(env: Env) -> None:
    """Kill the daemons still running, close their logs and end stray agents."""
    for d in env._daemons:
        if d.proc is None:
            continue
        if d.proc.poll() is None:
            d.proc.kill()
        d.proc.wait(60)
        fh = getattr(d, "_fh", None)
        if fh is not None and not fh.closed:
            fh.close()
    kill_strays(env)


# -- folders -------------------------------------------------------------------


def job_states(root: Path) -> dict[str, list[str]]:
    """Map every job id seen in the root's folders to the states it appears in."""
    out: dict[str, list[str]] = defaultdict(list)
    for state in STATES:
        folder = root / state
        if not folder.exists():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") or "@" in p.name:
                continue
            out[p.stem if state == "inbox" else p.name].append(state)
    return dict(out)


def refusals(root: Path) -> list[Path]:
    failed = root / "failed"
    return sorted(p for p in failed.iterdir() if "@" in p.name) if failed.exists() else []


def read_result(path: Path) -> dict[str, Any]:
    return json.loads((path / "result.json").read_text())


def check(result: dict[str, Any], name: str) -> dict[str, Any]:
    """Return the named check of a result."""
    for c in result["checks"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no check {name} in {result['checks']}")


def first_failing(result: dict[str, Any]) -> str | None:
    for c in result["checks"]:
        if c["ok"] is False:
            return c["name"]
    return None


def ts(text: str) -> float:
    """Parse a contract timestamp into seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# -- logs ----------------------------------------------------------------------


class LogTail:
    """Read a daemon's JSON log lines incrementally, as they are written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._rest = b""
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        new = []
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                new.append(obj)
        self.events += new
        return new

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """Return the first new line matching pred, or None after timeout."""
        end = time.monotonic() + timeout
        while True:
            for e in self.poll():
                if pred(e):
                    return e
            if time.monotonic() > end:
                return None
            time.sleep(0.003)


def count_events(d: Daemon, event: str, **match: Any) -> int:
    return sum(1 for e in d.events() if e.get("event") == event and all(e.get(k) == v for k, v in match.items()))


def wait_count(d: Daemon, event: str, n: int, timeout: float = 30, **match: Any) -> None:
    wait_until(lambda: count_events(d, event, **match) >= n, timeout, f"{n} x {event} {match}")


# -- a daemon with extra environment, and a notify socket ----------------------------


class EnvDaemon(Daemon):
    """A `dispatcher run` process started with extra environment variables."""

    def __init__(self, env: Env, args: list[str], extra: dict[str, str]) -> None:
        super().__init__(env, args)
        self.extra = extra

    def start(self) -> None:
        self._fh = self.out.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dispatcher",
                "--config",
                str(self.env.config_path),
                "run",
                *self.args,
            ],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=self.env.tmp,
            env=cli_env() | self.extra,
        )


def env_daemon(env: Env, extra: dict[str, str], *args: str) -> EnvDaemon:
    d = EnvDaemon(env, list(args), extra)
    d.start()
    env._daemons.append(d)
    return d


class NotifyListener:
    """A bound unix datagram socket that records (monotonic time, line) per notify line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.lines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            for line in data.decode(errors="replace").splitlines():
                self.lines.append((now, line))

    def times(self, line: str) -> list[float]:
        return [t for t, text in list(self.lines) if text == line]

    def wait_line(self, pred: Callable[[str], bool], timeout: float = 30) -> float:
        def seen() -> float | None:
            for t, text in list(self.lines):
                if pred(text):
                    return t
            return None

        return float(wait_until(seen, timeout, "notify line"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def assert_running(*daemons: Daemon) -> None:
    """Fail at once, with the daemon's last words, if one of the daemons has exited."""
    for d in daemons:
        assert d.proc is not None
        code = d.proc.poll()
        if code is not None:
            text = d.out.read_text(errors="replace").splitlines()
            words = [line for line in text if not line.startswith("{")][-6:]
            raise AssertionError(f"a daemon exited with {code}: " + " | ".join(words))
