"""Section `cpu`: what a job costs the daemon, by thread, beside the floor loop and `xargs -P`.

Each place (a fresh folder of the disk given by --tmp, and one on tmpfs, --tmpfs) gets the
same four runs over N orders, each in a folder of its own that saw no earlier run:
`xargs -P` (the agent's own cost), the floor loop (benchmarks/floor.py), three
`run --once` on an empty inbox (start-up), and the daemon as `run` on a backlog of N,
sampled from /proc at its last `job.done` and then stopped.

With ``--rounds K`` the three contenders take turns K times (xargs, floor, daemon, then
again), so that a machine whose disk or CPU slows during the run slows all three alike;
each figure is then the median of its K values, and a note gives every round's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    AGENT,
    HERE,
    BenchError,
    Daemon,
    agent_env,
    children_cpu_s,
    children_ctx,
    create_cost_us,
    filesystem,
    fresh_folder,
    job_ids,
    make_workdirs,
    missing_receipts,
    write_backlog,
    write_config,
)
from procfs import TICK_S, process_ticks, thread_table
from report import Result, Row
from throughput import STARTUP_RUNS, once, steady_rate, xargs_run

FLOOR = HERE / "floor.py"
NAMED = HERE / "named_threads.py"
# The targets for the daemon's CPU per job beyond the agent, as a share of the agent's.
TARGET_X = {"disk": 1.0, "tmpfs": 0.8}


@dataclass
class Run:
    """One contender's whole run over N orders: CPU with its agents, wall, context switches."""

    cpu_s: float
    wall_s: float
    ctx: int
    extra: dict[str, Any] = field(default_factory=dict)


def run_xargs(base: Path, mj: int, ids: list[str], timeout: float) -> Run:
    """Run the agent over ids with `xargs -P mj`; its CPU is the agent's own cost."""
    work = make_workdirs(base, ids)
    ctx0 = children_ctx()
    wall, cpu = xargs_run(base, ["sh", str(AGENT)], [[j, str(work / j)] for j in ids], mj, timeout)
    if missing := missing_receipts(work, ids):
        raise BenchError(f"xargs baseline: {len(missing)} receipts missing, e.g. {work / missing[0]}")
    return Run(cpu, wall, children_ctx() - ctx0)


def run_floor(base: Path, mj: int, ids: list[str], timeout: float) -> Run:
    """Run benchmarks/floor.py over ids as a backlog; return its whole run (its agents included)."""
    root = base / "dispatch"
    write_backlog(root / "inbox", ids)
    ctx0, cpu0 = children_ctx(), children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(FLOOR), str(root), str(mj), "sh", str(AGENT)],
        capture_output=True,
        env=agent_env(),
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - t0
    cpu, ctx = children_cpu_s() - cpu0, children_ctx() - ctx0
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if proc.returncode != 0 or done != len(ids):
        raise BenchError(f"floor.py exited {proc.returncode} with {done}/{len(ids)} in done/: {proc.stderr[-400:]!r}")
    return Run(cpu, wall, ctx, json.loads(proc.stdout.splitlines()[-1]))


def run_daemon(base: Path, mj: int, ids: list[str], timeout: float) -> Run:
    """Run `run` (not --once) on ids as a backlog; sample /proc at the last job.done, then stop it."""
    config, root = write_config(base, max_jobs=mj)
    write_backlog(root / "inbox", ids)
    d = Daemon(config, base, [], prefix=[str(NAMED)], label="run")
    ctx0 = children_ctx()
    t0 = time.perf_counter()
    d.start()
    try:
        t_end = d.wait_finished(len(ids), timeout)
        threads, ticks = thread_table(d.pid), process_ticks(d.pid)
    finally:
        d.stop()
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if done != len(ids) or d.cpu_s is None:
        raise BenchError(f"{done}/{len(ids)} jobs in done/ after {len(ids)} job.done lines\n{d.symptoms()}")
    extra = {"threads": threads, "ticks": ticks, "steady": steady_rate(d, len(ids))}
    return Run(d.cpu_s, t_end - t0, children_ctx() - ctx0, extra)


def median_run(runs: list[Run]) -> Run:
    """Return a run whose CPU, wall and switches are each the median over runs (its details: the median-CPU run's)."""
    if len(runs) == 1:
        return runs[0]
    middle = sorted(runs, key=lambda r: r.cpu_s)[len(runs) // 2]
    return Run(
        statistics.median(r.cpu_s for r in runs),
        statistics.median(r.wall_s for r in runs),
        round(statistics.median(r.ctx for r in runs)),
        middle.extra,
    )


def by_thread(threads: list[dict[str, Any]], ticks: dict[str, int], n: int) -> list[str]:
    """Return note lines: the daemon's CPU and context switches per job, by thread name."""
    groups: dict[str, dict[str, int]] = {}
    for t in threads:
        g = groups.setdefault(str(t["name"]), {"count": 0, "utime": 0, "stime": 0, "vol": 0, "invol": 0})
        g["count"] += 1
        for k in ("utime", "stime", "vol", "invol"):
            g[k] += int(t[k])
    per = TICK_S * 1000 / n
    parts = []
    for name, g in sorted(groups.items(), key=lambda kv: -(kv[1]["utime"] + kv[1]["stime"])):
        label = name if g["count"] == 1 else f"{name} ({g['count']} threads)"
        parts.append(
            f"{label} {(g['utime'] + g['stime']) * per:.3f} ms (user {g['utime'] * per:.3f}, sys "
            f"{g['stime'] * per:.3f}), switches {g['vol'] / n:.1f} + {g['invol'] / n:.1f}"
        )
    own = ticks["utime"] + ticks["stime"]
    gone = own - sum(g["utime"] + g["stime"] for g in groups.values())
    lines = ["daemon by thread at its last job.done, per job (start-up included; switches voluntary + involuntary):"]
    lines += [f"  {p}" for p in parts]
    lines.append(
        f"  whole process {own * per:.3f} ms (user {ticks['utime'] * per:.3f}, sys {ticks['stime'] * per:.3f})"
        + (f", of which threads that had ended {gone * per:.3f} ms" if gone > 0 else "")
        + f"; its agents {(ticks['cutime'] + ticks['cstime']) * per:.3f} ms"
    )
    return lines


def place(label: str, base: Path, opts: argparse.Namespace, res: Result) -> None:
    """Measure one place (disk or tmpfs): add its rows, notes and data to res."""
    n, mj, timeout = opts.orders, opts.max_jobs, opts.timeout
    create_us = create_cost_us(fresh_folder(base, "probe"))
    startups = [once(fresh_folder(base, f"startup-{k}"), mj, [], 120) for k in range(STARTUP_RUNS)]
    start_cpu = statistics.median(d.cpu_s or 0.0 for d in startups)
    start_wall = statistics.median(d.wall_s or 0.0 for d in startups)
    xs: list[Run] = []
    fs: list[Run] = []
    ds: list[Run] = []
    for _ in range(opts.rounds):  # taking turns: a machine that drifts moves all three alike
        xs.append(run_xargs(fresh_folder(base, "xargs"), mj, job_ids("XARG", n), timeout))
        fs.append(run_floor(fresh_folder(base, "floor"), mj, job_ids("FLOOR", n), timeout))
        ds.append(run_daemon(fresh_folder(base, "daemon"), mj, job_ids("RUN", n), timeout))
    x, f, d = median_run(xs), median_run(fs), median_run(ds)

    ms = 1000 / n
    agent = x.cpu_s * ms
    incl, excl = (d.cpu_s - x.cpu_s) * ms, (d.cpu_s - start_cpu - x.cpu_s) * ms
    floor_beyond = (f.cpu_s - x.cpu_s) * ms
    rate_d, rate_f, rate_x = n / d.wall_s, n / f.wall_s, n / x.wall_s
    cap = TARGET_X[label]
    sfx = "" if label == "disk" else f"_{label}"
    tag = f"[{label}]"
    res.rows += [
        Row(f"cpu_per_job_incl_startup{sfx}", f"{tag} daemon CPU/job beyond agent, incl. start-up", incl, agent,
            "ms", f"<= {cap} x agent", incl <= cap * agent, 3),
        Row(f"cpu_per_job_excl_startup{sfx}", f"{tag} daemon CPU/job beyond agent, excl. start-up", excl, agent,
            "ms", f"<= {cap} x agent", excl <= cap * agent, 3),
        Row(f"floor_cpu_per_job{sfx}", f"{tag} floor CPU/job beyond the agent", floor_beyond, agent,
            "ms", "-", None, 3),
        Row(f"daemon_vs_floor_cpu{sfx}", f"{tag} daemon CPU/job beyond agent vs floor's", excl, floor_beyond,
            "ms", "-", None, 3),
        Row(f"throughput_vs_xargs{sfx}", f"{tag} throughput, daemon vs xargs -P {mj}", rate_d, rate_x,
            "jobs/s", ">= 0.5 x xargs", rate_d >= 0.5 * rate_x, 1),
        Row(f"floor_throughput_vs_xargs{sfx}", f"{tag} throughput, floor vs xargs -P {mj}", rate_f, rate_x,
            "jobs/s", "-", None, 1),
    ]  # fmt: skip
    threads, ticks, steady = d.extra["threads"], d.extra["ticks"], d.extra["steady"]
    d_ctx = sum(int(t["vol"]) + int(t["invol"]) for t in threads)
    res.notes += [
        f"{tag} each run's root in a fresh folder under {base} ({filesystem(base)}); "
        f"an empty file's create there: {create_us:.0f} us CPU",
        f"{tag} {'':24}{'daemon':>12}{'floor':>12}{'xargs':>12}",
        f"{tag} {'CPU/job, agents included':24}{d.cpu_s * ms:>9.3f} ms{f.cpu_s * ms:>9.3f} ms{agent:>9.3f} ms",
        f"{tag} {'CPU/job beyond the agent':24}{excl:>9.3f} ms{floor_beyond:>9.3f} ms{'-':>12}",
        f"{tag} {'  as a share of the agent':24}{excl / agent:>11.2f}x{floor_beyond / agent:>11.2f}x{'-':>12}",
        f"{tag} {'jobs/s':24}{rate_d:>12.1f}{rate_f:>12.1f}{rate_x:>12.1f}",
        f"{tag} {'switches/job, own':24}{d_ctx / n:>12.1f}{f.extra['ctx'] / n:>12.1f}{'-':>12}",
        f"{tag} {'switches/job, all':24}{d.ctx / n:>12.1f}{f.ctx / n:>12.1f}{x.ctx / n:>12.1f}",
        f"{tag} daemon: `run` on a backlog of {n}, clock from spawn to its last job.done line (then SIGTERM); "
        f"CPU of the whole run after its exit, start-up ({STARTUP_RUNS} x `run --once` on an empty inbox, median: "
        f"{start_cpu * 1000:.0f} ms CPU, {start_wall * 1000:.0f} ms wall) subtracted in 'beyond the agent'; "
        "floor: benchmarks/floor.py spawn to exit, its start-up included"
        + (f"; daemon from its first agent.started to its last job.done: {steady:.1f} jobs/s" if steady else ""),
        *(f"{tag} {line}" for line in by_thread(threads, ticks, n)),
    ]
    if opts.rounds > 1:
        res.notes.append(
            f"{tag} {opts.rounds} rounds, each figure their median (the daemon's by-thread lines: its median run); "
            "CPU/job beyond the agent, daemon / floor, by round: "
            + ", ".join(
                f"{(r.cpu_s - start_cpu - a.cpu_s) * ms:.3f} / {(fl.cpu_s - a.cpu_s) * ms:.3f} ms"
                for a, fl, r in zip(xs, fs, ds, strict=True)
            )
            + "; jobs/s, daemon / floor / xargs: "
            + ", ".join(
                f"{n / r.wall_s:.0f} / {n / fl.wall_s:.0f} / {n / a.wall_s:.0f}"
                for a, fl, r in zip(xs, fs, ds, strict=True)
            )
        )
    res.data[label] = {
        "root_parent": str(base.parent),
        "filesystem": filesystem(base),
        "create_us": create_us,
        "daemon_cpu_s": d.cpu_s,
        "daemon_wall_s": d.wall_s,
        "daemon_ctx": d.ctx,
        "daemon_threads": threads,
        "daemon_ticks": ticks,
        "floor_cpu_s": f.cpu_s,
        "floor_wall_s": f.wall_s,
        "floor_ctx": f.ctx,
        "floor_self": f.extra,
        "xargs_cpu_s": x.cpu_s,
        "xargs_wall_s": x.wall_s,
        "xargs_ctx": x.ctx,
        "startup_cpu_s": start_cpu,
        "startup_wall_s": start_wall,
        "daemon_steady_jobs_per_s": steady,
        "rounds": [
            {"xargs": [a.cpu_s, a.wall_s], "floor": [fl.cpu_s, fl.wall_s], "daemon": [r.cpu_s, r.wall_s]}
            for a, fl, r in zip(xs, fs, ds, strict=True)
        ],
    }


def section_cpu(base: Path, opts: argparse.Namespace) -> Result:
    """Daemon CPU per job (by thread) and throughput, beside the floor loop and `xargs -P`, on disk and tmpfs."""
    res = Result(data={"orders": opts.orders, "max_jobs": opts.max_jobs})
    res.notes.append(
        f"N = {opts.orders} orders, max_jobs {opts.max_jobs}, agent `sh agent.sh`; baseline "
        f"`xargs -0 -P {opts.max_jobs} -n 2 sh agent.sh ID WORK` (its CPU is the agent's own cost)"
    )
    place("disk", base, opts, res)
    if opts.tmpfs_base is not None:
        place("tmpfs", opts.tmpfs_base(), opts, res)
    return res
