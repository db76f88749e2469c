"""Run the daemon on the power-cut filesystem, cut the power at a chosen moment, recover, check the promises.

One trial: a fresh lazyfs mount holds the dispatch root and its SQLite ledger; orders
for plain, retry-safe, review, handing-off, flaky and slow agents are dropped durably;
the real daemon runs on it while the harness plays the operator (approve, retry,
cancel). At the cut point, named by a log event (or a command the harness runs) and a
number of filesystem operations after it, the filesystem freezes, the daemon and its
agents are killed, and only the durable model is written back, onto plain disk at the
same path. Then ``dispatcher run --once`` recovers, leftover reviews are approved, and
:func:`broken_promises` lists every promise the folders, the ledger and the agents'
start records break.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
LAZYFS = HERE / "lazyfs.py"
FAKE_AGENT = TESTS / "agents" / "fakeagent.py"
FINISHED = ("done", "failed", "review")


# -- the workload --------------------------------------------------------------------


def _order(job_id: str, to: str, sender: str = "tester") -> dict[str, Any]:
    return {
        "job_id": job_id,
        "from": sender,
        "to": to,
        "task": "Assign each request to one team.",
        "items": [{"id": f"R{i}", "summary": f"request {i}"} for i in (1, 2)],
        "accept": {"output": "out.csv"},
    }


#: job id -> agent, for the orders the user drops
ORDERS = {
    "P1": "plain",
    "P2": "plain",
    "S1": "safe",
    "V1": "reviewer",
    "F1": "sender",
    "X1": "flaky",
    "C1": "slow",
}
#: the jobs whose end means the workload is over (X1 may end twice: failed, then done after its retry)
SETTLED = {"P1", "P2", "S1", "F1", "F1.child", "V1.next", "C1", "X1"}
#: follow-up id -> (parent, agent)
FOLLOWUPS = {"F1.child": ("F1", "plain"), "V1.next": ("V1", "plain")}
RETRY_SAFE = {"safe"}


def agents(count_file: Path) -> dict[str, dict[str, Any]]:
    """Return the config's agents: each runs the fake agent, recording its starts in count_file."""

    def agent(*flags: str, **settings: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "command": [sys.executable, str(FAKE_AGENT), "--count", str(count_file), *flags],
            "timeout": 30,
            "writes": ["out.csv"],
        }
        spec.update(settings)
        return spec

    child = json.dumps(_order("F1.child", "plain", sender="sender"))
    nxt = json.dumps(_order("V1.next", "plain", sender="reviewer"))
    return {
        "plain": agent(),
        "safe": agent("--fail-attempts", "1", retry_safe=True, max_attempts=3),
        "reviewer": agent("--followup", nxt, review=True),
        "sender": agent("--followup", child),
        "flaky": agent("--fail-attempts", "1"),
        "slow": agent("--sleep", "1.5"),
    }


# -- cut points ----------------------------------------------------------------------


@dataclass(frozen=True)
class CutPoint:
    """Where to cut: after the nth `anchor` (a log event, or "cmd:approve" etc.), `after` operations of `kind` later."""

    phase: str
    anchor: str
    job: str | None = None
    after: int = 0
    kind: str = "any"
    nth: int = 1

    @property
    def name(self) -> str:
        who = f"@{self.job}" if self.job else ""
        return f"{self.phase}:{self.anchor}{who}+{self.after}{'' if self.kind == 'any' else self.kind}"


def cut_points(long: bool = False) -> list[CutPoint]:
    """Return the cut points: each phase of a job's life, at several distances after its anchor."""
    near = (0, 2, 5, 12) if not long else (0, 1, 2, 3, 4, 5, 7, 9, 12, 16, 20, 25, 30, 40, 60)
    syncs = (0, 1, 3) if not long else (0, 1, 2, 3, 4, 5, 6, 8, 10)
    # (phase, anchor, job, counted: every operation or fsyncs only, nth anchor), in the order they run
    anchors = (
        ("claim", "order.received", "P1", "any", 1),
        ("claim", "job.claimed", "P1", "fsync", 1),
        ("start", "agent.started", "P2", "any", 1),
        ("finish", "agent.exited", "P1", "any", 1),
        ("finish", "agent.exited", "S1", "fsync", 2),
        ("followup", "job.done", "F1", "any", 1),
        ("followup", "agent.exited", "F1", "fsync", 1),
        ("review", "cmd:approve", "V1", "any", 1),
        ("review", "agent.exited", "V1", "fsync", 1),
        ("retry", "cmd:retry", "X1", "any", 1),
        ("retry", "job.retrying", "S1", "fsync", 1),
        ("cancel", "cmd:cancel", "C1", "any", 1),
    )
    points = [
        CutPoint(phase, anchor, job, after, kind, nth)
        for phase, anchor, job, kind, nth in anchors
        for after in (syncs if kind == "fsync" else near)
    ]
    if long:
        for n in range(0, 132, 4):  # the workload makes about 135 fsyncs before it settles
            points.append(CutPoint("any", "boot", None, n, "fsync"))
    return points


def start_run(config: Path, log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `dispatcher run` in a session of its own, its stdout and stderr into log."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(config), "run"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )


# -- the filesystem ------------------------------------------------------------------


class LazyMount:
    """A running lazyfs process and its control socket."""

    def __init__(self, backing: Path, mountpoint: Path, mode: str) -> None:
        self.backing, self.mountpoint, self.mode = backing, mountpoint, mode
        self.sock = backing.parent / "lazyfs.sock"
        self.log = backing.parent / "lazyfs.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None:
            raise RuntimeError("FUSE is needed: /dev/fuse and fusermount3 (Debian package fuse3; .ci/run installs it)")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(LAZYFS), str(self.backing), str(self.mountpoint), *self.options()],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        end = time.monotonic() + 20
        while not (os.path.ismount(self.mountpoint) and self.sock.exists()):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"lazyfs did not mount: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def options(self) -> list[str]:
        return ["--control", str(self.sock), "--mode", self.mode]

    def cmd(self, **req: Any) -> dict[str, Any]:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            with s.makefile("rwb") as f:
                f.write(json.dumps(req).encode() + b"\n")
                f.flush()
                reply: dict[str, Any] = json.loads(f.readline())
        if not reply.get("ok"):
            raise RuntimeError(f"lazyfs {req}: {reply}")
        return reply

    def unmount(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False, capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


TEMPLATES = Path(os.environ.get("TMPDIR", "/tmp")) / f"powercut-templates-{os.getpid()}"
atexit.register(shutil.rmtree, TEMPLATES, True)


def _no_orders(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if folder.endswith("inbox")]


# -- processes -----------------------------------------------------------------------


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose command line holds marker (this trial's count file)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- one trial -----------------------------------------------------------------------


@dataclass
class Trial:
    """One run of the workload with one power cut, on its own folder."""

    tmp: Path
    point: CutPoint | None
    mode: str = "strict"
    events_before: list[dict[str, Any]] = field(default_factory=list)
    acked: dict[str, str] = field(default_factory=dict)  # command -> job id, acknowledged before the cut
    asked: set[str] = field(default_factory=set)  # commands started before the cut
    cut_reached: bool = False
    cut_op: str = ""
    notes: list[str] = field(default_factory=list)
    dump_counts: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)  # the filesystem's operation counts at the cut

    def __post_init__(self) -> None:
        self.mnt = self.tmp / "mnt"
        self.root = self.mnt / "dispatch"
        self.count = self.tmp / "starts.txt"
        self.config = self.tmp / "dispatcher.yaml"
        self.fs = LazyMount(self.tmp / "backing", self.mnt, self.mode)

    # -- helpers --------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
        env["PYTHONPATH"] = str(TESTS.parent) + os.pathsep + env.get("PYTHONPATH", "")
        env["DISPATCHER_LOCAL_FUSE"] = "lazyfs"  # the ledger's way past its network-filesystem refusal
        return env

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dispatcher", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
            env=self.env(),
        )

    def write_config(self) -> None:
        cfg = {
            "root": str(self.root),
            "max_jobs": 4,
            "settle": 0.1,
            "retry_delay": 0.1,
            "rescan_interval": 1,
            "kill_grace": 1,
            "stop_timeout": 10,
            "agents": agents(self.count),
        }
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))

    def prepare(self) -> None:
        """Make the root as a daemon run left it, sync everything, then drop the orders durably.

        The orders are dropped the way a careful user does (temp name, fsync, rename,
        fsync inbox/), so that whatever is lost after the cut is the daemon's loss.
        """
        if not (self.backing_template / "dispatch").exists():
            self.root.mkdir()
            first = self.cli("run", "--once")
            if first.returncode != 0:
                raise RuntimeError(f"`run --once` on the empty root exited {first.returncode}: {first.stderr}")
            self.fs.cmd(cmd="sync")
        inbox = self.root / "inbox"
        for job_id, agent in ORDERS.items():
            tmp = inbox / f".{job_id}.tmp"
            with tmp.open("wb") as f:
                f.write(json.dumps(_order(job_id, agent)).encode())
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, inbox / f"{job_id}.json")
        fsync_path(inbox)

    def _keep_template(self) -> None:
        """Copy the prepared root (before any order) for the next trials of this process."""
        part = self.backing_template.with_name(self.backing_template.name + f".{os.getpid()}.tmp")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        shutil.copytree(self.fs.backing / "dispatch", part / "dispatch", symlinks=True, ignore=_no_orders)
        for lock in (part / "dispatch" / ".state" / "daemons").glob("*"):
            lock.unlink()  # the dead preparing daemon: nothing to recover from it
        os.rename(part, self.backing_template)

    # -- the run before the cut --------------------------------------------------
    def run(self, deadline_s: float = 40) -> None:
        """Run the daemon on the mount until the cut, then cut, write the durable model back, recover."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.write_config()
        # the root as the first `run --once` leaves it, made once per process and copied (all of it durable)
        self.backing_template = TEMPLATES / self.mode
        if (self.backing_template / "dispatch").exists():
            shutil.copytree(self.backing_template, self.fs.backing, symlinks=True)
        self.fs.start()
        try:
            self.prepare()
            if not (self.backing_template / "dispatch").exists():
                self._keep_template()
            self._drive(deadline_s)
        finally:
            self._cut()
        self._recover()

    def _arm(self) -> None:
        assert self.point is not None
        self.fs.cmd(cmd="arm", after=self.point.after, kind=self.point.kind)

    def _drive(self, deadline_s: float) -> None:
        point = self.point
        if point is not None and point.anchor == "boot":
            self._arm()
        log = self.tmp / "daemon-0.log"
        self.daemon = start_run(self.config, log, self.tmp, self.env())
        self.commands: list[tuple[str, str, subprocess.Popen[str]]] = []
        seen: Counter[tuple[str, str | None]] = Counter()
        pos = 0
        buf = b""
        end = time.monotonic() + deadline_s
        finished: set[str] = set()
        while time.monotonic() < end:
            with log.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.events_before.append(ev)
                name, job = ev.get("event"), ev.get("job_id")
                seen[(name, job)] += 1
                at_anchor = point is not None and point.anchor == name and point.job in (None, job)
                if at_anchor and seen[(name, job)] == point.nth:
                    self._arm()
                self._react(name, job)
                if name in ("job.done", "job.failed", "job.review") and job:
                    finished.add(job)
            for cmd, job, proc in self.commands:
                if proc.poll() == 0 and cmd not in self.acked:
                    self.acked[cmd] = job
            status = self.fs.cmd(cmd="status")
            if status["frozen"]:
                self.cut_reached = True
                self.cut_op = status["cut_op"]
                return
            if self.daemon.poll() is not None:
                self.notes.append(f"the daemon exited {self.daemon.returncode} before the cut")
                break
            self.ops = status["ops"]
            if finished >= SETTLED and (point is None or point.anchor == "boot"):
                break  # the workload is over: a later cut point cannot come
            time.sleep(0.01)
        if point is not None:
            self.notes.append(f"cut point {point.name} not reached; cut at the end instead")

    def _react(self, name: str | None, job: str | None) -> None:
        """Play the operator: approve the review, retry the flaky job once, cancel the slow one."""
        if name == "job.review" and job == "V1":
            self._command("approve", "V1")
        elif name == "job.failed" and job == "X1" and "retry" not in self.asked:
            self._command("retry", "X1")
        elif name == "agent.started" and job == "C1":
            self._command("cancel", "C1")

    def _command(self, cmd: str, job: str) -> None:
        if cmd in self.asked:
            return
        self.asked.add(cmd)
        if self.point is not None and self.point.anchor == f"cmd:{cmd}":
            self._arm()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(self.config), cmd, job],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.tmp,
            env=self.env(),
            start_new_session=True,
        )
        self.commands.append((cmd, job, proc))

    # -- the cut -------------------------------------------------------------------
    def _cut(self) -> None:
        with contextlib.suppress(Exception):
            self.fs.cmd(cmd="cut")
        procs = [self.daemon] if hasattr(self, "daemon") else []
        procs += [p for _c, _j, p in getattr(self, "commands", [])]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(str(self.count))
        for proc in procs:
            proc.communicate(timeout=30)  # waits, and closes the commands' pipes
        durable = self.tmp / "durable"
        try:
            self.dump_counts = self.fs.cmd(cmd="dump", dest=str(durable))["counts"]
        finally:
            self.fs.unmount()
        for name in os.listdir(durable):  # the mount point is a plain folder again: the disk after the cut
            os.rename(durable / name, self.mnt / name)

    # -- recovery on plain disk -----------------------------------------------------
    def _recover(self) -> None:
        self.recovery: list[subprocess.CompletedProcess[str]] = []
        first = self.cli("run", "--once", timeout=120)
        self.recovery.append(first)
        for _ in range(3):  # a person finishes what waits for them, as after any restart
            waiting = (
                sorted(p.name for p in (self.root / "review").glob("*")) if (self.root / "review").exists() else []
            )
            if not waiting:
                break
            for job in waiting:
                self.recovery.append(self.cli("approve", job))
            self.recovery.append(self.cli("run", "--once", timeout=120))


# -- the promises ----------------------------------------------------------------------


def _folders(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for state in ("active", *FINISHED):
        folder = root / state
        if folder.exists():
            for p in folder.iterdir():
                if not p.name.startswith("."):
                    out[p.name].append(state)
    return out


def _starts(count: Path) -> list[tuple[str, int]]:
    if not count.exists():
        return []
    out = []
    for line in count.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((parts[0], int(parts[1])))
    return out


def _ledger(root: Path) -> dict[str, str] | str:
    path = root / ".state" / "ledger.sqlite3"
    if not path.exists():
        return "no ledger file"
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return dict(con.execute("SELECT job_id, state FROM jobs").fetchall())
        finally:
            con.close()
    except sqlite3.Error as exc:
        return f"the ledger cannot be read: {exc}"


def broken_promises(t: Trial) -> list[str]:
    """Return one line for each promise the recovered root breaks (empty when all hold)."""
    broken: list[str] = []
    root = t.root
    for proc in t.recovery:
        if proc.returncode not in (0, 1):
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["(no stderr)"]
            broken.append(f"recovery: `{' '.join(proc.args[4:])}` exited {proc.returncode}: {tail[0][:300]}")
    folders = _folders(root)
    inbox = {p.stem: p for p in (root / "inbox").glob("*.json")} if (root / "inbox").exists() else {}
    refused = sorted(p.name for p in (root / "failed").glob("*@*")) if (root / "failed").exists() else []
    ledger = _ledger(root)
    before = {(e.get("event"), e.get("job_id")) for e in t.events_before}

    # every job id ends in exactly one of done/, failed/, review/ (or is back in inbox/ untouched)
    expected = dict(ORDERS)
    for child, (parent, agent) in FOLLOWUPS.items():
        if folders.get(parent) == ["done"]:
            expected[child] = agent
    for job_id in expected:
        states = folders.get(job_id, [])
        if len(states) == 1 and states[0] in FINISHED:
            continue
        if not states and job_id in inbox:
            if job_id in ORDERS and json.loads(inbox[job_id].read_bytes()) != _order(job_id, ORDERS[job_id]):
                broken.append(f"{job_id}: back in inbox/ but its bytes changed")
            else:
                broken.append(f"{job_id}: still in inbox/ after `run --once`")
            continue
        if "active" in states:
            has_spec = (root / "active" / job_id / "job.json").exists()
            what = "with its job.json" if has_spec else "without job.json (an empty claim, skipped silently)"
            broken.append(f"{job_id}: stuck in active/ {what} after `run --once`")
        elif not states:
            broken.append(f"{job_id}: lost: in no folder (order {'dropped' if job_id in ORDERS else 'released'})")
        else:
            broken.append(f"{job_id}: in {len(states)} folders: {', '.join(states)}")
    for job_id, states in folders.items():
        if job_id not in expected and "@" not in job_id:
            broken.append(f"{job_id}: unexpected job folder in {', '.join(states)}")

    # no valid order refused; no follow-up released twice
    for name in refused:
        stem = name.split("@", 1)[0]
        what = "follow-up released twice" if stem in FOLLOWUPS else "valid order refused"
        broken.append(f"{stem}: {what}: failed/{name}")

    # no follow-up lost: a child of a done parent exists (checked above); none of a parent that is not done
    for child, (parent, _agent) in FOLLOWUPS.items():
        if folders.get(parent) != ["done"] and (child in folders or child in inbox):
            broken.append(f"{child}: released although its parent {parent} is {folders.get(parent)}")
        if ("followup.released", child) in before and child not in folders and child not in inbox:
            broken.append(f"{child}: released before the cut, gone after it")

    # no agent that is not retry-safe started twice
    starts = _starts(t.count)
    per_job: dict[str, list[int]] = defaultdict(list)
    for job_id, attempt in starts:
        per_job[job_id].append(attempt)
    agent_of = {**ORDERS, **{c: a for c, (_p, a) in FOLLOWUPS.items()}}
    for job_id, attempts in per_job.items():
        if agent_of.get(job_id) in RETRY_SAFE:
            continue
        allowed = 2 if job_id == "X1" and (folders.get("X1") == ["done"] or "retry" in t.asked) else 1
        dupes = [a for a, n in Counter(attempts).items() if n > 1]
        if dupes or len(attempts) > allowed:
            broken.append(f"{job_id}: agent {agent_of.get(job_id)} (not retry-safe) started {len(attempts)} times")

    # every finished folder holds result.json, work/ and attempts/; its state is the folder's
    for job_id, states in folders.items():
        for state in states:
            if state not in FINISHED:
                continue
            folder = root / state / job_id
            needed = ("result.json",) if "@" in job_id else ("result.json", "work", "attempts")  # a refusal: no run
            missing = [n for n in needed if not (folder / n).exists()]
            if missing:
                broken.append(f"{job_id}: {state}/{job_id} lacks {', '.join(missing)}")
                continue
            try:
                result = json.loads((folder / "result.json").read_bytes())
            except (OSError, ValueError) as exc:
                broken.append(f"{job_id}: {state}/{job_id}/result.json unreadable: {exc}")
                continue
            if "@" not in job_id and result.get("state") != state:
                broken.append(f"{job_id}: result.json says {result.get('state')} in {state}/")
            if state == "failed" and not result.get("reason"):
                broken.append(f"{job_id}: failed without a reason")

    # a finished job stays finished; acknowledged commands are kept
    for job_id in expected:
        if ("job.done", job_id) in before and folders.get(job_id) != ["done"]:
            broken.append(f"{job_id}: logged job.done before the cut, {folders.get(job_id) or 'nowhere'} after it")
    if t.acked.get("approve") and folders.get("V1") != ["done"]:
        broken.append(f"V1: approve acknowledged before the cut, {folders.get('V1') or 'nowhere'} after it")
    if t.acked.get("cancel") and folders.get("C1") != ["failed"] and ("job.done", "C1") not in before:
        broken.append(f"C1: cancel acknowledged before the cut, {folders.get('C1') or 'nowhere'} after it")
    if t.acked.get("retry") and ("X1", 2) not in starts:
        broken.append(f"X1: retry acknowledged before the cut, never attempted again (in {folders.get('X1')})")

    # the ledger agrees with the folders
    if isinstance(ledger, str):
        broken.append(f"ledger: {ledger}")
    else:
        for job_id, states in folders.items():
            if "@" in job_id or len(states) != 1:
                continue
            row = ledger.get(job_id)
            if row != states[0]:
                broken.append(f"{job_id}: ledger says {row or 'nothing'}, folder is in {states[0]}/")
        for job_id, row in ledger.items():
            if row in FINISHED and job_id not in folders:
                broken.append(f"{job_id}: ledger says {row}, but there is no folder")
            if row == "claimed" and job_id not in folders:
                broken.append(f"{job_id}: ledger says claimed, but there is no folder")
    return broken


def report(t: Trial, broken: list[str]) -> str:
    """Return a short text naming the cut point and what broke."""
    name = t.point.name if t.point else "no cut"
    head = f"[{t.mode}] cut {name} (op {t.cut_op or '-'}; reached={t.cut_reached}; model {t.dump_counts})"
    return "\n".join([head, *(f"  - {b}" for b in broken), *(f"  note: {n}" for n in t.notes)])
