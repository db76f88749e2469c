"""Work order and config validation, driven through `dispatcher validate` and `submit`.

Every rule of contract sections 2 and 3 gets a file that breaks it (and, where a boundary
exists, one that sits just inside it). A bad file must give exit 2 and exactly one line on
stderr, `<file>: <field>: <message>` (or `<file>: <message>` where no one field is at
fault), with `<file>` exactly as given on the command line.

The order cases all run against one dispatch root and config (`max_timeout: 100`,
`max_order_bytes: 4096`), each through its own CLI process, a few at a time.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from conftest import Env, cli_env, order

PYTHON_M = [sys.executable, "-m", "dispatcher"]
MAX_TIMEOUT = 100
MAX_ORDER_BYTES = 4096

BASE: dict[str, Any] = {
    "job_id": "JOB-1",
    "from": "tester",
    "to": "worker",
    "task": "Assign each request to one team.",
    "items": [{"id": "R1", "summary": "oat milk missing"}, {"id": "R2"}],
    "accept": {"output": "out.csv"},
}
DROP = object()


def js(changes: dict[str, Any] | None = None, **accept: Any) -> bytes:
    """Return the base order as JSON bytes, with top-level fields replaced or dropped."""
    body = copy.deepcopy(BASE)
    for key, value in (changes or {}).items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    if accept:
        body["accept"] = {"output": "out.csv", **accept}
    return json.dumps(body).encode()


def yl(
    job_id: str = '"JOB-1"',
    frm: str = "tester",
    to: str = "worker",
    task: str = "Assign each request to one team.",
    items: str = "\n  - id: R1\n  - id: R2",
    extra: str = "",
) -> bytes:
    """Return a YAML order written by hand, each value as raw YAML text."""
    text = (
        "# a work order written by a person\n"
        f"job_id: {job_id}\n"
        f"from: {frm}\n"
        f"to: {to}\n"
        f"task: {task}\n"
        f"items:{items}\n"
        f"{extra}"
    )
    return text.encode()


@dataclass(frozen=True)
class Case:
    """One file for `validate`: valid, or invalid with the field it must name."""

    id: str
    name: str
    data: bytes
    valid: bool = False
    field: str | None = None  # dotted field the error must name (prefix match)
    mention: str | None = None  # text the error line must contain


def bad(id: str, data: bytes, field: str | None = None, mention: str | None = None, ext: str = "json") -> Case:
    return Case(id, f"{id}.{ext}", data, False, field, mention)


def good(id: str, data: bytes, ext: str = "json") -> Case:
    return Case(id, f"{id}.{ext}", data, True)


def deep_json(levels: int) -> bytes:
    body = copy.deepcopy(BASE)
    nested: Any = "leaf"
    for _ in range(levels):
        nested = {"k": nested}
    body["meta"] = nested
    return json.dumps(body).encode()


def deep_json_raw(levels: int) -> bytes:
    """Nesting built as text, deep enough to break a recursive parser."""
    head = json.dumps(BASE)[:-1]
    return (head + ', "meta": {"k": ' + "[" * levels + "]" * levels + "}}").encode()


def padded(total: int) -> bytes:
    body = copy.deepcopy(BASE)
    body["meta"] = {"pad": ""}
    size = len(json.dumps(body).encode())
    body["meta"]["pad"] = "x" * (total - size)
    data = json.dumps(body).encode()
    assert len(data) == total
    return data


ORDER_CASES: list[Case] = [
    # -- required fields ----------------------------------------------------------------
    *[bad(f"missing-{f}", js({f: DROP}), field=f) for f in ("job_id", "from", "to", "task", "items")],
    # -- unknown keys ------------------------------------------------------------------
    bad("unknown-acept", js({"acept": {"output": "out.csv"}}), field="acept", mention="acept"),
    bad(
        "unknown-acept-yaml",
        yl(extra="acept:\n  output: out.csv\n"),
        field="acept",
        mention="acept",
        ext="yaml",
    ),
    bad("unknown-accept-key", js(outptu="out.csv"), field="accept", mention="outptu"),
    bad("unknown-top-key", js({"priority": "high"}), field="priority", mention="priority"),
    bad("unknown-key-with-newline", js({"ac\nept": {"output": "out.csv"}}), mention="unknown"),
    bad("unknown-accept-key-with-newline", js(**{"ke\ny": "id"}), field="accept", mention="unknown"),
    bad("order-sets-command", js({"command": ["sh", "-c", "true"]}), field="command", mention="command"),
    bad("order-sets-env", js({"env": {"PATH": "/tmp"}}), field="env", mention="env"),
    # -- job_id pattern and type -------------------------------------------------------
    bad("id-empty", js({"job_id": ""}), field="job_id"),
    bad("id-leading-dash", js({"job_id": "-JOB"}), field="job_id"),
    bad("id-leading-dot", js({"job_id": ".JOB"}), field="job_id"),
    bad("id-space", js({"job_id": "JOB 1"}), field="job_id"),
    bad("id-slash", js({"job_id": "JOB/1"}), field="job_id"),
    bad("id-at", js({"job_id": "JOB@1"}), field="job_id"),
    bad("id-non-ascii", js({"job_id": "JÖB-1"}), field="job_id"),
    bad("id-129-chars", js({"job_id": "J" * 129}), field="job_id"),
    bad("id-trailing-newline", js({"job_id": "JOB-1\n"}), field="job_id"),
    bad("id-trailing-newline-yaml", yl(job_id='"JOB-1\\n"'), field="job_id", ext="yaml"),
    bad("id-int-yaml", yl(job_id="12345"), field="job_id", ext="yaml"),
    bad("id-int-json", js({"job_id": 12345}), field="job_id"),
    # -- strings where YAML reads dates, numbers, booleans ----------------------------
    bad("from-date-yaml", yl(frm="2026-11-29"), field="from", ext="yaml"),
    bad("to-bool-yaml", yl(to="yes"), field="to", ext="yaml"),
    bad("task-int-yaml", yl(task="42"), field="task", ext="yaml"),
    bad("for-date-yaml", yl(extra="for: 2026-11-29\n"), field="for", ext="yaml"),
    bad("for-int-json", js({"for": 5}), field="for"),
    bad("from-list-json", js({"from": ["a"]}), field="from"),
    bad("item-id-int-yaml", yl(items="\n  - id: 7\n  - id: R2"), field="items", ext="yaml"),
    # -- to must be a configured agent -----------------------------------------------
    bad("to-unknown-agent", js({"to": "nobody"}), field="to", mention="nobody"),
    # -- task ---------------------------------------------------------------------------
    bad("task-empty", js({"task": ""}), field="task"),
    bad("task-blank", js({"task": "   "}), field="task"),
    bad("task-ideographic-space", js({"task": "\u3000"}), field="task"),
    bad("task-cr", js({"task": "one\rtwo"}), field="task"),
    bad("task-lf", js({"task": "one\ntwo"}), field="task"),
    bad("task-crlf", js({"task": "one\r\ntwo"}), field="task"),
    bad("task-u2028", js({"task": "one\u2028two"}), field="task"),
    bad("task-u2029", js({"task": "one\u2029two"}), field="task"),
    bad("task-nel", js({"task": "one\x85two"}), field="task"),
    bad("task-vt", js({"task": "one\x0btwo"}), field="task"),
    bad("task-ff", js({"task": "one\x0ctwo"}), field="task"),
    bad("task-bell", js({"task": "one\x07two"}), field="task"),
    bad("task-nul", js({"task": "one\x00two"}), field="task"),
    bad("task-tab", js({"task": "one\ttwo"}), field="task"),
    bad("task-esc", js({"task": "one\x1b[31mtwo"}), field="task"),
    bad("task-cr-yaml", yl(task='"one\\rtwo"'), field="task", ext="yaml"),
    bad("task-501-chars", js({"task": "x" * 501}), field="task"),
    # -- items ---------------------------------------------------------------------------
    bad("items-empty", js({"items": []}), field="items"),
    bad("items-string", js({"items": "R1"}), field="items"),
    bad("items-mapping", js({"items": {"R1": {}}}), field="items"),
    bad("items-non-mapping", js({"items": ["R1", "R2"]}), field="items"),
    bad("items-no-id", js({"items": [{"id": "R1"}, {"summary": "x"}]}), field="items"),
    bad(
        "items-duplicate-id",
        js({"items": [{"id": "R1"}, {"id": "R2"}, {"id": "R1"}]}),
        field="items",
    ),
    bad("items-id-space", js({"items": [{"id": "R 1"}]}), field="items"),
    bad("items-id-newline", js({"items": [{"id": "R1\n"}]}), field="items"),
    bad("items-id-empty", js({"items": [{"id": ""}]}), field="items"),
    bad("items-id-int-json", js({"items": [{"id": 1}]}), field="items"),
    # -- writes --------------------------------------------------------------------------
    bad("writes-absolute", js({"writes": ["/etc/passwd"]}), field="writes"),
    bad("writes-dotdot", js({"writes": ["../escape.csv"]}), field="writes"),
    bad("writes-inner-dotdot", js({"writes": ["a/../../escape.csv"]}), field="writes"),
    bad("writes-trailing-dotdot", js({"writes": ["ok.csv", "a/.."]}), field="writes"),
    bad("writes-not-list", js({"writes": 5}), field="writes"),
    # -- accept --------------------------------------------------------------------------
    bad("accept-not-mapping", js({"accept": "out.csv"}), field="accept"),
    bad("output-absolute", js(output="/tmp/out.csv"), field="accept", mention="output"),
    bad("output-dotdot", js(output="../out.csv"), field="accept", mention="output"),
    bad("output-inner-dotdot", js(output="a/../../out.csv"), field="accept", mention="output"),
    bad("output-star", js(output="out*.csv"), field="accept", mention="output"),
    bad("output-question", js(output="out?.csv"), field="accept", mention="output"),
    bad("output-bracket", js(output="out[12].csv"), field="accept", mention="output"),
    bad("output-not-a-format", js(output="out.txt"), field="accept", mention="output"),
    # a file the daemon gives (or the receipt, or outbox/): no output there could ever pass its checks
    bad("output-the-order", js(output="order.json"), field="accept.output", mention="order the daemon gives"),
    bad("output-the-order-dot", js(output="./order.json"), field="accept.output", mention="never the output"),
    bad("output-the-receipt", js(output="receipt.json"), field="accept.output", mention="is the receipt"),
    good("ok-output-feedback-name", js(output="feedback.json")),  # given only to a repair or a revision
    good("ok-output-parents-name", js(output="parents.json")),  # given only to a join
    bad("output-in-outbox", js(output="outbox/r.json"), field="accept.output", mention="outbox/"),
    good("ok-output-named-like-outbox", js(output="outboxes/r.json")),
    bad("accept-key-int", js(key=5), field="accept", mention="key"),
    bad("accept-allowed-list", js(allowed=["orders"]), field="accept", mention="allowed"),
    bad("accept-required-string", js(required="team"), field="accept", mention="required"),
    # -- timeout, max_attempts, meta -----------------------------------------------------
    bad("timeout-zero", js({"timeout": 0}), field="timeout"),
    bad("timeout-negative", js({"timeout": -1}), field="timeout"),
    bad("timeout-string", js({"timeout": "10"}), field="timeout"),
    bad("timeout-bool", js({"timeout": True}), field="timeout"),
    bad("timeout-above-max", js({"timeout": MAX_TIMEOUT + 1}), field="timeout"),
    bad("timeout-inf-yaml", yl(extra="timeout: .inf\n"), field="timeout", ext="yaml"),
    bad("timeout-nan-yaml", yl(extra="timeout: .nan\n"), ext="yaml"),
    bad("timeout-int-beyond-float", js({"timeout": 2**1100}), field="timeout", mention="is too large (1101 bits)"),
    bad("priority-int-beyond-float", js({"priority": 2**1100}), field="priority", mention="is too large"),
    bad("max-attempts-int-beyond-float", js({"max_attempts": -(2**1100)}), field="max_attempts", mention="too large"),
    bad("attempts-zero", js({"max_attempts": 0}), field="max_attempts"),
    bad("attempts-negative", js({"max_attempts": -2}), field="max_attempts"),
    bad("attempts-float", js({"max_attempts": 1.5}), field="max_attempts"),
    bad("attempts-integral-float", js({"max_attempts": 1.0}), field="max_attempts"),
    bad("attempts-integral-float-yaml", yl(extra="max_attempts: 2.0\n"), field="max_attempts", ext="yaml"),
    bad("priority-integral-float", js({"priority": 1e0}), field="priority"),
    bad("attempts-string", js({"max_attempts": "2"}), field="max_attempts"),
    bad("attempts-bool", js({"max_attempts": True}), field="max_attempts"),
    bad("attempts-101", js({"max_attempts": 101}), field="max_attempts", mention="at most 100"),
    bad("meta-not-mapping", js({"meta": "free text"}), field="meta"),
    # -- YAML and JSON structure (the field is not asserted: it may be the whole file) ---
    bad("yaml-anchor-alias", yl(extra="meta:\n  a: &x {k: v}\n  b: *x\n"), ext="yaml"),
    bad("yaml-anchor-only", yl(extra="meta:\n  a: &x {k: v}\n"), ext="yaml"),
    bad(
        "yaml-billion-laughs",
        yl(extra="meta:\n  a: &a [x, x, x, x]\n  b: &b [*a, *a, *a, *a]\n  c: [*b, *b, *b, *b]\n"),
        ext="yaml",
    ),
    bad("yaml-duplicate-key", yl() + b'job_id: "JOB-2"\n', ext="yaml"),
    bad("yaml-duplicate-nested-key", yl(extra="meta:\n  a: 1\n  a: 2\n"), ext="yaml"),
    bad("json-duplicate-key", b'{"job_id": "JOB-1", ' + js()[1:]),
    bad("yaml-two-documents", yl() + b"---\n" + yl(), ext="yaml"),
    bad("yaml-list-top", b"- job_id: JOB-1\n- to: worker\n", ext="yaml"),
    bad("yaml-scalar-top", b"just some text\n", ext="yaml"),
    bad("yaml-empty-file", b"", ext="yaml"),
    bad("yaml-comment-only", b"# nothing here\n", ext="yml"),
    bad("json-list-top", b"[]"),
    bad("json-number-top", b"42"),
    bad("json-truncated", js()[:-20]),
    bad("json-nan-literal", js()[:-1] + b', "meta": {"score": NaN}}'),
    bad("json-infinity-literal", js()[:-1] + b', "meta": {"score": Infinity}}'),
    bad("yaml-syntax-error", b'job_id: "JOB-1\nfrom: [tester\n', ext="yaml"),
    bad("yaml-nesting-100", yl(extra="meta: {k: " + "[" * 100 + "]" * 100 + "}\n"), ext="yaml"),
    bad("json-nesting-100", deep_json(100)),
    bad("yaml-nesting-2000", yl(extra="meta: {k: " + "[" * 2000 + "]" * 2000 + "}\n"), ext="yaml"),
    bad("json-nesting-1900", deep_json_raw(1900)),
    bad("yaml-date-value", yl(extra="meta:\n  when: 2026-11-29\n"), ext="yaml"),
    bad("yaml-timestamp-value", yl(extra="meta:\n  when: 2026-11-29T08:16:00Z\n"), ext="yaml"),
    bad("yaml-binary-value", yl(extra="meta:\n  blob: !!binary aGVsbG8=\n"), ext="yaml"),
    bad("yaml-set-value", yl(extra="meta:\n  tags: !!set {a, b}\n"), ext="yaml"),
    bad("yaml-nan-value", yl(extra="meta:\n  score: .nan\n"), ext="yaml"),
    bad("yaml-inf-value", yl(extra="meta:\n  score: .inf\n"), ext="yaml"),
    bad(
        "yaml-python-tag",
        yl(extra="meta:\n  x: !!python/object/apply:os.system ['true']\n"),
        ext="yaml",
    ),
    bad("yaml-complex-key", yl(extra="meta:\n  ? [a, b]\n  : c\n"), ext="yaml"),
    # -- encoding and size -----------------------------------------------------------------
    bad("latin1-yaml", yl(task="Caf\xe9 order").decode().encode("latin-1"), ext="yaml"),
    bad("utf16-json", js().decode().encode("utf-16")),
    bad("utf16-yaml", yl().decode().encode("utf-16"), ext="yaml"),
    bad("over-max-order-bytes", padded(MAX_ORDER_BYTES + 1)),
    # -- lone surrogates: valid JSON escapes that UTF-8 cannot hold -------------------------
    bad("surrogate-task", js({"task": "one \ud800 two"}), field="task", mention="lone surrogate (\\ud800)"),
    bad("surrogate-item-id", js({"items": [{"id": "R\udfff"}]}), field="items.0.id", mention="lone surrogate"),
    bad("surrogate-key", js({"meta": {"k\ud800": 1}}), field="meta", mention="key 'k\\ud800'"),
    bad("surrogate-top-key", js({"\udc80": 1}), mention="lone surrogate (\\udc80)"),
    bad("surrogate-task-yaml", yl(task='"one \\ud800 two"'), field="task", mention="lone surrogate", ext="yaml"),
    # -- valid files, at the edges -------------------------------------------------------
    good("ok-json", js()),
    good("ok-yaml", yl(), ext="yaml"),
    good("ok-yml", yl(), ext="yml"),
    good("ok-bom-yaml", b"\xef\xbb\xbf" + yl(), ext="yaml"),
    good("ok-bom-json", b"\xef\xbb\xbf" + js()),
    good("ok-task-500-chars", js({"task": "x" * 500})),
    good("ok-task-unicode", js({"task": "Café ☕ for Aina, naïve résumé"})),
    good("ok-task-500-multibyte", yl(task="é" * 500), ext="yaml"),
    good("ok-crlf-yaml", yl().replace(b"\n", b"\r\n"), ext="yaml"),
    good("ok-id-128-chars", js({"job_id": "J" * 128, "items": [{"id": "R" * 128}]})),
    good("ok-id-punctuation", js({"job_id": "a.B_c-9", "items": [{"id": "0.x_Y-z"}]})),
    good("ok-quoted-date-yaml", yl(job_id='"2026-11-29"', frm='"2026-11-29"'), ext="yaml"),
    good("ok-timeout-at-max", js({"timeout": MAX_TIMEOUT})),
    good("ok-timeout-float", js({"timeout": 0.5})),
    good("ok-attempts", js({"max_attempts": 3})),
    good("ok-attempts-100", js({"max_attempts": 100})),
    good("ok-surrogate-pair", js({"task": "coffee \U0001f600", "items": [{"id": "R1", "note": "\U0001f600"}]})),
    good("ok-optional-fields", js({"for": "Aina", "meta": {"a": [1, {"b": None}]}})),
    good("ok-lineage-in-file", js({"parent": "OTHER-1", "hops": 3})),
    # lineage comes from the ledger, never from the file: whatever the file sets there changes nothing
    good("ok-lineage-hops-null", js({"hops": None})),
    good("ok-lineage-hops-negative", js({"hops": -1})),
    good("ok-lineage-parent-number", js({"parent": 5, "hops": "many"})),
    good("ok-writes-patterns", js({"writes": ["reports/*.csv", "notes/*", "a/b/c.txt"]})),
    good("ok-output-nested", js({"writes": []}, output="reports/final.jsonl")),
    good("ok-accept-full", js(key="ref", allowed={"team": ["orders", "bakery"]}, required=["team"])),
    good("ok-nesting-10", deep_json(10)),
    good("ok-at-max-order-bytes", padded(MAX_ORDER_BYTES)),
]

SUBMIT_CASES = [
    c
    for c in ORDER_CASES
    if c.id
    in {
        "missing-items",
        "unknown-acept",
        "to-unknown-agent",
        "task-cr",
        "yaml-anchor-alias",
        "latin1-yaml",
        "over-max-order-bytes",
        "surrogate-task",
        "surrogate-item-id",
        "surrogate-key",
    }
]


def error_rest(proc: subprocess.CompletedProcess[str], name: str) -> str:
    """Assert exit 2 with one stderr line `<name>: ...`; return what follows `<name>: `."""
    assert proc.returncode == 2, f"exit {proc.returncode}, stderr {proc.stderr!r}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {proc.stderr!r}"
    line = lines[0]
    assert line.startswith(f"{name}: "), f"error does not start with the file name: {line!r}"
    rest = line[len(name) + 2 :]
    assert rest.strip(), f"empty message: {line!r}"
    return rest


def dotted(field: str) -> str:
    """Normalise `items[1].id` or `accept['output']` to `items.1.id` / `accept.output`."""
    return re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", field).strip(".")


def assert_names_field(rest: str, field: str) -> None:
    named, sep, message = rest.partition(": ")
    assert sep and message.strip(), f"no `<field>: <message>` in {rest!r}"
    got = dotted(named.strip())
    assert got == field or got.startswith(field + "."), f"error names {named!r}, not {field!r}"


@pytest.fixture(scope="module")
def order_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One root and config for every order case; the files live in a cwd subfolder."""
    tmp = tmp_path_factory.mktemp("validate")
    env = Env(
        tmp=tmp,
        root=tmp / "dispatch",
        config_path=tmp / "dispatcher.yaml",
        count_file=tmp / "starts.txt",
    )
    env.configure(max_timeout=MAX_TIMEOUT, max_order_bytes=MAX_ORDER_BYTES)
    yield env


def run_all(env: Env, command: str, cases: list[Case], folder: str) -> dict[str, subprocess.CompletedProcess[str]]:
    """Write each case under env.tmp/folder; run `dispatcher COMMAND folder/name`, a few at once."""
    (env.tmp / folder).mkdir(exist_ok=True)
    for case in cases:
        (env.tmp / folder / case.name).write_bytes(case.data)

    def one(case: Case) -> tuple[str, subprocess.CompletedProcess[str]]:
        return case.id, env.cli(command, f"{folder}/{case.name}", timeout=90)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, cases))


@pytest.fixture(scope="module")
def validated(order_env: Env) -> dict[str, subprocess.CompletedProcess[str]]:
    return run_all(order_env, "validate", ORDER_CASES, "orders")


@pytest.fixture(scope="module")
def submitted(order_env: Env) -> dict[str, subprocess.CompletedProcess[str]]:
    return run_all(order_env, "submit", SUBMIT_CASES, "submits")


@pytest.mark.parametrize("case", [c for c in ORDER_CASES if not c.valid], ids=lambda c: c.id)
def test_invalid_order_exits_2_with_one_line_naming_the_field(
    validated: dict[str, subprocess.CompletedProcess[str]], case: Case
) -> None:
    """A file that breaks one order rule exits 2 with one `<file>: <field>: <message>` line."""
    rest = error_rest(validated[case.id], f"orders/{case.name}")
    if case.field is not None:
        assert_names_field(rest, case.field)
    if case.mention is not None:
        assert case.mention in rest, f"{case.mention!r} not named in {rest!r}"
    assert "Traceback" not in validated[case.id].stderr


@pytest.mark.parametrize("case", [c for c in ORDER_CASES if c.valid], ids=lambda c: c.id)
def test_valid_order_at_the_edges_passes(validated: dict[str, subprocess.CompletedProcess[str]], case: Case) -> None:
    """A file that keeps every rule, even at a boundary, validates with exit 0."""
    proc = validated[case.id]
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr!r}"


def test_validate_does_not_submit(order_env: Env, validated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """`validate` only checks: nothing lands in inbox/ and the files stay where they were."""
    inbox = order_env.root / "inbox"
    dropped = [p.name for p in inbox.iterdir()] if inbox.exists() else []
    assert dropped == []
    for case in ORDER_CASES:
        assert (order_env.tmp / "orders" / case.name).read_bytes() == case.data


@pytest.mark.parametrize("case", SUBMIT_CASES, ids=lambda c: c.id)
def test_submit_refuses_invalid_order_like_validate(
    order_env: Env,
    validated: dict[str, subprocess.CompletedProcess[str]],
    submitted: dict[str, subprocess.CompletedProcess[str]],
    case: Case,
) -> None:
    """`submit` of a bad file exits 2 with the same one-line error as `validate`, drops nothing."""
    rest = error_rest(submitted[case.id], f"submits/{case.name}")
    assert rest == error_rest(validated[case.id], f"orders/{case.name}")
    inbox = order_env.root / "inbox"
    visible = [p.name for p in inbox.iterdir() if not p.name.startswith(".")] if inbox.exists() else []
    assert visible == []


def test_validate_several_files_exits_0_when_all_are_valid(order_env: Env) -> None:
    """`validate FILE...` takes several files and exits 0 when each of them is valid."""
    folder = order_env.tmp / "multi"
    folder.mkdir(exist_ok=True)
    (folder / "a.json").write_bytes(js({"job_id": "MULTI-A"}))
    (folder / "b.yaml").write_bytes(yl(job_id="MULTI-B"))
    proc = order_env.cli("validate", "multi/a.json", "multi/b.yaml")
    assert proc.returncode == 0, proc.stderr


def test_validate_error_uses_the_path_as_given(order_env: Env) -> None:
    """The `<file>` in an error is the path exactly as given on the command line."""
    path = order_env.tmp / "given" / "bad order.json"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(js({"task": ""}))
    proc = order_env.cli("validate", str(path))
    assert_names_field(error_rest(proc, str(path)), "task")
    proc = order_env.cli("validate", "./given/bad order.json")
    assert_names_field(error_rest(proc, "./given/bad order.json"), "task")


# -- config ---------------------------------------------------------------------------------


def write_config(env: Env, cfg: dict[str, Any]) -> None:
    env.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def base_config(env: Env) -> dict[str, Any]:
    return {"root": str(env.root), "max_timeout": 100, "agents": {"worker": env.agent()}}


def config_error(env: Env, *args: str) -> str:
    """Run the CLI on the bad config; assert exit 2 with one stderr line and return it."""
    (env.tmp / "ok.json").write_bytes(js())
    proc = env.cli(*(args or ("validate", "ok.json")))
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr!r}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {proc.stderr!r}"
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_config_unknown_top_key_is_an_error(env: Env) -> None:
    """A typo among the config's top-level keys is an error naming the key."""
    cfg = base_config(env) | {"max_job": 3}
    write_config(env, cfg)
    assert "max_job" in config_error(env)


def test_config_unknown_agent_key_is_an_error(env: Env) -> None:
    """A typo inside an agent definition is an error naming the key."""
    cfg = base_config(env)
    cfg["agents"]["worker"]["comand"] = list(cfg["agents"]["worker"]["command"])
    write_config(env, cfg)
    assert "comand" in config_error(env)


def test_config_agent_timeout_above_max_timeout_is_an_error(env: Env) -> None:
    """An agent's timeout above max_timeout is a config error naming timeout."""
    cfg = base_config(env)
    cfg["agents"]["worker"]["timeout"] = 101
    write_config(env, cfg)
    assert "timeout" in config_error(env)


def test_config_agent_without_command_is_an_error(env: Env) -> None:
    """An agent without a command is a config error naming command."""
    cfg = base_config(env)
    del cfg["agents"]["worker"]["command"]
    write_config(env, cfg)
    assert "command" in config_error(env)


def test_config_timeout_at_max_timeout_is_fine(env: Env) -> None:
    """An agent timeout equal to max_timeout is accepted."""
    cfg = base_config(env)
    cfg["agents"]["worker"]["timeout"] = 100
    write_config(env, cfg)
    (env.tmp / "ok.json").write_bytes(js())
    proc = env.cli("validate", "ok.json")
    assert proc.returncode == 0, proc.stderr


def test_run_refuses_a_bad_config_with_exit_2(env: Env) -> None:
    """`run --once` with a bad config exits 2 with one line and starts nothing."""
    write_config(env, base_config(env) | {"max_job": 3})
    (env.root / "inbox").mkdir(parents=True)
    (env.root / "inbox" / "JOB-1.json").write_bytes(js())
    line = config_error(env, "run", "--once")
    assert "max_job" in line
    assert (env.root / "inbox" / "JOB-1.json").exists()
    assert env.starts() == []


def test_config_from_environment_variable(env: Env) -> None:
    """Without --config, $DISPATCHER_CONFIG names the config file."""
    (env.tmp / "ok.json").write_bytes(js())
    (env.tmp / "nobody.json").write_bytes(js({"to": "nobody"}))
    run_env = cli_env() | {"DISPATCHER_CONFIG": str(env.config_path)}

    def validate(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PYTHON_M, "validate", name],
            capture_output=True,
            text=True,
            cwd=env.tmp,
            env=run_env,
            timeout=60,
        )

    assert validate("ok.json").returncode == 0
    assert_names_field(error_rest(validate("nobody.json"), "nobody.json"), "to")


def test_config_relative_root_resolves_against_config_folder(env: Env) -> None:
    """A relative `root:` resolves against the config file's folder, not the cwd."""
    cfg_dir = env.tmp / "etc" / "dispatcher"
    cfg_dir.mkdir(parents=True)
    cfg = {"root": "../spool", "agents": {"worker": env.agent()}}
    cfg_path = cfg_dir / "dispatcher.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    spool = env.tmp / "etc" / "spool" / "inbox"
    spool.mkdir(parents=True)
    order = env.tmp / "ok.json"
    order.write_bytes(js({"job_id": "REL-1"}))
    proc = subprocess.run(
        [*PYTHON_M, "--config", str(cfg_path), "submit", "ok.json"],
        capture_output=True,
        text=True,
        cwd=env.tmp,
        env=cli_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert [p.read_bytes() for p in spool.iterdir() if not p.name.startswith(".")] == [order.read_bytes()]
    assert not (env.tmp.parent / "spool").exists()


def test_submit_drops_each_file_and_prints_each_job_id(env: Env) -> None:
    """`submit FILE...` validates, drops each file into inbox/ under a visible name and prints each job id."""
    (env.tmp / "a.json").write_bytes(js({"job_id": "SUB-A"}))
    (env.tmp / "b.yaml").write_bytes(yl(job_id="SUB-B"))
    proc = env.cli("submit", "a.json", "b.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SUB-A", "SUB-B"]
    inbox = env.root / "inbox"
    dropped = sorted(p.read_bytes() for p in inbox.iterdir() if not p.name.startswith("."))
    assert dropped == sorted([js({"job_id": "SUB-A"}), yl(job_id="SUB-B")])
    names = [p.name for p in inbox.iterdir()]
    assert not [n for n in names if n.startswith(".") or n.endswith((".tmp", ".part"))], names


def test_validate_without_files_checks_the_config(env: Env) -> None:
    """`validate` with no file checks the config: exit 0 when good, 2 naming the key when not."""
    assert env.cli("validate").returncode == 0
    write_config(env, base_config(env) | {"retry_dealy": 1})
    assert "retry_dealy" in config_error(env, "validate")


@pytest.mark.parametrize("command", ["validate", "submit"])
def test_missing_file_exits_2_with_one_line(env: Env, command: str) -> None:
    """A file that cannot be read is invalid input: exit 2 and one line naming it."""
    proc = env.cli(command, "no-such-order.json")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("no-such-order.json: "), proc.stderr


def test_default_max_order_bytes_is_one_mebibyte(env: Env) -> None:
    """Without max_order_bytes in the config, 1 MiB passes and one byte more is refused."""
    (env.tmp / "big-ok.json").write_bytes(padded(1_048_576))
    (env.tmp / "big-bad.json").write_bytes(padded(1_048_577))
    assert env.cli("validate", "big-ok.json").returncode == 0
    error_rest(env.cli("validate", "big-bad.json"), "big-bad.json")


def test_root_option_overrides_the_configured_root(env: Env) -> None:
    """`--root DIR` replaces the config's root: submit drops into DIR/inbox/."""
    other = env.tmp / "other-root"
    (other / "inbox").mkdir(parents=True)
    (env.tmp / "ok.json").write_bytes(js({"job_id": "ROOT-1"}))
    proc = env.cli("--root", str(other), "submit", "ok.json")
    assert proc.returncode == 0, proc.stderr
    assert [p.read_bytes() for p in (other / "inbox").iterdir() if not p.name.startswith(".")] == [
        js({"job_id": "ROOT-1"})
    ]
    inbox = env.root / "inbox"
    assert not inbox.exists() or not [p for p in inbox.iterdir() if not p.name.startswith(".")]


CONFIG_CASES = [
    ("agent-concurrency-0", "    concurrency: 0\n", "", "concurrency"),
    ("agent-timeout-0", "    timeout: 0\n", "", "timeout"),
    ("agent-max-attempts-0", "    max_attempts: 0\n", "", "max_attempts"),
    ("agent-max-attempts-101", "    max_attempts: 101\n", "", "max_attempts: must be at most 100"),
    ("agent-retry-safe-string", "    retry_safe: maybe\n", "", "retry_safe"),
    ("agent-env-int", "    env: {A: 1}\n", "", "env"),
    ("agent-command-empty", "    command: []\n", "", "command"),
    ("agent-command-string", "    command: python3 agent.py\n", "", "command"),
    ("agent-prompt-int", "    prompt: 5\n", "", "prompt"),
    ("max-jobs-0", "", "max_jobs: 0\n", "max_jobs"),
    ("max-followups-negative", "", "max_followups: -1\n", "max_followups: must be at least 0"),
    ("max-followups-string", "", "max_followups: many\n", "max_followups"),
    ("settle-negative", "", "settle: -1\n", "settle"),
    ("max-timeout-int-beyond-float", "", f"max_timeout: {2**1100}\n", "max_timeout: is too large (1101 bits)"),
    ("agent-timeout-int-beyond-float", f"    timeout: {2**1100}\n", "", "timeout: is too large"),
    ("duplicate-key", "", "max_jobs: 1\nmax_jobs: 2\n", "max_jobs"),
]


@pytest.mark.parametrize(
    ("agent_extra", "top_extra", "mention"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_config_value_errors_name_the_key(env: Env, agent_extra: str, top_extra: str, mention: str) -> None:
    """A config value of the wrong type or range is an error naming its key, with exit 2."""
    command = "    command: [python3, agent.py]\n" if "command:" not in agent_extra else ""
    env.config_path.write_text(f"root: {env.root}\n{top_extra}agents:\n  worker:\n{command}{agent_extra}")
    assert mention in config_error(env)


def test_config_limits_at_their_edges_are_fine(env: Env) -> None:
    """max_attempts 100 for an agent and max_followups 1 are inside the limits: `validate --config` exits 0."""
    agent = "    command: [python3, ./agent.py]\n    max_attempts: 100\n"
    env.config_path.write_text(f"root: {env.root}\nmax_followups: 1\nagents:\n  worker:\n{agent}")
    (env.config_path.parent / "agent.py").write_text("")  # the script is checked too, resolved beside the config
    proc = env.cli("validate")
    assert proc.returncode == 0, proc.stderr
    assert "ok (1 agent)" in proc.stdout


def test_a_bare_script_name_beside_the_config_is_resolved_there(env: Env) -> None:
    """`[python3, agent.py]`: agent.py beside the config is the script, whatever the working folder."""
    env.config_path.write_text(f"root: {env.root}\nagents:\n  worker:\n    command: [python3, agent.py]\n")
    proc = env.cli("validate")
    assert proc.returncode == 2 and "agent.py' not found" in proc.stderr, proc.stderr
    (env.config_path.parent / "agent.py").write_text("")
    proc = env.cli("validate")
    assert proc.returncode == 0, proc.stderr
    from dispatcher.spec.settings import resolve_argv

    got = resolve_argv(("python3", "agent.py", "notes.txt"), env.config_path.parent)
    assert got == ("python3", str(env.config_path.parent / "agent.py"), "notes.txt")
    assert resolve_argv(("echo", "agent.py"), env.config_path.parent) == ("echo", "agent.py")


@pytest.mark.parametrize("command", ["[/usr/bin/env, python3, agent.py]", "[python3, -u, agent.py]"])
def test_a_bare_script_name_after_env_or_an_option_is_resolved_beside_the_config(env: Env, command: str) -> None:
    """`[/usr/bin/env, python3, agent.py]` and `[python3, -u, agent.py]` find agent.py beside the config as
    `[python3, agent.py]` does (`validate` said ok and the agent then looked for it in work/); missing, it is
    named by `validate`."""
    env.config_path.write_text(f"root: {env.root}\nagents:\n  worker:\n    command: {command}\n")
    proc = env.cli("validate")
    assert proc.returncode == 2 and "agent.py' not found" in proc.stderr, proc.stderr
    script = env.config_path.parent / "agent.py"
    script.write_text(
        "import json, os\n"
        "o = json.load(open(os.environ['DISPATCH_ORDER']))\n"
        "r = {'job_id': o['job_id'], 'input_ids': [i['id'] for i in o['items']], 'status': 'done'}\n"
        "json.dump(r, open(os.environ['DISPATCH_RECEIPT'], 'w'))\n"
    )
    assert env.cli("validate").returncode == 0
    body = order("ENV-1")
    del body["accept"]
    env.drop(body)
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert env.result("ENV-1", "done")["state"] == "done"


@pytest.mark.parametrize("text", ["- a list\n", "just text\n", ""], ids=["list", "scalar", "empty"])
def test_config_that_is_not_a_mapping_is_an_error(env: Env, text: str) -> None:
    """A config whose top level is not a mapping is refused with exit 2 and one line."""
    env.config_path.write_text(text)
    config_error(env)


def test_missing_config_file_is_an_error(env: Env) -> None:
    """A --config path that does not exist exits 2 with one line naming it."""
    env.config_path.unlink()
    assert env.config_path.name in config_error(env)


def test_suffix_is_matched_as_written(env: Env) -> None:
    """An order named `*.JSON` is not a work order: only .yaml, .yml and .json are."""
    path = env.tmp / "UPPER.JSON"
    path.write_text(json.dumps(order("UPPER-1")))
    proc = env.cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{path}: not a work order (the name must end in .yaml, .yml or .json)"


def test_an_integer_longer_than_int_converts_is_refused_in_one_line_naming_it(env: Env) -> None:
    """A 5,000-digit integer (int() converts 4,300): `validate` and `submit` exit 2 with one line naming the field,
    and the daemon refuses the dropped file with that reason and its job_id, never a traceback or Python's advice."""
    env.configure()
    huge = "9" * 5000
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    (env.tmp / "huge-j.json").write_text(
        json.dumps(BASE | {"job_id": "HUGE-J"})[:-1] + ', "meta": {"x": ' + huge + "}}"
    )
    (env.tmp / "huge-y.yaml").write_bytes(yl(job_id="HUGE-Y", extra=f"meta:\n  x: {huge}\n"))
    for name in ("huge-j.json", "huge-y.yaml"):
        for command in ("validate", "submit"):
            proc = env.cli(command, str(env.tmp / name))
            assert proc.returncode == 2, (command, proc.stderr)
            lines = proc.stderr.splitlines()
            assert len(lines) == 1 and "meta.x: a number of 5000 digits is too long (at most 4300)" in lines[0], lines
        (env.root / "inbox" / name).write_bytes((env.tmp / name).read_bytes())
    env.cli("run", "--once", timeout=60)
    for name, job_id in (("huge-j.json", "HUGE-J"), ("huge-y.yaml", "HUGE-Y")):
        (folder,) = (env.root / "failed").glob(f"{name.split('.')[0]}@*")
        result = json.loads((folder / "result.json").read_text())
        assert result["job_id"] == job_id and "meta.x: a number of 5000 digits" in result["reason"], result
        assert "sys.set_int_max_str_digits" not in result["reason"]


def test_a_refused_yaml_order_that_no_parse_reads_keeps_its_job_id(env: Env) -> None:
    """YAML that even a plain parse cannot read (the escape of a lone surrogate, an alias never defined) is
    refused with the job_id its one top-level `job_id:` line names, in result.json and in `list --json`."""
    env.configure()
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    files = {
        "SUR-1": 'job_id: SUR-1\nfrom: me\nto: worker\ntask: "a\\ud800"\nitems: [{id: A}]\n',
        "ALIAS-1": "job_id: 'ALIAS-1'  # quoted\nfrom: me\nto: worker\ntask: t\nitems: [{id: A}]\nmeta: {a: *x}\n",
        "TWICE-1": "job_id: TWICE-1\njob_id: TWICE-2\nfrom: me\nto: worker\ntask: t\nitems: [{id: A}]\nmeta: *x\n",
    }
    for stem, text in files.items():
        (inbox / f"{stem}.yaml").write_text(text)
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stderr
    want = {"SUR-1": "SUR-1", "ALIAS-1": "ALIAS-1", "TWICE-1": None}  # two job_id lines: no one id is read
    for stem, job_id in want.items():
        (folder,) = (env.root / "failed").glob(f"{stem}@*")
        assert json.loads((folder / "result.json").read_text())["job_id"] == job_id, stem
        assert (folder / "order.yaml").read_text() == files[stem]
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert sorted(r["job_id"] or "-" for r in listed if r["state"] == "refused") == ["-", "ALIAS-1", "SUR-1"]
