"""Section `syscalls`: system calls per job of the daemon's own threads, beside the floor loop's.

Each contender runs under `strace -f` twice, over N orders and over none, in fresh
folders; a figure is (full run - empty run) / N, so start-up and stop fall out. strace
slows what it traces many times over: this section counts, it never times (the `cpu`
section's figures come from runs without it). Needs `strace` (Debian: `apt-get install
strace`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from harness import AGENT, BenchError, agent_env, child_env, fresh_folder, job_ids, write_backlog, write_config
from report import Result, Row

FLOOR = Path(__file__).resolve().parent / "floor.py"
TRACE = (
    "futex,openat,open,creat,mkdir,mkdirat,link,linkat,symlink,symlinkat,rename,renameat,renameat2,"
    "fsync,fdatasync,unlink,unlinkat,execve,clone,clone3,fork,vfork"
)
# What a reader asks about, from the traced calls.
KINDS = {
    "futex": ("futex",),
    "creates": ("mkdir", "mkdirat", "link", "linkat", "symlink", "symlinkat", "creat"),  # plus opens with O_CREAT
    "opens": ("openat", "open", "creat"),
    "renames": ("rename", "renameat", "renameat2"),
    "fsyncs": ("fsync", "fdatasync"),
    "unlinks": ("unlink", "unlinkat"),
    "execs": ("execve",),
    "spawns": ("clone", "clone3", "fork", "vfork"),
}
LINE = re.compile(r"^(\d+)\s+([a-z0-9_]+)\((.*)")


def count(trace: Path) -> tuple[Counter[str], Counter[str]]:
    """Return (calls by the traced program's own threads, calls by the processes it started), by kind.

    A process that calls execve, other than the first, is a started program (an agent);
    every other pid is a thread of the program itself.
    """
    calls: list[tuple[str, str, str]] = []
    for raw in trace.read_text(errors="replace").splitlines():
        if m := LINE.match(raw):
            calls.append((m.group(1), m.group(2), m.group(3)))
    if not calls:
        raise BenchError(f"strace wrote no calls to {trace}")
    first = calls[0][0]
    started = {pid for pid, name, _ in calls if name == "execve" and pid != first}
    own: Counter[str] = Counter()
    kids: Counter[str] = Counter()
    for pid, name, args in calls:
        side = kids if pid in started else own
        for kind, names in KINDS.items():
            if name in names:
                side[kind] += 1
        if name in ("openat", "open") and "O_CREAT" in args:
            side["creates"] += 1
    return own, kids


def traced(base: Path, label: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[Counter, Counter]:
    """Run argv under strace -f into base/<label>.strace; return its counts."""
    out = base / f"{label}.strace"
    cmd = ["strace", "-f", "-qq", "--seccomp-bpf", "-o", str(out), "-e", f"trace={TRACE}", *argv]
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=base, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{label}: `{' '.join(cmd[:8])} ...` exited {proc.returncode}: {proc.stderr[-400:]!r}")
    return count(out)


def daemon(base: Path, mj: int, ids: list[str], timeout: float) -> tuple[Counter, Counter]:
    """`run --once` under strace over ids as a backlog."""
    config, root = write_config(base, max_jobs=mj)
    write_backlog(root / "inbox", ids)
    argv = [sys.executable, "-m", "dispatcher", "--config", str(config), "run", "--once"]
    counts = traced(base, "daemon", argv, child_env(), timeout)
    if (done := sum(1 for j in ids if (root / "done" / j).is_dir())) != len(ids):
        raise BenchError(f"daemon under strace: {done}/{len(ids)} jobs in done/ (log: run with --keep)")
    return counts


def floor(base: Path, mj: int, ids: list[str], timeout: float) -> tuple[Counter, Counter]:
    """benchmarks/floor.py under strace over ids as a backlog."""
    root = base / "dispatch"
    write_backlog(root / "inbox", ids)
    argv = [sys.executable, str(FLOOR), str(root), str(mj), "sh", str(AGENT)]
    counts = traced(base, "floor", argv, agent_env(), timeout)
    if (done := sum(1 for j in ids if (root / "done" / j).is_dir())) != len(ids):
        raise BenchError(f"floor under strace: {done}/{len(ids)} jobs in done/")
    return counts


def xargs(base: Path, mj: int, ids: list[str], timeout: float) -> tuple[Counter, Counter]:
    """`xargs -P` over ids under strace (the agents' own calls)."""
    work = base / "work"
    work.mkdir()
    for j in ids:
        (work / j).mkdir()
    args = base / "xargs.args"
    args.write_bytes(b"".join(f"{j}\0{work / j}\0".encode() for j in ids))
    argv = ["xargs", "-0", "-a", str(args), "-P", str(mj), "-n", "2", "sh", str(AGENT)]
    return traced(base, "xargs", argv, agent_env(), timeout)


def per_job(full: Counter[str], empty: Counter[str], n: int) -> dict[str, float]:
    """Return (full - empty) / n for every kind."""
    return {k: (full[k] - empty[k]) / n for k in KINDS}


def section_syscalls(base: Path, opts: argparse.Namespace) -> Result:
    """System calls per job: the daemon's threads against the floor loop's, and their agents'."""
    if shutil.which("strace") is None:
        return Result(skipped="needs strace (Debian: apt-get install strace)")
    n, mj, timeout = opts.strace_orders, opts.max_jobs, opts.timeout * 4
    d_full = daemon(fresh_folder(base, "daemon"), mj, job_ids("SYS", n), timeout)
    d_empty = daemon(fresh_folder(base, "daemon-empty"), mj, [], timeout)
    f_full = floor(fresh_folder(base, "floor"), mj, job_ids("FLOOR", n), timeout)
    f_empty = floor(fresh_folder(base, "floor-empty"), mj, [], timeout)
    x_own, x_kids = xargs(fresh_folder(base, "xargs"), mj, job_ids("XARG", n), timeout)
    d_own, d_kids = per_job(d_full[0], d_empty[0], n), per_job(d_full[1], d_empty[1], n)
    f_own, f_kids = per_job(f_full[0], f_empty[0], n), per_job(f_full[1], f_empty[1], n)
    res = Result()
    for kind in KINDS:
        res.rows.append(
            Row(f"{kind}_per_job", f"{kind} per job, daemon's threads vs floor's", d_own[kind], f_own[kind],
                "", "-", None, 1)
        )  # fmt: skip
    res.notes += [
        f"N = {n} orders (--strace-orders), max_jobs {mj}, each run and an empty run (no orders) under "
        f"`strace -f --seccomp-bpf -e trace={TRACE}`; per job = (run - empty run) / N; roots in fresh folders "
        f"under {base}",
        "daemon: `run --once` on a backlog; floor: benchmarks/floor.py; its own threads' calls apart from those "
        "of the processes it started (a pid that calls execve is an agent); creates = mkdir(at), link(at), "
        "symlink(at) and opens with O_CREAT",
        "the agents' own calls per job: "
        + "; ".join(
            f"{k} daemon's {d_kids[k]:.1f}, floor's {f_kids[k]:.1f}, xargs's {x_kids[k] / n:.1f}" for k in KINDS
        ),
        "xargs itself per job: " + ", ".join(f"{k} {x_own[k] / n:.1f}" for k in KINDS),
        "strace slows the traced programs many times over: nothing here is timed",
    ]
    res.data = {
        "orders": n,
        "daemon_own": d_own,
        "daemon_agents": d_kids,
        "floor_own": f_own,
        "floor_agents": f_kids,
        "xargs_own": {k: x_own[k] / n for k in KINDS},
        "xargs_agents": {k: x_kids[k] / n for k in KINDS},
    }
    return res
