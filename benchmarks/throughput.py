"""Section `inotify`, and the runs other sections share: `xargs -P` over the agent, `run --once`.

`inotify` compares a running daemon with an `inotifywait -m` shell loop (a folder watcher
that runs one agent per file, one at a time, with no checks and no ledger).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from harness import (
    AGENT,
    BenchError,
    Daemon,
    agent_env,
    children_cpu_s,
    ensure_program,
    job_ids,
    make_workdirs,
    missing_receipts,
    order_bytes,
    parse_ts,
    running_daemon,
    safe_drop,
    write_backlog,
    write_config,
)
from report import Result, Row

STARTUP_RUNS = 3


def xargs_run(
    base: Path, command: list[str], per_job: list[list[str]], parallel: int, timeout: float
) -> tuple[float, float]:
    """Run `xargs -0 -P parallel -n k COMMAND` over per_job's arguments; return (wall s, CPU s).

    The agent is exec'd straight by xargs with its per-job values as arguments (no `env`
    in between: that would be two execs per job and flatter every ratio against it). CPU
    is the rusage of xargs and everything it waited for, user+sys.
    """
    if shutil.which("xargs") is None:
        raise BenchError("xargs not found on PATH")
    argfile = base / "xargs.args"
    argfile.write_bytes(b"".join(a.encode() + b"\0" for job in per_job for a in job))
    cmd = ["xargs", "-0", "-P", str(parallel), "-n", str(len(per_job[0])), *command]
    with open(argfile, "rb") as stdin:
        cpu0 = children_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=base,
            env=agent_env(),
            timeout=timeout,
            check=False,
        )
        wall = time.perf_counter() - t0
        cpu = children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise BenchError(
            f"{' '.join(cmd[:6])} ... exited {proc.returncode}: {proc.stderr.decode(errors='replace')[:400]}"
        )
    return wall, cpu


def steady_rate(d: Daemon, n: int) -> float | None:
    """Return jobs/s between the first `agent.started` and the last `job.done` log lines."""
    starts = [t for e in d.named("agent.started") if (t := parse_ts(e.get("timestamp"))) is not None]
    dones = [t for e in d.named("job.done") if (t := parse_ts(e.get("timestamp"))) is not None]
    if not starts or len(dones) < n:
        return None
    span = max(dones) - min(starts)
    return n / span if span > 0 else None


def once(base: Path, max_jobs: int, ids: list[str], timeout: float) -> Daemon:
    """Write ids as a backlog, run `run --once` to its exit; return the reaped Daemon."""
    config, root = write_config(base, max_jobs=max_jobs)
    write_backlog(root / "inbox", ids)
    d = Daemon(config, base, ["--once"])
    d.start()
    try:
        code = d.wait_exit(timeout)
    finally:
        d.stop()
    done = sum(1 for j in ids if (root / "done" / j / "result.json").exists())
    if code != 0 or done != len(ids):
        raise BenchError(f"run --once exited {code} with {done}/{len(ids)} jobs in done/\n{d.symptoms()}")
    return d


# -- inotifywait ---------------------------------------------------------------------

# One agent per file, one at a time: the shape of a folder-watching script with no checks.
LOOP = r"""
work=$1 agent=$2
while IFS= read -r f; do
    case $f in .*|*.tmp|*.part) continue ;; esac
    id=${f%.*}
    sh "$agent" "$id" "$work/$id"
    echo "$f"
done
"""


def inotify_loop(base: Path, tool: str, n: int, timeout: float) -> tuple[float, float]:
    """Run the inotifywait loop while n orders are safe-dropped; return (wall s, CPU s)."""
    inbox = base / "inbox"
    inbox.mkdir(parents=True)
    ids = job_ids("LOOP", n)
    work = make_workdirs(base, ids)
    payloads = [order_bytes(j) for j in ids]
    errlog = base / "inotifywait.err"
    seen = 0
    finished = threading.Event()
    t_end = 0.0

    def count(stream: IO[bytes]) -> None:
        nonlocal seen, t_end
        for _ in stream:
            seen += 1
            if seen == n:
                t_end = time.perf_counter()
                finished.set()

    cpu0 = children_cpu_s()
    with open(errlog, "wb") as err:
        watch = subprocess.Popen(
            [tool, "-m", "-e", "moved_to,close_write", "--format", "%f", str(inbox)],
            stdout=subprocess.PIPE,
            stderr=err,
            env=agent_env(),
        )
        loop = subprocess.Popen(
            ["sh", "-c", LOOP, "loop", str(work), str(AGENT)],
            stdin=watch.stdout,
            stdout=subprocess.PIPE,
            env=agent_env(),
        )
    assert watch.stdout is not None and loop.stdout is not None
    watch.stdout.close()  # the loop holds the read end now
    reader = threading.Thread(target=count, args=(loop.stdout,), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while b"Watches established" not in errlog.read_bytes():
            if watch.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"inotifywait did not start: {errlog.read_text(errors='replace')[:400]}")
            time.sleep(0.01)
        t0 = time.perf_counter()
        for job_id, data in zip(ids, payloads, strict=True):
            safe_drop(inbox, job_id, data)
        if not finished.wait(timeout):
            raise BenchError(f"inotifywait loop: {seen}/{n} orders done after {timeout:.0f} s")
    finally:
        watch.terminate()  # the loop then reads EOF and ends
        watch.wait(10)
        loop.wait(30)
        reader.join(5)
    cpu = children_cpu_s() - cpu0
    if missing := missing_receipts(work, ids):
        raise BenchError(f"inotifywait loop: {len(missing)} receipts missing, e.g. {work / missing[0]}")
    return t_end - t0, cpu


def section_inotify(base: Path, opts: argparse.Namespace) -> Result:
    """Throughput of a running daemon against an `inotifywait -m` loop, both fed by safe drops."""
    n, mj, timeout = opts.orders, opts.max_jobs, opts.timeout
    tool, note = ensure_program("inotifywait", "inotify-tools")
    if tool is None:
        return Result(skipped=note)
    res = Result(notes=[note] if note else [])
    wall_l, cpu_l = inotify_loop(base / "loop", tool, n, timeout)

    db = base / "daemon"
    config, root = write_config(db, max_jobs=mj)
    ids = job_ids("LIVE", n)
    payloads = [order_bytes(j) for j in ids]
    with running_daemon(config, db, [], notify=True) as d:
        d.wait_ready()
        t0 = time.perf_counter()
        for job_id, data in zip(ids, payloads, strict=True):
            safe_drop(root / "inbox", job_id, data)
        t_end = d.wait_finished(n, timeout)
    wall_d = t_end - t0
    if missing := [j for j in ids if not (root / "done" / j).is_dir()]:
        raise BenchError(f"{len(missing)} jobs logged done but not in done/, e.g. {missing[0]}")
    rate_d, rate_l = n / wall_d, n / wall_l
    res.rows.append(
        Row("throughput_vs_inotifywait", "throughput, running daemon vs inotifywait loop", rate_d, rate_l,
            "jobs/s", ">= 1.5 x loop", rate_d >= 1.5 * rate_l, 1)
    )  # fmt: skip
    cpu_d = d.cpu_s or 0.0
    res.notes += [
        f"N = {n} orders safe-dropped (write .tmp, rename) as fast as one Python loop can, into a ready "
        f"`run` (max_jobs {mj}) and into `inotifywait -m -e moved_to,close_write | while read f; "
        "do sh agent.sh ...; done`; clock from the first drop to the last job",
        f"CPU user+sys per job: daemon {cpu_d / n * 1000:.3f} ms (agents, start-up and stop included), "
        f"loop {cpu_l / n * 1000:.3f} ms (inotifywait, sh, agents)",
    ]
    res.data = {"orders": n, "daemon_wall_s": wall_d, "loop_wall_s": wall_l, "daemon_cpu_s": cpu_d, "loop_cpu_s": cpu_l}
    return res
