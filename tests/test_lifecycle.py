"""The work-order lifecycle, seen from outside: folders, files, commands and log lines.

Most behaviours are read off one shared daemon run (the `scenario` fixture): it drops
good orders to a few agents, bad files, a symlink, a FIFO, a folder and hidden names,
then stops the daemon and lets each test inspect what is left on disk. Behaviours that
need their own timing (restarts, slow writers, files left while no daemon runs, `run
--once`, `init`, `status` with a running job) get their own dispatch root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CHECK_NAMES, FAKE_AGENT, Daemon, Env, cli_env, order, wait_until

TS = r"\d{8}T\d{6}\.\d{6}Z"
PYTHON_M = [sys.executable, "-m", "dispatcher"]

# An agent that records what it was given (argv, environment as exec'd, pid, process
# group, cwd, stdin), writes a good receipt, and ends stdout with text after a JSON object.
ENVDUMP = """\
import json, os, stat, sys
from pathlib import Path
raw = Path("/proc/self/environ").read_bytes().decode()
env = dict(kv.split("=", 1) for kv in raw.split("\\0") if kv)
st = os.fstat(0)
info = {
    "argv": sys.argv[1:], "env": env, "pid": os.getpid(), "pgid": os.getpgid(0),
    "cwd": os.getcwd(), "stdin_chr": stat.S_ISCHR(st.st_mode), "stdin_rdev": st.st_rdev,
    "devnull_rdev": os.stat("/dev/null").st_rdev,
}
work = Path(env["DISPATCH_WORKSPACE"])
(work / "env.json").write_text(json.dumps(info))
order = json.loads(Path(env["DISPATCH_ORDER"]).read_text())
ids = [item["id"] for item in order["items"]]
receipt = {"job_id": order["job_id"], "input_ids": ids, "output_ids": ids,
           "status": "done", "outputs": []}
Path(env["DISPATCH_RECEIPT"]).write_text(json.dumps(receipt))
print('{"a": "json object that is not the last text"}')
print("bye")
"""

PROMPT = (
    "<J>{job_id}</J>\n<F>{from}</F>\n<T>{to}</T>\n<K>{task}</K>\n<I>{items_json}</I>\n"
    "<W>{writes}</W>\n<A>{accept_json}</A>\n<O>{order}</O>\n<S>{workspace}</S>\n<R>{receipt}</R>\n"
    "<U>{unknown} {} {0} {{job_id}} { job_id } {JOB_ID} $job_id {job_id</U>\n"
)

LIFE_YAML = b"""\
# A work order written by hand: comments and odd spacing are kept byte for byte.
job_id:   "LIFE-YAML"
from: intake
to: prompted
for: Aina
task: "Assign each request to one team: orders, payments, bakery or store-hours."
items:
  - {id: R1, customer: Aina, summary: "Order KC-1042 came without the oat milk."}
  - id: R2
    customer: Priya
    order: null
  - id: R3
writes: [out.csv, "notes/*.md"]
accept:
  output: out.csv   # one row per request
meta: {source: test, tags: [a, b]}
"""

SUBMITTED_YAML = b"""\
# submitted with `dispatcher submit`
job_id: LIFE-SUBMIT
from: tester
to: plain
task: Submitted before the daemon started.
items:
  - id: R1
accept: {output: out.csv}
"""

SMALL_RESULT = {"type": "result", "is_error": False, "total_cost_usd": 0.0123, "session_id": "s-1"}
MULTI_RESULT = {"session_id": "s-2", "num_turns": 4, "usage": {"input_tokens": 10, "output_tokens": 5}}
BIG_RESULT = {
    "total_cost_usd": 1.5,
    "session_id": "s-3",
    "num_turns": 7,
    "is_error": False,
    "duration_ms": 1234,
    "usage": {"input_tokens": 1},
    "result": "x" * 70_000,
    "extra": "dropped",
}
BIG_KEPT = {k: v for k, v in BIG_RESULT.items() if k not in ("result", "extra")}

BAD_FILES: dict[str, bytes] = {
    "bad-acept.yaml": b"job_id: BAD-ACEPT-1\nfrom: tester\nto: plain\ntask: Typo below.\n"
    b"items:\n  - id: R1\nacept:\n  output: out.csv\n",
    "bad-task.json": json.dumps(order("BAD-TASK-1", to="plain", task="two\rlines")).encode(),
    "bad-to.yaml": yaml.safe_dump(order("BAD-TO-1", to="nobody")).encode(),
    "bad-syntax.yaml": b"job_id: [unclosed\nfrom: tester\n",
    "bad-id.json": json.dumps(order("BAD ID", to="plain")).encode(),
    "empty.json": b"",
    "bad-key-newline.json": json.dumps(order("BAD-KEY-NL-1", to="plain", **{"ac\nept": 1})).encode(),
    "bad.dots.json": json.dumps(order("BAD-DOTS-1", to="plain", timeout=0)).encode(),
}
BAD_JOB_IDS = {
    "bad-acept.yaml": "BAD-ACEPT-1",
    "bad-task.json": "BAD-TASK-1",
    "bad-to.yaml": "BAD-TO-1",
    "bad.dots.json": "BAD-DOTS-1",
    "bad-key-newline.json": "BAD-KEY-NL-1",
}
BRACES_TASK = "Use {job_id}, {workspace} and {{task}} as written"
BOM_JSON = b"\xef\xbb\xbf" + json.dumps(order("LIFE-BOM", to="plain"), ensure_ascii=False).encode()
NOTES = b"Remember to water the plants.\n"
HIDDEN = {
    ".hidden.json": "HIDDEN-1",
    "h1.json.tmp": "HIDDEN-2",
    "h2.yaml.part": "HIDDEN-3",
    ".h3.json.part": "HIDDEN-4",
    "h4.tmp": "HIDDEN-5",
}
HIDDEN_LATE = {".late.json": "HIDDEN-6", "late.json.tmp": "HIDDEN-7", "late.yaml.part": "HIDDEN-8"}
JOBS = {
    "LIFE-YAML": "prompted",
    "LIFE-PLAIN": "plain",
    "LIFE-ENV": "envdump",
    "LIFE-AR1": "ar1",
    "LIFE-AR2": "ar2",
    "LIFE-AR3": "ar3",
    "LIFE-LINEAGE": "plain",
    "LIFE-SUBMIT": "plain",
    "LIFE-BOM": "plain",
    "LIFE-BRACES": "prompted",
    "BAD-ACEPT-1": "plain",
}
ENTRIES = ["link", "pipe", "folder", "link2", "pipe2", "folder2", "pipe3"]
STEMS = [Path(name).stem for name in BAD_FILES] + ["notes", *ENTRIES]


# -- helpers ------------------------------------------------------------------------------


def make_env(tmp: Path) -> Env:
    return Env(tmp=tmp, root=tmp / "dispatch", config_path=tmp / "dispatcher.yaml", count_file=tmp / "starts.txt")


def kill_all(env: Env) -> None:
    for d in env._daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(60)


def finished(env: Env, job_id: str) -> tuple[str, dict[str, Any]] | None:
    for state in ("done", "failed"):
        path = env.root / state / job_id / "result.json"
        if path.exists():
            with contextlib.suppress(json.JSONDecodeError):
                return state, json.loads(path.read_text())
    return None


def refusal_dirs(env: Env, stem: str) -> list[Path]:
    """Refusal folders of files with this stem: `<stem>@<timestamp>` with an optional `-n`."""
    failed = env.root / "failed"
    if not failed.exists():
        return []
    pattern = re.compile(re.escape(stem) + "@" + TS + r"(-\d+)?")
    return sorted(p for p in failed.iterdir() if pattern.fullmatch(p.name) and (p / "result.json").exists())


def iso(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert value.utcoffset() == timedelta(0), f"not UTC: {text}"
    return value


def starts_of(env: Env, job_id: str) -> int:
    return sum(1 for job, _ in env.starts() if job == job_id)


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.exists() else []


def run_cli(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `python -m dispatcher ARGS` with exactly these arguments (no implied --config)."""
    return subprocess.run([*PYTHON_M, *args], capture_output=True, text=True, cwd=tmp, env=cli_env(), timeout=timeout)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
    return lines[0]


# -- the shared run -----------------------------------------------------------------------


@dataclass
class Scenario:
    env: Env
    daemon: Daemon
    exit_code: int
    target: Path
    messages: dict[str, str]  # bad file name -> `validate` stderr line
    submit: subprocess.CompletedProcess[str]
    started: datetime


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """One daemon run over good orders, bad files, odd inbox entries and hidden names."""
    tmp = tmp_path_factory.mktemp("life")
    env = make_env(tmp)
    envdump = tmp / "envdump.py"
    envdump.write_text(ENVDUMP)
    argv = ["{job_id}", "x{job_id}y", "{order}", "{workspace}", "{receipt}", "{prompt_file}", "{prompt}"]
    env.configure(
        agents={
            "prompted": env.agent(prompt=PROMPT, writes=["out.csv"]),
            "plain": env.agent(concurrency=2),
            "envdump": {
                "command": [sys.executable, str(envdump), *argv, "{unknown}", "{job_id"],
                "prompt": "Prompt for {job_id}: {task}",
                "timeout": 30,
                "writes": ["env.json"],
                "env": {"MY_VAR": "from-config"},
            },
            "ar1": env.agent("--json-result", json.dumps(SMALL_RESULT)),
            "ar2": env.agent("--json-result", json.dumps(MULTI_RESULT, indent=2)),
            "ar3": env.agent("--json-result", json.dumps(BIG_RESULT)),
        },
        max_jobs=3,
        log_file=str(tmp / "dispatcher.log"),
    )
    old_umask = os.umask(0o022)
    try:
        inbox = env.root / "inbox"
        inbox.mkdir(parents=True)
        # Entries that are not regular files, and hidden or temp names, wait in inbox/ for the start.
        target = tmp / "target.json"
        target.write_bytes(json.dumps(order("LINKED-1", to="plain")).encode())
        os.symlink(target, inbox / "link.json")
        os.mkfifo(inbox / "pipe.yaml")
        (inbox / "folder.json").mkdir()
        (inbox / "folder.json" / "order.json").write_bytes(json.dumps(order("DIRJOB-1", to="plain")).encode())
        for name, job_id in HIDDEN.items():
            (inbox / name).write_bytes(json.dumps(order(job_id, to="plain")).encode())
        (tmp / "submitted.yaml").write_bytes(SUBMITTED_YAML)
        submit = env.cli("submit", "submitted.yaml")
        messages = {}
        for name, data in BAD_FILES.items():
            (tmp / name).write_bytes(data)
            messages[name] = env.cli("validate", name).stderr.strip()
        started = datetime.now(UTC)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SECRET_TOKEN", "must-not-leak")
            mp.setenv("LANG", "C.UTF-8")
            daemon = env.daemon()
    finally:
        os.umask(old_umask)
    code = -1
    try:
        daemon.wait_ready()
        env.drop(LIFE_YAML, "LIFE-YAML.yaml")
        env.drop(order("LIFE-PLAIN", to="plain"))
        body = order("LIFE-ENV", to="envdump", writes=["env.json"])
        del body["accept"]
        env.drop(body)
        for n in (1, 2, 3):
            env.drop(order(f"LIFE-AR{n}", to=f"ar{n}"))
        env.drop(order("LIFE-LINEAGE", to="plain", parent="SOMEONE-ELSE", hops=3))
        env.drop(BOM_JSON, "LIFE-BOM.json")
        env.drop(order("LIFE-BRACES", to="prompted", task=BRACES_TASK, **{"from": "{job_id}"}))
        for name, data in BAD_FILES.items():
            env.drop(data, name)
        env.drop(NOTES, "notes.txt")
        # Two files with one job id, dropped together: one job and one refusal.
        env.drop(order("TWIN-1", to="plain"), "twin-a.json")
        env.drop(order("TWIN-1", to="plain"), "twin-b.yaml")
        # Hidden and temp names written in place while the daemon runs.
        for name, job_id in HIDDEN_LATE.items():
            (inbox / name).write_bytes(json.dumps(order(job_id, to="plain")).encode())
        # Odd entries renamed in while the daemon runs, and a FIFO made in place (found by a rescan).
        os.symlink(target, inbox / ".link2.tmp")
        os.rename(inbox / ".link2.tmp", inbox / "link2.json")
        os.mkfifo(inbox / ".pipe2.tmp")
        os.rename(inbox / ".pipe2.tmp", inbox / "pipe2.json")
        (inbox / ".folder2.tmp").mkdir()
        (inbox / ".folder2.tmp" / "order.json").write_bytes(json.dumps(order("DIRJOB-2", to="plain")).encode())
        os.rename(inbox / ".folder2.tmp", inbox / "folder2.yaml")
        os.mkfifo(inbox / "pipe3.yml")
        # Once the typo is refused, the corrected file with the same id is a new job.
        with contextlib.suppress(AssertionError):
            wait_until(lambda: refusal_dirs(env, "bad-acept"), 30, "refusal of bad-acept.yaml")
        env.drop(order("BAD-ACEPT-1", to="plain"))
        end = time.monotonic() + 90
        while time.monotonic() < end:
            twins = refusal_dirs(env, "twin-a") + refusal_dirs(env, "twin-b")
            if all(finished(env, j) for j in [*JOBS, "TWIN-1"]) and all(refusal_dirs(env, s) for s in STEMS) and twins:
                break
            time.sleep(0.1)
    finally:
        code = daemon.stop()
    yield Scenario(env, daemon, code, target, messages, submit, started)
    kill_all(env)


def done_dir(sc: Scenario, job_id: str) -> Path:
    state = finished(sc.env, job_id)
    assert state is not None, f"{job_id} never finished"
    assert state[0] == "done", f"{job_id} ended in {state[0]}: {state[1].get('reason')}"
    return sc.env.root / "done" / job_id


def result_of(sc: Scenario, job_id: str) -> dict[str, Any]:
    return json.loads((done_dir(sc, job_id) / "result.json").read_text())


# -- done jobs and their folders ------------------------------------------------------------


@pytest.mark.parametrize("job_id", sorted(JOBS))
def test_valid_order_ends_done_with_every_check_in_order(scenario: Scenario, job_id: str) -> None:
    """A valid order handled by a good agent ends in done/ with all checks recorded by name, in order."""
    result = result_of(scenario, job_id)
    assert result["state"] == "done"
    assert result["job_id"] == job_id
    assert result["agent"] == JOBS[job_id]
    assert result["reason"] is None
    assert [c["name"] for c in result["checks"]] == CHECK_NAMES
    oks = {c["name"]: c["ok"] for c in result["checks"]}
    assert oks["exit_ok"] is oks["receipt_present"] is oks["receipt_job_id"] is True
    assert False not in oks.values(), oks
    assert not (scenario.env.root / "active" / job_id).exists()
    assert not (scenario.env.root / "failed" / job_id).exists()
    assert starts_of(scenario.env, job_id) == (0 if JOBS[job_id] == "envdump" else 1)


def test_result_json_fields_and_types(scenario: Scenario) -> None:
    """result.json has the contract's fields with the contract's types."""
    result = result_of(scenario, "LIFE-PLAIN")
    for key in ("job_id", "state", "agent", "reason", "checks", "attempts", "received", "finished"):
        assert key in result, key
    assert result["parent"] is None
    assert result["children"] == []
    for check in result["checks"]:
        assert set(check) >= {"name", "ok", "detail"}
        assert check["ok"] in (True, False, None)
    assert len(result["attempts"]) == 1
    attempt = result["attempts"][0]
    assert attempt["n"] == 1
    assert attempt["exit_code"] == 0
    assert attempt["timed_out"] is False
    assert isinstance(attempt["duration_ms"], int) and not isinstance(attempt["duration_ms"], bool)
    assert attempt["duration_ms"] >= 0
    started, ended = iso(attempt["started"]), iso(attempt["ended"])
    received, fin = iso(result["received"]), iso(result["finished"])
    assert scenario.started - timedelta(seconds=5) <= received <= started <= ended <= fin
    assert fin <= datetime.now(UTC)


def test_order_file_kept_byte_for_byte(scenario: Scenario) -> None:
    """The dropped file is kept as order.<ext>, byte for byte, comments and spacing included."""
    folder = done_dir(scenario, "LIFE-YAML")
    assert (folder / "order.yaml").read_bytes() == LIFE_YAML
    assert sorted(p.name for p in folder.glob("order.*")) == ["order.yaml"]


def test_order_with_byte_order_mark_runs_and_is_kept_whole(scenario: Scenario) -> None:
    """A UTF-8 byte-order mark is ignored: the job runs, and order.json keeps the dropped bytes."""
    folder = done_dir(scenario, "LIFE-BOM")
    assert (folder / "order.json").read_bytes() == BOM_JSON
    assert json.loads((folder / "work" / "order.json").read_bytes())["job_id"] == "LIFE-BOM"


def test_work_starts_with_the_validated_order_as_json(scenario: Scenario) -> None:
    """work/order.json holds the order as JSON: the same fields and values as the file."""
    work_order = json.loads((done_dir(scenario, "LIFE-YAML") / "work" / "order.json").read_text())
    dropped = yaml.safe_load(LIFE_YAML)
    for key in ("job_id", "from", "to", "for", "task", "items", "writes", "meta"):
        assert work_order[key] == dropped[key], key
    assert work_order["accept"]["output"] == "out.csv"
    assert work_order.get("hops", 0) == 0
    assert work_order.get("parent") is None


def test_prompt_rendered_with_placeholders_and_unknown_braces_kept(scenario: Scenario) -> None:
    """prompt.md has every known placeholder filled in and any other text, braces too, unchanged."""
    text = (done_dir(scenario, "LIFE-YAML") / "work" / "prompt.md").read_text()

    def part(tag: str) -> str:
        found = re.search(f"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
        assert found, f"<{tag}> missing in {text!r}"
        return found.group(1)

    dropped = yaml.safe_load(LIFE_YAML)
    work = scenario.env.root / "active" / "LIFE-YAML" / "work"
    assert part("J") == "LIFE-YAML"
    assert part("F") == "intake"
    assert part("T") == "prompted"
    assert part("K") == dropped["task"]
    assert json.loads(part("I")) == dropped["items"]
    assert "out.csv" in part("W") and "notes/*.md" in part("W")
    assert json.loads(part("A"))["output"] == "out.csv"
    assert os.path.realpath(part("O")) == os.path.realpath(work / "order.json")
    assert os.path.realpath(part("S")) == os.path.realpath(work)
    assert os.path.realpath(part("R")) == os.path.realpath(work / "receipt.json")
    assert part("U") == "{unknown} {} {0} {LIFE-YAML} { job_id } {JOB_ID} $job_id {job_id"


def test_placeholder_values_are_not_expanded_again(scenario: Scenario) -> None:
    """Braces inside an order's values reach the prompt as written: placeholders are filled in once."""
    text = (done_dir(scenario, "LIFE-BRACES") / "work" / "prompt.md").read_text()
    assert f"<K>{BRACES_TASK}</K>" in text
    assert "<F>{job_id}</F>" in text
    assert "<J>LIFE-BRACES</J>" in text


def test_no_prompt_md_without_prompt(scenario: Scenario) -> None:
    """An agent without a prompt gets no work/prompt.md."""
    assert (done_dir(scenario, "LIFE-PLAIN") / "work" / "order.json").is_file()
    assert not (done_dir(scenario, "LIFE-PLAIN") / "work" / "prompt.md").exists()


def test_attempt_logs_capture_the_agent_streams(scenario: Scenario) -> None:
    """attempts/1/ holds stdout.log and stderr.log with what the agent printed."""
    folder = done_dir(scenario, "LIFE-AR1")
    assert (folder / "attempts" / "1" / "stderr.log").is_file()
    stdout = (folder / "attempts" / "1" / "stdout.log").read_text()
    assert "some progress text" in stdout
    assert '"session_id": "s-1"' in stdout
    assert not (folder / "attempts" / "2").exists()


def test_agent_outputs_and_receipt_stay_in_work(scenario: Scenario) -> None:
    """The agent's output and receipt.json are left in work/ of the done job."""
    work = done_dir(scenario, "LIFE-PLAIN") / "work"
    assert (work / "out.csv").read_text().splitlines()[1:] == ["R1", "R2", "R3"]
    assert json.loads((work / "receipt.json").read_text())["job_id"] == "LIFE-PLAIN"


def test_submit_drops_the_file_and_the_job_runs(scenario: Scenario) -> None:
    """`submit` prints the job id and drops the file; the daemon runs it, bytes unchanged."""
    assert scenario.submit.returncode == 0, scenario.submit.stderr
    assert "LIFE-SUBMIT" in scenario.submit.stdout
    folder = done_dir(scenario, "LIFE-SUBMIT")
    kept = [p.read_bytes() for p in folder.glob("order.*")]
    assert kept == [SUBMITTED_YAML]


def test_lineage_in_a_dropped_file_changes_nothing(scenario: Scenario) -> None:
    """`parent` and `hops` set by a dropped file are ignored: the job has no parent and hops 0."""
    result = result_of(scenario, "LIFE-LINEAGE")
    assert result["parent"] is None
    work_order = json.loads((done_dir(scenario, "LIFE-LINEAGE") / "work" / "order.json").read_text())
    assert work_order.get("parent") is None
    assert work_order.get("hops", 0) == 0


# -- the agent's process and environment ----------------------------------------------------


@pytest.fixture(scope="module")
def dumped(scenario: Scenario) -> dict[str, Any]:
    path = done_dir(scenario, "LIFE-ENV") / "work" / "env.json"
    return json.loads(path.read_text())


def test_agent_environment_is_only_what_the_contract_lists(scenario: Scenario, dumped: dict[str, Any]) -> None:
    """The agent sees PATH, HOME, LANG, its own env and DISPATCH_*; nothing else of the daemon's."""
    env = dumped["env"]
    allowed = {"PATH", "HOME", "LANG", "MY_VAR"}
    extra = {k for k in env if k not in allowed and not k.startswith("DISPATCH_")}
    assert extra == set(), f"leaked into the agent: {sorted(extra)}"
    assert "SECRET_TOKEN" not in env and "PYTHONPATH" not in env
    assert env["PATH"] == os.environ["PATH"]
    assert env["LANG"] == "C.UTF-8"
    if "HOME" in os.environ:
        assert env["HOME"] == os.environ["HOME"]
    assert env["MY_VAR"] == "from-config"
    work = scenario.env.root / "active" / "LIFE-ENV" / "work"
    assert env["DISPATCH_JOB_ID"] == "LIFE-ENV"
    assert env["DISPATCH_ATTEMPT"] == "1"
    assert os.path.realpath(env["DISPATCH_WORKSPACE"]) == os.path.realpath(work)
    assert os.path.realpath(env["DISPATCH_ORDER"]) == os.path.realpath(work / "order.json")
    assert os.path.realpath(env["DISPATCH_RECEIPT"]) == os.path.realpath(work / "receipt.json")
    for key in ("DISPATCH_WORKSPACE", "DISPATCH_ORDER", "DISPATCH_RECEIPT"):
        assert os.path.isabs(env[key]), key


def test_agent_argv_placeholders_are_substituted(scenario: Scenario, dumped: dict[str, Any]) -> None:
    """Placeholders are filled in inside each argv element; unknown ones pass unchanged."""
    work = os.path.realpath(scenario.env.root / "active" / "LIFE-ENV" / "work")
    argv = dumped["argv"]
    assert len(argv) == 9, argv
    job, wrapped, order_path, workspace, receipt, prompt_file, prompt, unknown, open_brace = argv
    assert job == "LIFE-ENV"
    assert wrapped == "xLIFE-ENVy"
    assert os.path.isabs(order_path) and os.path.realpath(order_path) == os.path.join(work, "order.json")
    assert os.path.isabs(workspace) and os.path.realpath(workspace) == work
    assert os.path.isabs(receipt) and os.path.realpath(receipt) == os.path.join(work, "receipt.json")
    assert os.path.isabs(prompt_file) and os.path.realpath(prompt_file) == os.path.join(work, "prompt.md")
    assert prompt.rstrip("\n") == "Prompt for LIFE-ENV: Assign each request to one team."
    assert unknown == "{unknown}"
    assert open_brace == "{job_id"
    rendered = (done_dir(scenario, "LIFE-ENV") / "work" / "prompt.md").read_text()
    assert rendered == prompt


def test_agent_runs_in_work_with_devnull_stdin_in_its_own_group(scenario: Scenario, dumped: dict[str, Any]) -> None:
    """The agent's cwd is work/, its stdin is /dev/null and it leads its own process group."""
    work = os.path.realpath(scenario.env.root / "active" / "LIFE-ENV" / "work")
    assert os.path.realpath(dumped["cwd"]) == work
    assert dumped["stdin_chr"] is True
    assert dumped["stdin_rdev"] == dumped["devnull_rdev"]
    assert dumped["pgid"] == dumped["pid"]
    assert dumped["pgid"] != os.getpgid(0)


# -- agent_result -----------------------------------------------------------------------------


def attempt_of(sc: Scenario, job_id: str) -> dict[str, Any]:
    attempts = result_of(sc, job_id)["attempts"]
    assert len(attempts) == 1
    return attempts[0]


def test_agent_result_captured_from_last_json_line(scenario: Scenario) -> None:
    """A JSON object as the last stdout text is kept whole as the attempt's agent_result."""
    assert attempt_of(scenario, "LIFE-AR1")["agent_result"] == SMALL_RESULT


def test_agent_result_captured_when_spread_over_lines(scenario: Scenario) -> None:
    """A last JSON object printed over many lines is kept whole too."""
    assert attempt_of(scenario, "LIFE-AR2")["agent_result"] == MULTI_RESULT


def test_large_agent_result_keeps_only_the_summary_keys(scenario: Scenario) -> None:
    """An agent_result over 64 KiB keeps only cost, session, turns, is_error, duration and usage."""
    assert attempt_of(scenario, "LIFE-AR3")["agent_result"] == BIG_KEPT


def test_no_agent_result_without_a_final_json_object(scenario: Scenario) -> None:
    """No agent_result when stdout is empty or its last text is not a JSON object."""
    assert attempt_of(scenario, "LIFE-PLAIN").get("agent_result") is None
    assert attempt_of(scenario, "LIFE-ENV").get("agent_result") is None


# -- refused files ------------------------------------------------------------------------------


def only_refusal(sc: Scenario, stem: str) -> Path:
    dirs = refusal_dirs(sc.env, stem)
    assert len(dirs) == 1, f"refusal folders for {stem}: {dirs}"
    ts = dirs[0].name.split("@", 1)[1]
    when = datetime.strptime(ts, "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=UTC)
    assert sc.started - timedelta(seconds=5) <= when <= datetime.now(UTC), f"not a UTC timestamp: {ts}"
    return dirs[0]


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_invalid_order_is_refused_with_bytes_and_reason(scenario: Scenario, name: str) -> None:
    """An invalid order goes to failed/<stem>@<ts>/ with its bytes and the validate message as reason."""
    stem, ext = name.rsplit(".", 1)
    folder = only_refusal(scenario, stem)
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"order.{ext}", "result.json"])
    assert (folder / f"order.{ext}").read_bytes() == BAD_FILES[name]
    result = json.loads((folder / "result.json").read_text())
    assert result["state"] == "failed"
    message = scenario.messages[name]
    assert message.startswith(f"{name}: "), message
    assert result["reason"] == message[len(name) + 2 :]
    assert result["reason"].splitlines() == [result["reason"]], f"reason is not one line: {result['reason']!r}"
    if name in BAD_JOB_IDS:
        assert result["job_id"] == BAD_JOB_IDS[name]
        assert not (scenario.env.root / "failed" / BAD_JOB_IDS[name]).exists()
    if name == "bad-syntax.yaml":
        assert result.get("job_id") is None


def test_refused_id_can_be_sent_again_corrected(scenario: Scenario) -> None:
    """A refused file never becomes a job, so a corrected order with its id runs."""
    assert refusal_dirs(scenario.env, "bad-acept")
    assert result_of(scenario, "BAD-ACEPT-1")["state"] == "done"


def test_non_order_extension_is_refused(scenario: Scenario) -> None:
    """A file whose name does not end in .yaml, .yml or .json is refused as "not a work order"."""
    folder = only_refusal(scenario, "notes")
    assert (folder / "order.txt").read_bytes() == NOTES
    result = json.loads((folder / "result.json").read_text())
    assert result["state"] == "failed"
    assert "not a work order" in result["reason"]


@pytest.mark.parametrize("stem", ENTRIES)
def test_odd_inbox_entry_is_moved_as_entry_never_followed(scenario: Scenario, stem: str) -> None:
    """A symlink, FIFO or folder in inbox/ is moved whole as `entry`, never opened; the reason says what."""
    kind, words = {
        "link": (stat.S_ISLNK, ("link",)),
        "pipe": (stat.S_ISFIFO, ("fifo", "pipe")),
        "folder": (stat.S_ISDIR, ("director", "folder")),
    }[stem.rstrip("23")]
    folder = only_refusal(scenario, stem)
    assert sorted(p.name for p in folder.iterdir()) == ["entry", "result.json"]
    assert kind((folder / "entry").lstat().st_mode)
    result = json.loads((folder / "result.json").read_text())
    assert result["state"] == "failed"
    assert any(w in result["reason"].lower() for w in words), result["reason"]
    if stem.startswith("link"):
        assert os.readlink(folder / "entry") == str(scenario.target)
        assert json.loads(scenario.target.read_text())["job_id"] == "LINKED-1"
    if stem.startswith("folder"):
        wanted = "DIRJOB-1" if stem == "folder" else "DIRJOB-2"
        assert json.loads((folder / "entry" / "order.json").read_text())["job_id"] == wanted
    for job_id in ("LINKED-1", "DIRJOB-1", "DIRJOB-2"):
        for state in ("active", "done", "failed"):
            assert not (scenario.env.root / state / job_id).exists()
        assert starts_of(scenario.env, job_id) == 0


def test_hidden_and_temp_names_are_never_taken(scenario: Scenario) -> None:
    """Names starting with `.` or ending in .tmp / .part stay in inbox/ untouched."""
    inbox = scenario.env.root / "inbox"
    for name, job_id in (HIDDEN | HIDDEN_LATE).items():
        assert json.loads((inbox / name).read_text())["job_id"] == job_id
        assert finished(scenario.env, job_id) is None
        assert not (scenario.env.root / "active" / job_id).exists()
        assert starts_of(scenario.env, job_id) == 0
    assert not [p for p in (scenario.env.root / "failed").iterdir() if p.name.startswith(("h", ".h", "late", ".late"))]
    assert visible(inbox) == sorted(n for n in HIDDEN | HIDDEN_LATE if not n.startswith("."))


def test_two_files_with_one_id_give_one_job_and_one_refusal(scenario: Scenario) -> None:
    """Two files with one job id dropped together give one job and one refusal; the agent runs once."""
    state = finished(scenario.env, "TWIN-1")
    assert state is not None and state[0] == "done"
    refused = refusal_dirs(scenario.env, "twin-a") + refusal_dirs(scenario.env, "twin-b")
    assert len(refused) == 1, refused
    assert json.loads((refused[0] / "result.json").read_text())["job_id"] == "TWIN-1"
    assert starts_of(scenario.env, "TWIN-1") == 1


def test_status_counts_jobs_and_refusals_not_temp_names(scenario: Scenario) -> None:
    """`status --json` counts done jobs and refused files; hidden and temp names in inbox/ are not orders."""
    proc = scenario.env.cli("status", "--json")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout)["counts"]
    assert counts == {
        "inbox": 0,
        "held": 0,
        "active": 0,
        "waiting": 0,
        "review": 0,
        "done": len(JOBS) + 1,
        "failed": 0,
        "refused": len(STEMS) + 1,
    }


def test_failed_folder_holds_only_refusals_here(scenario: Scenario) -> None:
    """failed/<job_id>/ exists only for claimed jobs; refused files only make `<stem>@<ts>` folders."""
    names = visible(scenario.env.root / "failed")
    assert all("@" in n for n in names), names


def test_created_files_are_not_world_readable(scenario: Scenario) -> None:
    """Folders and files the daemon creates have no permission bits for others (umask 027)."""
    root = scenario.env.root
    paths = [root / "active", root / "done", root / "failed", Path(scenario.env.settings["log_file"])]
    job = root / "done" / "LIFE-YAML"
    paths += [job, job / "result.json", job / "work", job / "work" / "order.json", job / "work" / "prompt.md"]
    paths += [job / "attempts", job / "attempts" / "1"]
    paths += list((job / "attempts" / "1").iterdir())
    for folder in refusal_dirs(scenario.env, "bad-to") + refusal_dirs(scenario.env, "link"):
        paths += [folder, folder / "result.json"]
    if (root / ".state").exists():
        paths += [root / ".state", *(root / ".state").iterdir()]
    loose = {str(p): oct(p.lstat().st_mode & 0o777) for p in paths if p.lstat().st_mode & 0o007}
    assert loose == {}, f"world-accessible: {loose}"


# -- logs ----------------------------------------------------------------------------------------


def test_log_lines_are_json_with_timestamp_level_event(scenario: Scenario) -> None:
    """Every stdout line is a JSON object with an ISO UTC timestamp, a level and an event."""
    lines = [ln for ln in scenario.daemon.out.read_text().splitlines() if ln.strip()]
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict)
        iso(entry["timestamp"])
        assert entry["level"] and entry["event"], entry
    events = {json.loads(line)["event"] for line in lines}
    want = {"daemon.started", "order.received", "job.claimed", "agent.started", "agent.exited"}
    want |= {"job.verified", "job.done", "job.refused", "daemon.stopping"}
    assert want <= events, f"missing events: {want - events}"


def test_job_log_lines_carry_job_id_and_agent(scenario: Scenario) -> None:
    """The lines about a job carry its job_id and agent, from claim to done."""
    events = scenario.daemon.events()
    mine = [e for e in events if e.get("job_id") == "LIFE-PLAIN"]
    names = [e["event"] for e in mine]
    for name in ("job.claimed", "agent.started", "agent.exited", "job.verified", "job.done"):
        assert name in names, names
    for e in mine:
        assert e.get("agent") == "plain", f"a line about job LIFE-PLAIN without its agent: {e}"
    assert names.index("job.claimed") < names.index("agent.started") < names.index("job.done")


def test_log_file_gets_the_same_json_lines(scenario: Scenario) -> None:
    """With log_file set, the JSON log lines are written there too."""
    path = Path(scenario.env.settings["log_file"])
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert any(e["event"] == "job.done" and e.get("job_id") == "LIFE-PLAIN" for e in entries)


def test_logs_command_shows_one_job(scenario: Scenario) -> None:
    """`logs --job ID` reads the log file and shows that job's lines, not other jobs'."""
    proc = scenario.env.cli("logs", "--job", "LIFE-PLAIN")
    assert proc.returncode == 0, proc.stderr
    assert "LIFE-PLAIN" in proc.stdout and "job.done" in proc.stdout
    assert "LIFE-YAML" not in proc.stdout


def test_graceful_stop_exits_0(scenario: Scenario) -> None:
    """SIGTERM with nothing running ends the daemon with exit 0."""
    assert scenario.exit_code == 0


# -- duplicates ---------------------------------------------------------------------------------


def test_repeated_job_id_is_refused_without_calling_the_agent(env: Env) -> None:
    """A known job id is refused before any agent runs: in the same run, after a restart, by submit."""
    env.drop(order("DUP-1"), "first.json")
    first_bytes = json.dumps(order("DUP-1")).encode()
    d1 = env.daemon()
    d1.wait_ready()
    env.wait_job("DUP-1", "done")
    assert (env.root / "done" / "DUP-1" / "order.json").read_bytes() == first_bytes
    # A file name is not an identity: the same name with a new job id is a new job.
    env.drop(order("DUP-2"), "first.json")
    env.wait_job("DUP-2", "done")
    env.drop(order("DUP-1", task="Same id, second file."), "again.json")
    again = env.wait_refused("again")
    assert again["state"] == "failed"
    assert again["job_id"] == "DUP-1"
    assert isinstance(again["reason"], str) and again["reason"].strip()
    assert starts_of(env, "DUP-1") == 1
    assert d1.stop() == 0

    d2 = env.daemon()
    d2.wait_ready()
    env.drop(order("DUP-1", task="Third time, after a restart."), "third.yaml")
    third = env.wait_refused("third")
    assert third["job_id"] == "DUP-1"
    assert starts_of(env, "DUP-1") == 1
    assert d2.stop() == 0

    (env.tmp / "fourth.json").write_bytes(json.dumps(order("DUP-1")).encode())
    proc = env.cli("submit", "fourth.json")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert one_line(proc.stderr).startswith("fourth.json: ")
    assert visible(env.root / "inbox") == []
    assert not (env.root / "failed" / "DUP-1").exists()
    assert (env.root / "done" / "DUP-1" / "order.json").read_bytes() == first_bytes
    assert starts_of(env, "DUP-1") == 1


# -- arrival: slow writers, files left while down, names ---------------------------------------


def test_file_written_slowly_in_place_is_taken_once_whole(env: Env) -> None:
    """A file written in place over longer than a rescan is taken once, after its writer closes it."""
    env.configure(settle=3, rescan_interval=1)
    head = b'job_id: "SLOW-1"\nfrom: tester\nto: worker\ntask: Written slowly.\n'
    body = b"items:\n  - id: R1\n  - id: R2\n  - id: R3\n"
    tail = b"accept:\n  output: out.csv\n"
    daemon = env.daemon()
    daemon.wait_ready()
    path = env.root / "inbox" / "slow.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for part in (head, body, tail):
            os.write(fd, part)
            time.sleep(0.8)  # the writer's pace, well below settle (3 s); not a synchronisation
    finally:
        os.close(fd)
    env.wait_job("SLOW-1", "done")
    assert (env.root / "done" / "SLOW-1" / "order.yaml").read_bytes() == head + body + tail
    assert env.refusals() == []
    assert starts_of(env, "SLOW-1") == 1
    assert daemon.stop() == 0


def test_a_valid_order_still_being_written_is_not_taken_at_another_process_close(env: Env) -> None:
    """Section 1: taken after *its* writer closes it. Midway the file is already a valid order (one item); another
    process opens it for writing and closes it (`: >> file`). The order is not taken then, half written: it runs
    once, whole (both items), after the first writer closed it."""
    env.configure(settle=0.3, rescan_interval=1)
    daemon = env.daemon()
    daemon.wait_ready()
    first = b"job_id: HALF-1\nfrom: t\nto: worker\ntask: do\nitems:\n  - {id: R1}\n"
    rest = b"  - {id: R2}\n"
    path = env.root / "inbox" / "half.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, first)
        time.sleep(0.5)
        assert subprocess.run(["sh", "-c", ': >> "$0"', str(path)], check=False).returncode == 0
        time.sleep(1.5)  # five settle periods with the first writer still holding it
        assert path.exists() and starts_of(env, "HALF-1") == 0
        os.write(fd, rest)
    finally:
        os.close(fd)
    env.wait_job("HALF-1", "done")
    folder = env.root / "done" / "HALF-1"
    assert (folder / "order.yaml").read_bytes() == first + rest
    assert [i["id"] for i in json.loads((folder / "work" / "order.json").read_text())["items"]] == ["R1", "R2"]
    assert starts_of(env, "HALF-1") == 1 and env.refusals() == []
    assert daemon.stop() == 0


def test_a_draft_hard_linked_into_inbox_waits_while_its_writer_holds_it_under_its_own_name(env: Env) -> None:
    """Section 1: taken only after its writer closes it. A draft written under its own name elsewhere and
    hard-linked into inbox/ midway (its first item written, two to come): the writer's descriptor names the draft,
    not the inbox name, yet the order waits while it is held open (the kernel is asked, by inode), and runs once,
    whole. It was claimed after `settle` with one item and failed receipt_inputs."""
    env.configure(settle=0.5, rescan_interval=1)
    daemon = env.daemon()
    daemon.wait_ready()
    drafts = env.tmp / "drafts"
    drafts.mkdir()
    first = b"job_id: LINKED-1\nfrom: t\nto: worker\ntask: do\nitems:\n  - {id: R1}\n"
    rest = b"  - {id: R2}\n  - {id: R3}\n"
    draft = drafts / "draft.yaml"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, first)
        os.link(draft, env.root / "inbox" / "LINKED-1.yaml")
        time.sleep(3.0)  # six settle periods and two rescans with the writer still holding it
        assert starts_of(env, "LINKED-1") == 0 and (env.root / "inbox" / "LINKED-1.yaml").exists()
        os.write(fd, rest)
    finally:
        os.close(fd)
    env.wait_job("LINKED-1", "done")
    folder = env.root / "done" / "LINKED-1"
    assert [i["id"] for i in json.loads((folder / "work" / "order.json").read_text())["items"]] == ["R1", "R2", "R3"]
    assert starts_of(env, "LINKED-1") == 1 and env.refusals() == []
    assert daemon.stop() == 0


def test_the_same_file_dropped_again_after_its_job_folder_was_removed_by_hand_is_refused(env: Env) -> None:
    """README, troubleshooting: a job whose folder was removed from active/ by hand keeps its claim in the ledger
    (`show` says active), and the same file dropped again is refused as known; the live daemon never runs the id a
    second time (section 6)."""
    env.configure(agents={"worker": env.agent("--sleep", "3")})
    daemon = env.daemon()
    daemon.wait_ready()
    body = json.dumps(order("GONE-1")).encode()
    env.drop(order("GONE-1"))
    wait_until(lambda: starts_of(env, "GONE-1") == 1, 30, "the agent's start")
    shutil.rmtree(env.root / "active" / "GONE-1")
    time.sleep(4)  # the agent ended meanwhile, its job folder gone
    assert env.cli("show", "GONE-1").stdout.split()[:2] == ["GONE-1", "active"]
    tmp = env.root / "inbox" / ".again.tmp"
    tmp.write_bytes(body)
    os.rename(tmp, env.root / "inbox" / "GONE-1.json")
    refused = wait_until(lambda: env.refusals(), 30, "the second file refused")
    result = json.loads((refused[0] / "result.json").read_text())
    assert result["reason"] == "job_id: GONE-1 is already known (state claimed); a job id is never run twice"
    assert (refused[0] / "order.json").read_bytes() == body
    time.sleep(1)
    assert starts_of(env, "GONE-1") == 1
    assert daemon.stop() == 0


def test_a_second_process_closing_a_file_being_written_does_not_get_it_refused(env: Env) -> None:
    """Section 1: a file written in place is taken after *its* writer closes it. Another process opening it for
    writing and closing it (`touch`) midway sends a close event too; the half-written order is not refused then: it
    waits while the first writer holds it open, and the whole order runs once it is closed. A file no one holds open
    that is invalid is still refused at its close event."""
    env.configure(settle=0.3, rescan_interval=1)
    daemon = env.daemon()
    daemon.wait_ready()
    first, rest = b'{"job_id": "TC1", "from": "t", ', b'"to": "worker", "task": "do", "items": [{"id": "R1"}]}'
    path = env.root / "inbox" / "slow.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, first)
        time.sleep(0.5)
        assert subprocess.run(["touch", str(path)], check=False).returncode == 0  # opened for writing, closed
        time.sleep(1.5)  # five settle periods with the first writer still holding it
        assert env.refusals() == [] and path.exists()
        os.write(fd, rest)
    finally:
        os.close(fd)
    env.wait_job("TC1", "done")
    assert (env.root / "done" / "TC1" / "order.json").read_bytes() == first + rest
    bad = env.root / "inbox" / "bad.json"
    bad.write_bytes(first)  # written and closed: invalid, and no writer holds it
    refused = wait_until(lambda: env.refusals(), 30, "the invalid order refused")
    assert len(refused) == 1 and starts_of(env, "TC1") == 1
    assert daemon.stop() == 0


def test_a_writer_holding_the_file_open_is_seen_through_a_symlinked_root(env: Env) -> None:
    """The root named through a symlink: a writer that keeps an order open (written in place) still holds it back
    past settle, and the job takes the whole file once it is closed."""
    real, via = env.tmp / "real", env.tmp / "via"
    (real / "dispatch").mkdir(parents=True)
    via.symlink_to(real)
    env.configure(root=str(via / "dispatch"), settle=0.5, rescan_interval=1)
    daemon = env.daemon()
    daemon.wait_ready()
    first = b'job_id: "HELD-1"\nfrom: tester\nto: worker\ntask: Held open.\n'
    first += b"accept:\n  output: out.csv\nitems:\n  - id: R1\n"
    rest = b"  - id: R2\n  - id: R3\n"
    fd = os.open(via / "dispatch" / "inbox" / "held.yaml", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, first)  # a valid order already, with one item of three
        time.sleep(3.0)  # six settle periods and three rescans with the writer holding it open
        assert not any((real / "dispatch" / s / "HELD-1").exists() for s in ("active", "done", "failed"))
        os.write(fd, rest)
    finally:
        os.close(fd)
    done = real / "dispatch" / "done" / "HELD-1"
    wait_until(lambda: (done / "result.json").exists(), 60, "HELD-1 done")
    assert (done / "order.yaml").read_bytes() == first + rest
    assert [i["id"] for i in json.loads((done / "work" / "order.json").read_text())["items"]] == ["R1", "R2", "R3"]
    assert daemon.stop() == 0


BIND_WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, sys.argv[2].encode())  # a valid order already, with one item of three
print("written", flush=True)
sys.stdin.readline()  # until the test says go on
os.write(fd, sys.argv[3].encode())
os.close(fd)
"""


def test_a_writer_that_reached_inbox_through_a_bind_mount_in_its_own_namespace_holds_the_file(env: Env) -> None:
    """A writer in its own mount namespace (a container's volume) that writes an order in place through a bind mount
    of the root: /proc shows its descriptor under its own path, and it still holds the file back past settle (matched
    by inode and device); the job takes the whole file once it is closed. It was taken at settle with one item of
    three, its order.yaml then written on in done/."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) (util-linux), as bash .ci/run has them")
    mnt = env.tmp / "mnt"
    mnt.mkdir()
    env.configure(settle=0.5, rescan_interval=1)
    daemon = env.daemon()
    daemon.wait_ready()
    first = (
        'job_id: "BIND-1"\nfrom: tester\nto: worker\ntask: Held open.\naccept:\n  output: out.csv\nitems:\n  - id: R1\n'
    )
    rest = "  - id: R2\n  - id: R3\n"
    script = 'mount --bind "$0" "$1" && exec "$2" -c "$3" "$1/inbox/bind.yaml" "$4" "$5"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(env.root), str(mnt)]
    writer = subprocess.Popen(
        [*argv, sys.executable, BIND_WRITER, first, rest], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "written\n"
        time.sleep(3.0)  # six settle periods and three rescans with the writer holding it open
        assert (env.root / "inbox" / "bind.yaml").exists()
        assert not any((env.root / s / "BIND-1").exists() for s in ("active", "done", "failed")), daemon.events()
    finally:
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.close()
        assert writer.wait(30) == 0
        assert writer.stdout is not None
        writer.stdout.close()
    done = env.root / "done" / "BIND-1"
    wait_until(lambda: (done / "result.json").exists(), 60, "BIND-1 done")
    assert (done / "order.yaml").read_text() == first + rest
    assert [i["id"] for i in json.loads((done / "work" / "order.json").read_text())["items"]] == ["R1", "R2", "R3"]
    assert daemon.stop() == 0


@pytest.mark.parametrize("max_jobs", [1, 2])
def test_files_left_while_down_are_taken_oldest_first(env: Env, max_jobs: int) -> None:
    """Files that arrived while no daemon ran are claimed and started at start by mtime, then name; with a second
    slot too, while the agent's one slot is busy (b2.json started before b1.json: the name was left out when an
    order read ahead took its place among those waiting for the agent's slot)."""
    env.configure(max_jobs=max_jobs, agents={"worker": env.agent("--sleep", "0.1", concurrency=1)})
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    now = time.time()
    files = [("c.json", "OLD-1", now - 300), ("a.json", "OLD-2", now - 200)]
    files += [("b2.json", "OLD-4", now - 100), ("b1.json", "OLD-3", now - 100)]
    for name, job_id, mtime in files:
        (inbox / name).write_bytes(json.dumps(order(job_id)).encode())
        os.utime(inbox / name, (mtime, mtime))
    daemon = env.daemon()
    daemon.wait_ready()
    for _, job_id, _ in files:
        env.wait_job(job_id, "done")
    assert daemon.stop() == 0
    claimed = [e["job_id"] for e in daemon.events() if e.get("event") == "job.claimed"]
    assert claimed == ["OLD-1", "OLD-2", "OLD-3", "OLD-4"]
    assert [job for job, _ in env.starts()] == ["OLD-1", "OLD-2", "OLD-3", "OLD-4"]


# A clock for the daemon only, loaded through PYTHONPATH: every datetime.now() is one
# frozen second and time.time() is cut to whole seconds, so that two refusals of one stem
# get the same timestamp and the folder names collide.
FROZEN_CLOCK = """\
import datetime as _dt
import time as _time

_FROZEN = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
_real_time, _real_time_ns = _time.time, _time.time_ns
_time.time = lambda: float(int(_real_time()))
_time.time_ns = lambda: _real_time_ns() // 10**9 * 10**9


class _FrozenDateTime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        b = _FROZEN.astimezone(tz) if tz is not None else _FROZEN.astimezone().replace(tzinfo=None)
        return cls(b.year, b.month, b.day, b.hour, b.minute, b.second, 0, b.tzinfo)

    @classmethod
    def utcnow(cls):
        return cls.now(_dt.timezone.utc).replace(tzinfo=None)


_dt.datetime = _FrozenDateTime
"""


def test_refusal_folder_name_collision_gets_a_suffix(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """When `<stem>@<ts>` is taken, the next refusal folder of that stem gets `-2`, then `-3`."""
    shim = env.tmp / "clock"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(FROZEN_CLOCK)
    monkeypatch.setenv("PYTHONPATH", str(shim))
    daemon = env.daemon()
    daemon.wait_ready()
    datas = {
        "same.json": b'{"job_id": "SAME-1"}',
        "same.yaml": b"job_id: SAME-2\n",
        "same.yml": b"job_id: SAME-3\n",
    }
    wait_until(lambda: time.time() % 1 < 0.3, 5, "the start of a second")
    for name, data in datas.items():
        env.drop(data, name)
    wait_until(lambda: len(refusal_dirs(env, "same")) == 3, 60, "three refusals of same.*")
    names = sorted(p.name for p in refusal_dirs(env, "same"))
    base = min(names, key=len)
    assert names == sorted([base, f"{base}-2", f"{base}-3"]), names
    kept = {}
    for folder in refusal_dirs(env, "same"):
        (order_file,) = folder.glob("order.*")
        kept[order_file.name] = order_file.read_bytes()
    assert kept == {"order.json": datas["same.json"], "order.yaml": datas["same.yaml"], "order.yml": datas["same.yml"]}
    assert daemon.stop() == 0


def test_run_once_waits_for_a_file_still_being_written(env: Env) -> None:
    """`run --once` waits for a file still being written in inbox/ and takes it whole."""
    env.configure(settle=3, rescan_interval=1)
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    head = b'job_id: "ONCE-SLOW"\nfrom: tester\nto: worker\ntask: Written while run --once starts.\n'
    rest = b"items:\n  - id: R1\naccept:\n  output: out.csv\n"
    fd = os.open(inbox / "once-slow.yaml", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    proc = subprocess.Popen(
        [*PYTHON_M, "--config", str(env.config_path), "run", "--once"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=env.tmp,
        env=cli_env(),
    )
    try:
        os.write(fd, head)
        time.sleep(0.8)  # the writer's pace, well below settle (3 s); not a synchronisation
        os.write(fd, rest)
        time.sleep(0.8)
    finally:
        os.close(fd)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    env.wait_job("ONCE-SLOW", "done", timeout=5)
    assert (env.root / "done" / "ONCE-SLOW" / "order.yaml").read_bytes() == head + rest
    assert env.refusals() == []


def test_relative_paths_in_the_config_resolve_against_its_folder(env: Env) -> None:
    """A config's relative root, log_file and command path resolve against the config's folder."""
    etc = env.tmp / "etc"
    (etc / "agents").mkdir(parents=True)
    (etc / "agents" / "fake.py").write_bytes(FAKE_AGENT.read_bytes())
    cfg = {
        "root": "../spool",
        "log_file": "dispatcher.log",
        "settle": 0.3,
        "agents": {"worker": {"command": [sys.executable, "agents/fake.py"], "writes": ["out.csv"]}},
    }
    (etc / "dispatcher.yaml").write_text(yaml.safe_dump(cfg))
    spool = env.tmp / "spool"
    (spool / "inbox").mkdir(parents=True)
    (spool / "inbox" / "REL-1.json").write_bytes(json.dumps(order("REL-1")).encode())
    proc = run_cli(env.tmp, "--config", "etc/dispatcher.yaml", "run", "--once", timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((spool / "done" / "REL-1" / "result.json").read_text())["state"] == "done"
    entries = [json.loads(line) for line in (etc / "dispatcher.log").read_text().splitlines() if line.strip()]
    assert any(e["event"] == "job.done" and e.get("job_id") == "REL-1" for e in entries)


@pytest.mark.parametrize("name", [b"\xff\xfe-order.json", b"x" * 250 + b".json"], ids=["non-utf8", "250-chars"])
def test_file_with_an_awkward_name_is_refused_not_fatal(env: Env, name: bytes) -> None:
    """A bad file whose name is not UTF-8, or too long to carry a timestamp, is refused; the daemon goes on."""
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    bad_name = os.fsencode(inbox) + b"/" + name
    with open(bad_name, "wb") as f:
        f.write(b"{not json")
    os.utime(bad_name, (time.time() - 60, time.time() - 60))
    (inbox / "after.json").write_bytes(json.dumps(order("AFTER-BYTES")).encode())
    proc = env.cli("run", "--once", timeout=90)
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 1, proc.stderr
    assert finished(env, "AFTER-BYTES") == ("done", env.result("AFTER-BYTES", "done"))
    assert os.listdir(os.fsencode(inbox)) == []
    failed = os.fsencode(env.root / "failed")
    kept = [
        Path(os.fsdecode(os.path.join(failed, d, f))).read_bytes()
        for d in os.listdir(failed)
        for f in os.listdir(os.path.join(failed, d))
        if f.startswith(b"order.")
    ]
    assert kept == [b"{not json"]


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        (b"caf\xe9" * 50 + b".json", b"caf\xe9" * 45),  # not UTF-8: every byte of the first 180 kept
        ("é".encode() * 100 + b".json", "é".encode() * 90),  # UTF-8: 180 bytes, whole characters
        (b"a" + "é".encode() * 100 + b".json", b"a" + "é".encode() * 89),  # 181 would split one: 179
    ],
    ids=["not-utf8", "utf8", "utf8-split"],
)
def test_a_long_refused_names_folder_keeps_the_stems_first_180_bytes(env: Env, name: bytes, stem: bytes) -> None:
    """README, limits: a refused file's folder `failed/<stem>@<time>/` keeps the stem's first 180 bytes, whatever
    they are; a UTF-8 character the cut would split is left out whole."""
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    with open(os.fsencode(inbox) + b"/" + name, "wb") as f:
        f.write(b"{not json")
    assert env.cli("run", "--once", timeout=90).returncode == 1
    [folder] = os.listdir(os.fsencode(env.root / "failed"))
    assert folder.rpartition(b"@")[0] == stem, folder


def test_a_long_refused_extension_keeps_its_first_200_bytes_after_the_dot(env: Env) -> None:
    """README, limits: a refused file's `order.<ext>` keeps the extension's first 200 bytes, the dot apart."""
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    (inbox / ("ab." + "e" * 230)).write_bytes(b"{not json")
    assert env.cli("run", "--once", timeout=90).returncode == 1
    [folder] = (env.root / "failed").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["order." + "e" * 200, "result.json"]
    assert (folder / ("order." + "e" * 200)).read_bytes() == b"{not json"


# -- run --once -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "code", "stderr"),
    [
        pytest.param({}, 0, "", id="empty-inbox"),
        pytest.param({"ONCE-1.json": ("ONCE-1", "worker"), "ONCE-2.yaml": ("ONCE-2", "worker")}, 0, "", id="all-done"),
        pytest.param(
            {"ONCE-1.json": ("ONCE-1", "worker"), "ONCE-2.json": ("ONCE-2", "bad")},
            1,
            "run --once: 1 job failed\n",
            id="one-failed",
        ),
        pytest.param(
            {"ONCE-1.json": ("ONCE-1", "worker"), "notes.txt": None}, 1, "run --once: 1 file refused\n", id="not-order"
        ),
        pytest.param(
            {"ONCE-1.json": ("ONCE-2", "bad"), "ONCE-3.json": ("ONCE-3", "bad"), "bad.json": ("ONCE-4", "nobody")},
            1,
            "run --once: 2 jobs failed, 1 file refused\n",
            id="failed-and-invalid",
        ),
    ],
)
def test_run_once_exit_code(env: Env, files: dict[str, Any], code: int, stderr: str) -> None:
    """`run --once` drains inbox/, waits for every job, exits 0 only if all are done and none refused; an exit 1
    comes with one line on stderr that says what failed (section 7), the JSON lines staying on stdout."""
    env.configure(agents={"worker": env.agent(), "bad": env.agent("--exit", "3")})
    for name, spec in files.items():
        if spec is None:
            env.drop(NOTES, name)
        else:
            env.drop(order(spec[0], to=spec[1]), name)
    proc = env.cli("run", "--once", timeout=90)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == stderr
    for state in ("inbox", "active", "done", "failed"):
        assert (env.root / state).is_dir(), f"run did not create {state}/"
    assert visible(env.root / "inbox") == []
    assert visible(env.root / "active") == []
    for spec in files.values():
        if spec is not None and spec[1] != "nobody":
            assert finished(env, spec[0]) is not None, f"{spec[0]} not finished after run --once"
    events = [json.loads(line)["event"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[0] == "daemon.started" and events[-2:] == ["daemon.stopping", "daemon.stopped"], events


# -- init -------------------------------------------------------------------------------------------


def snapshot(*tops: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                st = p.lstat()
                out[str(p)] = (st.st_mode, st.st_mtime_ns, p.read_bytes() if p.is_file() else None)
        st = top.lstat()
        out[str(top)] = (st.st_mode, st.st_mtime_ns)
    return out


def test_init_makes_the_layout_and_a_starter_config(tmp_path: Path) -> None:
    """`init DIR` makes the root's folders and a starter config; a second run changes nothing."""
    cfg = tmp_path / "etc" / "dispatcher.yaml"
    root = tmp_path / "spool"
    first = run_cli(tmp_path, "--config", str(cfg), "init", str(root))
    assert first.returncode == 0, first.stderr
    for state in ("inbox", "active", "done", "failed"):
        assert (root / state).is_dir(), state
    assert cfg.is_file()
    assert isinstance(yaml.safe_load(cfg.read_text()), dict)
    before = snapshot(root, cfg.parent)
    second = run_cli(tmp_path, "--config", str(cfg), "init", str(root))
    assert second.returncode == 0, second.stderr
    assert snapshot(root, cfg.parent) == before
    status = run_cli(tmp_path, "--config", str(cfg), "--root", str(root), "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counts"]["inbox"] == 0


def test_init_with_default_config_path_and_relative_dir(tmp_path: Path) -> None:
    """Without --config, `init DIR` writes config/dispatcher.yaml under the cwd and DIR relative to it."""
    proc = run_cli(tmp_path, "init", "spool")
    assert proc.returncode == 0, proc.stderr
    for state in ("inbox", "active", "done", "failed"):
        assert (tmp_path / "spool" / state).is_dir(), state
    assert (tmp_path / "config" / "dispatcher.yaml").is_file()
    check = run_cli(tmp_path, "validate")
    assert check.returncode == 0, check.stderr


def test_init_uses_the_configured_root_and_never_overwrites_the_config(env: Env) -> None:
    """`init` without DIR makes the configured root and leaves an existing config as it is."""
    before = env.config_path.read_bytes()
    proc = env.cli("init")
    assert proc.returncode == 0, proc.stderr
    for state in ("inbox", "active", "done", "failed"):
        assert (env.root / state).is_dir(), state
    assert env.config_path.read_bytes() == before
    assert env.cli("init").returncode == 0
    assert env.config_path.read_bytes() == before


# -- status and show ------------------------------------------------------------------------------


@dataclass
class Busy:
    env: Env
    daemon: Daemon


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Busy]:
    """A running daemon with one job of each kind: done, failed, refused, active and queued."""
    env = make_env(tmp_path_factory.mktemp("busy"))
    env.configure(
        agents={"worker": env.agent(), "bad": env.agent("--exit", "3"), "slow": env.agent("--sleep", "60")},
        max_jobs=1,
        stop_timeout=1,
    )
    daemon = env.daemon()
    try:
        daemon.wait_ready()
        env.drop(order("ST-OK"))
        env.wait_job("ST-OK", "done")
        env.drop(order("ST-BAD", to="bad"))
        env.wait_job("ST-BAD", "failed")
        env.drop(NOTES, "notes.txt")
        env.wait_refused("notes")
        env.drop(order("ST-SLOW", to="slow"))
        wait_until(lambda: starts_of(env, "ST-SLOW") == 1, 30, "the slow agent to start")
        env.drop(order("ST-QUEUED"))
        yield Busy(env, daemon)
    finally:
        daemon.stop()
        kill_all(env)


def test_status_json_has_exact_keys_and_counts(busy: Busy) -> None:
    """`status --json` gives counts per state, the daemons and the active jobs with agent, pid, host and age."""
    proc = busy.env.cli("status", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {"counts", "daemons", "active"}
    assert data["counts"] == {
        "inbox": 1,
        "held": 0,
        "active": 1,
        "waiting": 0,
        "review": 0,
        "done": 1,
        "failed": 1,
        "refused": 1,
    }
    assert len(data["active"]) == 1
    job = data["active"][0]
    assert set(job) == {"job_id", "agent", "pid", "host", "age_s", "daemon_alive"}
    assert job["job_id"] == "ST-SLOW"
    assert job["agent"] == "slow"
    assert busy.daemon.proc is not None
    assert job["pid"] == busy.daemon.proc.pid
    assert job["host"] == socket.gethostname()
    assert isinstance(job["age_s"], int | float) and 0 <= job["age_s"] < 120


def test_status_text_names_states_and_active_jobs(busy: Busy) -> None:
    """`status` prints the counts per state and each active job with its agent and daemon pid."""
    proc = busy.env.cli("status")
    assert proc.returncode == 0, proc.stderr
    assert busy.daemon.proc is not None
    for word in ("inbox", "active", "done", "failed", "refused", "ST-SLOW", "slow", str(busy.daemon.proc.pid)):
        assert word in proc.stdout, f"{word!r} not in {proc.stdout!r}"


def test_options_may_follow_the_command(busy: Busy) -> None:
    """`--config` and `--root` may also come after the command name."""
    args = ("status", "--json", "--config", str(busy.env.config_path), "--root", str(busy.env.root))
    proc = run_cli(busy.env.tmp, *args)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"]["done"] == 1


def test_show_json_of_a_done_job(busy: Busy) -> None:
    """`show JOB_ID --json` gives the job's state, checks, attempts, parent and children."""
    proc = busy.env.cli("show", "ST-OK", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["job_id"] == "ST-OK"
    assert data["state"] == "done"
    assert [c["name"] for c in data["checks"]] == CHECK_NAMES
    assert [a["n"] for a in data["attempts"]] == [1]
    assert data["parent"] is None
    assert data["children"] == []


def test_show_json_of_a_failed_job(busy: Busy) -> None:
    """`show --json` of a failed job says failed, with exit_ok false."""
    proc = busy.env.cli("show", "ST-BAD", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["state"] == "failed"
    assert {c["name"]: c["ok"] for c in data["checks"]}["exit_ok"] is False


def test_show_json_of_a_running_job(busy: Busy) -> None:
    """`show --json` of a running job says it is active."""
    proc = busy.env.cli("show", "ST-SLOW", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["job_id"] == "ST-SLOW"
    assert data["state"] == "active"


def test_show_text_of_a_done_job(busy: Busy) -> None:
    """`show JOB_ID` prints the job id, its state and its checks for a person."""
    proc = busy.env.cli("show", "ST-OK")
    assert proc.returncode == 0, proc.stderr
    for word in ("ST-OK", "done", "exit_ok", "writes_scope"):
        assert word in proc.stdout, f"{word!r} not in {proc.stdout!r}"


@pytest.mark.parametrize("args", [("show", "NO-SUCH-JOB"), ("show", "NO-SUCH-JOB", "--json")])
def test_show_of_an_unknown_job_exits_1(busy: Busy, args: tuple[str, ...]) -> None:
    """`show` of a job id nobody knows exits 1 with a one-line error."""
    proc = busy.env.cli(*args)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "NO-SUCH-JOB" in one_line(proc.stderr)


@pytest.mark.parametrize("args", [("frobnicate",), ("show",), ("run", "--no-such-option")])
def test_bad_usage_exits_2(env: Env, args: tuple[str, ...]) -> None:
    """An unknown command, a missing argument or an unknown option exits 2."""
    proc = env.cli(*args, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip()
