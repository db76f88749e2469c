#!/usr/bin/env python3
"""Measure the dispatcher on this machine: throughput, pickup latency, ledger lookups.

Run from the repository root:

    .venv/bin/python benchmarks/bench.py [--orders N] [--pickup-samples M] [--max-jobs 2]

Sections, all in one run on fresh temporary dispatch roots:

1. Throughput: N orders through the real daemon, (a) pre-dropped then `run --once`, and
   (b) safe-dropped as fast as possible into an already running `run`; baseline: the same
   agent over the same N orders through `xargs -P <max-jobs>`.
2. Pickup latency: an idle running daemon, one order at a time; latency is the agent's own
   start stamp minus the time just before the `rename` into inbox/. Baseline: one spawn of
   the agent straight from Python.
3. Ledger lookup at scale: a ledger with 1,000,000 job ids, then duplicate lookups.

Prints a table and, as its last line, one JSON object with the figures. Exits 0 when every
section ran and every job ended in done/, 1 otherwise (the symptom is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
AGENT = HERE / "agent.sh"
AGENT_NAME = "bench"
ITEM_ID = "R1"
READY_TIMEOUT_S = 60.0
POLL_S = 0.01


class BenchError(Exception):
    """A section could not produce its figures; the message says what was seen."""


# -- small helpers -----------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Return the nearest-rank percentile p (0..100) of values."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def parse_ts(text: str) -> float | None:
    """Return a log line's ISO 8601 timestamp as epoch seconds, or None."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def child_env() -> dict[str, str]:
    """Return the environment for `python -m dispatcher`: no inherited config or notify socket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def order_bytes(job_id: str) -> bytes:
    """Return a valid work order for the bench agent, as JSON."""
    body = {
        "job_id": job_id,
        "from": "bench",
        "to": AGENT_NAME,
        "task": "Copy the one item id to out.csv.",
        "items": [{"id": ITEM_ID}],
        "accept": {"output": "out.csv"},
    }
    return json.dumps(body).encode()


def job_ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:07d}" for i in range(1, n + 1)]


def write_config(base: Path, max_jobs: int, agent_env: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write a config under base (root base/dispatch) and return (config path, root).

    Only what the benchmark needs is set; every check and durability setting keeps its
    default. JSON is valid YAML, so no YAML writer is needed.
    """
    root = base / "dispatch"
    cfg = {
        "root": str(root),
        "max_jobs": max_jobs,
        "agents": {
            AGENT_NAME: {
                "command": ["sh", str(AGENT)],
                "concurrency": max_jobs,
                "timeout": 60,
                "writes": ["out.csv"],
                "env": agent_env or {},
            }
        },
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


# -- the daemon process ------------------------------------------------------------


class Daemon:
    """A real `python -m dispatcher --config CFG run [...]` with stdout+stderr in a file."""

    def __init__(self, config: Path, base: Path, args: list[str]) -> None:
        self.config = config
        self.log_path = base / f"daemon-{'-'.join(a.strip('-') for a in args) or 'run'}.log"
        self.argv = [sys.executable, "-m", "dispatcher", "--config", str(config), "run", *args]
        self.proc: subprocess.Popen[bytes] | None = None
        self._fh: Any = None
        self._offset = 0
        self._events: list[dict[str, Any]] = []
        self._junk: list[str] = []

    def start(self) -> None:
        self._fh = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.config.parent,
            env=child_env(),
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events():
                if event.get("event") == name:
                    return event
            if not self.running():
                raise BenchError(f"daemon exited ({self.exit_code()}) before `{name}`\n{self.symptoms()}")
            if time.monotonic() > deadline:
                raise BenchError(f"no `{name}` log line within {timeout:.0f} s\n{self.symptoms()}")
            time.sleep(POLL_S)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def symptoms(self, limit: int = 12) -> str:
        """Return the log lines a reader needs to see why the daemon misbehaved."""
        events = self.events()
        bad = [
            e
            for e in events
            if str(e.get("level", "")).lower() in ("warning", "error", "critical", "exception")
            or e.get("event") in ("job.failed", "job.refused", "config.rejected")
        ]
        lines = [f"  daemon: {shlex.join(self.argv)} (log {self.log_path})"]
        lines += ["  " + json.dumps(e)[:400] for e in bad[:limit]]
        if not bad:
            lines += ["  (no warning/error lines) last lines:"]
            lines += ["  " + json.dumps(e)[:400] for e in events[-5:]]
        lines += ["  " + j[:400] for j in self._junk[-limit:]]
        return "\n".join(lines)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; always close the log file."""
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


@contextlib.contextmanager
def daemon(config: Path, base: Path, args: list[str]) -> Iterator[Daemon]:
    d = Daemon(config, base, args)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def failed_reasons(root: Path, limit: int = 5) -> list[str]:
    """Return 'name: reason' for the first entries of failed/."""
    out = []
    failed = root / "failed"
    for name in sorted(os.listdir(failed))[:limit] if failed.is_dir() else []:
        try:
            reason = json.loads((failed / name / "result.json").read_text()).get("reason")
        except (OSError, json.JSONDecodeError) as exc:
            reason = f"(no readable result.json: {exc.__class__.__name__})"
        out.append(f"  failed/{name}: {reason}")
    return out


def wait_all_done(root: Path, ids: list[str], timeout: float, d: Daemon | None) -> float:
    """Poll until every id has done/<id>/result.json; return time.perf_counter() at that moment.

    Fails fast when anything shows up in failed/ or the daemon exits.
    """
    pending = set(ids)
    done_dir, failed_dir = root / "done", root / "failed"
    deadline = time.monotonic() + timeout
    while pending:
        with contextlib.suppress(FileNotFoundError):
            for name in set(os.listdir(done_dir)) & pending:
                if (done_dir / name / "result.json").exists():
                    pending.discard(name)
        if not pending:
            break
        if failed_dir.is_dir() and os.listdir(failed_dir):
            raise BenchError(
                f"{len(os.listdir(failed_dir))} entries in failed/, {len(pending)} jobs not done\n"
                + "\n".join(failed_reasons(root))
                + ("\n" + d.symptoms() if d else "")
            )
        if d is not None and not d.running():
            raise BenchError(f"daemon exited ({d.exit_code()}) with {len(pending)} jobs not done\n{d.symptoms()}")
        if time.monotonic() > deadline:
            where = {s: len(os.listdir(root / s)) for s in ("inbox", "active", "done", "failed") if (root / s).is_dir()}
            raise BenchError(
                f"{len(pending)} of {len(ids)} jobs not done after {timeout:.0f} s; "
                f"folders {where}\n" + (d.symptoms() if d else "")
            )
        time.sleep(POLL_S)
    return time.perf_counter()


def steady_rate(events: list[dict[str, Any]], n: int) -> float | None:
    """Return jobs/s between the first agent.started and the last job.done log lines."""
    starts = [parse_ts(e.get("timestamp", "")) for e in events if e.get("event") == "agent.started"]
    dones = [parse_ts(e.get("timestamp", "")) for e in events if e.get("event") == "job.done"]
    starts_ok = [t for t in starts if t is not None]
    dones_ok = [t for t in dones if t is not None]
    if not starts_ok or len(dones_ok) < n:
        return None
    span = max(dones_ok) - min(starts_ok)
    return n / span if span > 0 else None


# -- section 1: throughput -----------------------------------------------------------


def bench_once(base: Path, n: int, max_jobs: int, timeout: float) -> dict[str, Any]:
    """Pre-drop n orders into inbox/, then time `run --once` from spawn to exit."""
    config, root = write_config(base, max_jobs)
    inbox = root / "inbox"
    inbox.mkdir(parents=True)
    ids = job_ids("ONCE", n)
    for job_id in ids:
        safe_drop(inbox, job_id, order_bytes(job_id))
    # These files "arrived while no daemon ran": make them older than any settle time.
    old = time.time() - 600
    for job_id in ids:
        os.utime(inbox / f"{job_id}.json", (old, old))

    d = Daemon(config, base, ["--once"])
    t0 = time.perf_counter()
    d.start()
    try:
        assert d.proc is not None
        code = d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        d.stop()
        done = len(os.listdir(root / "done")) if (root / "done").is_dir() else 0
        raise BenchError(f"run --once still running after {timeout:.0f} s ({done}/{n} done)\n{d.symptoms()}") from None
    finally:
        elapsed = time.perf_counter() - t0
        d.stop()
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if code != 0 or done != n:
        raise BenchError(
            f"run --once exited {code} with {done}/{n} jobs in done/\n"
            + "\n".join(failed_reasons(root))
            + "\n"
            + d.symptoms()
        )
    return {
        "jobs": n,
        "seconds": elapsed,
        "jobs_per_s": n / elapsed,
        "steady_jobs_per_s": steady_rate(d.events(), n),
    }


def bench_running(base: Path, n: int, max_jobs: int, timeout: float) -> dict[str, Any]:
    """Start `run`, wait for daemon.ready, safe-drop n orders at once, time until all are done."""
    config, root = write_config(base, max_jobs)
    ids = job_ids("LIVE", n)
    payloads = [order_bytes(j) for j in ids]
    t_spawn = time.perf_counter()
    with daemon(config, base, []) as d:
        d.wait_event("daemon.ready", READY_TIMEOUT_S)
        ready_s = time.perf_counter() - t_spawn
        inbox = root / "inbox"
        t0 = time.perf_counter()
        for job_id, data in zip(ids, payloads, strict=True):
            safe_drop(inbox, job_id, data)
        dropped_s = time.perf_counter() - t0
        t_end = wait_all_done(root, ids, timeout, d)
        elapsed = t_end - t0
        rate = steady_rate(d.events(), n)
    return {
        "jobs": n,
        "seconds": elapsed,
        "jobs_per_s": n / elapsed,
        "steady_jobs_per_s": rate,
        "startup_to_ready_s": ready_s,
        "drop_all_s": dropped_s,
    }


def bench_xargs(base: Path, n: int, max_jobs: int, timeout: float) -> dict[str, Any]:
    """Run the agent n times through `xargs -P`, each in a fresh work dir holding order.json."""
    if shutil.which("xargs") is None:
        raise BenchError("xargs not found on PATH")
    ids = job_ids("XARG", n)
    args = bytearray()
    common = [
        f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}",
        f"HOME={os.environ.get('HOME', '/')}",
        f"LANG={os.environ.get('LANG', 'C.UTF-8')}",
    ]
    for job_id in ids:  # untimed set-up: work dirs, order.json, the argument list
        work = base / "jobs" / job_id / "work"
        work.mkdir(parents=True)
        (work / "order.json").write_bytes(order_bytes(job_id))
        argv = [
            "-i",
            *common,
            f"DISPATCH_JOB_ID={job_id}",
            f"DISPATCH_ORDER={work / 'order.json'}",
            f"DISPATCH_WORKSPACE={work}",
            f"DISPATCH_RECEIPT={work / 'receipt.json'}",
            "DISPATCH_ATTEMPT=1",
            "sh",
            str(AGENT),
        ]
        per_call = len(argv)
        for a in argv:
            args += a.encode() + b"\0"
    argfile = base / "args.bin"
    argfile.write_bytes(bytes(args))
    cmd = ["xargs", "-0", "-P", str(max_jobs), "-n", str(per_call), "env"]
    with open(argfile, "rb") as stdin:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdin=stdin, capture_output=True, timeout=timeout, check=False)
        elapsed = time.perf_counter() - t0
    missing = [j for j in ids if not (base / "jobs" / j / "work" / "receipt.json").exists()]
    if proc.returncode != 0 or missing:
        raise BenchError(
            f"xargs exited {proc.returncode}, {len(missing)} receipts missing: "
            f"{proc.stderr.decode(errors='replace')[:400]}"
        )
    return {"jobs": n, "seconds": elapsed, "jobs_per_s": n / elapsed, "command": shlex.join(cmd)}


# -- section 2: pickup latency -------------------------------------------------------


def read_stamp(path: Path, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = path.read_text().strip()
            if text:
                return float(text)
        if time.monotonic() > deadline:
            raise BenchError(f"the agent left no start stamp in {path}")
        time.sleep(POLL_S)


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "min_ms": min(ms),
    }


def bench_pickup(base: Path, m: int, max_jobs: int, gap_s: float) -> dict[str, Any]:
    """Drop m orders one at a time into an idle daemon; latency = agent stamp - pre-rename time."""
    stamps = base / "stamps"
    stamps.mkdir()
    config, root = write_config(base, max_jobs, {"STAMP_DIR": str(stamps)})
    ids = job_ids("PICK", m)
    lat: list[float] = []
    t_rename: dict[str, float] = {}
    with daemon(config, base, []) as d:
        d.wait_event("daemon.ready", READY_TIMEOUT_S)
        inbox = root / "inbox"
        for job_id in ids:
            data = order_bytes(job_id)
            time.sleep(gap_s)  # let the daemon go idle after the previous job
            t0 = safe_drop(inbox, job_id, data)
            t_rename[job_id] = t0
            wait_all_done(root, [job_id], 30.0, d)
            lat.append(read_stamp(stamps / job_id) - t0)
        events = d.events()
    out: dict[str, Any] = summary_ms(lat)
    # Where the time goes, from the daemon's own log timestamps (if they carry sub-ms digits).
    for name in ("order.received", "job.claimed", "agent.started"):
        deltas = [
            ts - t_rename[e["job_id"]]
            for e in events
            if e.get("event") == name
            and e.get("job_id") in t_rename
            and (ts := parse_ts(e.get("timestamp", ""))) is not None
        ]
        if len(deltas) == m:
            out[f"log_{name.replace('.', '_')}_p50_ms"] = percentile([x * 1000 for x in deltas], 50)
    return out


def bench_spawn(base: Path, m: int) -> dict[str, Any]:
    """Spawn the agent by hand from Python as the daemon would; time Popen to the agent's stamp."""
    stamps = base / "stamps"
    stamps.mkdir()
    lat = []
    for job_id in job_ids("SPAWN", m):
        work = base / job_id
        work.mkdir()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "STAMP_DIR": str(stamps),
            "DISPATCH_JOB_ID": job_id,
            "DISPATCH_ORDER": str(work / "order.json"),
            "DISPATCH_WORKSPACE": str(work),
            "DISPATCH_RECEIPT": str(work / "receipt.json"),
            "DISPATCH_ATTEMPT": "1",
        }
        with open(work / "stdout.log", "wb") as out, open(work / "stderr.log", "wb") as err:
            t0 = time.time()
            proc = subprocess.Popen(
                ["sh", str(AGENT)],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            proc.wait(30)
        if proc.returncode != 0:
            raise BenchError(f"agent exited {proc.returncode} when spawned by hand in {work}")
        lat.append(read_stamp(stamps / job_id) - t0)
    return summary_ms(lat)


# -- section 3: ledger ---------------------------------------------------------------


def bench_ledger(base: Path, count: int, lookups: int, max_jobs: int) -> dict[str, Any]:
    """Fill a ledger with count job ids, time duplicate lookups, then a refusal by the daemon.

    Uses ``dispatcher.ledger.Ledger(path)``: ``insert_done(ids)`` to fill it, ``get(id)``
    for a plain lookup and ``claim(id, ...)`` for the daemon's own duplicate check (a
    write transaction that finds the id and refuses it).
    """
    sys.path.insert(0, str(REPO))
    try:
        from dispatcher.ledger import Ledger
    except ImportError as exc:
        raise BenchError(f"cannot import dispatcher.ledger.Ledger: {exc}") from None
    config, root = write_config(base, max_jobs)
    path = root / ".state" / "ledger.sqlite3"
    ids = job_ids("LEDG", count)
    ledger = Ledger(path)
    try:
        t0 = time.perf_counter()
        ledger.insert_done(ids)
        build_s = time.perf_counter() - t0
        rng = random.Random(7)
        known = rng.sample(ids, min(lookups, count))
        unknown = [f"NEW-{i:07d}" for i in range(len(known))]
        get_dup = timed_us(ledger.get, known, expect=True)
        get_new = timed_us(ledger.get, unknown, expect=False)

        def claim(job_id: str) -> bool:
            c = ledger.claim(job_id, agent=AGENT_NAME, owner="bench", source="bench", digest="")
            return not c.ok  # True = refused as a duplicate

        claim_dup = timed_us(claim, known[:1000], expect=True)
        fresh = [f"CLM-{i:07d}" for i in range(200)]
        claim_new = timed_us(claim, fresh, expect=False)
        for job_id in fresh:  # leave no open claim for the daemon's recovery to find
            ledger.finish(job_id, "done")
    finally:
        ledger.close()
    out = {
        "ids": count,
        "build_s": build_s,
        "db_mb": sum(p.stat().st_size for p in path.parent.glob("ledger.sqlite3*")) / 1e6,
        "get_dup_us": get_dup,
        "get_new_us": get_new,
        "claim_dup_us": claim_dup,
        "claim_new_us": claim_new,
    }
    try:
        out["daemon_refusal"] = daemon_refusal(base, config, root, known[-20:])
    except BenchError as exc:
        out["daemon_refusal"] = {"error": str(exc)}
    return out


def timed_us(fn: Callable[[str], Any], ids: list[str], expect: bool) -> dict[str, float]:
    """Call fn on each id; check truthiness is expect; return p50/p99/max in microseconds."""
    times = []
    for job_id in ids:
        t = time.perf_counter()
        got = fn(job_id)
        times.append((time.perf_counter() - t) * 1e6)
        if bool(got) != expect:
            raise BenchError(f"ledger answered {got!r} for {job_id!r}, expected {'not ' * (not expect)}known")
    return {
        "n": len(ids),
        "p50_us": percentile(times, 50),
        "p99_us": percentile(times, 99),
        "max_us": max(times),
    }


def daemon_refusal(base: Path, config: Path, root: Path, dup_ids: list[str]) -> dict[str, Any]:
    """Drop orders whose ids the big ledger knows, one at a time; time rename -> refusal result."""
    lat = []
    failed = root / "failed"
    with daemon(config, base, []) as d:
        d.wait_event("daemon.ready", READY_TIMEOUT_S)
        for job_id in dup_ids:
            time.sleep(0.02)
            t0 = time.perf_counter()
            safe_drop(root / "inbox", job_id, order_bytes(job_id))
            deadline = t0 + 30
            while True:
                names = os.listdir(failed) if failed.is_dir() else []
                hit = [n for n in names if n.startswith(job_id + "@")]
                if hit and (failed / hit[0] / "result.json").exists():
                    break
                if (root / "done" / job_id).exists() or (root / "active" / job_id).exists():
                    raise BenchError(f"daemon ran {job_id}, an id its ledger already knows")
                if not d.running() or time.perf_counter() > deadline:
                    raise BenchError(f"no refusal of duplicate {job_id} within 30 s\n{d.symptoms()}")
                time.sleep(0.001)
            lat.append(time.perf_counter() - t0)
    return summary_ms(lat)


# -- report --------------------------------------------------------------------------


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def print_report(meta: dict[str, Any], res: dict[str, Any], args: argparse.Namespace) -> None:
    w = 52
    rows: list[tuple[str, str]] = []

    def row(label: str, value: str) -> None:
        rows.append((label, value))

    def section(title: str) -> None:
        rows.append(("", ""))
        rows.append((f"== {title}", ""))

    def err(key: str) -> bool:
        """Print a section's failure; also True when it was skipped."""
        if key not in res:
            row(f"  ({key}: skipped)", "")
            return True
        if "error" in res[key]:
            first, *rest = res[key]["error"].splitlines()
            row("  FAILED", first)
            for line in rest:
                row("", line)
            return True
        return False

    section(f"1. throughput, {args.orders} orders, max_jobs {args.max_jobs}")
    x = res.get("xargs", {})
    if not err("xargs"):
        row("xargs -P baseline", f"{fmt(x['jobs_per_s'])} jobs/s  ({fmt(x['seconds'], ' s', 2)})")
    for key, label in (
        ("once", "daemon, pre-dropped, run --once"),
        ("running", "daemon, running, safe-dropped"),
    ):
        if err(key):
            continue
        r = res[key]
        row(label, f"{fmt(r['jobs_per_s'])} jobs/s  ({fmt(r['seconds'], ' s', 2)} wall)")
        if r.get("steady_jobs_per_s"):
            row("  first agent.started -> last job.done", f"{fmt(r['steady_jobs_per_s'])} jobs/s")
        if "startup_to_ready_s" in r:
            row("  spawn -> daemon.ready (not timed)", fmt(r["startup_to_ready_s"] * 1000, " ms", 0))
            row("  dropping all orders took", fmt(r["drop_all_s"] * 1000, " ms", 0))
        if "ratio_vs_xargs" in r:
            ratio = r["ratio_vs_xargs"]
            verdict = "goal met" if ratio >= 0.8 else "target met" if ratio >= 0.5 else "BELOW TARGET"
            row("  ratio daemon/xargs (target>=0.5, goal 0.8)", f"{ratio:.2f}  {verdict}")

    section(
        f"2. pickup latency, {args.pickup_samples} orders one at a time, "
        f"{args.pickup_gap * 1000:.0f} ms after the previous one is done"
    )
    if not err("pickup"):
        p = res["pickup"]
        row(
            "rename -> agent start stamp",
            "  ".join(f"{k[:-3]} {fmt(p[k], ' ms', 2)}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
        )
        verdict = "target met" if p["p99_ms"] < 10 else "ABOVE TARGET"
        row("  p99 target < 10 ms", verdict)
        for name in ("order_received", "job_claimed", "agent_started"):
            if f"log_{name}_p50_ms" in p:
                row(
                    f"  rename -> log {name.replace('_', '.')} p50",
                    fmt(p[f"log_{name}_p50_ms"], " ms", 2),
                )
    if not err("spawn"):
        s = res["spawn"]
        row(
            "baseline: Popen -> agent stamp (by hand)",
            "  ".join(f"{k[:-3]} {fmt(s[k], ' ms', 2)}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
        )

    section(f"3. ledger, {args.ledger_ids:,} job ids (dispatcher.ledger.Ledger)")
    if not err("ledger"):
        g = res["ledger"]
        row("insert_done(all ids), one transaction", f"{fmt(g['build_s'], ' s', 2)}")
        row("  ledger files on disk", fmt(g["db_mb"], " MB"))
        for key, label in (
            ("get_dup_us", "get(known id)"),
            ("get_new_us", "get(new id)"),
            ("claim_dup_us", "claim(known id) -> refused (daemon's check)"),
            ("claim_new_us", "claim(new id) -> inserted, fsync"),
        ):
            v = g[key]
            row(
                f"{label}, n={v['n']}",
                "  ".join(f"{k[:-3]} {fmt(v[k], ' us')}" for k in ("p50_us", "p99_us", "max_us")),
            )
        r = g["daemon_refusal"]
        if "error" in r:
            first, *rest = r["error"].splitlines()
            row("daemon refusal of a duplicate: FAILED", first)
            for line in rest:
                row("", line)
        else:
            row(
                f"daemon: rename -> refusal result.json, n={r['n']}",
                "  ".join(f"{k[:-3]} {fmt(r[k], ' ms', 2)}" for k in ("p50_ms", "p99_ms", "max_ms")),
            )

    print(f"dispatcher benchmark  {meta['date']}")
    print(f"command: {meta['command']}")
    print(
        f"machine: nproc {meta['nproc']} (usable {meta['cpus_usable']}), {meta['platform']}, "
        f"python {meta['python']}, {meta['sh']}"
    )
    for label, value in rows:
        print(f"{label:<{w}} {value}".rstrip() if label or value else "")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--orders", type=int, default=2000, help="orders per throughput run (default 2000)")
    ap.add_argument("--pickup-samples", type=int, default=200, help="orders for pickup latency (default 200)")
    ap.add_argument("--max-jobs", type=int, default=2, help="max_jobs, agent concurrency and xargs -P")
    ap.add_argument("--ledger-ids", type=int, default=None, help="job ids in the ledger (default 1000000)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 50,000 ledger ids unless given")
    ap.add_argument(
        "--pickup-gap",
        type=float,
        default=0.02,
        help="seconds of quiet after a pickup job is done, before the next drop (default 0.02)",
    )
    ap.add_argument("--timeout", type=float, default=None, help="seconds per throughput run")
    ap.add_argument("--tmp", default=None, help="where to make the temporary roots (default $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary roots and logs")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["once", "running", "xargs", "pickup", "spawn", "ledger"],
    )
    args = ap.parse_args(argv)
    if args.ledger_ids is None:
        args.ledger_ids = 50_000 if args.quick else 1_000_000
    if args.orders < 1 or args.pickup_samples < 1 or args.max_jobs < 1:
        ap.error("--orders, --pickup-samples and --max-jobs must be >= 1")
    timeout = args.timeout or 120 + args.orders * 0.5
    lookups = 2_000 if args.quick else 10_000

    # A SIGTERM to the benchmark unwinds through the finally blocks that stop the daemons.
    signal.signal(signal.SIGTERM, _interrupt)

    sh = os.path.realpath(shutil.which("sh") or "sh")
    meta = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "sh": f"sh -> {sh}",
    }
    tmp = Path(tempfile.mkdtemp(prefix="dispatcher-bench-", dir=args.tmp))
    res: dict[str, dict[str, Any]] = {}
    plan: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
        ("xargs", lambda b: bench_xargs(b, args.orders, args.max_jobs, timeout)),
        ("once", lambda b: bench_once(b, args.orders, args.max_jobs, timeout)),
        ("running", lambda b: bench_running(b, args.orders, args.max_jobs, timeout)),
        ("pickup", lambda b: bench_pickup(b, args.pickup_samples, args.max_jobs, args.pickup_gap)),
        ("spawn", lambda b: bench_spawn(b, args.pickup_samples)),
        ("ledger", lambda b: bench_ledger(b, args.ledger_ids, lookups, args.max_jobs)),
    ]
    try:
        for name, fn in plan:
            if name in args.skip:
                continue
            base = tmp / name
            base.mkdir()
            print(f"running {name} ...", file=sys.stderr, flush=True)
            try:
                res[name] = fn(base)
            except BenchError as exc:
                res[name] = {"error": str(exc)}
            except subprocess.TimeoutExpired as exc:
                res[name] = {"error": f"timed out: {exc}"}
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for key in ("once", "running"):
        if "jobs_per_s" in res.get(key, {}) and "jobs_per_s" in res.get("xargs", {}):
            res[key]["ratio_vs_xargs"] = res[key]["jobs_per_s"] / res["xargs"]["jobs_per_s"]
    print_report(meta, res, args)
    figures = {"meta": meta, **res}
    print(json.dumps(figures, sort_keys=True, default=str))
    failed = any("error" in r or "error" in r.get("daemon_refusal", {}) for r in res.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
