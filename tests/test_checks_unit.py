"""The checks of contract section 5 as pure functions, on hand-built Evidence.

No daemon, no files: each test builds the Evidence an attempt could leave (a good
job, then one thing bent) and calls one check, `run_checks` or `verdict` directly.
The end-to-end counterpart, with a real daemon and real agents, is test_checks_e2e.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import CHECK_NAMES

from dispatcher.checks import builtin as checks
from dispatcher.checks.builtin import run_checks, verdict
from dispatcher.checks.facts import Doc, Entry, Evidence, Exit, Followup
from dispatcher.checks.stream import summarise_fd
from dispatcher.checks.summary import summarise
from dispatcher.spec.orders import Order, validate_order
from dispatcher.spec.result import CheckResult

CONTRACT_ORDER = CHECK_NAMES
IDS = ["R1", "R2", "R3"]
GIVEN = {"order.json": "sha-of-order"}
ACCEPT = {"output": "out.csv", "allowed": {"team": ["orders", "payments"]}, "required": ["team"]}
BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


# -- builders ------------------------------------------------------------------------------------


def make_order(**extra: Any) -> Order:
    """Return a validated order J-1 for `worker` with items R1..R3 (fields replaced by extra)."""
    body: dict[str, Any] = {
        "job_id": "J-1",
        "from": "tester",
        "to": "worker",
        "task": "Assign each request to one team.",
        "items": [{"id": i} for i in IDS],
        "accept": ACCEPT,
    }
    body.update(extra)
    return validate_order({k: v for k, v in body.items() if v is not None})


def receipt(**extra: Any) -> Doc:
    """Return a good parsed receipt for J-1, with fields replaced by extra."""
    body: dict[str, Any] = {
        "job_id": "J-1",
        "input_ids": IDS,
        "output_ids": IDS,
        "status": "done",
        "outputs": ["out.csv"],
    }
    body.update(extra)
    return Doc(value=body)


def rows(*ids: Any, **fields: Any) -> list[dict[str, Any]]:
    """Return output records, one per id, team `orders` unless fields say otherwise."""
    return [{"id": i, "team": "orders", **fields} for i in ids]


def files(*paths: str) -> tuple[Entry, ...]:
    """Return work/ entries: the given order.json unchanged, then these new regular files."""
    return (Entry("order.json", "file", digest=GIVEN["order.json"]), *(Entry(p, "file") for p in paths))


def evidence(**over: Any) -> Evidence:
    """Return the Evidence of a job that kept every rule; keyword arguments bend one part.

    An ``output`` given as a list of records is summarised against the order, as the
    daemon's reader would have summarised the file.
    """
    base: dict[str, Any] = {
        "order": make_order(),
        "agent": "worker",
        "writes": ("out.csv",),
        "exit": Exit(code=0, seconds=0.41, timeout_s=30),
        "receipt": receipt(),
        "output": rows(*IDS),
        "work_exists": True,
        "entries": files("out.csv", "receipt.json"),
        "given": GIVEN,
        "outbox_exists": False,
        "followups": (),
    }
    base.update(over)
    if isinstance(base["output"], list):
        base["output"] = Doc(value=summarise(base["order"], base["output"]))
    return Evidence(**base)


def followup(job_id: str, to: str = "assigner", sender: str = "worker", **extra: Any) -> Followup:
    """Return one parsed follow-up order found in work/outbox/."""
    body: dict[str, Any] = {"job_id": job_id, "from": sender, "to": to, "task": "Next step.", "items": [{"id": "R1"}]}
    body.update(extra)
    return Followup(f"{job_id}.json", order=validate_order(body))


def outbox(*found: Followup, **over: Any) -> Evidence:
    """Return good Evidence whose work/outbox/ holds these follow-ups."""
    return evidence(outbox_exists=True, followups=found, **over)


def results(**ok: bool | None) -> list[CheckResult]:
    """Return a passing result for every check, with the named ones set to the given ok."""
    return [CheckResult(n, ok.get(n, True), f"{n} detail") for n in CONTRACT_ORDER]


# -- one table row per (check, evidence, expected ok, text the detail must hold) ----------------

NO_ACCEPT = make_order(accept=None)
NO_RECEIPT = Doc(missing=True)

CASES = [
    # exit_ok
    ("exit_ok", evidence(), True, "exit 0 in 0.41 s"),
    ("exit_ok", evidence(exit=Exit(code=3, seconds=1.5)), False, "exit 3 in 1.50 s"),
    ("exit_ok", evidence(exit=Exit(code=-9, seconds=2)), False, "killed by SIGKILL"),
    ("exit_ok", evidence(exit=Exit(code=-15, timed_out=True, timeout_s=2)), False, "timed out after 2 s"),
    ("exit_ok", evidence(exit=Exit(code=0, timed_out=True, timeout_s=2)), False, "timed out"),
    ("exit_ok", evidence(exit=Exit(code=-15, aborted="cancelled", seconds=1)), False, "cancelled"),
    ("exit_ok", evidence(exit=Exit(code=None)), False, "no exit status"),
    ("exit_ok", evidence(exit=Exit(lost=True)), None, "exit status lost"),
    ("exit_ok", evidence(exit=Exit(lost=True), receipt=NO_RECEIPT), False, "exit status lost: the daemon stopped"),
    # receipt_present
    ("receipt_present", evidence(), True, "JSON object"),
    ("receipt_present", evidence(receipt=NO_RECEIPT), False, "no receipt.json"),
    ("receipt_present", evidence(receipt=Doc(error="is not valid JSON (x)")), False, "is not valid JSON"),
    ("receipt_present", evidence(receipt=Doc(error="is a FIFO, not a regular file")), False, "FIFO"),
    ("receipt_present", evidence(receipt=Doc(value=["J-1"])), False, "not a JSON object"),
    ("receipt_present", evidence(receipt=Doc(value=None)), False, "not a JSON object"),
    # receipt_job_id
    ("receipt_job_id", evidence(), True, "J-1"),
    ("receipt_job_id", evidence(receipt=receipt(job_id="J-2")), False, '"J-2", expected "J-1"'),
    ("receipt_job_id", evidence(receipt=receipt(job_id=None)), False, 'job_id is missing, expected "J-1"'),
    ("receipt_job_id", evidence(receipt=receipt(job_id=True)), False, 'job_id is true, expected "J-1"'),
    ("receipt_job_id", evidence(order=make_order(job_id="123"), receipt=receipt(job_id=123)), False, "123"),
    ("receipt_job_id", evidence(receipt=NO_RECEIPT), None, "no usable receipt"),
    ("receipt_job_id", evidence(receipt=Doc(value=[1])), None, "no usable receipt"),
    # receipt_status
    ("receipt_status", evidence(), True, "done"),
    ("receipt_status", evidence(receipt=receipt(status="failed", reason="no data")), False, "no data"),
    ("receipt_status", evidence(receipt=receipt(status="failed")), False, "status is failed"),
    ("receipt_status", evidence(receipt=receipt(status="ok")), False, '"ok"'),
    ("receipt_status", evidence(receipt=receipt(status=None)), False, "status is missing, expected"),
    ("receipt_status", evidence(receipt=receipt(status=["done"])), False, 'status is ["done"], expected'),
    ("receipt_status", evidence(receipt=NO_RECEIPT), None, "no usable receipt"),
    # receipt_inputs
    ("receipt_inputs", evidence(receipt=receipt(input_ids=["R3", "R1", "R2"])), True, "3 input ids"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids=["R1", "R2"])), False, "missing R3"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids=[*IDS, "R4"])), False, "extra R4"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids=[*IDS, "R1"])), False, "repeated R1"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids=[])), False, "missing R1, R2, R3"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids="R1,R2,R3")), False, "not a list"),
    ("receipt_inputs", evidence(receipt=receipt(input_ids=[1, "R2", "R3"])), False, "missing R1; extra 1"),
    ("receipt_inputs", evidence(receipt=NO_RECEIPT), None, "no usable receipt"),
    # output_rows
    ("output_rows", evidence(), True, "3 records"),
    ("output_rows", evidence(order=NO_ACCEPT, output=None), None, "no accept.output"),
    ("output_rows", evidence(output=Doc(missing=True)), False, "out.csv is missing"),
    ("output_rows", evidence(output=Doc(error="cannot be parsed (x)")), False, "out.csv cannot be parsed"),
    ("output_rows", evidence(output=rows("R1", "R2")), False, "missing R3"),
    ("output_rows", evidence(output=rows(*IDS, "R9")), False, "extra R9"),
    ("output_rows", evidence(output=rows(*IDS, "R2")), False, "repeated R2"),
    ("output_rows", evidence(output=[{"team": "orders"}, *rows(*IDS)]), False, "none in 1 record"),
    (
        "output_rows",
        evidence(
            order=make_order(accept={"output": "out.json", "key": "ref"}),
            output=[{"ref": i} for i in IDS],
        ),
        True,
        "one per item",
    ),
    ("output_rows", evidence(output=rows(*IDS), receipt=NO_RECEIPT), True, "3 records"),
    # receipt_outputs
    ("receipt_outputs", evidence(), True, "3 output ids match out.csv"),
    ("receipt_outputs", evidence(receipt=receipt(output_ids=["R2", "R3", "R1"])), True, "match"),
    ("receipt_outputs", evidence(order=NO_ACCEPT, output=None), None, "no accept.output"),
    ("receipt_outputs", evidence(receipt=NO_RECEIPT), None, "no usable receipt"),
    ("receipt_outputs", evidence(output=Doc(missing=True)), None, "no usable output"),
    ("receipt_outputs", evidence(receipt=receipt(output_ids=["R1", "R2"])), False, "missing R3"),
    ("receipt_outputs", evidence(receipt=receipt(output_ids=[*IDS, "R9"])), False, "extra R9"),
    ("receipt_outputs", evidence(receipt=receipt(output_ids=[*IDS, "R1"])), False, "counts differ"),
    ("receipt_outputs", evidence(receipt=receipt(output_ids="R1")), False, "not a list"),
    ("receipt_outputs", evidence(output=rows("R1"), receipt=receipt(output_ids=["R1"])), True, "1 output id matches"),
    # allowed_values
    ("allowed_values", evidence(), True, "3 records"),
    ("allowed_values", evidence(order=make_order(accept={"output": "out.csv"})), None, "no accept.allowed"),
    ("allowed_values", evidence(output=Doc(missing=True)), None, "no usable output"),
    ("allowed_values", evidence(output=rows(*IDS, team="bakery")), False, 'R1: team "bakery" is not allowed'),
    ("allowed_values", evidence(output=rows(*IDS, team=True)), False, "record R1: team true is not allowed"),
    (
        "allowed_values",
        evidence(order=make_order(accept={"output": "out.csv", "allowed": {"w": ["1"]}}), output=rows(*IDS)),
        False,
        "record R1: w is missing",
    ),
    ("allowed_values", evidence(output=rows(*IDS, team="")), False, "required field team is empty"),
    ("allowed_values", evidence(output=rows(*IDS, team=None)), False, "required field team is empty"),
    ("allowed_values", evidence(output=[{"id": i} for i in IDS]), False, "field team is empty"),
    (
        "allowed_values",
        evidence(order=make_order(accept={"output": "o.json", "required": ["n"]}), output=rows(*IDS, n=[])),
        False,
        "field n is empty",
    ),
    (
        "allowed_values",
        evidence(order=make_order(accept={"output": "o.json", "required": ["n"]}), output=rows(*IDS, n=0)),
        True,
        "3 records",
    ),
    (
        "allowed_values",
        evidence(order=make_order(accept={"output": "o.json", "allowed": {"n": [1, None]}}), output=rows(*IDS, n=None)),
        True,
        "3 records",
    ),
    # writes_scope
    ("writes_scope", evidence(), True, "inside writes"),
    ("writes_scope", evidence(work_exists=False, entries=()), False, "work/ is gone"),
    ("writes_scope", evidence(entries=(Entry("out.csv", "file"),)), False, "order.json was given and is deleted"),
    ("writes_scope", evidence(entries=(Entry("order.json", "file", digest="other"),)), False, "is changed"),
    ("writes_scope", evidence(entries=(Entry("order.json", "symlink"),)), False, "order.json was given and is changed"),
    ("writes_scope", evidence(entries=files("notes.txt")), False, "notes.txt is outside writes (out.csv)"),
    ("writes_scope", evidence(writes=(), entries=files("x")), False, "outside writes (none)"),
    ("writes_scope", evidence(writes=("reports/*.csv",), entries=files("reports/2026/11/a.csv")), True, "inside"),
    ("writes_scope", evidence(writes=("reports/*.csv",), entries=files("reports/a.json")), False, "reports/a.json"),
    ("writes_scope", evidence(writes=("[x].csv",), entries=files("[x].csv")), True, "inside writes"),
    ("writes_scope", evidence(writes=(), entries=files("receipt.json", "outbox/a/b.json")), True, "inside"),
    ("writes_scope", evidence(writes=(), entries=(*files(), Entry("tmp", "dir"), Entry("tmp/x", "dir"))), True, "in"),
    ("writes_scope", evidence(entries=(*files(), Entry("out.csv", "symlink", target_inside=False))), False, "points"),
    ("writes_scope", evidence(entries=(*files(), Entry("out.csv", "symlink", target_inside=True))), True, "inside"),
    ("writes_scope", evidence(entries=(*files(), Entry("out.csv", "fifo"))), False, "out.csv is a fifo"),
    ("writes_scope", evidence(entries=(*files(), Entry("out.csv", "socket"))), False, "out.csv is a socket"),
    ("writes_scope", evidence(entries=(*files(), Entry("receipt.json", "device"))), False, "is a device"),
    ("writes_scope", evidence(entries=(*files(), Entry("out.csv", "file", nlink=2))), False, "has 2 hard links"),
    # followups_valid
    ("followups_valid", evidence(), None, "no outbox/"),
    ("followups_valid", outbox(), True, "no follow-ups"),
    ("followups_valid", outbox(followup("J-1.next")), True, "1 follow-up valid"),
    ("followups_valid", outbox(followup("A"), followup("B", to="reviewer")), True, "2 follow-ups valid"),
    ("followups_valid", outbox(Followup("x.txt", error="not a work order")), False, "outbox/x.txt: not a work order"),
    ("followups_valid", outbox(followup("J-1")), False, "this job's own"),
    ("followups_valid", outbox(followup("A"), Followup("B.json", order=followup("A").order)), False, "repeated"),
    ("followups_valid", outbox(followup("OLD"), known_ids=frozenset({"OLD"})), False, "OLD is already known"),
    ("followups_valid", outbox(followup("A", sender="tester")), False, 'from is "tester", expected "worker"'),
    ("followups_valid", outbox(followup("A", parent="J-1")), False, "parent and hops are set by the daemon"),
    ("followups_valid", outbox(followup("A", hops=0)), False, "parent and hops"),
    ("followups_valid", outbox(followup("A"), hops=5, max_hops=5), False, "hops 6 would exceed max_hops 5"),
    ("followups_valid", outbox(followup("A"), hops=4, max_hops=5), True, "1 follow-up valid"),
    ("followups_valid", outbox(followup("A"), max_hops=0), False, "exceed max_hops 0"),
]
FOLLOWUPS = make_order(accept={"followups": ["assigner"]})
CASES += [
    ("followups_valid", evidence(order=FOLLOWUPS), False, "exactly one follow-up to assigner, found 0"),
    ("followups_valid", outbox(followup("A"), order=FOLLOWUPS), True, "1 follow-up valid"),
    ("followups_valid", outbox(followup("A"), followup("B"), order=FOLLOWUPS), False, "found 2"),
    ("followups_valid", outbox(followup("A"), followup("B", to="x"), order=FOLLOWUPS), False, "not in accept"),
    ("followups_valid", outbox(followup("A"), order=make_order(accept={"followups": []})), False, "assigner"),
    ("followups_valid", evidence(order=make_order(accept={"followups": []})), True, "no follow-ups"),
]


def _case_id(case: tuple[str, Evidence, bool | None, str]) -> str:
    return f"{case[0]}-{case[2]}-{case[3][:40]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_check_outcome_and_detail(case: tuple[str, Evidence, bool | None, str]) -> None:
    """Each check passes, fails or records null as the contract says, with a detail saying why."""
    name, ev, ok, text = case
    result = getattr(checks, name)(ev)
    assert result.name == name
    assert result.ok is ok, result
    assert text in result.detail, result


def test_every_check_has_pass_fail_and_null_cases() -> None:
    """The table above covers true and false for every check, and null wherever the contract allows it."""
    seen = {(name, ok) for name, _ev, ok, _text in CASES}
    may_be_null = set(CONTRACT_ORDER) - {"receipt_present", "writes_scope"}
    for name in CONTRACT_ORDER:
        assert (name, True) in seen and (name, False) in seen, name
        assert ((name, None) in seen) == (name in may_be_null), name


# -- order and completeness ---------------------------------------------------------------------


def test_checks_run_in_contract_order() -> None:
    """CHECKS holds one function per contract check, in the contract's order."""
    assert [c.__name__ for c in checks.CHECKS] == CONTRACT_ORDER
    assert [r.name for r in run_checks(evidence())] == CONTRACT_ORDER


def test_every_check_runs_after_earlier_failures() -> None:
    """With everything wrong at once, all ten checks still run and are recorded, in order."""
    ev = evidence(
        exit=Exit(code=2),
        receipt=NO_RECEIPT,
        output=Doc(missing=True),
        work_exists=False,
        entries=(),
        outbox_exists=True,
        followups=(Followup("bad.json", error="not valid JSON"),),
    )
    got = run_checks(ev)
    assert [r.to_json()["name"] for r in got] == CONTRACT_ORDER
    assert [r.ok for r in got] == [False, False, None, None, None, False, None, None, False, False]
    assert all(isinstance(r.detail, str) and r.detail for r in got)


def test_good_evidence_passes_every_applicable_check() -> None:
    """A job that kept every rule passes each check that applies; only followups_valid is null."""
    got = run_checks(evidence())
    assert {r.name: r.ok for r in got} == dict.fromkeys(CONTRACT_ORDER, True) | {"followups_valid": None}
    assert verdict(got) is None


def test_result_json_entry_shape() -> None:
    """A check result serialises as exactly name, ok and detail, as result.json records it."""
    assert checks.exit_ok(evidence()).to_json() == {"name": "exit_ok", "ok": True, "detail": "exit 0 in 0.41 s"}


def test_checks_without_input_say_why_they_are_null() -> None:
    """No receipt and no accept: the checks that need them record null with a non-empty reason."""
    got = {r.name: r for r in run_checks(evidence(order=NO_ACCEPT, receipt=NO_RECEIPT, output=None))}
    for name in ("receipt_job_id", "receipt_status", "receipt_inputs", "output_rows", "receipt_outputs"):
        assert got[name].ok is None and got[name].detail, got[name]
    assert got["allowed_values"].ok is None and "accept" in got["allowed_values"].detail


# -- values an agent controls -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ev"),
    [
        ("receipt_inputs", evidence(receipt=receipt(input_ids=[["R1"], "R2", "R3"]))),
        ("receipt_inputs", evidence(receipt=receipt(input_ids=[{"id": "R1"}, "R2", "R3"]))),
        ("output_rows", evidence(output=[{"id": ["R1"]}, {"id": "R2"}, {"id": "R3"}])),
        ("output_rows", evidence(output=[{"id": {"x": 1}}, {"id": "R2"}, {"id": "R3"}])),
        ("receipt_outputs", evidence(receipt=receipt(output_ids=[["R1"], "R2", "R3"]))),
    ],
    ids=["input-list", "input-object", "row-list", "row-object", "output-ids-list"],
)
def test_ids_of_any_json_type_fail_the_check_instead_of_crashing(name: str, ev: Evidence) -> None:
    """An id that is a JSON list or object (the agent wrote it) makes the check false, never raises."""
    result = getattr(checks, name)(ev)
    assert result.ok is False, result
    assert result.detail


@pytest.mark.parametrize(
    ("allowed", "value"),
    [([True], 1), ([False], 0), ([1], True), ([0], False)],
    ids=["true-vs-1", "false-vs-0", "1-vs-true", "0-vs-false"],
)
def test_allowed_values_tells_booleans_from_numbers(allowed: list[Any], value: Any) -> None:
    """In JSON 1 is not true: a number is not an allowed value because a boolean of equal value is."""
    order = make_order(accept={"output": "out.json", "allowed": {"flag": allowed}})
    result = checks.allowed_values(evidence(order=order, output=rows(*IDS, flag=value)))
    assert result.ok is False, result


HOSTILE = "a\nb\r\u2028c\u2029\x1b[31m\x00\x85d"
HOSTILE_EVIDENCE = [
    evidence(receipt=receipt(job_id=HOSTILE)),
    evidence(receipt=receipt(status="failed", reason=HOSTILE)),
    evidence(receipt=receipt(status=HOSTILE)),
    evidence(receipt=receipt(input_ids=[*IDS, HOSTILE], output_ids=[HOSTILE])),
    evidence(output=[{"id": HOSTILE, "team": HOSTILE}]),
    evidence(output=Doc(error=f"cannot be parsed ({HOSTILE})")),
    evidence(receipt=Doc(error=f"is not valid JSON ({HOSTILE})")),
    evidence(entries=files(f"dir{HOSTILE}/x.txt")),
    evidence(entries=files("bad\udcffname.txt")),
    evidence(writes=(HOSTILE,), entries=files("x")),
    outbox(Followup(f"x{HOSTILE}.json", error=HOSTILE)),
    outbox(followup("A", sender="worker-2"), agent=HOSTILE),
    evidence(exit=Exit(code=-15, aborted=HOSTILE)),
]


@pytest.mark.parametrize("ev", HOSTILE_EVIDENCE, ids=[str(i) for i in range(len(HOSTILE_EVIDENCE))])
def test_details_are_one_printable_line(ev: Evidence) -> None:
    """Line breaks, control characters and undecodable bytes from an agent never break a detail's one line."""
    got = run_checks(ev)
    assert any(r.ok is False for r in got)
    for r in got:
        assert not BREAKS.search(r.detail), r
        r.detail.encode("utf-8")  # no lone surrogate: result.json can be written as UTF-8
    reason = verdict(got)
    assert reason is not None and not BREAKS.search(reason)


def test_a_printable_detail_beyond_ascii_is_kept_as_written() -> None:
    """Printable text beyond ASCII (a receipt's reason in German, a CJK name) is a detail as it is, not escaped."""
    reason = "Bäckerei geschlossen 東京 \u00a0 ✓"
    result = checks.receipt_status(evidence(receipt=receipt(status="failed", reason=reason)))
    assert (result.ok, result.detail) == (False, f"the agent reported failure: {reason}")


@pytest.mark.parametrize(
    ("reason", "shown_as"),
    [(3600.0, "3600"), (True, "true"), (["a", "b"], "a, b"), ({"why": None, "l": ["a"]}, '{"why": null, "l": ["a"]}')],
)
def test_a_reason_that_is_not_text_is_shown_without_python_notation(reason: Any, shown_as: str) -> None:
    """A receipt's `reason` of another JSON type reads as a person would write it (contract 7), never `3600.0`,
    `True`, `['a']` or `None`."""
    result = checks.receipt_status(evidence(receipt=receipt(status="failed", reason=reason)))
    assert (result.ok, result.detail) == (False, f"the agent reported failure: {shown_as}")


def test_lone_surrogate_in_an_output_id_is_shown_escaped() -> None:
    """An output id holding a lone surrogate (valid JSON, not UTF-8) is shown as an escape, not a crashed check."""
    result = checks.allowed_values(evidence(output=[{"id": "\ud800", "team": "bakery"}]))
    assert (result.ok, result.detail) == (False, 'record \\ud800: team "bakery" is not allowed')


# -- verdict ------------------------------------------------------------------------------------


def test_verdict_done_when_nothing_fails() -> None:
    """Every check true or null (except the three that must pass) means done: verdict is None."""
    nulls = {n: None for n in CONTRACT_ORDER[3:]}
    assert verdict(results()) is None
    assert verdict(results(**nulls)) is None


def test_verdict_names_the_first_failing_check() -> None:
    """The reason is `<first failing check>: <its detail>`, in contract order."""
    assert verdict(results(writes_scope=False, receipt_status=False)) == "receipt_status: receipt_status detail"
    ev = evidence(exit=Exit(code=3, seconds=1), receipt=receipt(status="failed"))
    assert verdict(run_checks(ev)) == "exit_ok: exit 3 in 1.00 s"


@pytest.mark.parametrize("name", ["exit_ok", "receipt_present", "receipt_job_id"])
def test_verdict_requires_the_three_checks_to_be_true(name: str) -> None:
    """exit_ok, receipt_present and receipt_job_id must be true: null for one of them fails the job."""
    assert verdict(results(**{name: None})) == f"{name}: {name} detail"


def test_verdict_with_exit_lost_accepts_null_exit_ok() -> None:
    """After a crash hid the exit status, a null exit_ok no longer fails a job whose other checks pass."""
    assert verdict(results(exit_ok=None), exit_lost=True) is None
    lost = run_checks(evidence(exit=Exit(lost=True)))
    assert lost[0].ok is None
    assert verdict(lost, exit_lost=True) is None
    reason = verdict(lost)
    assert reason is not None and reason.startswith("exit_ok: exit status lost")


def test_verdict_exit_lost_excuses_nothing_else() -> None:
    """exit_lost excuses only a null exit_ok: a false exit_ok or a null receipt_job_id still fail."""
    assert verdict(results(exit_ok=False), exit_lost=True) == "exit_ok: exit_ok detail"
    assert (
        verdict(results(exit_ok=None, receipt_job_id=None), exit_lost=True) == "receipt_job_id: receipt_job_id detail"
    )
    assert verdict(results(exit_ok=None, followups_valid=False), exit_lost=True) == (
        "followups_valid: followups_valid detail"
    )


# -- outputs too big to keep, details too long to print -------------------------------------------


def many(n: int, prefix: str = "X") -> list[dict[str, Any]]:
    """Return n output records whose ids are not item ids."""
    return [{"id": f"{prefix}{i}", "team": "orders"} for i in range(n)]


def test_output_with_thousands_of_other_ids_names_some_and_counts_the_rest() -> None:
    """Beyond the first 1000 other ids, records are counted, not kept; the detail still names every problem."""
    ev = evidence(output=[*rows(*IDS), *many(5000), *rows("R2")])
    summary = ev.output.value
    assert len(summary.others) == 1000 and summary.uncounted == 4000 and summary.records == 5004
    result = checks.output_rows(ev)
    assert result.ok is False
    assert result.detail.startswith("out.csv id: extra X0, X1, X10, ")
    assert "(cut, " in result.detail and "and 4000 more records with other ids)" in result.detail
    assert result.detail.endswith("; repeated R2")
    assert len(result.detail) < checks.DETAIL_MAX


@pytest.mark.parametrize(
    ("output_ids", "text"),
    [
        ([*IDS, *(f"X{i}" for i in range(5000))], "cannot be compared in full"),
        ([*IDS, *(f"X{i}" for i in range(4999))], "counts differ"),
        ([*IDS, *(f"X{i}" for i in range(1, 5001))], "missing X0"),
        ([*IDS, "R1", *(f"X{i}" for i in range(4999))], "counts differ"),
        (["R1", "R2", "R4", *(f"X{i}" for i in range(5000))], "missing R3"),
    ],
    ids=["same-ids", "one-fewer", "one-kept-id-missing", "item-repeated", "item-swapped"],
)
def test_receipt_outputs_is_conservative_when_output_ids_were_not_all_kept(output_ids: list[str], text: str) -> None:
    """When some output ids were only counted, receipt_outputs never passes, and says what it could tell."""
    ev = evidence(output=[*rows(*IDS), *many(5000)], receipt=receipt(output_ids=output_ids))
    result = checks.receipt_outputs(ev)
    assert result.ok is False
    assert text in result.detail, result.detail


def test_receipt_outputs_names_an_item_id_no_record_carries_even_when_ids_were_not_all_kept() -> None:
    """An item id in output_ids that no record holds is reported as extra: item ids are always counted exactly."""
    ev = evidence(
        output=[*rows("R1", "R2"), *many(2000)], receipt=receipt(output_ids=[*IDS, *(f"X{i}" for i in range(1999))])
    )
    result = checks.receipt_outputs(ev)
    assert result.ok is False and "extra R3" in result.detail, result.detail


def test_long_ids_are_compared_exactly() -> None:
    """Other ids longer than the kept length are compared by digest: equal ones match, different ones do not."""
    long_ids = ["L" * 5000 + str(i) for i in range(3)]
    out = [*rows(*IDS), *({"id": i, "team": "orders"} for i in long_ids)]
    assert checks.receipt_outputs(evidence(output=out, receipt=receipt(output_ids=[*IDS, *long_ids]))).ok is True
    wrong = [*IDS, *long_ids[:2], "L" * 5000 + "9"]
    assert checks.receipt_outputs(evidence(output=out, receipt=receipt(output_ids=wrong))).ok is False


def test_allowed_values_reports_the_first_bad_record_of_a_long_output() -> None:
    """The first record breaking accept.allowed is found however far into the output it is."""
    out = [*rows(*IDS), *many(3000), {"id": "X9", "team": "bakery"}, {"id": "X8", "team": ""}]
    result = checks.allowed_values(evidence(output=out))
    assert (result.ok, result.detail) == (False, 'record X9: team "bakery" is not allowed')


def test_receipt_with_100000_extra_input_ids_gives_a_short_detail_that_says_it_was_cut() -> None:
    """A receipt listing 100,000 extra input_ids fails with a detail of bounded length that says how much was cut."""
    ev = evidence(receipt=receipt(input_ids=[*IDS, *(f"EXTRA-{i}" for i in range(100_000))]))
    result = checks.receipt_inputs(ev)
    assert result.ok is False
    assert result.detail.startswith("input_ids: extra EXTRA-0, EXTRA-1, ")
    assert "(cut, " in result.detail and "more)" in result.detail
    assert len(result.detail) <= checks.DETAIL_MAX
    reason = verdict(run_checks(ev))
    assert reason == f"receipt_inputs: {result.detail}"


def test_any_detail_longer_than_1000_characters_is_cut_with_a_note() -> None:
    """A detail over 1000 characters keeps its first 1000 and ends saying how many more were cut; the reason too."""
    ev = evidence(receipt=receipt(status="failed", reason="x" * 5000))
    result = checks.receipt_status(ev)
    assert result.ok is False
    head = "the agent reported failure: "
    assert result.detail == head + "x" * (1000 - len(head)) + f"\u2026 (cut, {5000 - 1000 + len(head)} more characters)"
    reason = verdict(run_checks(ev))
    assert reason is not None and reason.endswith("more characters)") and len(reason) < 1100


def test_a_check_that_raises_has_its_detail_cut_too() -> None:
    """Even the error of a check that crashed is cut to the detail limit."""

    class Huge(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            raise ValueError("y" * 5000)

    got = {r.name: r for r in run_checks(evidence(receipt=Doc(value=Huge())))}
    assert got["receipt_job_id"].ok is False
    assert got["receipt_job_id"].detail.startswith("the check failed: ValueError('yyy")
    assert got["receipt_job_id"].detail.endswith("more characters)")


# -- max_followups -------------------------------------------------------------------------------


def test_more_follow_ups_than_max_followups_fail() -> None:
    """An outbox holding more orders than max_followups fails followups_valid, saying how many and the limit."""
    found = tuple(followup(f"N{i}") for i in range(3))
    result = checks.followups_valid(outbox(*found, max_followups=2))
    assert (result.ok, result.detail) == (False, "3 follow-ups, more than max_followups (2)")
    assert checks.followups_valid(outbox(*found, max_followups=3)).ok is True


def test_max_followups_0_allows_no_follow_up() -> None:
    """max_followups 0 (as max_hops 0) means a job may hand off nothing: one follow-up fails, in the singular."""
    result = checks.followups_valid(outbox(followup("N1"), max_followups=0))
    assert (result.ok, result.detail) == (False, "1 follow-up, more than max_followups (0)")
    assert checks.followups_valid(outbox(max_followups=0)).ok is not False


def test_max_followups_defaults_to_100() -> None:
    """Without max_followups, 100 follow-ups pass and 101 fail."""
    assert evidence().max_followups == 100
    assert checks.followups_valid(outbox(*(followup(f"N{i}") for i in range(100)))).ok is True
    result = checks.followups_valid(outbox(*(followup(f"N{i}") for i in range(101))))
    assert (result.ok, result.detail) == (False, "101 follow-ups, more than max_followups (100)")


@pytest.mark.parametrize("pattern", ["./x.txt", "./sub/./*.csv", "sub//*.csv"])
def test_writes_with_dot_or_empty_parts_match_what_they_name(pattern: str) -> None:
    """`./x.txt` in an order's writes is x.txt: the agent may write what the pattern names."""
    order = make_order(writes=[pattern])
    path = "x.txt" if pattern == "./x.txt" else "sub/out.csv"
    assert order.writes is not None
    assert checks.in_scope(path, order.writes), order.writes
    assert not checks.in_scope("other.txt", order.writes)


def test_details_never_show_python_notation() -> None:
    """Records without an id, a number where a string id was, a string where a number was allowed: plain or JSON."""
    no_ids = evidence(output=[{"ID": i} for i in IDS], receipt=receipt(output_ids=["A", "B"]))
    details = {c.name: c.detail for c in run_checks(no_ids)}
    assert details["output_rows"] == "out.csv id: missing R1, R2, R3; none in 3 records"
    assert details["receipt_outputs"] == "output_ids differ from out.csv: missing null; extra A, B"
    numeric = {c.name: c.detail for c in run_checks(evidence(output=[*rows("R1", "R2"), {"id": 1}]))}
    assert numeric["output_rows"] == "out.csv id: missing R3; extra 1"
    allowed = make_order(accept={"output": "out.csv", "allowed": {"n": [1, 2]}})
    typed = {c.name: c.detail for c in run_checks(evidence(order=allowed, output=rows(*IDS, n="1")))}
    assert typed["allowed_values"] == 'record R1: n "1" is not allowed'
    for text in (*details.values(), *numeric.values(), *typed.values()):
        assert "None" not in text and "'" not in text, text


def test_ids_in_another_order_pass_with_the_same_details_as_ids_in_item_order() -> None:
    """The item ids in order (the usual receipt and output) and the same ids shuffled pass alike."""
    shuffled = list(reversed(IDS))
    in_order = {c.name: c for c in run_checks(evidence())}
    other = {c.name: c for c in run_checks(evidence(receipt=receipt(input_ids=shuffled, output_ids=shuffled)))}
    moved = {c.name: c for c in run_checks(evidence(output=rows(*shuffled)))}
    for name in ("receipt_inputs", "output_rows", "receipt_outputs"):
        assert in_order[name].ok is True, in_order[name]
        assert other[name] == in_order[name] == moved[name], name


def test_ids_that_differ_only_in_type_are_told_apart_in_the_detail() -> None:
    """Item ids "1", "2" against receipt ids 1, 2: the detail quotes the strings, so the two lists never read alike."""
    order = make_order(items=[{"id": "1"}, {"id": "2"}], accept=None)
    ev = evidence(order=order, receipt=receipt(input_ids=[1, 2], output_ids=[1, 2]), output=None)
    [inputs] = [c for c in run_checks(ev) if c.name == "receipt_inputs"]
    assert (inputs.ok, inputs.detail) == (False, 'input_ids: missing "1", "2"; extra 1, 2')
    empty = evidence(receipt=receipt(input_ids=[*IDS, ""]))
    [inputs] = [c for c in run_checks(empty) if c.name == "receipt_inputs"]
    assert inputs.detail == 'input_ids: extra ""'


@pytest.mark.parametrize(
    ("fmt", "text", "allowed", "ok"),
    [
        ("csv", "id,level\nR1,2\nR2,3\nR3,1\n", [1, 2, 3], True),  # a CSV cell is text: 2 allows "2"
        ("csv", "id,level\nR1,2.5\nR2,1\nR3,1\n", [1, 2.5], True),
        ("csv", "id,level\nR1,true\nR2,false\nR3,true\n", [True, False], True),
        ("csv", "id,level\nR1,4\nR2,1\nR3,1\n", [1, 2, 3], False),
        ("csv", "id,level\nR1,2\nR2,1\nR3,1\n", ["1", "2"], True),
        ("json", '[{"id": "R1", "level": 1.0}, {"id": "R2", "level": 2}, {"id": "R3", "level": 2}]', [1, 2], True),
        ("json", '[{"id": "R1", "level": "1"}, {"id": "R2", "level": 2}, {"id": "R3", "level": 2}]', [1, 2], False),
        ("jsonl", '{"id": "R1", "level": true}\n{"id": "R2", "level": 1}\n{"id": "R3", "level": 1}\n', [1], False),
    ],
    ids=["csv-ints", "csv-float", "csv-bools", "csv-not-allowed", "csv-strings", "json-1.0-is-1", "json-str-not-1",
         "jsonl-true-not-1"],
)  # fmt: skip
def test_allowed_values_of_an_output_file_compare_as_its_format_writes_them(
    tmp_path: Path, fmt: str, text: str, allowed: list[Any], ok: bool
) -> None:
    """An output file is read as the user wrote it: in CSV every cell is text, so an allowed number or boolean
    allows the cell that writes it (`2`, `2.5`, `true`); in JSON a number equals itself written otherwise (1.0)."""
    path = tmp_path / f"out.{fmt}"
    path.write_text(text)
    order = make_order(accept={"output": path.name, "allowed": {"level": allowed}})
    doc = summarise_fd(os.open(path, os.O_RDONLY), fmt, order, 1 << 20)
    result = checks.allowed_values(evidence(order=order, output=doc))
    assert result.ok is ok, result


def test_a_receipt_of_an_order_of_many_long_ids_is_read_whole_beyond_4_mib(tmp_path: Path) -> None:
    """An order of 34,000 items with 128-character ids (valid under a raised max_order_bytes): its compact receipt
    listing every id as input and output is 4.45 MB. It is read (the limit leaves room for the order's ids twice);
    it failed `receipt_present: larger than 4194304 bytes` after the agent's work. A small order keeps 4 MiB."""
    import json

    from dispatcher.checks.evidence import RECEIPT_MAX, read_receipt, receipt_max

    ids = [f"{i:06d}" + "x" * 122 for i in range(34000)]
    big = validate_order({"job_id": "BIG", "from": "a", "to": "b", "task": "t", "items": [{"id": i} for i in ids]})
    receipt = {"job_id": "BIG", "input_ids": ids, "output_ids": ids, "status": "done"}
    (tmp_path / "receipt.json").write_text(json.dumps(receipt, separators=(",", ":")))
    assert (tmp_path / "receipt.json").stat().st_size > RECEIPT_MAX
    doc = read_receipt(tmp_path, None, receipt_max(big))
    assert doc.error is None and doc.value["input_ids"] == ids
    short = [f"R{i:06d}" for i in range(150000)]  # short ids, pretty-printed: more bytes a list entry than its id
    many = validate_order({"job_id": "MANY", "from": "a", "to": "b", "task": "t", "items": [{"id": i} for i in short]})
    pretty = {"job_id": "MANY", "input_ids": short, "output_ids": short, "status": "done"}
    (tmp_path / "receipt.json").write_text(json.dumps(pretty, indent=4))
    assert (tmp_path / "receipt.json").stat().st_size > 5_600_000
    assert read_receipt(tmp_path, None, receipt_max(many)).error is None
    (tmp_path / "receipt.json").write_text(json.dumps(receipt, separators=(",", ":")))
    small = validate_order({"job_id": "S", "from": "a", "to": "b", "task": "t", "items": [{"id": "R1"}]})
    assert receipt_max(small) == RECEIPT_MAX
    assert read_receipt(tmp_path, None, receipt_max(small)).error == f"larger than {RECEIPT_MAX} bytes"
