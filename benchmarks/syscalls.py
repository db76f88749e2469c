"""Section `syscalls`: system calls per job of the daemon's own threads, beside the floor loop's.

The daemon's threads are traced (attached by thread id once it is ready and warm, so its
agents are not) while N orders go through it; the floor loop runs under strace without
`-f` over N orders and over none (start-up and stop fall out of the difference); the
agent's own calls come from `xargs -P` under `strace -f`. strace
slows what it traces many times over: this section counts, it never times (the `cpu`
section's figures come from runs without it). Needs `strace` (Debian: `apt-get install
strace`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from harness import (
    AGENT,
    BenchError,
    agent_env,
    ensure_program,
    fresh_folder,
    job_ids,
    order_bytes,
    running_daemon,
    safe_drop,
    write_backlog,
    write_config,
)
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
PLAIN = re.compile(r"^([a-z0-9_]+)\((.*)")
WARMUP = 10
Counts = Counter[str]


def split(trace: Path) -> tuple[Counter[str], Counter[str]]:
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


def strace_cmd(out: Path) -> list[str]:
    """Return the strace command line that writes the traced calls to out."""
    return ["strace", "-o", str(out), "-e", f"trace={TRACE}"]


def traced(base: Path, label: str, argv: list[str], env: dict[str, str], timeout: float, *, follow: bool) -> Counts:
    """Run argv under strace (with -f when follow) into base/<label>.strace; return its counts."""
    out = base / f"{label}.strace"
    cmd = [*strace_cmd(out), *(["-f", "--seccomp-bpf"] if follow else []), *argv]
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=base, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-400:]
        raise BenchError(f"{label}: `{' '.join(cmd[:5])} ...` exited {proc.returncode}: {tail!r}")
    return count(out)


def daemon(base: Path, mj: int, n: int, timeout: float) -> tuple[Counts, int, int]:
    """Trace a ready `run`'s threads (not its agents) while n orders go through it.

    Returns the counts, the threads at attach time and the threads started while tracing.
    """
    config, root = write_config(base, max_jobs=mj)
    inbox = root / "inbox"
    with running_daemon(config, base, [], notify=True) as d:
        d.wait_ready()
        # Warm-up: the pools start their threads on first use.
        for job_id in job_ids("WARM", WARMUP):
            safe_drop(inbox, job_id, order_bytes(job_id))
        d.wait_finished(WARMUP, timeout)
        tids = sorted(os.listdir(f"/proc/{d.pid}/task"), key=int)
        out, err = base / "daemon.strace", base / "strace.err"
        with open(err, "wb") as errfh:
            # -f for threads a pool starts later; -b execve lets go of each agent at its exec, so
            # that the agents stay untraced (a traced agent's exit reaches the daemon late).
            # With -f, -p PID attaches to every thread of the process.
            attach = [*strace_cmd(out), "-f", "-b", "execve", "-p", str(d.pid)]
            tracer = subprocess.Popen(attach, stderr=errfh)
        try:
            deadline = time.monotonic() + 30
            while "attached" not in err.read_text(errors="replace"):
                if tracer.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"strace did not attach to {len(tids)} threads: {err.read_text()[-400:]}")
                time.sleep(0.02)
            ids = job_ids("SYS", n)
            for job_id in ids:
                safe_drop(inbox, job_id, order_bytes(job_id))
            d.wait_finished(WARMUP + n, timeout)
            later = set(os.listdir(f"/proc/{d.pid}/task")) - set(tids)  # traced too (-f)
        finally:
            tracer.send_signal(signal.SIGINT)  # strace detaches and exits
            tracer.wait(30)
    if (done := sum(1 for j in ids if (root / "done" / j).is_dir())) != n:
        raise BenchError(f"daemon under strace: {done}/{n} jobs in done/\n{d.symptoms()}")
    own = count(out, exclude_after_exec=True)
    return own, len(tids), len(later)


def floor(base: Path, mj: int, ids: list[str], timeout: float) -> Counts:
    """benchmarks/floor.py (one thread) under strace, its agents not traced, over ids as a backlog."""
    root = base / "dispatch"
    write_backlog(root / "inbox", ids)
    argv = [sys.executable, str(FLOOR), str(root), str(mj), "sh", str(AGENT)]
    counts = traced(base, "floor", argv, agent_env(), timeout, follow=False)
    if (done := sum(1 for j in ids if (root / "done" / j).is_dir())) != len(ids):
        raise BenchError(f"floor under strace: {done}/{len(ids)} jobs in done/")
    return counts


def xargs(base: Path, mj: int, ids: list[str], timeout: float) -> tuple[Counter[str], Counter[str]]:
    """`xargs -P` over ids under `strace -f`: (xargs's own calls, its agents')."""
    work = base / "work"
    work.mkdir()
    for j in ids:
        (work / j).mkdir()
    args = base / "xargs.args"
    args.write_bytes(b"".join(f"{j}\0{work / j}\0".encode() for j in ids))
    argv = ["xargs", "-0", "-a", str(args), "-P", str(mj), "-n", "2", "sh", str(AGENT)]
    out = base / "xargs.strace"
    traced(base, "xargs", argv, agent_env(), timeout, follow=True)
    return split(out)


def count(trace: Path, *, exclude_after_exec: bool = False) -> Counts:
    """Return the calls in an strace output file, by kind.

    With exclude_after_exec, a process's calls after its first execve are left out (they
    are the agent's), and `exec_paths:<path>` counts the paths of those first execs.
    """
    out: Counts = Counter()
    execed: set[str] = set()
    for raw in trace.read_text(errors="replace").splitlines():
        m = LINE.match(raw) or PLAIN.match(raw)
        if m is None:
            continue
        pid = m.group(1) if m.re is LINE else ""
        name, args = m.groups()[-2:]
        if exclude_after_exec:
            if pid in execed:
                continue
            if name == "execve":
                execed.add(pid)
                out["exec_paths:" + args.split(",", 1)[0].strip('"')] += 1
                continue  # the agent's exec, in its own process
        for kind, names in KINDS.items():
            if name in names:
                out[kind] += 1
        if name in ("openat", "open") and "O_CREAT" in args:
            out["creates"] += 1
    return out


def per_job(full: Counter[str], empty: Counter[str], n: int) -> dict[str, float]:
    """Return (full - empty) / n for every kind."""
    return {k: (full[k] - empty[k]) / n for k in KINDS}


def section_syscalls(base: Path, opts: argparse.Namespace) -> Result:
    """System calls per job: the daemon's threads against the floor loop's, and the agents' own."""
    tool, installed = ensure_program("strace", "strace")
    if tool is None:
        return Result(skipped=f"needs strace: {installed}")
    n, mj, timeout = opts.strace_orders, opts.max_jobs, opts.timeout * 4
    d_all, traced_threads, later = daemon(fresh_folder(base, "daemon"), mj, n, timeout)
    f_full = floor(fresh_folder(base, "floor"), mj, job_ids("FLOOR", n), timeout)
    f_empty = floor(fresh_folder(base, "floor-empty"), mj, [], timeout)
    x_own, x_kids = xargs(fresh_folder(base, "xargs"), mj, job_ids("XARG", n), timeout)
    d_own = {k: d_all[k] / n for k in KINDS}
    f_own = per_job(f_full, f_empty, n)
    res = Result()
    for kind in (k for k in KINDS if k != "execs"):  # the agents' execs are theirs, in the notes
        res.rows.append(
            Row(f"{kind}_per_job", f"{kind} per job, daemon's threads vs floor's", d_own[kind], f_own[kind],
                "", "-", None, 1)
        )  # fmt: skip
    if installed:
        res.notes.append(installed)
    res.notes += [
        f"N = {n} orders (--strace-orders), max_jobs {mj}, agent `sh agent.sh`; calls traced: {TRACE}; "
        f"each run's root in a fresh folder under {base}",
        f"daemon: a ready `run`, {WARMUP} orders to warm it up, then `strace -f -b execve -p PID` attached to its "
        f"{traced_threads} threads while N orders are safe-dropped, until the "
        f"last job.done, with -f (threads started later) and -b execve (strace lets go of an agent at its "
        f"first exec, so execs count 1 per agent whatever PATH search follows); per job = calls / N"
        + (f"; {later} threads started meanwhile" if later else ""),
        "floor: benchmarks/floor.py (one thread) under `strace` without -f, over N orders and over none; per job = "
        "(run - empty run) / N",
        "the daemon's agents' first exec: "
        + ", ".join(f"{k.split(':', 1)[1]} {v / n:.1f}/job" for k, v in sorted(d_all.items()) if k.startswith("exec_"))
        + f" (the floor resolves its program once: {shutil.which('sh')})",
        "creates = mkdir(at), link(at), symlink(at) and opens with O_CREAT; spawns = clone, clone3, fork, vfork",
        "the agent's own calls per job (`xargs -P` under `strace -f`, its children): "
        + ", ".join(f"{k} {x_kids[k] / n:.1f}" for k in KINDS)
        + "; xargs itself: "
        + ", ".join(f"{k} {x_own[k] / n:.1f}" for k in KINDS),
        "strace slows the traced programs many times over: nothing here is timed, and futex calls (lock hand-offs "
        "between threads) grow when threads run slower: read the daemon's futex figure as an upper bound, and the "
        "`cpu` section's context switches (no strace) beside it",
    ]
    res.data = {
        "orders": n,
        "daemon_own": d_own,
        "daemon_threads_traced": traced_threads,
        "floor_own": f_own,
        "xargs_own": {k: x_own[k] / n for k in KINDS},
        "xargs_agents": {k: x_kids[k] / n for k in KINDS},
    }
    return res
