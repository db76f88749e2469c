"""Several daemons on one root, duplicate ids in a race, and inbox events that never arrive.

Filesystem events are hints; the folder is the truth. These tests make the hints go
missing (no daemon running, an inotify burst, a file that appears without a move or a
close) or arrive early (a file still being written) and check the folders afterwards.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import Env, order, wait_until
from helpers_faults import (
    agent_starts,
    alive,
    assert_running,
    job_states,
    refusals,
    tiny_agent,
    tiny_order,
)


def settled(env: Env) -> int:
    """Count the finished jobs and refused files, once inbox/ and active/ are empty."""
    if any(
        not p.name.startswith(".")
        for state in ("inbox", "active")
        if (env.root / state).exists()
        for p in (env.root / state).iterdir()
    ):
        return 0
    return sum(
        1
        for state in ("done", "failed")
        if (env.root / state).exists()
        for p in (env.root / state).iterdir()
        if (p / "result.json").exists()
    )


def test_three_daemons_run_every_job_exactly_once(env: Env) -> None:
    """Three daemons on one root share 300 jobs: each runs exactly once and ends done."""
    n = 300
    env.configure(agents={"tiny": tiny_agent(env, concurrency=6)}, max_jobs=2, rescan_interval=1)
    for i in range(n // 2):
        env.drop(tiny_order(f"M{i:04d}"))
    daemons = [env.daemon() for _ in range(3)]
    for d in daemons:
        d.wait_ready()
    for i in range(n // 2, n):
        env.drop(tiny_order(f"M{i:04d}"))
    wait_until(lambda: assert_running(*daemons) or settled(env) >= n, 120, f"{n} files to end in done/ or failed/")
    for d in daemons:
        assert d.stop() == 0

    refused = [json.loads((p / "result.json").read_text())["reason"] for p in refusals(env.root)]
    assert refused == [], f"{len(refused)} single orders refused, e.g. {refused[:2]}"
    states = job_states(env.root)
    bad = [(j, s) for j, s in states.items() if s != ["done"]]
    assert not bad, bad[:5]
    assert len(states) == n
    started = Counter(j for j, _a, _p in agent_starts(env))
    assert set(started) == set(states)
    assert set(started.values()) == {1}, {j: c for j, c in started.items() if c != 1}
    # (which daemon took how many jobs is not part of the contract)


def test_same_job_id_dropped_together_gives_one_job_and_one_refusal(env: Env) -> None:
    """Two files with one job id, renamed in together under three daemons: one job, one refusal."""
    env.configure(agents={"tiny": tiny_agent(env, concurrency=6)}, max_jobs=2)
    daemons = [env.daemon() for _ in range(3)]
    for d in daemons:
        d.wait_ready()
    inbox = env.root / "inbox"
    pairs = [f"DUP-{i}" for i in range(8)]
    for job_id in pairs:
        body = json.dumps(tiny_order(job_id)).encode()
        (inbox / f".{job_id}-a.json.tmp").write_bytes(body)
        (inbox / f".{job_id}-b.json.tmp").write_bytes(body)
    for job_id in pairs:
        os.rename(inbox / f".{job_id}-a.json.tmp", inbox / f"{job_id}-a.json")
        os.rename(inbox / f".{job_id}-b.json.tmp", inbox / f"{job_id}-b.json")
    wait_until(
        lambda: assert_running(*daemons) or settled(env) >= 2 * len(pairs), 60, "every file to end in done/ or failed/"
    )
    refused = [json.loads((p / "result.json").read_text()) for p in refusals(env.root)]
    assert sorted(r["job_id"] for r in refused) == sorted(pairs), "not one refusal per pair"
    assert all(r["state"] == "failed" for r in refused)
    states = job_states(env.root)
    assert {j: states.get(j) for j in pairs} == {j: ["done"] for j in pairs}
    assert Counter(j for j, _a, _p in agent_starts(env)) == dict.fromkeys(pairs, 1)
    assert not [p for p in inbox.iterdir() if not p.name.startswith(".")]
    for d in daemons:
        assert d.stop() == 0


def test_files_dropped_while_no_daemon_runs_are_taken_oldest_first(env: Env) -> None:
    """Orders dropped while no daemon ran are all processed at start, oldest mtime first."""
    env.configure(max_jobs=1)
    base = time.time() - 600
    # (name, age order): names deliberately out of mtime order; B and C share an mtime
    plan = [("E", 0), ("A", 4), ("D", 1), ("C", 2), ("B", 2), ("F", 3)]
    for name, rank in plan:
        path = env.drop(order(f"OLD-{name}"))
        os.utime(path, (base + rank, base + rank))
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 0, proc.stderr
    claimed = []
    for line in proc.stdout.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "job.claimed":
            claimed.append(e["job_id"])
    assert claimed == ["OLD-E", "OLD-D", "OLD-B", "OLD-C", "OLD-F", "OLD-A"]
    assert all(s == ["done"] for s in job_states(env.root).values())


def test_file_appearing_without_move_or_close_event_is_found_by_rescan(env: Env) -> None:
    """A file hard-linked into inbox/ (inotify: IN_CREATE only) is taken by the settle rule.

    What is lost: a hard link creates the name in inbox/ without IN_MOVED_TO and without
    IN_CLOSE_WRITE (the file was written and closed elsewhere), so the daemon never sees
    the event that says "complete". The rescan (every rescan_interval) finds the file,
    sees its size and mtime unchanged for `settle` seconds and takes it.
    """
    env.configure(settle=0.5, rescan_interval=1)
    d = env.daemon()
    d.wait_ready()
    outside = env.tmp / "outside"
    outside.mkdir()
    old = time.time() - 120
    for i in range(5):
        src = outside / f"LINK-{i}.json"
        src.write_text(json.dumps(order(f"LINK-{i}")))
        os.utime(src, (old, old))
        os.link(src, env.root / "inbox" / src.name)
        os.unlink(src)
    for i in range(5):
        env.wait_job(f"LINK-{i}", "done", timeout=30)
    assert refusals(env.root) == []
    assert d.stop() == 0


def test_burst_of_2000_renames_ends_with_every_job_done(env: Env) -> None:
    """A burst of 2000 renames (inotify queue may overflow) still ends with every job done."""
    n = 2000
    env.configure(agents={"tiny": tiny_agent(env, concurrency=4)}, max_jobs=4, rescan_interval=1)
    d = env.daemon()
    d.wait_ready()
    inbox = env.root / "inbox"
    for i in range(n):
        (inbox / f".B{i:05d}.json.tmp").write_text(json.dumps(tiny_order(f"B{i:05d}")))
    for i in range(n):
        os.rename(inbox / f".B{i:05d}.json.tmp", inbox / f"B{i:05d}.json")
    wait_until(lambda: assert_running(d) or settled(env) >= n, 200, f"{n} files to end in done/ or failed/")
    assert d.stop() == 0
    states = job_states(env.root)
    assert len(states) == n
    assert all(s == ["done"] for s in states.values())
    assert set(Counter(j for j, _a, _p in agent_starts(env)).values()) == {1}


def _untouched_while_open(env: Env, path: Path, seconds: float) -> None:
    """An observation window while a writer holds path open: the daemon neither takes it nor refuses it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert path.exists(), "the daemon took a file its writer still had open"
        assert refusals(env.root) == [], "a half-written order was refused"
        time.sleep(0.05)


def test_file_still_being_written_is_not_taken_by_the_rescan(env: Env) -> None:
    """A file written in place and held open past settle and rescan is taken once, whole.

    The writer creates the final name in inbox/, writes half an order, then pauses with
    the file open for longer than `settle` (1 s) and `rescan_interval` (0.5 s): the size
    and mtime are stable, but no close was seen, so the file is not complete yet.
    """
    env.configure(settle=1, rescan_interval=0.5)
    d = env.daemon()
    d.wait_ready()
    data = json.dumps(order("HALF-1"), indent=2).encode()
    path = env.root / "inbox" / "HALF-1.json"
    with path.open("wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        _untouched_while_open(env, path, 3.5)
        f.write(data[len(data) // 2 :])
    env.wait_job("HALF-1", "done")
    assert refusals(env.root) == []
    assert (env.root / "done" / "HALF-1" / "order.json").read_bytes() == data
    assert [j for j, _a, _p in agent_starts(env)] == ["HALF-1"]
    assert d.stop() == 0


def test_a_file_held_open_since_before_the_start_is_not_taken_half_written(env: Env) -> None:
    """A writer opens HALF-2.json in inbox/ with no daemon running, writes half an order and keeps it open; the
    daemon starts once the file is older than `settle`: found by the start's listing, not by an event, it waits
    for its writer as a file that settles under the watch does, and runs once, whole. It was taken at once, by
    its age (refused half-written here; a valid half ran without the rest)."""
    env.configure(settle=0.5, rescan_interval=0.5)
    data = json.dumps(order("HALF-2"), indent=2).encode()
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    path = inbox / "HALF-2.json"
    with path.open("wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        time.sleep(1.0)  # older than settle before the daemon looks
        d = env.daemon()
        d.wait_ready()
        _untouched_while_open(env, path, 2.5)
        f.write(data[len(data) // 2 :])
    env.wait_job("HALF-2", "done")
    assert refusals(env.root) == []
    assert (env.root / "done" / "HALF-2" / "order.json").read_bytes() == data
    assert d.stop() == 0


def test_a_file_written_again_in_place_just_after_its_first_write_loses_neither_order(env: Env) -> None:
    """Two writers write one inbox name one after the other (`cp a inbox/X.json; cp b inbox/X.json`): each
    closed write runs as its own job (or the second replaced the first before any claim), a job's order.json
    is the bytes it ran, and no order vanishes."""
    env.configure(rescan_interval=1)
    d = env.daemon()
    d.wait_ready()
    inbox = env.root / "inbox"
    rounds = 12
    for n in range(rounds):
        (inbox / f"CP{n}.json").write_bytes(json.dumps(order(f"CP{n}-a")).encode())
        time.sleep(0.002)
        (inbox / f"CP{n}.json").write_bytes(json.dumps(order(f"CP{n}-b")).encode())
        time.sleep(0.3)
    for n in range(rounds):
        env.wait_job(f"CP{n}-b", "done")  # the second write is never lost
    wait_until(lambda: not any(inbox.iterdir()), what="an empty inbox/")
    assert refusals(env.root) == []
    for folder in (env.root / "done").iterdir():
        kept = json.loads((folder / "order.json").read_text())["job_id"]
        assert kept == folder.name, f"done/{folder.name}/order.json holds {kept}"
    assert d.stop() == 0


@pytest.mark.slow
def test_three_daemons_with_kills_never_run_a_job_twice(env: Env) -> None:
    """Three daemons, one of them kill -9ed and replaced 12 times: no job runs twice, all end."""
    n = 240
    env.configure(
        agents={"tiny": tiny_agent(env, concurrency=6, max_attempts=3)},
        max_jobs=2,
        settle=0.2,
        rescan_interval=0.5,
        kill_grace=0.5,
    )
    rng = random.Random(4)
    daemons = [env.daemon() for _ in range(3)]
    ids = [f"K{i:04d}" for i in range(n)]
    for k in range(12):
        for job_id in ids[k * 20 : (k + 1) * 20]:
            env.drop(tiny_order(job_id))
        # the fault schedule: a random moment, then one daemon dies and is replaced
        time.sleep(rng.uniform(0.2, 0.6))
        victim = rng.randrange(3)
        assert_running(*[d for i, d in enumerate(daemons) if i != victim])
        daemons[victim].kill()
        daemons[victim] = env.daemon()
    for d in daemons:
        d.wait_ready()
    wait_until(lambda: assert_running(*daemons) or settled(env) >= n, 120, f"{n} jobs to end")
    for d in daemons:
        assert d.stop() == 0

    refused = [json.loads((p / "result.json").read_text())["reason"] for p in refusals(env.root)]
    assert refused == [], refused[:2]
    states = job_states(env.root)
    assert set(states) == set(ids)
    assert all(s in (["done"], ["failed"]) for s in states.values())
    started = Counter(j for j, _a, _p in agent_starts(env))
    assert not {j: c for j, c in started.items() if c > 1}, "a not-retry-safe job ran twice"
    for job_id, (state,) in states.items():
        if state == "failed":
            reason = json.loads((env.root / "failed" / job_id / "result.json").read_text())["reason"]
            assert "retr" in reason.lower(), reason


def test_a_killed_daemons_agent_keeps_its_slot_until_it_is_ended(env: Env) -> None:
    """`concurrency: 1` over the whole root (section 3): daemon A is killed while its agent runs; daemon B does not
    start a second copy of that agent beside the one A left running (its slot stays taken while it lives), and
    starts the queued job once the orphan has been ended (section 6)."""
    env.configure(
        agents={"one": env.agent("--sleep", "60", concurrency=1)}, max_jobs=2, rescan_interval=2, kill_grace=1
    )
    a, b = env.daemon(), env.daemon()
    a.wait_ready()
    b.wait_ready()
    env.drop(order("SLOT-1", to="one"))
    wait_until(lambda: [j for j, _ in env.starts()] == ["SLOT-1"], 30, "the first agent to start")
    env.drop(order("SLOT-2", to="one"))
    time.sleep(1.0)  # SLOT-2 is claimed or read, and waits for the one slot
    assert [j for j, _ in env.starts()] == ["SLOT-1"]
    first_pid = int(env.count_file.read_text().split()[2])
    owner = json.loads(env.cli("status", "--json", check=True).stdout)["active"]
    [row] = [r for r in owner if r["job_id"] == "SLOT-1"]
    killed, survivor = (a, b) if a.proc is not None and row["pid"] == a.proc.pid else (b, a)
    killed.kill()
    wait_until(lambda: "SLOT-2" in [j for j, _ in env.starts()], 60, "the queued job to start on the survivor")
    assert not alive(first_pid), "a second copy started beside the dead daemon's agent"
    assert any(e.get("event") == "agent.orphan_ended" for e in survivor.events())
    assert survivor.stop() == 0


TIMED_AGENT = r"""#!/bin/sh
printf '%s %s %s\n' "$DISPATCH_JOB_ID" "$DISPATCH_ATTEMPT" "$$" >> "$1"
case "$DISPATCH_JOB_ID" in Q*) sleep 0.05 ;; *) sleep 2 ;; esac
printf '{"job_id": "%s", "input_ids": ["R1"], "output_ids": [], "status": "done", "outputs": []}' \
  "$DISPATCH_JOB_ID" > .receipt.tmp
mv .receipt.tmp receipt.json
"""


def test_claims_made_ahead_stay_within_the_agents_concurrency_on_each_daemon(env: Env) -> None:
    """README (claims made ahead): at most the agent's concurrency is claimed ahead by a daemon. Three daemons share
    a concurrency-1 agent whose runs were quick: a daemon whose claimed-ahead job found the one slot held by
    another daemon did not count it any more, and claimed more ahead behind it (3 where 1 is the bound)."""
    script = env.tmp / "timed.sh"
    script.write_text(TIMED_AGENT)
    agent = {"command": ["/bin/sh", str(script), str(env.count_file)], "timeout": 30, "writes": [".receipt.tmp"]}
    env.configure(agents={"b": agent | {"concurrency": 1}}, max_jobs=2, settle=1, rescan_interval=5)
    daemons = [env.daemon() for _ in range(3)]
    for d in daemons:
        d.wait_ready()
    for i in range(4):  # quick runs first: the daemons that ran them claim that agent's next orders ahead
        env.drop(tiny_order(f"Q{i}", to="b"))
    time.sleep(3)
    for i in range(1, 9):
        env.drop(tiny_order(f"BQ{i}", to="b"))
    pids = {d.proc.pid for d in daemons if d.proc is not None}
    worst = 0
    before: set[tuple[int, str]] = set()
    for _ in range(30):
        time.sleep(0.25)
        active = json.loads(env.cli("status", "--json", check=True).stdout)["active"]
        now = {
            (r["pid"], r["job_id"])
            for r in active
            if r["pid"] in pids and not (env.root / "active" / r["job_id"] / "attempts" / "1").exists()
        }
        # claimed and not started in two looks in a row: waiting for a slot (one claimed just now starts at once)
        held = Counter(pid for pid, _ in now & before)
        worst = max(worst, *held.values(), 0)
        before = now
    assert worst <= 1, f"a daemon held {worst} jobs claimed ahead of a concurrency-1 agent"
    for d in daemons:
        assert d.stop() == 0
