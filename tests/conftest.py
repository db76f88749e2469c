"""Shared fixtures: a dispatch root on tmp_path, the CLI, and a real running daemon.

Everything here drives `dispatcher` from outside, the way a user would: real
files, real renames, the real CLI in a subprocess and a real daemon process.
Timings are shrunk through the config (``settle``, ``retry_delay`` ...), never by
patching time; waits poll folder state with a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
FAKE_AGENT = HERE / "agents" / "fakeagent.py"
DEADLINE = 60.0
# the checks of contract section 5, in the order result.json records them
CHECK_NAMES = [
    "exit_ok",
    "receipt_present",
    "receipt_job_id",
    "receipt_status",
    "receipt_inputs",
    "output_rows",
    "receipt_outputs",
    "allowed_values",
    "writes_scope",
    "followups_valid",
]


def items(n: int = 3) -> list[dict[str, Any]]:
    """Return n items with ids R1..Rn."""
    return [{"id": f"R{i}", "summary": f"request {i}"} for i in range(1, n + 1)]


def order(job_id: str, to: str = "worker", **extra: Any) -> dict[str, Any]:
    """Return a valid work order for the fake agent."""
    body: dict[str, Any] = {
        "job_id": job_id,
        "from": "tester",
        "to": to,
        "task": "Assign each request to one team.",
        "items": items(),
        "accept": {"output": "out.csv"},
    }
    body.update(extra)
    return body


def wait_until(predicate: Callable[[], Any], timeout: float = DEADLINE, what: str = "") -> Any:
    """Poll predicate until it returns something truthy, or fail after timeout."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(0.05)


@dataclass
class Env:
    """One dispatch root with its config file, and helpers to drive it."""

    tmp: Path
    root: Path
    config_path: Path
    count_file: Path
    settings: dict[str, Any] = field(default_factory=dict)

    # -- config -----------------------------------------------------------
    def agent(self, *flags: str, **settings: Any) -> dict[str, Any]:
        """Return an agent definition running the fake agent with flags."""
        spec: dict[str, Any] = {
            "command": [sys.executable, str(FAKE_AGENT), "--count", str(self.count_file), *flags],
            "timeout": 30,
            "writes": ["out.csv", "out.json", "out.jsonl"],
        }
        spec.update(settings)
        return spec

    def configure(self, agents: dict[str, dict[str, Any]] | None = None, **top: Any) -> Path:
        """Write the config file: the fake agent as `worker` unless agents are given."""
        cfg: dict[str, Any] = {
            "root": str(self.root),
            "max_jobs": 2,
            "settle": 0.3,
            "retry_delay": 0.1,
            "rescan_interval": 2,
            "kill_grace": 1,
            "stop_timeout": 10,
            "agents": agents if agents is not None else {"worker": self.agent()},
        }
        cfg.update(top)
        self.settings = cfg
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.root.mkdir(parents=True, exist_ok=True)  # `run` makes the folders inside a root, never the root
        return self.config_path

    # -- commands ---------------------------------------------------------
    def cli(
        self, *args: str, check: bool = False, timeout: float = DEADLINE, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `dispatcher --config CFG ARGS` (with input on stdin, if given) and return the finished process."""
        proc = subprocess.run(
            [sys.executable, "-m", "dispatcher", "--config", str(self.config_path), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
            env=cli_env(),
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"dispatcher {args} exited {proc.returncode}: {proc.stderr}")
        return proc

    def daemon(self, *args: str) -> Daemon:
        """Start `dispatcher run` as a real process; stopped at teardown."""
        d = Daemon(self, list(args))
        d.start()
        self._daemons.append(d)
        return d

    _daemons: list[Daemon] = field(default_factory=list)

    # -- orders -----------------------------------------------------------
    def drop(self, body: dict[str, Any] | str | bytes, name: str | None = None) -> Path:
        """Safe-drop an order into inbox/: write a hidden temp file, then rename it in."""
        if isinstance(body, dict):
            name = name or f"{body['job_id']}.json"
            data = json.dumps(body).encode() if name.endswith(".json") else yaml.safe_dump(body).encode()
        else:
            assert name, "a name is needed for raw bytes"
            data = body.encode() if isinstance(body, str) else body
        inbox = self.root / "inbox"
        inbox.mkdir(parents=True, exist_ok=True)
        tmp = inbox / f".{name}.tmp"
        tmp.write_bytes(data)
        final = inbox / name
        os.rename(tmp, final)
        return final

    # -- state ------------------------------------------------------------
    def job_dir(self, job_id: str, state: str) -> Path:
        return self.root / state / job_id

    def result(self, job_id: str, state: str) -> dict[str, Any]:
        """Read result.json of a finished job."""
        return json.loads((self.job_dir(job_id, state) / "result.json").read_text())

    def wait_job(
        self, job_id: str, state: str | None = None, timeout: float = DEADLINE, *, after: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Wait until the job has a result.json in done/ or failed/; check its state.

        ``after``: a result the job had before a `retry` (which the daemon carries out later):
        wait for one with more attempts, not that one still in failed/.
        """
        before = -1 if after is None else len(after.get("attempts") or [])

        def finished() -> tuple[str, dict[str, Any]] | None:
            for s in ("done", "failed"):
                path = self.root / s / job_id / "result.json"
                if path.exists():
                    try:
                        result = json.loads(path.read_text())
                    except json.JSONDecodeError:
                        return None
                    return (s, result) if len(result.get("attempts") or []) > before else None
            return None

        where, result = wait_until(finished, timeout, f"job {job_id} to finish")
        if state is not None:
            assert where == state, f"{job_id} ended in {where}: {result.get('reason')}"
        return result

    def refusals(self) -> list[Path]:
        """Return the refusal folders in failed/ (names with '@')."""
        failed = self.root / "failed"
        return sorted(p for p in failed.iterdir() if "@" in p.name) if failed.exists() else []

    def wait_refused(self, stem: str, timeout: float = DEADLINE) -> dict[str, Any]:
        """Wait for a refusal folder of the file with this stem; return its result."""

        def found() -> dict[str, Any] | None:
            for p in self.refusals():
                if p.name.startswith(stem + "@") and (p / "result.json").exists():
                    return json.loads((p / "result.json").read_text()) | {"_dir": str(p)}
            return None

        return wait_until(found, timeout, f"refusal of {stem}")

    def starts(self) -> list[tuple[str, int]]:
        """Return the (job_id, attempt) lines the fake agent recorded at each start."""
        if not self.count_file.exists():
            return []
        out = []
        for line in self.count_file.read_text().splitlines():
            job, attempt, _pid = line.split()
            out.append((job, int(attempt)))
        return out


def cli_env() -> dict[str, str]:
    """Return an environment for the CLI: no inherited config, no notify socket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def namespaced_daemon(
    config: Path,
    out: Path,
    cwd: Path,
    *,
    hostname: str | None = None,
    pid1: bool = True,
    before: str = "",
    after: str = "",
) -> subprocess.Popen[bytes]:
    """Start `dispatcher run` in a pid namespace of its own, as a container runs it (`unshare --pid --mount-proc`).

    ``hostname``: its own host name (`--uts`); else this host's. ``pid1``: the daemon is pid 1 there, else
    a child of its `sh`. ``before``: shell run first (ending in `&&`); ``after``: shell run once the daemon
    ended, its `sh` still the namespace's init (a container whose init outlives its daemon). Its output goes
    to out; SIGKILL of the returned process ends the whole namespace.
    """
    import shutil

    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed"
    script = f"hostname {hostname} && " if hostname else ""
    script += before + ("exec " if pid1 and not after else "") + '"$0" -m dispatcher --config "$1" run'
    script += f"; {after}" if after else ""
    uts = ["--uts"] if hostname else []
    with open(out, "wb") as log:
        return subprocess.Popen(
            [unshare, *uts, "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", script, sys.executable,
             str(config)],
            stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=cwd,
        )  # fmt: skip


class Daemon:
    """A real `dispatcher run` process with its output captured to a file."""

    def __init__(self, env: Env, args: list[str]) -> None:
        self.env = env
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = env.tmp / f"daemon-{len(env._daemons)}-{time.monotonic_ns()}.log"

    def start(self) -> None:
        self._fh = self.out.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(self.env.config_path), "run", *self.args],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=self.env.tmp,
            env=cli_env() | {"PYTHONFAULTHANDLER": "1"},  # stacks on SIGABRT, for ``post_mortem``
        )

    def events(self) -> list[dict[str, Any]]:
        """Return the JSON log lines printed so far."""
        lines = []
        for line in self.out.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return lines

    def wait_event(self, event: str, timeout: float = DEADLINE, **match: Any) -> dict[str, Any]:
        """Wait for a log line with this event (and these key values)."""

        def found() -> dict[str, Any] | None:
            for e in self.events():
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None

        def seen() -> dict[str, Any] | None:
            exited = self.proc is not None and self.proc.poll() is not None
            line = found()  # after the exit check: once it exited, its output is whole
            if line is None and exited:
                raise AssertionError(
                    f"the daemon exited without logging {event} {match}"
                )  # the end of its output: below
            return line

        try:
            return wait_until(seen, timeout, f"log event {event} {match}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.post_mortem()}") from None

    def post_mortem(self) -> str:
        """Return the end of the daemon's output; a daemon still running first dumps its threads' stacks
        (SIGABRT, with PYTHONFAULTHANDLER set), so that a test that timed out says where it hung."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        lines = self.out.read_text(errors="replace").splitlines()
        return f"daemon exit code {self.proc.poll()}; its last output lines:\n" + "\n".join(lines[-60:])

    def wait_ready(self) -> None:
        self.wait_event("daemon.ready")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = DEADLINE) -> int:
        """Send SIGTERM and wait for the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._fh.close()

    def kill(self) -> None:
        """kill -9 the daemon."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE)
        self._fh.close()

    def wait(self, timeout: float = DEADLINE) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            self._fh.close()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    """A dispatch root and config on tmp_path, with the fake agent as `worker`."""
    e = Env(
        tmp=tmp_path,
        root=tmp_path / "dispatch",
        config_path=tmp_path / "dispatcher.yaml",
        count_file=tmp_path / "starts.txt",
    )
    e.configure()
    yield e
    from helpers_faults import reap  # imported late: helpers_faults imports this module

    reap(e)  # kill daemons still running, close their logs, end stray agents


def pytest_addoption(parser: pytest.Parser) -> None:
    """--powercut-long: run tests/test_powercut.py over every cut point, in both filesystem modes."""
    parser.addoption(
        "--powercut-long",
        action="store_true",
        default=False,
        help="power-cut suite: every cut point (several hundred), strict and gentle (README: Power cuts)",
    )
