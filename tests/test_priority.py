"""Time and priority (contract section 16): `priority`, `not_before` (`submit --at/--in`) and `expires`.

Real daemons and folders: the claim order is read from the daemon's `job.claimed`
log lines, due times from `list` and from each job's `received` time.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime

import pytest
import yaml
from conftest import Env, order, wait_until


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claimed(d: object) -> list[str]:
    return [e["job_id"] for e in d.events() if e.get("event") == "job.claimed"]  # type: ignore[attr-defined]


def test_priorities_under_a_backlog_of_1000(env: Env) -> None:
    """1,000 queued orders: the 10 newest with priority 9 are claimed first, then the oldest of priority 5."""
    env.configure({"worker": env.agent("--sleep", "0.2", concurrency=2)}, max_jobs=2)
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    base = time.time() - 5000
    for i in range(1000):
        if i >= 990:  # the newest, in YAML: their priority is read from the YAML text
            body, name = order(f"hi{i}", priority=9), f"hi{i}.yaml"
            (inbox / name).write_text(yaml.safe_dump(body))
        else:
            body, name = order(f"b{i:03d}", priority=1 if i % 2 else 5), f"b{i:03d}.json"
            (inbox / name).write_text(json.dumps(body))
        os.utime(inbox / name, (base + i, base + i))
    d = env.daemon()
    wait_until(lambda: len(claimed(d)) >= 20, 120, "20 claims")
    assert d.stop() == 0
    first = claimed(d)[:20]
    assert sorted(first[:10]) == [f"hi{i}" for i in range(990, 1000)]
    assert first[10:20] == [f"b{i:03d}" for i in range(0, 20, 2)]  # priority 5, oldest first; priority 1 after


def test_the_last_microsecond_of_the_year_9999_is_refused_too(env: Env) -> None:
    """9999-12-31T23:59:59.999999Z rounds to the year 10000 as a time: refused in one line like a later one, and a
    file dropped by hand with it leaves `list` working (it exited 1 with a traceback)."""
    last = "9999-12-31T23:59:59.999999Z"
    path = env.tmp / "last.json"
    path.write_text(json.dumps(order("last", not_before=last)))
    for command in ("validate", "submit"):
        proc = env.cli(command, str(path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert f"not_before: {last} is later than 9999-12-31T23:59:59Z" in proc.stderr
    plain = env.tmp / "plain.json"
    plain.write_text(json.dumps(order("plain")))
    proc = env.cli("submit", "--at", "9999-12-31T23:59:59.9999999Z", str(plain))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    env.drop(order("by-hand", not_before=last))
    for flags in ((), ("--json",)):
        listed = env.cli("list", *flags)
        assert listed.returncode == 0 and "by-hand" in listed.stdout, listed.stderr


def test_a_time_before_the_year_1_in_utc_is_refused_in_one_line_and_the_year_1_is_written_with_four_digits(
    env: Env,
) -> None:
    """`submit --at 0001-01-01T00:00:00+00:01` (the year 0 in UTC) exits 2 with one line, as a time after 9999 does;
    it exited 1 with a traceback. `--at 0001-01-01T00:00:00Z` is a valid time: the order gets `not_before:
    0001-01-01T00:00:00.000Z` (it was refused, its year written as "1"). A dropped file with the year 0 time is refused
    with the same words."""
    plain = env.tmp / "plain.json"
    plain.write_text(json.dumps(order("plain")))
    for at in ("0001-01-01T00:00:00+00:01", "00010101T000000+0001"):
        proc = env.cli("submit", "--at", at, str(plain))
        assert (proc.returncode, proc.stderr) == (2, f"submit: --at: '{at}' is earlier than 0001-01-01T00:00:00Z\n")
    proc = env.cli("submit", "--at", "0001-01-01T00:00:00Z", str(plain))
    assert proc.returncode == 0, proc.stderr
    [dropped] = (env.root / "inbox").iterdir()
    assert json.loads(dropped.read_text())["not_before"] == "0001-01-01T00:00:00.000Z"
    early = env.tmp / "early.json"
    early.write_text(json.dumps(order("early", expires="0001-01-01T00:00:00+01:00")))
    proc = env.cli("validate", str(early))
    assert proc.returncode == 2
    assert proc.stderr == f"{early}: expires: 0001-01-01T00:00:00+01:00 is earlier than 0001-01-01T00:00:00Z\n"


def test_not_before_waits_unclaimed_across_a_restart(env: Env) -> None:
    """An order not due yet stays in inbox/ (list says when it is due), across a restart, and runs once due."""
    d = env.daemon()
    d.wait_ready()
    due = time.time() + 4
    env.drop(order("later", not_before=iso(due)))
    env.drop(order("now"))
    env.wait_job("now", "done")
    listed = [
        json.loads(line) for line in env.cli("list", "--state", "inbox", "--json", check=True).stdout.splitlines()
    ]
    assert [(r["job_id"], r["reason"]) for r in listed] == [("later", f"due {iso(due)[:23]}Z")]
    assert d.stop() == 0
    assert (env.root / "inbox" / "later.json").exists()
    again = env.daemon()
    result = env.wait_job("later", "done")
    received = datetime.fromisoformat(result["received"].replace("Z", "+00:00")).timestamp()
    assert received >= due - 0.01
    assert again.stop() == 0


def test_submit_in_and_at_set_not_before(env: Env) -> None:
    """`submit --in 1h` drops the order as JSON with not_before an hour ahead; a bad --at exits 2."""
    path = env.tmp / "o.yaml"
    path.write_text(yaml.safe_dump(order("sub-in")))
    before = time.time()
    assert env.cli("submit", "--in", "1h", str(path), check=True).stdout == "sub-in\n"
    body = json.loads((env.root / "inbox" / "sub-in.json").read_text())
    due = datetime.fromisoformat(body["not_before"].replace("Z", "+00:00")).timestamp()
    assert before + 3600 - 1 <= due <= time.time() + 3600 + 1
    bad = env.cli("submit", "--at", "tomorrow", str(path))
    assert bad.returncode == 2 and "--at" in bad.stderr and bad.stderr.count("\n") == 1
    negative = env.cli("submit", "--in", "-1h", str(path))  # a dash first: a value, not an option
    assert negative.returncode == 2 and negative.stderr.count("\n") == 1
    assert "--in: '-1h' is not a duration" in negative.stderr


def test_submit_at_takes_the_time_forms_an_order_takes_and_no_other(env: Env) -> None:
    """`--at` and an order's not_before agree: calendar dates (extended or basic) pass both; a week date or an
    ordinal date, which the order refuses, is refused by `--at` too (exit 2), and nothing is dropped."""
    path = env.tmp / "o.yaml"
    for n, (when, ok) in enumerate(
        [("2099-01-05T08:00Z", True), ("20990105T0800Z", True), ("2099-W02-1", False), ("2099-005", False)]
    ):
        body = order(f"at-{n}", not_before=when)
        path.write_text(yaml.safe_dump(body))
        assert (env.cli("validate", str(path)).returncode == 0) is ok, when
        del body["not_before"]
        path.write_text(yaml.safe_dump(body))
        proc = env.cli("submit", "--at", when, str(path))
        assert (proc.returncode == 0) is ok, (when, proc.stderr)
        assert (env.root / "inbox" / f"at-{n}.json").exists() is ok
        if not ok:
            assert proc.returncode == 2 and "--at" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_time_beyond_the_year_9999_in_utc_is_refused_in_one_line(env: Env) -> None:
    """9999-12-31T23:59:59-12:00 is in the year 10000 in UTC: `validate` and `submit` refuse it (exit 2, one line
    naming the field), as do `submit --at` with it and `--in` that far ahead; a file dropped by hand with it
    leaves `list` working, and the daemon refuses it."""
    far = "9999-12-31T23:59:59-12:00"
    path = env.tmp / "far.json"
    path.write_text(json.dumps(order("far", not_before=far)))
    for command in ("validate", "submit"):
        proc = env.cli(command, str(path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert "not_before: 9999-12-31T23:59:59-12:00 is later than 9999-12-31T23:59:59Z" in proc.stderr
    plain = env.tmp / "plain.json"
    plain.write_text(json.dumps(order("plain")))
    for flags in (("--at", far), ("--in", "99999999999d")):
        proc = env.cli("submit", *flags, str(plain))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (flags, proc.stderr)
        assert "later than 9999-12-31T23:59:59Z" in proc.stderr and "Traceback" not in proc.stderr
    env.drop(order("by-hand", not_before=far))
    listed = env.cli("list", "--state", "inbox")
    assert listed.returncode == 0 and "by-hand" in listed.stdout, listed.stderr
    env.cli("run", "--once", timeout=60)
    assert "later than 9999-12-31T23:59:59Z" in env.wait_refused("by-hand")["reason"]


def test_an_order_not_started_by_expires_is_refused_as_expired(env: Env) -> None:
    """An order whose expires has passed is refused with reason `expired`; one due after it expired is too."""
    d = env.daemon()
    d.wait_ready()
    env.drop(order("stale", expires=iso(time.time() - 1)))
    env.drop(order("too-late", not_before=iso(time.time() + 1), expires=iso(time.time() + 0.5)))
    assert env.wait_refused("stale")["reason"] == "expired"
    assert env.wait_refused("too-late")["reason"] == "expired"
    assert [j for j, _ in env.starts()] == []
    assert d.stop() == 0


def test_an_order_that_expires_before_it_is_due_is_refused_at_its_expires(env: Env) -> None:
    """`expires` before `not_before`: refused as `expired` when its expires comes (section 16: not started by then),
    not 30 s later when it would have been due."""
    d = env.daemon()
    d.wait_ready()
    t0 = time.time()
    env.drop(order("early-end", not_before=iso(t0 + 30), expires=iso(t0 + 2)))
    refused = env.wait_refused("early-end", timeout=20)
    assert refused["reason"] == "expired"
    assert time.time() - t0 < 15, "refused only when it was due"
    stamp = next(p.name for p in (env.root / "failed").iterdir() if p.name.startswith("early-end@"))
    at = datetime.strptime(stamp.split("@")[1][:15], "%Y%m%dT%H%M%S").replace(tzinfo=UTC).timestamp()
    assert t0 + 1 <= at <= t0 + 15, (stamp, t0)
    assert [j for j, _ in env.starts()] == []
    assert d.stop() == 0


def test_unquoted_yaml_times_and_the_basic_format_are_iso_8601_times(env: Env) -> None:
    """`not_before:` and `expires:` written unquoted in YAML (the README's way) or in basic format are times.

    The order keeps each as the text given; an unquoted date in any other field is still refused.
    """
    soon = datetime.fromtimestamp(time.time() + 2, UTC).replace(microsecond=0)
    head = "from: tester\nto: worker\ntask: Copy the rows.\nitems:\n  - id: R1\n"
    env.drop(f"job_id: plain\n{head}not_before: {soon:%Y-%m-%dT%H:%M:%S}Z\nexpires: 2999-01-01\n", name="plain.yaml")
    env.drop(f"job_id: basic\n{head}not_before: '{soon:%Y%m%dT%H%M%S}Z'\n", name="basic.yaml")
    env.drop(f"job_id: gone\n{head}expires: 2001-01-01 00:00:00\n", name="gone.yaml")
    env.drop(f"job_id: dated\n{head}meta:\n  day: 2026-12-01\n", name="dated.yaml")
    d = env.daemon()
    for job_id in ("plain", "basic"):
        result = env.wait_job(job_id, "done")
        received = datetime.fromisoformat(result["received"].replace("Z", "+00:00"))
        assert received.timestamp() >= soon.timestamp() - 0.01, job_id
    assert env.wait_refused("gone")["reason"] == "expired"
    assert env.wait_refused("dated")["reason"] == "meta.day: a date value is not allowed (quote it to make it a string)"
    assert d.stop() == 0
    body = json.loads((env.job_dir("plain", "done") / "work" / "order.json").read_text())
    assert (body["not_before"], body["expires"]) == (f"{soon:%Y-%m-%dT%H:%M:%S}Z", "2999-01-01")


def test_an_unquoted_basic_format_date_in_yaml_is_a_time(env: Env) -> None:
    """README: the basic format works "quoted or not" in YAML. `expires: 29990101` (read by YAML as a number) is a
    date; `not_before: 20010101` lets the order run at once; the order keeps each as the text given."""
    head = "from: tester\nto: worker\ntask: Copy the rows.\nitems:\n  - id: R1\n"
    env.drop(f"job_id: digits\n{head}not_before: 20010101\nexpires: 29990101\n", name="digits.yaml")
    assert env.cli("run", "--once", timeout=60).returncode == 0
    body = json.loads((env.job_dir("digits", "done") / "work" / "order.json").read_text())
    assert (body["not_before"], body["expires"]) == ("20010101", "29990101")


def test_a_follow_up_with_an_unquoted_basic_date_is_released_and_listed_as_due(env: Env) -> None:
    """The basic format works "quoted or not" in a follow-up's YAML too: `not_before: 29990101` in outbox/ is a time.
    The follow-up is released into inbox/ (not lost), and `list` shows when it is due, as for a quoted date."""
    follow = "job_id: FU2\nfrom: fu\nto: worker\ntask: Later.\nitems: [{id: R1}]\nnot_before: 29990101\n"
    env.configure({"worker": env.agent(), "fu": env.agent("--outbox-file", f"FU2.yaml={follow}")})
    env.drop(order("FU1", to="fu"))
    once = env.cli("run", "--once", timeout=60)
    assert once.returncode == 0, once.stderr
    assert '"followup.lost"' not in once.stdout
    assert env.result("FU1", "done")["children"] == ["FU2"]
    released = json.loads((env.root / "inbox" / "FU2.json").read_text())
    assert (released["not_before"], released["parent"]) == ("29990101", "FU1")
    lines = env.cli("list", "--json", check=True).stdout.splitlines()  # JSON lines
    listed = {row["job_id"]: row for row in map(json.loads, lines)}
    assert "2999-01-01" in json.dumps(listed["FU2"]), listed["FU2"]
    assert "due 2999-01-01" in env.cli("list", check=True).stdout


def test_cancel_of_an_order_not_due_yet_takes_effect_at_once(env: Env) -> None:
    """`cancel` of an order held back by not_before fails it (cancelled) within seconds, not at its due time."""
    d = env.daemon()
    d.wait_ready()
    env.drop(order("far", not_before=iso(time.time() + 3600)))
    wait_until(lambda: "far" in env.cli("list", "--state", "inbox").stdout, what="far listed")
    assert env.cli("cancel", "far").returncode == 0
    assert env.wait_job("far", "failed", timeout=15)["reason"] == "cancelled"
    assert d.stop() == 0


def test_priority_and_after_are_read_from_yaml_in_any_style(env: Env) -> None:
    """YAML saved with CRLF line ends, as a flow mapping, or with quoted keys: its priority orders the claims as in
    plain block style (section 16), and its `after` is seen before the file is read for real."""
    env.configure({"worker": env.agent(concurrency=1)}, max_jobs=1)
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    base = time.time() - 500
    items = "[{id: R1}]"
    files = {
        "LF5.yaml": (f"job_id: LF5\nfrom: t\nto: worker\ntask: t\nitems: {items}\n", 0),
        "CRLF9.yaml": (f"job_id: CRLF9\r\nfrom: t\r\nto: worker\r\ntask: t\r\nitems: {items}\r\npriority: 9\r\n", 1),
        "FLOW9.yaml": (f"{{job_id: FLOW9, from: t, to: worker, task: t, items: {items}, priority: 9}}\n", 2),
        "QK9.yaml": (f'"job_id": QK9\n"from": t\n"to": worker\n"task": t\n"items": {items}\n"priority": 9\n', 3),
        "J9.yaml": (f"job_id: J9\nfrom: t\nto: worker\ntask: t\nitems: {items}\npriority: 9\n", 4),
    }
    for name, (text, age) in files.items():
        (inbox / name).write_bytes(text.encode())
        os.utime(inbox / name, (base + age, base + age))
    once = env.cli("run", "--once")
    assert once.returncode == 0, once.stderr
    started = [json.loads(line)["job_id"] for line in once.stdout.splitlines() if '"agent.started"' in line]
    assert started == ["CRLF9", "FLOW9", "QK9", "J9", "LF5"]


def test_a_flow_style_yaml_order_naming_after_is_claimed_at_once_into_waiting(env: Env) -> None:
    """A flow-style YAML order with `after`, dropped while the only slot is busy: claimed at once into waiting/
    (section 16), as the same order in block style is; it runs once its parent is done."""
    # BUSY runs 8 s: FJ's claim, at once, comes well within it even on a loaded machine
    env.configure({"worker": env.agent("--sleep", "8", concurrency=1)}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BUSY"))
    wait_until(lambda: (env.root / "active" / "BUSY").is_dir(), 30, "BUSY running")
    flow = "{job_id: FJ, from: t, to: worker, task: t, items: [{id: R1}], after: [BUSY]}\n"
    env.drop(flow, name="FJ.yaml")
    wait_until(lambda: (env.root / "waiting" / "FJ").is_dir(), 5, "FJ in waiting/ while BUSY runs")
    assert (env.root / "active" / "BUSY").is_dir()
    env.wait_job("FJ", "done")
    assert d.stop() == 0


def test_an_order_read_ahead_for_its_busy_agent_does_not_pass_a_higher_priority_one_of_that_agent(env: Env) -> None:
    """LOW-D is read while a slot is free and waits for its agent's; HIGH-D (priority 9) for the same agent comes
    once every slot is taken. When the agent's slot frees, HIGH-D starts first (section 16: higher priority
    first); the order read ahead took it, and HIGH-D was not even read until LOW-D had run."""
    env.configure(
        max_jobs=2,
        agents={"a": env.agent("--sleep", "5", concurrency=1), "d": env.agent("--sleep", "6", concurrency=1)},
    )  # BLOCK-D's 6 s leave room for three drops and their lines under load before its slot frees
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BLOCK-D", to="d"))
    d.wait_event("agent.started", job_id="BLOCK-D")
    env.drop(order("LOW-D", to="d", priority=0))
    d.wait_event("order.received", job_id="LOW-D")
    env.drop(order("BLOCK-A", to="a"))
    d.wait_event("agent.started", job_id="BLOCK-A")
    env.drop(order("HIGH-D", to="d", priority=9))
    env.wait_job("HIGH-D", "done", timeout=60)
    env.wait_job("LOW-D", "done", timeout=60)
    ids = [j for j, _ in env.starts()]
    assert ids.index("HIGH-D") < ids.index("LOW-D"), ids
    assert d.stop() == 0


def test_a_busy_agents_backlog_past_the_read_ahead_limit_does_not_hold_up_an_idle_agent(env: Env) -> None:
    """70 orders queued for an agent busy with a long job (more than the daemon reads ahead for busy agents, 64):
    an order for another, idle agent still starts at once, its agent's slot and max_jobs being free. It waited
    until the busy agent's job ended, however high its priority."""
    env.configure(max_jobs=3, agents={"d": env.agent("--sleep", "30", concurrency=1), "a": env.agent(concurrency=1)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BLOCK", to="d"))
    d.wait_event("agent.started", job_id="BLOCK")
    for i in range(70):
        env.drop(order(f"LOW{i:02d}", to="d"))
    wait_until(lambda: len([e for e in d.events() if e.get("event") == "order.received"]) >= 65, 30, "read ahead")
    dropped = time.monotonic()
    env.drop(order("AJOB", to="a"))
    env.wait_job("AJOB", "done", timeout=25)
    assert time.monotonic() - dropped < 20, "AJOB waited for the busy agent's job"  # BLOCK sleeps 30 s
    assert [j for j, _ in env.starts()] == ["BLOCK", "AJOB"]
    assert d.stop() == 0


def test_a_higher_priority_order_of_an_agent_read_past_starts_at_its_next_free_slot(env: Env) -> None:
    """70 priority-1 orders wait for one busy agent (more than the daemon reads ahead, so its further orders are
    left unread); a priority-9 order for the same agent then starts at that agent's next free slot, before every
    older priority-1 order read ahead (section 16: higher priority first). It waited behind 64 of them."""
    env.configure(max_jobs=3, agents={"d": env.agent("--sleep", "3", concurrency=1), "a": env.agent(concurrency=1)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BLOCK", to="d"))
    d.wait_event("agent.started", job_id="BLOCK")
    for i in range(70):
        env.drop(order(f"LOW{i:02d}", to="d", priority=1))
    wait_until(lambda: len([e for e in d.events() if e.get("event") == "order.received"]) >= 65, 30, "read ahead")
    env.drop(order("HIGH", to="d", priority=9))
    wait_until(lambda: len(env.starts()) >= 2, 30, "the next start")
    assert [j for j, _ in env.starts()][:2] == ["BLOCK", "HIGH"]
    assert d.stop() == 0


def test_a_higher_priority_order_passes_a_backlog_being_worked_off(env: Env) -> None:
    """The same while the backlog drains after a resume: the priority-9 order starts next but one (the next
    may already be on its way), not after the 48 or so read ahead."""
    env.configure(max_jobs=2, agents={"d": env.agent("--sleep", "0.6", concurrency=1)})
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "d", check=True)  # so that all 70 orders are in inbox/ before d runs
    for i in range(70):
        env.drop(order(f"LOW{i:02d}", to="d", priority=1))
    time.sleep(1)
    env.cli("resume", "d", check=True)
    wait_until(lambda: len(env.starts()) >= 3, 60, "3 starts")
    env.drop(order("HIGH", to="d", priority=9))
    dropped_at = len(env.starts())
    env.wait_job("HIGH", "done", timeout=120)
    ids = [j for j, _ in env.starts()]
    assert d.stop() == 0
    assert ids.index("HIGH") <= dropped_at + 1, ids


@pytest.mark.parametrize("max_jobs", [1, 2])
def test_at_start_a_newer_order_still_settling_goes_before_an_older_one_of_lower_priority(
    env: Env, max_jobs: int
) -> None:
    """LOW-S (priority 1) has sat in inbox/ for a minute; HIGH-S (priority 9) was submitted just before the start, so
    the start's scan lets it settle first (section 1). It is still claimed and run first (section 16: higher priority
    first, then older): the older order waits for it rather than take the one slot before it is read - the one of
    max_jobs 1, or with max_jobs 2 the one of its agent (concurrency 1, the default)."""
    env.configure({"worker": env.agent(concurrency=1)}, max_jobs=max_jobs, settle=2)
    low = env.drop(order("LOW-S", priority=1))
    os.utime(low, (time.time() - 60, time.time() - 60))
    env.drop(order("HIGH-S", priority=9))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = [j for j, _ in env.starts()]
    assert ids == ["HIGH-S", "LOW-S"], ids
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["job_id"] for e in events if e.get("event") == "job.claimed"] == ["HIGH-S", "LOW-S"]


def test_at_start_a_settling_order_holds_back_no_other_while_slots_are_free(env: Env) -> None:
    """With slots free for both, the older priority-1 order is not made to wait for the newer priority-9 one still
    settling: it starts at once and so is not refused at its `expires` (2 s later, inside the settle of 4 s); a
    settling file that is no order (notes.txt) holds nothing back either."""
    env.configure({"b": env.agent(concurrency=2), "c": env.agent(concurrency=2)}, max_jobs=4, settle=4)
    exp = env.drop(order("EXP-1", to="b", priority=1, expires=iso(time.time() + 2.5)))
    os.utime(exp, (time.time() - 60, time.time() - 60))
    env.drop(order("HI-1", to="c", priority=9))
    (env.root / "inbox" / "notes.txt").write_text("not an order\n")
    proc = env.cli("run", "--once", timeout=60)
    assert env.result("EXP-1", "done")["state"] == "done", proc.stdout[-2000:]
    assert env.result("HI-1", "done")["state"] == "done"
    assert proc.returncode == 1  # notes.txt is refused as "not a work order"


def test_at_start_a_paused_agents_settling_order_holds_back_no_other_agents_order(env: Env) -> None:
    """Agent a is paused: its older D8 waits unread and its D9, still settling at the start, can run no sooner. So
    neither holds back agent b's older D1 of priority 1 (section 14: the daemon reads past a gated agent's orders):
    D1 starts at once, not after D9's settle."""
    env.configure({"a": env.agent(concurrency=1), "b": env.agent(concurrency=1)}, max_jobs=2, settle=4)
    env.cli("pause", "a", check=True)
    old = time.time() - 120
    for job_id, to, priority in (("D1", "b", 1), ("D8", "a", 8)):
        os.utime(env.drop(order(job_id, to=to, priority=priority)), (old, old))
    env.drop(order("D9", to="a", priority=9))
    d = env.daemon()
    started = d.wait_event("daemon.ready")
    ran = d.wait_event("agent.started", job_id="D1", timeout=60)
    ready_at = datetime.fromisoformat(started["timestamp"].replace("Z", "+00:00"))
    ran_at = datetime.fromisoformat(ran["timestamp"].replace("Z", "+00:00"))
    assert (ran_at - ready_at).total_seconds() < 2.5, (started, ran)  # the settle is 4 s
    assert not (env.root / "active" / "D8").exists() and not (env.root / "active" / "D9").exists()
    assert d.stop() == 0


@pytest.mark.parametrize("field", ["not_before", "expires"])
def test_every_unreadable_time_gets_the_iso_8601_message(env: Env, field: str) -> None:
    """`not_before`/`expires` of "garbage", "x", "2026", "12:00", "" or "tomorrow": each refused by validate (exit 2)
    with one line `FILE: FIELD: must be an ISO 8601 time such as ...`; the short ones said `is too short`."""
    env.configure(agents={"worker": env.agent()})
    for value in ("garbage", "x", "2026", "12:00", "", "tomorrow"):
        path = env.tmp / "t.json"
        path.write_text(json.dumps(order("T-1", **{field: value})))
        proc = env.cli("validate", str(path))
        assert proc.returncode == 2, (value, proc.stderr)
        assert proc.stderr == f"{path}: {field}: must be an ISO 8601 time such as 2026-12-01T08:00:00Z\n", value


def test_an_order_whose_quoted_task_runs_over_a_not_before_line_is_claimed_at_once(env: Env) -> None:
    """A YAML order with no not_before, whose double-quoted task continues on a line that starts `not_before: 2030`:
    `run --once` runs it now (before, the daemon's glance put it off until 2030, unread, while `list` showed a plain
    queued job)."""
    env.configure()
    text = 'job_id: G1\nfrom: me\nto: worker\ntask: "run\nnot_before: 2030-01-01T00:00:00Z"\nitems: [{id: a}]\n'
    env.drop(text, name="g1.yaml")
    assert env.cli("run", "--once", timeout=120).returncode == 0
    result = env.wait_job("G1", "done")
    assert result["state"] == "done"


def test_submit_refuses_an_order_it_knows_the_daemon_would_refuse_as_expired(env: Env) -> None:
    """`submit` of an order whose expires has passed, or comes no later than its not_before (or `--at`), exits 2 with
    one line naming the file and `expires`, and drops nothing: the daemon would only refuse it as `expired`."""
    env.configure()
    now = time.time()
    cases = {
        "past.json": order("PAST", expires=iso(now - 60)),
        "never.json": order("NEVER", expires=iso(now + 3600), not_before=iso(now + 7200)),
    }
    for name, body in cases.items():
        path = env.tmp / name
        path.write_text(json.dumps(body))
        proc = env.cli("submit", str(path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"{path}: expires: "), proc.stderr
    late = env.tmp / "late.json"
    late.write_text(json.dumps(order("LATE", expires=iso(now + 3600))))
    proc = env.cli("submit", "--in", "2h", str(late))
    assert proc.returncode == 2 and "expires: " in proc.stderr and "not after not_before" in proc.stderr, proc.stderr
    inbox = env.root / "inbox"
    assert not inbox.exists() or not list(inbox.iterdir())  # nothing was dropped
    ok = env.tmp / "ok.json"
    ok.write_text(json.dumps(order("FINE", expires=iso(now + 3600))))
    assert env.cli("submit", str(ok)).returncode == 0


def test_a_not_due_copy_of_a_job_id_that_was_taken_is_refused_at_the_next_rescan(env: Env) -> None:
    """Two files of one job id wait for a not_before in 2030; `cancel` takes one (it fails cancelled), and a due copy
    of another id's not-due order runs: at the next rescan the copies left are refused as known, instead of staying
    queued in inbox/ until 2030 beside a job that no command can reach any more (list showed the id twice)."""
    env.configure(rescan_interval=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("NB", not_before="2030-01-01T00:00:00Z"), name="NB.json")
    env.drop(order("NB", not_before="2030-01-01T00:00:00Z"), name="copy.json")
    env.drop(order("NB2", not_before="2030-01-01T00:00:00Z"), name="NB2.json")
    time.sleep(1.5)  # both settled and put off unread
    assert env.cli("cancel", "NB").returncode == 0
    assert env.wait_job("NB", "failed")["reason"] == "cancelled"
    env.drop(order("NB2"), name="due.json")
    env.wait_job("NB2", "done")
    wait_until(lambda: not list((env.root / "inbox").iterdir()), 30, "the copies refused")
    refused = [json.loads(x) for x in env.cli("list", "--state", "refused", "--json", check=True).stdout.splitlines()]
    assert sorted(r["job_id"] for r in refused) == ["NB", "NB2"], refused
    assert all("already" in r["reason"] for r in refused), refused
    assert [j for j, _ in env.starts()] == ["NB2"]
    assert d.stop() == 0


def test_a_large_yaml_order_with_a_quote_before_its_expires_is_refused_on_time_while_every_slot_is_busy(
    env: Env,
) -> None:
    """A 26 KB YAML order whose quoted task comes before its `expires:` waits unread for the one busy slot: it is
    refused `expired` at its expires, not once the slot frees (its glance keeps the expires)."""
    env.configure({"worker": env.agent(), "slow": env.agent("--sleep", "25")}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("BUSY", to="slow"))
    d.wait_event("agent.started", job_id="BUSY")
    pad = "".join(f"  - line {i} of a long list\n" for i in range(1200))
    text = f'job_id: BIGQ\nfrom: me\nto: worker\ntask: "a quoted task"\nexpires: {iso(time.time() + 3)}\n'
    text += "items: [{id: a}]\nmeta:\n  lines:\n" + pad
    assert len(text) > 16 * 1024
    t0 = time.time()
    env.drop(text, name="BIGQ.yaml")
    assert env.wait_refused("BIGQ", timeout=20)["reason"] == "expired"
    assert time.time() - t0 < 15, "refused only once the slot was free"
    assert d.stop(timeout=40) == 0
