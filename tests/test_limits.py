"""Usage limits, gates and waits (contract section 14) against a real daemon.

The agent is ``tests/agents/headless.py``, which prints, at a limit, exactly the
text the real CLIs print (quoted from their trackers: anthropics/claude-code
#9046 "Claude AI usage limit reached|1760000400", #12802 "5-hour limit reached
· resets 3pm (Europe/Stockholm)", openai/codex #3899 "You've hit your usage
limit. ... try again in 5 days 22 hours 11 minutes.") and otherwise does its job.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order, wait_until
from test_metrics import samples

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"


def headless(env: Env, plan: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """Return the headless stand-in as an agent, with its plan file written."""
    plan_file = env.tmp / "plan.json"
    plan_file.write_text(json.dumps(plan or {}))
    spec: dict[str, Any] = {
        "command": [sys.executable, str(HEADLESS), "--count", str(env.count_file), "--plan", str(plan_file)],
        "timeout": 30,
        "writes": ["out.csv"],
        "limits": [{"preset": "claude"}, {"preset": "codex"}, {"preset": "http429"}],
    }
    spec.update(settings)
    return spec


def claude_limit(until: float) -> dict[str, Any]:
    """What `claude -p --output-format json` prints at a usage limit (its final JSON, then exit 1)."""
    result = {
        "type": "result",
        "subtype": "success",
        "is_error": True,
        "duration_ms": 412,
        "num_turns": 1,
        "result": f"Claude AI usage limit reached|{int(until)}",
        "session_id": "0b6e4c5e-1f4a-4a57-9d2e-6c9d1f1c2a11",
        "total_cost_usd": 0,
    }
    return {"times": 1, "stdout": json.dumps(result), "exit": 1}


def events(d: Any, name: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in d.events() if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]


def status(env: Env) -> dict[str, Any]:
    return json.loads(env.cli("status", "--json", check=True).stdout)


def test_an_epoch_limit_waits_then_runs_again_without_spending_an_attempt(env: Env) -> None:
    """A Claude limit with an epoch a few seconds ahead: the job waits (shown), reruns at T, and is done."""
    until = int(time.time()) + 12  # room for the four commands below on a loaded machine, before T
    env.configure(agents={"worker": headless(env, {"limit": claude_limit(until)}, max_attempts=1)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LIM-1"))
    d.wait_event("job.waiting", job_id="LIM-1")
    info = status(env)
    assert info["counts"]["waiting"] == 1 and info["waiting"][0]["job_id"] == "LIM-1"
    assert [g["kind"] for g in info["gates"]] == ["limit"] and info["gates"][0]["agent"] == "worker"
    listed = [json.loads(x) for x in env.cli("list", "--state", "waiting", "--json", check=True).stdout.splitlines()]
    assert [r["job_id"] for r in listed] == ["LIM-1"] and listed[0]["until"].startswith(
        datetime.fromtimestamp(int(until), UTC).strftime("%Y-%m-%dT%H:%M:%S")
    )
    shown = json.loads(env.cli("show", "LIM-1", "--json", check=True).stdout)
    assert shown["state"] == "waiting" and shown["until"] == listed[0]["until"]
    assert "waiting" in env.cli("list", check=True).stdout
    result = env.wait_job("LIM-1", "done")
    assert time.time() >= until - 0.5
    first, second = result["attempts"]
    assert first["limited"]["text"] == f"Claude AI usage limit reached|{int(until)}"
    assert first["exit_code"] == 1 and second["exit_code"] == 0
    limited = events(d, "agent.limited", job_id="LIM-1")
    assert len(limited) == 1 and limited[0]["agent"] == "worker"
    assert len(events(d, "agent.gated", agent="worker")) == 1
    d.wait_event("agent.resumed", agent="worker")
    assert status(env)["counts"]["waiting"] == 0


@pytest.mark.parametrize("ended_by", ["timeout", "idle_timeout"])
def test_an_attempt_its_timeout_ended_is_timed_out_whatever_limit_its_output_names(env: Env, ended_by: str) -> None:
    """An agent prints a usage limit and hangs until its timeout (or idle_timeout) ends it: the limit did not end
    the attempt, so it is judged as timed out (it may have worked until then) and spent, not waited out."""
    until = int(time.time()) + 4
    limit = {"times": 1, "stdout": f"Claude AI usage limit reached|{until}", "exit": 1, "hang_s": 60}
    settings: dict[str, Any] = {"timeout": 2} if ended_by == "timeout" else {"idle_timeout": 2}
    env.configure(agents={"worker": headless(env, {"limit": limit}, max_attempts=1, **settings)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HANG-1"))
    result = env.wait_job("HANG-1", "failed", timeout=90)
    [first] = result["attempts"]
    assert first["timed_out"] is True and "limited" not in first, first
    assert result["reason"].startswith("exit_ok: timed out") and "not retried" in result["reason"], result["reason"]
    assert not events(d, "agent.limited", job_id="HANG-1")
    assert d.stop() == 0


def test_a_clock_limit_is_read_in_its_zone_and_resume_lifts_it(env: Env) -> None:
    """'5-hour limit reached ∙ resets 3pm (Europe/Stockholm)': until is the next 3 pm there; resume lifts it."""
    text = "5-hour limit reached ∙ resets 3pm (Europe/Stockholm) · /upgrade to Max 20x or turn on /extra-usage"
    env.configure(agents={"worker": headless(env, {"limit": {"times": 1, "stderr": text, "exit": 1}})})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CLOCK-1"))
    d.wait_event("job.waiting", job_id="CLOCK-1")
    until = datetime.fromisoformat(status(env)["waiting"][0]["until"].replace("Z", "+00:00"))
    local = until.astimezone(__import__("zoneinfo").ZoneInfo("Europe/Stockholm"))
    assert (local.hour, local.minute) == (15, 0) and 0 < until.timestamp() - time.time() <= 24 * 3600
    assert env.cli("resume", "worker", check=True).stdout.strip() == "worker: resumed (limit gate lifted)"
    env.wait_job("CLOCK-1", "done")
    assert env.cli("resume", "worker").returncode == 1  # nothing left to lift


@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("RETRY-AFTER", {"stderr": "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\n", "exit": 2}),
        (
            "CODEX",
            {
                "stderr": "■ You've hit your usage limit. Upgrade to Pro (https://openai.com/chatgpt/pricing)"
                " or try again in 3\nseconds.",
                "exit": 1,
            },
        ),
        (
            "CODEX-GO",  # the API prints a Go duration: 6m0s, 1h2m3s, here 0m3s
            {
                "stderr": "Rate limit reached for o3 in organization org-abc on requests per day (RPD): Limit 100,"
                " Used 100, Requested 1. Please try again in 0m3s.",
                "exit": 1,
            },
        ),
    ],
)
def test_retry_after_and_codex_limits_wait_their_seconds(env: Env, name: str, limit: dict[str, Any]) -> None:
    """An HTTP 429 with Retry-After: 3, Codex's "try again in 3 seconds", the API's "0m3s": a wait of 3 s, then done."""
    env.configure(agents={"worker": headless(env, {"limit": {"times": 1, **limit}})})
    d = env.daemon()
    d.wait_ready()
    env.drop(order(name))
    waited = d.wait_event("job.waiting", job_id=name)
    result = env.wait_job(name, "done")
    first = result["attempts"][0]
    assert first["limited"]["wait_s"] == pytest.approx(3, abs=0.5)
    assert waited["until"] == first["limited"]["until"]


def test_a_limit_is_lifted_at_its_time_not_at_the_next_rescan(env: Env) -> None:
    """A 2 s Retry-After with rescan_interval 30: the agent resumes and runs again about 2 s later."""
    limit = {"times": 1, "stderr": "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\n", "exit": 2}
    env.configure(agents={"worker": headless(env, {"limit": limit})}, rescan_interval=30)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SOON-1"))
    limited = d.wait_event("agent.limited", job_id="SOON-1")
    resumed = d.wait_event("agent.resumed", agent="worker", timeout=20)
    env.wait_job("SOON-1", "done")
    until = datetime.fromisoformat(limited["until"].replace("Z", "+00:00")).timestamp()
    lifted = datetime.fromisoformat(resumed["timestamp"].replace("Z", "+00:00")).timestamp()
    assert 0 <= lifted - until < 5, (limited, resumed)  # a lift at the next rescan came 27 s late


def test_two_jobs_meet_one_limit_and_the_agent_is_gated_once(env: Env) -> None:
    """Two jobs of one agent hit the limit at once: both wait for it, one gate, both done, no third start early."""
    until = int(time.time()) + 5
    plan = {"limit": {**claude_limit(until), "times": 2}, "busy_s": 0}
    env.configure(agents={"worker": headless(env, plan, concurrency=2)}, max_jobs=3)
    d = env.daemon()
    d.wait_ready()
    for job_id in ("TWO-1", "TWO-2"):
        env.drop(order(job_id))
    wait_until(lambda: len(events(d, "job.waiting")) == 2, what="both jobs waiting")
    env.drop(order("TWO-3"))  # a new job of the gated agent stays queued
    time.sleep(1.5)
    assert ("TWO-3", 1) not in env.starts()
    for job_id in ("TWO-1", "TWO-2", "TWO-3"):
        env.wait_job(job_id, "done")
    starts = env.starts()
    assert starts.count(("TWO-3", 1)) == 1 and len(starts) == 5
    assert len(events(d, "agent.limited")) == 2 and len(events(d, "agent.gated", agent="worker")) == 1


def test_the_wait_survives_a_restart(env: Env) -> None:
    """A daemon stopped during the wait: the next one keeps the gate, waits until T, then runs the job once."""
    until = int(time.time()) + 15  # two daemons start and one agent runs before it: room for a loaded machine
    env.configure(agents={"worker": headless(env, {"limit": claude_limit(until)})})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RESTART-1"))
    d.wait_event("job.waiting", job_id="RESTART-1")
    assert d.stop() == 0
    assert (env.root / "active" / "RESTART-1").is_dir()
    assert status(env)["gates"][0]["agent"] == "worker"
    d2 = env.daemon()
    d2.wait_ready()
    d2.wait_event("job.waiting", job_id="RESTART-1")
    result = env.wait_job("RESTART-1", "done")
    assert time.time() >= until - 0.5
    assert [a["n"] for a in result["attempts"]] == [1, 2] and env.starts() == [("RESTART-1", 1), ("RESTART-1", 2)]


@pytest.mark.parametrize(("bound", "shown"), [(10, "10"), (1_000_000, "1000000"), (2.5, "2.5")])
def test_a_limit_beyond_max_limit_wait_fails_the_job(env: Env, bound: float, shown: str) -> None:
    """A reset far away: the job fails at once with a reason that says so, naming max_limit_wait's N as the config
    has it (1000000 read `1e+06 s`)."""
    until = time.time() + 10 * max(bound, 3600)
    env.configure(agents={"worker": headless(env, {"limit": claude_limit(until)})}, max_limit_wait=bound)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FAR-1"))
    result = env.wait_job("FAR-1", "failed")
    assert result["reason"].startswith("limit: Claude AI usage limit reached|")
    assert result["reason"].endswith(f"is beyond max_limit_wait ({shown} s)"), result["reason"]


def test_a_retry_or_revise_of_a_job_failed_beyond_max_limit_wait_fails_at_once_while_the_gate_holds(env: Env) -> None:
    """A job failed at a limit 2 minutes away (max_limit_wait 30): `retry` and then `revise` while the agent's gate
    still holds fail it again at once with the same kind of reason; neither waits out the 2 minutes (the bound counts
    a job's waits from its first attempt)."""
    until = int(time.time() + 120)  # claude prints a whole epoch second
    env.configure(agents={"worker": headless(env, {"limit": claude_limit(until)})}, max_limit_wait=30)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FAR-2"))
    env.wait_job("FAR-2", "failed")
    for n, action in enumerate((["retry", "FAR-2"], ["revise", "FAR-2", "--note", "try again"]), start=2):
        assert env.cli(*action).returncode == 0
        wait_until(lambda n=n: len(events(d, "job.failed", job_id="FAR-2")) == n, 30, f"{action[0]} failed at once")
        result = env.result("FAR-2", "failed")
        assert result["reason"].startswith("limit: Claude AI usage limit reached|"), result["reason"]
        assert result["reason"].endswith("is beyond max_limit_wait (30 s)"), result["reason"]
    assert env.starts() == [("FAR-2", 1)]  # the agent never ran again
    assert d.stop() == 0


def test_max_limit_wait_counts_a_wait_resume_cut_short_as_it_was(env: Env) -> None:
    """Two limits of 6 s each, max_limit_wait 10: resume ends the first after about a second, so the job waits
    about 7 s in all and ends done (the two planned waits, 12 s, would have failed it)."""
    plan = {"limit": {"times": 2, "stderr": "rate limited, retry in 6 s", "exit": 1}}
    rule = {"match": r"retry in (\d+) s", "until": "seconds"}
    env.configure(agents={"worker": headless(env, plan, limits=[rule])}, max_limit_wait=10)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CUT-1"))
    d.wait_event("agent.gated", agent="worker")
    assert env.cli("resume", "worker").returncode == 0
    result = env.wait_job("CUT-1", "done", timeout=60)
    assert [a["n"] for a in result["attempts"]] == [1, 2, 3]
    assert [bool(a.get("limited")) for a in result["attempts"]] == [True, True, False]


def test_a_rule_anchored_at_the_end_matches_the_end_of_stdout(env: Env) -> None:
    """`in (.+)\\.$` on a stdout that ends `in 2 seconds.` and a newline: a limit, not a failure (each stream is
    matched on its own too, so `$` may sit at the end of stdout although stderr follows it)."""
    plan = {"limit": {"times": 1, "stdout": "rate limited, try again in 2 seconds.", "exit": 1}}
    env.configure(agents={"worker": headless(env, plan, limits=[{"match": r"in (.+)\.$", "until": "seconds"}])})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("END-1"))
    result = env.wait_job("END-1", "done", timeout=60)
    assert [bool(a.get("limited")) for a in result["attempts"]] == [True, False]


@pytest.mark.parametrize("wait", ["99999999999999999999", "1e400"])
def test_a_limit_too_far_to_name_fails_like_one_beyond_max_limit_wait(env: Env, wait: str) -> None:
    """`retry in 1e400 s`: the job fails with the limit's reason and its attempt recorded, not as a crash."""
    plan = {"limit": {"times": 1, "stderr": f"rate limited, retry in {wait} s", "exit": 1}}
    rule = {"match": r"retry in (\S+) s", "until": "seconds"}
    env.configure(agents={"worker": headless(env, plan, limits=[rule])}, max_limit_wait=10)
    env.drop(order("HUGE-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 1
    result = env.result("HUGE-1", "failed")
    assert result["reason"].startswith(f"limit: retry in {wait} s; waiting until 9999-12-31T23:59:59"), result["reason"]
    assert "max_limit_wait (10 s)" in result["reason"]
    assert [a["n"] for a in result["attempts"]] == [1]


def test_attempts_that_meet_a_limit_still_spend_the_budget(env: Env) -> None:
    """Each limited attempt reports 2 USD against max_cost_usd 1: the job fails at once, budget spent."""
    limit = claude_limit(time.time() + 300)  # far enough ahead on a loaded machine: never "already past"
    costly = json.loads(limit["stdout"]) | {"total_cost_usd": 2}
    limit = limit | {"stdout": json.dumps(costly), "times": 10}
    env.configure(agents={"worker": headless(env, {"limit": limit}, max_cost_usd=1, max_attempts=3)})
    env.drop(order("COST-1"))
    env.cli("run", "--once", timeout=60)
    result = env.result("COST-1", "failed")
    assert result["reason"].startswith("limit: Claude AI usage limit reached|"), result["reason"]
    assert "not retried: the budget is spent (2 USD of max_cost_usd 1)" in result["reason"], result["reason"]
    assert len(result["attempts"]) == 1 and result["cost_usd"] == 2


def test_pause_keeps_new_jobs_queued_and_resume_lets_them_run(env: Env) -> None:
    """`pause worker`: a new order stays in inbox/ and the gate shows in status; `resume worker`: it runs."""
    env.configure(agents={"worker": headless(env)}, metrics_file=str(env.tmp / "m.prom"))
    d = env.daemon()
    d.wait_ready()
    assert env.cli("pause", "worker", check=True).stdout.startswith("worker: paused")
    assert env.cli("pause", "nobody").returncode == 1
    wait_until(lambda: 'dispatcher_agent_gated{agent="worker"} 1.0' in _read(env.tmp / "m.prom"), what="gauge 1")
    env.drop(order("PAUSED-1"))
    time.sleep(1.5)
    info = status(env)
    assert info["counts"]["inbox"] == 1 and env.starts() == []
    assert info["gates"] == [{"agent": "worker", "kind": "pause", "until": None, "reason": "paused by hand"}]
    assert "gated    worker" in env.cli("status", check=True).stdout
    env.cli("resume", "worker", check=True)
    env.wait_job("PAUSED-1", "done")
    wait_until(lambda: 'dispatcher_agent_gated{agent="worker"} 0.0' in _read(env.tmp / "m.prom"), what="gauge 0")


def test_pause_holds_an_order_dropped_just_after_it_when_inbox_is_polled(env: Env) -> None:
    """`watch: poll` (no inotify, so no hint of the pause is heard): an order dropped the moment `pause` returns is
    not started (section 7: no new attempt of it starts); the gates are read in the claim's trip. 2 of 8 ran, the
    daemon claiming against a snapshot the pause had not reached."""
    env.configure(agents={"worker": headless(env), "other": headless(env)}, watch="poll", poll_interval=0.2)
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "other", check=True)  # a gate in force: the daemon reads its gates once a second, not faster
    for i in range(5):
        env.cli("pause", "worker", check=True)
        env.drop(order(f"POLLED-{i}"))
        time.sleep(1.3)  # several listings of inbox/, and a read of the gates
        assert env.starts() == [], i
        env.cli("cancel", f"POLLED-{i}", check=True)
        env.wait_job(f"POLLED-{i}", "failed")
        env.cli("resume", "worker", check=True)
    env.drop(order("POLLED-RUN"))
    env.wait_job("POLLED-RUN", "done")
    assert [j for j, _ in env.starts()] == ["POLLED-RUN"]
    assert d.stop() == 0


def test_run_once_leaves_the_orders_of_an_agent_paused_by_hand(env: Env) -> None:
    """`pause gated` then `run --once`: the other agent's job is done, the paused agent's order stays, exit 0."""
    env.configure(agents={"worker": headless(env), "gated": headless(env)})
    env.cli("pause", "gated", check=True)
    env.drop(order("FREE-1"))
    env.drop(order("PAUSED-2", to="gated"))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env.result("FREE-1", "done")
    assert (env.root / "inbox" / "PAUSED-2.json").exists() and env.starts() == [("FREE-1", 1)]


def test_an_order_whose_quoted_task_runs_over_a_line_like_to_a_paused_agent_runs_on_its_own_agent(env: Env) -> None:
    """A YAML order for `worker` whose double-quoted task continues on a line `to: gated"`: the order's `to` is
    worker (as `validate` says), so `pause gated` does not keep it; `run --once` runs it. It stayed in inbox/."""
    env.configure(agents={"worker": headless(env), "gated": headless(env)})
    env.cli("pause", "gated", check=True)
    body = b'job_id: QUOTED-1\nfrom: me\ntask: "first part\nto: gated"\nto: worker\nitems: [{id: R1}]\n'
    env.drop(body, name="quoted.yaml")
    assert env.cli("validate", str(env.root / "inbox" / "quoted.yaml")).returncode == 0
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert env.result("QUOTED-1", "done")["state"] == "done"
    assert env.starts() == [("QUOTED-1", 1)]


def test_a_paused_agent_taken_out_of_the_config_gets_its_orders_refused_and_resume_lifts_its_gate(env: Env) -> None:
    """`pause gated`, then a config without `gated`: its order names an agent the config does not define, so
    `run --once` refuses it (section 2) as `show` predicts, exit 1; `resume gated` still lifts the gate it kept."""
    env.configure(agents={"worker": headless(env), "gated": headless(env)})
    env.cli("pause", "gated", check=True)
    env.configure(agents={"worker": headless(env)})
    env.drop(order("GONE-1", to="gated"))
    assert "refused when a daemon reads it" in env.cli("show", "GONE-1", check=True).stdout
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    refused = env.wait_refused("GONE-1", timeout=5)
    assert "to:" in refused["reason"] and "gated" in refused["reason"], refused
    assert not (env.root / "inbox" / "GONE-1.json").exists() and env.starts() == []
    proc = env.cli("resume", "gated")
    assert proc.returncode == 0 and proc.stdout.strip() == "gated: resumed (pause gate lifted)", proc.stderr
    assert json.loads(env.cli("status", "--json", check=True).stdout)["gates"] == []
    proc = env.cli("resume", "gated")  # nothing left to lift: a name the config does not have
    assert proc.returncode == 1 and "gated: no such agent in" in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["retry", "revise"])
def test_run_once_leaves_a_retried_job_of_an_agent_paused_by_hand(env: Env, how: str) -> None:
    """A `retry` (or `revise`) of a job whose agent is paused: `run --once` claims it, sets it aside in active/
    and exits instead of waiting for a `resume` no one will give; after the resume it runs."""
    env.configure(agents={"worker": env.agent("--exit", "3")})
    env.drop(order("AGAIN-1"))
    assert env.cli("run", "--once", timeout=60).returncode == 1  # it failed
    env.cli("pause", "worker", check=True)
    env.cli(how, "AGAIN-1", *(("--note", "once more") if how == "revise" else ()), check=True)
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert (env.root / "active" / "AGAIN-1").is_dir() and env.starts() == [("AGAIN-1", 1)]
    env.cli("resume", "worker", check=True)
    assert env.cli("run", "--once", timeout=60).returncode == 1  # it ran, and failed again
    assert env.starts() == [("AGAIN-1", 1), ("AGAIN-1", 2)]
    assert [a["n"] for a in env.result("AGAIN-1", "failed")["attempts"]] == [1, 2]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_a_job_waiting_out_a_limit_is_listed_once_in_status_as_waiting(env: Env) -> None:
    """`status` counts a job a gate holds as waiting, as the `dispatcher_queue` gauge does; its text lists it once,
    in the jobs' table, saying it waits (and, once its daemon died, that too), and the JSON lists it once, among
    the waiting jobs with its owner, so that `active` holds as many jobs as `counts` says."""
    until = int(time.time()) + 30
    prom = env.tmp / "metrics.prom"
    env.configure(
        agents={"worker": headless(env, {"limit": claude_limit(until)}, max_attempts=1)}, metrics_file=str(prom)
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ONCE-1"))
    d.wait_event("job.waiting", job_id="ONCE-1")
    info = status(env)
    assert (info["counts"]["active"], info["counts"]["waiting"]) == (0, 1)

    def queue() -> tuple[float, float] | None:  # the metric counts it where status does (section 10, 14)
        got = samples(prom) if prom.exists() else {}
        pair = tuple(got.get(("dispatcher_queue", (("state", s),))) for s in ("active", "waiting"))
        return pair if pair == (0, 1) else None  # type: ignore[return-value]

    wait_until(queue, 20, "dispatcher_queue counting the job waiting, not active")
    assert [w["job_id"] for w in info["waiting"]] == ["ONCE-1"]
    assert [(a["job_id"], a["pid"], a["daemon_alive"]) for a in info["waiting"]] == [
        ("ONCE-1", d.proc.pid if d.proc else 0, True)
    ], info
    assert info["active"] == [] and len(info["active"]) == info["counts"]["active"]
    text = env.cli("status", check=True).stdout
    assert text.count("ONCE-1") == 1, text
    line = next(x for x in text.splitlines() if "ONCE-1" in x)
    assert "waiting for a gate until" in line and "daemon not running" not in line, line
    d.kill()  # its daemon dies while the job waits: flagged, as any active job's would be
    after = status(env)
    assert [(a["job_id"], a["daemon_alive"]) for a in after["waiting"]] == [("ONCE-1", False)], after
    line = next(x for x in env.cli("status", check=True).stdout.splitlines() if "ONCE-1" in x)
    assert "daemon not running" in line and "waiting for a gate" in line, line


LIMIT_THEN_WORK = """import os, subprocess, sys, time
job, attempt = os.environ["DISPATCH_JOB_ID"], os.environ["DISPATCH_ATTEMPT"]
plan = {"LONG-B": (1.0, 600), "SHORT-A": (0.0, 2)}
if attempt == "1" and job in plan:
    pause, ahead = plan[job]
    time.sleep(pause)
    print("Claude AI usage limit reached|%d" % int(time.time() + ahead))
    sys.exit(1)
sys.exit(subprocess.run(sys.argv[1:]).returncode)
"""


def test_a_job_held_past_max_limit_wait_by_a_limit_another_job_met_fails(env: Env) -> None:
    """max_limit_wait 8: A meets a limit 6 s away and waits; B meets one 600 s away a second later, which moves the
    agent's gate. B fails at once; A fails once its limit waits reach 8 s, with the reason saying so, instead of
    waiting the 600 s of B's limit (section 14: a job waits for usage limits at most max_limit_wait in all).
    A's 6 s leave B's limit time to come before A's own has passed on a loaded machine."""
    script = env.tmp / "limit_then_work.py"
    script.write_text(LIMIT_THEN_WORK.replace('"SHORT-A": (0.0, 2)', '"SHORT-A": (0.0, 6)'))
    work = env.agent()["command"]
    agent = {**env.agent(), "command": [sys.executable, str(script), *work], "limits": [{"preset": "claude"}]}
    env.configure(agents={"worker": {**agent, "concurrency": 2}}, max_limit_wait=8)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SHORT-A"))
    env.drop(order("LONG-B"))
    b = env.wait_job("LONG-B", "failed", timeout=30)
    assert "is beyond max_limit_wait (8 s)" in b["reason"], b["reason"]
    a = env.wait_job("SHORT-A", "failed", timeout=40)
    assert a["reason"].startswith("limit: Claude AI usage limit reached|") and "max_limit_wait (8 s)" in a["reason"]
    waited = d.wait_event("job.failed", job_id="SHORT-A")["duration_s"]
    assert 7 <= waited < 30, waited
    assert env.cli("status", "--json", check=True).stdout.count("SHORT-A") == 0  # no wait left behind
    assert d.stop() == 0


def test_a_job_whose_retry_meets_another_jobs_limit_past_max_limit_wait_keeps_its_checks(env: Env) -> None:
    """A fails its attempt 1 (exit 1) and waits for its retry; meanwhile B meets a limit 600 s away on the same agent.
    A's retry finds that gate beyond max_limit_wait and fails: its checks are attempt 1's, which ran, and its reason
    starts with the first failing one (section 5), then says the limit stopped the retry. None says "not run"."""
    script = env.tmp / "limit_then_work.py"
    script.write_text(LIMIT_THEN_WORK.replace('"LONG-B": (1.0, 600), "SHORT-A": (0.0, 2)', '"LONG-B": (0.0, 600)'))
    work = env.agent("--fail-attempts", "1")["command"]
    agent = {
        **env.agent(retry_safe=True, max_attempts=2),
        "command": [sys.executable, str(script), *work],
        "limits": [{"preset": "claude"}],
    }
    env.configure(agents={"worker": {**agent, "concurrency": 2}}, max_limit_wait=8, retry_delay=3)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RA-1"))
    env.drop(order("LONG-B"))
    a = env.wait_job("RA-1", "failed", timeout=60)
    assert a["reason"].startswith("exit_ok: exit 1 in "), a["reason"]
    assert "not retried: limit: Claude AI usage limit reached|" in a["reason"], a["reason"]
    checks = {c["name"]: c for c in a["checks"]}
    assert checks["exit_ok"]["ok"] is False and not [c for c in a["checks"] if c["detail"].startswith("not run")]
    # a person's retry while the gate still holds: it fails at once the same way, its lead and checks kept
    assert env.cli("retry", "RA-1").returncode == 0
    wait_until(lambda: len(events(d, "job.failed", job_id="RA-1")) == 2, 30, "the retry failed at the gate")
    # its line comes with the commit; the folder's move into failed/ right after it
    wait_until(lambda: (env.root / "failed" / "RA-1" / "result.json").exists(), 30, "RA-1 back in failed/")
    again = env.result("RA-1", "failed")
    assert again["reason"].startswith("exit_ok: exit 1 in "), again["reason"]
    assert "not retried: limit: Claude AI usage limit reached|" in again["reason"], again["reason"]
    assert {c["name"]: c["ok"] for c in again["checks"]}["exit_ok"] is False
    assert d.stop() == 0


def test_a_job_held_by_a_gate_another_limit_moved_later_shows_that_later_time(env: Env) -> None:
    """A meets a limit 2 s away and waits; B meets one 600 s away a second later, which moves the agent's gate. Once
    A's own time has passed, status, list and show give A's `until` as the gate's (when it will run), not its own
    time, which had passed (section 14: a job waits until the time its limit names, or a gate moved later). Then
    `resume` lifts the gate and both run: the commands have minutes between the two times, not 5 s, whatever the
    machine's load."""
    script = env.tmp / "limit_then_work.py"
    script.write_text(LIMIT_THEN_WORK)
    work = env.agent()["command"]
    agent = {**env.agent(), "command": [sys.executable, str(script), *work], "limits": [{"preset": "claude"}]}
    env.configure(agents={"worker": {**agent, "concurrency": 2}})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SHORT-A"))
    env.drop(order("LONG-B"))
    d.wait_event("job.waiting", job_id="LONG-B")
    own = d.wait_event("job.waiting", job_id="SHORT-A")["until"]
    gate = json.loads(env.cli("status", "--json", check=True).stdout)["gates"]
    [later] = [g["until"] for g in gate if g["agent"] == "worker"]
    assert later > own
    wait_until(lambda: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z" > own, 10, "A's own time")
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert [w["until"] for w in status["waiting"] if w["job_id"] == "SHORT-A"] == [later]
    shown = json.loads(env.cli("show", "SHORT-A", "--json", check=True).stdout)
    assert (shown["state"], shown["until"]) == ("waiting", later)
    listed = [
        json.loads(line) for line in env.cli("list", "--state", "waiting", "--json", check=True).stdout.splitlines()
    ]
    assert [r["until"] for r in listed if r["job_id"] == "SHORT-A"] == [later]
    env.cli("resume", "worker", check=True)
    env.wait_job("SHORT-A", "done", timeout=30)
    env.wait_job("LONG-B", "done", timeout=30)
    assert d.stop() == 0


TWO_WAITS = """import os, subprocess, sys, time
plan = {"Y1": (1.0, 40), "Y2": (2.0, 5)}
job = os.environ["DISPATCH_JOB_ID"]
if os.environ["DISPATCH_ATTEMPT"] == "1" and job in plan:
    pause, ahead = plan[job]
    time.sleep(pause)
    print("wait %d s" % ahead)
    sys.exit(1)
sys.exit(subprocess.run(sys.argv[1:]).returncode)
"""


def test_a_shorter_limit_met_later_leaves_the_gate_its_longer_limits_time_and_text(env: Env) -> None:
    """Y1 meets `wait 40 s`, then Y2 `wait 5 s` a second later: the agent's gate keeps Y1's time, and with it Y1's
    text, in `status` and `status --json`; Y2's job.waiting gives the time it waits for, the gate's, with its text
    (section 14: agent.limited, job.waiting; `status` prints a `gated` line)."""
    script = env.tmp / "two_waits.py"
    script.write_text(TWO_WAITS)
    work = env.agent()["command"]
    limits = [{"match": r"wait (\d+) s", "until": "seconds"}]
    agent = {**env.agent(), "command": [sys.executable, str(script), *work], "limits": limits, "concurrency": 3}
    env.configure(agents={"cc": agent}, max_jobs=3)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("Y1", to="cc"))
    env.drop(order("Y2", to="cc"))
    y1 = d.wait_event("agent.limited", job_id="Y1")
    assert y1["text"] == "wait 40 s"
    waiting = d.wait_event("job.waiting", job_id="Y2")
    assert (waiting["until"], waiting["reason"]) == (y1["until"], "wait 40 s"), waiting
    [gate] = [g for g in status(env)["gates"] if g["agent"] == "cc"]
    assert (gate["until"], gate["reason"]) == (y1["until"], "wait 40 s"), gate
    [line] = [x for x in env.cli("status", check=True).stdout.splitlines() if x.startswith("gated")]
    assert line.endswith(f"until {y1['until']}  wait 40 s"), line
    assert d.stop() == 0


LIMIT_THEN_FAIL = """
import os, sys, time
count = os.path.join(os.environ["STATE"], "starts")
n = len(open(count).read().split()) if os.path.exists(count) else 0
open(count, "a").write("x\\n")
if n == 0:  # its first run meets a usage limit 2 s ahead
    print("Claude AI usage limit reached|%d" % int(time.time() + 2))
sys.exit(1)  # later runs: a plain failure, retried after retry_delay, doubling
"""


def test_a_restart_during_a_limit_wait_leaves_the_retry_delays_doubling_from_retry_delay(env: Env) -> None:
    """A daemon stopped while a job waits at a usage limit: the attempt the limit gave back is no retry, so the
    next daemon's retries wait retry_delay, then twice that (as without the restart), not twice and four times."""
    state = env.tmp / "state"
    state.mkdir()
    agent = {"command": [sys.executable, "-c", LIMIT_THEN_FAIL], "env": {"STATE": str(state)}, "timeout": 30,
             "limits": [{"preset": "claude"}], "retry_safe": True, "max_attempts": 3}  # fmt: skip
    env.configure(agents={"worker": agent}, retry_delay=0.5)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BACKOFF-1"))
    d.wait_event("job.waiting", job_id="BACKOFF-1")
    assert d.stop() == 0
    d2 = env.daemon()
    result = env.wait_job("BACKOFF-1", "failed", timeout=60)
    assert [a["n"] for a in result["attempts"]] == [1, 2, 3, 4]  # the limited one did not count
    assert [e["delay_s"] for e in events(d2, "job.retrying", job_id="BACKOFF-1")] == [0.5, 1.0]
    assert d2.stop() == 0


LIMIT_LATE = """
import sys, time
time.sleep(1.5)
print("Claude AI usage limit reached|%d" % int(time.time() + 120))
sys.exit(1)
"""


def test_a_limit_met_while_the_daemon_stops_leaves_the_job_shown_waiting_with_its_until(env: Env) -> None:
    """SIGTERM while the agent runs; it ends at a usage limit within stop_timeout: the daemon exits 0 and the job
    is `waiting` with `until` in list, show and status (and job.waiting was logged), not `active`."""
    agent = {"command": [sys.executable, "-c", LIMIT_LATE], "timeout": 30, "limits": [{"preset": "claude"}]}
    env.configure(agents={"worker": agent}, stop_timeout=10)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LATE-1"))
    d.wait_event("agent.started", job_id="LATE-1")
    assert d.stop() == 0
    assert events(d, "agent.limited", job_id="LATE-1") and events(d, "job.waiting", job_id="LATE-1")
    (row,) = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert (row["job_id"], row["state"]) == ("LATE-1", "waiting") and row["until"], row
    shown = json.loads(env.cli("show", "LATE-1", "--json", check=True).stdout)
    assert (shown["state"], shown["until"]) == ("waiting", row["until"]), shown
    assert status(env)["counts"]["waiting"] == 1


LIMIT_FIRST = """
import os, sys, time
count = os.path.join(os.environ["STATE"], "starts")
n = len(open(count).read().split()) if os.path.exists(count) else 0
open(count, "a").write(os.environ["DISPATCH_JOB_ID"] + "\\n")
if n == 0:
    print("Claude AI usage limit reached|%d" % int(time.time() + 60))
    sys.exit(1)
"""


def test_a_gate_one_daemon_sets_holds_the_other_daemons_on_the_root_at_once(env: Env) -> None:
    """Two daemons on one root and its SQLite ledger: one meets a usage limit and gates the agent; orders dropped
    right after are claimed by neither, "no attempt of it starts on any host" (section 14), not even by the
    daemon whose snapshot of the gates has not been refreshed yet."""
    state = env.tmp / "state"
    state.mkdir()
    agent = {"command": [sys.executable, "-c", LIMIT_FIRST], "env": {"STATE": str(state)}, "timeout": 30,
             "limits": [{"preset": "claude"}]}  # fmt: skip
    env.configure(agents={"worker": agent})
    first, second = env.daemon(), env.daemon()
    first.wait_ready()
    second.wait_ready()
    env.drop(order("GATE-1"))
    wait_until(lambda: events(first, "agent.gated") or events(second, "agent.gated"), 30, "the gate")
    for i in range(6):
        env.drop(order(f"AFTER-{i}"))
    time.sleep(3)
    assert (state / "starts").read_text().split() == ["GATE-1"]
    assert first.stop() == 0 and second.stop() == 0
