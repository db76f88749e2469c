"""In-process tests of ``job.intake``: what becomes of an inbox file, decided against a real SQLite ledger."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from seam_fixtures import open_seam, order

from dispatcher.job import intake
from dispatcher.job.intake import Cancelled, Refused
from dispatcher.ledger.base import Claimed, Request
from dispatcher.lifecycle import Row
from dispatcher.store import placing
from dispatcher.store.placing import Inspected, Skipped, Started
from dispatcher.store.refusals import Refusal


def test_inspect_reads_a_valid_order_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    """inspect returns the parsed order, a Refusal (with the id when readable) for bad files, None when gone."""
    with open_seam(tmp_path) as s:
        good = intake.inspect(s.layout, s.drop(order("J1")), s.config)
        wrong_name = intake.inspect(s.layout, s.drop(b"job_id: J2\n", "notes.txt"), s.config)
        unknown_agent = intake.inspect(s.layout, s.drop(order("J3", to="nobody")), s.config)
        gone = intake.inspect(s.layout, "never-there.json", s.config)
    assert isinstance(good, Inspected) and good.order.job_id == "J1" and good.order.to == "worker"
    assert isinstance(wrong_name, Refusal) and "must end in .yaml, .yml or .json" in wrong_name.reason
    assert isinstance(unknown_agent, Refusal) and unknown_agent.job_id == "J3"
    assert gone is None


def test_a_new_id_is_claimed_into_active_and_its_inbox_file_is_gone(tmp_path: Path) -> None:
    """A claim of a new id places active/<id> with job.json and work/order.json, and unlinks the inbox name."""
    with open_seam(tmp_path) as s:
        [answer] = s.claim(s.drop(order("J1")))
        row = s.ledger.get("J1")
    assert isinstance(answer, Started)
    assert answer.folder.path == s.layout.root / "active" / "J1"
    assert (answer.folder.path / "job.json").is_file()
    assert json.loads((answer.folder.path / "work" / "order.json").read_text())["job_id"] == "J1"
    assert os.listdir(s.layout.inbox) == []
    assert row is not None and row.state == Row.CLAIMED and row.token == answer.token
    assert os.listdir(s.layout.staging) == []


def test_one_batch_claims_every_new_id_in_order(tmp_path: Path) -> None:
    """A batch of three orders gives three answers, in the order of the picks, each in active/."""
    with open_seam(tmp_path) as s:
        names = [s.drop(order(f"J{i}")) for i in range(3)]
        answers = s.claim(*names)
    assert [a.spec.job_id for a in answers if isinstance(a, Started)] == ["J0", "J1", "J2"]
    assert sorted(os.listdir(s.layout.root / "active")) == ["J0", "J1", "J2"]


def test_a_known_id_is_refused_into_failed_with_a_timestamped_folder(tmp_path: Path) -> None:
    """A second file with a claimed id is Refused: failed/<stem>@<time>/ says the id is already known."""
    with open_seam(tmp_path) as s:
        s.started("J1")
        [answer] = s.claim(s.drop(order("J1"), "again.json"))
        [folder] = [p for p in (s.layout.root / "failed").iterdir() if p.name.startswith("again@")]
        result = json.loads((folder / "result.json").read_text())
    assert answer == Refused("again.json", "J1")
    assert "already known (state claimed)" in result["reason"]
    assert [r.name for r in s.refused] == ["again.json"]
    assert os.listdir(s.layout.inbox) == []


def test_the_same_order_dropped_again_under_its_name_while_its_job_runs_is_refused(tmp_path: Path) -> None:
    """The very bytes under the very name the running job was claimed from, as a new file: not the job's own
    (another inode), so refused as known at once, never left in inbox/ as a claim under way."""
    with open_seam(tmp_path) as s:
        started = s.started("J1")
        data = (started.folder.path / "order.json").read_bytes()
        name = s.drop(data, "J1.json")  # same name, same bytes, a new inode
        [answer] = s.claim(name)
        [folder] = [p for p in (s.layout.root / "failed").iterdir() if p.name.startswith("J1@")]
        result = json.loads((folder / "result.json").read_text())
    assert answer == Refused("J1.json", "J1")
    assert "already known (state claimed)" in result["reason"]
    assert (folder / "order.json").read_bytes() == data
    assert os.listdir(s.layout.inbox) == []
    assert (s.layout.root / "active" / "J1" / "order.json").read_bytes() == data  # the job's own untouched


def test_a_file_written_to_in_place_after_it_was_read_is_skipped_and_read_again(tmp_path: Path) -> None:
    """An editor's in-place save between the read and the claim (same inode, new bytes): Skipped to be read
    again, never claimed with bytes it did not read (order.<ext> would hold the edit, order.json the old order)."""
    with open_seam(tmp_path) as s:
        name = s.drop(order("J1"))
        item = s.inspected(name)
        assert item.stamp is not None
        edited = json.dumps(order("J1X")).encode()
        path = s.layout.inbox / name
        with open(path, "r+b") as fh:  # truncate and write, as `vim` or `printf > file` saves
            fh.truncate(0)
            fh.write(edited)
        os.utime(path, ns=(item.stamp[1] + 1_000_000, item.stamp[1] + 1_000_000))  # a later save, whatever the clock
        [answer] = intake.claim(
            s.layout, s.ledger, [placing.Pick(item, s.config.agents["worker"])], on_refused=print, finisher=s.finisher
        )
        row = s.ledger.get("J1")
        staged = os.listdir(s.layout.staging)
    assert answer == Skipped(name, retry_later=True)
    assert path.read_bytes() == edited and row is None and staged == []
    assert not (s.layout.root / "active" / "J1").exists()


def test_a_file_replaced_after_it_was_read_is_skipped_and_left_in_inbox(tmp_path: Path) -> None:
    """A file whose name now holds another file (a new inode) is Skipped, stays in inbox/ and is not claimed."""
    with open_seam(tmp_path) as s:
        name = s.drop(order("J1"))
        item = s.inspected(name)
        s.drop(order("J1", task="Do it again."), name)  # a rename over the name: another inode
        [answer] = intake.claim(
            s.layout, s.ledger, [placing.Pick(item, s.config.agents["worker"])], on_refused=print, finisher=s.finisher
        )
        row = s.ledger.get("J1")
    assert answer == Skipped(name, retry_later=True)  # read again in a moment: the new file is the order now
    assert os.listdir(s.layout.inbox) == [name]
    assert row is None
    assert os.listdir(s.layout.root / "active") == []


def test_an_order_cancelled_before_its_claim_lands_in_failed_without_an_attempt(tmp_path: Path) -> None:
    """With a cancel request open, the claim answers Cancelled: failed/<id> says cancelled, no attempt ran."""
    with open_seam(tmp_path) as s:
        s.ledger.request("J1", Request.CANCEL)
        [answer] = s.claim(s.drop(order("J1")))
        result = s.result("failed", "J1")
        row = s.ledger.get("J1")
        open_cancels = s.ledger.requests(Request.CANCEL)
    assert answer == Cancelled("J1.json", "J1")
    assert result["state"] == "failed" and result["reason"] == "cancelled"
    assert result["attempts"] == []
    assert os.listdir(s.layout.root / "failed" / "J1" / "attempts") == []
    assert row is not None and row.state == Row.FAILED
    assert open_cancels == []
    assert os.listdir(s.layout.inbox) == [] and os.listdir(s.layout.root / "active") == []


def test_a_cancel_for_one_id_leaves_the_rest_of_its_batch_claimed(tmp_path: Path) -> None:
    """In a batch, only the id with the open cancel request is Cancelled; the others are Started."""
    with open_seam(tmp_path) as s:
        s.ledger.request("J1", Request.CANCEL)
        answers = s.claim(s.drop(order("J0")), s.drop(order("J1")), s.drop(order("J2")))
    assert [type(a) for a in answers] == [Started, Cancelled, Started]
    assert sorted(os.listdir(s.layout.root / "active")) == ["J0", "J2"]


def test_an_id_with_a_folder_but_no_ledger_row_is_refused_and_its_row_put_back(tmp_path: Path) -> None:
    """A job folder the ledger does not know (a lost ledger) is never run again: refused, its row repaired."""
    with open_seam(tmp_path) as s:
        (s.layout.root / "done" / "J1").mkdir()
        [answer] = s.claim(s.drop(order("J1")))
        row = s.ledger.get("J1")
    assert answer == Refused("J1.json", "J1")
    assert row is not None and row.state == Row.DONE
    assert "already known (state done)" in s.refused[0].reason


@pytest.mark.parametrize(
    ("name", "body", "why"),
    [
        (
            "date.yaml",
            b"job_id: RG-1\nfrom: a\nto: worker\ntask: t\nitems: [{id: R1}]\nmeta: {d: 2024-01-01}\n",
            "date",
        ),
        (
            "dup.json",
            b'{"job_id": "RG-2", "from": "a", "to": "worker", "task": "t", "items": [{"id": "R1"}], '
            b'"meta": {"k": 1, "k": 2}}',
            "duplicate key",
        ),
        (
            "nan.json",
            b'{"job_id": "RG-3", "from": "a", "to": "worker", "task": "t", "items": [{"id": "R1"}], '
            b'"meta": {"x": NaN}}',
            "NaN",
        ),
        (
            "surrogate.json",
            b'{"job_id": "RG-4", "from": "a", "to": "worker", "task": "t", "items": [{"id": "R1"}], '
            b'"meta": {"x": "\\ud800"}}',
            "surrogate",
        ),
        (
            "anchor.yaml",
            b"job_id: RG-5\nfrom: a\nto: worker\ntask: t\nitems: [{id: R1}]\nmeta: {a: &x 1, b: *x}\n",
            "anchor",
        ),
    ],
)
def test_a_file_the_strict_parser_refuses_keeps_the_job_id_it_names(
    tmp_path: Path, name: str, body: bytes, why: str
) -> None:
    """A date, a duplicate key, NaN, a lone surrogate or an anchor elsewhere: the refusal still names the job id."""
    with open_seam(tmp_path) as s:
        refused = intake.inspect(s.layout, s.drop(body, name), s.config)
    assert isinstance(refused, Refusal)
    assert why.lower() in refused.reason.lower(), refused.reason
    assert refused.job_id == re.search(rb"RG-\d", body).group().decode()  # type: ignore[union-attr]


def test_a_file_without_a_readable_job_id_is_refused_without_one(tmp_path: Path) -> None:
    """Not JSON at all, or a job_id that is not a string: the refusal has no job id."""
    with open_seam(tmp_path) as s:
        broken = intake.inspect(s.layout, s.drop(b'{"job_id": "X-1", ', "broken.json"), s.config)
        number = intake.inspect(s.layout, s.drop(b"job_id: 12\nmeta: {d: 2024-01-01}\n", "number.yaml"), s.config)
    assert isinstance(broken, Refusal) and broken.job_id is None
    assert isinstance(number, Refusal) and number.job_id is None


def test_an_invalid_order_is_refused_with_its_job_id_and_parsed_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A small and a 40 KB YAML order missing `task` are refused naming the field, with their job_id, one parse each."""
    from dispatcher.spec import orderchild

    calls: list[str] = []

    def counted(name: str, real: Any) -> Any:
        def parse(data: bytes, fmt: str) -> Any:
            calls.append(name)
            return real(data, fmt)

        return parse

    monkeypatch.setattr(intake, "load_apart_text", counted("child", orderchild.load_apart_text))
    monkeypatch.setattr(intake, "load_document", counted("here", intake.load_document))
    small = b"job_id: BAD-1\nfrom: a\nto: worker\nitems: [{id: R1}]\n"
    big = b"job_id: BAD-2\nfrom: a\nto: worker\nitems: [{id: R1}]\nmeta:\n  lines:\n" + b"    - a line\n" * 4000
    with open_seam(tmp_path) as s:
        one = intake.inspect(s.layout, s.drop(small, "BAD-1.yaml"), s.config)
        two = intake.inspect(s.layout, s.drop(big, "BAD-2.yaml"), s.config)
    assert isinstance(one, Refusal) and isinstance(two, Refusal)
    assert (one.job_id, two.job_id) == ("BAD-1", "BAD-2")
    assert "task" in one.reason and "task" in two.reason
    assert calls == ["here", "child"]  # each parsed once (the large one in the child); job_ids come from those parses


def _rewritten_before_announce(s: Any, other_name: Path | None) -> tuple[bytes, bytes, Path]:
    """Claim J1, then put its folder back as ``announce`` finds it when another daemon took the inbox name first:
    the job's ``order.json`` is the inode it read, written again in place since (optionally linked at other_name,
    as another daemon's refusal links it). Announce again; return (bytes read, bytes written since, the folder)."""
    name = s.drop(order("J1"))
    item = s.inspected(name)
    [answer] = intake.claim(
        s.layout, s.ledger, [placing.Pick(item, s.config.agents["worker"])], on_refused=print, finisher=s.finisher
    )
    assert isinstance(answer, Started) and os.listdir(s.layout.inbox) == []
    placed = s.layout.root / "active" / "J1"
    kept = placed / "order.json"
    assert (kept.stat().st_dev, kept.stat().st_ino) == item.inode  # the inbox file itself, by its link
    if other_name is not None:
        os.link(kept, other_name)
    rewritten = b'{"job_id": "J1", "not": "an order"}\n'
    with open(kept, "r+b") as fh:  # a second `cp` onto the name: truncated and written, the same inode
        fh.truncate(0)
        fh.write(rewritten)
    assert item.stamp is not None
    os.utime(kept, ns=(item.stamp[1] + 1_000_000, item.stamp[1] + 1_000_000))
    placing.announce(s.layout, placing.Pick(item, s.config.agents["worker"]), Claimed("J1", 1), str(placed))
    return item.data, rewritten, placed


def test_a_claimed_file_rewritten_in_place_after_another_daemon_took_its_name_keeps_the_job_its_bytes(
    tmp_path: Path,
) -> None:
    """Two daemons: one claims a file, a second `cp` rewrites it in place and the other daemon refuses the new text
    (its refusal links the file and removes the inbox name). The job's order.json was the same inode as the
    refusal's: it now holds the bytes the job read, the refusal the bytes written since, and nothing is read twice."""
    with open_seam(tmp_path) as s:
        refusal = tmp_path / "refusal-order.json"
        read, rewritten, placed = _rewritten_before_announce(s, refusal)
        job_order = (placed / "order.json").read_bytes()
        inbox = os.listdir(s.layout.inbox)
    assert job_order == read
    assert refusal.read_bytes() == rewritten
    assert inbox == []  # the refusal keeps the new bytes: not linked back to be read again


def test_a_claimed_file_rewritten_in_place_whose_new_bytes_no_other_name_holds_goes_back_to_inbox(
    tmp_path: Path,
) -> None:
    """The same, where the inbox name went and no other name holds the new bytes (the other daemon gave its
    refusal up): the job keeps what it read, and the new bytes are back in inbox/ under their name, to be read."""
    with open_seam(tmp_path) as s:
        read, rewritten, placed = _rewritten_before_announce(s, None)
        job_order = (placed / "order.json").read_bytes()
        back = (s.layout.inbox / "J1.json").read_bytes()
        inbox = os.listdir(s.layout.inbox)
    assert job_order == read
    assert back == rewritten and inbox == ["J1.json"]


def test_cancel_of_a_job_its_daemon_records_done_first_says_so_and_fails(tmp_path: Path) -> None:
    """`cancel` of a running job whose daemon records it done as the request lands (its agent had just exited):
    the command does not say "cancel requested" of a job that will never fail as cancelled; it says the job
    ended done first, and fails for that id (exit 1)."""
    import threading

    from dispatcher.errors import WrongState
    from dispatcher.ledger.base import Finish
    from dispatcher.ops.actions import Operator

    with open_seam(tmp_path) as s:
        started = s.started("J1")
        answer: list[object] = []

        def cancel() -> None:
            op = Operator(s.config, s.layout)
            try:
                answer.append(op.cancel("J1"))
            except WrongState as exc:
                answer.append(exc)
            finally:
                op.close()

        command = threading.Thread(target=cancel)
        command.start()
        deadline = time.monotonic() + 20
        while "J1" not in s.ledger.requests(Request.CANCEL):  # the daemon's finish lands after the request
            assert time.monotonic() < deadline, "the cancel request never came"
            time.sleep(0.005)
        assert s.ledger.finish([Finish("J1", started.token, Row.DONE)]) == [True]
        command.join(30)
    [said] = answer
    assert isinstance(said, WrongState), said
    assert str(said) == "J1: it ended done before the cancel reached it"
