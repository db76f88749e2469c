"""The operator's actions on job ids (contract 7): hold, release, retry and cancel, several ids or `-`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, Env, cli_env, order, wait_until
from helpers_faults import env_daemon

from dispatcher.layout import Layout
from dispatcher.ledger.base import ClaimRequest
from dispatcher.lifecycle import Row
from dispatcher.spec.config import load_config
from dispatcher.store.ledgers import open_ledger


def cli_input(env: Env, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher --config CFG ARGS` with stdin."""
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env(),
    )


def run_once(env: Env) -> int:
    return env.cli("run", "--once", timeout=120).returncode


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stderr_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_held_order_is_never_claimed_until_released(env: Env) -> None:
    """`hold` moves a queued order into held/ where `run --once` leaves it; `release` puts it back and it runs."""
    log_file = env.tmp / "dispatcher.log"
    env.configure(log_file=str(log_file))
    env.drop(order("HOLD-1"))
    proc = env.cli("hold", "HOLD-1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "HOLD-1: held (held/HOLD-1.json)"
    assert sorted(os.listdir(env.root / "held")) == ["HOLD-1.json"]
    assert not (env.root / "inbox" / "HOLD-1.json").exists()
    assert run_once(env) == 0
    assert not (env.root / "done" / "HOLD-1").exists() and env.starts() == []
    assert (env.root / "held" / "HOLD-1.json").exists()

    proc = env.cli("release", "HOLD-1")
    assert proc.returncode == 0 and proc.stdout.strip() == "HOLD-1: released into inbox/", proc.stderr
    assert os.listdir(env.root / "held") == []
    assert run_once(env) == 0
    env.wait_job("HOLD-1", "done")
    got = [(e["event"], e["job_id"], e["agent"]) for e in events(log_file) if e["event"].startswith("job.")]
    assert ("job.held", "HOLD-1", "worker") in got and ("job.released", "HOLD-1", "worker") in got, got
    assert got.index(("job.held", "HOLD-1", "worker")) < got.index(("job.released", "HOLD-1", "worker"))


def test_a_copy_of_a_held_order_dropped_into_inbox_is_refused_and_the_held_one_still_runs(env: Env) -> None:
    """A held id is known, to the daemon as to `submit`: a copy dropped by hand is refused (one job per id), and
    the held order stays releasable and runs once released."""
    env.configure()
    env.drop(order("HOLD-2"))
    env.cli("hold", "HOLD-2", check=True)
    copy = env.root / "inbox" / "copy-of-hold-2.json"
    copy.write_bytes((env.root / "held" / "HOLD-2.json").read_bytes())
    assert run_once(env) == 1  # a refused file
    (refused,) = [p for p in (env.root / "failed").iterdir() if p.name.startswith("copy-of-hold-2@")]
    result = json.loads((refused / "result.json").read_text())
    assert result["reason"] == "job_id: HOLD-2 is already known (held in held/); a job id is never run twice"
    assert (refused / "order.json").read_bytes() == (env.root / "held" / "HOLD-2.json").read_bytes()
    assert env.starts() == [] and not (env.root / "done" / "HOLD-2").exists()
    env.cli("release", "HOLD-2", check=True)
    assert run_once(env) == 0
    env.wait_job("HOLD-2", "done")
    assert env.starts() == [("HOLD-2", 1)]


def test_a_hold_cut_between_its_two_steps_leaves_the_order_held_and_refuses_nothing(env: Env) -> None:
    """`hold` links the order into held/, then unlinks its inbox name; a crash between the two leaves one file under
    both names. The daemon finishes the hold (the inbox name goes): no refusal, no run, the order stays held."""
    env.configure()
    queued = env.drop(order("HALF-1"))
    (env.root / "held").mkdir(exist_ok=True)
    os.link(queued, env.root / "held" / "HALF-1.json")  # the hold's first step, as the crash left it
    assert run_once(env) == 0
    assert not queued.exists() and (env.root / "held" / "HALF-1.json").exists()
    assert env.refusals() == [] and env.starts() == []
    env.cli("release", "HALF-1", check=True)
    assert run_once(env) == 0
    env.wait_job("HALF-1", "done")


@pytest.mark.parametrize("then", ["release", "hold"])
def test_a_command_after_a_hold_cut_short_finishes_the_move_instead_of_naming_a_second_file(
    env: Env, then: str
) -> None:
    """A hold killed between its link and its unlink leaves one file under two names. A `release` (or a second
    `hold`) then finishes the move: one name is left, never `X-2.json` beside it, so nothing is refused later."""
    env.configure()
    queued = env.drop(order("HALF-2"))
    held = env.root / "held" / "HALF-2.json"
    held.parent.mkdir(exist_ok=True)
    os.link(queued, held)  # the hold's first step, as the kill left it
    env.cli(then, "HALF-2", check=True)
    inbox_names = sorted(p.name for p in (env.root / "inbox").iterdir())
    held_names = sorted(p.name for p in held.parent.iterdir())
    if then == "release":
        assert inbox_names == ["HALF-2.json"] and held_names == []
    else:
        assert inbox_names == [] and held_names == ["HALF-2.json"]
        env.cli("release", "HALF-2", check=True)
    assert os.lstat(env.root / "inbox" / "HALF-2.json").st_nlink == 1
    assert run_once(env) == 0
    env.wait_job("HALF-2", "done")
    assert env.refusals() == []


@pytest.mark.parametrize("with_file", [False, True])
def test_an_operators_actions_reach_the_daemons_log_with_or_without_log_file(env: Env, with_file: bool) -> None:
    """hold and release: each event once on the running daemon's stdout (the journal), and once in
    log_file when one is set (the command writes it there, the daemon does not again)."""
    log_file = env.tmp / "dispatcher.log"
    slow = env.agent("--sleep", "30")
    env.configure(
        agents={"worker": slow},
        max_jobs=1,
        log_file=str(log_file) if with_file else None,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BUSY"))
    wait_until(lambda: ("BUSY", 1) in env.starts(), 30, "BUSY to start")
    env.drop(order("Q1"))
    env.cli("hold", "Q1", check=True)
    env.cli("release", "Q1", check=True)
    wanted = [("job.held", "Q1"), ("job.released", "Q1")]
    seen = lambda: [(e["event"], e.get("job_id")) for e in d.events() if e["event"] in ("job.held", "job.released")]  # noqa: E731
    wait_until(lambda: seen() == wanted, 30, "the actions on the daemon's stdout")
    time.sleep(1.0)
    assert seen() == wanted  # once each
    if with_file:
        in_file = [
            (e["event"], e.get("job_id")) for e in events(log_file) if e["event"] in ("job.held", "job.released")
        ]
        assert in_file == wanted
    assert d.stop() == 0


def test_hold_of_ids_not_queued_fails_for_each_and_still_holds_the_others(env: Env) -> None:
    """`hold` of unknown, finished and queued ids holds the queued ones; one stderr line per other id; exit 1."""
    env.drop(order("FIN-1"))
    assert run_once(env) == 0
    env.drop(order("Q-1"))
    env.drop(order("Q-2"))
    proc = env.cli("hold", "Q-1", "NOPE", "FIN-1", "Q-2")
    assert proc.returncode == 1, proc.stderr
    errors = stderr_lines(proc)
    assert len(errors) == 2 and errors[0].startswith("NOPE: ") and errors[1].startswith("FIN-1: "), errors
    assert "done" in errors[1]
    assert sorted(os.listdir(env.root / "held")) == ["Q-1.json", "Q-2.json"]
    again = env.cli("hold", "Q-1")
    assert again.returncode == 1 and "held" in again.stderr, again.stderr


def test_hold_of_an_order_with_a_cancel_asked_is_refused_and_the_cancel_holds(env: Env) -> None:
    """`cancel` accepted (exit 0), then `hold` of the same queued order: refused (exit 1, one line), so the cancel
    is carried out as promised (section 6: failed/ with reason cancelled), not dropped while the order sits in held/
    to run after a `release`."""
    env.drop(order("CX-1"))
    env.cli("cancel", "CX-1", check=True)
    proc = env.cli("hold", "CX-1")
    assert proc.returncode == 1 and stderr_lines(proc) == [
        "CX-1: a cancel was asked for it; it fails with reason cancelled"
    ], proc.stderr
    assert not (env.root / "held" / "CX-1.json").exists()
    assert run_once(env) == 1
    assert env.result("CX-1", "failed")["reason"] == "cancelled"


def test_cancel_of_an_order_held_by_hand_fails_it_cancelled_as_for_a_held_follow_up(env: Env) -> None:
    """`cancel` of an order an operator put in held/ is a cancel of a queued job (exit 0): its file goes back to
    inbox/ and the next daemon fails it with reason cancelled, byte for byte kept, no agent run; it said "release
    it first" and exited 1, where a held follow-up was cancelled."""
    body = order("HX-1")
    env.drop(body)
    env.cli("hold", "HX-1", check=True)
    proc = env.cli("cancel", "HX-1")
    assert (proc.returncode, proc.stdout.strip()) == (0, "HX-1: cancel requested"), proc.stderr
    assert not (env.root / "held" / "HX-1.json").exists()
    assert run_once(env) == 1
    result = env.result("HX-1", "failed")
    assert result["reason"] == "cancelled" and result["attempts"] == []
    assert json.loads((env.job_dir("HX-1", "failed") / "order.json").read_text()) == body
    assert not env.count_file.exists()


def test_release_of_an_order_that_is_not_held_exits_1(env: Env) -> None:
    """`release` of a queued (not held) order, an unknown id or a path instead of an id fails with one line each."""
    env.drop(order("Q-3"))
    proc = env.cli("release", "Q-3", "NOPE")
    assert proc.returncode == 1
    errors = stderr_lines(proc)
    assert [e.split(":")[0] for e in errors] == ["Q-3", "NOPE"], errors
    assert "not held" in errors[0], errors
    odd = env.cli("release", "../inbox/Q-3")
    assert (
        odd.returncode == 1
        and odd.stderr == "../inbox/Q-3: not a job id (letters, digits, '.', '_', '-'; at most 128)\n"
    )
    assert (env.root / "inbox" / "Q-3.json").exists()


def test_release_of_a_done_job_with_nothing_held_says_it_is_not_held(env: Env) -> None:
    """`release` of a finished job: exit 1, "is done, not held"; no word of a held order when none is there."""
    env.drop(order("FIN-1"))
    assert env.cli("run", "--once").returncode == 0
    proc = env.cli("release", "FIN-1")
    assert proc.returncode == 1
    assert proc.stderr == "FIN-1: is done, not held\n"


def test_ids_are_read_from_stdin_with_a_dash(env: Env) -> None:
    """`hold -` and `release -` take one id a line from stdin (blank lines skipped)."""
    for job_id in ("S-1", "S-2", "S-3"):
        env.drop(order(job_id))
    proc = cli_input(env, "S-1\n\nS-3\n", "hold", "-")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(env.root / "held")) == ["S-1.json", "S-3.json"]
    proc = cli_input(env, "S-3\nS-1\n", "release", "-")
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(env.root / "held") == []


def test_retry_of_several_ids_from_stdin_retries_the_failed_ones(env: Env) -> None:
    """`retry -` retries each failed id read from stdin; an unknown one is one stderr line and exit 1."""
    env.configure(agents={"worker": env.agent("--fail-attempts", "1")})
    env.drop(order("R-1"))
    env.drop(order("R-2"))
    assert run_once(env) == 1
    proc = cli_input(env, "R-1\nNOPE\nR-2\n", "retry", "-")
    assert proc.returncode == 1
    assert [e.split(":")[0] for e in stderr_lines(proc)] == ["NOPE"], proc.stderr
    assert proc.stdout.splitlines() == ["R-1: retry requested", "R-2: retry requested"]
    assert run_once(env) == 0
    assert sorted(job for job, attempt in env.starts() if attempt == 2) == ["R-1", "R-2"]


def test_run_once_ends_after_a_retried_job_fails_again(env: Env) -> None:
    """`retry` of a job that fails again: the next `run --once` runs it once more and exits 1, not hangs."""
    env.configure(agents={"worker": env.agent("--exit", "1")}, rescan_interval=300)
    env.drop(order("AGAIN-1"))
    assert run_once(env) == 1
    assert env.cli("retry", "AGAIN-1").returncode == 0
    started = time.monotonic()
    assert env.cli("run", "--once", timeout=60).returncode == 1
    assert time.monotonic() - started < 30  # it ended with its work, not at a rescan
    assert [attempt for job, attempt in env.starts() if job == "AGAIN-1"] == [1, 2]


def test_cancel_of_several_ids_cancels_each_queued_one(env: Env) -> None:
    """`cancel A B C` cancels each queued job; a finished one fails on its own with exit 1."""
    env.drop(order("DONE-1"))
    assert run_once(env) == 0
    env.drop(order("C-1"))
    env.drop(order("C-2"))
    proc = env.cli("cancel", "C-1", "DONE-1", "C-2")
    assert proc.returncode == 1
    assert [e.split(":")[0] for e in stderr_lines(proc)] == ["DONE-1"], proc.stderr
    assert run_once(env) == 1
    for job_id in ("C-1", "C-2"):
        assert env.wait_job(job_id, "failed")["reason"] == "cancelled"


def test_followup_held_by_budget_is_released_and_runs(env: Env) -> None:
    """A follow-up held by max_chain_cost_usd is released by `release` (file and ledger) and then runs to done."""
    child = order("BUDGET-B")
    child["from"] = "first"
    spend = json.dumps({"total_cost_usd": 0.5})
    env.configure(
        agents={"first": env.agent("--json-result", spend, "--followup", json.dumps(child)), "worker": env.agent()},
        max_chain_cost_usd=0.1,
    )
    env.drop(order("BUDGET-A", to="first"))
    assert run_once(env) == 0
    assert os.listdir(env.root / "held") == ["BUDGET-B.json"]
    assert json.loads(env.cli("status", "--json", check=True).stdout)["counts"]["held"] == 1
    assert json.loads(env.cli("show", "BUDGET-B", "--json", check=True).stdout)["state"] == "held"

    proc = env.cli("release", "BUDGET-B")
    assert proc.returncode == 0, proc.stderr
    assert run_once(env) == 0
    result = env.wait_job("BUDGET-B", "done")
    assert result["parent"] == "BUDGET-A"


def _ledger(env: Env) -> Any:
    cfg = load_config(env.config_path)
    return open_ledger(cfg, Layout(cfg.root), patience_s=10)


def _hold_in_background(env: Env, job_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "hold", job_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=env.tmp,
        env=cli_env(),
    )


def test_hold_racing_a_claim_leaves_the_job_to_the_daemon(env: Env) -> None:
    """A hold that moves a file a daemon is claiming reports it as being claimed and leaves no copy in held/."""
    assert run_once(env) == 0  # makes the layout and the ledger
    inbox_file = env.drop(order("RACE-1"))
    data = inbox_file.read_bytes()
    stage = env.root / ".state" / "staging" / "fake.claim-RACE-1"
    stage.mkdir()
    os.link(inbox_file, stage / "order.json")  # step 1 of a claim: the daemon's second name
    hold = _hold_in_background(env, "RACE-1")
    held = env.root / "held" / "RACE-1.json"
    wait_until(held.exists, 30, "hold to move the file")
    ledger = _ledger(env)
    try:  # steps 2 and 3: the id is claimed and the staging folder becomes the job's folder
        ledger.claim([ClaimRequest("RACE-1", "worker", "RACE-1.json", "x")])
        os.rename(stage, env.root / "active" / "RACE-1")
    finally:
        ledger.close()
    out, err = hold.communicate(timeout=30)
    assert hold.returncode == 1, (out, err)
    assert err.strip() == "RACE-1: is being claimed by a daemon, not queued"
    assert not held.exists()
    assert (env.root / "active" / "RACE-1" / "order.json").read_bytes() == data


def test_hold_waits_for_a_daemon_that_lets_the_file_go(env: Env) -> None:
    """A hold that finds a daemon's second name on the file waits until it is dropped, then holds the order."""
    assert run_once(env) == 0
    inbox_file = env.drop(order("RACE-2"))
    stage = env.root / ".state" / "staging" / "fake.claim-RACE-2"
    stage.mkdir()
    os.link(inbox_file, stage / "order.json")
    hold = _hold_in_background(env, "RACE-2")
    held = env.root / "held" / "RACE-2.json"
    wait_until(held.exists, 30, "hold to move the file")
    time.sleep(0.3)
    assert hold.poll() is None, "hold did not wait for the daemon's claim to settle"
    os.unlink(stage / "order.json")  # the daemon let go (the id was known, or the file changed)
    stage.rmdir()
    _, err = hold.communicate(timeout=30)
    assert hold.returncode == 0, err
    assert held.exists() and os.stat(held).st_nlink == 1
    ledger = _ledger(env)
    try:
        assert ledger.get("RACE-2") is None
    finally:
        ledger.close()


def _followup_behind_a_busy_worker(env: Env, child_id: str, *, busy: str, parent: str, queued: str = "") -> Daemon:
    """Start a daemon whose `worker` (one slot) is busy with ``busy``; `first` runs ``parent``, whose follow-up
    ``child_id`` to worker is released into inbox/ and waits there (with ``queued``, a dropped order, if given)."""
    child = order(child_id)
    child["from"] = "first"
    env.configure(
        agents={
            "worker": env.agent("--sleep", "60", concurrency=1),
            "first": env.agent("--followup", json.dumps(child)),
        },
        max_jobs=2,
        stop_timeout=1,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order(busy))  # takes worker's one slot: the follow-up (and the queued order) wait in inbox/
    wait_until(lambda: (env.root / "active" / busy).exists(), 30, "the worker to be busy")
    if queued:
        env.drop(order(queued))
    env.drop(order(parent, to="first"))
    env.wait_job(parent, "done")
    wait_until(lambda: (env.root / "inbox" / f"{child_id}.json").exists(), 30, "the follow-up to be released")
    return d


def test_hold_and_release_of_a_released_followup_keep_the_ledger_in_step(env: Env) -> None:
    """A released follow-up waiting for its agent is held (ledger row `held`) and released again (row `released`)."""
    d = _followup_behind_a_busy_worker(env, "FUP-B", busy="BUSY-W", parent="FUP-A")

    def row() -> str:
        ledger = _ledger(env)
        try:
            entry = ledger.get("FUP-B")
            return str(entry.state) if entry else "-"
        finally:
            ledger.close()

    # the file is renamed into inbox/ first, then its row goes from reserved to released
    wait_until(lambda: row() == Row.RELEASED, 30, "the ledger to record the release")
    assert env.cli("hold", "FUP-B").returncode == 0
    assert row() == Row.HELD
    assert os.listdir(env.root / "held") == ["FUP-B.json"]
    assert env.cli("release", "FUP-B").returncode == 0
    assert row() in (Row.RELEASED, Row.CLAIMED)
    assert (env.root / "inbox" / "FUP-B.json").exists() or (env.root / "active" / "FUP-B").exists()
    d.stop()


def test_an_operators_line_read_by_a_daemon_killed_before_writing_it_is_written_at_the_next_start(env: Env) -> None:
    """kill -9 after the daemon read a command's relayed line, before it wrote it: the next daemon writes it
    (the file was removed as it was read, and the line was lost to the journal)."""
    env.configure(agents={"worker": env.agent("--sleep", "30")}, max_jobs=1)
    d = env_daemon(env, {"DISPATCHER_FAULT": "relay.read"})
    d.wait_ready()
    env.drop(order("BUSY"))
    wait_until(lambda: ("BUSY", 1) in env.starts(), 30, "BUSY to start")
    env.drop(order("Q2"))
    env.cli("hold", "Q2", check=True)
    assert d.wait(30) == -signal.SIGKILL
    assert not [e for e in d.events() if e["event"] == "job.held"]
    d2 = env.daemon()
    d2.wait_event("job.held", job_id="Q2")
    d2.stop()
    assert [e["job_id"] for e in d2.events() if e["event"] == "job.held"] == ["Q2"]


def _raced(env: Env, ids: list[str], *commands: str) -> list[tuple[str, list[subprocess.CompletedProcess[str]]]]:
    """Drop an order for each id, then run the commands on each id at once (one id after another); return, per id,
    how each command ended."""
    for job_id in ids:
        env.drop(order(job_id))
    base = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path)]
    out = []
    for job_id in ids:
        procs = [
            subprocess.Popen([*base, what, job_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=env.tmp, env=cli_env())
            for what in commands
        ]  # fmt: skip
        ended = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            ended.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        out.append((job_id, ended))
    return out


def test_a_cancel_racing_a_hold_always_ends_the_job_cancelled(env: Env) -> None:
    """`hold ID` and `cancel ID` run at once, 20 times over: cancel exits 0 each time, so each job ends in failed/
    with reason cancelled and none is left in held/ (where the cancel's request would be dropped and the order,
    once released, would run)."""
    ids = [f"RACE-{i:02d}" for i in range(20)]
    for job_id, ran in _raced(env, ids, "hold", "cancel"):
        assert ran[1].returncode == 0, (job_id, ran[1].stderr)
    held = env.root / "held"
    assert (sorted(p.name for p in held.iterdir()) if held.is_dir() else []) == []
    assert env.cli("run", "--once", timeout=120).returncode == 1
    for job_id in ids:
        assert env.result(job_id, "failed")["reason"] == "cancelled", job_id


def test_hold_and_release_at_once_never_lose_the_order(env: Env) -> None:
    """`hold ID` and `release ID` run at once, 20 times over: each order is left whole in inbox/ or in held/, never
    in neither (a hold's link and unlink beside a release's rename could unlink both names)."""
    ids = [f"HR-{i:02d}" for i in range(20)]
    _raced(env, ids, "hold", "release")
    for job_id in ids:
        found = [p for folder in ("inbox", "held") for p in (env.root / folder).glob(f"{job_id}*.json")]
        assert len(found) == 1, (job_id, found)
        assert json.loads(found[0].read_text())["job_id"] == job_id


def test_a_released_follow_up_still_queued_is_called_queued_by_approve_reject_and_land(env: Env) -> None:
    """A released follow-up waiting in inbox/ for its busy agent is `queued` to approve, reject and land, as to
    retry and hold (its ledger row says `released`, a word `list` and `show` never use); a dropped order waiting there
    too is `queued` to land, not unknown (`show` shows it). Each exits 1."""
    d = _followup_behind_a_busy_worker(env, "FUP-Q", busy="BUSY-Q", parent="FUP-P", queued="QUEUED-Q")
    for command, tail in (
        (("approve", "FUP-Q"), "is queued, not waiting for review"),
        (("reject", "FUP-Q", "--reason", "x"), "is queued, not waiting for review"),
        (("land", "FUP-Q"), "is queued, not done (only a done job lands)"),
        (("land", "QUEUED-Q"), "is queued, not done (only a done job lands)"),
    ):
        proc = env.cli(*command)
        assert proc.returncode == 1 and proc.stderr == f"{command[1]}: {tail}\n", (command, proc.stderr)
    d.stop()
