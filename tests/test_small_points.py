"""The smaller points of an operator's second day: checks at validate and start, clear words, exact counts."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import Env, cli_env, order
from structlog.testing import capture_logs

import dispatcher.cli.commands as commands_mod
import dispatcher.spec.config as config_mod
from dispatcher import shortage
from dispatcher.cli.main import main
from dispatcher.cli.render import render_status

CHECKOUT = Path(__file__).resolve().parent.parent


def test_a_mistyped_script_for_an_interpreter_fails_validate_and_is_named_at_start(env: Env) -> None:
    """`[python3, ../agents/shuot.py]`: validate exits 2 naming the resolved path; run logs config.problem for it."""
    (env.tmp / "agents").mkdir()
    (env.tmp / "agents" / "shout.py").write_text("print('hi')\n")
    agents = {
        "shout": {"command": ["python3", "agents/shuot.py", "{order}"], "writes": ["x"]},
        "fixer": env.agent(repair=True),
    }
    env.configure(agents)
    proc = env.cli("validate")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        f"{env.config_path}: agents.shout.command: script '{env.tmp / 'agents' / 'shuot.py'}' not found:"
        " a relative path is resolved against the config's folder, else the agent would look for it in its job's work/"
    )
    assert lines[1] == f"{env.config_path}: agents.fixer.repair: has no effect without retry_safe or probe"
    d = env.daemon()
    d.wait_ready()
    problem = d.wait_event("config.problem", field="agents.shout.command")
    assert problem["level"] == "error" and "shuot.py' not found" in problem["problem"]
    assert d.wait_event("config.problem", field="agents.fixer.repair")["level"] == "warning"
    agents["shout"]["command"] = ["python3", "agents/shout.py", "{order}"]
    env.configure(agents)
    assert "agents.shout" not in env.cli("validate").stderr


def test_a_second_daemon_on_the_root_says_so(env: Env) -> None:
    """The second daemon to start logs daemon.shared naming the first; the first logged none."""
    first = env.daemon()
    first.wait_ready()
    second = env.daemon()
    second.wait_ready()
    shared = second.wait_event("daemon.shared")
    assert shared["others"] == [f"{first.proc.pid} on {shared['others'][0].split(' on ')[1]}"]  # type: ignore[union-attr]
    assert not [e for e in first.events() if e.get("event") == "daemon.shared"]


def test_submit_of_several_files_with_one_known_id_says_nothing_was_submitted(env: Env) -> None:
    """Three files, one with a known job id: one line names it and says `nothing was submitted (3 files given)`;
    exit 2 (section 7: a one-line error)."""
    env.drop(order("OLD-1"))
    assert env.cli("run", "--once").returncode == 0
    names = []
    for job_id in ("NEW-1", "OLD-1", "NEW-2"):
        path = env.tmp / f"{job_id}.json"
        path.write_text(json.dumps(order(job_id)))
        names.append(str(path))
    proc = env.cli("submit", *names)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{names[1]}: job_id: OLD-1 is already known (state done); a job id is never run twice;"
        " nothing was submitted (3 files given)",
    ]
    assert list((env.root / "inbox").iterdir()) == []


def test_show_of_a_refused_file_shows_the_refusal(env: Env) -> None:
    """`show` of an id that list shows as refused prints the refusal (reason, folder), exit 0; --json the list row."""
    env.drop(order("REF-1", to="nobody"))
    assert env.cli("run", "--once").returncode == 1
    shown = env.cli("show", "REF-1")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert re.fullmatch(r"REF-1  refused  agent -  \d+ s ago: the file never became a job", lines[0]), lines[0]
    assert lines[1].startswith("  reason: to: ") and lines[2].startswith(f"  folder: {env.root / 'failed'}/REF-1@")
    as_json = json.loads(env.cli("show", "REF-1", "--json", check=True).stdout)
    assert as_json["state"] == "refused" and as_json["job_id"] == "REF-1"
    missing = env.cli("show", "NOPE-9")
    assert missing.returncode == 1 and missing.stderr == "NOPE-9: no such job or refused file\n"


@pytest.mark.parametrize("stem_bytes", [175, 185, 240])
def test_show_finds_a_refused_file_by_a_name_longer_than_its_folder_keeps(env: Env, stem_bytes: int) -> None:
    """A refused file whose stem is longer than the 180 bytes its folder keeps: `show NAME` (README: by its file name)
    prints the refusal, as for a shorter name; it said `not a job id` and exited 1."""
    name = "w" * stem_bytes + ".json"
    env.drop(b"bad\n", name=name)
    assert env.cli("run", "--once").returncode == 1
    [folder] = [p for p in (env.root / "failed").iterdir() if "@" in p.name]
    assert folder.name.startswith("w" * min(stem_bytes, 180) + "@")
    shown = env.cli("show", name)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[2] == f"  folder: {folder}"
    assert json.loads(env.cli("show", name, "--json", check=True).stdout)["state"] == "refused"


def test_init_in_an_empty_folder_makes_a_local_config_even_with_a_system_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With /etc/dispatcher/dispatcher.yaml present, `init` in an empty folder writes ./config/dispatcher.yaml."""
    system = tmp_path / "etc" / "dispatcher.yaml"
    system.parent.mkdir()
    system.write_text("root: /nonexistent/system-root\nagents: {}\n")
    monkeypatch.setattr(config_mod, "SYSTEM_CONFIG", system)
    monkeypatch.setattr(commands_mod, "SYSTEM_CONFIG", system)
    monkeypatch.delenv("DISPATCHER_CONFIG", raising=False)
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as done:
        main(["init"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert (work / "config" / "dispatcher.yaml").is_file() and (work / "dispatch" / "inbox").is_dir()
    assert f"wrote {work / 'config' / 'dispatcher.yaml'}" in out
    assert f"(it comes before {system}, which commands run elsewhere still use)" in out


def test_an_agent_killed_by_a_signal_reads_killed_by_sigterm(env: Env) -> None:
    """An agent ended by SIGTERM reads `killed by SIGTERM` in show and its reason; one stderr line: `the last line`."""
    env.configure({"worker": {"command": ["sh", "-c", "echo oops >&2; kill -TERM $$"], "timeout": 30}})
    env.drop(order("SIG-1"))
    env.cli("run", "--once")
    result = env.result("SIG-1", "failed")
    assert result["reason"].startswith("exit_ok: killed by SIGTERM after ")
    shown = env.cli("show", "SIG-1", check=True).stdout
    assert "killed by SIGTERM" in shown and "exit -15" not in shown
    assert "stderr, the last line:" in shown and "last 1 lines" not in shown


def test_show_json_keeps_the_stderr_tail_as_it_is_and_the_text_escapes_it(env: Env) -> None:
    """`--json` keeps text as it is: ESC and U+202E of an agent's stderr reach it as they were written (JSON's
    own escapes); the text for a person shows both escaped (section 7: no control character reaches a terminal)."""
    script = "import sys; sys.stderr.write('\\x1b[31mred\\x1b[0m \\u202erev\\n'); sys.exit(3)"
    env.configure({"worker": {"command": [sys.executable, "-c", script], "timeout": 30}})
    env.drop(order("ESC-1"))
    env.cli("run", "--once")
    shown = json.loads(env.cli("show", "ESC-1", "--json", check=True).stdout)
    assert shown["attempts"][0]["stderr_tail"] == ["\x1b[31mred\x1b[0m \u202erev"]
    text = env.cli("show", "ESC-1", check=True).stdout
    assert "| \\x1b[31mred\\x1b[0m \\u202erev" in text, text
    assert "\x1b" not in text and "\u202e" not in text


def test_one_hidden_stopped_daemon_is_counted_in_the_singular() -> None:
    """Four stopped daemons (three shown): `(1 older stopped daemon not shown; ...)`."""
    now = time.time()
    daemons = [
        {"owner": f"o{i}", "pid": 100 + i, "host": "h", "alive": False, "started": now - 60 * (i + 1)} for i in range(4)
    ]
    info = {"counts": {"inbox": 0}, "daemons": daemons, "active": [], "spend_24h": {}}
    text = render_status("/r", info, now)
    assert "  (1 older stopped daemon not shown; `dispatcher status --json` lists every one)" in text.splitlines()


def test_the_stopped_owner_of_an_active_job_is_shown_beside_the_three_latest_others() -> None:
    """README: the text names the stopped daemons that own active jobs *and* the three latest others; the owner
    (here the oldest of five) does not take one of those three places."""
    now = time.time()
    daemons = [
        {"owner": f"o{i}", "pid": 100 + i, "host": "h", "alive": False, "started": now - 60 * (i + 1)} for i in range(5)
    ]
    active = [{"job_id": "J-1", "agent": "w", "pid": 104, "host": "h", "age_s": 5.0, "daemon_alive": False}]
    info = {"counts": {"inbox": 0}, "daemons": daemons, "active": active, "spend_24h": {}}
    lines = render_status("/r", info, now).splitlines()
    shown = [int(line.split()[2]) for line in lines if line.startswith("  stopped ")]
    assert shown == [104, 100, 101, 102], lines
    assert "  (1 older stopped daemon not shown; `dispatcher status --json` lists every one)" in lines


def test_the_benchmarks_readme_gives_commands_relative_to_the_checkout() -> None:
    """benchmarks/README.md holds no machine's absolute paths (no /work/, /home/, /root/, /tmp/ in a command)."""
    text = (CHECKOUT / "benchmarks" / "README.md").read_text()
    assert not re.search(r"(^|\s)/(work|home|root)/", text)
    assert ".venv/bin/python benchmarks/bench.py" in text
    assert sys.executable  # the report's own command line is made relative the same way (bench.py)


EMFILE = OSError(errno.EMFILE, "Too many open files")


def clocked_shortage(monkeypatch: pytest.MonkeyPatch) -> tuple[shortage.Shortage, list[float]]:
    """Return a Shortage whose monotonic clock is the returned list's one value (moved by hand)."""
    now = [1000.0]
    monkeypatch.setattr(shortage.time, "monotonic", lambda: now[0])
    return shortage.Shortage(), now


def test_a_shortage_is_logged_once_and_again_after_a_quiet_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    """daemon.short_of: once while a shortage goes on (retries every 2 s at most), again for a later one."""
    short, now = clocked_shortage(monkeypatch)
    emfile = EMFILE
    with capture_logs() as logs:
        for _ in range(10):  # one shortage: a retry every 2 s for 20 s
            assert short.note(emfile, "claim")
            now[0] += 2.0
        short.ok()
        now[0] += shortage.QUIET_S + 1  # the agents ran; a later shortage is another one
        assert short.note(emfile, "claim")
    assert [e["event"] for e in logs] == ["daemon.short_of", "daemon.short_of"]


def test_a_new_shortage_soon_after_an_agent_started_is_logged_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short, over (an agent started), short again 3 s later: two lines; met again on the edge: one."""
    short, now = clocked_shortage(monkeypatch)
    emfile = EMFILE
    with capture_logs() as logs:
        for _ in range(5):  # a shortage met on every retry for 10 s
            assert short.note(emfile, "claim")
            now[0] += 2.0
        short.ok()  # the limit was raised: an agent started
        now[0] += 1.0
        assert short.note(emfile, "claim")  # a second shortage, 3 s after the first was last met
        now[0] += 1.0
        short.ok()
        now[0] += 0.5
        assert short.note(emfile, "claim")  # on the edge: met again 1.5 s later, the same shortage
    assert [e["event"] for e in logs] == ["daemon.short_of", "daemon.short_of"]


def test_a_root_folder_on_another_filesystem_is_refused_at_start_in_one_line(env: Env) -> None:
    """done/ linked to another filesystem: `run` exits 2 naming it, before any order is claimed."""
    here = os.stat(env.tmp).st_dev
    other = next(p for p in ("/dev/shm", "/var/tmp", "/tmp", "/run") if os.path.isdir(p) and os.stat(p).st_dev != here)
    away = Path(tempfile.mkdtemp(prefix="dispatcher-done-", dir=other))
    try:
        env.root.mkdir(parents=True, exist_ok=True)
        (env.root / "done").symlink_to(away)
        env.drop(order("FS-1"))
        proc = env.cli("run", "--once", timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = proc.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in proc.stdout + proc.stderr
        assert line.endswith("on another filesystem than the root " + str(env.root) + "; a dispatch root must be"
                             " on one filesystem (jobs move between its folders by rename)"), line  # fmt: skip
        assert str(env.root / "done") in line
        assert (env.root / "inbox" / "FS-1.json").exists() and not list((env.root / "active").iterdir())
    finally:
        shutil.rmtree(away, ignore_errors=True)


def test_a_root_folder_bind_mounted_from_the_same_disk_is_refused_at_start_in_one_line(env: Env) -> None:
    """done/ bind-mounted from another folder of the same disk (the same device, a mount of its own): a rename
    across it fails (EXDEV), so `run` exits 2 naming it, as for another disk. It started, and the finished job
    stayed in active/ with job.stuck, `run --once` exiting 0."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) (util-linux), as bash .ci/run has them")
    away = env.tmp / "away"
    away.mkdir()
    env.root.mkdir(parents=True, exist_ok=True)
    (env.root / "done").mkdir()
    env.drop(order("BIND-DONE-1"))
    script = 'mount --bind "$0" "$1" && exec "$2" -m dispatcher --config "$3" run --once'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(away), str(env.root / "done")]
    proc = subprocess.run(
        [*argv, sys.executable, str(env.config_path)], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert line.startswith(f"{env.root / 'done'}: on another filesystem than the root {env.root}"), line
    assert (env.root / "inbox" / "BIND-DONE-1.json").exists() and not list((env.root / "active").iterdir())


def test_a_root_mounted_over_a_folder_that_held_a_mount_is_one_filesystem(env: Env) -> None:
    """The README's advice, the root itself mounted, over a root whose done/ held a bind mount before: that mount is
    hidden under the root's, every folder is on the root's mount, and `run` starts and lands the job (it refused
    the root, naming done/)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) (util-linux), as bash .ci/run has them")
    x, y = env.tmp / "x", env.tmp / "y"
    x.mkdir()
    (y / "done").mkdir(parents=True)
    (env.root / "done").mkdir(parents=True)
    (y / "inbox").mkdir()
    (y / "inbox" / "HIDDEN-1.json").write_text(json.dumps(order("HIDDEN-1")))
    script = 'mount --bind "$0" "$1/done" && mount --bind "$2" "$1" && exec "$3" -m dispatcher --config "$4" run --once'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(x), str(env.root), str(y)]
    proc = subprocess.run(
        [*argv, sys.executable, str(env.config_path)], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((y / "done" / "HIDDEN-1" / "result.json").read_text())["state"] == "done"


def test_the_mount_point_of_a_path_is_the_longest_that_holds_it() -> None:
    """A bind mount has its own line (and point) with the device of the disk it came from."""
    from dispatcher.storage import mount_point_of

    info = "\n".join(
        [
            "22 1 252:1 / / rw - ext4 /dev/vda1 rw",
            "40 22 252:1 /srv/away /data/dispatch/done rw - ext4 /dev/vda1 rw",
            "41 22 0:41 / /data/dispatch/do rw - tmpfs none rw",
        ]
    )
    assert mount_point_of("/data/dispatch", info) == "/"
    assert mount_point_of("/data/dispatch/done", info) == "/data/dispatch/done"
    assert mount_point_of("/data/dispatch/done/JOB-1", info) == "/data/dispatch/done"
    assert mount_point_of("/data/dispatch/doneX", info) == "/"  # a prefix of the text, not of the path
    # the root mounted later over a folder that held a mount of its own: that one is hidden under it
    hidden = info + "\n42 22 252:1 /srv/y /data/dispatch rw - ext4 /dev/vda1 rw"
    assert mount_point_of("/data/dispatch/done/JOB-1", hidden) == "/data/dispatch"
    assert mount_point_of("/data/dispatch", hidden) == "/data/dispatch"
    # a mount made under it after that is seen again; / listed late (a container's) is only ever the base
    again = hidden + "\n43 42 0:50 / /data/dispatch/done rw - tmpfs none rw\n44 1 252:1 / / rw - ext4 /dev/vda1 rw"
    assert mount_point_of("/data/dispatch/done/JOB-1", again) == "/data/dispatch/done"
    assert mount_point_of("/srv", again) == "/"


def test_a_relayed_log_line_is_taken_once(tmp_path: Path) -> None:
    """A command's relayed line is handed over once: a daemon pass that fails after taking it does not repeat it."""
    from dispatcher.layout import Layout
    from dispatcher.store.relay import Relay, take_relayed

    layout = Layout(tmp_path / "root")
    layout.create()
    Relay(layout).send('{"event": "job.approved", "job_id": "R1"}')
    Relay(layout).send('{"event": "job.held", "job_id": "R2"}')
    hints = os.listdir(layout.control)
    assert take_relayed(layout, hints) == [
        '{"event": "job.approved", "job_id": "R1"}',
        '{"event": "job.held", "job_id": "R2"}',
    ]
    assert take_relayed(layout, hints) == [], "the same lines were handed over twice"
    assert os.listdir(layout.control) == []


@pytest.mark.parametrize(
    "when",
    [0.0, 1e-7, 0.5, 0.9999994, 0.9999995, 0.9999996, 1764800000.0, 1764800000.123, 1764800000.9999996,
     1764800001.0004, 1764800001.9994999, 4102444799.999],
)  # fmt: skip
def test_result_times_are_strftimes_text_whether_or_not_their_second_was_seen_before(when: float) -> None:
    """`iso` (result.json's times) gives datetime's text for a time, alone and after a time in the same second."""
    from datetime import UTC, datetime

    from dispatcher.clock import iso

    def want(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(t * 1000) % 1000:03d}Z"

    assert iso(when) == want(when)
    earlier = float(int(when)) + 0.25
    assert iso(earlier) == want(earlier)
    assert iso(when) == want(when)  # the second's text cached by the time before it


def test_a_relayed_log_file_is_passed_on_by_one_daemon_only(tmp_path: Path) -> None:
    """Two daemons woken by one hint: the one that holds the relay file passes its lines on; the other, finding it
    held (or gone), writes nothing, so a command's `job.approved` is one line and counted once (sections 8, 10)."""
    import fcntl

    from dispatcher.layout import Layout
    from dispatcher.store.relay import pass_on

    layout = Layout(tmp_path / "dispatch")
    layout.control.mkdir(parents=True)
    name = "log-0001-approve"
    (layout.control / name).write_text('{"event": "job.approved"}\n')
    held = os.open(layout.control / name, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first daemon at work on it
        other: list[str] = []
        assert pass_on(layout, [name], other.append) == [] and other == []
    finally:
        os.close(held)
    first: list[str] = []
    assert pass_on(layout, [name], first.append) == ['{"event": "job.approved"}'] == first
    assert not (layout.control / name).exists()
    assert pass_on(layout, [name], first.append) == []  # gone: nothing twice


def test_a_refused_orders_agent_is_the_same_in_its_result_list_show_and_log(env: Env) -> None:
    """A refused order naming a configured agent: its result.json, `list` (and `list --agent`), `show --json` and the
    job.refused line all name that agent (section 7: list gives id, state, agent ...); one naming no configured
    agent names none anywhere."""
    env.configure()
    bad = order("REF-AGENT-1")
    del bad["task"]
    env.drop(bad)
    stray = order("REF-AGENT-2", to="nobody-here")
    env.drop(stray)
    inbox = env.root / "inbox"  # refused for the file as a whole, its job_id and to read all the same:
    (inbox / "anchor.yaml").write_text("job_id: REF-AGENT-3\nfrom: &a me\nto: worker\ntask: t\nitems: [{id: A}]\n")
    (inbox / "twice.json").write_text('{"job_id": "REF-AGENT-4", "to": "worker", "to": "worker", "task": "t"}')
    (inbox / os.fsdecode(b"n\xe9u.json")).write_text(json.dumps(order("REF-AGENT-5")))
    assert env.cli("run", "--once").returncode == 1
    refused = {json.loads((p / "result.json").read_text())["job_id"]: p for p in env.refusals()}
    for job_id in ("REF-AGENT-1", "REF-AGENT-3", "REF-AGENT-4", "REF-AGENT-5"):
        assert json.loads((refused[job_id] / "result.json").read_text())["agent"] == "worker", job_id
    assert json.loads((refused["REF-AGENT-2"] / "result.json").read_text())["agent"] is None
    rows = [json.loads(line) for line in env.cli("list", "--agent", "worker", "--json", check=True).stdout.splitlines()]
    assert sorted((r["job_id"], r["state"], r["agent"]) for r in rows) == [
        (f"REF-AGENT-{n}", "refused", "worker") for n in (1, 3, 4, 5)
    ]
    shown = json.loads(env.cli("show", "REF-AGENT-1", "--json", check=True).stdout)
    assert shown["agent"] == "worker"


def test_check_details_of_a_one_item_order_are_in_the_singular(env: Env) -> None:
    """An order of one item: the checks' details say `1 input id matches the order`, `1 record, one per item`, as
    `show` prints them (README, the receipt and the checks: `5 input ids match the order`, ...)."""
    env.configure()
    env.drop(order("ONE-ITEM", items=[{"id": "R1"}], accept={"output": "out.csv", "required": ["id"]}))
    assert env.cli("run", "--once").returncode == 0
    details = {c["name"]: c["detail"] for c in env.result("ONE-ITEM", "done")["checks"]}
    assert details["receipt_inputs"] == "1 input id matches the order"
    assert details["output_rows"] == "1 record, one per item"
    assert details["receipt_outputs"] == "1 output id matches out.csv"
    assert details["allowed_values"] == "1 record uses allowed values"


def test_status_lists_daemons_by_host_the_running_first_on_each() -> None:
    """Section 12: `status` lists daemons by host. Daemons of two hosts started in turn are shown host by host (the
    running ones of a host before its stopped ones), not in the order they started."""
    now = time.time()
    hosts = ["vm", "hostC", "vm", "hostC", "vm"]
    daemons = [
        {"owner": f"o{i}", "pid": 100 + i, "host": h, "alive": i != 2, "started": now - 10 * i}
        for i, h in enumerate(hosts)
    ]
    info = {"counts": {"inbox": 0}, "daemons": daemons, "active": [], "spend_24h": {}}
    lines = [line.split() for line in render_status("/r", info, now).splitlines() if line.startswith("  ")]
    assert [(w[0], w[4], int(w[2])) for w in lines] == [
        ("running", "hostC", 101),
        ("running", "hostC", 103),
        ("running", "vm", 100),
        ("running", "vm", 104),
        ("stopped", "vm", 102),
    ], lines


def test_list_cuts_a_refused_files_overlong_id_text_and_keeps_the_other_lines_narrow() -> None:
    """A refused file whose job_id is 100,000 characters (no valid id is longer than 128): `list` cuts that text to
    128 columns ending in `...`, so the id column is at most 128 wide; every line, the header's too, was 100 KB."""
    from dispatcher.cli.render import render_list

    rows = [
        {"job_id": "G1", "state": "done", "agent": "w", "age_s": 5.0, "cost_usd": None, "reason": None},
        {"job_id": "x" * 100_000, "state": "refused", "agent": None, "age_s": 6.0, "cost_usd": None,
         "reason": "job_id: must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
    ]  # fmt: skip
    lines = list(render_list(rows))
    assert max(len(line) for line in lines) < 300, [len(line) for line in lines]
    assert lines[2].startswith("x" * 125 + "...  refused"), lines[2][:140]
    assert lines[1].startswith("G1" + " " * 126 + "  done"), lines[1]
    valid = "A" * 128
    lines = list(render_list([{**rows[0], "job_id": valid}]))
    assert lines[1].startswith(valid + "  done"), "a valid id is never cut"
