"""A job gives its slot back when its agent exits: the next agent starts while it is checked, waits or finishes.

``max_jobs`` and an agent's ``concurrency`` count agents running at once (contract,
section 3). A job whose agent has exited, and which is being checked, finished or is
waiting out ``retry_delay``, runs no agent: the next order starts, and a further attempt
queues for a slot again. Never more agents at once than the limits allow.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

from conftest import Env, order
from helpers_faults import ts, wait_start


def intervals(results: list[dict[str, Any]]) -> list[tuple[float, float, str, int]]:
    """Return (started, ended, job_id, n) of every attempt in these result.json files, by start."""
    out = [(ts(a["started"]), ts(a["ended"]), r["job_id"], a["n"]) for r in results for a in r["attempts"]]
    return sorted(out)


def most_at_once(spans: list[tuple[float, float, str, int]]) -> int:
    """Return the largest number of attempts whose agents ran at the same moment."""
    edges = sorted(
        [(s, 1) for s, _e, _j, _n in spans] + [(e, -1) for _s, e, _j, _n in spans], key=lambda x: (x[0], x[1])
    )
    now = most = 0
    for _t, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_job_waiting_to_retry_leaves_max_jobs_to_the_next_order(env: Env) -> None:
    """max_jobs 1: while a failed job waits 3 s to retry, the next order runs and is done first."""
    env.configure(
        agents={
            "flaky": env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=2),
            "steady": env.agent(),
        },
        max_jobs=1,
        retry_delay=3,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SLOW-A", to="flaky"))
    wait_start(env, "SLOW-A", 1)
    env.drop(order("NEXT-B", to="steady"))
    b = env.wait_job("NEXT-B", "done", timeout=60)
    a = env.wait_job("SLOW-A", "done", timeout=60)
    assert [x["n"] for x in a["attempts"]] == [1, 2]
    assert ts(b["attempts"][0]["ended"]) < ts(a["attempts"][1]["started"])  # B ran inside A's wait
    assert ts(b["attempts"][0]["started"]) < ts(a["attempts"][0]["ended"]) + 3  # not after A's whole retry
    assert most_at_once(intervals([a, b])) == 1


def test_concurrency_one_holds_across_retries_of_two_jobs(env: Env) -> None:
    """concurrency 1, both jobs failing once: B's first attempt runs in A's wait, never two agents at once."""
    env.configure(
        agents={"worker": env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=2, concurrency=1)},
        max_jobs=4,
        retry_delay=2,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CONC-A"))
    wait_start(env, "CONC-A", 1)
    env.drop(order("CONC-B"))
    a = env.wait_job("CONC-A", "done", timeout=60)
    b = env.wait_job("CONC-B", "done", timeout=60)
    spans = intervals([a, b])
    assert [(j, n) for _s, _e, j, n in spans][:2] == [("CONC-A", 1), ("CONC-B", 1)]
    assert most_at_once(spans) == 1
    for (s1, e1, _j1, _n1), (s2, _e2, _j2, _n2) in itertools.pairwise(spans):
        assert s2 >= e1 > s1  # one agent of `worker` at a time, whatever the retries


def test_many_jobs_never_exceed_max_jobs_agents(env: Env) -> None:
    """30 short jobs with max_jobs 2: all done, at most 2 agents ran at any moment."""
    env.configure(agents={"worker": env.agent("--sleep", "0.05")}, max_jobs=2)
    d = env.daemon()
    d.wait_ready()
    ids = [f"MANY-{i:02d}" for i in range(30)]
    for job_id in ids:
        env.drop(order(job_id))
    results = [env.wait_job(job_id, "done", timeout=90) for job_id in ids]
    assert most_at_once(intervals(results)) <= 2


PROBE = """
import os, sys
said = []
for name in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{name}")
    except OSError:
        continue
    if "/slots/" in target:
        try:
            os.write(int(name), b"x")
            said.append("wrote")
        except OSError:
            said.append("refused")
open(sys.argv[1], "w").write(" ".join(said))
"""


def test_the_slot_lock_an_agent_inherits_cannot_be_written_through(env: Env) -> None:
    """The agent holds its slot's lock file open (the slot is held while it lives), read-only: a write through it
    is refused and the file stays empty. It was open read-write: an agent (a sandboxed one too) wrote into .state/."""
    said = env.tmp / "said.txt"
    env.configure(agents={"worker": {"command": [sys.executable, "-c", PROBE, str(said)], "timeout": 30}})
    env.drop(order("SL1"))
    env.cli("run", "--once", timeout=120)
    assert said.read_text() == "refused"
    assert all(p.stat().st_size == 0 for p in (env.root / ".state" / "slots").iterdir())
