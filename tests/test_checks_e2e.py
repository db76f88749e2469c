"""Each check of contract section 5 made to fail on purpose, through the real daemon.

One daemon run handles every case: the config defines one fake agent per misbehaviour
(`--exit 3`, `--wrong-id`, `--fifo`, ...) and one work order goes to each. The tests then
read `result.json` the way a user would: the folder the job ended in, the `reason`, and
the checks, all of them recorded by name and in order even after one fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import CHECK_NAMES, Env, order

NOT_TRUE = "not true"  # the check ran and did not pass: false, or null where input is missing
DROP = object()
ALLOWED = {"output": "out.csv", "allowed": {"team": ["orders", "payments"]}, "required": ["team"]}

# An agent scripted by the order's meta: it makes the files, folders, links and FIFOs
# listed there, touches, rewrites or deletes given files, writes a receipt (a good one
# unless meta.receipt changes it, or meta.receipt_kind makes it a FIFO or a link), and
# prints meta.stdout last.
SCRIBE = """\
import json, os, sys
from pathlib import Path
order = json.loads(Path(os.environ["DISPATCH_ORDER"]).read_text())
work = Path(os.environ["DISPATCH_WORKSPACE"])
meta = order.get("meta") or {}
for rel in meta.get("create", []):
    path = work / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x\\n")
for rel, text in meta.get("files", {}).items():
    (work / rel).parent.mkdir(parents=True, exist_ok=True)
    (work / rel).write_text(text, newline="")
for rel in meta.get("dirs", []):
    (work / rel).mkdir(parents=True)
for rel, target in meta.get("symlinks", {}).items():
    os.symlink(target, work / rel)
for rel in meta.get("fifos", []):
    os.mkfifo(work / rel)
for rel in meta.get("sockets", []):
    import socket
    socket.socket(socket.AF_UNIX).bind(str(work / rel))
for name in meta.get("raw_names", []):
    with open(os.fsencode(work) + b"/" + name.encode("latin-1"), "wb") as f:
        f.write(b"x")
for rel in meta.get("touch", []):
    os.utime(work / rel, (1, 1))
for rel in meta.get("rewrite", []):
    data = (work / rel).read_bytes()
    (work / rel).unlink()
    (work / rel).write_bytes(data)
for rel in meta.get("delete", []):
    (work / rel).unlink()
ids = [item["id"] for item in order["items"]]
receipt = {"job_id": order["job_id"], "input_ids": ids, "output_ids": ids,
           "status": "done", "outputs": []}
receipt.update(meta.get("receipt", {}))
kind = meta.get("receipt_kind", "file")
if kind == "fifo":
    os.mkfifo(work / "receipt.json")
elif kind.startswith("symlink:"):
    outside = Path(kind.split(":", 1)[1])
    outside.write_text(json.dumps(receipt))
    os.symlink(outside, work / "receipt.json")
else:
    (work / "receipt.json").write_text(json.dumps(receipt))
sys.stdout.write(meta.get("stdout", ""))
"""


@dataclass(frozen=True)
class Case:
    """One work order, the agent that gets it and what result.json must say."""

    job_id: str
    agent: str
    state: str
    first: str | None = None  # the check `reason` starts with
    expect: dict[str, Any] = field(default_factory=dict)  # check name -> True/False/None/NOT_TRUE
    extra: dict[str, Any] = field(default_factory=dict)  # order fields

    def body(self) -> dict[str, Any]:
        body = order(self.job_id, to=self.agent)
        for key, value in self.extra.items():
            if value is DROP:
                body.pop(key, None)
            else:
                body[key] = value
        return body


GOOD = {
    "exit_ok": True,
    "receipt_present": True,
    "receipt_job_id": True,
    "receipt_status": True,
    "receipt_inputs": True,
    "output_rows": True,
    "receipt_outputs": True,
    "writes_scope": True,
}
NO_RECEIPT = {
    "receipt_present": NOT_TRUE,
    "receipt_job_id": None,
    "receipt_status": None,
    "receipt_inputs": None,
    "receipt_outputs": None,
}

SCRIPT_OK = {"exit_ok": True, "receipt_present": True, "receipt_job_id": True, "writes_scope": True}
QUOTED_CSV = 'id,team,note\r\nR1,"orders, payments","two\nlines"\r\nR2,bakery,plain\r\nR3,"orders, payments",x\r\n'


def scripted(accept: Any = DROP, writes: list[str] | None = None, **meta: Any) -> dict[str, Any]:
    """Order fields for the scripted agent: its meta, its writes (default none) and accept."""
    return {"accept": accept, "writes": writes or [], "meta": meta}


CASES = [
    # -- done: formats, keys and scopes that must pass -------------------------------------
    Case("CK-OK-CSV", "ok", "done", expect=GOOD | {"allowed_values": None}),
    Case("CK-OK-JSON", "ok", "done", expect=GOOD, extra={"accept": {"output": "out.json"}}),
    Case("CK-OK-JSONL", "ok", "done", expect=GOOD, extra={"accept": {"output": "out.jsonl"}}),
    Case(
        "CK-KEY-REF-CSV",
        "ok",
        "done",
        expect=GOOD,
        extra={"accept": {"output": "out.csv", "key": "ref"}},
    ),
    Case(
        "CK-KEY-REF-JSONL",
        "ok",
        "done",
        expect=GOOD,
        extra={"accept": {"output": "out.jsonl", "key": "request_id"}},
    ),
    Case(
        "CK-NO-ACCEPT",
        "ok",
        "done",
        expect={
            "exit_ok": True,
            "output_rows": None,
            "receipt_outputs": None,
            "allowed_values": None,
        },
        extra={"accept": DROP},
    ),
    Case(
        "CK-OUTPUT-NOT-IN-WRITES",
        "ok",
        "done",
        expect=GOOD,
        extra={"accept": {"output": "reports/final.csv"}, "writes": ["nothing.txt"]},
    ),
    Case(
        "CK-ALLOWED-OK",
        "teams",
        "done",
        expect=GOOD | {"allowed_values": True},
        extra={"accept": ALLOWED},
    ),
    Case(
        "CK-GLOB-DEEP",
        "scribe",
        "done",
        expect={"writes_scope": True},
        extra={
            "accept": DROP,
            "writes": ["notes/*.md"],
            "meta": {"create": ["notes/a/b/c.md", "notes/top.md"]},
        },
    ),
    # -- what an order overrides: writes and max_attempts ------------------------------
    Case("CK-ORDER-WRITES", "outside", "done", expect=GOOD, extra={"writes": ["not-allowed.txt"]}),
    Case("CK-ORDER-ATTEMPTS", "flaky", "done", expect=GOOD, extra={"max_attempts": 2}),
    Case("CK-AGENT-ATTEMPTS", "flaky", "failed", "exit_ok", GOOD | {"exit_ok": False}),
    # -- exit_ok -------------------------------------------------------------------------
    Case("CK-EXIT-3", "exit3", "failed", "exit_ok", GOOD | {"exit_ok": False}),
    Case(
        "CK-ORDER-TIMEOUT",
        "sleepy",
        "failed",
        "exit_ok",
        NO_RECEIPT | {"exit_ok": False},
        {"timeout": 1},
    ),
    Case(
        "CK-TIMEOUT",
        "slow",
        "failed",
        "exit_ok",
        NO_RECEIPT | {"exit_ok": False, "output_rows": False},
    ),
    # -- receipt_* -----------------------------------------------------------------------
    Case(
        "CK-RECEIPT-NOT-JSON",
        "badjson",
        "failed",
        "receipt_present",
        {
            "exit_ok": True,
            "receipt_present": False,
            "receipt_job_id": NOT_TRUE,
            "output_rows": True,
        },
    ),
    Case(
        "CK-RECEIPT-LIST",
        "rlist",
        "failed",
        "receipt_present",
        {
            "exit_ok": True,
            "receipt_present": False,
            "receipt_job_id": NOT_TRUE,
            "output_rows": True,
        },
    ),
    Case(
        "CK-NO-RECEIPT",
        "noreceipt",
        "failed",
        "receipt_present",
        NO_RECEIPT | {"exit_ok": True, "output_rows": True, "writes_scope": True},
    ),
    Case("CK-WRONG-ID", "wrongid", "failed", "receipt_job_id", GOOD | {"receipt_job_id": False}),
    Case("CK-STATUS-FAILED", "status", "failed", "receipt_status", GOOD | {"receipt_status": False}),
    Case("CK-INPUT-MISSING", "dropin", "failed", "receipt_inputs", GOOD | {"receipt_inputs": False}),
    Case("CK-INPUT-REPEATED", "repin", "failed", "receipt_inputs", GOOD | {"receipt_inputs": False}),
    # -- output_rows ---------------------------------------------------------------------
    Case("CK-ROW-MISSING", "missrow", "failed", "output_rows", GOOD | {"output_rows": False}),
    Case(
        "CK-ROW-MISSING-JSONL",
        "missrow",
        "failed",
        "output_rows",
        GOOD | {"output_rows": False},
        {"accept": {"output": "out.jsonl"}},
    ),
    Case("CK-ROW-EXTRA", "extrarow", "failed", "output_rows", GOOD | {"output_rows": False}),
    Case(
        "CK-ROW-DUPLICATE",
        "duprow",
        "failed",
        "output_rows",
        {"exit_ok": True, "receipt_inputs": True, "output_rows": False},
    ),
    Case(
        "CK-ROW-DUPLICATE-JSON",
        "duprow",
        "failed",
        "output_rows",
        {"exit_ok": True, "receipt_inputs": True, "output_rows": False},
        {"accept": {"output": "out.json"}},
    ),
    Case(
        "CK-NO-OUTPUT",
        "noout",
        "failed",
        "output_rows",
        {"exit_ok": True, "receipt_inputs": True, "output_rows": False, "receipt_outputs": None},
    ),
    # -- receipt_outputs, allowed_values -------------------------------------------------
    Case("CK-OUTPUT-IDS", "outids", "failed", "receipt_outputs", GOOD | {"receipt_outputs": False}),
    Case(
        "CK-BAD-VALUE",
        "badval",
        "failed",
        "allowed_values",
        GOOD | {"allowed_values": False},
        {"accept": ALLOWED},
    ),
    Case(
        "CK-EMPTY-REQUIRED",
        "emptyreq",
        "failed",
        "allowed_values",
        GOOD | {"allowed_values": False},
        {"accept": ALLOWED},
    ),
    # -- writes_scope --------------------------------------------------------------------
    Case("CK-WRITE-OUTSIDE", "outside", "failed", "writes_scope", GOOD | {"writes_scope": False}),
    Case("CK-MODIFY-ORDER", "modify", "failed", "writes_scope", GOOD | {"writes_scope": False}),
    Case("CK-SYMLINK-OUT", "symlink", "failed", "writes_scope", GOOD | {"writes_scope": False}),
    Case("CK-HARDLINK", "hardlink", "failed", "writes_scope", GOOD | {"writes_scope": False}),
    Case("CK-FIFO", "fifo", "failed", "writes_scope", GOOD | {"writes_scope": False}),
    Case(
        "CK-DELETE-WORK",
        "delwork",
        "failed",
        "receipt_present",
        {"exit_ok": True, "receipt_present": NOT_TRUE, "writes_scope": False},
    ),
    Case(
        "CK-GLOB-MISS",
        "scribe",
        "failed",
        "writes_scope",
        {"exit_ok": True, "receipt_present": True, "receipt_job_id": True, "writes_scope": False},
        {"accept": DROP, "writes": ["notes/*.md"], "meta": {"create": ["notes/a/b/c.txt"]}},
    ),
    # -- scripted agent: output formats read as their standards say ----------------------
    Case(
        "CK-CSV-QUOTED",
        "scribe",
        "done",
        expect=GOOD | {"allowed_values": True},
        extra={
            "accept": {"output": "out.csv", "allowed": {"team": ["orders, payments", "bakery"]}, "required": ["team"]},
            "meta": {"files": {"out.csv": QUOTED_CSV}},
        },
    ),
    Case(
        "CK-JSON-NOT-LIST",
        "scribe",
        "failed",
        "output_rows",
        {"exit_ok": True, "receipt_inputs": True, "output_rows": False},
        scripted(files={"out.json": '{"id": "R1"}'}, accept={"output": "out.json"}),
    ),
    Case(
        "CK-JSONL-BAD-LINE",
        "scribe",
        "failed",
        "output_rows",
        {"exit_ok": True, "output_rows": False},
        scripted(
            files={"out.jsonl": '{"id": "R1"}\nnot json\n{"id": "R2"}\n{"id": "R3"}\n'}, accept={"output": "out.jsonl"}
        ),
    ),
    Case(
        "CK-ROW-WITHOUT-KEY",
        "scribe",
        "failed",
        "output_rows",
        {"exit_ok": True, "output_rows": False},
        scripted(
            files={"out.json": '[{"id": "R1"}, {"id": "R2"}, {"id": "R3"}, {"team": "x"}]'},
            accept={"output": "out.json"},
        ),
    ),
    Case(
        "CK-REQUIRED-ABSENT",
        "scribe",
        "failed",
        "allowed_values",
        {"exit_ok": True, "output_rows": True, "allowed_values": False},
        scripted(
            files={"out.json": '[{"id": "R1", "team": "a"}, {"id": "R2"}, {"id": "R3", "team": "b"}]'},
            accept={"output": "out.json", "required": ["team"]},
        ),
    ),
    Case(
        "CK-ANY-ORDER",
        "scribe",
        "done",
        expect=GOOD,
        extra=scripted(
            files={"out.json": '[{"id": "R3"}, {"id": "R1"}, {"id": "R2"}]'},
            accept={"output": "out.json"},
            receipt={"input_ids": ["R3", "R2", "R1"], "output_ids": ["R2", "R3", "R1"]},
        ),
    ),
    Case(
        "CK-CSV-NO-KEY-COLUMN",
        "scribe",
        "failed",
        "output_rows",
        {"exit_ok": True, "output_rows": False},
        scripted(files={"out.csv": "ref,team\nR1,a\nR2,a\nR3,a\n"}, accept={"output": "out.csv"}),
    ),
    Case(
        "CK-JSON-RECORD-NOT-OBJECT",
        "scribe",
        "failed",
        "output_rows",
        {"exit_ok": True, "output_rows": False},
        scripted(files={"out.json": '[{"id": "R1"}, {"id": "R2"}, {"id": "R3"}, "R4"]'}, accept={"output": "out.json"}),
    ),
    # -- scripted agent: receipts that are not what they seem -----------------------------
    Case(
        "CK-RECEIPT-INPUTS-MAPPING",
        "scribe",
        "failed",
        "receipt_inputs",
        {"exit_ok": True, "receipt_present": True, "receipt_inputs": False},
        scripted(receipt={"input_ids": {"R1": 1, "R2": 1, "R3": 1}}),
    ),
    Case(
        "CK-RECEIPT-STATUS-CASE",
        "scribe",
        "failed",
        "receipt_status",
        {"receipt_status": False, "receipt_inputs": True},
        scripted(receipt={"status": "DONE"}),
    ),
    Case(
        "CK-RECEIPT-FIFO",
        "scribe",
        "failed",
        None,
        {"exit_ok": True, "receipt_present": NOT_TRUE, "writes_scope": False},
        scripted(receipt_kind="fifo"),
    ),
    Case(
        "CK-RECEIPT-SYMLINK",
        "scribe",
        "failed",
        None,
        {"exit_ok": True, "writes_scope": False},
        scripted(receipt_kind="symlink:@OUTSIDE@/outside-receipt.json"),
    ),
    Case(
        "CK-OUTPUT-FIFO",
        "scribe",
        "failed",
        None,
        {"exit_ok": True, "output_rows": NOT_TRUE, "writes_scope": False},
        scripted(fifos=["out.csv"], accept={"output": "out.csv"}),
    ),
    # -- scripted agent: writes_scope rules ------------------------------------------------
    Case("CK-EMPTY-DIRS-FREE", "scribe", "done", expect=SCRIPT_OK, extra=scripted(dirs=["scratch/deep"])),
    Case("CK-TOUCH-GIVEN", "scribe", "done", expect=SCRIPT_OK, extra=scripted(touch=["order.json"])),
    Case("CK-REWRITE-GIVEN", "scribe", "done", expect=SCRIPT_OK, extra=scripted(rewrite=["order.json"])),
    Case(
        "CK-DELETE-GIVEN",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(delete=["order.json"]),
    ),
    Case(
        "CK-LINK-INSIDE",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(files={"data.txt": "x"}, symlinks={"alias.txt": "data.txt"}, writes=["data.txt", "alias.txt"]),
    ),
    Case(
        "CK-LINK-DOTDOT",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(symlinks={"up.txt": "../order.json"}, writes=["up.txt"]),
    ),
    Case(
        "CK-WRITES-NOT-IN-SUBDIR",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(create=["sub/out.csv"], writes=["out.csv"]),
    ),
    Case(
        "CK-WRITES-QMARK",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(create=["file1.txt"], writes=["file?.txt"]),
    ),
    Case(
        "CK-WRITES-CASE",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(create=["NOTES.md"], writes=["notes.md"]),
    ),
    Case(
        "CK-SOCKET",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(sockets=["agent.sock"], writes=["agent.sock"]),
    ),
    Case(
        "CK-DEEP-FOLDERS-FREE",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(dirs=["/".join(["d"] * 200)]),
    ),
    Case(
        "CK-REQUIRED-NULL",
        "scribe",
        "failed",
        "allowed_values",
        {"output_rows": True, "allowed_values": False},
        scripted(
            files={"out.json": '[{"id": "R1", "team": null}, {"id": "R2", "team": "a"}, {"id": "R3", "team": "b"}]'},
            accept={"output": "out.json", "required": ["team"]},
        ),
    ),
    # -- scripted agent: text from the agent must not break the one-line reason ----------
    Case(
        "CK-NEWLINE-IN-NAME",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(create=["evil\nname.txt"]),
    ),
    Case(
        "CK-U2028-IN-NAME",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(create=["evil\u2028name.txt"]),
    ),
    Case(
        "CK-RECEIPT-REASON-LINES",
        "scribe",
        "failed",
        "receipt_status",
        {"receipt_status": False},
        scripted(receipt={"status": "failed", "reason": "line one\nline two\rline three"}),
    ),
    # -- scripted agent: agent_result ------------------------------------------------------
    Case(
        "CK-AR-TRAILING-BLANK",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(stdout='{"session_id": "t"}\n\n   \n'),
    ),
    Case("CK-AR-ARRAY", "scribe", "done", expect=SCRIPT_OK, extra=scripted(stdout="progress\n[1, 2]\n")),
    Case("CK-AR-NOT-LAST", "scribe", "done", expect=SCRIPT_OK, extra=scripted(stdout='{"a": 1}\ndone.\n')),
]


def agents(env: Env, scribe: str) -> dict[str, dict[str, Any]]:
    """One agent per misbehaviour; writes lists widened where a case must fail on links only."""
    a = env.agent
    return {
        "ok": a(concurrency=3),
        "teams": a("--field", "team=orders"),
        "exit3": a("--exit", "3"),
        "slow": a("--sleep", "30", timeout=1),
        "sleepy": a("--sleep", "30", timeout=30),
        "flaky": a("--fail-attempts", "1", retry_safe=True),
        "badjson": a("--invalid-receipt"),
        "rlist": a("--receipt-list"),
        "noreceipt": a("--no-receipt"),
        "wrongid": a("--wrong-id"),
        "status": a("--status", "failed"),
        "dropin": a("--drop-input"),
        "repin": a("--repeat-input"),
        "missrow": a("--missing-row"),
        "extrarow": a("--extra-row"),
        "duprow": a("--duplicate-row"),
        "noout": a("--no-output"),
        "outids": a("--output-ids-wrong"),
        "badval": a("--bad-value", "--field", "team=orders"),
        "emptyreq": a("--empty-required", "--field", "team=orders"),
        "outside": a("--write-outside"),
        "modify": a("--modify-given"),
        "symlink": a("--symlink-out", writes=["out.csv", "outbox-link"]),
        "hardlink": a("--hardlink", writes=["out.csv", "hard*"]),
        "fifo": a("--fifo", writes=["out.csv", "pipe"]),
        "delwork": a("--delete-work"),
        "scribe": {"command": [sys.executable, scribe], "timeout": 30, "writes": []},
    }


@dataclass
class Run:
    """The finished run: the dispatch root and job id -> (folder, result.json)."""

    env: Env
    results: dict[str, tuple[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Run every case through one daemon, then stop it."""
    tmp = tmp_path_factory.mktemp("checks")
    env = Env(
        tmp=tmp,
        root=tmp / "dispatch",
        config_path=tmp / "dispatcher.yaml",
        count_file=tmp / "starts.txt",
    )
    scribe = tmp / "scribe.py"
    scribe.write_text(SCRIBE)
    env.configure(agents=agents(env, str(scribe)), max_jobs=4)
    daemon = env.daemon()
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    try:
        daemon.wait_ready()
        for case in CASES:
            body = json.loads(json.dumps(case.body()).replace("@OUTSIDE@", str(tmp)))
            env.drop(body)
        end = time.monotonic() + 120
        while len(found) < len(CASES) and time.monotonic() < end:
            for case in CASES:
                for state in ("done", "failed"):
                    path = env.root / state / case.job_id / "result.json"
                    if case.job_id not in found and path.exists():
                        with contextlib.suppress(json.JSONDecodeError):
                            found[case.job_id] = (state, json.loads(path.read_text()))
            time.sleep(0.1)
    finally:
        daemon.stop()
    yield Run(env, found)
    for d in env._daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(60)


@pytest.fixture(scope="module")
def results(run: Run) -> dict[str, tuple[str, dict[str, Any]]]:
    return run.results


def first_failing(checks: list[dict[str, Any]]) -> str:
    """Return the first check that keeps the job from being done."""
    required = ("exit_ok", "receipt_present", "receipt_job_id")
    return next(c["name"] for c in checks if c["ok"] is False or (c["name"] in required and c["ok"] is not True))


def check_map(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in result["checks"]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.job_id)
def test_check_outcome(results: dict[str, tuple[str, dict[str, Any]]], case: Case) -> None:
    """The job ends in its folder, all checks recorded in order, reason naming the first failure."""
    assert_outcome(results, case)


def assert_outcome(results: dict[str, tuple[str, dict[str, Any]]], case: Case) -> None:
    assert case.job_id in results, f"{case.job_id} never finished"
    state, result = results[case.job_id]
    assert state == case.state, f"{case.job_id} ended in {state}: {result.get('reason')}"
    assert result["state"] == case.state
    assert result["job_id"] == case.job_id
    assert result["agent"] == case.agent
    assert [c["name"] for c in result["checks"]] == CHECK_NAMES
    for c in result["checks"]:
        assert c["ok"] in (True, False, None), c
        assert "detail" in c, c
        if c["ok"] is None:
            assert isinstance(c["detail"], str) and c["detail"].strip(), f"null check without detail: {c}"
    checks = check_map(result)
    for name, want in case.expect.items():
        got = checks[name]["ok"]
        if want == NOT_TRUE:
            assert got is not True, f"{name} should not pass: {checks[name]}"
        else:
            assert got is want, f"{name}: expected {want}, got {checks[name]}"
    if case.state == "done":
        assert result["reason"] is None
        assert all(c["ok"] is not False for c in result["checks"]), result["checks"]
        for name in ("exit_ok", "receipt_present", "receipt_job_id"):
            assert checks[name]["ok"] is True
    else:
        reason = result["reason"]
        assert isinstance(reason, str) and reason.splitlines() == [reason], f"reason is not one line: {reason!r}"
        first = case.first or first_failing(result["checks"])
        assert reason.startswith(first), f"reason {reason!r} does not start with {first}"
        assert checks[first]["ok"] is not True


def test_exit_code_recorded_in_attempt(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """An agent that exits 3 fails exit_ok, and its one attempt records exit_code 3."""
    _, result = results["CK-EXIT-3"]
    assert len(result["attempts"]) == 1
    attempt = result["attempts"][0]
    assert attempt["exit_code"] == 3
    assert attempt["timed_out"] is False
    assert "3" in check_map(result)["exit_ok"]["detail"]


def test_timeout_recorded_in_attempt(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """An agent past its timeout is stopped, its attempt says timed_out, and exit_ok fails."""
    _, result = results["CK-TIMEOUT"]
    assert len(result["attempts"]) == 1
    attempt = result["attempts"][0]
    assert attempt["timed_out"] is True
    assert attempt["duration_ms"] < 20_000, "the agent was not stopped at its 1 s timeout"


def test_failed_agents_are_not_retried(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """With max_attempts 1 every failed case ran exactly one attempt."""
    for case in CASES:
        if case.job_id in results and case.job_id != "CK-ORDER-ATTEMPTS":
            _, result = results[case.job_id]
            assert [a["n"] for a in result["attempts"]] == [1], case.job_id


def test_agent_files_stay_in_the_job_folder(run: Run) -> None:
    """What an agent left in work/ is kept as it was, in done/ and in failed/ alike."""
    root = run.env.root
    out = root / "done" / "CK-OK-JSONL" / "work" / "out.jsonl"
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["R1", "R2", "R3"]
    receipt = json.loads((root / "done" / "CK-OK-JSONL" / "work" / "receipt.json").read_text())
    assert receipt["job_id"] == "CK-OK-JSONL"
    assert (root / "failed" / "CK-WRITE-OUTSIDE" / "work" / "not-allowed.txt").is_file()
    assert stat.S_ISFIFO((root / "failed" / "CK-FIFO" / "work" / "pipe").lstat().st_mode)
    link = root / "failed" / "CK-SYMLINK-OUT" / "work" / "outbox-link"
    assert os.readlink(link) == "/etc/passwd"
    assert (root / "failed" / "CK-MODIFY-ORDER" / "work" / "order.json").read_text() == "{}"
    assert (root / "done" / "CK-GLOB-DEEP" / "work" / "notes" / "a" / "b" / "c.md").is_file()


def test_writes_scope_names_each_allowed_file_once(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """The agent's writes already name accept.output (out.csv): the detail lists it once, not twice."""
    _, result = results["CK-WRITE-OUTSIDE"]
    detail = next(c["detail"] for c in result["checks"] if c["name"] == "writes_scope")
    assert detail == "not-allowed.txt is outside writes (out.csv, out.json, out.jsonl)", detail


def test_checks_logged_per_job(run: Run) -> None:
    """Each job logs job.verified and then job.done or job.failed, with its job_id and agent."""
    events = [json.loads(line) for line in run.env._daemons[0].out.read_text().splitlines() if line.startswith("{")]
    for case in CASES:
        mine = [e for e in events if e.get("job_id") == case.job_id]
        names = [e["event"] for e in mine]
        assert "job.verified" in names, (case.job_id, names)
        final = "job.done" if case.state == "done" else "job.failed"
        assert final in names, (case.job_id, names)
        assert all(e.get("agent") == case.agent for e in mine if e["event"] in ("job.verified", final))


def test_order_timeout_overrides_the_agents(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """An order's `timeout` replaces the agent's: a 1 s order stops a 30 s agent."""
    _, result = results["CK-ORDER-TIMEOUT"]
    (attempt,) = result["attempts"]
    assert attempt["timed_out"] is True
    assert attempt["duration_ms"] < 20_000


def test_order_max_attempts_overrides_the_agents(run: Run, results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """An order's `max_attempts` replaces the agent's: a retry-safe agent failing once gets a second go."""
    assert [s for s in run.env.starts() if s[0] == "CK-ORDER-ATTEMPTS"] == [
        ("CK-ORDER-ATTEMPTS", 1),
        ("CK-ORDER-ATTEMPTS", 2),
    ]
    _, result = results["CK-ORDER-ATTEMPTS"]
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert [a["exit_code"] for a in result["attempts"]] == [1, 0]
    _, result = results["CK-AGENT-ATTEMPTS"]
    assert [a["n"] for a in result["attempts"]] == [1]


def test_agent_result_rules(results: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """agent_result is taken when the last non-blank stdout text is a JSON object, and only then."""
    assert results["CK-AR-TRAILING-BLANK"][1]["attempts"][0]["agent_result"] == {"session_id": "t"}
    assert results["CK-AR-ARRAY"][1]["attempts"][0].get("agent_result") is None
    assert results["CK-AR-NOT-LAST"][1]["attempts"][0].get("agent_result") is None


# -- hostile output: each case must still end in done/ or failed/ ----------------------------
#
# These run through `run --once`, which returns once every job it claimed is over, so a
# job that never finishes shows up as missing at once instead of after a long deadline.

DEEP_OBJECT = '{"a": ' + "[" * 5000 + "]" * 5000 + "}\n"
HOSTILE = [
    Case(
        "HX-RAW-NAME-OUTSIDE",
        "scribe",
        "failed",
        "writes_scope",
        SCRIPT_OK | {"writes_scope": False},
        scripted(raw_names=["\xff\xfe-left.txt"]),
    ),
    Case(
        "HX-RAW-NAME-INSIDE",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(raw_names=["\xff\xfe-left.txt"], writes=["*"]),
    ),
    Case("HX-DEEP-AGENT-RESULT", "scribe", "done", expect=SCRIPT_OK, extra=scripted(stdout=DEEP_OBJECT)),
    Case(
        "HX-DEEP-BIG-AGENT-RESULT",
        "scribe",
        "done",
        expect=SCRIPT_OK,
        extra=scripted(stdout='{"a": ' + "[" * 40000 + "]" * 40000 + "}\n"),
    ),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, Any]]]:
    """Run the hostile cases with `run --once`; map job id -> (folder, result.json)."""
    tmp = tmp_path_factory.mktemp("hostile")
    env = Env(tmp=tmp, root=tmp / "dispatch", config_path=tmp / "dispatcher.yaml", count_file=tmp / "starts.txt")
    scribe = tmp / "scribe.py"
    scribe.write_text(SCRIBE)
    env.configure(agents={"scribe": agents(env, str(scribe))["scribe"]}, max_jobs=4)
    for case in HOSTILE:
        env.drop(case.body())
    env.cli("run", "--once", timeout=90)
    found = {}
    for case in HOSTILE:
        for state in ("done", "failed"):
            path = env.root / state / case.job_id / "result.json"
            if path.exists():
                found[case.job_id] = (state, json.loads(path.read_text()))
    return found


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.job_id)
def test_hostile_output_still_ends_the_job(hostile: dict[str, tuple[str, dict[str, Any]]], case: Case) -> None:
    """Odd file names or a pathologically deep JSON object from an agent still end the job with its checks."""
    assert_outcome(hostile, case)
