"""Sections `sleepers` and `idle`: what the daemon holds while agents wait, and while nothing happens."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import (
    SLEEP_AGENT,
    BenchError,
    job_ids,
    make_workdirs,
    missing_receipts,
    order_bytes,
    parse_ts,
    running_daemon,
    write_config,
)
from procfs import Sampler, proc_cpu_ns, proc_status, proc_ticks, proc_wakeups
from report import Result, Row
from throughput import xargs_run

SLEEPERS_WALL_SLACK_S = 3.0
MAX_THREADS = 50
MAX_RSS_MB = 150.0
IDLE_CPU_PCT = 0.05
IDLE_RSS_MB = 30.0
IDLE_RSS_SLACK_MB = 3.0


def raise_nofile(want: int) -> str:
    """Raise this process's soft RLIMIT_NOFILE towards want (children inherit it); say what was done."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return f"soft RLIMIT_NOFILE raised from {soft} to {target} (hard {hard}) for the daemon and xargs"
    return f"soft RLIMIT_NOFILE {soft} (hard {hard}), left as it was"


def section_sleepers(base: Path, opts: argparse.Namespace) -> Result:
    """N agents at once, each sleeping S seconds: wall time, peak threads and RSS of the daemon."""
    n, secs = opts.sleepers, opts.sleep
    # Each running agent may hold a few descriptors in the daemon (log files, a pidfd, a pipe).
    nofile = raise_nofile(8 * n + 1024)
    timeout = secs + 120 + n * 0.05
    command = ["sh", str(SLEEP_AGENT), f"{secs:g}"]

    xb = base / "xargs"
    xb.mkdir()
    xids = job_ids("XSLP", n)
    work = make_workdirs(xb, xids)
    wall_x, cpu_x = xargs_run(xb, command, [[j, str(work / j)] for j in xids], n, timeout)
    if missing := missing_receipts(work, xids):
        raise BenchError(f"xargs baseline: {len(missing)} receipts missing, e.g. {work / missing[0]}")

    db = base / "daemon"
    config, root = write_config(db, max_jobs=n, command=command, concurrency=n, timeout_s=secs + 60)
    ids = job_ids("SLEEP", n)
    inbox = root / "inbox"
    with running_daemon(config, db, [], notify=True) as d:
        d.wait_ready()
        time.sleep(0.5)
        idle = proc_status(d.pid)
        # Written first, renamed in together: "2,000 orders at once" is the renames.
        for job_id in ids:
            (inbox / f".{job_id}.json.tmp").write_bytes(order_bytes(job_id))
        with Sampler(d.pid) as sampler:
            t0, wall0 = time.perf_counter(), time.time()
            for job_id in ids:
                os.rename(inbox / f".{job_id}.json.tmp", inbox / f"{job_id}.json")
            t_end = d.wait_finished(n, timeout, interval=0.1)
            hwm = proc_status(d.pid).get("VmHWM", 0)
    wall_d = t_end - t0
    phases = sleeper_phases(d.log_path, wall0)
    if missing := [j for j in ids if not (root / "done" / j).is_dir()]:
        raise BenchError(f"{len(missing)} jobs logged done but not in done/, e.g. {missing[0]}")
    peak_mb = max(sampler.peak_rss_kb, hwm) / 1024
    idle_mb = idle.get("VmRSS", 0) / 1024
    limit = secs + SLEEPERS_WALL_SLACK_S
    res = Result()
    res.rows += [
        Row("sleepers_wall", f"{n:,} agents sleeping {secs:g} s: drop -> all done", wall_d, wall_x,
            "s", f"< {limit:g} s", wall_d < limit),
        Row("sleepers_peak_threads", f"{n:,} sleeping agents: daemon's peak threads",
            sampler.peak_threads, idle.get("Threads"), "", f"< {MAX_THREADS}", sampler.peak_threads < MAX_THREADS, 0),
        Row("sleepers_peak_rss", f"{n:,} sleeping agents: daemon's peak RSS", peak_mb, idle_mb,
            "MB", f"< {MAX_RSS_MB:g} MB", peak_mb < MAX_RSS_MB, 1),
    ]  # fmt: skip
    res.notes += [
        f"`max_jobs: {n}`, `concurrency: {n}`, agent `sh sleep_agent.sh {secs:g}`; {n:,} orders renamed into "
        f"the inbox of a ready, idle `run`; baseline wall: `xargs -0 -P {n} -n 2 sh sleep_agent.sh {secs:g} ID WORK`",
        f"threads and RSS: /proc/PID/status read {sampler.samples} times, every 50 ms (VmHWM at the end "
        f"{hwm / 1024:.1f} MB); their baseline is the same daemon, idle, just before the drop",
        f"CPU user+sys: daemon {d.cpu_s or 0:.2f} s (agents, start-up and stop included), xargs {cpu_x:.2f} s",
        "phases, seconds after the first rename (log timestamps): "
        + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()),
        nofile,
    ]
    res.data = {
        "agents": n,
        "sleep_s": secs,
        "daemon_wall_s": wall_d,
        "xargs_wall_s": wall_x,
        "peak_threads": sampler.peak_threads,
        "idle_threads": idle.get("Threads"),
        "peak_rss_mb": peak_mb,
        "vmhwm_mb": hwm / 1024,
        "idle_rss_mb": idle_mb,
        "daemon_cpu_s": d.cpu_s,
        "xargs_cpu_s": cpu_x,
        "phases_s": phases,
    }
    return res


def sleeper_phases(log_path: Path, t0: float) -> dict[str, float]:
    """Return when the sleepers' phases ended, in seconds after t0 (wall clock), from the daemon's log.

    The first and last ``agent.started``, the first and last ``agent.exited`` and the last ``job.done``:
    the starts' spread and the finishes' spread are the daemon's share of the wall time beyond
    the agents' own sleep.
    """
    seen: dict[str, list[float]] = {"agent.started": [], "agent.exited": [], "job.done": []}
    with open(log_path, "rb") as fh:
        for line in fh:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or event.get("event") not in seen:
                continue
            ts = parse_ts(event.get("timestamp"))
            if ts is not None:
                seen[event["event"]].append(ts - t0)
    out: dict[str, float] = {}
    if seen["agent.started"]:
        out["first start"] = min(seen["agent.started"])
        out["last start"] = max(seen["agent.started"])
    if seen["agent.exited"]:
        out["first exit"] = min(seen["agent.exited"])
        out["last exit"] = max(seen["agent.exited"])
    if seen["job.done"]:
        out["last done"] = max(seen["job.done"])
    return out


def section_idle(base: Path, opts: argparse.Namespace) -> Result:
    """CPU % and RSS of a ready daemon with an empty inbox, beside a bare sleeping interpreter."""
    secs, mj = opts.idle_seconds, opts.max_jobs
    config, _root = write_config(base, max_jobs=mj)
    # The floor for a resident Python program: this interpreter, started and asleep.
    floor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e6)"])
    try:
        with running_daemon(config, base, [], notify=True) as d:
            d.wait_ready()
            time.sleep(1.0)  # start-up work (first scan, recovery) is not idle time
            pid = d.pid
            c0, k0, w0, f0 = proc_cpu_ns(pid), proc_ticks(pid), proc_wakeups(pid), proc_cpu_ns(floor.pid)
            t0 = time.monotonic()
            time.sleep(secs)
            c1, k1, w1, f1 = proc_cpu_ns(pid), proc_ticks(pid), proc_wakeups(pid), proc_cpu_ns(floor.pid)
            span = time.monotonic() - t0
            st, fst = proc_status(pid), proc_status(floor.pid)
            if not d.running():
                raise BenchError(f"daemon exited ({d.exit_code()}) while idle\n{d.symptoms()}")
    finally:
        floor.kill()
        floor.wait()
    cpu_pct = (c1 - c0) / (span * 1e9) * 100
    floor_pct = (f1 - f0) / (span * 1e9) * 100
    rss, floor_rss = st.get("VmRSS", 0) / 1024, fst.get("VmRSS", 0) / 1024
    tick = os.sysconf("SC_CLK_TCK")
    res = Result()
    res.rows += [
        Row("idle_cpu_pct", f"idle, empty inbox: CPU over {secs:g} s", cpu_pct, floor_pct, "%",
            f"0 % (< {IDLE_CPU_PCT:g} %)", cpu_pct < IDLE_CPU_PCT, 3),
        Row("idle_rss", "idle, empty inbox: RSS", rss, floor_rss, "MB",
            f"about {IDLE_RSS_MB:g} MB (<= {IDLE_RSS_MB + IDLE_RSS_SLACK_MB:g})",
            rss <= IDLE_RSS_MB + IDLE_RSS_SLACK_MB, 1),
    ]  # fmt: skip
    res.notes += [
        f"a ready `run` (max_jobs {mj}), 1 s after READY=1; CPU from /proc/PID/task/*/schedstat (ns); baseline: "
        f"`python -c 'import time; time.sleep(1e6)'` over the same {span:.1f} s",
        f"daemon: {st.get('Threads', 0)} threads, {(w1 - w0) / span:.1f} wake-ups/s (context switches of all "
        f"threads), {k1 - k0} clock ticks of 1/{tick} s in /proc/PID/stat",
    ]
    res.data = {
        "seconds": span,
        "cpu_pct": cpu_pct,
        "floor_cpu_pct": floor_pct,
        "rss_mb": rss,
        "floor_rss_mb": floor_rss,
        "threads": st.get("Threads"),
        "wakeups_per_s": (w1 - w0) / span,
    }
    return res
