"""Gathering evidence from a work/ folder: what is read, and what is deliberately not.

`evidence.gather` and `read_followups` run against real folders on tmp_path, with a
parse function that counts its calls, so that a cost bound is a number a test can see.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dispatcher.checks.builtin import followups_valid
from dispatcher.checks.evidence import gather, list_entries, read_followups
from dispatcher.checks.facts import Exit
from dispatcher.job.treehazards import hazard
from dispatcher.spec.orders import Order, parse_order, validate_order


def fill_outbox(work: Path, n: int) -> None:
    """Write n valid follow-up orders from `worker` into work/outbox/."""
    outbox = work / "outbox"
    outbox.mkdir(parents=True)
    for i in range(n):
        body = {"job_id": f"N{i:05d}", "from": "worker", "to": "worker", "task": "Next.", "items": [{"id": "R1"}]}
        (outbox / f"N{i:05d}.json").write_text(json.dumps(body))


def test_read_followups_parses_at_most_max_followups_plus_one(tmp_path: Path) -> None:
    """With 5,000 files in outbox/ and max_followups 100, only 101 are parsed; every file is still listed."""
    fill_outbox(tmp_path, 5000)
    calls: list[str] = []

    def parse(data: bytes, name: str) -> Order:
        calls.append(name)
        return parse_order(data, name)

    exists, found = read_followups(tmp_path, parse, 1 << 20, 100)
    assert exists is True
    assert len(calls) == 101
    assert len(found) == 5000
    assert [f.order is not None for f, _ in found].count(True) == 101
    left = found[-1][0]
    assert left.order is None and left.error == "not read: more than max_followups (100)"


def test_gather_passes_max_followups_to_the_check(tmp_path: Path) -> None:
    """gather(max_followups=...) reaches followups_valid: 3 follow-ups pass with 3 and fail with 2."""
    fill_outbox(tmp_path, 3)
    order = validate_order({"job_id": "J-1", "from": "tester", "to": "worker", "task": "Go.", "items": [{"id": "R1"}]})
    common: dict[str, Any] = {
        "order": order,
        "agent": "worker",
        "writes": (),
        "exit": Exit(code=0),
        "work": tmp_path,
        "given": {},
        "agents": {"worker"},
        "max_timeout_s": 60.0,
        "max_order_bytes": 1 << 20,
        "known": lambda ids: frozenset(),
        "hops": 0,
        "max_hops": 5,
    }
    ev, _ = gather(**common, max_followups=2)
    assert ev.max_followups == 2
    result = followups_valid(ev)
    assert (result.ok, result.detail) == (False, "3 follow-ups, more than max_followups (2)")
    ev, followups = gather(**common, max_followups=3)
    assert followups_valid(ev).ok is True
    assert len(followups) == 3
    ev, _ = gather(**common)
    assert ev.max_followups == 100


def test_a_link_that_climbs_out_through_another_link_is_outside(tmp_path: Path) -> None:
    """`d -> .` then `x -> d/../order.json` leaves work/: links are judged by where they resolve, not by their text."""
    work = tmp_path / "job" / "work"
    (work / "sub" / "p" / "p").mkdir(parents=True)
    (tmp_path / "job" / "order.json").write_text("{}")
    links = {
        "d": ".",  # a link to its own folder: inside
        "x": "d/../order.json",  # through d, then up: the job folder's order.json
        "sub/up": "..",  # back to work/: inside
        "y": "sub/up/../order.json",
        "sub/p/p/l": "../../../..",  # work/'s parent: outside itself
        "z": "sub/p/p/l/../../etc/passwd",
        "in": "sub/up/sub/p",  # through a link, yet inside
    }
    for name, target in links.items():
        (work / name).symlink_to(target)
    (work / "abs").symlink_to(work / "sub")  # inside today, by the path active/<id>/work: gone once the job moves
    found = {e.path: e.target_inside for e in list_entries(work, {}) if e.kind == "symlink"}
    assert found == {
        "d": True, "x": False, "sub/up": True, "y": False, "sub/p/p/l": False, "z": False, "in": True, "abs": False,
    }  # fmt: skip
    assert hazard(str(work), ["d", "in"]) is None
    assert hazard(str(work), ["x"]) == "x is a link that points outside the workspace"


def test_a_relative_link_out_of_work_and_back_through_the_job_folder_points_outside(tmp_path: Path) -> None:
    """`../../../../active/J/work/order.json` resolves inside work/ while the job is in active/, but names it by
    that path, as an absolute link does: gone once the job moves. A climb that stays below work/ is inside."""
    work = tmp_path / "active" / "J" / "work"
    (work / "data").mkdir(parents=True)
    (work / "order.json").write_text("{}")
    (work / "data" / "out").symlink_to("../../../../active/J/work/order.json")
    (work / "data" / "ok").symlink_to("../order.json")
    found = {e.path: e.target_inside for e in list_entries(work, {}) if e.kind == "symlink"}
    assert found == {"data/out": False, "data/ok": True}


def _deep(top: Path) -> Path:
    """Make top and, below it, a chain of folders longer than a path the system can name; return top."""
    top.mkdir(exist_ok=True)
    here = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(18):  # 18 x 251 bytes: past PATH_MAX (4096), made through folder descriptors
            os.mkdir("d" * 250, dir_fd=here)
            below = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = below
        fd = os.open("secret.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=here)
        os.close(fd)
        os.mkfifo("pipe", dir_fd=here)
    finally:
        os.close(here)
    return top


def test_an_entry_below_a_path_too_long_to_name_is_refused_not_passed_over(tmp_path: Path) -> None:
    """A file (or a FIFO) below a path longer than PATH_MAX cannot be looked at by path: it is an `unreadable`
    entry, which writes_scope refuses, in work/ and in a worktree alike, never an entry that is not there."""
    work = tmp_path / "work"
    work.mkdir()
    _deep(work)
    unreadable = [e.path for e in list_entries(work, {}) if e.kind == "unreadable"]
    assert len(unreadable) == 1 and unreadable[0].startswith("d" * 250 + "/"), unreadable
    tree = _deep(tmp_path / "tree")
    (tree / "tree-only").mkdir()  # the worktree's walk
    why = hazard(str(tree), [])
    assert why is not None and why.endswith(" cannot be listed") and why.startswith("d" * 250 + "/"), why


def _gathered(work: Path, **order: Any) -> Any:
    """Return the Evidence of work/ for an order J-1 (items R1, R2) of `worker`, with the given fields."""
    body = {"job_id": "J-1", "from": "tester", "to": "worker", "task": "Go.", "items": [{"id": "R1"}, {"id": "R2"}]}
    ev, _ = gather(
        order=validate_order({**body, **order}),
        agent="worker",
        writes=(),
        exit=Exit(code=0),
        work=work,
        given={},
        agents={"worker"},
        max_timeout_s=60.0,
        max_order_bytes=1 << 20,
        known=lambda ids: frozenset(),
        hops=0,
        max_hops=5,
    )
    return ev


def test_an_output_named_with_dot_slash_or_a_double_slash_is_the_file_it_names(tmp_path: Path) -> None:
    """accept.output `./o.csv` or `res//o.csv` is read, and writing it stays inside writes (none given)."""
    from dispatcher.checks.builtin import run_checks

    for output, path in (("./o.csv", "o.csv"), ("res//o.csv", "res/o.csv")):
        work = tmp_path / output.replace("/", "_")
        (work / path).parent.mkdir(parents=True)
        (work / path).write_text("id\nR1\nR2\n")
        receipt = {"job_id": "J-1", "input_ids": ["R1", "R2"], "output_ids": ["R1", "R2"], "status": "done"}
        (work / "receipt.json").write_text(json.dumps(receipt))
        ev = _gathered(work, accept={"output": output})
        failed = [(c.name, c.detail) for c in run_checks(ev) if c.ok is False]
        assert failed == [], (output, failed)


def test_a_receipt_with_nan_a_key_twice_or_not_in_utf8_is_not_valid_json(tmp_path: Path) -> None:
    """receipt_present passes only for JSON as the contract means it: no NaN, no key given twice, UTF-8."""
    from dispatcher.checks.builtin import receipt_present

    cases = {
        b'{"job_id": "J-1", "status": "done", "x": NaN}': "receipt.json is not valid JSON (x: NaN is not a JSON value)",
        b'{"job_id": "J-1", "status": "failed", "status": "done"}': (
            "receipt.json is not valid JSON (status: is a duplicate key)"
        ),
        '{"job_id": "J-1"}'.encode("utf-16"): "receipt.json is not valid JSON (not UTF-8 text (byte 0xff at offset 0))",
        b'\xef\xbb\xbf{"job_id": "J-1"}': "receipt.json is a JSON object",
    }
    for body, detail in cases.items():
        (tmp_path / "receipt.json").write_bytes(body)
        assert receipt_present(_gathered(tmp_path)).detail == detail, body


def test_work_is_read_only_as_a_folder_of_its_own_and_no_fd_is_left_open(tmp_path: Path) -> None:
    """A work/ that is a link to a folder, a file or missing has no evidence; a folder's files are read under it."""
    real = tmp_path / "real"
    (real / "res").mkdir(parents=True)
    (real / "res" / "o.csv").write_text("id\nR1\n")
    (real / "receipt.json").write_text('{"job_id": "J-1"}')
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "file").write_text("x")
    before = len(os.listdir("/proc/self/fd"))
    ev = _gathered(real, accept={"output": "res/o.csv"})
    assert ev.work_exists and ev.receipt.value == {"job_id": "J-1"} and ev.output is not None
    assert ev.output.error is None and not ev.output.missing
    assert sorted(e.path for e in ev.entries) == ["receipt.json", "res", "res/o.csv"]
    for name in ("link", "file", "gone"):
        ev = _gathered(tmp_path / name, accept={"output": "res/o.csv"})
        assert (ev.work_exists, ev.receipt.missing, ev.entries) == (False, True, ()), name
        assert ev.output is not None and ev.output.missing, name
    (real / "receipt.json").unlink()
    (real / "receipt.json").symlink_to(real / "res" / "o.csv")
    assert _gathered(real).receipt.error == "is a symlink, not a regular file"
    (real / "via").symlink_to(real / "res")  # the output named through a linked folder: never followed
    ev = _gathered(real, accept={"output": "via/o.csv"})
    assert ev.output is not None and ev.output.error == "is under a path part that is not a folder, not a regular file"
    assert len(os.listdir("/proc/self/fd")) == before
