"""Shortages and stops (contract section 13): a daemon short of something waits, never answers for good.

Each test runs the real daemon as a process: with a low RLIMIT_NOFILE, with its
PostgreSQL server stopped, with a reload that removes an agent, with a long
queue for a busy agent, with many failing jobs and a notify command, and with
two `approve -` commands racing on the same ids.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, Env, cli_env, order, wait_until
from git_helpers import code_order, coder, make_repo
from helpers_faults import hold_agent, tiny_order, write_script
from pg_fixtures import running_pg_server
from pgserver import PgServer
from web_helpers import start_web


def nofile(limit: int) -> Callable[[], None]:
    """Return a preexec function that caps the child's open files (soft and hard) at limit."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def run_once(
    env: Env, *, preexec: Callable[[], None] | None = None, timeout: float = 150
) -> tuple[int, list[dict[str, Any]]]:
    """Run `dispatcher run --once` to its end; return its exit code and its JSON log lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=env.tmp,
        env=cli_env(),
        preexec_fn=preexec,
    )
    lines = []
    for line in proc.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return proc.returncode, lines


def names(folder: Path) -> list[str]:
    """Return the sorted entry names of a folder (none if it does not exist)."""
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_out_of_file_descriptors_waits_and_finishes_every_job(env: Env) -> None:
    """Short of open files (RLIMIT_NOFILE 40, 90 agents, 12 at once), nothing is refused or failed and --once ends."""
    jobs = [f"fd{i:03d}" for i in range(90)]
    # 12 copies at once need about 50 descriptors; a slot that stayed taken would stop the run for good
    env.configure({"tiny": hold_agent(env, 0.3, concurrency=12)}, max_jobs=60)
    for job_id in jobs:
        env.drop(tiny_order(job_id))
    code, lines = run_once(env, preexec=nofile(40))
    problems = [e for e in lines if e.get("level") in ("error", "warning") and e["event"] != "daemon.short_of"]
    assert code == 0 and problems == [], problems[:3]
    assert names(env.root / "done") == jobs
    assert names(env.root / "failed") == [], "no order refused and no job failed for a shortage"
    assert names(env.root / "active") == [] and names(env.root / "inbox") == []
    assert names(env.root / ".state" / "staging") == []
    short = [e for e in lines if e["event"] == "daemon.short_of"]
    assert len(short) >= 1 and all(new_shortage(lines, a, b) for a, b in itertools.pairwise(short)), short
    received = Counter(e["job_id"] for e in lines if e["event"] == "order.received")
    assert sorted(received) == jobs and set(received.values()) == {1}, "a file read again is not received again"
    assert "EMFILE" in short[0]["resource"]
    starts = env.starts()
    assert sorted(j for j, _a in starts) == jobs and all(a == 1 for _j, a in starts), "each agent ran once"
    results = [json.loads((env.root / "done" / j / "result.json").read_text()) for j in jobs]
    assert all(len(r["attempts"]) == 1 for r in results), "a start put off for a shortage is not an attempt"


def new_shortage(lines: list[dict[str, Any]], first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Is `second` a shortage of its own, logged once more by rule: an agent started since `first`, and more than a
    pause (2 s) passed? (One met again on the edge is not logged again; on a loaded machine the agents can run out of
    descriptors a second time, a new shortage.)"""
    at = [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")) for e in (first, second)]
    i, j = lines.index(first), lines.index(second)
    started = any(e["event"] == "agent.started" for e in lines[i:j])
    return started and (at[1] - at[0]).total_seconds() > 2.0


def test_after_a_descriptor_shortage_one_start_is_tried_at_a_time_in_claim_order(env: Env) -> None:
    """RLIMIT_NOFILE 24, 8 slots, 20 agents of 0.5 s: room for one agent at a time. Starts after a shortage go one
    at a time (two that cannot both fit never fail together after every pause, which stalled the daemon for up to
    46 s), so the run never sits idle for long, and jobs put off for a shortage start in the order of their claims."""
    jobs = [f"fdw{i:02d}" for i in range(20)]
    env.configure({"tiny": hold_agent(env, 0.5, concurrency=8)}, max_jobs=8)
    for job_id in jobs:
        env.drop(tiny_order(job_id))
    code, lines = run_once(env, preexec=nofile(24))
    assert code == 0 and names(env.root / "done") == jobs
    stamps = [datetime.fromisoformat(e["timestamp"]) for e in lines]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
    assert max(gaps) < 8.0, f"the daemon sat idle for {max(gaps):.1f} s with work left"
    claimed = [e["job_id"] for e in lines if e["event"] == "job.claimed"]
    last_claim = max(i for i, e in enumerate(lines) if e["event"] == "job.claimed")
    waited = [e["job_id"] for e in lines[last_claim:] if e["event"] == "agent.started"]  # claimed, then put off
    assert waited == [j for j in claimed if j in waited], f"claimed {claimed}, started after the last claim {waited}"


@pytest.mark.parametrize("limit", [5, 6, 8, 10])
def test_out_of_file_descriptors_at_start_is_a_shortage_not_a_crash(env: Env, limit: int) -> None:
    """RLIMIT_NOFILE 5, 6, 8 or 10 (hard too): the daemon cannot make its event loop, its folders, open its ledger or
    register.
    It logs daemon.short_of once (no traceback, no exit 1 or 2) and waits; SIGTERM ends it with exit 0."""
    env.configure({"tiny": hold_agent(env, 0)})
    out = env.tmp / f"run-{limit}.out"
    with out.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=env.tmp,
            env=cli_env(),
            preexec_fn=nofile(limit),
        )
    try:

        def events() -> list[dict[str, Any]]:
            return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]

        wait_until(lambda: any(e["event"] == "daemon.short_of" for e in events()), 60, "daemon.short_of")
        time.sleep(2.5)  # retries go on meanwhile
        assert proc.poll() is None, out.read_text()[-2000:]
        text = out.read_text()
        assert "Traceback" not in text and "daemon.ready" not in text
        short = [e for e in events() if e["event"] == "daemon.short_of"]
        assert len(short) == 1 and short[0]["step"] == "start" and "EMFILE" in short[0]["resource"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


LOOP_BACK = """import os, resource, sys, threading, time
from dispatcher.core import startup
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))  # room for one more
threading.Timer(2.5, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))).start()
started = time.monotonic()
loop = startup.new_loop(lambda: False)
print(loop is not None and not loop.is_closed(), round(time.monotonic() - started))
"""


def test_the_event_loop_is_made_once_descriptors_are_back(env: Env) -> None:
    """Too few descriptors for the event loop (it needs three): daemon.short_of once, step start, another try each
    second, and the loop is made once the limit gives room again; no traceback (a loop made half would print one)."""
    proc = subprocess.run([sys.executable, "-c", LOOP_BACK], capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    short = [x for x in lines if "daemon.short_of" in x]  # structlog's console lines: no JSON set up here
    assert len(short) == 1 and "step=start" in short[0] and "EMFILE" in short[0], proc.stdout
    made, waited = lines[-1].split()
    assert made == "True" and 2 <= int(waited) <= 5, proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


STARTED = ("daemon.short_of", "daemon.ready")  # a start that waits, or one that got through


def test_every_low_descriptor_limit_at_start_waits_or_starts_never_crashes(env: Env) -> None:
    """RLIMIT_NOFILE from 9 to 16, each with an order queued: wherever the start-up meets the limit (its folders, the
    ledger, the first scan of inbox/, the worktrees' housekeeping), the daemon logs daemon.short_of or gets ready;
    never a traceback or an exit before the SIGTERM, which it answers with exit 0 (section 13)."""
    env.configure({"tiny": hold_agent(env, 0)})
    env.drop(order("FD-1", to="tiny"))
    for limit in range(9, 17):
        with run_at_limit(env, limit) as (proc, out):
            time.sleep(1.0)
            assert proc.poll() is None, (limit, out.read_text()[-2000:])
            assert "Traceback" not in out.read_text(), (limit, out.read_text()[-2000:])


@contextlib.contextmanager
def run_at_limit(env: Env, limit: int) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """Start `run` under RLIMIT_NOFILE limit (soft and hard) and wait until it logs daemon.short_of or gets ready;
    yield it and its output file; on the way out SIGTERM it and check that it exits 0 (section 13)."""
    out = env.tmp / f"run-{limit}.out"
    with out.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run"],
            stdout=fh, stderr=subprocess.STDOUT, cwd=env.tmp, env=cli_env(), preexec_fn=nofile(limit),
        )  # fmt: skip
    try:
        wait_until(lambda: any(f'"{e}"' in out.read_text() for e in STARTED), 60, f"start at limit {limit}")
        yield proc, out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (limit, out.read_text()[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_short_of_descriptors_to_start_an_agent_claims_nothing_until_they_are_back(env: Env) -> None:
    """RLIMIT_NOFILE 16 (set from outside): the daemon goes on, but no agent could start. No order leaves inbox/
    for active/ to wait there (the first one neither), daemon.short_of is logged once; the limit raised, every
    job runs once."""
    jobs = [f"few{i}" for i in range(5)]
    env.configure({"tiny": hold_agent(env, 0, concurrency=4)}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (16, 256))  # its own start would raise a soft limit

    def events(name: str) -> list[dict[str, Any]]:
        return [e for e in d.events() if e["event"] == name]

    for job_id in jobs:
        env.drop(tiny_order(job_id))
    d.wait_event("daemon.short_of")
    time.sleep(4)  # several pauses: each look after one finds the descriptors still short
    assert names(env.root / "inbox") == [f"{j}.json" for j in jobs], "every order stays where it is"
    assert names(env.root / "active") == [] and events("job.claimed") == [] and env.starts() == []
    short = events("daemon.short_of")
    assert len(short) == 1 and "EMFILE" in short[0]["resource"], short
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (256, 256))  # the descriptors are back
    wait_until(lambda: names(env.root / "done") == jobs, 60, "every job done")
    assert sorted(j for j, _a in env.starts()) == jobs and names(env.root / "failed") == []
    assert len(events("daemon.short_of")) == 1
    assert d.stop() == 0


def test_a_limit_lowered_under_a_daemon_that_ran_agents_strands_no_order_in_active(env: Env) -> None:
    """Agents ran; then `prlimit` lowers RLIMIT_NOFILE to a few above the descriptors the daemon holds, one limit after
    another: at each, the orders dropped run or wait in inbox/, none waits in active/ for a start that cannot happen
    there (section 13: keeps every order where it is). The limit raised, every job runs once."""
    env.configure({"tiny": hold_agent(env, 0, concurrency=4)}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    pid = d.proc.pid
    env.drop(tiny_order("warm"))
    env.wait_job("warm", "done")
    jobs = ["warm"]
    for extra in range(1, 12):
        held = len([fd for fd in os.listdir(f"/proc/{pid}/fd") if int(fd) < 200])
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + extra, 256))
        for i in range(2):
            jobs.append(f"low{extra}-{i}")
            env.drop(tiny_order(jobs[-1]))
        time.sleep(1.0)  # a few turns and pauses at this limit
        wait_until(lambda: names(env.root / "active") == [], 20, f"active/ empty at {held} + {extra} descriptors")
        assert set(names(env.root / "active")) == set(), "an order waits in active/ for a start that cannot happen"
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, 256))  # the descriptors are back
    wait_until(lambda: names(env.root / "done") == sorted(jobs), 60, "every job done")
    assert sorted(j for j, _a in env.starts()) == sorted(jobs) and names(env.root / "failed") == []
    assert d.stop() == 0


def test_at_every_low_descriptor_limit_an_order_runs_or_stays_in_inbox(env: Env) -> None:
    """`run` started under RLIMIT_NOFILE from 17 to 26 (soft and hard), four orders for four slots: at each limit the
    orders run or stay in inbox/. None is claimed into active/ to wait there for a start that cannot happen (the
    look before a claim asked for fewer descriptors than a first start takes)."""
    env.configure({"tiny": hold_agent(env, 0, concurrency=4)}, max_jobs=4)
    jobs = [f"lim{i}" for i in range(4)]
    for job_id in jobs:
        env.drop(tiny_order(job_id))
    for limit in range(17, 27):
        with run_at_limit(env, limit) as (_proc, out):
            time.sleep(2.5)  # several turns and pauses at this limit
        assert names(env.root / "active") == [], (limit, out.read_text()[-3000:])
    proc2 = env.cli("run", "--once", timeout=120)
    assert proc2.returncode == 0, proc2.stderr
    assert names(env.root / "done") == jobs and names(env.root / "failed") == []
    assert sorted(j for j, _a in env.starts()) == jobs


def cpu_seconds(pid: int) -> float:
    """Return the user + system CPU time a process has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pid: int, seconds: float = 4.0) -> float:
    """Return the CPU seconds the process used over the next `seconds` of wall time."""
    before = cpu_seconds(pid)
    time.sleep(seconds)  # a measurement window, not a wait for state
    return cpu_seconds(pid) - before


def test_long_queue_for_a_busy_agent_costs_no_cpu(env: Env) -> None:
    """80 orders queued behind a busy agent (concurrency 1) with a free daemon slot: the daemon sleeps."""
    env.configure({"tiny": hold_agent(env, 60, concurrency=1)}, max_jobs=2)
    for i in range(80):
        env.drop(tiny_order(f"q{i:03d}"))
    d = env.daemon()
    d.wait_ready()
    wait_until(lambda: len(env.starts()) == 1, what="the one agent to start")
    wait_until(lambda: len(names(env.root / "inbox")) == 79, what="the queue to settle")
    assert d.proc is not None
    used = idle_cpu(d.proc.pid)
    assert used < 1.0, f"the idle daemon used {used:.2f} s of CPU in 4 s"
    assert len(env.starts()) == 1 and names(env.root / "active") == ["q000"]


@pytest.mark.parametrize("limit", [22, 26, 30])
def test_at_low_descriptor_limits_workspace_jobs_and_their_hooks_wait_never_fail(
    env: Env, tmp_path: Path, limit: int
) -> None:
    """RLIMIT_NOFILE 22, 26 or 30 and four orders for an agent with a git worktree, an after hook and a land hook:
    a shortage met making a worktree, reading its change or starting a hook is waited out (section 13), so every
    job ends done, its after hook ran once and passed, it landed once after the worktree was removed, and no
    worktree is left."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "hooks.txt"
    trees = env.root / ".state" / "worktrees"
    after = ["sh", "-c", 'echo "after {job_id}" >> "$0"', str(log)]
    land = ["sh", "-c", 'echo "land {job_id}" >> "$0"; [ -d "$1/{job_id}" ] && echo "tree {job_id}" >> "$0"; true']
    land += [str(log), str(trees)]
    agent = coder(env, repo, "--write", "src/a.txt=x", after=after, land=land, concurrency=4)
    env.configure({"coder": agent}, max_jobs=4, settle=0.2)
    jobs = [f"W{limit}-{i}" for i in range(4)]
    for job_id in jobs:
        env.drop(code_order(job_id))
    with run_at_limit(env, limit) as (_proc, out):
        wait_until(lambda: names(env.root / "done") + names(env.root / "failed") == jobs and log.exists()
                   and len([ln for ln in log.read_text().splitlines() if ln.startswith("land")]) == 4,
                   120, f"every job ended and landed at limit {limit}")  # fmt: skip
    assert names(env.root / "failed") == [], out.read_text()[-3000:]
    lines = sorted(log.read_text().splitlines())
    assert lines == sorted([f"after {j}" for j in jobs] + [f"land {j}" for j in jobs]), lines
    for job_id in jobs:
        records = list((env.root / "done" / job_id / "hooks").glob("after-*.json"))
        assert [json.loads(r.read_text())["ok"] for r in records] == [True], (job_id, out.read_text()[-3000:])
    assert names(trees) == []


# an order of one item hands on a follow-up of 2,500 items (about 300 KB) to the same agent, which the checks
# read; each job's receipt names its own items
BIG_FOLLOWUP_AGENT = r"""import json, os
j = os.environ["DISPATCH_JOB_ID"]
with open(os.environ["DISPATCH_ORDER"]) as f:
    ids = [i["id"] for i in json.load(f)["items"]]
if len(ids) == 1:
    os.makedirs("outbox", exist_ok=True)
    items = [{"id": "i%d" % k, "pad": "x" * 100} for k in range(2500)]
    with open("outbox/c.json", "w") as f:
        json.dump({"job_id": j + "-c", "from": "big", "to": "big", "task": "t", "items": items}, f)
receipt = {"job_id": j, "input_ids": ids, "output_ids": [], "status": "done", "outputs": []}
with open(".receipt.tmp", "w") as f:
    json.dump(receipt, f)
os.rename(".receipt.tmp", "receipt.json")
"""


def _vm_kb(pid: int) -> int:
    """Return the address space a process holds now (VmSize, kB)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmSize:")))


def test_a_memory_shortage_while_a_job_is_checked_is_waited_out_not_the_jobs_answer(env: Env) -> None:
    """Section 13: a shortage of memory is never a job's answer. The daemon's address space capped from outside
    (`prlimit --as`) at what it holds, each job's checks read a 300 KB follow-up: no job fails ("crashed:
    MemoryError"), daemon.short_of names memory, and once the cap is lifted every job ends done and its follow-up
    runs."""
    script = write_script(env.tmp, "big_followup.py", BIG_FOLLOWUP_AGENT)
    big = {"command": [sys.executable, str(script)], "timeout": 60, "writes": [".receipt.tmp", "outbox/**"]}
    env.configure({"big": big}, max_jobs=2, settle=0.2)
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    env.drop(tiny_order("M0", to="big"))  # warm: the daemon's threads and imports are in place
    wait_until(lambda: names(env.root / "done") == ["M0", "M0-c"], 60, "the warm-up jobs done")
    jobs = [f"M{i}" for i in range(1, 5)]
    vm = _vm_kb(d.proc.pid)
    resource.prlimit(d.proc.pid, resource.RLIMIT_AS, ((vm - 1000) * 1024, resource.RLIM_INFINITY))
    try:
        for job_id in jobs:
            env.drop(tiny_order(job_id, to="big"))
            time.sleep(0.5)
        d.wait_event("daemon.short_of", timeout=60)
        time.sleep(3)
    finally:
        resource.prlimit(d.proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    every = sorted(["M0", "M0-c"] + jobs + [f"{j}-c" for j in jobs])
    wait_until(lambda: names(env.root / "done") == every, 90, "every job and follow-up done")
    assert names(env.root / "failed") == []
    assert not [e for e in d.events() if e["event"] in ("job.crashed", "job.failed")]
    short = [e for e in d.events() if e["event"] == "daemon.short_of"]
    assert short and all("memory" in e["resource"] or "ENOMEM" in e["resource"] for e in short), short
    assert d.stop() == 0


def test_agent_removed_by_reload_its_orders_wait_until_it_is_back(env: Env) -> None:
    """Orders of an agent a reload removed wait in inbox/ (logged once); back in the config, they all run."""
    slow = hold_agent(env, 1.5, concurrency=1)
    env.configure({"slow": slow, "tiny": hold_agent(env, 0)}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    for job_id in ("s1", "s2", "s3"):
        env.drop(tiny_order(job_id, to="slow"))
    wait_until(lambda: [j for j, _a in env.starts()] == ["s1"], what="s1 to start")
    env.configure({"tiny": hold_agent(env, 0)}, max_jobs=4)  # `slow` removed while s2, s3 wait for its slot
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(tiny_order("s4", to="slow"))  # an order for the removed agent, dropped while it is gone
    env.drop(tiny_order("t1"))
    env.wait_job("s1", "done")  # a running job goes on with the settings it started with
    env.wait_job("t1", "done")
    d.wait_event("order.waiting", agent="slow")
    assert names(env.root / "inbox") == ["s2.json", "s3.json", "s4.json"], "its orders wait where they are"
    assert env.refusals() == []
    env.configure({"slow": slow, "tiny": hold_agent(env, 0)}, max_jobs=4)  # back again
    d.signal(signal.SIGHUP)
    for job_id in ("s2", "s3", "s4"):
        env.wait_job(job_id, "done")
    assert [e["event"] for e in d.events()].count("order.waiting") == 1, "the wait is logged once"
    assert not [e for e in d.events() if e.get("level") == "error"]


def test_run_once_leaves_the_orders_of_an_agent_a_reload_removed_and_exits(env: Env) -> None:
    """`run --once` and a SIGHUP that removes an agent with orders still in inbox/ (a logrotate's): its running
    job finishes, its orders wait unread (logged once) and --once exits 0, as for a paused agent. It never exited."""
    slow = hold_agent(env, 1.5, concurrency=1)
    env.configure({"slow": slow, "tiny": hold_agent(env, 0)}, max_jobs=4)
    for job_id in ("s1", "s2", "s3"):
        env.drop(tiny_order(job_id, to="slow"))
    d = env.daemon("--once")
    wait_until(lambda: [j for j, _a in env.starts()] == ["s1"], what="s1 to start")
    env.configure({"tiny": hold_agent(env, 0)}, max_jobs=4)
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    assert d.wait(timeout=60) == 0
    env.result("s1", "done")
    assert names(env.root / "inbox") == ["s2.json", "s3.json"], "its orders wait where they are"
    assert [e["event"] for e in d.events()].count("order.waiting") == 1
    assert env.refusals() == [] and [j for j, _a in env.starts()] == ["s1"]


def test_a_job_of_an_agent_a_reload_removed_gives_its_slot_back_at_its_agents_exit(env: Env) -> None:
    """max_jobs 1: X1's agent fails its first attempt and waits retry_delay; a reload removed its agent meanwhile.
    Its slot goes to Y1 at the agent's exit, as any job's does (section 13: no slot stays taken), and X1's retry
    still runs with the settings it started with."""
    x = env.agent("--sleep", "1", "--fail-attempts", "1", retry_safe=True, max_attempts=2)
    env.configure({"x": x, "y": hold_agent(env, 0)}, max_jobs=1, retry_delay=3)
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("X1", to="x"))
    wait_until(lambda: env.starts() == [("X1", 1)], what="X1 to start")
    env.configure({"y": hold_agent(env, 0)}, max_jobs=1, retry_delay=3)  # `x` removed while X1 runs
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(tiny_order("Y1", to="y"))
    env.wait_job("Y1", "done")
    result = env.wait_job("X1", "done")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert [j for j, _n in env.starts()] == ["X1", "Y1", "X1"], "Y1 waited for X1's retry_delay and retry"
    assert not [e for e in d.events() if e.get("level") == "error"]


def test_an_agent_removed_before_any_of_its_orders_came_is_waited_for_too(env: Env) -> None:
    """Nothing read for `gone` before a reload removes it: its orders still wait, unrefused, until it is back."""
    env.configure({"gone": hold_agent(env, 0), "tiny": hold_agent(env, 0)})
    d = env.daemon()
    d.wait_ready()
    env.configure({"tiny": hold_agent(env, 0)})
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(tiny_order("g1", to="gone"))
    env.drop(tiny_order("t2"))
    env.wait_job("t2", "done")
    d.wait_event("order.waiting", agent="gone")
    assert names(env.root / "inbox") == ["g1.json"] and env.refusals() == []
    env.configure({"gone": hold_agent(env, 0), "tiny": hold_agent(env, 0)})
    d.signal(signal.SIGHUP)
    env.wait_job("g1", "done")
    assert not [e for e in d.events() if e.get("level") == "error"]


def test_a_follow_up_to_an_agent_a_reload_removed_waits_for_it(env: Env) -> None:
    """A kept agent hands off to a removed one: the parent is done, the follow-up waits in inbox/ until it is back."""
    follow = tiny_order("X1", to="gone") | {"from": "keep"}
    agents = {"keep": env.agent("--followup", json.dumps(follow)), "gone": hold_agent(env, 0)}
    env.configure(agents)
    d = env.daemon()
    d.wait_ready()
    env.configure({"keep": agents["keep"]})
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(order("P1", to="keep"))
    assert env.wait_job("P1", "done")["children"] == ["X1"]
    d.wait_event("order.waiting", agent="gone")
    assert names(env.root / "inbox") == ["X1.json"] and env.refusals() == []
    env.configure(agents)
    d.signal(signal.SIGHUP)
    env.wait_job("X1", "done")
    assert not [e for e in d.events() if e.get("level") == "error"]


def test_a_refused_file_is_not_a_lost_ledger(env: Env) -> None:
    """A fresh root whose only history is one refused file without a readable job id starts again."""
    env.drop(b'job_id: "\\udc80"\nfrom: [unclosed\n', name="bad.yaml")
    code, lines = run_once(env)
    assert code == 1 and [e["event"] for e in lines].count("job.refused") == 1
    assert len(env.refusals()) == 1
    env.drop(tiny_order("after", to="worker") | {"accept": {"output": "out.csv"}, "items": [{"id": "R1"}]})
    code, lines = run_once(env)
    assert code == 0, [e for e in lines if e.get("level") == "error"] or lines[-1:]
    assert names(env.root / "done") == ["after"]
    status = env.cli("status")
    assert status.returncode == 0, status.stderr


def test_two_approve_at_once_each_id_one_line_no_traceback(env: Env) -> None:
    """Two `approve -` racing on the same ids: each id is approved once, the loser says so, exit 1, no traceback."""
    ids = [f"r{i:03d}" for i in range(100)]
    env.configure({"tiny": hold_agent(env, 0, review=True, concurrency=8)}, max_jobs=8)
    for job_id in ids:
        env.drop(tiny_order(job_id))
    code, _lines = run_once(env)
    assert code == 0 and names(env.root / "review") == ids
    argv = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "approve", "-"]
    id_file = env.tmp / "ids.txt"
    id_file.write_text("\n".join(ids) + "\n")
    with id_file.open() as first, id_file.open() as second:
        procs = [
            subprocess.Popen(argv, stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=env.tmp, env=cli_env())
            for f in (first, second)
        ]  # fmt: skip
        outs = [p.communicate(timeout=120) for p in procs]
    for _out, err in outs:
        assert "Traceback" not in err, err
    approved = [line.split(":")[0] for out, _err in outs for line in out.splitlines()]
    lost = [line.split(":")[0] for _out, err in outs for line in err.splitlines()]
    assert sorted(approved) == ids, "each id approved by exactly one of the two"
    assert sorted(lost) == ids, "and refused by the other, one line each"
    errors = [line for _out, err in outs for line in err.splitlines()]
    # lost while the other decided: "was already approved"; came after it had landed: "is done, not waiting"
    assert all(line.endswith((": was already approved", ": is done, not waiting for review")) for line in errors)
    assert sorted(p.returncode for p in procs) in ([0, 1], [1, 1]), "a command that lost an id exits 1"
    assert names(env.root / "done") == ids and names(env.root / "review") == []


# A notify command that records its start and end (with the time) and takes a while.
NOTIFY = r"""#!/bin/sh
printf 'start %s %s %s\n' "$(date +%s.%N)" "$1" "$2" >> "$3"
sleep 2
printf 'end %s %s\n' "$(date +%s.%N)" "$2" >> "$3"
"""


def test_notifications_run_a_few_at_a_time_in_order_and_a_long_wait_is_summarised(env: Env) -> None:
    """300 failed jobs: at most 4 notify commands at once (the default), in order, the excess in one notify.dropped.

    The 4 commands take 2 events a second: the 300 jobs fail within 100 s even on a machine busy with a whole test
    run beside it, so more than 100 wait.
    """
    record = env.tmp / "notified.txt"
    script = write_script(env.tmp, "notify.sh", NOTIFY)
    failing = {"command": ["/bin/sh", "-c", "exit 1"], "timeout": 30, "writes": []}
    env.configure({"tiny": failing}, max_jobs=8, notify=["/bin/sh", str(script), "{event}", "{job_id}", str(record)])
    jobs = [f"n{i:03d}" for i in range(300)]
    for job_id in jobs:
        env.drop(tiny_order(job_id))
    d = env.daemon()
    d.wait_ready()
    dropped = d.wait_event("notify.dropped", timeout=120)
    assert dropped["job_id"] is None and dropped["agent"] is None, dropped  # a summary, about no one job

    def settled() -> bool:
        lines = record.read_text().splitlines() if record.exists() else []
        return sum(line.startswith("end ") for line in lines) == sum(line.startswith("start ") for line in lines) > 100

    wait_until(settled, 120, "the queued notifications to run")
    assert len(names(env.root / "failed")) == 300
    lines = [line.split() for line in record.read_text().splitlines()]
    starts = [(float(f[1]), f[2], f[3] if len(f) > 3 else "") for f in lines if f[0] == "start"]
    ends = [float(f[1]) for f in lines if f[0] == "end"]
    most = max(sum(1 for t, *_ in starts if t <= s) - sum(1 for e in ends if e <= s) for s, *_ in starts)
    assert most <= 4, f"{most} notify commands ran at once"
    failed_order = [e["job_id"] for e in d.events() if e["event"] == "job.failed"]
    notified = [job for _t, event, job in starts if event == "job.failed"]
    summaries = [s for s in starts if s[1] == "notify.dropped"]
    assert len(summaries) == 1, "one notification stands for every event dropped while over 100 waited"
    assert len(set(notified)) == len(notified) and len(notified) + dropped["count"] == 300
    where = [failed_order.index(job) for job in notified]
    # in order: 4 start together, so their own start lines may swap within that window
    assert all(where[i] < where[i + 4] for i in range(len(where) - 4)), "notifications run in the order of events"


@pytest.fixture
def own_pg() -> Iterator[PgServer]:
    """A PostgreSQL server of this test's own (it is stopped on purpose); fails, never skips, without one."""
    yield from running_pg_server()


def stopped_within(d: Daemon, sig: int, seconds: float) -> float:
    """Send sig to the daemon; return how long it took to exit (fail if longer than seconds)."""
    assert d.proc is not None
    t0 = time.monotonic()
    d.signal(sig)
    try:
        d.proc.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the daemon did not exit within {seconds} s of {signal.Signals(sig).name}") from None
    return time.monotonic() - t0


@pytest.mark.postgres
def test_sigterm_while_postgresql_is_down_is_answered_within_stop_timeout(env: Env, own_pg: PgServer) -> None:
    """PostgreSQL stops under running jobs: SIGTERM still ends the daemon within stop_timeout, the jobs are kept."""
    env.configure(
        {"tiny": hold_agent(env, 1, concurrency=2), "long": hold_agent(env, 60)},
        ledger=own_pg.dsn, stop_timeout=3, kill_grace=1, lease=6, watch="poll", max_jobs=4,
    )  # fmt: skip
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("pg1"))
    env.drop(tiny_order("pg2", to="long"))
    wait_until(lambda: len(env.starts()) == 2, what="the agents to start")
    own_pg.stop("immediate")
    env.drop(tiny_order("pg3"))  # its claim now waits for the database
    # pg1's agent ends during the outage: its finish waits for the database too
    wait_until(lambda: (env.root / "active" / "pg1" / "work" / "receipt.json").exists(), what="pg1's receipt")
    time.sleep(1.0)  # let the daemon's finish, claim and lease meet the outage
    took = stopped_within(d, signal.SIGTERM, 3 + 1 + 3)  # stop_timeout, kill_grace, a margin
    assert names(env.root / "active") == ["pg1", "pg2"], "unfinished jobs stay for recovery"
    assert "pg3.json" in names(env.root / "inbox"), "the order whose claim could not be made stays"
    gave_up = [e for e in d.events() if e["event"] in ("daemon.error", "job.crashed")]
    assert gave_up == [], "a wait given up for a stop is no error"
    errors = [e["event"] for e in d.events() if e.get("level") == "error" and e["event"] != "lease.fenced"]
    assert errors == [], errors  # nor any other error line ("Task exception was never retrieved")
    own_pg.start()
    again = env.daemon()  # the stopped daemon's lease runs out, then its jobs are recovered
    env.wait_job("pg1", "done", timeout=60)  # its receipt decides: done
    env.wait_job("pg3", "done", timeout=60)
    assert "interrupted" in env.wait_job("pg2", "failed", timeout=60)["reason"]
    assert again.stop() == 0
    print(f"stopped in {took:.1f} s")


@pytest.mark.postgres
def test_an_idle_daemon_with_a_long_lease_stops_at_once_while_postgresql_is_down(env: Env, own_pg: PgServer) -> None:
    """lease 30, nothing running, the server gone: SIGTERM ends the daemon within stop_timeout, exit 0."""
    env.configure({"tiny": hold_agent(env, 1)}, ledger=own_pg.dsn, lease=30, stop_timeout=5, kill_grace=1, watch="poll")
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("IDLE-1"))
    env.wait_job("IDLE-1", "done")
    own_pg.stop("fast")
    time.sleep(2.0)  # its gate and lease reads now wait for the database
    stopped_within(d, signal.SIGTERM, 5 + 1 + 5)
    assert d.proc is not None and d.proc.returncode == 0
    own_pg.start()


@pytest.mark.postgres
@pytest.mark.parametrize(("busy", "lease"), [(False, 6), (True, 6), (True, 30)])
def test_a_stop_is_answered_while_postgresql_is_silent(env: Env, own_pg: PgServer, busy: bool, lease: int) -> None:
    """The server's processes stopped (SIGSTOP: its kernel still answers TCP, no query returns): SIGTERM still
    ends the daemon within stop_timeout and a margin for a busy machine, exit 0, idle or with an agent running;
    the work is kept. With an agent running it took stop_timeout + 3 s: the lease's renewal, hung in a connect to
    the silent server, was waited for at the stop (2 s) and again at the ledger's close (1 s)."""
    env.configure(
        {"tiny": hold_agent(env, 1), "long": hold_agent(env, 60)},
        ledger=own_pg.dsn, lease=lease, stop_timeout=4, kill_grace=1, watch="poll", max_jobs=4,
    )  # fmt: skip
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("QUIET-1"))
    env.wait_job("QUIET-1", "done")
    if busy:
        env.drop(tiny_order("QUIET-2", to="long"))
        wait_until(lambda: len(env.starts()) == 2, what="the long agent to start")
    frozen = list(own_pg._processes())
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # its lease renewal and gate reads now hang in the server's silence
        took = stopped_within(d, signal.SIGTERM, 4 + 2.5)
        assert d.proc is not None and d.proc.returncode == 0
        print(f"stopped in {took:.1f} s")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    if busy:
        assert names(env.root / "active") == ["QUIET-2"], "the unfinished job stays for recovery"


@pytest.mark.postgres
def test_a_daemon_started_with_postgresql_down_can_be_stopped(env: Env, own_pg: PgServer) -> None:
    """Started while PostgreSQL is down, the daemon waits without spinning and SIGTERM (or SIGINT) ends it."""
    env.configure({"tiny": hold_agent(env, 0)}, ledger=own_pg.dsn, stop_timeout=3, watch="poll")
    own_pg.stop("fast")
    for sig in (signal.SIGTERM, signal.SIGINT):
        d = env.daemon()
        wait_until(lambda d=d: any(e["event"] == "ledger.reconnecting" for e in d.events()), what="the wait")
        assert d.proc is not None
        used = idle_cpu(d.proc.pid, 3.0)
        assert used < 1.0, f"waiting for the database used {used:.2f} s of CPU in 3 s"
        stopped_within(d, sig, 3 + 10)


@pytest.mark.postgres
def test_after_an_outage_past_half_a_lease_a_stopped_job_is_taken_back_once(env: Env, own_pg: PgServer) -> None:
    """PostgreSQL away past lease/2: the daemon fences itself, then runs its stopped jobs again, one copy each."""
    env.configure(
        {"safe": env.agent("--sleep", "30", retry_safe=True, max_attempts=3), "once": env.agent("--sleep", "30")},
        ledger=own_pg.dsn, lease=10, rescan_interval=2, retry_delay=1, kill_grace=1, watch="poll", max_jobs=4,
    )  # fmt: skip
    d = env.daemon()
    d.wait_ready()
    env.drop(order("OUT-1", to="safe"))
    env.drop(order("OUT-2", to="once"))
    wait_until(lambda: len(env.starts()) == 2, what="the agents to start")
    own_pg.stop("fast")
    time.sleep(7.0)  # past lease/2: the daemon fences itself and stops its jobs
    own_pg.start()
    wait_until(lambda: ("OUT-1", 2) in env.starts(), 60, "the retry-safe job to run again")
    time.sleep(8.0)  # four rescans: a second recovery of the same job would start another copy
    assert sorted(env.starts()) == [("OUT-1", 1), ("OUT-1", 2), ("OUT-2", 1)], env.starts()
    assert "lease.fenced" in {e["event"] for e in d.events()}
    assert "interrupted" in env.wait_job("OUT-2", "failed", timeout=30)["reason"]  # not retry-safe: not run again
    d.stop()


def test_every_state_filter_answers_503_while_the_ledger_is_out_of_reach(env: Env, own_pg: PgServer) -> None:
    """PostgreSQL stopped: `/api/jobs?state=review` (and the review page) answer 503, as `list --state review --json`
    exits 2, instead of rows read from the folders; the same filters answer again once the server is back."""
    env.configure({"reviewer": env.agent(review=True)}, ledger=own_pg.dsn)
    env.drop(order("REV-9", to="reviewer"))
    assert env.cli("run", "--once", timeout=60).returncode == 0
    web = start_web(env)
    try:
        assert [r["job_id"] for r in web.json("/api/jobs?state=review")] == ["REV-9"]
        own_pg.stop("immediate")
        for path in ("/api/jobs?state=review", "/api/jobs?state=failed", "/api/jobs?state=inbox"):
            assert web.get(path)[0] == 503, path
        assert env.cli("list", "--state", "review", "--json").returncode == 2
        own_pg.start()
        wait_until(lambda: web.get("/api/jobs?state=review")[0] == 200, 30, "the view back with the server")
    finally:
        web.stop()
