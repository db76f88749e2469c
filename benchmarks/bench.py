#!/usr/bin/env python3
"""Measure the dispatcher against the cheapest ways to run the same agent, on this machine.

Run from the repository root:

    .venv/bin/python benchmarks/bench.py [--only cpu,inotify,pickup,backlog,sleepers,idle]
        [--orders 2000] [--max-jobs 2] [--tmp DIR] [--tmpfs DIR] [--keep]
    .venv/bin/python benchmarks/bench.py --only rq      # needs redis-server and the bench extra
    .venv/bin/python benchmarks/bench.py --only pg,hosts,roundtrips,takeover [--orders 1000]
        [--hosts 1,2,3] [--hosts-sleep 0.05] [--lease 2,30]
    .venv/bin/python benchmarks/bench.py --profile [--orders 2000]

Every figure is printed beside a baseline measured in the same run, their ratio, the
target and MET or MISSED; the last line is one JSON object with all figures. The daemon is
driven from outside only (`python -m dispatcher`, config files, folders, log lines, the
notify socket). Exit 0 when every section produced its figures, whether or not targets
were met; 1 when a section could not (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bigorder import section_bigorder
from capacity import section_idle, section_sleepers
from cpu import section_cpu
from harness import BenchError, fresh_folder
from latency import section_backlog, section_pickup
from many_hosts import section_hosts, section_pg, section_roundtrips, section_takeover
from profiling import run_profile
from report import Result, table
from rq_queue import section_rq
from syscalls import section_syscalls
from throughput import section_inotify

Section = Callable[[Path, argparse.Namespace], Result]

SECTIONS: dict[str, tuple[Section, str]] = {
    "cpu": (section_cpu, "daemon CPU per job (by thread) and throughput vs the floor loop and `xargs -P`"),
    "syscalls": (section_syscalls, "system calls per job under strace: the daemon's threads vs the floor's"),
    "inotify": (section_inotify, "throughput, running daemon vs an `inotifywait -m` loop"),
    "pickup": (section_pickup, "rename into inbox/ -> agent start, idle daemon"),
    "backlog": (section_backlog, "orders waiting at start: `run` spawn -> first agent start"),
    "sleepers": (section_sleepers, "many agents waiting at once"),
    "idle": (section_idle, "idle daemon, empty inbox"),
    "bigorder": (section_bigorder, "a 1 MB YAML order beside small ones: the small ones' pickup"),
    "pg": (section_pg, "PostgreSQL ledger vs SQLite, `run --once` on one host"),
    "hosts": (section_hosts, "one PostgreSQL ledger, daemons on 1, 2 and 3 hosts (namespaces)"),
    "roundtrips": (section_roundtrips, "the PostgreSQL ledger's transactions and statements per job"),
    "takeover": (section_takeover, "a host killed mid-job: time until another host takes it over"),
    "rq": (section_rq, "throughput against RQ (2 workers, Redis without persistence) and `xargs -P`"),
}
# Run when --only is not given. The PostgreSQL sections need a server's binaries (and
# `hosts` and `takeover` root, for network namespaces), `rq` redis-server and the bench
# extra; they run when named.
DEFAULT_SECTIONS = ("cpu", "syscalls", "inotify", "pickup", "backlog", "sleepers", "idle", "bigorder")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Return the options; --only and --backlog come back as lists."""
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)}",
    )
    ap.add_argument(
        "--orders",
        type=int,
        default=None,
        help="orders for cpu, inotify and --profile (default 2000) and for pg, hosts and roundtrips (default 1000)",
    )
    ap.add_argument("--max-jobs", type=int, default=2, help="max_jobs, agent concurrency and xargs -P")
    ap.add_argument("--pickup-samples", type=int, default=100, help="drops for pickup")
    ap.add_argument("--pickup-gap", type=float, default=0.05, help="seconds between pickup drops")
    ap.add_argument("--backlog", default="10000,100000", help="comma-separated backlog sizes")
    ap.add_argument("--sleepers", type=int, default=2000, help="agents at once for sleepers")
    ap.add_argument("--sleep", type=float, default=10.0, help="seconds each sleeper sleeps")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="length of the idle measurement")
    ap.add_argument(
        "--hosts", default="1,2,3", help="comma-separated host counts for hosts (the first is the baseline)"
    )
    ap.add_argument("--hosts-sleep", type=float, default=0.05, help="seconds the agent sleeps in hosts")
    ap.add_argument("--lease", default="2,30", help="comma-separated leases (seconds) for takeover")
    ap.add_argument("--timeout", type=float, default=None, help="limit per throughput run (default 120 + 0.5 s/order)")
    ap.add_argument(
        "--tmp", default=None, help="folder on disk under which each run gets a fresh folder (default $TMPDIR)"
    )
    ap.add_argument(
        "--tmpfs",
        default="/dev/shm",
        help="folder on tmpfs where `cpu` measures a second time, in fresh folders; 'none' to skip",
    )
    ap.add_argument("--strace-orders", type=int, default=300, help="orders for syscalls (each run under strace)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of `cpu`, its contenders taking turns (xargs, floor, daemon); each figure is the median",
    )
    ap.add_argument("--keep", action="store_true", help="keep the dispatch roots and daemon logs")
    ap.add_argument("--profile", action="store_true", help="profile `run --once` over --orders orders instead")
    ap.add_argument("--profile-wall", action="store_true", help="with --profile: wall clock instead of CPU time")
    ap.add_argument(
        "--from-source",
        action="store_true",
        help="do not byte-compile the package first (an editable install under PYTHONDONTWRITEBYTECODE; remove "
        "dispatcher/**/__pycache__ to measure it)",
    )
    args = ap.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := [s for s in args.only if s not in SECTIONS]:
        ap.error(f"--only: unknown section {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    try:
        args.backlog = [int(s.replace("_", "")) for s in args.backlog.split(",") if s.strip()]
    except ValueError:
        ap.error("--backlog takes comma-separated integers, e.g. 10000,100000")
    try:
        args.hosts = [int(s) for s in args.hosts.split(",") if s.strip()]
        args.lease = [float(s) for s in args.lease.split(",") if s.strip()]
    except ValueError:
        ap.error("--hosts takes comma-separated integers (1,2,3), --lease comma-separated seconds (2,30)")
    if not args.hosts or not args.lease or min(args.lease) <= 0 or args.hosts_sleep <= 0:
        ap.error("--hosts, --lease and --hosts-sleep need positive values")
    args.pg_orders = args.orders or 1000
    args.orders = args.orders or 2000
    counts = [
        args.orders,
        args.strace_orders,
        args.max_jobs,
        args.rounds,
        args.pickup_samples,
        args.sleepers,
        *args.backlog,
        *args.hosts,
    ]
    if min(counts) < 1:
        ap.error("counts must be >= 1")
    args.timeout = args.timeout or 120 + max(args.orders, args.pg_orders) * 0.5
    return args


def _from_checkout(path: str) -> str:
    """Return path relative to the checkout (`.venv/bin/python`) when inside it: reports hold no machine paths."""
    checkout = Path(__file__).resolve().parent.parent
    try:
        return str(Path(path).relative_to(checkout))
    except ValueError:
        return os.path.basename(path)


def machine(argv: list[str] | None) -> dict[str, Any]:
    """Return what a reader needs to compare runs: when, what, on which machine."""
    sh = os.path.realpath(shutil.which("sh") or "sh")
    try:
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([_from_checkout(sys.executable), *(sys.argv if argv is None else ["bench.py", *argv])]),
        "commit": commit or None,
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg()[0],
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "sh": sh,
    }


def byte_compile() -> str:
    """Byte-compile the package the daemons import, as a wheel install has it; say how it was.

    An editable install leaves only sources, and with PYTHONDONTWRITEBYTECODE set every start
    of the daemon would compile its modules again (about 0.2 s of CPU): a cost of that
    install, not of the daemon, and it would land in every start-up and backlog figure.
    """
    package = Path(__file__).resolve().parent.parent / "dispatcher"  # what harness.py puts first on PYTHONPATH
    done = subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", str(package)], capture_output=True, check=False
    )
    return "byte-compiled first" if done.returncode == 0 else f"compileall failed ({done.returncode}): from source"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections (or the profile), print the table and the JSON line."""
    args = parse_args(argv)
    # A SIGTERM to the benchmark unwinds through the finally blocks that stop the daemons.
    signal.signal(signal.SIGTERM, _interrupt)
    meta = machine(argv)
    meta["bytecode"] = "not byte-compiled first (--from-source)" if args.from_source else byte_compile()
    tmp = Path(tempfile.mkdtemp(prefix="dispatcher-bench-", dir=args.tmp))
    made = [tmp]

    def tmpfs_base() -> Path:
        top = Path(tempfile.mkdtemp(prefix="dispatcher-bench-", dir=args.tmpfs))
        made.append(top)
        return top

    args.tmpfs_base = None if args.tmpfs.lower() in ("", "none") else tmpfs_base
    results: dict[str, Result] = {}
    try:
        if args.profile:
            base = fresh_folder(tmp, "profile")
            try:
                print("\n".join(run_profile(base, args)))
            except BenchError as exc:
                print(f"profile: no figures: {exc}")
                return 1
            return 0
        for name in args.only:
            fn, _title = SECTIONS[name]
            base = fresh_folder(tmp, name)
            print(f"running {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                results[name] = fn(base, args)
            except BenchError as exc:
                results[name] = Result(error=str(exc))
            except (subprocess.TimeoutExpired, OSError) as exc:
                results[name] = Result(error=f"{exc.__class__.__name__}: {exc}")
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for top in made:
            if args.keep:
                print(f"kept {top}", file=sys.stderr)
            else:
                shutil.rmtree(top, ignore_errors=True)

    print(f"dispatcher benchmark  {meta['date']}  (commit {meta['commit'] or '?'})")
    print(f"command: {meta['command']}")
    print(
        f"machine: nproc {meta['nproc']} (usable {meta['cpus_usable']}), load {meta['loadavg']:.2f} at start, "
        f"{meta['platform']}, python {meta['python']}, sh -> {meta['sh']}; the package {meta['bytecode']}"
    )
    print()
    print("\n".join(table(results, {k: v[1] for k, v in SECTIONS.items()})))
    print(json.dumps({"meta": meta, **{k: r.as_json() for k, r in results.items()}}, sort_keys=True))
    return 1 if any(r.error for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
