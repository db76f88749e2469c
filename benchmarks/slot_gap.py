#!/usr/bin/env python3
"""The gap on a slot between an agent's exit and the next agent's start, and the throughput it allows.

    .venv/bin/python benchmarks/slot_gap.py [--orders 300] [--sleep 0.05] [--tmp DIR] [CODE_DIR ...]

For each CODE_DIR (a checkout of the project; default: this one), in turn and ``--rounds``
times over, a fresh root gets a backlog of ``--orders`` orders for ``sh sleep_agent.sh
SLEEP`` (max_jobs 2) and ``run --once`` works it off, with ``python -m dispatcher`` run from
that checkout, so that two versions can be compared side by side in the same minutes. From
the daemon's log: for each ``agent.exited``, the time to the next ``agent.started`` (p50,
p90), the agent's own ``duration_ms`` (p50), jobs per second from the first start to the last
``job.done``, and the CPU per job of the daemon and its agents.
"""

from __future__ import annotations

import argparse
import bisect
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import agent_env, fresh_folder, job_ids, parse_ts, percentile, write_backlog, write_config

HERE = Path(__file__).resolve().parent
SLEEP_AGENT = HERE / "sleep_agent.sh"


def one_run(code: Path, base: Path, orders: int, sleep: str) -> str:
    """Run one backlog with the daemon of ``code``; return its line of figures."""
    folder = fresh_folder(base, "gap")
    config, root = write_config(folder, max_jobs=2, command=["sh", str(SLEEP_AGENT), sleep])
    ids = job_ids("G", orders)
    write_backlog(root / "inbox", ids)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = [sys.executable, "-m", "dispatcher", "--config", str(config), "run", "--once"]
    proc = subprocess.run(argv, cwd=code, env=agent_env(), capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_ms = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / orders * 1000
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    starts = sorted(t for e in events if e.get("event") == "agent.started" and (t := parse_ts(e["timestamp"])))
    exits = [e for e in events if e.get("event") == "agent.exited"]
    gaps = []
    for e in exits:
        t = parse_ts(e["timestamp"])
        i = bisect.bisect_right(starts, t) if t is not None else len(starts)
        if t is not None and i < len(starts):
            gaps.append((starts[i] - t) * 1000)
    done = [t for e in events if e.get("event") == "job.done" and (t := parse_ts(e["timestamp"]))]
    shutil.rmtree(folder)
    if not starts or not done or len(done) != orders:
        return f"{code}: {len(done)} of {orders} jobs done (exit {proc.returncode}): no figures"
    span = max(done) - starts[0]
    agent = percentile([float(e["duration_ms"]) for e in exits], 50)
    return (
        f"{code.name:>12}  {orders / span:6.1f} jobs/s  gap p50 {percentile(gaps, 50):5.2f} ms  "
        f"p90 {percentile(gaps, 90):5.2f} ms  agent p50 {agent:5.1f} ms  CPU/job {cpu_ms:5.2f} ms"
    )


def main() -> int:
    """Run the comparison; print one line per run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("code", nargs="*", type=Path, help="checkouts to compare (default: this one)")
    ap.add_argument("--orders", type=int, default=300)
    ap.add_argument("--sleep", default="0.05", help="seconds each agent sleeps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    opts = ap.parse_args()
    codes = [c.resolve() for c in opts.code] or [HERE.parent]
    base = Path(tempfile.mkdtemp(prefix="dispatcher-gap-", dir=opts.tmp))
    print(f"backlog of {opts.orders} orders, agent `sh sleep_agent.sh {opts.sleep}`, max_jobs 2, load {_load()}")
    try:
        for _ in range(opts.rounds):
            for code in codes:
                print(one_run(code, base, opts.orders, opts.sleep), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _load() -> str:
    with open("/proc/loadavg") as fh:
        return fh.read().split()[0]


if __name__ == "__main__":
    sys.exit(main())
