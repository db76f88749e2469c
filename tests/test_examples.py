"""The bundled Kopi & Crumb demo: its agents, the `claude` stub, its configs and demo.sh.

The agents run as real subprocesses in a temporary work/ folder, with the environment
the daemon gives them; the configs and demo.sh run through the real CLI and daemon.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
INTAKE = EXAMPLES / "agents" / "intake.py"
ASSIGNER = EXAMPLES / "agents" / "assigner.py"
CLAUDE_STUB = REPO / "tests" / "agents" / "claude"
JOB_001 = EXAMPLES / "kopi" / "JOB-001.yaml"
JOB_002 = EXAMPLES / "kopi" / "JOB-002.yaml"
MESSAGES = EXAMPLES / "kopi" / "messages.json"
TEAMS = ["orders", "payments", "bakery", "store-hours"]
EXPECTED_TEAMS = {
    "R1": "orders",
    "R2": "orders",
    "R3": "payments",
    "R4": "bakery",
    "R5": "store-hours",
}
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# -- helpers ----------------------------------------------------------------------------
def read_order(path: Path) -> dict[str, Any]:
    """Return an example order file as the validated JSON the daemon would hand over."""
    return yaml.safe_load(path.read_text())


def prepare(tmp: Path, order: dict[str, Any] | None, name: str = "work") -> Path:
    """Make a work/ folder holding order.json (unless order is None); return it."""
    work = tmp / name
    work.mkdir()
    if order is not None:
        (work / "order.json").write_text(json.dumps(order))
    return work


def agent_env(work: Path, job_id: str, **extra: str) -> dict[str, str]:
    """Return the environment the daemon gives an agent (PATH, HOME, LANG, DISPATCH_*)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update(
        DISPATCH_JOB_ID=job_id,
        DISPATCH_ORDER=str(work / "order.json"),
        DISPATCH_WORKSPACE=str(work),
        DISPATCH_RECEIPT=str(work / "receipt.json"),
        DISPATCH_ATTEMPT="1",
    )
    env.update(extra)
    return env


def run_agent(script: Path, work: Path, job_id: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run an example agent the way the daemon does: argv [python, script, ORDER], cwd work/."""
    argv = [sys.executable, str(script), *(args or [str(work / "order.json")])]
    return subprocess.run(
        argv,
        cwd=work,
        env=agent_env(work, job_id, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def run_stub(work: Path, prompt: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run the claude stub with the argv of config/agents.claude.yaml."""
    config = yaml.safe_load((REPO / "config" / "agents.claude.yaml").read_text())
    argv = [a.replace("{prompt}", prompt) for a in config["agents"]["intake"]["command"]]
    assert argv[0] == "claude"
    argv[0] = str(CLAUDE_STUB)
    return subprocess.run(
        argv,
        cwd=work,
        env=agent_env(work, "JOB", **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def last_json(stdout: str) -> dict[str, Any]:
    """Return the JSON object on the last non-blank line of stdout."""
    line = [x for x in stdout.splitlines() if x.strip()][-1]
    value = json.loads(line)
    assert isinstance(value, dict)
    return value


def files_in(folder: Path) -> list[str]:
    """Return every file below folder as sorted POSIX relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def handoff(tmp: Path) -> dict[str, Any]:
    """Run intake on JOB-001 and return the follow-up order it wrote."""
    work = prepare(tmp, read_order(JOB_001), "intake-work")
    assert run_agent(INTAKE, work, "JOB-001").returncode == 0
    return json.loads((work / "outbox" / "JOB-001.assign.json").read_text())


def cli_env(**extra: str) -> dict[str, str]:
    """Return an environment for the CLI: this checkout's package, no inherited config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def dispatcher(*args: str, timeout: float = 90, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m dispatcher ARGS` from the checkout's root."""
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", *args],
        cwd=REPO,
        env=cli_env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stub_path() -> str:
    """Return a PATH with the claude stub first, then this Python's folder, then the rest."""
    folders = [str(CLAUDE_STUB.parent), str(Path(sys.executable).parent), os.environ["PATH"]]
    return os.pathsep.join(folders)


def result(root: Path, state: str, job_id: str) -> dict[str, Any]:
    return json.loads((root / state / job_id / "result.json").read_text())


# -- the example data ---------------------------------------------------------------------
def test_job_001_carries_the_five_messages_of_messages_json() -> None:
    """JOB-001.yaml holds exactly the messages of messages.json (without the channel)."""
    messages = json.loads(MESSAGES.read_text())
    assert [m["id"] for m in messages] == ["R1", "R2", "R3", "R4", "R5"]
    assert [m["customer"] for m in messages] == ["Aina", "Hafiz", "Priya", "Wei Jie", "Daniel"]
    inline = [{k: v for k, v in m.items() if k != "channel"} for m in messages]
    assert read_order(JOB_001)["items"] == inline


# -- intake ---------------------------------------------------------------------------------
def test_intake_hands_every_message_to_the_assigner(tmp_path: Path) -> None:
    """Intake writes one follow-up order to the assigner, one item per message, and a receipt."""
    work = prepare(tmp_path, read_order(JOB_001))
    proc = run_agent(INTAKE, work, "JOB-001")
    assert proc.returncode == 0, proc.stderr
    assert files_in(work) == ["order.json", "outbox/JOB-001.assign.json", "receipt.json"]
    follow = json.loads((work / "outbox" / "JOB-001.assign.json").read_text())
    assert follow["job_id"] == "JOB-001.assign"
    assert (follow["from"], follow["to"]) == ("intake", "assigner")
    assert follow["task"] == "Assign each request to one team: orders, payments, bakery or store-hours."
    assert "parent" not in follow and "hops" not in follow
    assert [i["id"] for i in follow["items"]] == ["R1", "R2", "R3", "R4", "R5"]
    assert follow["items"][0] == {
        "id": "R1",
        "customer": "Aina",
        "summary": "Order KC-1042 came without the oat milk I paid for.",
        "order": "KC-1042",
    }
    assert all(set(i) == {"id", "customer", "summary", "order"} for i in follow["items"])
    assert follow["accept"] == {
        "output": "assignments.csv",
        "key": "id",
        "allowed": {"team": TEAMS},
        "required": ["team", "next_step"],
    }
    assert follow["writes"] == ["assignments.csv"]
    receipt = json.loads((work / "receipt.json").read_text())
    ids = ["R1", "R2", "R3", "R4", "R5"]
    assert receipt == {
        "job_id": "JOB-001",
        "input_ids": ids,
        "output_ids": ids,
        "status": "done",
        "outputs": [],
    }
    summary = last_json(proc.stdout)
    assert summary["type"] == "result" and summary["is_error"] is False
    assert summary["session_id"] == "local-JOB-001" and summary["num_turns"] == 1
    assert "JOB-001.assign" in proc.stdout.splitlines()[0]


def test_intake_reads_messages_by_id_from_meta_messages(tmp_path: Path) -> None:
    """Items that carry only an id get their text from the file named by meta.messages."""
    order = read_order(JOB_002)
    order["meta"].pop("skip_handoff")
    work = prepare(tmp_path, order)
    assert run_agent(INTAKE, work, "JOB-002").returncode == 0
    follow = json.loads((work / "outbox" / "JOB-002.assign.json").read_text())
    by_id = {i["id"]: i for i in follow["items"]}
    assert by_id["R3"]["customer"] == "Priya"
    assert by_id["R3"]["summary"] == "The card machine charged me twice for one latte this morning."
    assert by_id["R2"]["order"] == "KC-1047" and by_id["R4"]["order"] is None


def test_intake_skip_handoff_writes_a_receipt_but_no_followup(tmp_path: Path) -> None:
    """With meta.skip_handoff the receipt claims done, yet no outbox order exists."""
    work = prepare(tmp_path, read_order(JOB_002))
    proc = run_agent(INTAKE, work, "JOB-002")
    assert proc.returncode == 0, proc.stderr
    assert files_in(work) == ["order.json", "receipt.json"]
    receipt = json.loads((work / "receipt.json").read_text())
    assert receipt["status"] == "done" and receipt["output_ids"] == ["R1", "R2", "R3", "R4", "R5"]
    assert "skipped on purpose" in proc.stdout


@pytest.mark.parametrize("name", ["../config/dispatcher.yaml", "/etc/passwd", "kopi/nothing.json"])
def test_intake_fails_in_its_receipt_on_a_bad_messages_file(tmp_path: Path, name: str) -> None:
    """A messages path outside examples/, or one that is missing, fails the receipt: no handoff."""
    order = read_order(JOB_002)
    order["meta"] = {"messages": name}
    work = prepare(tmp_path, order)
    proc = run_agent(INTAKE, work, "JOB-002")
    assert proc.returncode == 0, proc.stderr
    assert files_in(work) == ["order.json", "receipt.json"]
    receipt = json.loads((work / "receipt.json").read_text())
    assert receipt["status"] == "failed" and "meta.messages" in receipt["reason"]
    assert last_json(proc.stdout)["is_error"] is True


def test_intake_derives_a_valid_followup_id_from_a_long_job_id(tmp_path: Path) -> None:
    """A 128-character job id still gives a follow-up id that matches the id pattern."""
    order = read_order(JOB_001)
    order["job_id"] = "J" * 128
    work = prepare(tmp_path, order)
    assert run_agent(INTAKE, work, order["job_id"]).returncode == 0
    (name,) = os.listdir(work / "outbox")
    follow = json.loads((work / "outbox" / name).read_text())
    assert JOB_ID.fullmatch(follow["job_id"]) and follow["job_id"].endswith(".assign")
    assert follow["job_id"] != order["job_id"] and name == follow["job_id"] + ".json"


def test_intake_without_an_order_stops_and_writes_nothing(tmp_path: Path) -> None:
    """No order file: intake says STOP, exits 1 and leaves its folder empty."""
    work = prepare(tmp_path, None)
    proc = run_agent(INTAKE, work, "JOB-009")
    assert proc.returncode == 1
    assert "STOP" in proc.stdout and last_json(proc.stdout)["is_error"] is True
    assert files_in(work) == []


# -- assigner -------------------------------------------------------------------------------
def test_assigner_gives_each_request_one_allowed_team(tmp_path: Path) -> None:
    """Assigner writes one row per item with an allowed team and a next step, and a receipt."""
    work = prepare(tmp_path, handoff(tmp_path))
    proc = run_agent(ASSIGNER, work, "JOB-001.assign")
    assert proc.returncode == 0, proc.stderr
    assert files_in(work) == ["assignments.csv", "order.json", "receipt.json"]
    assert (work / "assignments.csv").read_text().splitlines()[0] == "id,team,next_step"
    rows = csv_rows(work / "assignments.csv")
    assert {r["id"]: r["team"] for r in rows} == EXPECTED_TEAMS
    assert [r["id"] for r in rows] == ["R1", "R2", "R3", "R4", "R5"]
    assert all(r["team"] in TEAMS and r["next_step"].strip() for r in rows)
    assert "KC-1042" in rows[0]["next_step"] and "Daniel" in rows[4]["next_step"]
    receipt = json.loads((work / "receipt.json").read_text())
    ids = ["R1", "R2", "R3", "R4", "R5"]
    assert receipt == {
        "job_id": "JOB-001.assign",
        "input_ids": ids,
        "output_ids": ids,
        "status": "done",
        "outputs": ["assignments.csv"],
    }
    summary = last_json(proc.stdout)
    assert summary["is_error"] is False and summary["session_id"] == "local-JOB-001.assign"


def test_assigner_quotes_csv_fields_that_need_it(tmp_path: Path) -> None:
    """A next step holding a comma and a quote survives a csv round trip."""
    order = handoff(tmp_path)
    order["items"] = [{"id": "Q1", "customer": 'Tan, "Ah Kow"', "summary": "Where is my order?", "order": None}]
    work = prepare(tmp_path, order)
    assert run_agent(ASSIGNER, work, "JOB-001.assign").returncode == 0
    raw = (work / "assignments.csv").read_text()
    assert '"Check the order and draft a reply to Tan, ""Ah Kow"""' in raw
    (row,) = csv_rows(work / "assignments.csv")
    assert row == {
        "id": "Q1",
        "team": "orders",
        "next_step": 'Check the order and draft a reply to Tan, "Ah Kow"',
    }


def test_assigner_fails_in_its_receipt_when_no_rule_matches(tmp_path: Path) -> None:
    """An item no rule can place gives a failed receipt naming it, and no csv at all."""
    order = handoff(tmp_path)
    order["items"].append({"id": "R6", "customer": "Mei", "summary": "Lovely weather today.", "order": None})
    work = prepare(tmp_path, order)
    proc = run_agent(ASSIGNER, work, "JOB-001.assign")
    assert proc.returncode == 0, proc.stderr
    assert files_in(work) == ["order.json", "receipt.json"]
    receipt = json.loads((work / "receipt.json").read_text())
    assert receipt["status"] == "failed" and "R6" in receipt["reason"]
    assert receipt["input_ids"] == ["R1", "R2", "R3", "R4", "R5", "R6"] and receipt["output_ids"] == []
    assert last_json(proc.stdout)["is_error"] is True


def test_assigner_keeps_to_the_teams_the_order_allows(tmp_path: Path) -> None:
    """When accept.allowed.team leaves a team out, items of that team are not forced elsewhere."""
    order = handoff(tmp_path)
    order["accept"]["allowed"]["team"] = ["orders", "payments", "store-hours"]
    work = prepare(tmp_path, order)
    assert run_agent(ASSIGNER, work, "JOB-001.assign").returncode == 0
    receipt = json.loads((work / "receipt.json").read_text())
    assert receipt["status"] == "failed" and "R4" in receipt["reason"]
    assert not (work / "assignments.csv").exists()


def test_assigner_without_an_order_stops_and_writes_nothing(tmp_path: Path) -> None:
    """In an empty folder the assigner replies STOP, exits 1 and writes no file (as in the seed)."""
    work = prepare(tmp_path, None)
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    proc = subprocess.run(
        [sys.executable, str(ASSIGNER)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert last_json(proc.stdout)["result"] == "STOP no order.json."
    assert files_in(work) == []


# -- the claude stub ------------------------------------------------------------------------
def check_cli_result(out: dict[str, Any]) -> None:
    """Assert the shape of `claude -p --output-format json` output."""
    assert out["type"] == "result" and out["subtype"] == "success"
    for key, kind in [
        ("duration_ms", int),
        ("duration_api_ms", int),
        ("num_turns", int),
        ("result", str),
    ]:
        assert isinstance(out[key], kind), key
    assert isinstance(out["total_cost_usd"], (int, float))
    assert {"input_tokens", "output_tokens"} <= set(out["usage"])
    uuid.UUID(out["session_id"])


def test_claude_stub_does_both_roles_like_the_example_agents(tmp_path: Path) -> None:
    """The stub, run with the config's argv, writes what intake.py and assigner.py write."""
    work = prepare(tmp_path, read_order(JOB_001))
    proc = run_stub(work, "You are the intake agent of Kopi & Crumb.")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    out = json.loads(proc.stdout)
    check_cli_result(out)
    assert out["is_error"] is False and "JOB-001.assign" in out["result"]
    follow = json.loads((work / "outbox" / "JOB-001.assign.json").read_text())
    assert follow == handoff(tmp_path)

    work2 = prepare(tmp_path, follow, "work2")
    proc = run_stub(work2, "You are the assigner agent of Kopi & Crumb.")
    assert proc.returncode == 0, proc.stderr
    check_cli_result(json.loads(proc.stdout))
    assert files_in(work2) == ["assignments.csv", "order.json", "receipt.json"]
    assert {r["id"]: r["team"] for r in csv_rows(work2 / "assignments.csv")} == EXPECTED_TEAMS
    assert json.loads((work2 / "receipt.json").read_text())["job_id"] == "JOB-001.assign"
    assert not (EXAMPLES / "agents" / "__pycache__").exists()


def test_claude_stub_not_logged_in_answers_like_the_cli(tmp_path: Path) -> None:
    """CLAUDE_STUB_MODE=not-logged-in: is_error true, the login message, exit 1, no files."""
    work = prepare(tmp_path, read_order(JOB_001))
    proc = run_stub(work, "You are the intake agent.", CLAUDE_STUB_MODE="not-logged-in")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    check_cli_result(out)
    assert out["is_error"] is True and out["result"] == "Not logged in · Please run /login"
    assert out["total_cost_usd"] == 0
    assert files_in(work) == ["order.json"]


def test_claude_stub_without_an_order_replies_stop(tmp_path: Path) -> None:
    """Without order.json the stub replies STOP and writes nothing, as the seed's receiver did."""
    work = prepare(tmp_path, None)
    proc = run_stub(work, "You are the assigner agent.")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["result"] == "STOP no order.json."
    assert files_in(work) == []


def test_claude_stub_refuses_an_unknown_option(tmp_path: Path) -> None:
    """An option the CLI does not know is an error on stderr with exit 1, as commander.js does."""
    proc = subprocess.run(
        [str(CLAUDE_STUB), "-p", "hi", "--no-such-flag"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: unknown option '--no-such-flag'"


# -- through the real CLI and daemon --------------------------------------------------------
def test_example_orders_and_followup_validate_against_the_config(tmp_path: Path) -> None:
    """`dispatcher validate` accepts both example orders and the follow-up intake writes."""
    follow = tmp_path / "JOB-001.assign.json"
    follow.write_text(json.dumps(handoff(tmp_path)))
    for config in ("config/dispatcher.yaml", "config/agents.claude.yaml"):
        proc = dispatcher("--config", config, "validate", str(JOB_001), str(JOB_002), str(follow))
        assert proc.returncode == 0, proc.stderr


def test_claude_config_runs_the_handoff_with_the_stub(tmp_path: Path) -> None:
    """config/agents.claude.yaml, with the stub first on PATH, takes JOB-001 through both agents."""
    root = tmp_path / "dispatch"
    root.mkdir()  # a root must exist (`dispatcher init` makes one)
    path = stub_path()
    base = ("--config", "config/agents.claude.yaml", "--root", str(root))
    assert dispatcher(*base, "submit", str(JOB_001), PATH=path).returncode == 0
    proc = dispatcher(*base, "run", "--once", PATH=path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parent, child = result(root, "done", "JOB-001"), result(root, "done", "JOB-001.assign")
    assert parent["children"] == ["JOB-001.assign"] and child["parent"] == "JOB-001"
    prompt = (root / "done" / "JOB-001.assign" / "work" / "prompt.md").read_text()
    assert prompt.startswith("You are the assigner agent") and "JOB-001.assign" in prompt
    assert '"R3"' in prompt and "{items_json}" not in prompt
    agent_result = child["attempts"][-1]["agent_result"]
    assert agent_result["type"] == "result" and agent_result["is_error"] is False
    uuid.UUID(agent_result["session_id"])
    rows = csv_rows(root / "done" / "JOB-001.assign" / "work" / "assignments.csv")
    assert {r["id"]: r["team"] for r in rows} == EXPECTED_TEAMS


def test_claude_not_logged_in_fails_the_job_with_the_cli_answer_recorded(tmp_path: Path) -> None:
    """A `claude` that is not logged in fails exit_ok; result.json keeps its is_error answer."""
    root = tmp_path / "dispatch"
    root.mkdir()  # a root must exist (`dispatcher init` makes one)
    config = yaml.safe_load((REPO / "config" / "agents.claude.yaml").read_text())
    config["root"] = str(root)
    for agent in config["agents"].values():
        agent["env"] = {"CLAUDE_STUB_MODE": "not-logged-in"}
    cfg = tmp_path / "claude.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    path = stub_path()
    assert dispatcher("--config", str(cfg), "submit", str(JOB_001), PATH=path).returncode == 0
    proc = dispatcher("--config", str(cfg), "run", "--once", PATH=path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = result(root, "failed", "JOB-001")
    assert failed["reason"].startswith("exit_ok")
    assert failed["children"] == []
    (attempt,) = failed["attempts"]
    assert attempt["exit_code"] == 1
    assert attempt["agent_result"]["is_error"] is True
    assert attempt["agent_result"]["result"] == "Not logged in · Please run /login"
    assert not (root / "inbox" / "JOB-001.assign.json").exists()


@pytest.mark.timeout(300)
def test_demo_script_runs_end_to_end(tmp_path: Path) -> None:
    """`bash examples/demo.sh` exits 0, shows the handoff and both failures; dispatch/ untouched."""
    before = files_in(REPO / "dispatch")
    demo = tmp_path / "demo"
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "demo.sh")],
        cwd=tmp_path,
        env=cli_env(DEMO_DIR=str(demo)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "The demo behaved as expected." in out
    assert "UNEXPECTED" not in out
    assert "R3,payments," in out and "R5,store-hours," in out
    assert re.search(r"refused into failed/JOB-001@\d{8}T\d{6}\.\d{6}Z", out)
    assert "followups_valid" in out
    assert "STOP no order.json." in out
    root = demo / "dispatch"
    assert result(root, "done", "JOB-001.assign")["parent"] == "JOB-001"
    assert result(root, "failed", "JOB-002")["reason"].startswith("followups_valid")
    assert files_in(REPO / "dispatch") == before
