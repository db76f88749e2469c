"""`dispatcher list` and `dispatcher show` (contract 7) over a root with a job of every kind."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order, wait_until
from test_lifecycle import make_env

from dispatcher.layout import Layout
from dispatcher.query.listing import list_jobs
from dispatcher.spec.config import load_config
from dispatcher.store.jobstore import JobFolder

ROW_KEYS = {"job_id", "state", "agent", "age_s", "reason", "cost_usd", "path"}
PYTHON_NOTATION = ("None", "True", "False", "['", "{'", ".0 ")
# an agent that prints 15 numbered lines on stderr and exits 3
NOISY = [
    sys.executable,
    "-c",
    "import sys\nfor i in range(1, 16): print(f'err line {i}', file=sys.stderr)\nsys.exit(3)",
]


def costing(env: Env, usd: float, *flags: str) -> dict[str, Any]:
    """Return the fake agent reporting usd as its total_cost_usd, with more flags."""
    return env.agent(*flags, "--json-result", json.dumps({"total_cost_usd": usd}))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A root after `run --once`: done (with cost), failed (noisy stderr), refused, a chain; then queued and held."""
    env = make_env(tmp_path_factory.mktemp("listshow"))
    child = order("CHAIN-B", to="worker")
    child["from"] = "first"
    env.configure(
        agents={
            "worker": costing(env, 0.25),
            "noisy": {"command": NOISY, "timeout": 30},
            "first": costing(env, 0.5, "--followup", json.dumps(child)),
        }
    )
    env.drop(order("OK-1"))
    env.drop(order("BAD-1", to="noisy"))
    env.drop(order("CHAIN-A", to="first"))
    env.drop("just notes\n", "notes.txt")
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a failure and a refusal
    env.drop(order("QUEUED-1"))
    held = env.root / "held"
    held.mkdir(exist_ok=True)
    (held / "HELD-1.json").write_text(json.dumps(order("HELD-1")))
    yield env


def rows(env: Env, *args: str) -> list[dict[str, Any]]:
    """Return `list --json ARGS` as data."""
    proc = env.cli("list", "--json", *args, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines()]


# -- list ------------------------------------------------------------------------------------------


def test_list_json_has_one_row_per_job_and_refused_file_newest_first(root: Env) -> None:
    """`list --json` prints one JSON object a line with the contract's keys, each job and refusal once, newest first."""
    got = rows(root)
    assert all(set(r) == ROW_KEYS for r in got), got
    states = {r["job_id"]: r["state"] for r in got}
    assert states == {
        "QUEUED-1": "inbox",
        "HELD-1": "held",
        "OK-1": "done",
        "BAD-1": "failed",
        "CHAIN-A": "done",
        "CHAIN-B": "done",
        None: "refused",
    }
    ages = [r["age_s"] for r in got]
    assert ages == sorted(ages), got
    assert got[0]["job_id"] in ("QUEUED-1", "HELD-1")
    by_id = {r["job_id"]: r for r in got}
    assert by_id["OK-1"]["cost_usd"] == 0.25 and by_id["OK-1"]["agent"] == "worker"
    assert Path(by_id["OK-1"]["path"]) == root.root / "done" / "OK-1"
    assert Path(by_id["QUEUED-1"]["path"]) == root.root / "inbox" / "QUEUED-1.json"


def test_list_state_failed_gives_the_reason_and_refused_gives_null_job_id(root: Env) -> None:
    """`--state failed` lists the failed job with its reason; `--state refused` the refused file, job_id null."""
    (failed,) = rows(root, "--state", "failed")
    assert failed["job_id"] == "BAD-1" and failed["reason"].startswith("exit_ok")
    (refused,) = rows(root, "--state", "refused")
    assert refused["job_id"] is None
    assert refused["reason"].startswith("not a work order")
    assert "notes@" in refused["path"]


def test_list_agent_keeps_only_that_agents_jobs(root: Env) -> None:
    """`--agent worker` lists only jobs whose agent is worker, queued and held orders included."""
    got = rows(root, "--agent", "worker")
    assert {r["job_id"] for r in got} == {"OK-1", "CHAIN-B", "QUEUED-1", "HELD-1"}


def test_list_text_shows_id_state_agent_age_cost_reason_without_python_notation(root: Env) -> None:
    """`list` prints a line per job: state, agent, age, cost in USD, a failure's reason; no Python notation."""
    text = root.cli("list", check=True).stdout
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "done" in lines["OK-1"] and "worker" in lines["OK-1"] and "0.25 USD" in lines["OK-1"], text
    assert "failed" in lines["BAD-1"] and "exit_ok: exit 3" in lines["BAD-1"], text
    assert "refused" in lines["-"] and "not a work order" in lines["-"], text
    for python in PYTHON_NOTATION:
        assert python not in text, text


def test_list_with_an_unknown_state_exits_2(root: Env) -> None:
    """`list --state nonsense` is bad usage: exit 2 with one line on stderr."""
    proc = root.cli("list", "--state", "nonsense")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_list_of_failed_jobs_reads_no_result_of_a_done_job(root: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--state failed`, no result.json under done/ is opened (a big root stays fast)."""
    opened: list[Path] = []
    real = JobFolder.result

    def spy(self: JobFolder) -> dict[str, Any] | None:
        opened.append(self.path)
        return real(self)

    monkeypatch.setattr(JobFolder, "result", spy)
    cfg = load_config(root.config_path)
    got = list_jobs(cfg, Layout(root.root), None, state="failed")
    assert [r["job_id"] for r in got] == ["BAD-1"]
    assert opened == [root.root / "failed" / "BAD-1"]


# -- show ------------------------------------------------------------------------------------------


def show_json(env: Env, job_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(env.cli("show", job_id, "--json", check=True).stdout)
    return data


def test_show_failed_job_prints_its_stderr_tail_log_paths_argv_and_host(root: Env) -> None:
    """`show` of a failed job prints the last 10 lines of its stderr, its logs' paths, the argv it ran and the host."""
    text = root.cli("show", "BAD-1", check=True).stdout
    attempts = root.root / "failed" / "BAD-1" / "attempts" / "1"
    assert str(attempts / "stderr.log") in text and str(attempts / "stdout.log") in text, text
    for i in range(6, 16):
        assert f"err line {i}\n" in text, text
    assert "err line 5\n" not in text, text
    assert f"argv: {sys.executable} -c" in text, text
    assert f"host {socket.gethostname()}" in text, text


def test_show_json_of_a_failed_attempt_has_argv_host_logs_and_stderr_tail(root: Env) -> None:
    """`show --json` gives each attempt its argv, host, log paths, and for a failed one its stderr's last lines."""
    (attempt,) = show_json(root, "BAD-1")["attempts"]
    assert attempt["argv"] == NOISY
    assert attempt["host"] == socket.gethostname()
    assert Path(attempt["logs"]["stderr"]).read_text().startswith("err line 1\n")
    assert attempt["stderr_tail"] == [f"err line {i}" for i in range(6, 16)]


def test_show_gives_cost_per_attempt_and_in_total(root: Env) -> None:
    """`show` of a job whose agent reported a cost shows it per attempt and for the job, in USD."""
    data = show_json(root, "OK-1")
    assert data["cost_usd"] == 0.25 and data["attempts"][0]["cost_usd"] == 0.25
    assert "stderr_tail" not in data["attempts"][0]
    text = root.cli("show", "OK-1", check=True).stdout
    assert "cost 0.25 USD" in text and "cost: 0.25 USD" in text, text


def test_show_tree_gives_each_jobs_cost_and_the_chains_total(root: Env) -> None:
    """`show --tree` prints each job of the chain with its cost, then the chain's total."""
    text = root.cli("show", "--tree", "CHAIN-B", check=True).stdout
    lines = text.splitlines()
    assert "CHAIN-A" in lines[0] and "0.5 USD" in lines[0], text
    assert "CHAIN-B" in lines[1] and "0.25 USD" in lines[1] and "<-" in lines[1], text
    assert lines[-1] == "chain total: 0.75 USD", text


@pytest.mark.parametrize(("job_id", "state", "folder"), [("QUEUED-1", "inbox", "inbox"), ("HELD-1", "held", "held")])
def test_show_of_a_queued_or_held_order(root: Env, job_id: str, state: str, folder: str) -> None:
    """`show` of an order still in inbox/ or held/ gives its state, agent and file."""
    data = show_json(root, job_id)
    assert (data["job_id"], data["state"], data["agent"]) == (job_id, state, "worker")
    assert Path(data["file"]) == root.root / folder / f"{job_id}.json"
    text = root.cli("show", job_id, check=True).stdout
    assert text.startswith(f"{job_id}  {state}  agent worker"), text


@pytest.mark.parametrize("bad", [".", "../done/OK-1", "OK-1/", "\udcff", "a\x1b[31mred"])
def test_show_of_what_is_no_job_id_is_one_escaped_line_and_exit_1_as_retry(root: Env, bad: str) -> None:
    """`show` of a path, an undecodable byte or a control character is `retry`'s one escaped line, exit 1."""
    retry = root.cli("retry", bad)
    assert retry.returncode == 1 and retry.stderr.endswith(
        ": not a job id (letters, digits, '.', '_', '-'; at most 128)\n"
    )
    for args in (("show", bad), ("show", bad, "--json"), ("show", "--tree", bad)):
        proc = root.cli(*args)
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", retry.stderr), args


def test_show_of_a_refused_files_folder_name_shows_the_refusal_not_a_failed_job(root: Env) -> None:
    """`failed/<stem>@<time>/` is a refused file, never a job (contract 1): `show` of that name shows the refusal."""
    (name,) = [p.name for p in (root.root / "failed").iterdir() if "@" in p.name]
    text = root.cli("show", name, check=True).stdout
    assert text.startswith(f"{name}  refused  agent -  "), text
    data = show_json(root, name)
    assert data["state"] == "refused" and data["path"] == str(root.root / "failed" / name), data
    # the shape of every `show --json`: a job's keys, for a file that never ran and has no lineage or chain
    assert show_json(root, "OK-1").keys() <= data.keys(), data
    assert data["folder"] == data["path"] and data["attempts"] == [] and data["children"] == []
    assert (data["parent"], data["cost_usd"], data["tree"]) == (None, None, None)
    assert [c["name"] for c in data["checks"]][:3] == ["exit_ok", "receipt_present", "receipt_job_id"]
    assert all(c["ok"] is None for c in data["checks"]) and data["received"] and data["reason"]


@pytest.mark.parametrize("name", ["notes.txt", "notes"])
def test_show_finds_a_refused_file_by_its_file_name_and_its_stem(root: Env, name: str) -> None:
    """`show notes.txt` (the name it was dropped as) and `show notes` both show the refusal of notes.txt."""
    (folder,) = [p for p in (root.root / "failed").iterdir() if "@" in p.name]
    data = show_json(root, name)
    assert data["state"] == "refused" and data["path"] == str(folder), data
    assert root.cli("show", name, check=True).stdout.startswith(f"{name}  refused  agent -  ")
    other = root.cli("show", "notes.json")  # another file of the same stem was never refused
    assert other.returncode == 1 and other.stderr == "notes.json: no such job or refused file\n"


@pytest.mark.parametrize("job_id", ["OK-1", "BAD-1", "CHAIN-A", "CHAIN-B", "QUEUED-1", "HELD-1"])
def test_show_text_has_no_python_notation(root: Env, job_id: str) -> None:
    """`show` and `show --tree` text never shows None, True/False, a Python list or a needless `.0`."""
    for args in (("show", job_id), ("show", "--tree", job_id)):
        text = root.cli(*args, check=True).stdout
        for python in PYTHON_NOTATION:
            assert python not in text, text


def test_a_retried_job_back_in_active_is_as_old_as_its_return_not_its_first_claim(env: Env) -> None:
    """A job claimed ten minutes ago, failed, then retried: in active/ again, `list` and `status` give it the age
    of its return (seconds), not of its first claim, and `list` sorts it as new."""
    env.configure(agents={"worker": env.agent("--exit", "1")})
    env.drop(order("OLD-1"))
    env.cli("run", "--once", timeout=60)
    folder = env.job_dir("OLD-1", "failed")
    spec = json.loads((folder / "job.json").read_text())
    spec["received"] -= 600  # as if claimed ten minutes ago
    (folder / "job.json").write_text(json.dumps(spec))
    env.configure(agents={"worker": env.agent("--sleep", "30")}, kill_grace=0.5)
    assert env.cli("retry", "OLD-1").returncode == 0
    d = env.daemon()
    wait_until(lambda: (env.root / "active" / "OLD-1" / "attempts" / "2").is_dir(), what="attempt 2")
    rows = [json.loads(x) for x in env.cli("list", "--state", "active", "--json", check=True).stdout.splitlines()]
    assert [r["job_id"] for r in rows] == ["OLD-1"] and rows[0]["age_s"] < 60, rows
    active = json.loads(env.cli("status", "--json", check=True).stdout)["active"]
    assert [a["job_id"] for a in active] == ["OLD-1"] and active[0]["age_s"] < 60, active
    d.stop()


def test_an_order_read_ahead_is_as_old_in_active_as_its_claim(env: Env) -> None:
    """`concurrency: 1`: S2 is read while S1 runs and claimed 8 s later. In active/ its age in `list` and `status` is
    the time since its claim (README: a job's claim in active/), not since its order was read (a bound of 5 s leaves
    a busy machine's commands room)."""
    env.configure(agents={"worker": {**env.agent("--sleep", "8"), "concurrency": 1}}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("S1"))
    d.wait_event("agent.started", job_id="S1")
    env.drop(order("S2"))
    d.wait_event("order.received", job_id="S2")
    d.wait_event("job.claimed", job_id="S2", timeout=60)
    rows = [json.loads(x) for x in env.cli("list", "--state", "active", "--json", check=True).stdout.splitlines()]
    assert [(r["job_id"], r["age_s"] < 5) for r in rows] == [("S2", True)], rows
    active = json.loads(env.cli("status", "--json", check=True).stdout)["active"]
    assert [(a["job_id"], a["age_s"] < 5) for a in active] == [("S2", True)], active
    assert d.stop() == 0


def test_show_explains_an_invalid_order_no_daemon_has_read_yet(env: Env) -> None:
    """An invalid order waiting unread in inbox/ (no daemon runs): `list` shows it, and `show` says why it will be
    refused instead of calling it unknown."""
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    bad = {**order("BAD-FROM"), "from": "t\x1bx"}
    (env.root / "inbox" / "BAD-FROM.json").write_text(json.dumps(bad))
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    assert [(r["job_id"], r["state"]) for r in listed] == [("BAD-FROM", "inbox")]
    shown = json.loads(env.cli("show", "BAD-FROM", "--json", check=True).stdout)
    assert shown["state"] == "inbox" and shown["reason"].startswith("not a valid order"), shown
    assert "from:" in shown["reason"], shown
    text = env.cli("show", "BAD-FROM", check=True).stdout
    assert "BAD-FROM  inbox" in text and "reason: not a valid order" in text, text


def test_show_explains_a_queued_order_for_an_agent_the_config_lacks(env: Env) -> None:
    """A queued order whose `to` names no agent of the config: `show` gives the reason it will be refused for, as
    `validate` does (it showed a queued job with no reason); the same order for a known agent has none."""
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    (env.root / "inbox" / "Q3.json").write_text(json.dumps(order("Q3", to="nobody")))
    (env.root / "inbox" / "Q4.json").write_text(json.dumps(order("Q4")))
    shown = json.loads(env.cli("show", "Q3", "--json", check=True).stdout)
    assert shown["state"] == "inbox" and shown["reason"] == (
        "not a valid order, refused when a daemon reads it: to: no agent 'nobody' is defined in the config"
        " (a daemon that had the agent before a reload removed it leaves the order waiting instead)"
    ), shown
    assert json.loads(env.cli("show", "Q4", "--json", check=True).stdout)["reason"] is None
    assert "reason: not a valid order" in env.cli("show", "Q3", check=True).stdout


def test_bidirectional_controls_are_shown_escaped_and_kept_in_json(env: Env) -> None:
    """A task holding U+202E: `show` and `list` print it escaped (it cannot reorder the line), `--json` keeps it."""
    (env.root / "inbox").mkdir(parents=True, exist_ok=True)
    task = "Pay the \u202eeciovni\u202c today."
    (env.root / "inbox" / "RTL-1.json").write_text(json.dumps({**order("RTL-1"), "task": task}))
    text = env.cli("show", "RTL-1", check=True).stdout
    assert "\u202e" not in text and "\\u202eeciovni\\u202c" in text, text
    assert json.loads(env.cli("show", "RTL-1", "--json", check=True).stdout)["task"] == task


def test_list_and_status_print_a_long_job_id_whole(env: Env) -> None:
    """A job id may have 128 characters: `list` and `status` print it whole (it is what `show` takes), however
    long; the columns widen to it rather than cut it with `...`."""
    from dispatcher.cli.render import render_status

    long_id = "L" + "o" * 120 + "ng-id.1"
    assert len(long_id) == 128
    env.configure()
    env.drop(order(long_id))
    env.drop(order("SHORT-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    text = env.cli("list", check=True).stdout
    assert "..." not in text, text
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert lines[long_id].split()[1] == "done" and lines["SHORT-1"].split()[1] == "done", text
    assert env.cli("show", lines[long_id].split()[0], check=True).stdout
    active = {"job_id": long_id, "agent": "worker", "pid": 42, "host": "h", "age_s": 3, "daemon_alive": True}
    status = render_status("/r", {"counts": {"active": 1}, "daemons": [], "active": [active]}, 0.0)
    assert any(line.split()[:2] == [long_id, "worker"] for line in status.splitlines()), status


def test_a_job_claimed_between_the_reads_of_two_states_is_listed_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`list` reads inbox/ and then the job folders: an order claimed (its file gone from inbox/) after inbox/ was read
    is listed once, where it went, not also as queued (section 7: one line per job). A file of the same id that is
    still in inbox/ (a duplicate to be refused) keeps its own line."""
    import os

    from dispatcher.query import listing

    env.configure()
    env.drop(order("MOVED-1"))
    assert env.cli("run", "--once", timeout=60).returncode == 0
    again = env.drop(order("MOVED-1"))  # the same order again: to be refused, listed as queued meanwhile
    cfg, layout = load_config(env.config_path), Layout(env.root)
    assert sorted(r["state"] for r in list_jobs(cfg, layout, None)) == ["done", "inbox"]
    real = listing._finished

    def claimed_meanwhile(*args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        if again.exists():  # read once inbox/ was read (the states' rows are read lazily, one state after another)
            os.unlink(again)  # as a claim's move would, between the two reads
        yield from real(*args, **kwargs)

    monkeypatch.setattr(listing, "_finished", claimed_meanwhile)
    got = list_jobs(cfg, layout, None)
    assert [(r["job_id"], r["state"]) for r in got] == [("MOVED-1", "done")], got


def test_status_leaves_out_a_job_that_left_active_while_it_was_read(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status` lists active/ and then reads each job: one that finished in between is not shown as active with no
    age; one whose job.json is damaged in active/ still is."""
    import shutil

    from dispatcher.query.report import active_jobs

    env.configure()
    layout = Layout(env.root)
    for job_id in ("LEFT-1", "DAMAGED-1"):
        (env.root / "active" / job_id).mkdir(parents=True)
    real = JobFolder.spec

    def finished_meanwhile(self: JobFolder) -> Any:
        if self.path.name == "LEFT-1":
            shutil.move(str(self.path), str(env.root / "done" / "LEFT-1"))
        return real(self)

    monkeypatch.setattr(JobFolder, "spec", finished_meanwhile)
    got = active_jobs(layout, None, [], 0.0)
    assert [(a["job_id"], a["age_s"]) for a in got] == [("DAMAGED-1", None)], got


def test_a_refused_files_job_id_that_is_no_job_id_is_null_and_show_of_it_is_not_a_job_id(env: Env) -> None:
    """Refused files whose `job_id` is a string no job id can be (`a@b`, empty): `list --json` gives job_id null, as
    for a file whose id could not be read, and `show` of that string says it is not a job id (exit 1), as `retry`
    does; the refusal is still shown by its file's name."""
    env.configure()
    for name, job_id in (("at.json", "a@b"), ("empty.json", "")):
        env.drop({"job_id": job_id, "from": "me", "to": "worker", "task": "t", "items": [{"id": "a"}]}, name=name)
    assert env.cli("run", "--once", timeout=120).returncode == 1  # refused files: exit 1
    listed = env.cli("list", "--state", "refused", "--json", check=True).stdout
    refused = [json.loads(line) for line in listed.splitlines()]
    assert len(refused) == 2 and [r["job_id"] for r in refused] == [None, None], refused
    for bad in ("a@b", ""):
        proc = env.cli("show", bad)
        assert proc.returncode == 1 and "not a job id" in proc.stderr, (bad, proc.stdout, proc.stderr)
    assert env.cli("show", "at.json", check=True).stdout.startswith("at.json  refused  agent worker")


def test_an_approved_jobs_age_in_list_counts_from_the_approval(env: Env) -> None:
    """A job approved 4 s after it entered review/: `list` gives its age since it entered done/ (the approval), and
    lists it before a job that finished in between, newest first. (The bound leaves 3 s for the `list` command's
    own start under load; its age since review/ is over 4 s.)"""
    env.configure(agents={"worker": env.agent(review=True), "plain": env.agent()})
    env.drop(order("REV-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    time.sleep(4)
    env.drop(order("MID-1", to="plain"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    env.cli("approve", "REV-1", check=True)
    rows = [json.loads(x) for x in env.cli("list", "--state", "done", "--json", check=True).stdout.splitlines()]
    assert [r["job_id"] for r in rows] == ["REV-1", "MID-1"], rows
    assert rows[0]["age_s"] < 3.0, rows
