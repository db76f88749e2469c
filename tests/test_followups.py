"""Agent hand-offs: follow-up orders in work/outbox/, their lineage, checks and release.

Contract sections 2 (`parent`, `hops`, `accept.followups`), 5 (`followups_valid`,
`children`, `parent`), 6 (reserve, release after done, release again without duplicates)
and 7 (`show`). Every test runs the real daemon over a real dispatch root; the fake agent's
`--followup JSON` flag writes one order into its outbox/, and `writing_agent` below puts
any other file there first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DEADLINE, Daemon, Env, order, wait_until

from dispatcher.job.followups import release_followups
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry
from dispatcher.ledger.records import Child, Claimed, ClaimRequest, DaemonInfo, Finish, Row
from dispatcher.ledger.sqlite import SqliteLedger
from dispatcher.lifecycle import State

# A wrapper agent: writes NAME=TEXT files into work/, then execs the fake agent after `--`.
# A name "@N:PATH" is written on attempt N only; "link:PATH=TARGET" makes a symlink and
# "fifo:PATH=" a FIFO; "bytes:PATH=TEXT" a file whose PATH holds \\xNN escapes for bytes that are not UTF-8.
WRITER = """\
import os, sys
args = sys.argv[1:]
cut = args.index("--")
work = os.environ["DISPATCH_WORKSPACE"]
for spec in args[:cut]:
    name, _, text = spec.partition("=")
    if name.startswith("@"):
        attempt, _, name = name[1:].partition(":")
        if attempt != os.environ["DISPATCH_ATTEMPT"]:
            continue
    kind, _, rest = name.partition(":")
    if rest and kind in ("link", "fifo", "bytes"):
        name = rest
    if kind == "bytes":
        name = os.fsdecode(name.encode().decode("unicode_escape").encode("latin-1"))
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "link":
        os.symlink(text, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "w") as fh:
            fh.write(text)
os.execv(sys.executable, [sys.executable, *args[cut + 1:]])
"""


# -- helpers ----------------------------------------------------------------------------


def followup(job_id: str, to: str, sender: str, **extra: Any) -> dict[str, Any]:
    """Return a follow-up order that agent `sender` hands to agent `to`."""
    body = order(job_id, to=to, **extra)
    body["from"] = sender
    return body


def handing_off(env: Env, *orders: dict[str, Any], flags: tuple[str, ...] = (), **settings: Any) -> dict[str, Any]:
    """Return a fake agent that does its job and writes each order into its outbox/."""
    args = [x for body in orders for x in ("--followup", json.dumps(body))]
    return env.agent(*flags, *args, **settings)


def writing_agent(env: Env, files: dict[str, Any], *flags: str, **settings: Any) -> dict[str, Any]:
    """Return a fake agent that first writes these files (path in work/ -> text or order)."""
    script = env.tmp / "outbox_writer.py"
    if not script.exists():
        script.write_text(WRITER)
    spec = env.agent(*flags, **settings)
    puts = [f"{name}={json.dumps(body) if isinstance(body, dict) else body}" for name, body in files.items()]
    spec["command"] = [sys.executable, str(script), *puts, "--", *spec["command"][1:]]
    return spec


def dropped_order(env: Env, job_id: str, state: str) -> dict[str, Any]:
    """Return the order file of a job as kept in its folder (must be JSON)."""
    path = env.job_dir(job_id, state) / "order.json"
    assert path.exists(), f"{job_id}: no order.json in {state}/: {sorted(p.name for p in path.parent.iterdir())}"
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def check(result: dict[str, Any], name: str) -> dict[str, Any]:
    """Return one named check of a result.json."""
    found: list[dict[str, Any]] = [c for c in result["checks"] if c["name"] == name]
    assert len(found) == 1, f"check {name} recorded {len(found)} times: {result['checks']}"
    return found[0]


def starts_of(env: Env, job_id: str) -> list[int]:
    """Return the attempt numbers the fake agent recorded for one job."""
    return [n for job, n in env.starts() if job == job_id]


def refusals_of(env: Env, job_id: str) -> list[Path]:
    """Return the refusal folders whose result names this job id."""
    found = []
    for p in env.refusals():
        res = p / "result.json"
        if res.exists() and json.loads(res.read_text()).get("job_id") == job_id:
            found.append(p)
    return found


def flush(env: Env, tag: str) -> None:
    """Run one more job to the end, so that whatever the daemon was going to release is out."""
    env.drop(order(f"FLUSH-{tag}", to="worker"))
    env.wait_job(f"FLUSH-{tag}", "done")


def assert_not_released(env: Env, job_id: str) -> None:
    """Assert that no job, refusal, inbox file or agent start exists for this job id."""
    for state in ("active", "done", "failed"):
        assert not env.job_dir(job_id, state).exists(), f"{job_id} was released: it is in {state}/"
    assert not refusals_of(env, job_id), f"{job_id} was released and refused"
    inbox = env.root / "inbox"
    for p in inbox.iterdir() if inbox.exists() else []:
        if p.is_file():
            assert f'"{job_id}"' not in p.read_text(errors="replace"), f"{job_id} is waiting in inbox/{p.name}"
    assert not starts_of(env, job_id), f"an agent ran {job_id}"


def detail_text(result: dict[str, Any], name: str) -> str:
    """Return the detail of a check together with the job's reason, for word checks."""
    return f"{check(result, name).get('detail')} | {result.get('reason')}"


def started(env: Env) -> Daemon:
    """Start the daemon and wait until it is ready; fail at once, with its output, if it exits."""
    d = env.daemon()
    proc = d.proc
    assert proc is not None
    wait_until(
        lambda: proc.poll() is not None or any(e.get("event") == "daemon.ready" for e in d.events()),
        what="daemon.ready",
    )
    if proc.poll() is not None:
        d.wait()
        tail = d.out.read_text(errors="replace").strip().splitlines()[-3:]
        raise AssertionError(f"the daemon exited {proc.returncode} before it was ready: {tail}")
    return d


def fast_wait(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> None:
    """Poll tightly (2 ms): used to act (kill -9) as close to a moment as possible."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


# -- chains -----------------------------------------------------------------------------


def test_two_step_chain_releases_the_followup_with_lineage(env: Env) -> None:
    """A's follow-up to B is released as JSON with parent and hops, runs once; results link."""
    handoff = followup("JOB-002", to="assigner", sender="intake")
    # the outbox is written a second before the agent exits: no release before done
    intake = handing_off(env, handoff, flags=("--sleep-after", "1"))
    env.configure(agents={"intake": intake, "assigner": env.agent(), "worker": env.agent()})
    d = started(env)
    env.drop(order("JOB-001", to="intake"))

    child = env.wait_job("JOB-002", "done")
    parent = env.wait_job("JOB-001", "done")

    released = dropped_order(env, "JOB-002", "done")
    assert released["parent"] == "JOB-001"
    assert released["hops"] == 1
    for key in ("job_id", "from", "to", "task", "items", "accept"):
        assert released[key] == handoff[key], f"released order changed {key}"
    assert parent["parent"] is None
    assert parent["children"] == ["JOB-002"]
    assert child["parent"] == "JOB-001"
    assert child["children"] == []
    assert child["agent"] == "assigner"
    assert starts_of(env, "JOB-002") == [1]
    assert child["received"] >= parent["finished"], "released before its parent was done"
    assert starts_of(env, "JOB-001") == [1]
    # the parent's outbox stays where the agent left it: nothing is deleted
    assert (env.job_dir("JOB-001", "done") / "work" / "outbox" / "JOB-002.json").exists()
    assert any(e.get("event") == "followup.released" for e in d.events()), "no followup.released log line"
    assert d.stop() == 0


def test_three_step_chain_counts_hops_zero_one_two(env: Env) -> None:
    """A -> B -> C runs to the end with hops 0, 1, 2 and each result names its parent and child."""
    b = followup("CH3-B", to="second", sender="first")
    c = followup("CH3-C", to="third", sender="second")
    env.configure(
        agents={
            "first": handing_off(env, b),
            "second": handing_off(env, c),
            "third": env.agent(),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("CH3-A", to="first"))

    rc = env.wait_job("CH3-C", "done")
    rb = env.wait_job("CH3-B", "done")
    ra = env.wait_job("CH3-A", "done")
    assert "hops" not in dropped_order(env, "CH3-A", "done")  # the user's file, byte for byte
    assert (
        dropped_order(env, "CH3-B", "done")["hops"],
        dropped_order(env, "CH3-C", "done")["hops"],
    ) == (1, 2)
    assert (ra["parent"], rb["parent"], rc["parent"]) == (None, "CH3-A", "CH3-B")
    assert (ra["children"], rb["children"], rc["children"]) == (["CH3-B"], ["CH3-C"], [])
    assert d.stop() == 0


def test_loop_is_stopped_at_max_hops(env: Env) -> None:
    """A ping-pong loop stops where the next follow-up would pass max_hops; nothing is released."""
    # {job_id} is a command placeholder: each run hands off a new id, as a real loop would
    ping = followup("{job_id}.b", to="pong", sender="ping")
    pong = followup("{job_id}.a", to="ping", sender="pong")
    env.configure(
        agents={
            "ping": handing_off(env, ping),
            "pong": handing_off(env, pong),
            "worker": env.agent(),
        },
        max_hops=2,
    )
    d = started(env)
    env.drop(order("LOOP", to="ping"))

    third = env.wait_job("LOOP.b.a", "failed")
    assert env.wait_job("LOOP", "done")["children"] == ["LOOP.b"]
    assert env.wait_job("LOOP.b", "done")["children"] == ["LOOP.b.a"]
    assert dropped_order(env, "LOOP.b", "done")["hops"] == 1
    assert dropped_order(env, "LOOP.b.a", "failed")["hops"] == 2
    assert third["reason"].startswith("followups_valid"), third["reason"]
    assert check(third, "followups_valid")["ok"] is False
    assert "hops" in detail_text(third, "followups_valid"), third
    flush(env, "loop")
    assert_not_released(env, "LOOP.b.a.b")
    assert starts_of(env, "LOOP.b.a") == [1]
    assert d.stop() == 0


def test_dropped_file_cannot_set_its_own_lineage(env: Env) -> None:
    """A dropped order claiming parent and hops gets hops 0 and parent null: the ledger decides."""
    child = followup("LIN-Y", to="worker", sender="sender")
    env.configure(agents={"sender": handing_off(env, child), "worker": env.agent()}, max_hops=2)
    d = started(env)
    # with hops 2 taken from the file, the follow-up (hops 3) would break max_hops 2
    env.drop(order("LIN-X", to="sender", parent="SOMEONE-ELSE", hops=2))

    rx = env.wait_job("LIN-X", "done")
    ry = env.wait_job("LIN-Y", "done")
    assert rx["parent"] is None
    assert rx["children"] == ["LIN-Y"]
    assert ry["parent"] == "LIN-X"
    released = dropped_order(env, "LIN-Y", "done")
    assert (released["parent"], released["hops"]) == ("LIN-X", 1)
    assert d.stop() == 0


def test_lineage_a_dropped_file_sets_to_any_value_is_not_a_reason_to_refuse_it(env: Env) -> None:
    """`hops: -1`, `hops: null`, `parent: 5`: lineage comes from the ledger, so the job runs with hops 0."""
    env.configure(agents={"worker": env.agent()})
    d = started(env)
    weird = {"LIN-A": {"hops": -1}, "LIN-B": {"hops": None}, "LIN-C": {"parent": 5, "hops": "many"}}
    for job_id, lineage in weird.items():
        env.drop(order(job_id, **lineage))
    for job_id in weird:
        result = env.wait_job(job_id, "done")
        assert result["parent"] is None
        given = json.loads((env.root / "done" / job_id / "work" / "order.json").read_text())
        assert (given["parent"], given["hops"]) == (None, 0)
    assert d.stop() == 0


def test_release_never_replaces_a_users_file_in_inbox(env: Env) -> None:
    """A user's file still being written in inbox/ under the child's name survives the release."""
    env.configure(
        agents={
            "intake": handing_off(env, followup("UF-B", to="worker", sender="intake")),
            "worker": env.agent(),
        },
        settle=5,
    )
    d = started(env)
    user = env.root / "inbox" / "UF-B.json"
    text = json.dumps(order("UF-USER", to="worker"))
    stop = threading.Event()
    with user.open("w") as fh:
        fh.write(text)
        fh.flush()

        def keep_writing() -> None:
            # a slow writer: the file keeps changing, so the daemon must leave it alone
            while not stop.wait(0.2):
                fh.write(" ")
                fh.flush()

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            env.drop(order("UF-A", to="intake"))
            env.wait_job("UF-B", "done")
        finally:
            stop.set()
            writer.join()
        written = user.read_bytes() if user.exists() else b""
    assert written.startswith(text.encode()), "the user's file in inbox/ was replaced"
    env.wait_job("UF-USER", "done")
    assert (env.job_dir("UF-USER", "done") / "order.json").read_bytes().rstrip() == text.encode()
    assert dropped_order(env, "UF-B", "done")["parent"] == "UF-A"
    assert d.stop() == 0


# -- followups_valid: one daemon run, one job per way of getting it wrong ---------------


@pytest.fixture(scope="module")
def outbox_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Run, in one daemon, one parent job per outbox case below; yield when all are finished."""
    tmp = tmp_path_factory.mktemp("outbox")
    env = Env(
        tmp=tmp,
        root=tmp / "dispatch",
        config_path=tmp / "dispatcher.yaml",
        count_file=tmp / "starts.txt",
    )

    def fu(child: str, sender: str, **extra: Any) -> dict[str, Any]:
        return followup(child, to="worker", sender=sender, **extra)

    agents = {
        "worker": env.agent(),
        "reuser": handing_off(env, fu("KNOWN-1", "reuser")),
        "selfish": handing_off(env, fu("OB-SELFISH", "selfish")),
        "twin": writing_agent(
            env,
            {"outbox/a.json": fu("OB-TWIN-C", "twin"), "outbox/b.json": fu("OB-TWIN-C", "twin")},
        ),
        "forger": handing_off(env, fu("OB-FORGER-C", "intake")),
        "parentset": handing_off(env, fu("OB-PARENTSET-C", "parentset", parent="OB-PARENTSET")),
        "hopsset": handing_off(env, fu("OB-HOPSSET-C", "hopsset", hops=1)),
        "noter": writing_agent(
            env,
            {
                "outbox/notes.txt": "remember to call Aina",
                "outbox/OB-NOTER-C.json": fu("OB-NOTER-C", "noter"),
            },
        ),
        "nester": writing_agent(env, {"outbox/sub/OB-NESTER-C.json": fu("OB-NESTER-C", "nester")}),
        "junk": writing_agent(env, {"outbox/OB-JUNK-C.json": '{"job_id": "OB-JUNK-C", '}),
        "stranger": handing_off(env, followup("OB-STRANGER-C", to="nobody", sender="stranger")),
        "tidy": writing_agent(
            env,
            {
                "outbox/.draft.json": "{half",
                "outbox/.OB-TIDY-X.json": json.dumps(fu("OB-TIDY-X", "tidy")),
                "outbox/next.json.tmp": "{half",
                "outbox/next.json.part": "{half",
                "outbox/OB-TIDY-C.json": fu("OB-TIDY-C", "tidy"),
            },
        ),
        "failing": handing_off(env, fu("OB-FAILING-C", "failing"), flags=("--missing-row",)),
        "yamler": writing_agent(env, {"outbox/OB-YAMLER-C.yml": yaml.safe_dump(fu("OB-YAMLER-C", "yamler"))}),
        "bloater": handing_off(env, fu("OB-BLOATER-C", "bloater", meta={"blob": "x" * 6000})),
        # a link inside work/ to a valid order, and a FIFO: neither is a regular order file
        "linker": writing_agent(
            env, {"out.json": fu("OB-LINKER-C", "linker"), "link:outbox/OB-LINKER-C.json": "../out.json"}
        ),
        "piper": writing_agent(env, {"fifo:outbox/OB-PIPER-C.json": ""}),
        # a valid order under a file name that is not UTF-8 (inbox/ refuses such a name too)
        "badname": writing_agent(env, {"bytes:outbox/next\\xff.json": fu("OB-BADNAME-C", "badname")}),
        # two parents running at once hand off the same new id: only one can have it
        "racer1": handing_off(env, fu("OB-RACE-C", "racer1"), flags=("--sleep", "0.5")),
        "racer2": handing_off(env, fu("OB-RACE-C", "racer2"), flags=("--sleep", "0.5")),
    }
    env.configure(agents=agents, max_jobs=6, max_order_bytes=4096)
    d = env.daemon()
    try:
        d.wait_ready()
        env.drop(order("KNOWN-1", to="worker"))
        env.wait_job("KNOWN-1", "done")
        for name in agents:
            if name != "worker":
                env.drop(order(f"OB-{name.upper()}", to=name))
        for name in agents:
            if name != "worker":
                env.wait_job(f"OB-{name.upper()}")
        env.wait_job("OB-TIDY-C")
        env.wait_job("OB-YAMLER-C")
        env.wait_job("OB-RACE-C")
        flush(env, "outbox")
        yield env
    finally:
        for daemon in env._daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.stop()


def rejected(env: Env, agent: str, *words: str) -> dict[str, Any]:
    """Assert the agent's parent job failed followups_valid with these words in the detail."""
    job = f"OB-{agent.upper()}"
    result = env.wait_job(job, "failed", timeout=1)
    assert result["reason"].startswith("followups_valid"), result["reason"]
    assert "\n" not in result["reason"]
    assert check(result, "followups_valid")["ok"] is False
    text = detail_text(result, "followups_valid")
    for word in words:
        assert word in text, f"{word!r} not named in {text!r}"
    for name in ("exit_ok", "receipt_present", "receipt_job_id", "writes_scope"):
        assert check(result, name)["ok"] is True, f"{name} failed too: {result['checks']}"
    return result


def test_a_follow_up_too_large_once_released_fails_followups_valid_and_one_that_fits_runs(env: Env) -> None:
    """max_order_bytes 2000: a follow-up written in 1,990 bytes grows past it once released (JSON with parent and
    hops), so followups_valid fails the parent and says so, instead of the daemon refusing its own release and the
    chain being lost; one of 1,900 bytes is released and runs (sections 2, 5, 6)."""
    fits = followup("FIT-2", to="worker", sender="intake")
    fits["meta"] = {"pad": ""}
    fits["meta"]["pad"] = "x" * (1900 - len(json.dumps(fits)))
    big = followup("BIG-2", to="worker", sender="bigger")
    big["meta"] = {"pad": ""}
    big["meta"]["pad"] = "x" * (1990 - len(json.dumps(big)))
    assert (len(json.dumps(fits)), len(json.dumps(big))) == (1900, 1990)
    env.configure(
        agents={"intake": handing_off(env, fits), "bigger": handing_off(env, big), "worker": env.agent()},
        max_order_bytes=2000,
    )
    env.drop(order("FIT-1", to="intake"))
    env.drop(order("BIG-1", to="bigger"))
    env.cli("run", "--once", timeout=90)
    assert env.result("FIT-2", "done")["parent"] == "FIT-1"
    failed = env.result("BIG-1", "failed")
    check = next(c for c in failed["checks"] if c["name"] == "followups_valid")
    assert check["ok"] is False and "once released as JSON with parent and hops" in check["detail"], check
    assert "(2" in check["detail"] and "> 2000 bytes)" in check["detail"]
    assert not [p for p in (env.root / "failed").iterdir() if "@" in p.name], "the daemon refused its own release"


def test_show_of_a_released_follow_up_that_was_refused_says_refused(env: Env) -> None:
    """A follow-up released into inbox/ and then refused (its `expires` had passed) is shown `refused`, with the
    refusal's reason and folder, by `show` of it and of its parent; not `inbox`, where nothing is (section 7)."""
    late = followup("LATE-2", to="worker", sender="intake", expires="2000-01-01T00:00:00Z")
    env.configure(agents={"intake": handing_off(env, late), "worker": env.agent()})
    env.drop(order("LATE-1", to="intake"))
    env.cli("run", "--once", timeout=90)
    shown = json.loads(env.cli("show", "LATE-2", "--json", check=True).stdout)
    assert shown["state"] == "refused" and shown["reason"] == "expired", shown
    assert "@" in Path(shown["folder"]).name and Path(shown["folder"]).parent.name == "failed"
    text = env.cli("show", "LATE-2", check=True).stdout
    assert text.startswith("LATE-2  refused") and "inbox" not in text, text
    parent = env.cli("show", "LATE-1", check=True).stdout
    assert "LATE-2" in parent and "inbox" not in parent, parent


def test_followup_reusing_a_known_job_id_fails_and_the_job_never_runs_again(
    outbox_run: Env,
) -> None:
    """A follow-up whose id the ledger knows fails followups_valid; that job is not run again."""
    rejected(outbox_run, "reuser", "KNOWN-1")
    assert starts_of(outbox_run, "KNOWN-1") == [1]
    assert not refusals_of(outbox_run, "KNOWN-1")


def test_followup_with_the_parents_own_id_fails(outbox_run: Env) -> None:
    """A follow-up that reuses the writing job's own id fails followups_valid."""
    rejected(outbox_run, "selfish", "OB-SELFISH")
    assert starts_of(outbox_run, "OB-SELFISH") == [1]
    assert not refusals_of(outbox_run, "OB-SELFISH")


def test_two_followups_with_one_id_fail(outbox_run: Env) -> None:
    """Two outbox orders with the same job id fail followups_valid, and neither is released."""
    rejected(outbox_run, "twin", "OB-TWIN-C")
    assert_not_released(outbox_run, "OB-TWIN-C")


def test_followup_with_a_forged_sender_fails(outbox_run: Env) -> None:
    """A follow-up whose `from` is not the writing agent's name fails followups_valid."""
    rejected(outbox_run, "forger", "from")
    assert_not_released(outbox_run, "OB-FORGER-C")


def test_followup_that_sets_parent_fails(outbox_run: Env) -> None:
    """A follow-up that writes its own `parent` fails followups_valid."""
    rejected(outbox_run, "parentset", "parent")
    assert_not_released(outbox_run, "OB-PARENTSET-C")


def test_followup_that_sets_hops_fails(outbox_run: Env) -> None:
    """A follow-up that writes its own `hops` fails followups_valid."""
    rejected(outbox_run, "hopsset", "hops")
    assert_not_released(outbox_run, "OB-HOPSSET-C")


def test_non_order_file_in_outbox_fails_and_blocks_the_valid_one(outbox_run: Env) -> None:
    """notes.txt in outbox/ fails followups_valid, and the valid order beside it is not released."""
    rejected(outbox_run, "noter", "notes.txt")
    assert_not_released(outbox_run, "OB-NOTER-C")


def test_folder_in_outbox_fails(outbox_run: Env) -> None:
    """A folder in outbox/ is not a regular order file: followups_valid fails."""
    rejected(outbox_run, "nester", "sub")
    assert_not_released(outbox_run, "OB-NESTER-C")


def test_unreadable_followup_fails(outbox_run: Env) -> None:
    """A truncated JSON order in outbox/ fails followups_valid."""
    rejected(outbox_run, "junk", "OB-JUNK-C.json")
    assert_not_released(outbox_run, "OB-JUNK-C")


def test_followup_to_an_unknown_agent_fails(outbox_run: Env) -> None:
    """A follow-up to an agent the config does not define fails followups_valid."""
    rejected(outbox_run, "stranger", "nobody")
    assert_not_released(outbox_run, "OB-STRANGER-C")


def test_hidden_and_temp_names_in_outbox_are_ignored(outbox_run: Env) -> None:
    """Hidden, .tmp and .part files in outbox/ are ignored; the one real follow-up is released."""
    parent = outbox_run.wait_job("OB-TIDY", "done", timeout=1)
    assert check(parent, "followups_valid")["ok"] is True
    assert parent["children"] == ["OB-TIDY-C"]
    assert outbox_run.wait_job("OB-TIDY-C", "done", timeout=1)["parent"] == "OB-TIDY"
    assert_not_released(outbox_run, "OB-TIDY-X")


def test_followup_of_a_failed_parent_is_never_released(outbox_run: Env) -> None:
    """A valid follow-up whose parent failed another check is not released."""
    parent = outbox_run.wait_job("OB-FAILING", "failed", timeout=1)
    assert parent["reason"].startswith("output_rows"), parent["reason"]
    assert check(parent, "followups_valid")["ok"] is not False
    assert_not_released(outbox_run, "OB-FAILING-C")


def test_symlink_in_outbox_is_not_an_order(outbox_run: Env) -> None:
    """A symlink in outbox/ (even to a valid order inside work/) fails followups_valid."""
    rejected(outbox_run, "linker", "OB-LINKER-C.json")
    assert_not_released(outbox_run, "OB-LINKER-C")


def test_an_order_under_a_file_name_that_is_not_utf8_fails_followups_valid(outbox_run: Env) -> None:
    """A valid follow-up whose outbox/ name is not UTF-8 fails its check, named, beside the others' real results."""
    rejected(outbox_run, "badname", "outbox/next\\xff.json", "not valid UTF-8")
    assert_not_released(outbox_run, "OB-BADNAME-C")


def test_fifo_in_outbox_fails_without_hanging(outbox_run: Env) -> None:
    """A FIFO named like an order in outbox/ is never opened: the job finishes and fails both checks."""
    result = outbox_run.wait_job("OB-PIPER", "failed", timeout=1)
    assert result["reason"].startswith("writes_scope"), result["reason"]
    assert check(result, "followups_valid")["ok"] is False
    assert "OB-PIPER-C.json" in check(result, "followups_valid")["detail"]


def test_yaml_followup_is_released_as_json(outbox_run: Env) -> None:
    """A .yml follow-up in outbox/ is released as JSON with parent and hops set."""
    assert outbox_run.wait_job("OB-YAMLER", "done", timeout=1)["children"] == ["OB-YAMLER-C"]
    released = dropped_order(outbox_run, "OB-YAMLER-C", "done")
    assert (released["parent"], released["hops"]) == ("OB-YAMLER", 1)
    assert not list(outbox_run.job_dir("OB-YAMLER-C", "done").glob("order.y*ml"))


def test_followup_larger_than_max_order_bytes_fails(outbox_run: Env) -> None:
    """A follow-up above max_order_bytes is not a valid order: followups_valid fails."""
    rejected(outbox_run, "bloater", "OB-BLOATER-C")
    assert_not_released(outbox_run, "OB-BLOATER-C")


def test_two_parents_handing_off_one_new_id_give_one_job(outbox_run: Env) -> None:
    """Two parents that hand off the same new id at once: one keeps it, the other fails."""
    results = {job: outbox_run.wait_job(job, timeout=1) for job in ("OB-RACER1", "OB-RACER2")}
    done = [job for job, r in results.items() if r["state"] == "done"]
    failed = [job for job, r in results.items() if r["state"] == "failed"]
    assert len(done) == 1 and len(failed) == 1, {job: r["reason"] for job, r in results.items()}
    rejected(outbox_run, failed[0].removeprefix("OB-").lower(), "OB-RACE-C")
    assert results[done[0]]["children"] == ["OB-RACE-C"]
    assert outbox_run.wait_job("OB-RACE-C", "done", timeout=1)["parent"] == done[0]
    assert starts_of(outbox_run, "OB-RACE-C") == [1]
    assert not refusals_of(outbox_run, "OB-RACE-C")


# -- run --once waits for follow-ups ----------------------------------------------------


def test_run_once_waits_for_followups(env: Env) -> None:
    """`run --once` runs the follow-ups too: exit 0 when the chain is done, 1 when a child fails."""
    env.configure(
        agents={
            "first": handing_off(env, followup("{job_id}.c", to="second", sender="first")),
            "second": env.agent(),
            "hands": handing_off(env, followup("{job_id}.c", to="bad", sender="hands")),
            "bad": env.agent("--exit", "3"),
            "worker": env.agent(),
        }
    )
    env.drop(order("ONCE-1", to="first"))
    proc = env.cli("run", "--once")
    assert proc.returncode == 0, proc.stderr
    assert env.wait_job("ONCE-1.c", "done", timeout=1)["parent"] == "ONCE-1"

    env.drop(order("ONCE-2", to="hands"))
    proc = env.cli("run", "--once")
    assert proc.returncode == 1, proc.stderr
    assert env.wait_job("ONCE-2", "done", timeout=1)["children"] == ["ONCE-2.c"]
    assert env.wait_job("ONCE-2.c", "failed", timeout=1)["parent"] == "ONCE-2"


def test_outbox_of_a_failed_attempt_is_no_proof_for_the_next(env: Env) -> None:
    """A retried job's earlier outbox is moved aside: only the last attempt's follow-ups count."""
    old, new = followup("RT-OLD", to="worker", sender="retrier"), followup("RT-NEW", to="worker", sender="retrier")
    handoff = followup("RT-HANDOFF", to="worker", sender="retrier")
    env.configure(
        agents={
            # attempt 1 hands off then exits 1; attempt 2 runs clean
            "retrier": writing_agent(
                env,
                {"@1:outbox/RT-OLD.json": old, "@2:outbox/RT-NEW.json": new},
                "--fail-attempts",
                "1",
                retry_safe=True,
                max_attempts=2,
            ),
            # attempt 1 hands off then exits 1; attempt 2 forgets the handoff
            "forgetful": writing_agent(
                env,
                {"@1:outbox/RT-HANDOFF.json": {**handoff, "from": "forgetful"}},
                "--fail-attempts",
                "1",
                retry_safe=True,
                max_attempts=2,
            ),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("RT-1", to="retrier"))
    env.drop(order("RT-2", to="forgetful", accept={"output": "out.csv", "followups": ["worker"]}))

    first = env.wait_job("RT-1", "done")
    assert [a["n"] for a in first["attempts"]] == [1, 2]
    assert first["children"] == ["RT-NEW"]
    assert env.wait_job("RT-NEW", "done")["parent"] == "RT-1"
    assert (env.job_dir("RT-1", "done") / "attempts" / "1" / "outbox" / "RT-OLD.json").exists()
    second = env.wait_job("RT-2", "failed")
    assert [a["n"] for a in second["attempts"]] == [1, 2]
    assert second["reason"].startswith("followups_valid"), second["reason"]
    flush(env, "retry")
    assert_not_released(env, "RT-OLD")
    assert_not_released(env, "RT-HANDOFF")
    assert d.stop() == 0


# -- accept.followups: the seed's missing handoff ---------------------------------------


def test_accept_followups_needs_exactly_one_handoff_per_named_agent(env: Env) -> None:
    """accept.followups [assigner]: none, one elsewhere or two hand-offs fail; one passes."""
    accept = {"output": "out.csv", "followups": ["assigner"]}
    env.configure(
        agents={
            "silent": env.agent(),
            "stray": handing_off(env, followup("ACC-STRAY-C", to="other", sender="stray")),
            "twice": handing_off(
                env,
                followup("ACC-TWICE-1", to="assigner", sender="twice"),
                followup("ACC-TWICE-2", to="assigner", sender="twice"),
            ),
            "intake": handing_off(env, followup("ACC-OK-C", to="assigner", sender="intake")),
            "assigner": env.agent(),
            "other": env.agent(),
            "worker": env.agent(),
        },
        max_jobs=4,
    )
    d = started(env)
    for job, agent in [
        ("ACC-SILENT", "silent"),
        ("ACC-STRAY", "stray"),
        ("ACC-TWICE", "twice"),
        ("ACC-OK", "intake"),
    ]:
        env.drop(order(job, to=agent, accept=accept))

    for job in ("ACC-SILENT", "ACC-STRAY", "ACC-TWICE"):
        result = env.wait_job(job, "failed")
        assert result["reason"].startswith("followups_valid"), f"{job}: {result['reason']}"
        assert check(result, "followups_valid")["ok"] is False
    ok = env.wait_job("ACC-OK", "done")
    assert check(ok, "followups_valid")["ok"] is True
    assert ok["children"] == ["ACC-OK-C"]
    assert env.wait_job("ACC-OK-C", "done")["parent"] == "ACC-OK"
    flush(env, "accept")
    for job in ("ACC-STRAY-C", "ACC-TWICE-1", "ACC-TWICE-2"):
        assert_not_released(env, job)
    # nothing reached the assigner but the one good handoff
    ran = {job for job, _ in env.starts()}
    assert ran == {"ACC-SILENT", "ACC-STRAY", "ACC-TWICE", "ACC-OK", "ACC-OK-C", "FLUSH-accept"}
    assert d.stop() == 0


# -- crash between done and release -----------------------------------------------------


def test_followup_is_released_exactly_once_across_kill_9(env: Env) -> None:
    """kill -9 around a parent's done and release, restart: each follow-up is one job."""
    env.configure(
        agents={
            "parent": handing_off(env, followup("{job_id}.c", to="child", sender="parent")),
            "child": env.agent(retry_safe=True, max_attempts=3),
            "worker": env.agent(),
        }
    )

    def released(d: Any, child: str) -> bool:
        seen = any(e.get("event") == "followup.released" for e in d.events())
        return seen or any(env.job_dir(child, s).exists() for s in ("active", "done", "failed"))

    kill_points: list[Callable[[Any, str, str], bool]] = [
        lambda d, p, c: env.job_dir(p, "done").exists(),
        lambda d, p, c: (env.job_dir(p, "done") / "result.json").exists(),
        lambda d, p, c: released(d, c),
        lambda d, p, c: any(env.job_dir(c, s).exists() for s in ("active", "done", "failed")),
        lambda d, p, c: env.job_dir(p, "done").exists(),
    ]
    kill_points = kill_points * 2  # the windows are narrow: try each twice
    for i, point in enumerate(kill_points):
        parent, child = f"CRASH-{i}", f"CRASH-{i}.c"
        d = started(env)
        env.drop(order(parent, to="parent"))
        fast_wait(partial(point, d, parent, child), f"kill point {i}")
        d.kill()
        again = started(env)
        env.wait_job(child, "done")
        assert again.stop() == 0

    for i in range(len(kill_points)):
        parent, child = f"CRASH-{i}", f"CRASH-{i}.c"
        assert env.wait_job(parent, "done", timeout=1)["children"] == [child]
        result = env.wait_job(child, "done", timeout=1)
        assert result["parent"] == parent
        assert not env.job_dir(child, "active").exists()
        assert not env.job_dir(child, "failed").exists()
        assert not refusals_of(env, child), f"{child} was released twice (a refusal of it exists)"
        attempts = starts_of(env, child)
        assert len(attempts) == len(set(attempts)), f"{child} ran as two jobs: attempts {attempts}"
        # an attempt the kill interrupted may never have reached the agent's first line
        numbers = [a["n"] for a in result["attempts"]]
        assert set(attempts) <= set(numbers) and numbers[-1] in attempts, f"{child}: {attempts} vs {numbers}"
        assert starts_of(env, parent) == [1]
    leftovers = [p.name for p in (env.root / "inbox").iterdir() if not p.name.startswith(".")]
    assert leftovers == []


def test_parent_recovered_after_kill_9_releases_its_followup_at_most_once(env: Env) -> None:
    """kill -9 while a parent agent still runs after writing receipt and outbox: one outcome, no duplicate."""
    env.configure(
        agents={
            "parent": handing_off(
                env, followup("{job_id}.c", to="worker", sender="parent"), flags=("--sleep-after", "30")
            ),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("REC-1", to="parent"))
    fast_wait(lambda: (env.job_dir("REC-1", "active") / "work" / "receipt.json").exists(), "the receipt")
    d.kill()
    again = started(env)
    parent = env.wait_job("REC-1")
    assert check(parent, "exit_ok")["ok"] is None, check(parent, "exit_ok")
    if parent["state"] == "done":
        assert parent["children"] == ["REC-1.c"]
        assert env.wait_job("REC-1.c", "done")["parent"] == "REC-1"
        assert starts_of(env, "REC-1.c") == [1]
    else:
        flush(env, "recovered")
        assert_not_released(env, "REC-1.c")
    assert starts_of(env, "REC-1") == [1]
    assert not refusals_of(env, "REC-1.c")
    assert again.stop() == 0


# -- show -------------------------------------------------------------------------------


@pytest.fixture
def shown_chain(env: Env) -> Env:
    """Run SHOW-A -> SHOW-B -> SHOW-C where the last agent fails (exit 3)."""
    env.configure(
        agents={
            "first": handing_off(env, followup("SHOW-B", to="second", sender="first")),
            "second": handing_off(env, followup("SHOW-C", to="third", sender="second")),
            "third": env.agent("--exit", "3"),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("SHOW-A", to="first"))
    env.wait_job("SHOW-C", "failed")
    assert d.stop() == 0
    return env


def line_with(text: str, job_id: str) -> tuple[int, str]:
    """Return (index, line) of the first line naming this job id as a whole word."""
    pattern = re.compile(rf"(?<![\w.-]){re.escape(job_id)}(?![\w.-])")
    for i, line in enumerate(text.splitlines()):
        if pattern.search(line):
            return i, line
    raise AssertionError(f"{job_id} not shown in:\n{text}")


def test_show_names_ancestors_and_descendants_with_states(shown_chain: Env) -> None:
    """`show SHOW-B` names its parent and child with their states."""
    proc = shown_chain.cli("show", "SHOW-B", check=True)
    _, parent = line_with(proc.stdout, "SHOW-A")
    _, child = line_with(proc.stdout, "SHOW-C")
    assert "done" in parent, proc.stdout
    assert "failed" in child, proc.stdout


def test_show_tree_draws_the_chain(shown_chain: Env) -> None:
    """`show --tree SHOW-B` draws A, B, C on their own lines, each with its state, nested deeper."""
    proc = shown_chain.cli("show", "--tree", "SHOW-B", check=True)
    rows = {job: line_with(proc.stdout, job) for job in ("SHOW-A", "SHOW-B", "SHOW-C")}
    assert rows["SHOW-A"][0] < rows["SHOW-B"][0] < rows["SHOW-C"][0], proc.stdout
    assert "done" in rows["SHOW-A"][1] and "done" in rows["SHOW-B"][1], proc.stdout
    assert "failed" in rows["SHOW-C"][1], proc.stdout
    columns = [rows[job][1].index(job) for job in ("SHOW-A", "SHOW-B", "SHOW-C")]
    assert columns[0] < columns[1] < columns[2], f"no nesting shown:\n{proc.stdout}"


def test_show_json_has_parent_and_children(shown_chain: Env) -> None:
    """`show --json` gives each job's parent and children."""
    a = json.loads(shown_chain.cli("show", "SHOW-A", "--json", check=True).stdout)
    b = json.loads(shown_chain.cli("show", "SHOW-B", "--json", check=True).stdout)
    c = json.loads(shown_chain.cli("show", "SHOW-C", "--json", check=True).stdout)
    assert (a["parent"], a["children"]) == (None, ["SHOW-B"])
    assert (b["parent"], b["children"]) == ("SHOW-A", ["SHOW-C"])
    assert (c["parent"], c["children"]) == ("SHOW-B", [])
    assert (a["state"], b["state"], c["state"]) == ("done", "done", "failed")


# -- repair -----------------------------------------------------------------------------


def find_detail(data: Any, name: str) -> Any:
    """Return the detail recorded for check `name` anywhere in a feedback document."""
    if isinstance(data, dict):
        if data.get("name") == name:
            return data.get("detail") or data.get("message") or data.get("reason")
        if name in data:
            value = data[name]
            return value.get("detail") if isinstance(value, dict) else value
        data = list(data.values())
    if isinstance(data, list):
        for value in data:
            found = find_detail(value, name)
            if found:
                return found
    return None


def test_repair_retry_gives_the_agent_feedback_and_ends_done(env: Env) -> None:
    """With repair, a checks failure is retried with work/feedback.json naming the failed check."""
    env.configure(
        agents={
            "fixer": env.agent("--fail-checks-attempts", "1", repair=True, retry_safe=True, max_attempts=2),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("REPAIR-1", to="fixer"))

    result = env.wait_job("REPAIR-1", "done")
    assert starts_of(env, "REPAIR-1") == [1, 2]
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    job = env.job_dir("REPAIR-1", "done")
    feedback = job / "work" / "feedback.json"
    assert feedback.exists(), "attempt 2 got no work/feedback.json"
    data = json.loads(feedback.read_text())
    detail = find_detail(data, "output_rows")
    assert detail, f"feedback.json does not list output_rows with a detail: {data}"
    assert (job / "attempts" / "1" / "receipt.json").exists(), "attempt 1's receipt was not moved aside"
    assert d.stop() == 0


def test_a_cancel_during_a_repairs_wait_keeps_the_checks_of_the_attempt_it_repairs(env: Env) -> None:
    """Attempt 1 fails output_rows and a repair is due in 30 s; a cancel then fails the job `cancelled` with attempt
    1's checks (output_rows false), not "not run" for every check."""
    fixer = env.agent("--fail-checks-attempts", "1", repair=True, retry_safe=True, max_attempts=2)
    env.configure(agents={"fixer": fixer, "worker": env.agent()}, retry_delay=30)
    d = started(env)
    env.drop(order("REPAIR-C", to="fixer"))
    d.wait_event("job.retrying", job_id="REPAIR-C")
    env.cli("cancel", "REPAIR-C", check=True)
    result = env.wait_job("REPAIR-C", "failed")
    assert result["reason"] == "cancelled"
    checks = {c["name"]: c["ok"] for c in result["checks"]}
    assert checks["output_rows"] is False and checks["exit_ok"] is True, result["checks"]
    assert d.stop() == 0


def test_without_repair_no_feedback_and_checks_failures_are_not_retried(env: Env) -> None:
    """Without repair: a checks failure ends the job; an exit 1 is retried; no feedback.json."""
    env.configure(
        agents={
            "plain": env.agent("--fail-checks-attempts", "1", retry_safe=True, max_attempts=2),
            "crashy": env.agent(
                "--fail-attempts",
                "1",
                "--fail-checks-attempts",
                "1",
                retry_safe=True,
                max_attempts=2,
            ),
            "worker": env.agent(),
        }
    )
    d = started(env)
    env.drop(order("PLAIN-1", to="plain"))
    env.drop(order("CRASHY-1", to="crashy"))

    plain = env.wait_job("PLAIN-1", "failed")
    assert plain["reason"].startswith("output_rows"), plain["reason"]
    assert starts_of(env, "PLAIN-1") == [1]
    assert len(plain["attempts"]) == 1
    assert not (env.job_dir("PLAIN-1", "failed") / "work" / "feedback.json").exists()

    crashy = env.wait_job("CRASHY-1", "done")
    assert starts_of(env, "CRASHY-1") == [1, 2]
    assert len(crashy["attempts"]) == 2
    assert not (env.job_dir("CRASHY-1", "done") / "work" / "feedback.json").exists()
    assert d.stop() == 0


def test_followup_with_the_id_of_a_held_order_fails(env: Env) -> None:
    """An order an operator holds in held/ is known: a follow-up reusing its id fails, the held order stays."""
    env.configure(agents={"worker": handing_off(env, followup("HELD-ID", to="worker", sender="worker"))})
    (env.root / "held").mkdir(parents=True, exist_ok=True)
    held = json.dumps(order("HELD-ID"))
    (env.root / "held" / "HELD-ID.json").write_text(held)
    env.drop(order("HANDS-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 1
    result = env.result("HANDS-1", "failed")
    assert check(result, "followups_valid")["ok"] is False
    assert "job_id HELD-ID is already known" in detail_text(result, "followups_valid")
    assert (env.root / "held" / "HELD-ID.json").read_text() == held
    assert not (env.root / "done" / "HELD-ID").exists()


def _done_parent_with_a_followup(tmp_path: Path) -> tuple[Layout, SqliteLedger]:
    """A root whose ledger holds P-1 done and its follow-up C-1 reserved, C-1's order in P-1's outbox."""
    layout = Layout(tmp_path / "root")
    layout.create()
    ledger = SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)
    ledger.register(DaemonInfo(f"t-{os.getpid()}", os.getpid(), "localhost", time.time()))
    (claimed,) = ledger.claim([ClaimRequest("P-1", "worker", "P-1.json", "d")])
    assert isinstance(claimed, Claimed)
    assert ledger.reserve("P-1", claimed.token, 0, [Child("C-1", "worker", "C-1.json")]) == []
    assert ledger.finish([Finish("P-1", claimed.token, Row.DONE)]) == [True]
    outbox = layout.job(State.DONE, "P-1") / "work" / "outbox"
    outbox.mkdir(parents=True)
    (outbox / "C-1.json").write_text(json.dumps(order("C-1")))
    return layout, ledger


def test_two_releases_of_one_parent_at_once_link_its_followup_once(tmp_path: Path) -> None:
    """A daemon finishing a decision and its housekeeping release one parent together; a claim takes the file between.

    The first release's link is claimed (unlinked) at once; the second release, which had read the
    same reserved row, must not link the follow-up into inbox/ again (it would be refused as known).
    """
    layout, ledger = _done_parent_with_a_followup(tmp_path)
    try:
        read = ledger.pending_releases
        both_read = threading.Barrier(2, timeout=2)

        def slow_read(parent: str | None = None) -> list[Entry]:
            rows = read(parent)
            with contextlib.suppress(threading.BrokenBarrierError):
                both_read.wait()  # the code before: both threads hold the reserved row here
            return rows

        ledger.pending_releases = slow_read  # type: ignore[method-assign]
        linked: list[str] = []

        def claimed_at_once(name: str) -> None:
            linked.append(name)
            (layout.inbox / name).unlink(missing_ok=True)  # a daemon's claim takes the file

        counts: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: counts.append(release_followups(layout, ledger, "P-1", released=claimed_at_once))
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(counts) == [0, 1] and linked == ["C-1.json"], (counts, linked)
        assert list(layout.inbox.iterdir()) == []
    finally:
        ledger.close()


# One release in its own process: it reads the pending rows, waits until the other process has
# read them too (a file each), then releases; a claim takes each copy it links at once.
_RELEASER = """
import os, sys, time
from pathlib import Path
from dispatcher.job.followups import release_followups
from dispatcher.layout import Layout
from dispatcher.ledger.sqlite import SqliteLedger

root, me, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
layout = Layout(root)
ledger = SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)
read = ledger.pending_releases

def slow_read(parent=None):
    rows = read(parent)
    (root / me).touch()
    end = time.monotonic() + 10
    while not (root / other).exists() and time.monotonic() < end:
        time.sleep(0.01)
    return rows

def claimed_at_once(name):
    with open(root / "linked", "a") as f:
        f.write(name + "\\n")
    (layout.inbox / name).unlink(missing_ok=True)

ledger.pending_releases = slow_read
print(release_followups(layout, ledger, "P-1", released=claimed_at_once))
ledger.close()
"""


def test_two_processes_releasing_one_parent_at_once_link_its_followup_once(tmp_path: Path) -> None:
    """A command approving a parent and a daemon's housekeeping (or two daemons) release it together.

    Both read the reserved row; a claim takes the first copy from inbox/ at once. The second process
    must not link the follow-up again (it would be refused as known): the ledger's turn is taken.
    """
    import subprocess

    from conftest import cli_env

    layout, ledger = _done_parent_with_a_followup(tmp_path)
    ledger.close()
    root = str(layout.root)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RELEASER, root, me, other],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
        )
        for me, other in (("read-a", "read-b"), ("read-b", "read-a"))
    ]
    outs = [p.communicate(timeout=DEADLINE) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = sorted(int(out.strip().splitlines()[-1]) for out, _ in outs)
    linked = (layout.root / "linked").read_text().split()
    assert counts == [0, 1] and linked == ["C-1.json"], (counts, linked)
    assert list(layout.inbox.iterdir()) == []


def _released_file(env: Env, job_id: str, folder: str = "inbox") -> Path:
    """Wait for the follow-up's released file in inbox/ (or held/) and return it."""
    found: list[Path] = []

    def there() -> bool:
        found[:] = [p for p in (env.root / folder).glob("*.json") if json.loads(p.read_text())["job_id"] == job_id]
        return len(found) == 1

    wait_until(there, what=f"{job_id} released into {folder}/")
    return found[0]


def test_a_released_follow_up_edited_before_it_runs_runs_once_with_its_ledger_lineage(env: Env) -> None:
    """Section 2: the daemon takes lineage from its ledger, never from the file. A released follow-up waiting for its
    paused agent is rewritten under its name (a new file renamed over it, task and hops changed): it runs once, with
    the new task and with parent and hops from the ledger. It was refused as a known id and lost for good."""
    env.configure(agents={"intake": handing_off(env, followup("ED-B", to="worker", sender="intake")),
                          "worker": env.agent()})  # fmt: skip
    d = started(env)
    env.cli("pause", "worker", check=True)
    env.drop(order("ED-A", to="intake"))
    released = _released_file(env, "ED-B")
    body = json.loads(released.read_text())
    assert (body["parent"], body["hops"]) == ("ED-A", 1)
    edited = {**body, "task": "the task as an operator fixed it", "hops": 0, "parent": None}
    tmp = env.root / "inbox" / ".edit.tmp"
    tmp.write_text(json.dumps(edited))
    os.rename(tmp, released)
    env.cli("resume", "worker", check=True)
    result = env.wait_job("ED-B", "done")
    assert dropped_order(env, "ED-B", "done") == edited  # order.json: the file, byte for byte
    ran = json.loads((env.job_dir("ED-B", "done") / "work" / "order.json").read_text())  # what the agent was given
    assert ran["task"] == "the task as an operator fixed it"
    assert (ran["parent"], ran["hops"], result["parent"]) == ("ED-A", 1, "ED-A")
    assert starts_of(env, "ED-B") == [1] and not refusals_of(env, "ED-B")
    assert d.stop() == 0


def test_a_held_follow_up_edited_in_held_and_released_runs_and_another_file_with_its_id_is_refused(env: Env) -> None:
    """`hold` of a released follow-up, its task edited in place in held/, `release`: it runs once with the edit and
    its ledger lineage. A second file with the same id under another name is still refused as a duplicate."""
    env.configure(agents={"intake": handing_off(env, followup("EH-B", to="worker", sender="intake")),
                          "worker": env.agent()})  # fmt: skip
    d = started(env)
    env.cli("pause", "worker", check=True)
    env.drop(order("EH-A", to="intake"))
    _released_file(env, "EH-B")
    env.cli("hold", "EH-B", check=True)
    held = _released_file(env, "EH-B", "held")
    body = json.loads(held.read_text())
    held.write_text(json.dumps({**body, "task": "edited while held"}))
    env.cli("release", "EH-B", check=True)
    env.drop(order("EH-B", to="worker"), name="EH-B-copy.json")  # whichever is taken first, only the released runs
    env.cli("resume", "worker", check=True)
    env.wait_job("EH-B", "done")
    wait_until(lambda: len(refusals_of(env, "EH-B")) == 1, what="the second file with EH-B refused")
    ran = json.loads((env.job_dir("EH-B", "done") / "work" / "order.json").read_text())
    assert (ran["task"], ran["parent"], ran["hops"]) == ("edited while held", "EH-A", 1)
    refused = json.loads((refusals_of(env, "EH-B")[0] / "result.json").read_text())
    assert "already known" in refused["reason"], refused
    assert starts_of(env, "EH-B") == [1]
    assert d.stop() == 0
