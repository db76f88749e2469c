"""In-process tests of ``job.finish.Finisher``: stage and commit with the token in one batch, land, release."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

from seam_fixtures import Seam, open_seam, order, run, until

from dispatcher.ledger.base import Child, Finish
from dispatcher.lifecycle import Row
from dispatcher.spec.result import Result
from dispatcher.store.placing import Started
from dispatcher.store.results import build_result


def result_of(started: Started, state: Row, reason: str | None = None, **extra: Any) -> Result:
    """Return the result body a job would finish with."""
    spec = started.spec
    return build_result(
        job_id=spec.job_id, state=str(state), agent=spec.agent.name, reason=reason, received=spec.received, **extra
    )


async def finish(s: Seam, started: Started, state: Row, *, token: int | None = None, release: bool = False) -> bool:
    """Finish the job as it does at its end: stage, commit, land (and release its follow-ups)."""
    result = result_of(started, state, children=["C1"] if release else [])
    done = Finish(started.spec.job_id, started.token if token is None else token, state)
    return await s.finisher.finish(started.folder, done, result, release=release)


def test_a_staged_result_lands_the_folder_in_done_with_result_json(tmp_path: Path) -> None:
    """finish: the ledger row is done and done/<id>/result.json holds the result; active/ is empty."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        landed = run(lambda: finish(s, started, Row.DONE))
        result = s.result("done", "J1")
        row = s.ledger.get("J1")
    assert landed is True
    assert result["job_id"] == "J1" and result["state"] == "done"
    assert row is not None and row.state == Row.DONE
    assert os.listdir(s.layout.root / "active") == []
    assert "result.json" in os.listdir(s.layout.root / "done" / "J1")


def test_a_failed_result_lands_in_failed_with_its_reason(tmp_path: Path) -> None:
    """A failed finish moves the folder to failed/ and the reason is in its result.json."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        result = result_of(started, Row.FAILED, "exit_ok: exit code 3")

        async def body() -> bool:
            end = Finish("J1", started.token, Row.FAILED)
            return await s.finisher.finish(started.folder, end, result, release=False)

        assert run(body) is True
        assert s.result("failed", "J1")["reason"] == "exit_ok: exit code 3"


def test_a_token_that_no_longer_holds_the_claim_is_fenced_and_changes_nothing(tmp_path: Path) -> None:
    """A stale token answers False: the folder stays in active/ with no result.json, the row stays claimed."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        landed = run(lambda: finish(s, started, Row.DONE, token=started.token + 1))
        row = s.ledger.get("J1")
    assert landed is False
    assert os.listdir(s.layout.root / "active") == ["J1"]
    assert not (s.layout.root / "active" / "J1" / "result.json").exists()
    assert os.listdir(s.layout.root / "done") == []
    assert row is not None and row.state == Row.CLAIMED


def test_jobs_finishing_in_one_turn_each_land_in_their_folder(tmp_path: Path) -> None:
    """Three jobs finishing in one loop turn: the two holding their claim land, the fenced one stays in active/."""
    with open_seam(tmp_path, max_jobs=4) as s:
        a, b, c = (s.started(f"J{i}") for i in range(3))

        async def body() -> list[bool]:
            return list(
                await asyncio.gather(
                    finish(s, a, Row.DONE), finish(s, b, Row.FAILED), finish(s, c, Row.DONE, token=c.token + 5)
                )
            )

        assert run(body) == [True, True, False]
        assert os.listdir(s.layout.root / "done") == ["J0"]
        assert os.listdir(s.layout.root / "failed") == ["J1"]
        assert os.listdir(s.layout.root / "active") == ["J2"]


def test_a_landing_repeated_after_a_crash_answers_true_and_changes_nothing(tmp_path: Path) -> None:
    """Landing an already landed job again (a crash before the daemon learnt of it) is harmless and answers True."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        result = result_of(started, Row.DONE)
        end = Finish("J1", started.token, Row.DONE)
        first = run(lambda: s.finisher.finish(started.folder, end, result, release=False))
        before = s.result("done", "J1")
        again = run(lambda: s.finisher.land(started.folder, end, result, release=False))
        after = s.result("done", "J1")
    assert first is True and again is True
    assert after == before
    assert os.listdir(s.layout.root / "done") == ["J1"]


def test_a_result_staged_before_a_crash_is_landed_by_land(tmp_path: Path) -> None:
    """land finishes a job whose result was staged when its daemon died: the folder moves to done/ with it."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        result = result_of(started, Row.DONE)
        started.folder.stage_result(result)  # what the dead daemon left
        landed = run(
            lambda: s.finisher.land(started.folder, Finish("J1", started.token, Row.DONE), result, release=False)
        )
        row = s.ledger.get("J1")
    assert landed is True
    assert s.result("done", "J1")["state"] == "done"
    assert row is not None and row.state == Row.DONE


def test_a_result_that_cannot_be_staged_raises_and_the_rest_of_the_batch_lands(tmp_path: Path) -> None:
    """A job whose result cannot be written gets the OSError and stays claimed; its batch-mates still land."""
    with open_seam(tmp_path) as s:
        a, b = s.started("J1"), s.started("J2")
        shutil.rmtree(b.folder.path)  # its folder is gone: staging its result fails

        async def body() -> list[object]:
            return list(await asyncio.gather(finish(s, a, Row.DONE), finish(s, b, Row.DONE), return_exceptions=True))

        landed, failed = run(body)
        row = s.ledger.get("J2")
    assert landed is True and isinstance(failed, OSError)
    assert os.listdir(s.layout.root / "done") == ["J1"]
    assert row is not None and row.state == Row.CLAIMED


def reserve_child(s: Seam, parent: Started) -> None:
    """Write a follow-up into the parent's outbox and reserve it in the ledger, as the parent's checks do."""
    outbox = parent.folder.work / "outbox"
    outbox.mkdir()
    (outbox / "C1.json").write_text(json.dumps(order("C1", **{"from": "worker"})))
    taken = s.ledger.reserve("J1", parent.token, parent.spec.hops + 1, [Child("C1", "worker", "C1.json")])
    assert taken == []


def test_a_done_parents_followups_are_released_into_inbox_once(tmp_path: Path) -> None:
    """A done parent's reserved follow-up appears once in inbox/ with its lineage and is hinted to the inbox."""
    with open_seam(tmp_path) as s:
        parent = s.started("J1")
        reserve_child(s, parent)

        async def body() -> str | None:
            assert await finish(s, parent, Row.DONE, release=True)
            await until(s.inbox.has_ready, "the released follow-up to be hinted")
            return s.inbox.pop()

        hinted = run(body)
        again = s.finisher.release("J1")
        child = json.loads((s.layout.inbox / "C1.json").read_text())
        row = s.ledger.get("C1")
    assert hinted == "C1.json"
    assert os.listdir(s.layout.inbox) == ["C1.json"]
    assert child["job_id"] == "C1" and child["parent"] == "J1" and child["hops"] == 1
    assert again == 0
    assert row is not None and row.state == Row.RELEASED


def test_a_failed_parents_followups_are_never_released(tmp_path: Path) -> None:
    """A parent that ends failed releases nothing: inbox/ stays empty and the reservation is dropped."""
    with open_seam(tmp_path) as s:
        parent = s.started("J1")
        reserve_child(s, parent)
        landed = run(lambda: finish(s, parent, Row.FAILED, release=True))
        row = s.ledger.get("C1")
    assert landed is True
    assert os.listdir(s.layout.inbox) == []
    assert row is None
