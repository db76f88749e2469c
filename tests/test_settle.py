"""The post-exit trip (``job.settle``): a job that ends right after its checks makes one trip off the loop.

Seam tests with a real tiny agent, a real SQLite ledger and the real lanes; the
trips are counted on the ``Lanes`` object the job uses. Pure tests of ``retry.judge``,
the decision both the trip and the loop use.
"""

from __future__ import annotations

import errno
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from seam_fixtures import GOOD, Seam, open_seam, run, sh

from dispatcher.checks.facts import Exit
from dispatcher.job.job import Job
from dispatcher.job.retry import Judgement, Next, judge
from dispatcher.lifecycle import Outcome
from dispatcher.spec.result import CheckResult
from dispatcher.store.jobstore import JobFolder

TRIPS = ("io", "io_then", "ledger", "scan")


def counted(s: Seam, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count every trip off the loop the seam's lanes make from now on."""
    seen: Counter[str] = Counter()
    for name in TRIPS:
        real = getattr(s.lanes, name)

        def trip(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(s.lanes, name, trip)
    return seen


def job_of(s: Seam, job_id: str) -> Job:
    started = s.started(job_id)
    return Job(s.ctx, started.folder, started.spec, started.order, started.token)


def test_a_job_that_passes_ends_in_one_trip_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Record, evidence, checks, decision, staged result, ledger commit, landing: one io trip handed to the ledger."""
    with open_seam(tmp_path) as s:
        job = job_of(s, "ONE-1")
        seen = counted(s, monkeypatch)
        outcome = run(job.run)
        result = s.result("done", "ONE-1")
        row = s.ledger.get("ONE-1")
    assert outcome is Outcome.DONE
    assert result["state"] == "done" and all(c["ok"] is not False for c in result["checks"])
    assert row is not None and row.state == "done"
    assert seen == Counter({"io_then": 1}), f"trips after the claim: {dict(seen)}"


def test_a_job_that_fails_for_good_ends_in_one_trip_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_seam(tmp_path, {"worker": sh("exit 1", max_attempts=3)}) as s:
        job = job_of(s, "ONE-2")
        seen = counted(s, monkeypatch)
        outcome = run(job.run)
        result = s.result("failed", "ONE-2")
    assert outcome is Outcome.FAILED
    assert "not retried: agent worker is not retry_safe and has no probe" in result["reason"]
    assert seen == Counter({"io_then": 1}), f"trips after the claim: {dict(seen)}"


def test_in_memory_a_small_job_ends_with_no_trip_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A root held in memory: the same record, checks, result and landing, done on the loop (no io trip)."""
    with open_seam(tmp_path) as s:
        s.lanes.files_in_memory = True
        job = job_of(s, "MEM-1")
        seen = counted(s, monkeypatch)
        outcome = run(job.run)
        result = s.result("done", "MEM-1")
        row = s.ledger.get("MEM-1")
        record = json.loads((s.layout.root / "done" / "MEM-1" / "attempts" / "1" / "attempt.json").read_text())
    assert outcome is Outcome.DONE
    assert result["state"] == "done" and all(c["ok"] is not False for c in result["checks"])
    assert row is not None and row.state == "done"
    assert record["exit_code"] == 0
    assert seen == Counter(), f"trips after the claim: {dict(seen)}"


def test_in_memory_a_large_work_folder_still_goes_to_the_io_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over 1 MiB in work/ is read off the loop, wherever it lives: a large output never stalls pickup."""
    big = f'head -c 2000000 /dev/zero > "$DISPATCH_WORKSPACE/out.csv"; {GOOD}'
    with open_seam(tmp_path, {"worker": sh(big, writes=["out.csv"])}) as s:
        s.lanes.files_in_memory = True
        job = job_of(s, "MEM-2")
        seen = counted(s, monkeypatch)
        run(job.run)
    assert seen == Counter({"io_then": 1}), f"trips after the claim: {dict(seen)}"


def test_a_result_that_cannot_be_staged_in_the_trip_is_finished_from_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is full when the trip stages the result: the job still ends done, through the loop's finish."""
    real = JobFolder.write_staged
    calls: list[str] = []

    def full_once(self: JobFolder, result: Any) -> tuple[str, str]:
        calls.append(self.job_id)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, result)

    monkeypatch.setattr(JobFolder, "write_staged", full_once)
    with open_seam(tmp_path) as s:
        job = job_of(s, "ONE-3")
        seen = counted(s, monkeypatch)
        outcome = run(job.run)
        result = s.result("done", "ONE-3")
    assert outcome is Outcome.DONE and result["state"] == "done"
    assert calls == ["ONE-3", "ONE-3"]  # staged again by the loop's finish, which waits out a full disk
    assert seen == Counter({"io_then": 1})


def test_a_job_with_its_own_checks_is_decided_after_them_on_the_loop(tmp_path: Path) -> None:
    """An agent's `checks:` run after the trip: their failure decides, and the trip did not finish the job."""
    agent = sh(GOOD, checks=[{"name": "never", "command": ["sh", "-c", "echo nope; exit 1"]}])
    with open_seam(tmp_path, {"worker": agent}) as s:
        outcome = run(job_of(s, "ONE-4").run)
        result = s.result("failed", "ONE-4")
    assert outcome is Outcome.FAILED
    assert result["reason"].startswith("never")
    assert [c["name"] for c in result["checks"]][-1] == "never"


# -- the decision ---------------------------------------------------------------------------------
def checks(*failing: str, receipt_detail: str = "no receipt.json") -> list[CheckResult]:
    names = ["exit_ok", "receipt_present", "receipt_job_id", "ids_match"]
    out = []
    for name in names:
        if name in failing:
            out.append(CheckResult(name, False, receipt_detail if name == "receipt_present" else "bad"))
        else:
            out.append(CheckResult(name, True, ""))
    return out


@pytest.fixture
def spec(tmp_path: Path) -> Any:
    with open_seam(tmp_path, {"worker": sh(GOOD, max_attempts=2, retry_safe=True)}) as s:
        return s.started("J-SPEC").spec


@pytest.mark.parametrize(
    ("exit_", "failing", "receipt", "n", "repair", "want"),
    [
        (Exit(code=0), (), True, 1, False, Judgement(Next.PASS)),
        (Exit(code=1), ("exit_ok",), True, 1, False, Judgement(Next.RETRY, "exit_ok: bad")),
        (
            Exit(code=1),
            ("exit_ok",),
            True,
            2,
            False,
            Judgement(Next.FAIL, "exit_ok: bad; not retried: no attempts left"),
        ),
        (
            Exit(code=0),
            ("receipt_present",),
            False,
            1,
            False,
            Judgement(Next.RETRY, "receipt_present: no receipt.json"),
        ),
        (Exit(timed_out=True), (), True, 1, False, Judgement(Next.RETRY, "receipt_present: no receipt.json")),
        (Exit(code=0), ("ids_match",), True, 1, False, Judgement(Next.FAIL, "ids_match: bad")),
        (Exit(code=0), ("ids_match",), True, 1, True, Judgement(Next.REPAIR, "ids_match: bad")),
        (
            Exit(code=0),
            ("ids_match",),
            True,
            2,
            True,
            Judgement(Next.FAIL, "ids_match: bad; not repaired: no attempts left"),
        ),
        (Exit(lost=True), (), True, 1, True, Judgement(Next.PASS)),
    ],
)
def test_judge_follows_the_retry_rules(
    spec: Any, exit_: Exit, failing: tuple[str, ...], receipt: bool, n: int, repair: bool, want: Judgement
) -> None:
    from dataclasses import replace

    s = replace(spec, agent=replace(spec.agent, repair=repair))
    results = checks(*failing)
    if exit_.timed_out:
        results = [CheckResult("exit_ok", False, "timed out"), *results[1:]]
        want = Judgement(Next.RETRY, "exit_ok: timed out")
    assert judge(s, [], n, exit_, results, receipt=receipt) == want


def test_a_failed_exit_beside_an_unusable_receipt_says_why_it_is_not_retried(spec: Any) -> None:
    """exit_ok leads the reason, so the reason adds why no attempt follows although attempts remain."""
    bad = checks("exit_ok", "receipt_present", receipt_detail="not JSON")
    got = judge(spec, [], 1, Exit(code=1), bad, receipt=True)
    assert got.next is Next.FAIL
    assert got.reason == (
        "exit_ok: bad; not retried: its receipt.json is present but invalid (receipt_present), "
        "and such a job is never retried"
    )


def test_an_unusable_receipt_is_never_retried_and_a_final_judgement_never_repairs(spec: Any) -> None:
    from dataclasses import replace

    bad = checks("receipt_present", receipt_detail="not JSON")
    assert judge(spec, [], 1, Exit(code=1), bad, receipt=True) == Judgement(Next.FAIL, "receipt_present: not JSON")
    repairing = replace(spec, agent=replace(spec.agent, repair=True))
    failed = checks("ids_match")
    assert judge(repairing, [], 1, Exit(lost=True), failed, receipt=True, final=True) == Judgement(
        Next.FAIL, "ids_match: bad; not repaired: recovered with its receipt after its daemon died"
    )  # a job not repaired says why (section 6)


def test_a_recovered_job_with_a_receipt_and_a_recorded_failed_exit_is_not_run_again(spec: Any) -> None:
    """Section 6: with work/receipt.json there, a recovered job's agent is not run again, also when the dead daemon
    had recorded its exit (exit 3): the checks decide, and the reason says why it was not retried."""
    failed = checks("exit_ok")
    assert judge(spec, [], 1, Exit(code=3), failed, receipt=True, final=True) == Judgement(
        Next.FAIL, "exit_ok: bad; not retried: recovered with its receipt after its daemon died"
    )
    assert judge(spec, [], 1, Exit(code=3), failed, receipt=True) == Judgement(Next.RETRY, "exit_ok: bad")
