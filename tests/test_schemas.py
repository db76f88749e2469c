"""The published JSON Schemas (dispatcher/schemas/*.json) against `jsonschema`, the reference.

Editors and other tools read these files with a standard JSON Schema 2020-12
validator, while the daemon applies them with its own small one
(`dispatcher.spec.schema`). These tests prove the files are valid JSON Schema, that
the two validators agree on a corpus of valid and invalid orders, configs and
receipts, and they write down the few deliberate differences: patterns are
matched against the whole string (a trailing newline never slips past `$`), and
rules only code can check (unique item ids, known agents, timeout ceilings,
nesting depth) are applied after the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dispatcher.errors import OrderError
from dispatcher.spec import schema
from dispatcher.spec.config import build_config, load_config
from dispatcher.spec.loader import load_document
from dispatcher.spec.orders import parse_order

REPO = Path(__file__).resolve().parent.parent
SCHEMA_FILES = sorted(schema.SCHEMA_DIR.glob("*.schema.json"))
AGENTS = {"worker", "assigner"}

# The keywords dispatcher.spec.schema implements; any other keyword in a schema file would be
# silently ignored by the daemon while editors enforce it.
VALIDATION_KEYWORDS = {
    "type", "enum", "properties", "required", "additionalProperties", "propertyNames", "items",
    "minItems", "maxItems", "uniqueItems",
    "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "$ref", "allOf", "anyOf",
}  # fmt: skip
ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description", "x-error"}


def reference(name: str) -> jsonschema.Draft202012Validator:
    """Return the reference validator for dispatcher/schemas/<name>.schema.json."""
    return jsonschema.Draft202012Validator(schema.load(name))


def ours_accepts(body: Any, name: str) -> bool:
    """Return True when dispatcher.spec.schema.validate finds nothing wrong with body."""
    try:
        schema.validate(body, name)
    except OrderError:
        return False
    return True


# -- the schema files themselves ----------------------------------------------------------------


def test_three_schemas_are_published() -> None:
    """The order, config and receipt schemas are shipped in dispatcher/schemas/."""
    assert [p.name for p in SCHEMA_FILES] == ["config.schema.json", "order.schema.json", "receipt.schema.json"]


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.name for p in SCHEMA_FILES])
def test_schema_is_valid_json_schema_2020_12(path: Path) -> None:
    """Each published schema declares draft 2020-12 and passes the draft's own metaschema."""
    body = json.loads(path.read_text())
    assert body["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert body["$id"].endswith("/" + path.name)
    jsonschema.Draft202012Validator.check_schema(body)


def _subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the schemas nested directly inside one schema object."""
    out: list[dict[str, Any]] = []
    for key in ("properties", "$defs"):
        out += node.get(key, {}).values()
    for key in ("items", "additionalProperties", "propertyNames"):
        if isinstance(node.get(key), dict):
            out.append(node[key])
    for key in ("allOf", "anyOf"):
        out += node.get(key, [])
    return out


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.name for p in SCHEMA_FILES])
def test_schema_uses_only_keywords_the_daemon_applies(path: Path) -> None:
    """No schema uses a keyword dispatcher.spec.schema ignores; x-error only ever sits beside a pattern."""
    todo = [json.loads(path.read_text())]
    seen = 0
    while todo:
        node = todo.pop()
        seen += 1
        unknown = set(node) - VALIDATION_KEYWORDS - ANNOTATIONS
        assert not unknown, f"{path.name}: keywords the daemon would ignore: {unknown}"
        if "x-error" in node:
            assert "pattern" in node, f"{path.name}: x-error without a pattern: {node}"
        todo += _subschemas(node)
    assert seen > 5


# -- the corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One document: is it valid by the schema, and (for orders and configs) accepted in full?

    ``reference_valid`` differs from ``valid`` only for the documented differences.
    ``accepted`` is what the daemon finally says, after the rules only code can check.
    """

    kind: str
    name: str
    body: Any
    valid: bool
    reference_valid: bool | None = None
    accepted: bool | None = None
    why: str = field(default="")

    @property
    def ref_valid(self) -> bool:
        return self.valid if self.reference_valid is None else self.reference_valid

    @property
    def fully_accepted(self) -> bool:
        return self.valid if self.accepted is None else self.accepted


def order(**extra: Any) -> dict[str, Any]:
    """Return a minimal valid order with fields replaced (None drops a field)."""
    body: dict[str, Any] = {
        "job_id": "JOB-1",
        "from": "tester",
        "to": "worker",
        "task": "Assign each request to one team.",
        "items": [{"id": "R1"}, {"id": "R2"}],
    }
    body.update(extra)
    return {k: v for k, v in body.items() if v is not None}


DROP = object()


def config(agent: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """Return a minimal valid config with one agent `worker` (its keys replaced by agent; DROP drops one)."""
    spec: dict[str, Any] = {"command": ["python3", "agent.py", "{order}"]}
    spec.update(agent or {})
    body: dict[str, Any] = {"agents": {"worker": {k: v for k, v in spec.items() if v is not DROP}}}
    body.update(top)
    return body


def receipt(**extra: Any) -> dict[str, Any]:
    """Return a valid receipt with fields replaced (None drops a field)."""
    body: dict[str, Any] = {"job_id": "JOB-1", "input_ids": ["R1"], "output_ids": ["R1"], "status": "done"}
    body.update(extra)
    return {k: v for k, v in body.items() if v is not None}


def deep(levels: int) -> dict[str, Any]:
    """Return a mapping nested this many levels deep."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"x": value}
    return value


FULL_ACCEPT = {
    "output": "out/assignments.jsonl",
    "key": "ref",
    "allowed": {"team": ["orders", "payments"], "n": [1, 2.5, True, None]},
    "required": ["team"],
    "followups": ["assigner"],
}
TRAILING_NL = "`$` matches before a final newline in re.search; ours matches the whole string"
FLOAT_INT = "JSON Schema's integer is any number with no fraction; ours is an integer written as one (not 2.0)"

ORDERS = [
    # valid
    Case("order", "minimal", order(), True),
    Case(
        "order",
        "every optional field",
        order(
            **{
                "for": "Kopi & Crumb",
                "writes": ["out/*.csv", "notes.md"],
                "accept": FULL_ACCEPT,
                "timeout": 0.5,
                "max_attempts": 3,
                "meta": {"any": ["thing", 1, None]},
            }
        ),
        True,
    ),
    Case("order", "job_id of 128 characters", order(job_id="J" + "x" * 127), True),
    Case("order", "task of 500 characters", order(task="t" * 500), True),
    Case("order", "unicode task", order(task="Café ☕ 注文 — one line"), True),
    Case("order", "items with free keys", order(items=[{"id": "a.b_c-1", "text": "x", "n": [1]}]), True),
    Case("order", "integer timeout", order(timeout=30), True),
    Case("order", "integer-valued float max_attempts", order(max_attempts=2.0), False, True, why=FLOAT_INT),
    Case("order", "integer-valued float priority", order(priority=1e0), False, True, why=FLOAT_INT),
    Case("order", "'..' inside a name is not a segment", order(writes=["a..b/c..", "..x"]), True),
    Case("order", "lineage fields of a released follow-up", order(parent="JOB-0", hops=1), True),
    Case("order", "empty accept", order(accept={}), True),
    # invalid
    Case("order", "missing job_id", order(job_id=None), False),
    Case("order", "missing items", order(items=None), False),
    Case("order", "job_id starting with '-'", order(job_id="-JOB"), False),
    Case("order", "job_id of 129 characters", order(job_id="J" * 129), False),
    Case("order", "job_id with a space", order(job_id="JOB 1"), False),
    Case("order", "job_id with '@'", order(job_id="JOB@1"), False),
    Case("order", "job_id a number", order(job_id=123), False),
    Case("order", "unknown top-level key", order(acept={}), False),
    Case("order", "unknown accept key", order(accept={"outptu": "x.csv"}), False),
    Case("order", "empty items", order(items=[]), False),
    Case("order", "items a mapping", order(items={"id": "R1"}), False),
    Case("order", "item without id", order(items=[{"name": "R1"}]), False),
    Case("order", "item id a number", order(items=[{"id": 1}]), False),
    Case("order", "item not a mapping", order(items=["R1"]), False),
    Case("order", "empty task", order(task=""), False),
    Case("order", "task of 501 characters", order(task="t" * 501), False),
    Case("order", "task with a line break inside", order(task="one\ntwo"), False),
    Case("order", "task with \\r", order(task="one\rtwo"), False),
    Case("order", "task with U+2028", order(task="one\u2028two"), False),
    Case("order", "task with a tab", order(task="one\ttwo"), False),
    Case("order", "from empty", order(**{"from": ""}), False),
    Case("order", "for with a control character", order(**{"for": "x\x07"}), False),
    Case("order", "timeout 0", order(timeout=0), False),
    Case("order", "timeout negative", order(timeout=-1), False),
    Case("order", "timeout a boolean", order(timeout=True), False),
    Case("order", "timeout a string", order(timeout="30"), False),
    Case("order", "max_attempts 0", order(max_attempts=0), False),
    Case("order", "max_attempts 1.5", order(max_attempts=1.5), False),
    Case("order", "max_attempts 100", order(max_attempts=100), True),
    Case("order", "max_attempts 101", order(max_attempts=101), False),
    Case("order", "absolute writes", order(writes=["/etc/passwd"]), False),
    Case("order", "writes starting with ..", order(writes=["../x"]), False),
    Case("order", "writes with a .. segment", order(writes=["a/../../x"]), False),
    Case("order", "writes ending in /..", order(writes=["a/.."]), False),
    Case("order", "writes a string", order(writes="out.csv"), False),
    Case("order", "accept.output a pattern", order(accept={"output": "out/*.csv"}), False),
    Case("order", "accept.output .txt", order(accept={"output": "out.txt"}), False),
    Case("order", "accept.output with ..", order(accept={"output": "../out.csv"}), False),
    Case("order", "accept.output absolute", order(accept={"output": "/tmp/out.csv"}), False),
    Case("order", "accept.allowed not a list", order(accept={"allowed": {"team": "orders"}}), False),
    Case("order", "accept.allowed holds an object", order(accept={"allowed": {"team": [{"x": 1}]}}), False),
    Case("order", "accept.key empty", order(accept={"key": ""}), False),
    Case("order", "accept.followups empty name", order(accept={"followups": [""]}), False),
    Case("order", "meta a list", order(meta=[1]), False),
    # lineage in a dropped file changes nothing (contract section 2), whatever its value
    Case("order", "hops negative", order(hops=-1), True),
    Case("order", "parent a number", order(parent=1), True),
    Case("order", "top level a list", [order()], False),
    # deliberate difference: the whole string must match
    Case("order", "job_id with a trailing newline", order(job_id="JOB-1\n"), False, True, why=TRAILING_NL),
    Case("order", "item id with a trailing newline", order(items=[{"id": "R1\n"}]), False, True, why=TRAILING_NL),
    Case("order", "task with a trailing newline", order(task="Do it.\n"), False, True, why=TRAILING_NL),
    Case("order", "to with a trailing newline", order(to="worker\n"), False, True, why=TRAILING_NL),
    # valid by the schema, refused by the rules only code can check
    Case("order", "duplicate item ids", order(items=[{"id": "R1"}, {"id": "R1"}]), True, accepted=False),
    Case("order", "to an agent the config lacks", order(to="nobody"), True, accepted=False),
    Case("order", "timeout above max_timeout", order(timeout=3601), True, accepted=False),
    Case("order", "followups to an unknown agent", order(accept={"followups": ["nobody"]}), True, accepted=False),
    Case("order", "meta nested deeper than 64 levels", order(meta=deep(70)), True, accepted=False),
]

CONFIGS = [
    Case("config", "one agent", config(), True),
    Case("config", "no agents", {"agents": {}}, True),
    Case(
        "config",
        "every key",
        config(
            {
                "prompt": "Do {task}",
                "timeout": 60,
                "concurrency": 2,
                "max_attempts": 2,
                "retry_safe": True,
                "probe": ["check", "{job_id}"],
                "repair": True,
                "writes": ["out.csv", "out/*"],
                "env": {"A": "1"},
            },
            root="../dispatch",
            max_jobs=2,
            max_timeout=3600,
            max_hops=0,
            max_order_bytes=1,
            stop_timeout=0,
            retry_delay=0,
            rescan_interval=0.5,
            settle=0,
            kill_grace=0,
            max_log_bytes=1,
            log_file="d.log",
        ),
        True,
    ),
    Case(
        "config", "probe and prompt null, log_file null", config({"probe": None, "prompt": None}, log_file=None), True
    ),
    Case("config", "agent name with dots", {"agents": {"a.b-c_1": {"command": ["x"]}}}, True),
    Case("config", "missing agents", {"max_jobs": 1}, False),
    Case("config", "unknown top-level key", config(max_job=2), False),
    Case("config", "unknown agent key", config({"comand": ["x"]}), False),
    Case("config", "agent without command", config({"command": DROP, "timeout": 5}), False),
    Case("config", "empty command", config({"command": []}), False),
    Case("config", "command a string", config({"command": "python3 agent.py"}), False),
    Case("config", "command with a number", config({"command": ["sleep", 5]}), False),
    Case("config", "agent name with a space", {"agents": {"my agent": {"command": ["x"]}}}, False),
    Case("config", "agent not a mapping", {"agents": {"worker": ["x"]}}, False),
    Case("config", "max_jobs 0", config(max_jobs=0), False),
    Case("config", "max_jobs true", config(max_jobs=True), False),
    Case("config", "max_jobs 2.0", config(max_jobs=2.0), False, True, why=FLOAT_INT),
    Case("config", "agent max_attempts 100", config({"max_attempts": 100}), True),
    Case("config", "agent max_attempts 101", config({"max_attempts": 101}), False),
    Case("config", "max_followups 1", config(max_followups=1), True),
    Case("config", "max_followups 0", config(max_followups=0), True),
    Case("config", "max_followups -1", config(max_followups=-1), False),
    Case("config", "max_followups 2.5", config(max_followups=2.5), False),
    Case("config", "max_timeout 0", config(max_timeout=0), False),
    Case("config", "settle negative", config(settle=-1), False),
    Case("config", "timeout 0", config({"timeout": 0}), False),
    Case("config", "concurrency 0", config({"concurrency": 0}), False),
    Case("config", "retry_safe a string", config({"retry_safe": "yes"}), False),
    Case("config", "env value a number", config({"env": {"A": 1}}), False),
    Case("config", "probe empty", config({"probe": []}), False),
    Case("config", "probe a string", config({"probe": "check.sh"}), False),
    Case("config", "writes absolute", config({"writes": ["/x"]}), False),
    Case("config", "root empty", config(root=""), False),
    Case("config", "log_file a number", config(log_file=1), False),
    Case("config", "agent timeout above max_timeout", config({"timeout": 7200}), True, accepted=False),
]

RECEIPTS = [
    Case("receipt", "contract example", receipt(outputs=["assignments.csv"]), True),
    Case("receipt", "failed with a reason", receipt(status="failed", reason="no data"), True),
    Case("receipt", "extra keys are free", receipt(notes={"a": 1}), True),
    Case("receipt", "empty id lists", receipt(input_ids=[], output_ids=[]), True),
    Case("receipt", "status ok", receipt(status="ok"), False),
    Case("receipt", "no status", receipt(status=None), False),
    Case("receipt", "no output_ids (only checked with accept.output)", receipt(output_ids=None), True),
    Case("receipt", "input_ids a string", receipt(input_ids="R1"), False),
    Case("receipt", "input_ids with a number", receipt(input_ids=[1]), False),
    Case("receipt", "job_id a number", receipt(job_id=1), False),
    Case("receipt", "reason a list", receipt(reason=["x"]), False),
    Case("receipt", "a list", [receipt()], False),
]

CORPUS = ORDERS + CONFIGS + RECEIPTS


@pytest.mark.parametrize("case", CORPUS, ids=[f"{c.kind}-{c.name}" for c in CORPUS])
def test_our_validator_and_jsonschema_agree(case: Case) -> None:
    """dispatcher.spec.schema and jsonschema give the same verdict, except for the documented differences."""
    assert ours_accepts(case.body, case.kind) is case.valid
    assert reference(case.kind).is_valid(case.body) is case.ref_valid


def test_corpus_is_broad() -> None:
    """The corpus holds plenty of valid and invalid documents of each kind, so agreement means something."""
    for kind in ("order", "config", "receipt"):
        mine = [c for c in CORPUS if c.kind == kind]
        assert sum(c.valid for c in mine) >= 3 and sum(not c.valid for c in mine) >= 5, kind
    assert len(CORPUS) >= 40


def test_every_difference_is_the_trailing_newline_or_an_integer_written_as_a_float() -> None:
    """The only documents the two validators disagree on end in a newline that `$` lets through, or write an
    integer as a float (2.0)."""
    differ = [c for c in CORPUS if c.ref_valid != c.valid]
    assert {c.why for c in differ} == {TRAILING_NL, FLOAT_INT}
    for c in differ:
        assert not c.valid
        if c.why == TRAILING_NL:
            assert any(isinstance(v, str) and v.endswith("\n") for v in _strings(c.body)), c.name
        else:
            assert any(isinstance(v, float) and v.is_integer() for v in _strings(c.body)), c.name


def _strings(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value]


def _accepts_order(body: Any) -> bool:
    try:
        parse_order(json.dumps(body).encode(), "order.json", agents=AGENTS, max_timeout_s=3600)
    except OrderError:
        return False
    return True


def _accepts_config(body: Any) -> bool:
    try:
        build_config(body, None)
    except OrderError:
        return False
    return True


@pytest.mark.parametrize(
    "case",
    [c for c in ORDERS + CONFIGS],
    ids=[f"{c.kind}-{c.name}" for c in ORDERS + CONFIGS],
)
def test_code_rules_come_on_top_of_the_schema(case: Case) -> None:
    """The daemon accepts a document only if the schema does, and refuses the code-only cases too."""
    accepts = _accepts_order if case.kind == "order" else _accepts_config
    assert accepts(case.body) is case.fully_accepted
    if case.fully_accepted:
        assert case.valid and case.ref_valid


# -- the shipped examples -----------------------------------------------------------------------

EXAMPLE_CONFIGS = [REPO / "config" / "dispatcher.yaml", REPO / "config" / "agents.claude.yaml"]
EXAMPLE_ORDERS = sorted((REPO / "examples" / "kopi").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=[p.name for p in EXAMPLE_CONFIGS])
def test_example_config_validates(path: Path) -> None:
    """The example configs load in the daemon and are valid by the published config schema."""
    cfg = load_config(path)
    assert {"intake", "assigner"} <= set(cfg.agents)  # dispatcher.yaml adds the notifier after the review
    body = load_document(path.read_bytes(), "yaml", aliases=True)
    reference("config").validate(body)


def test_example_orders_are_found() -> None:
    """The Kopi & Crumb example orders are there to be checked."""
    assert [p.name for p in EXAMPLE_ORDERS] == ["JOB-001.yaml", "JOB-002.yaml"]


@pytest.mark.parametrize("path", EXAMPLE_ORDERS, ids=[p.name for p in EXAMPLE_ORDERS])
def test_example_order_validates(path: Path) -> None:
    """Each example order is accepted with the example config's agents and valid by the order schema."""
    cfg = load_config(EXAMPLE_CONFIGS[0])
    got = parse_order(path.read_bytes(), path.name, agents=cfg.agents, max_timeout_s=cfg.max_timeout_s)
    assert got.job_id == path.stem
    reference("order").validate(load_document(path.read_bytes(), "yaml"))


# -- the compiled checks against the schema walk ----------------------------------------------


def _verdict(check: Any, body: Any, name: str) -> tuple[str | None, str] | None:
    try:
        check(body, name)
    except OrderError as exc:
        return (exc.field, exc.message)
    return None


ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1.5, 10**20, "", "x", "a\nb", " "]
ODD_VALUES += [[], [1], ["a", "a"], {}, {"id": 1}]


def _mutations(body: Any) -> list[Any]:
    """Return body with each field, list entry and nested value replaced by odd values, dropped, or extended."""
    out: list[Any] = []
    if isinstance(body, dict):
        for key, value in body.items():
            for odd in ODD_VALUES:
                out.append({**body, key: odd})
            out.append({k: v for k, v in body.items() if k != key})
            out.extend({**body, key: sub} for sub in _mutations(value))
        out.append({**body, "zz_unknown": 1})
    elif isinstance(body, list):
        for i, value in enumerate(body):
            out.extend([*body[:i], sub, *body[i + 1 :]] for sub in _mutations(value))
            out.extend([*body[:i], odd, *body[i + 1 :]] for odd in ODD_VALUES)
        out.append([*body, *body])
    return out


def test_compiled_checks_say_what_the_schema_walk_says() -> None:
    """Every corpus document and thousands of mutations of it: the same field and message, or both accept."""
    compared = refused = 0
    for case in CORPUS:
        for body in [case.body, *_mutations(case.body)]:
            walked = _verdict(schema.check_interpreted, body, case.kind)
            compiled = _verdict(schema.validate, body, case.kind)
            assert compiled == walked, (case.kind, case.name, body)
            compared += 1
            refused += walked is not None
    assert compared > 5000 and refused > 2000
