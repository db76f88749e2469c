"""The lifecycle vocabulary and the typed result.json, as pure values.

No daemon: the row/folder conversions every module uses, and a ``Result`` read
from a result.json body and written back, are checked directly. The daemon tests
(test_lifecycle.py, test_cost_review.py, ...) check the files a real job leaves.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dispatcher.job.finish import this_claim
from dispatcher.lifecycle import (
    Outcome,
    Row,
    State,
    is_final,
    is_landed,
    landed_state,
    outcome_of,
    row_to_state,
    state_to_row,
)
from dispatcher.spec.jobspec import Attempt
from dispatcher.spec.result import CheckResult, Result
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.results import DETAIL_MAX, build_result

BODY = {
    "job_id": "J1",
    "state": "review",
    "agent": "w",
    "reason": None,
    "checks": [{"name": "exit_zero", "ok": True, "detail": "exit code 0"}],
    "attempts": [{"n": 1, "started": "2026-12-01T08:00:00.123Z", "exit_code": 0, "agent_result": {"x": 1}}],
    "received": "2026-12-01T08:00:00.000Z",
    "finished": "2026-12-01T08:00:02.500Z",
    "parent": None,
    "children": ["C1"],
    "cost_usd": 1,
    "chain_cost_usd": 1.5,
    "file": "old-field.json",
}


def test_rows_and_folders_convert_both_ways() -> None:
    """A claimed row lives in active/, a landed row in its own folder, a queued row in no folder."""
    assert row_to_state(Row.CLAIMED) is State.ACTIVE
    assert [row_to_state(r) for r in (Row.REVIEW, Row.DONE, Row.FAILED)] == [State.REVIEW, State.DONE, State.FAILED]
    assert [row_to_state(r) for r in (Row.RESERVED, Row.HELD, Row.RELEASED)] == [None, None, None]
    assert [state_to_row(s) for s in State] == [Row.CLAIMED, Row.CLAIMED, Row.REVIEW, Row.DONE, Row.FAILED]
    assert state_to_row(State.FAILED, "done") is Row.DONE  # landed in failed/ by a crash, but its result says done
    assert is_final("done") and is_final(Row.FAILED) and not is_final(Row.REVIEW)
    assert is_landed(Row.REVIEW) and not is_landed(Row.CLAIMED)
    assert outcome_of(Row.REVIEW) is Outcome.REVIEW
    with pytest.raises(ValueError, match="claimed"):
        landed_state(Row.CLAIMED)


def test_result_round_trip_keeps_every_key_and_the_order() -> None:
    """A result.json read and written back says the same, unknown keys included, in the same order."""
    result = Result.from_json(BODY)
    assert result.extra == {"file": "old-field.json"}
    assert result.checks == (CheckResult("exit_zero", True, "exit code 0"),)
    assert result.duration_s == 2.5
    assert json.dumps(result.to_json()) == json.dumps(BODY)


def test_a_decision_is_a_new_result() -> None:
    """Deciding a review builds a new Result; the one read from the file is left as it was."""
    read = Result.from_json(BODY)
    decided = replace(read, state="failed", reason="rejected: no")
    assert read.state == "review" and decided.to_json()["reason"] == "rejected: no"
    assert list(decided.to_json()) == list(BODY)


def test_a_damaged_result_reads_as_missing_fields() -> None:
    """Values of the wrong type read as missing, never as an exception."""
    result = Result.from_json({"job_id": 5, "checks": "x", "children": [1, "C"], "cost_usd": True})
    assert (result.job_id, result.checks, result.children, result.cost_usd) == (None, (), ("C",), None)
    assert result.duration_s is None


def test_build_result_writes_the_contract_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A built result is staged with the contract's keys in order, its reason cut to one line."""
    attempt = Attempt(n=1, started=1.0, ended=2.0, exit_code=0)
    result = build_result(
        job_id="J", state="failed", agent="w", reason="a\nb" + "x" * DETAIL_MAX, attempts=[attempt], received=1.0
    )
    folder = JobFolder(tmp_path)
    folder.stage_result(result)
    data = json.loads((tmp_path / ".result.json.staged").read_text())
    assert list(data) == list(BODY)[:-1]
    assert data["reason"].startswith("a\\nb") and data["reason"].endswith("more characters)")
    assert folder.result() == result


def test_build_result_cuts_only_the_check_details_over_detail_max() -> None:
    """A check detail over DETAIL_MAX is cut with a note; the others, one of exactly DETAIL_MAX too, are kept."""
    checks = [
        CheckResult("a", True, "fine"),
        CheckResult("b", False, "y" * (DETAIL_MAX + 7)),
        CheckResult("c", None, "z" * DETAIL_MAX),
    ]
    result = build_result(job_id="J", state="failed", agent="w", reason="b", checks=checks, received=1.0)
    assert result.checks == (
        checks[0],
        CheckResult("b", False, "y" * DETAIL_MAX + "… (cut, 7 more characters)"),
        checks[2],
    )
    plain = build_result(job_id="J", state="done", agent="w", reason=None, checks=checks[::2], received=1.0)
    assert plain.checks == tuple(checks[::2])


def _attempt(n: int, started: str, cost: float) -> dict[str, object]:
    return {"n": n, "started": started, "ended": started, "exit_code": 1, "cost_usd": cost}


@pytest.mark.parametrize(
    ("kept", "attempts", "counted"),
    [
        ({}, [_attempt(1, "2026-12-02T10:00:00.000Z", 1.0)], (60.0, 1.0)),  # claimed once: all of it
        ({1: "failed"}, [_attempt(1, "2026-12-02T10:00:00.000Z", 1.0)], (None, None)),  # reopened, no new attempt
        (
            {1: "failed"},
            [_attempt(1, "2026-12-02T10:00:00.000Z", 1.0), _attempt(2, "2026-12-02T10:00:50.000Z", 2.0)],
            (10.0, 2.0),  # retried: its new attempt, from its start
        ),
        (
            {1: "review"},
            [_attempt(1, "2026-12-02T10:00:00.000Z", 1.0), _attempt(2, "2026-12-02T10:00:50.000Z", 2.0)],
            (60.0, 3.0),  # revised from review/, whose entry was never counted: both attempts
        ),
    ],
)
def test_the_metrics_count_each_attempt_once(
    tmp_path: Path, kept: dict[int, str], attempts: list[dict[str, object]], counted: tuple[object, object]
) -> None:
    """this_claim: the seconds and cost a finish adds to the metrics, for jobs claimed once and reopened."""
    folder = JobFolder(tmp_path / "J")
    for a in attempts:
        (folder.attempts_dir / str(a["n"])).mkdir(parents=True)
    for n, state in kept.items():
        (folder.attempts_dir / str(n) / "result.json").write_text(json.dumps({"state": state}))
    result = Result(
        "J", "failed", "w", None, attempts=tuple(attempts), received="2026-12-02T10:00:00.000Z",
        finished="2026-12-02T10:01:00.000Z", cost_usd=sum(float(a["cost_usd"]) for a in attempts),  # type: ignore[arg-type]
    )  # fmt: skip
    assert this_claim(folder, result) == counted


def test_a_staged_result_is_named_over_only_the_result_json_this_process_named(tmp_path: Path) -> None:
    """Naming the staged result never replaces a result.json someone else made (an agent outside work/: a
    FileExistsError, the job stuck), but does replace the one this folder's own earlier naming made: a finish tried
    again after a shortage met once its result was named (at `ulimit -n` a job was left stuck)."""
    folder_path = tmp_path / "J1"
    folder_path.mkdir()
    staged, result = folder_path / ".result.json.staged", folder_path / "result.json"
    folder = JobFolder(folder_path)
    staged.write_text('{"try": 1}')
    assert folder.name_result() == str(folder_path)
    staged.write_text('{"try": 2}')  # the finish again: staged anew, named again over its own
    assert folder.name_result() == str(folder_path)
    assert json.loads(result.read_text()) == {"try": 2} and not staged.exists()
    result.write_text("an agent's own")
    staged.write_text('{"try": 1}')
    with pytest.raises(FileExistsError):
        JobFolder(folder_path).name_result()  # another process (a start's recovery): not its own
    assert result.read_text() == "an agent's own" and staged.exists()
    assert JobFolder(folder_path).name_result(replace=True) == str(folder_path)  # a review's decision
    assert json.loads(result.read_text()) == {"try": 1}


def test_an_attempt_record_written_again_is_never_left_torn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Marking a retry writes attempt.json again: a crash in that write (here, every write failing once the
    file is open) leaves the first record whole, with the agent's exit status, so that a failed agent can never
    read as one whose status was lost (README: attempt.json, written once, with the exit status)."""
    folder = JobFolder(tmp_path / "J-1")
    (tmp_path / "J-1" / "attempts" / "1").mkdir(parents=True)
    first = Attempt(n=1, started=1.0, ended=2.0, exit_code=3)
    folder.record_attempt(first)

    def crash(fd: int, data: object) -> int:
        raise OSError("killed mid-write")

    monkeypatch.setattr("os.write", crash)
    with pytest.raises(OSError, match="killed mid-write"):
        folder.record_attempt(replace(first, retry_next=True))
    monkeypatch.undo()
    assert [(a.n, a.exit_code, a.retry_next) for a in folder.attempts()] == [(1, 3, False)]
    folder.record_attempt(replace(first, retry_next=True))
    assert [(a.n, a.exit_code, a.retry_next) for a in folder.attempts()] == [(1, 3, True)]
