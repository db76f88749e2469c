"""Sections `pickup` and `backlog`: how soon an agent starts after an order arrives.

Pickup times single drops into an idle daemon; backlog times a daemon that starts with
thousands of orders already waiting. Clock values that cross processes are wall-clock
(`time.time()`, `date +%s.%N`, log timestamps): one machine, one clock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    AGENT,
    BenchError,
    Daemon,
    agent_env,
    child_env,
    job_ids,
    make_workdirs,
    order_bytes,
    parse_ts,
    percentile,
    running_daemon,
    safe_drop,
    ts_digits,
    write_backlog,
    write_config,
)
from report import Result, Row

PICKUP_P50_MS = 3.0
PICKUP_P99_MS = 10.0
FLOOR_RUNS = 3
FIRST_START_TIMEOUT_S = 300.0


def read_stamp(path: Path, timeout: float = 10.0) -> float:
    """Return the `date +%s.%N` an agent wrote to path, waiting for it to appear."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = path.read_text().strip()
            if text:
                return float(text)
        if time.monotonic() > deadline:
            raise BenchError(f"the agent left no start stamp in {path}")
        time.sleep(0.005)


def sleep_until(t: float) -> None:
    """Sleep until time.perf_counter() reaches t."""
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def ms(values: list[float]) -> dict[str, float]:
    """Return p50, p90, p99 and max of values (seconds) in ms."""
    v = [x * 1000 for x in values]
    return {"n": len(v), "p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99), "max": max(v)}


def spawn_baseline(base: Path, m: int, gap: float) -> tuple[list[float], list[float]]:
    """Popen the agent straight from Python m times, gap s apart, as the daemon would.

    Returns (Popen -> the agent's own stamp, Popen call -> return), in seconds.
    """
    stamps = base / "stamps"
    stamps.mkdir(parents=True)
    ids = job_ids("SPAWN", m)
    work = make_workdirs(base, ids)
    to_stamp: list[tuple[str, float]] = []
    to_return: list[float] = []
    t_start = time.perf_counter() + gap
    for i, job_id in enumerate(ids):
        w = work / job_id
        env = agent_env(
            {
                "STAMP_DIR": str(stamps),
                "DISPATCH_JOB_ID": job_id,
                "DISPATCH_ORDER": str(w / "order.json"),
                "DISPATCH_WORKSPACE": str(w),
                "DISPATCH_RECEIPT": str(w / "receipt.json"),
                "DISPATCH_ATTEMPT": "1",
            }
        )
        sleep_until(t_start + i * gap)
        with open(w / "stdout.log", "wb") as out, open(w / "stderr.log", "wb") as err:
            t_wall = time.time()
            p0 = time.perf_counter()
            proc = subprocess.Popen(
                ["sh", str(AGENT)],
                cwd=w,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            to_return.append(time.perf_counter() - p0)
        if proc.wait(30) != 0:
            raise BenchError(f"agent exited {proc.returncode} when spawned by hand in {w}")
        to_stamp.append((job_id, t_wall))
    return [read_stamp(stamps / j) - t for j, t in to_stamp], to_return


def section_pickup(base: Path, opts: argparse.Namespace) -> Result:
    """Rename into inbox/ -> agent start, on an idle daemon, two ways, each with its baseline."""
    m, gap, mj = opts.pickup_samples, opts.pickup_gap, opts.max_jobs
    base_stamp, base_popen = spawn_baseline(base / "spawn", m, gap)

    db = base / "daemon"
    stamps = db / "stamps"
    stamps.mkdir(parents=True)
    config, root = write_config(db, max_jobs=mj, env={"STAMP_DIR": str(stamps)})
    ids = job_ids("PICK", m)
    t_drop: dict[str, float] = {}
    with running_daemon(config, db, [], notify=True) as d:
        d.wait_ready()
        time.sleep(0.5)  # let start-up work settle: the daemon is idle when the first order comes
        t_start = time.perf_counter()
        for i, job_id in enumerate(ids):
            data = order_bytes(job_id)
            sleep_until(t_start + i * gap)
            t_drop[job_id] = safe_drop(root / "inbox", job_id, data)
        d.wait_finished(m, 60 + m * gap)
        events = d.events()
    by_stamp = [read_stamp(stamps / j) - t for j, t in t_drop.items()]
    logged: dict[str, dict[str, float]] = {}
    digits = 9
    for e in events:
        if e.get("job_id") in t_drop and (ts := parse_ts(e.get("timestamp"))) is not None:
            logged.setdefault(str(e.get("event")), {}).setdefault(e["job_id"], ts - t_drop[e["job_id"]])
            digits = min(digits, ts_digits(e.get("timestamp")))
    by_log = list(logged.get("agent.started", {}).values())
    if len(by_log) != m:
        raise BenchError(f"{len(by_log)}/{m} `agent.started` lines with a job_id and a timestamp\n{d.symptoms()}")

    s, sb, lg, lb = ms(by_stamp), ms(base_stamp), ms(by_log), ms(base_popen)
    res = Result()
    res.rows += [
        Row("pickup_stamp_p50", "pickup p50, rename -> agent's own stamp", s["p50"], sb["p50"],
            "ms", f"< {PICKUP_P50_MS:g} ms", s["p50"] < PICKUP_P50_MS),
        Row("pickup_stamp_p99", "pickup p99, rename -> agent's own stamp", s["p99"], sb["p99"],
            "ms", f"< {PICKUP_P99_MS:g} ms", s["p99"] < PICKUP_P99_MS),
        Row("pickup_log_p50", "pickup p50, rename -> agent.started log line", lg["p50"], lb["p50"],
            "ms", f"< {PICKUP_P50_MS:g} ms", lg["p50"] < PICKUP_P50_MS),
        Row("pickup_log_p99", "pickup p99, rename -> agent.started log line", lg["p99"], lb["p99"],
            "ms", f"< {PICKUP_P99_MS:g} ms", lg["p99"] < PICKUP_P99_MS),
    ]  # fmt: skip
    res.notes += [
        f"{m} drops {gap * 1000:.0f} ms apart into a ready, idle `run` (max_jobs {mj}); clock starts just "
        "before the rename of inbox/.<id>.json.tmp",
        f"stamp rows: baseline = Popen of `sh agent.sh` straight from Python -> its stamp, {m} times "
        f"{gap * 1000:.0f} ms apart; max daemon {s['max']:.2f} ms, baseline {sb['max']:.2f} ms",
        f"log rows: baseline = a bare subprocess.Popen call -> return, same agent; max daemon {lg['max']:.2f} ms, "
        f"baseline {lb['max']:.2f} ms",
    ]
    if digits <= 3:
        res.notes.append(
            f"the daemon's log timestamps have only {'millisecond' if digits == 3 else f'{digits}-digit'} "
            "resolution: the log rows are good to +-1 ms at best"
        )
    else:
        res.notes.append(f"log timestamps carry {digits} fractional digits")
    steps = [
        f"{name} {percentile([v * 1000 for v in logged[name].values()], 50):.2f} ms"
        for name in ("order.received", "job.claimed", "agent.started", "agent.exited", "job.done")
        if len(logged.get(name, {})) == m
    ]
    if steps:
        res.notes.append("rename -> log line, p50: " + ", ".join(steps))
    res.data = {
        "samples": m,
        "gap_s": gap,
        "daemon_stamp_ms": s,
        "spawn_stamp_ms": sb,
        "daemon_log_ms": lg,
        "popen_return_ms": lb,
        "log_timestamp_digits": digits,
    }
    return res


# -- backlog -------------------------------------------------------------------------

# The least any program can do to start the oldest of a backlog: list, stat, pick, spawn.
FLOOR = r"""
import os, subprocess, sys
inbox, agent, work, stamps = sys.argv[1:5]
best = None
with os.scandir(inbox) as it:
    for e in it:
        n = e.name
        if n.startswith(".") or not n.endswith((".json", ".yaml", ".yml")):
            continue
        k = (e.stat(follow_symlinks=False).st_mtime_ns, n)
        if best is None or k < best:
            best = k
job = best[1].rsplit(".", 1)[0]
w = os.path.join(work, job)
os.makedirs(w)
env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "STAMP_DIR": stamps}
sys.exit(subprocess.call(["sh", agent, job, w], env=env))
"""


def floor_start(base: Path, inbox: Path) -> tuple[float, str]:
    """Run FLOOR on inbox; return (spawn -> agent stamp in s, the job it chose)."""
    stamps = base / "stamps"
    stamps.mkdir(parents=True)
    work = base / "work"
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", FLOOR, str(inbox), str(AGENT), str(work), str(stamps)],
        env=child_env(),
        capture_output=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"backlog baseline exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-400:]}")
    (name,) = os.listdir(stamps)
    return read_stamp(stamps / name) - t0, name


def first_starts(stamps: Path, d: Daemon, want: int, timeout: float) -> list[tuple[float, str]]:
    """Wait for the first agent stamp, then up to `want` (at most 2 s more); return sorted (t, id)."""
    deadline = time.monotonic() + timeout
    while not os.listdir(stamps):
        if not d.running():
            raise BenchError(f"daemon exited ({d.exit_code()}) before any agent started\n{d.symptoms()}")
        if time.monotonic() > deadline:
            raise BenchError(f"no agent started within {timeout:.0f} s of `run`\n{d.symptoms()}")
        time.sleep(0.005)
    more = time.monotonic() + 2.0
    while len(os.listdir(stamps)) < want and time.monotonic() < more and d.running():
        time.sleep(0.02)
    return sorted((read_stamp(stamps / name), name) for name in os.listdir(stamps))


def backlog_one(base: Path, size: int, mj: int) -> tuple[list[Row], list[str], dict[str, Any]]:
    """Time `run` spawn -> first agent start with size orders waiting; baseline FLOOR."""
    stamps = base / "stamps"
    stamps.mkdir(parents=True)
    config, root = write_config(base, max_jobs=mj, env={"STAMP_DIR": str(stamps)})
    ids = job_ids("BKLG", size)
    t = time.perf_counter()
    write_backlog(root / "inbox", ids)
    write_s = time.perf_counter() - t
    floors = [floor_start(base / f"floor-{k}", root / "inbox") for k in range(FLOOR_RUNS)]
    floor_s = statistics.median(f[0] for f in floors)

    d = Daemon(config, base, [], label="backlog")
    d.start()
    try:
        starts = first_starts(stamps, d, want=3, timeout=FIRST_START_TIMEOUT_S)
        t_stop = time.perf_counter()
    finally:
        d.stop()
    stop_s = time.perf_counter() - t_stop
    first_s = starts[0][0] - d.t_spawn
    first_id = starts[0][1]
    logged = [ts for e in d.named("agent.started") if (ts := parse_ts(e.get("timestamp"))) is not None]
    log_s = min(logged) - d.t_spawn if logged else None
    limit = 1.0 if size <= 10_000 else 2.0
    row = Row(f"backlog_{size}_first_start", f"backlog {size:,}: run spawn -> first agent start", first_s,
              floor_s, "s", f"< {limit:g} s", first_s < limit, 3)  # fmt: skip
    notes = [
        f"{size:,} orders written into inbox/ before `run` ({write_s:.1f} s to write), mtimes an hour back; "
        f"first job started: {first_id} "
        + ("(the oldest, as it should)" if first_id == ids[0] else f"(NOT the oldest, {ids[0]})"),
        f"first agent.started log line {log_s:.3f} s after spawn" if log_s is not None else "no agent.started line",
        f"baseline: `python -c` that lists inbox/, stats every entry, picks the oldest, spawns the agent "
        f"(median of {FLOOR_RUNS}); SIGTERM after {len(starts)} starts, the daemon took {stop_s:.1f} s to stop",
    ]
    data: dict[str, Any] = {
        "first_start_s": first_s,
        "floor_s": floor_s,
        "first_log_s": log_s,
        "first_job_is_oldest": first_id == ids[0],
        "stop_s": stop_s,
    }
    return [row], notes, data


def section_backlog(base: Path, opts: argparse.Namespace) -> Result:
    """Backlog start-up for each size in --backlog, largest last; each root removed after use."""
    res = Result()
    for size in opts.backlog:
        print(f"  backlog {size:,} ...", file=sys.stderr, flush=True)
        b = base / f"backlog-{size}"
        rows, notes, data = backlog_one(b, size, opts.max_jobs)
        res.rows += rows
        res.notes += notes
        res.data[str(size)] = data
        if not opts.keep:
            shutil.rmtree(b, ignore_errors=True)
    return res
