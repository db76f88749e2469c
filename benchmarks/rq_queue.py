"""Section `rq`: the same agent through RQ, what a Python user would pick instead of the dispatcher.

A Redis server of its own, without persistence (`redis-server --save '' --appendonly no`),
N jobs enqueued up front, each one `subprocess.run` of the agent (benchmarks/rq_job.py);
then 2 workers in burst mode (`rq worker --burst`), once with RQ's default worker (it
forks a work horse per job) and once with `SimpleWorker` (runs jobs in the worker itself).
Beside them, in the same section: the daemon (`run --once` on a backlog) and `xargs -P`.
Needs `redis-server` (Debian package redis-server) and the `bench` extra (rq).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import (
    AGENT,
    HERE,
    BenchError,
    agent_env,
    children_cpu_s,
    ensure_program,
    fresh_folder,
    job_ids,
    make_workdirs,
    missing_receipts,
)
from procfs import TICK_S, process_ticks
from report import Result, Row
from throughput import once, xargs_run

# key: (name in the table, --worker-class)
WORKERS = {"default": ("default worker", None), "simple": ("SimpleWorker", "rq.worker.SimpleWorker")}


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(base: Path, exe: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start the Redis server exe without persistence on a free port; yield (url, process); always stop it."""
    port = free_port()
    log = open(base / "redis.log", "wb")  # noqa: SIM115 - closed below
    cmd = [exe, "--save", "", "--appendonly", "no", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(base)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(
                    f"redis-server did not answer on port {port}: {(base / 'redis.log').read_text()[-400:]}"
                )
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def rq_run(base: Path, url: str, server_pid: int, worker_class: str | None, n: int, timeout: float) -> dict[str, Any]:
    """Enqueue n agent runs, run 2 burst workers to their exit; return wall, CPU and the jobs' span."""
    from redis import Redis
    from rq import Queue
    from rq.job import Job

    conn = Redis.from_url(url)
    conn.flushall()
    ids = job_ids("RQ", n)
    work = make_workdirs(base, ids)
    env = agent_env()
    q = Queue("bench", connection=conn)
    with conn.pipeline() as pipe:
        q.enqueue_many(
            [
                Queue.prepare_data(
                    "rq_job.run_agent", args=(["sh", str(AGENT), j, str(work / j)], env), job_id=j, result_ttl=3600
                )
                for j in ids
            ],
            pipeline=pipe,
        )
        pipe.execute()
    rq_cli = Path(sys.executable).with_name("rq")
    cmd = [str(rq_cli), "worker", "--burst", "--quiet", "--url", url, "--path", str(HERE)]
    cmd += ["--worker-class", worker_class] if worker_class else []
    server0 = process_ticks(server_pid)
    cpu0 = children_cpu_s()
    t0 = time.perf_counter()
    with open(base / "workers.log", "wb") as log:
        procs = [subprocess.Popen([*cmd, "bench"], stdout=log, stderr=subprocess.STDOUT, cwd=HERE) for _ in range(2)]
        try:
            codes = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    wall = time.perf_counter() - t0
    cpu = children_cpu_s() - cpu0
    server1 = process_ticks(server_pid)
    missing = missing_receipts(work, ids)
    if any(codes) or missing:
        tail = (base / "workers.log").read_text(errors="replace")[-400:]
        raise BenchError(f"rq workers exited {codes}; receipts missing: {len(missing)}\n{tail}")
    jobs = [j for j in Job.fetch_many(ids, connection=conn) if j is not None]
    starts = [j.started_at.timestamp() for j in jobs if j.started_at]
    ends = [j.ended_at.timestamp() for j in jobs if j.ended_at]
    span = max(ends) - min(starts) if starts and ends else None
    server_s = (server1["utime"] + server1["stime"] - server0["utime"] - server0["stime"]) * TICK_S
    return {"wall_s": wall, "cpu_s": cpu, "server_cpu_s": server_s, "span_s": span}


def section_rq(base: Path, opts: argparse.Namespace) -> Result:
    """Throughput and CPU per job of RQ (2 workers, both kinds) beside the daemon and `xargs -P`."""
    try:
        import rq  # noqa: F401
    except ImportError:
        raise BenchError("needs rq: .venv/bin/pip install -e '.[bench]'") from None
    exe, installed = ensure_program("redis-server", "redis-server")
    if exe is None:
        raise BenchError(f"needs redis-server: {installed}")
    n, mj, timeout = opts.orders, opts.max_jobs, opts.timeout
    xb = fresh_folder(base, "xargs")
    ids = job_ids("XARG", n)
    work = make_workdirs(xb, ids)
    wall_x, cpu_x = xargs_run(xb, ["sh", str(AGENT)], [[j, str(work / j)] for j in ids], 2, timeout)
    d = once(fresh_folder(base, "daemon"), mj, job_ids("ONCE", n), timeout)
    assert d.cpu_s is not None and d.wall_s is not None
    runs: dict[str, dict[str, Any]] = {}
    sb = fresh_folder(base, "redis")
    with redis_server(sb, exe) as (url, server):
        for key, (_name, cls) in WORKERS.items():
            runs[key] = rq_run(fresh_folder(base, f"rq-{key}"), url, server.pid, cls, n, timeout)
    rate_x, rate_d = n / wall_x, n / d.wall_s
    ms = 1000 / n
    res = Result()
    res.rows.append(
        Row("daemon_throughput_vs_xargs", f"throughput, daemon (max_jobs {mj}) vs xargs -P 2", rate_d, rate_x,
            "jobs/s", "-", None, 1)
    )  # fmt: skip
    for key, r in runs.items():
        rate, label = n / r["wall_s"], WORKERS[key][0]
        res.rows += [
            Row(f"rq_{key}_vs_xargs", f"throughput, RQ {label} x 2 vs xargs -P 2", rate, rate_x,
                "jobs/s", "-", None, 1),
            Row(f"daemon_vs_rq_{key}", f"throughput, daemon vs RQ {label} x 2", rate_d, rate,
                "jobs/s", "ahead of RQ", rate_d > rate, 1),
        ]  # fmt: skip
    if installed:
        res.notes.append(installed)
    res.notes += [
        f"N = {n}; RQ: one redis-server (--save '' --appendonly no) on 127.0.0.1, jobs enqueued up front (one "
        "pipeline), each `subprocess.run(['sh', 'agent.sh', ID, WORK])`; 2 x `rq worker --burst` spawned together, "
        "clock from their spawn to both exits (their start-up included); daemon `run --once` on a backlog, spawn "
        "to exit; xargs `-P 2`",
        f"CPU/job, agents included: daemon {d.cpu_s * ms:.3f} ms, xargs {cpu_x * ms:.3f} ms (= the agent's own), "
        + ", ".join(
            f"RQ {WORKERS[k][0]} {r['cpu_s'] * ms:.3f} ms + redis-server {r['server_cpu_s'] * ms:.3f} ms "
            f"({(r['cpu_s'] + r['server_cpu_s']) / cpu_x:.1f} x the agent)"
            for k, r in runs.items()
        ),
        "RQ between its first job's start and its last job's end: "
        + ", ".join(f"{WORKERS[k][0]} {n / r['span_s']:.1f} jobs/s" for k, r in runs.items() if r["span_s"]),
        "RQ keeps no fsync, no folder per job, no receipt check: it stands for what a Python user would pick",
    ]
    res.data = {
        "orders": n,
        "daemon_cpu_s": d.cpu_s,
        "daemon_wall_s": d.wall_s,
        "xargs_cpu_s": cpu_x,
        "xargs_wall_s": wall_x,
        "rq": runs,
    }
    return res
