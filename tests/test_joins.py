"""Chains that join (contract section 16): `after`, `after_rule`, parents.json, cycles, max_wait, cancel.

Real daemons, real agents (the fake agent), real folders: a merger waits in
waiting/<job_id>/ until the jobs it names are final, then runs once with
work/parents.json; or fails with the reason the contract gives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FAKE_AGENT, Env, order, wait_until
from git_helpers import code_order, coder, git, make_repo
from helpers_faults import env_daemon, run_once_killed_at

from dispatcher.clock import iso, parse_iso

FAN = 20


def join_agents(env: Env) -> dict[str, dict[str, Any]]:
    """worker (does the job), bad (exits 1), merger (reads {parents} and logs it outside the root)."""
    log = str(env.tmp / "parents.log")
    return {
        "worker": env.agent(),
        "bad": env.agent("--exit", "1"),
        "merger": env.agent("--parents", "{parents}", "--parents-log", log),
    }


def parents_log(env: Env) -> list[tuple[str, list[dict[str, Any]]]]:
    """Return (job_id, parents.json) for every start of the merger agent."""
    path = env.tmp / "parents.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        job_id, _, data = line.partition(" ")
        out.append((job_id, json.loads(data)))
    return out


def fan(n: int = FAN, bad: str | None = None) -> list[dict[str, Any]]:
    """Return n worker orders w01..wNN; the one named ``bad`` goes to the failing agent."""
    return [order(f"w{i:02d}", to="bad" if f"w{i:02d}" == bad else "worker") for i in range(1, n + 1)]


def merger(job_id: str = "merge", after: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return order(job_id, to="merger", after=after or [f"w{i:02d}" for i in range(1, FAN + 1)], **extra)


def starts_of(env: Env, job_id: str) -> int:
    return sum(1 for j, _ in env.starts() if j == job_id)


def test_fan_out_all_done_fails_the_merger_when_one_worker_fails(env: Env) -> None:
    """A merger waiting for 20 workers (all_done) fails with `after: w07 failed` and never starts."""
    env.configure(join_agents(env), max_jobs=4)
    env.drop(merger())
    d = env.daemon()
    wait_until(lambda: (env.root / "waiting" / "merge" / "order.json").exists(), what="merge in waiting/")
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert status["counts"]["waiting"] == 1
    out = env.cli("list", "--state", "waiting", "--json", check=True).stdout
    listed = [json.loads(line) for line in out.splitlines()]
    assert [r["job_id"] for r in listed] == ["merge"]
    assert listed[0]["reason"] == "waiting for " + ", ".join(f"w{i:02d}" for i in range(1, FAN + 1)) + " (all_done)"
    text = env.cli("list", "--state", "waiting", check=True).stdout
    assert "waiting for w01, w02," in text and "w20 (all_done)" in text and "until -" not in text, text
    shown = env.cli("show", "merge", check=True).stdout
    assert "merge  waiting  agent merger" in shown and "  waiting for w01, w02," in shown and "w20 (all_done)" in shown
    for body in fan(bad="w07"):
        env.drop(body)
    result = env.wait_job("merge", "failed")
    assert result["reason"] == "after: w07 failed"
    assert starts_of(env, "merge") == 0
    for i in range(1, FAN + 1):
        env.wait_job(f"w{i:02d}", "failed" if i == 7 else "done")
    assert d.stop() == 0
    assert not (env.root / "waiting" / "merge").exists()


def test_fan_out_all_final_runs_the_merger_once_with_every_parent(env: Env) -> None:
    """A merger waiting for 20 workers (all_final) runs once when all are final; parents.json lists each."""
    env.configure(join_agents(env), max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    env.drop(merger(after_rule="all_final"))
    for body in fan(bad="w07"):
        env.drop(body)
    env.wait_job("merge", "done")
    assert starts_of(env, "merge") == 1
    [(job_id, parents)] = parents_log(env)
    assert job_id == "merge"
    assert [p["job_id"] for p in parents] == [f"w{i:02d}" for i in range(1, FAN + 1)]
    states = {p["job_id"]: p["state"] for p in parents}
    assert states.pop("w07") == "failed" and set(states.values()) == {"done"}
    for p in parents:
        assert Path(p["path"]).is_dir() and Path(p["result"]).name == "result.json"
        assert json.loads(Path(p["result"]).read_text())["job_id"] == p["job_id"]
    assert d.stop() == 0


def follow(job_id: str, to: str, **extra: Any) -> str:
    """Return a follow-up order (as the JSON text the planner writes into its outbox)."""
    body = {"job_id": job_id, "from": "planner", "to": to, "task": "Part of the plan.", "items": [{"id": "R1"}]}
    return json.dumps(body | {"accept": {"output": "out.csv"}} | extra)


def test_planner_fans_out_three_workers_and_a_merger_from_one_outbox(env: Env) -> None:
    """A planner's outbox holds 3 workers and a merger whose after names them; the merger runs last, once."""
    parts = ["p-w1", "p-w2", "p-w3"]
    flags = [f for p in parts for f in ("--followup", follow(p, "worker"))]
    flags += ["--followup", follow("p-merge", "merger", after=parts)]
    env.configure(join_agents(env) | {"planner": env.agent(*flags)}, max_jobs=3)
    d = env.daemon()
    env.drop(order("plan", to="planner"))
    result = env.wait_job("p-merge", "done")
    assert result["parent"] == "plan"
    assert env.result("plan", "done")["checks"][-1]["ok"] is True
    [(job_id, parents)] = parents_log(env)
    assert job_id == "p-merge" and [(p["job_id"], p["state"]) for p in parents] == [(p, "done") for p in parts]
    starts = [j for j, _ in env.starts()]
    assert starts.count("p-merge") == 1 and starts.index("p-merge") > max(starts.index(p) for p in parts)
    assert d.stop() == 0


def test_outbox_with_a_cycle_of_after_fails_followups_valid(env: Env) -> None:
    """Two follow-ups that wait for each other fail the planner's followups_valid check; none is released."""
    flags = ["--followup", follow("c-a", "worker", after=["c-b"]), "--followup", follow("c-b", "worker", after=["c-a"])]
    env.configure(join_agents(env) | {"planner": env.agent(*flags)})
    d = env.daemon()
    env.drop(order("cplan", to="planner"))
    result = env.wait_job("cplan", "failed")
    assert "after would make a cycle: c-a -> c-b -> c-a" in result["reason"]
    assert d.stop() == 0
    assert not (env.root / "waiting").exists() or not list((env.root / "waiting").iterdir())


def test_cycle_through_a_waiting_job_is_refused(env: Env) -> None:
    """`a` waits for `b`; an order `b` that waits for `a` closes a cycle and is refused; self-reference exits 2."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(order("a", to="merger", after=["b"]))
    wait_until(lambda: (env.root / "waiting" / "a").is_dir(), what="a in waiting/")
    env.drop(order("b", to="merger", after=["a"]))
    refused = env.wait_refused("b")
    assert refused["reason"] == "after: would make a cycle (b -> a -> b)"
    self_ref = env.tmp / "self.json"
    self_ref.write_text(json.dumps(order("s", after=["s"])))
    proc = env.cli("submit", str(self_ref))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{self_ref}: after: names the order's own job_id s (a cycle)"
    assert d.stop() == 0


def test_submit_refuses_an_after_that_closes_a_cycle(env: Env) -> None:
    """`submit` of an order whose `after` closes a cycle through a waiting job, or through another order of the
    same submit, exits 2 naming the file and the field, with the claim's words; nothing is dropped."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(order("wa", to="merger", after=["wb"]))
    wait_until(lambda: (env.root / "waiting" / "wa").is_dir(), what="wa in waiting/")
    closing = env.tmp / "wb.json"
    closing.write_text(json.dumps(order("wb", to="merger", after=["wa"])))
    proc = env.cli("submit", str(closing))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"{closing}: after: would make a cycle (wb -> wa -> wb)"
    first, second = env.tmp / "x1.json", env.tmp / "x2.json"
    first.write_text(json.dumps(order("x1", to="merger", after=["x2"])))
    second.write_text(json.dumps(order("x2", to="merger", after=["x1"])))
    proc = env.cli("submit", str(first), str(second))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr == f"{first}: after: would make a cycle (x1 -> x2 -> x1); nothing was submitted (2 files given)\n"
    )
    assert proc.stdout == ""
    assert sorted(p.name for p in (env.root / "inbox").iterdir()) == []
    assert d.stop() == 0


def test_submit_refuses_an_after_that_closes_a_cycle_through_queued_and_held_orders(env: Env) -> None:
    """No daemon runs: an order queued in inbox/ (or held in held/) waits from its claim on, so `submit` of one whose
    `after` closes a cycle through it, even over a longer chain, exits 2 with the claim's words; an `after` that
    names a queued order without closing a cycle is submitted."""
    env.configure(join_agents(env))

    def submit(job_id: str, after: list[str]) -> Any:
        path = env.tmp / f"{job_id}.json"
        path.write_text(json.dumps(order(job_id, to="merger", after=after)))
        return path, env.cli("submit", str(path))

    assert submit("ca", ["cb"])[1].returncode == 0
    path, proc = submit("cb", ["ca"])
    assert (proc.returncode, proc.stderr.strip()) == (2, f"{path}: after: would make a cycle (cb -> ca -> cb)")
    assert submit("ha", ["hm"])[1].returncode == 0
    assert submit("hm", ["hb"])[1].returncode == 0
    assert env.cli("hold", "ha").returncode == 0
    path, proc = submit("hb", ["ha"])
    assert (proc.returncode, proc.stderr.strip()) == (2, f"{path}: after: would make a cycle (hb -> ha -> hm -> hb)")
    assert submit("ok", ["ca", "hm"])[1].returncode == 0
    assert sorted(p.name for p in (env.root / "inbox").iterdir()) == ["ca.json", "hm.json", "ok.json"]


def test_submit_refuses_a_cycle_through_a_waiting_job_and_a_queued_order(env: Env) -> None:
    """X waits (claimed, in the ledger) for Y; Y is queued in inbox/ with `after: [N]` while no daemon runs: `submit`
    of N with `after: [X]` closes N -> X -> Y -> N and exits 2 with the claim's words."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(order("qx", to="merger", after=["qy"]))
    wait_until(lambda: (env.root / "waiting" / "qx").is_dir(), what="qx in waiting/")
    assert d.stop() == 0
    paths = {}
    for job_id, after in (("qy", ["qn"]), ("qn", ["qx"])):
        paths[job_id] = env.tmp / f"{job_id}.json"
        paths[job_id].write_text(json.dumps(order(job_id, to="merger", after=after)))
    assert env.cli("submit", str(paths["qy"])).returncode == 0
    proc = env.cli("submit", str(paths["qn"]))
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        f"{paths['qn']}: after: would make a cycle (qn -> qx -> qy -> qn)",
    )


def test_orders_that_wait_for_each_other_read_together_are_not_both_claimed(env: Env) -> None:
    """Three orders closing a cycle, all in inbox/ at start, are claimed in one batch: the last is refused.

    The earlier ones' waits are not in the ledger yet when the last is checked; without them
    all three would wait for each other for ever (max_wait never ends a wait for a known job).
    """
    env.configure(join_agents(env), max_wait=2)
    env.drop(order("ca", to="merger", after=["cc"]))
    env.drop(order("cb", to="merger", after=["ca"]))
    env.drop(order("cc", to="merger", after=["cb"]))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stderr  # a file was refused
    [refused] = env.refusals()
    result = json.loads((refused / "result.json").read_text())
    stem = refused.name.split("@")[0]
    assert result["reason"].startswith("after: would make a cycle (" + stem + " -> "), result["reason"]
    left = sorted(p.name for p in (env.root / "waiting").iterdir())
    assert stem not in left and len(left) == 2  # the other two wait, on the refused one: a daemon's max_wait ends that
    d = env.daemon()
    for job_id in left:
        env.wait_job(job_id, "failed")
    assert d.stop() == 0


@pytest.mark.parametrize("how", ["run --once", "run"])
def test_joins_whose_parent_ends_start_by_priority_not_by_id(env: Env, how: str) -> None:
    """Three joins wait on one parent, `max_jobs: 1`: when it ends they start by priority, the highest first (section
    16), not in the order of their ids (the first one joined took the slot before the others were queued)."""
    env.configure({"worker": env.agent(), "slow": env.agent("--sleep", "1.5")}, max_jobs=1)
    env.drop(order("PAR", to="slow"))
    for job_id, priority in (("J-A", 1), ("J-B", 5), ("J-C", 9)):
        env.drop(order(job_id, after=["PAR"], priority=priority))
    if how == "run":
        d = env.daemon()
        for job_id in ("J-A", "J-B", "J-C"):
            env.wait_job(job_id, "done")
        assert d.stop() == 0
    else:
        assert env.cli("run", "--once", timeout=120).returncode == 0
    assert [j for j, _a in env.starts()] == ["PAR", "J-C", "J-B", "J-A"]


def test_unknown_parent_is_waited_for_max_wait_then_fails(env: Env) -> None:
    """A merger naming an id no one knows fails with `after: ghost never finished` once max_wait ran out.

    At max_wait, not at the next rescan (a minute away here).
    """
    env.configure(join_agents(env), max_wait=2, rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    env.drop(merger(after=["w01", "ghost"]))
    env.drop(order("w01"))
    result = env.wait_job("merge", "failed", timeout=30)
    assert result["reason"] == "after: ghost never finished"
    assert starts_of(env, "merge") == 0
    waited = d.wait_event("job.failed", job_id="merge")["duration_s"]
    assert 2 <= waited < 10, waited
    assert d.stop() == 0


def test_a_retried_join_that_never_saw_its_parent_waits_max_wait_again_and_runs_once_it_comes(env: Env) -> None:
    """A join failed with `after: ghost never finished`, then `retry merge`: it waits again, max_wait counted from
    the retry (README: the join waits again), and runs once ghost is done. It failed again at once, within 4 ms,
    because its wait kept the first claim's time."""
    env.configure(join_agents(env), max_wait=3, rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    env.drop(merger(after=["ghost"]))
    assert env.wait_job("merge", "failed", timeout=30)["reason"] == "after: ghost never finished"
    env.cli("retry", "merge", check=True)
    wait_until((env.root / "waiting" / "merge").exists, 30, "the retried join to wait again")
    time.sleep(1.0)
    assert (env.root / "waiting" / "merge").exists(), "the retried join failed before max_wait"
    env.drop(order("ghost"))
    result = env.wait_job("merge", "done", timeout=30)
    assert starts_of(env, "merge") == 1 and result["state"] == "done"
    assert [(j, [(p["job_id"], p["state"]) for p in ps]) for j, ps in parents_log(env)] == [
        ("merge", [("ghost", "done")])
    ]
    assert d.stop() == 0


def test_show_of_a_waiting_join_says_what_it_waits_for_and_names_no_gate(env: Env) -> None:
    """`show` of a join in waiting/ says `waiting for A1 (all_done)`, as `list` does; no gate holds it."""
    env.configure(join_agents(env))
    d = env.daemon()
    d.wait_ready()
    env.drop(merger("W1", after=["A1"]))
    wait_until((env.root / "waiting" / "W1" / "order.json").exists, 30, "W1 in waiting/")
    shown = env.cli("show", "W1", check=True).stdout.splitlines()
    assert shown[:2] == ["W1  waiting  agent merger  hops 0", "  waiting for A1 (all_done)"], shown
    assert not [line for line in shown if "gate" in line or "until" in line], shown
    assert d.stop() == 0


def test_a_join_waiting_for_a_job_in_review_moves_on_when_a_person_decides(env: Env) -> None:
    """approve or reject ends the parent: the merger waiting for it runs (or fails) then, not at the next rescan."""
    agents = join_agents(env)
    agents["checked"] = env.agent(review=True)
    env.configure(agents, rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("R1", to="checked"))
    env.drop(order("R2", to="checked"))
    env.drop(merger("m1", after=["R1"]))
    env.drop(merger("m2", after=["R2"]))
    for job_id in ("R1", "R2"):
        wait_until((env.root / "review" / job_id / "result.json").exists, 30, f"{job_id} in review/")
    wait_until(lambda: (env.root / "waiting" / "m1").is_dir() and (env.root / "waiting" / "m2").is_dir(), 30, "joins")
    assert env.cli("approve", "R1").returncode == 0
    assert env.wait_job("m1", "done", timeout=15)["state"] == "done"
    assert env.cli("reject", "R2", "--reason", "no").returncode == 0
    assert env.wait_job("m2", "failed", timeout=15)["reason"] == "after: R2 failed"
    assert d.stop() == 0


def test_a_released_follow_up_that_was_refused_ends_the_wait_after_max_wait(env: Env) -> None:
    """planner hands off C (already expired); C is refused, so the merger waiting for C fails after max_wait."""
    agents = join_agents(env)
    child = order("C", to="worker", expires="2020-01-01T00:00:00Z")
    child["from"] = "planner"
    agents["planner"] = env.agent("--followup", json.dumps(child))
    env.configure(agents, max_wait=1, rescan_interval=0.5)
    d = env.daemon()
    env.drop(order("P", to="planner", accept={"output": "out.csv", "followups": ["worker"]}))
    env.drop(merger(after=["C"]))
    assert env.wait_refused("C")["reason"] == "expired"
    assert env.wait_job("merge", "failed")["reason"] == "after: C never finished"
    assert starts_of(env, "merge") == 0 and starts_of(env, "C") == 0
    assert d.stop() == 0


def test_a_parent_queued_in_inbox_is_waited_for_past_max_wait(env: Env) -> None:
    """A parent whose order sits in inbox/ (its agent paused) is known: the merger waits for it, then runs."""
    env.configure(join_agents(env), max_wait=1, rescan_interval=0.5)
    assert env.cli("pause", "worker").returncode == 0
    d = env.daemon()
    d.wait_ready()
    env.drop(merger(after=["w01"]))
    env.drop(order("w01"))
    time.sleep(3.0)  # max_wait three times over, with sweeps every 0.5 s
    assert (env.root / "waiting" / "merge").is_dir(), "the merger gave up on a parent that is queued"
    assert (env.root / "inbox" / "w01.json").exists()
    assert env.cli("resume", "worker").returncode == 0
    env.wait_job("w01", "done")
    assert env.wait_job("merge", "done")["state"] == "done"
    assert d.stop() == 0


def test_cancel_of_a_waiting_job(env: Env) -> None:
    """`cancel` of a waiting merger fails it with reason cancelled; it never runs, even when its parents finish."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(merger(after=["w01"]))
    wait_until(lambda: (env.root / "waiting" / "merge").is_dir(), what="merge in waiting/")
    assert env.cli("cancel", "merge").returncode == 0
    assert env.wait_job("merge", "failed")["reason"] == "cancelled"
    env.drop(order("w01"))
    env.wait_job("w01", "done")
    assert starts_of(env, "merge") == 0
    assert d.stop() == 0


def test_kill_9_while_the_merger_waits(env: Env) -> None:
    """A daemon killed while the merger waits: the next daemon runs it once, when its parents are done."""
    env.configure(join_agents(env))
    first = env.daemon()
    env.drop(merger(after=["w01", "w02", "w03"]))
    wait_until(lambda: (env.root / "waiting" / "merge" / "job.json").exists(), what="merge in waiting/")
    first.wait_event("job.waiting", job_id="merge")
    first.kill()
    for body in fan(3):
        env.drop(body)
    second = env.daemon()
    env.wait_job("merge", "done")
    assert starts_of(env, "merge") == 1
    assert second.stop() == 0


@pytest.mark.parametrize("fault", ["join.claimed", "join.taken", "join.parents", "join.moved"])
def test_kill_9_while_the_last_parent_finishes(env: Env, fault: str) -> None:
    """A daemon killed at each step between a wait and the merger's start: the merger runs exactly once."""
    env.configure(join_agents(env))
    first = env_daemon(env, {"DISPATCHER_FAULT": fault})
    if fault == "join.claimed":
        env.drop(merger(after=["w01"]))
    else:
        env.drop(merger(after=["w01", "w02"]))
        wait_until(lambda: (env.root / "waiting" / "merge" / "job.json").exists(), what="merge in waiting/")
        first.wait_event("job.waiting", job_id="merge")
        for body in fan(2):
            env.drop(body)
    assert first.proc is not None
    first.proc.wait(60)  # it died at the fault point
    for body in fan(2) if fault == "join.claimed" else []:
        env.drop(body)
    second = env.daemon()
    env.wait_job("merge", "done")
    for worker in ("w01", "w02"):  # with join.claimed the merger waits for w01 only: w02 may still be running
        env.wait_job(worker, "done")
    assert starts_of(env, "merge") == 1
    assert [starts_of(env, w) for w in ("w01", "w02")] == [1, 1]
    assert second.stop() == 0


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_waiting_jobs_cost_no_cpu_and_no_thread(env: Env) -> None:
    """50 waiting mergers add no thread to the daemon, and it stays near idle while they wait."""
    env.configure(join_agents(env), rescan_interval=30)
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    pid = d.proc.pid
    time.sleep(1)  # startup work done (wait_ready returned): let the pools settle
    before = _threads(pid)
    for i in range(50):
        env.drop(merger(f"m{i:02d}", after=["never"]))
    wait_until(lambda: len(list((env.root / "waiting").iterdir())) == 50, what="50 jobs in waiting/")
    time.sleep(1)
    ticks = _cpu_ticks(pid)
    time.sleep(5)
    used = (_cpu_ticks(pid) - ticks) / os.sysconf("SC_CLK_TCK")
    assert _threads(pid) <= before, f"threads: {before} before the waits, {_threads(pid)} with 50 waiting"
    assert used < 0.1, f"the daemon used {used:.2f} s of CPU in 5 s with 50 waiting jobs"
    assert d.stop() == 0


def test_cancel_tree_racing_the_workers(env: Env) -> None:
    """`cancel --tree` of a planner whose 6 follow-ups run, queue and wait: each ends cancelled once; show marks it."""
    parts = [f"t-w{i}" for i in range(1, 6)]
    flags = [f for p in parts for f in ("--followup", follow(p, "slow"))]
    flags += ["--followup", follow("t-merge", "merger", after=parts)]
    agents = join_agents(env) | {"planner": env.agent(*flags), "slow": env.agent("--sleep", "20", concurrency=5)}
    env.configure(agents, max_jobs=2, kill_grace=0.5)
    d = env.daemon()
    env.drop(order("tplan", to="planner"))
    wait_until(lambda: (env.root / "waiting" / "t-merge").is_dir(), what="t-merge in waiting/")
    wait_until(lambda: len(env.starts()) >= 3, what="two workers running")  # the planner and two of five
    proc = env.cli("cancel", "--tree", "tplan")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted(f"{j}: cancel requested" for j in [*parts, "t-merge"])
    for j in [*parts, "t-merge"]:
        assert env.wait_job(j, "failed")["reason"] == "cancelled"
    started = [j for j, _ in env.starts()]
    assert all(started.count(j) <= 1 for j in parts) and "t-merge" not in started
    tree = env.cli("show", "--tree", "t-w1", check=True).stdout
    assert "tplan [done]" in tree and "t-w1 [failed, cancelled]" in tree and "t-merge [failed, cancelled]" in tree
    again = env.cli("cancel", "--tree", "tplan")
    assert again.returncode == 1 and again.stderr == "tplan: it and its 6 descendants are finished; nothing to cancel\n"
    alone = env.cli("cancel", "--tree", "t-merge")  # a job with no descendant is named as one
    assert alone.returncode == 1 and alone.stderr == "t-merge: it is finished; nothing to cancel\n"
    assert d.stop() == 0


@pytest.mark.parametrize("rule", ["all_final", "all_done"])
def test_cancel_tree_cancels_the_joins_that_wait_for_the_job_and_theirs(env: Env, rule: str) -> None:
    """`cancel --tree A` of a running job also cancels the orders that wait for it in `after` (dropped from outside,
    no lineage), and a join of that join: each ends failed, cancelled, and no join's agent runs (with all_final,
    a cancelled parent would otherwise let it run)."""
    env.configure(join_agents(env) | {"slow": env.agent("--sleep", "30")}, kill_grace=0.5)
    d = env.daemon()
    env.drop(order("ta", to="slow"))
    wait_until(lambda: "ta" in [j for j, _ in env.starts()], what="ta's agent to start")
    env.drop(merger("tj", after=["ta"], after_rule=rule))
    env.drop(merger("tk", after=["tj"], after_rule=rule))
    wait_until(lambda: (env.root / "waiting" / "tk").is_dir() and (env.root / "waiting" / "tj").is_dir())
    proc = env.cli("cancel", "--tree", "ta")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert proc.stdout.splitlines() == ["ta: cancel requested", "tj: cancel requested", "tk: cancel requested"]
    for j in ("ta", "tj", "tk"):
        assert env.wait_job(j, "failed")["reason"] == "cancelled", j
    assert [j for j, _ in env.starts()] == ["ta"]  # no join's agent ran
    again = env.cli("cancel", "--tree", "ta")
    assert again.returncode == 1 and again.stderr == "ta: it and its 2 descendants are finished; nothing to cancel\n"
    assert d.stop() == 0


def test_cancel_tree_of_a_queued_order_cancels_the_joins_already_waiting_for_it(env: Env) -> None:
    """`cancel --tree A` of an order still queued (its `not_before` later; no ledger row yet) also cancels the joins
    already claimed and waiting for it, and a join of a join: all_final ones never run."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(order("qa", not_before="2099-01-01T00:00:00Z"))
    env.drop(merger("qj", after=["qa"], after_rule="all_final"))
    env.drop(merger("qk", after=["qj"], after_rule="all_final"))
    wait_until(lambda: (env.root / "waiting" / "qk").is_dir() and (env.root / "waiting" / "qj").is_dir())
    proc = env.cli("cancel", "--tree", "qa")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert proc.stdout.splitlines() == ["qa: cancel requested", "qj: cancel requested", "qk: cancel requested"]
    for j in ("qa", "qj", "qk"):
        assert env.wait_job(j, "failed")["reason"] == "cancelled", j
    assert env.starts() == []  # no agent ran
    unknown = env.cli("cancel", "--tree", "nope")
    assert unknown.returncode == 1 and unknown.stderr == "nope: no such job\n", unknown.stderr
    assert d.stop() == 0


def test_cancel_tree_cancels_the_joins_not_claimed_yet_in_inbox_and_held(env: Env) -> None:
    """With no daemon running, `cancel --tree A` of a queued order also cancels the joins still in inbox/ (no ledger
    row yet), a join of a join, and a join an operator put in held/: the next `run --once` fails each cancelled and
    runs no agent (an all_final join would otherwise run after its cancelled parent)."""
    env.configure(join_agents(env))
    env.drop(order("qa"))
    env.drop(merger("qj", after=["qa"], after_rule="all_final"))
    env.drop(merger("qk", after=["qj"], after_rule="all_final"))
    env.drop(merger("qh", after=["qa"], after_rule="all_final"))
    env.drop(merger("other", after=["elsewhere"], after_rule="all_final"))
    env.cli("hold", "qh", check=True)
    proc = env.cli("cancel", "--tree", "qa")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "qa: cancel requested"
    assert sorted(lines[1:]) == ["qh: cancel requested", "qj: cancel requested", "qk: cancel requested"]
    assert env.cli("run", "--once", timeout=120).returncode == 1  # failed jobs: exit 1
    for j in ("qa", "qj", "qk", "qh"):
        assert env.wait_job(j, "failed")["reason"] == "cancelled", j
    assert env.starts() == []  # no agent ran
    assert (env.root / "waiting" / "other").is_dir()  # a join of another job is left waiting


def test_cancel_tree_of_a_job_in_review_says_it_was_not_cancelled(env: Env) -> None:
    """`cancel --tree rv` of a job in review cancels the join waiting for it and says on stderr that rv itself, in
    review, was not cancelled (exit 0: the join was); again, with nothing left to cancel, that line is the error
    (exit 1), as `cancel rv` says. It printed only the join's line and never named the job."""
    env.configure(join_agents(env) | {"rev": env.agent(review=True)})
    d = env.daemon()
    env.drop(order("rv", to="rev"))
    env.drop(merger("rj", after=["rv"]))
    wait_until(lambda: (env.root / "review" / "rv" / "result.json").exists() and (env.root / "waiting" / "rj").is_dir())
    proc = env.cli("cancel", "--tree", "rv")
    assert proc.returncode == 0 and proc.stdout == "rj: cancel requested\n", proc.stdout + proc.stderr
    assert proc.stderr == "rv: in review, not cancelled: approve or reject it\n"
    assert env.wait_job("rj", "failed")["reason"] == "cancelled"
    again = env.cli("cancel", "--tree", "rv")
    assert (again.returncode, again.stdout) == (1, "")
    assert again.stderr == "rv: in review, not cancelled: approve or reject it\n"
    assert (env.root / "review" / "rv").is_dir()
    assert d.stop() == 0


def test_the_fan_out_example_runs(tmp_path: Path) -> None:
    """`bash examples/fanout/run.sh` exits 0: three researchers, then one merger that read all three."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "examples" / "fanout" / "run.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCHER_")}
    proc = subprocess.run(
        ["bash", str(script)],
        env=env | {"FANOUT_DIR": str(tmp_path / "fanout"), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "├── PLAN-001.merge [done] (merger, -)  <-" in proc.stdout
    assert "ok: the merger ran once, after its 3 parents" in proc.stdout


def test_a_waiting_job_survives_a_ledger_rebuild(env: Env) -> None:
    """`ledger rebuild` of a root with a waiting merger: the next daemon records its wait again and runs it once."""
    env.configure(join_agents(env))
    d = env.daemon()
    env.drop(merger(after=["w01"]))
    d.wait_event("job.waiting", job_id="merge")
    assert d.stop() == 0
    assert env.cli("ledger", "rebuild").returncode == 0
    again = env.daemon()
    again.wait_event("job.waiting", job_id="merge")
    env.drop(order("w01"))
    env.wait_job("merge", "done")
    assert starts_of(env, "merge") == 1
    assert again.stop() == 0


def test_retry_of_a_failed_join_waits_for_its_parents_again(env: Env) -> None:
    """A join failed by `after: w01 failed`, retried together with w01, waits for it again and runs once."""
    log = str(env.tmp / "parents.log")
    flaky = env.agent("--fail-attempts", "1", "--sleep", "0.5", max_attempts=1)
    env.configure({"worker": flaky, "merger": env.agent("--parents", "{parents}", "--parents-log", log)})
    d = env.daemon()
    env.drop(merger(after=["w01"]))
    env.drop(order("w01"))
    assert env.wait_job("merge", "failed")["reason"] == "after: w01 failed"
    assert env.cli("retry", "w01", "merge").returncode == 0
    wait_until(lambda: len([e for e in d.events() if e.get("event") == "job.waiting"]) == 2, what="a second wait")
    wait_until(lambda: (env.root / "done" / "merge" / "result.json").exists(), what="merge done")
    assert starts_of(env, "merge") == 1 and starts_of(env, "w01") == 2
    [(_, parents)] = parents_log(env)
    assert [(p["job_id"], p["state"]) for p in parents] == [("w01", "done")]
    assert d.stop() == 0


def test_run_once_exits_1_when_a_join_fails_at_once_in_it(env: Env) -> None:
    """w01 failed in an earlier run; a join on it dropped now fails at once (`after: w01 failed`): exit 1."""
    env.configure({"worker": env.agent("--exit", "1", max_attempts=1), "merger": env.agent()})
    env.drop(order("w01"))
    assert env.cli("run", "--once").returncode == 1
    env.drop(merger(after=["w01"]))
    assert env.cli("run", "--once").returncode == 1
    assert env.result("merge", "failed")["reason"] == "after: w01 failed"


def test_retry_or_revise_of_a_join_whose_parent_failed_is_done_with_a_note_and_it_fails_again(env: Env) -> None:
    """`after: w01 failed`: retry and revise of the join exit 0 (section 6) with a note on stderr; the join
    waits again and fails again at once, no agent run. Retried together with w01, no note."""
    env.configure({"worker": env.agent("--exit", "1", max_attempts=1), "merger": env.agent()})
    env.drop(merger(after=["w01"]))
    env.drop(order("w01"))
    assert env.cli("run", "--once").returncode == 1
    assert env.result("merge", "failed")["reason"] == "after: w01 failed"
    note = "merge: note: it waits for w01, which failed: it fails again at once unless w01 is retried too\n"
    for args, line in (
        (["retry", "merge"], "merge: retry requested\n"),
        (["revise", "merge", "--note", "run it anyway"], None),
    ):
        proc = env.cli(*args)
        assert proc.returncode == 0 and proc.stderr.endswith(note), proc.stderr
        assert line is None or proc.stdout == line
        assert env.cli("run", "--once").returncode == 1  # it failed again under this run: exit 1
        assert env.result("merge", "failed")["reason"] == "after: w01 failed"
    proc = env.cli("retry", "w01", "merge")
    assert proc.stdout == "w01: retry requested\nmerge: retry requested\n" and "note" not in proc.stderr
    assert starts_of(env, "merge") == 0


def test_the_web_views_retry_of_a_join_whose_parent_failed_answers_the_clis_note(env: Env) -> None:
    """The web view's retry (its JSON API's message) of a join failed with `after: w01 failed` carries the note the
    CLI prints on stderr; it answered only `merge: retry requested`."""
    from dispatcher.layout import Layout
    from dispatcher.spec.config import load_config
    from dispatcher.web.actions import Actions

    env.configure({"worker": env.agent("--exit", "1", max_attempts=1), "merger": env.agent()})
    env.drop(merger(after=["w01"]))
    env.drop(order("w01"))
    assert env.cli("run", "--once").returncode == 1
    config = load_config(env.config_path)
    outcome = Actions(config, Layout(config.root)).run("retry", "merge")
    assert (outcome.status, outcome.message) == (
        200,
        "merge: retry requested; note: it waits for w01, which failed: it fails again at once unless w01 is retried"
        " too",
    )


def test_retry_of_a_join_named_before_its_failed_parent_runs_both(env: Env) -> None:
    """`retry merge w01` works as `retry w01 merge` (section 7): w01 is handled first, no note, both done."""
    flaky = env.agent("--fail-attempts", "1", max_attempts=1)
    env.configure({"worker": flaky, "merger": env.agent()}, max_jobs=1)
    env.drop(merger(after=["w01"]))
    env.drop(order("w01"))
    assert env.cli("run", "--once").returncode == 1
    assert env.result("merge", "failed")["reason"] == "after: w01 failed"
    proc = env.cli("retry", "merge", "w01")
    assert proc.returncode == 0 and proc.stdout == "w01: retry requested\nmerge: retry requested\n"
    assert "note" not in proc.stderr, proc.stderr
    assert env.cli("run", "--once").returncode == 0
    env.result("w01", "done")
    env.result("merge", "done")
    assert starts_of(env, "merge") == 1 and starts_of(env, "w01") == 2


def test_a_join_is_claimed_at_once_even_when_every_slot_is_busy(env: Env) -> None:
    """With max_jobs 1 taken by a long job, a merger order (YAML) is still claimed into waiting/ at once."""
    agents = join_agents(env) | {"slow": env.agent("--sleep", "30")}  # busy for the whole test
    env.configure(agents, max_jobs=1, kill_grace=0.5, stop_timeout=1)
    d = env.daemon()
    env.drop(order("long", to="slow"))
    wait_until(lambda: env.starts(), what="the long job running")
    env.drop(merger(after=["long"]), name="merge.yaml")
    wait_until(lambda: (env.root / "waiting" / "merge").is_dir(), timeout=10, what="merge in waiting/")
    assert (env.root / "active" / "long").is_dir()
    assert d.stop() == 0


def test_a_join_for_a_paused_agent_is_claimed_at_once_and_waits_max_wait(env: Env) -> None:
    """Section 16: an order with `after` is claimed at once into waiting/, its agent paused or not.

    Its wait for an unknown parent then ends at max_wait, as any join's does; the agent
    stays paused and never starts.
    """
    env.configure(join_agents(env), max_wait=2)
    d = env.daemon()
    d.wait_ready()
    assert env.cli("pause", "merger").returncode == 0
    env.drop(merger(after=["ghost"]))
    wait_until(lambda: (env.root / "waiting" / "merge").is_dir(), timeout=10, what="merge in waiting/")
    assert not (env.root / "inbox" / "merge.json").exists()
    result = env.wait_job("merge", "failed", timeout=30)
    assert result["reason"] == "after: ghost never finished"
    assert starts_of(env, "merge") == 0
    assert d.stop() == 0


def test_a_joins_branch_starts_from_base_as_it_was_at_the_claim(env: Env, tmp_path: Path) -> None:
    """A join claimed into waiting/ while main is at A, then main moves to B before its parent is done: its branch is
    made from A (section 15: a new branch made from `base` at claim time)."""
    repo = make_repo(tmp_path / "shop")
    at_claim = git(repo, "rev-parse", "main")
    env.configure(agents={"slow": env.agent("--sleep", "3"), "coder": coder(env, repo, "--write", "src/{job}.txt=x")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BP", to="slow"))
    env.drop(code_order("BJ", after=["BP"]))
    wait_until(lambda: (env.root / "waiting" / "BJ").is_dir(), 30, "BJ waiting")
    (repo / "later.txt").write_text("moved on\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "later")
    assert git(repo, "rev-parse", "main") != at_claim
    result = env.wait_job("BJ", "done")
    assert result["workspace"]["base"] == at_claim
    assert git(repo, "merge-base", "dispatch/BJ", "main") == at_claim
    assert d.stop() == 0


def test_two_daemons_never_both_take_the_halves_of_an_after_cycle(env: Env) -> None:
    """A0 after B0 and B0 after A0, renamed in together under two daemons, ten pairs: no pair ends with both
    halves waiting for each other for good (section 16: an `after` that would make a cycle is refused). Each claim
    looked for a cycle before the other's wait was recorded; the one recorded later now sees it and fails. (The
    half that is not cut waits for its parent until max_wait, as for any parent refused.)"""
    env.configure(agents={"worker": env.agent()}, max_wait=600)
    daemons = [env.daemon(), env.daemon()]
    for d in daemons:
        d.wait_ready()
    stage = env.tmp / "stage"
    stage.mkdir()
    for i in range(10):
        for a, b in ((f"A{i}", f"B{i}"), (f"B{i}", f"A{i}")):
            (stage / f"{a}.json").write_text(json.dumps(order(a, after=[b])))
        os.rename(stage / f"A{i}.json", env.root / "inbox" / f"A{i}.json")
        os.rename(stage / f"B{i}.json", env.root / "inbox" / f"B{i}.json")
        time.sleep(0.3)

    def ends(job_id: str) -> list[str]:
        """Where the one file of job_id ended: its job folder's state, or `refused`."""
        found = [s for s in ("waiting", "active", "done", "failed") if (env.root / s / job_id).is_dir()]
        return found + ["refused" for p in (env.root / "failed").iterdir() if p.name.startswith(f"{job_id}@")]

    def decided() -> bool:
        inbox = [p for p in (env.root / "inbox").iterdir() if not p.name.startswith(".")]
        pairs = [(ends(f"A{i}"), ends(f"B{i}")) for i in range(10)]
        return not inbox and all(a and b and not (a == b == ["waiting"]) for a, b in pairs)

    wait_until(decided, 30, "each pair decided: no two halves waiting for each other")
    time.sleep(1.0)  # nothing changes its mind later
    for d in daemons:
        assert d.stop() == 0
    for i in range(10):
        a, b = ends(f"A{i}"), ends(f"B{i}")
        assert a and b and not (a == b == ["waiting"]), (i, a, b)
        reasons = {
            j: json.loads((env.root / "failed" / j / "result.json").read_text())["reason"]
            for j, e in ((f"A{i}", a), (f"B{i}", b))
            if "failed" in e
        }
        cut = [j for j, e in ((f"A{i}", a), (f"B{i}", b)) if "refused" in e or "cycle" in reasons.get(j, "")]
        assert cut, (i, a, b, reasons)


def test_a_ready_join_takes_its_place_by_priority_then_age(env: Env) -> None:
    """One slot: while the parent P runs, a join J (priority 9, after P), then orders M1..M4 (priority 0) and a join
    J0 (priority 0, after P) come. Once P is done and J has joined, J starts before every M still waiting, and J0
    after the M orders older than it: priority, then age, as for orders read from inbox/ (section 16)."""
    slow = env.agent("--sleep", "1.5")
    env.configure({"worker": {**slow, "concurrency": 1}}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("P"))
    d.wait_event("agent.started", job_id="P")
    env.drop(order("J", after=["P"], priority=9))
    time.sleep(0.3)
    for i in range(1, 5):
        env.drop(order(f"M{i}", priority=0))
        time.sleep(0.05)
    env.drop(order("J0", after=["P"], priority=0))
    for job_id in ("J", "J0", "M4"):
        env.wait_job(job_id, "done", timeout=60)
    started = [e["job_id"] for e in d.events() if e["event"] == "agent.started"]
    assert started[:2] == ["P", "J"], started  # P keeps its slot until it ends: J, joined then, takes it before M1
    assert started.index("J0") > started.index("M4"), started  # the M orders are older than J0
    assert d.stop() == 0


def slot_held(env: Env, d: Any, parent: str, busy: str, **extra: Any) -> None:
    """With one slot: run `parent` (worker) to done, then start `busy` on the slow agent, which keeps the slot."""
    env.drop(order(parent))
    env.wait_job(parent, "done")
    env.drop(order(busy, to="slow", **extra))
    d.wait_event("agent.started", job_id=busy)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_ready_join_keeps_its_place_by_priority_across_a_restart(env: Env, how: str) -> None:
    """One slot: P ends while B (priority 9) runs, so the join J0 (priority 0, after P) is ready and waits for the slot
    beside U9 (priority 9) in inbox/. The daemon is stopped (or killed) and started again: U9 still goes before J0.
    A job that never started an attempt is queued by priority and age like any order, not first as a recovered
    job whose agent a crash cut short is."""
    env.configure({"worker": env.agent(), "slow": env.agent("--sleep", "4")}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    slot_held(env, d, "P", "B", priority=9)
    env.drop(order("J0", after=["P"], priority=0))
    d.wait_event("job.joined", job_id="J0")
    env.drop(order("U9", priority=9))
    time.sleep(1)  # settled in inbox/: read once the slot is free (no line before)
    assert "U9" not in [j for j, _ in env.starts()]
    if how == "stop":
        assert d.stop() == 0  # B's agent runs to its end first
        assert env.wait_job("B", "done")
    else:
        d.kill()
    assert (env.root / "active" / "J0").is_dir()
    d2 = env.daemon()
    for job_id in ("U9", "J0"):
        env.wait_job(job_id, "done", timeout=60)
    env.wait_job("B", "done" if how == "stop" else "failed")  # killed: cut short, not retry_safe
    started = [j for j, _ in env.starts()]
    assert started.index("U9") < started.index("J0"), started
    assert started.count("J0") == 1 and started.count("U9") == 1, started
    assert d2.stop() == 0


def test_a_ready_join_waiting_for_a_slot_across_a_restart_fails_expired_at_its_expires(env: Env) -> None:
    """One slot: Y (slow, retry_safe) runs, and the join J (after P, done) waits for the slot with an expires 12 s
    away. The daemon is killed and started again: Y, cut short, runs again first; J, never started, still waits for
    the slot, and fails `expired` at its expires, its agent never started (section 16)."""
    slow = env.agent("--sleep", "60", retry_safe=True, max_attempts=2)
    env.configure({"worker": env.agent(), "slow": slow}, max_jobs=1, kill_grace=0.5)
    d = env.daemon()
    d.wait_ready()
    slot_held(env, d, "P", "Y")
    expires = time.time() + 12
    env.drop(order("J", after=["P"], expires=iso(expires)))
    d.wait_event("job.joined", job_id="J")
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("J", "failed", timeout=60)
    assert result["reason"] == "expired", result["reason"]
    failed = d2.wait_event("job.failed", job_id="J")
    at = parse_iso(failed["timestamp"])
    assert expires - 1 <= at <= expires + 6, (at, expires)
    assert "J" not in [j for j, _ in env.starts()]
    assert d2.stop(timeout=30) == 0


def test_a_join_waiting_at_start_runs_before_lower_priority_orders_when_its_parent_ends(env: Env) -> None:
    """`run --once`, one slot: G (priority 9), its join J (priority 9) and Q1..Q3 (priority 5) found at start. When G
    ends, J goes next: the slot G's agent frees is not given to Q1 before G's end readied J (section 16)."""
    slow = env.agent("--sleep", "1")
    env.configure({"worker": slow}, max_jobs=1)
    base = time.time() - 60
    bodies = [order("G", priority=9), order("J", after=["G"], priority=9)]
    bodies += [order(f"Q{i}", priority=5) for i in (1, 2, 3)]
    for i, body in enumerate(bodies):
        path = env.root / "inbox" / f"{body['job_id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body))
        os.utime(path, (base + i, base + i))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert [j for j, _ in env.starts()] == ["G", "J", "Q1", "Q2", "Q3"]


def test_a_ready_join_waits_behind_an_older_order_for_its_agents_concurrency_slot(env: Env) -> None:
    """Free slots under max_jobs, but the agent's `concurrency: 1` is taken by S: an order L (priority 9) then a join
    J whose parent is done already (priority 5) come while S runs. S's slot goes to L first: higher priority is
    claimed first, then older (section 16), as it is when max_jobs is the limit."""
    slow = env.agent("--sleep", "1.5")
    env.configure({"worker": {**slow, "concurrency": 1}, "quick": env.agent()}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("Q", to="quick"))
    env.wait_job("Q", "done")
    env.drop(order("S"))
    d.wait_event("agent.started", job_id="S")
    env.drop(order("L", priority=9))
    time.sleep(0.3)
    env.drop(order("J", after=["Q"]))
    d.wait_event("job.joined", job_id="J")
    time.sleep(0.2)
    env.drop(order("M"))
    for job_id in ("L", "J", "M"):
        env.wait_job(job_id, "done", timeout=60)
    started = [e["job_id"] for e in d.events() if e["event"] == "agent.started"]
    assert started == ["Q", "S", "L", "J", "M"], started
    assert d.stop() == 0


def test_parents_json_and_job_joined_keep_the_orders_after_order(env: Env) -> None:
    """`after: [w02, w01, w03]`: work/parents.json and job.joined name the parents in that order, as the order,
    `list` and `show` do (not sorted by id)."""
    env.configure(join_agents(env))
    d = env.daemon()
    d.wait_ready()
    env.drop(merger(after=["w02", "w01", "w03"]))
    for body in fan(3):
        env.drop(body)
    env.wait_job("merge", "done")
    [(_, parents)] = parents_log(env)
    assert [p["job_id"] for p in parents] == ["w02", "w01", "w03"]
    assert d.wait_event("job.joined", job_id="merge")["after"] == ["w02", "w01", "w03"]
    assert d.stop() == 0


def test_a_join_whose_ledger_rows_were_lost_runs_once_its_parents_are_done(env: Env) -> None:
    """A join in waiting/ whose claim and wait rows the ledger lost (a power cut before they were durable): the next
    daemon puts them back from its order, and the join runs once its parents are done, never waits for ever."""
    import sqlite3

    env.configure()
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LOST-J", after=["LOST-A"]))
    d.wait_event("job.waiting", job_id="LOST-J")
    assert d.stop() == 0
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3")
    with db:
        db.execute("DELETE FROM jobs WHERE job_id = 'LOST-J'")
        db.execute("DELETE FROM waits WHERE job_id = 'LOST-J'")
    db.close()
    d2 = env.daemon()
    d2.wait_ready()
    env.drop(order("LOST-A"))
    env.wait_job("LOST-A", "done")
    assert env.wait_job("LOST-J", "done", timeout=60)["state"] == "done"
    assert [j for j, _ in env.starts()].count("LOST-J") == 1
    assert d2.stop() == 0


def test_a_join_not_started_by_its_expires_fails_then_not_when_its_wait_ends(env: Env) -> None:
    """A join claimed at once waits for a parent that does not come; its `expires` passes: it fails `expired` at
    that time, with no attempt (section 16: an order not started by then), not a week later at `max_wait`."""
    from dispatcher.clock import iso

    env.configure()
    d = env.daemon()
    d.wait_ready()
    env.drop(order("EXP-J", after=["NEVER-1"], expires=iso(time.time() + 3)))
    d.wait_event("job.waiting", job_id="EXP-J")
    started = time.monotonic()
    result = env.wait_job("EXP-J", "failed", timeout=30)
    assert result["reason"] == "expired" and result["attempts"] == [], result
    assert time.monotonic() - started < 15
    assert env.starts() == []
    assert d.stop() == 0


def test_a_ready_join_waiting_for_a_slot_fails_at_its_expires(env: Env) -> None:
    """One slot, busy for 10 s: a join whose parent is done joins at once and waits for the slot; its `expires`
    comes 4 s later. It fails `expired` then, with no attempt, not when the slot frees (section 16)."""
    from dispatcher.clock import iso

    env.configure(agents={"worker": env.agent(), "slow": env.agent("--sleep", "10")}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    slot_held(env, d, "PL", "LONG")
    env.drop(order("EJ", after=["PL"], expires=iso(time.time() + 4)))  # time to be claimed and joined under load
    d.wait_event("job.joined", job_id="EJ")
    result = env.wait_job("EJ", "failed", timeout=30)
    assert result["reason"] == "expired" and result["attempts"] == [], result
    assert not (env.root / "done" / "LONG").exists(), "EJ failed only once the slot was free"
    assert [j for j, _ in env.starts()] == ["PL", "LONG"]
    env.wait_job("LONG", "done", timeout=60)
    assert d.stop() == 0


def test_a_retry_of_an_expired_join_waits_again_for_its_running_parent(env: Env) -> None:
    """A join failed `expired` while its parent still runs; `retry` of it (on the same daemon) waits for the
    parent again and then runs, as the README says a retry of such a job does (it failed `expired` again at once)."""
    from dispatcher.clock import iso

    env.configure(agents={"worker": env.agent(), "slow": env.agent("--sleep", "6")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SP", to="slow"))
    env.drop(order("JE", after=["SP"], expires=iso(time.time() + 1.5)))
    assert env.wait_job("JE", "failed", timeout=30)["reason"] == "expired"
    assert not (env.root / "done" / "SP").exists(), "the parent ended before the retry: nothing to show"
    env.cli("retry", "JE", check=True)
    wait_until(lambda: (env.root / "done" / "JE" / "result.json").exists(), 60, "JE done after its retry")
    assert (env.root / "done" / "SP").exists()
    assert [j for j, _ in env.starts()].count("JE") == 1
    assert d.stop() == 0


def test_joins_found_in_inbox_at_start_are_claimed_oldest_first(env: Env) -> None:
    """Join orders that arrived while no daemon ran are claimed oldest first (section 1), not in the folder's order."""
    env.configure()
    names = ["zeta", "alpha", "mike", "bravo", "yankee", "echo"]  # oldest first
    base = time.time() - 600
    for i, name in enumerate(names):
        path = env.root / "inbox" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(order(f"J-{name}", after=["NEVER-1"])))
        os.utime(path, (base + i, base + i))
    d = env.daemon()
    wait_until(lambda: sum(e.get("event") == "job.claimed" for e in d.events()) == len(names), 60, "every claim")
    claimed = [e["job_id"] for e in d.events() if e.get("event") == "job.claimed"]
    assert claimed == [f"J-{n}" for n in names]
    assert d.stop() == 0


def test_a_retried_join_is_listed_with_its_age_since_it_waits_again(env: Env) -> None:
    """`list`'s age of a join back in waiting/ after a retry counts from the retry, not from its first claim."""
    first_fails = env.tmp / "first_fails.py"
    first_fails.write_text(
        "import os, sys, time\n"
        "if os.environ['DISPATCH_ATTEMPT'] == '1':\n    sys.exit(1)\n"
        "time.sleep(10)\n"
        f"os.execv(sys.executable, [sys.executable, {str(FAKE_AGENT)!r}])\n"
    )
    env.configure(agents={"bad": {"command": [sys.executable, str(first_fails)], "timeout": 30}, "worker": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("P-AGE", to="bad"))
    env.drop(order("J-AGE", after=["P-AGE"]))
    env.wait_job("J-AGE", "failed")
    time.sleep(6)
    env.cli("retry", "P-AGE", "J-AGE", check=True)
    wait_until(lambda: (env.root / "waiting" / "J-AGE").exists(), 30, "J-AGE waiting again")
    rows = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]  # JSON lines
    [row] = [r for r in rows if r["job_id"] == "J-AGE"]
    assert row["state"] == "waiting" and row["age_s"] < 5, row
    assert d.stop() == 0


def test_a_join_whose_parent_ended_as_its_daemon_died_gets_the_parents_landed_folder(env: Env) -> None:
    """The daemon dies between the ledger's record of the parent's end and the move of its folder (fault point
    finish.recorded): the next daemon lands the parent in done/ before it runs the join, whose parents.json names
    done/W and its result.json. It named active/W, gone by then, with result null."""
    env.configure(join_agents(env))
    env.drop(order("W", to="worker"))
    env.drop(merger("J", after=["W"]))
    run_once_killed_at(env, "finish.recorded")
    assert (env.root / "active" / "W").is_dir() and (env.root / "waiting" / "J").is_dir()
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [(job_id, parents)] = parents_log(env)
    w = env.root / "done" / "W"
    assert (job_id, parents) == (
        "J",
        [{"job_id": "W", "state": "done", "path": str(w), "result": str(w / "result.json")}],
    )
    assert env.result("J", "done")["state"] == "done"


@pytest.mark.parametrize("running", [1, 4])
def test_a_failed_parents_notification_comes_before_its_joins(env: Env, running: int) -> None:
    """A fails; J (after: [A]) fails with it. Their job.failed notifications run in the order of the events, A's
    first (section 13: notifications beyond notify_max_running wait in order); J's ran first, as the join's end was
    queued inside A's commit, before A's own notification. Each notification writes its process id: with several
    running at once, the order they were started in is that of their ids, whichever writes first."""
    script = "import os, sys; open(sys.argv[1], 'a').write(' | '.join([str(os.getpid()), *sys.argv[2:]]) + '\\n')"
    notified = env.tmp / "notified.txt"
    notify = [sys.executable, "-c", script, str(notified), "{event}", "{job_id}", "{reason}"]
    env.configure(join_agents(env), notify=notify, notify_max_running=running)
    env.drop(order("A1", to="bad"))
    env.drop(merger("J1", after=["A1"]))
    assert env.cli("run", "--once", timeout=60).returncode == 1
    wait_until(lambda: notified.exists() and notified.read_text().count("\n") == 2, 20, "both notifications")
    lines = sorted(notified.read_text().splitlines(), key=lambda line: int(line.split(" | ")[0]))  # as started
    assert [line.split(" | ")[1:3] for line in lines] == [["job.failed", "A1"], ["job.failed", "J1"]], lines
    assert lines[1].endswith("after: A1 failed")
