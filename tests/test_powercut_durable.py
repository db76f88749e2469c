"""Power cuts at two moments the workload of tests/test_powercut.py does not reach.

That suite prepares its roots with a synced run first; here the root is fresh, as a
user's is at its very first start. The daemon runs on the strict lazyfs mount (only
what was fsynced survives), the power is cut at a log event, the durable model is
written back and looked at the way a user would.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from powercut.harness import FAKE_AGENT, TESTS, LazyMount, fsync_path, start_run

from dispatcher.layout import Layout

DEADLINE = 60.0


class Rig:
    """A fresh dispatch root on a strict lazyfs mount, its config, and the daemon's log."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mnt = tmp / "mnt"
        self.root = self.mnt / "dispatch"
        self.config = tmp / "dispatcher.yaml"
        self.log = tmp / "daemon.log"
        self.fs = LazyMount(tmp / "backing", self.mnt, "strict")
        self.daemon: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "WATCHDOG_"))}
        env["PYTHONPATH"] = str(TESTS.parent) + os.pathsep + env.get("PYTHONPATH", "")
        env["DISPATCHER_LOCAL_FUSE"] = "lazyfs"  # the ledger's way past its network-filesystem refusal
        return env

    def start(self, agent: dict[str, Any]) -> None:
        """Mount, make the root (durably: the user's part), write the config, start `dispatcher run`."""
        self.fs.start()
        self.root.mkdir()
        fsync_path(self.mnt)
        cfg = {"root": str(self.root), "settle": 0.1, "kill_grace": 1, "stop_timeout": 10, "agents": {"worker": agent}}
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.daemon = start_run(self.config, self.log, self.tmp, self.env())

    def wait_event(self, event: str, **match: Any) -> dict[str, Any]:
        """Wait for the daemon's log line with this event (and these values)."""
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            for line in self.log.read_bytes().splitlines():
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                    return dict(ev)
            assert self.daemon is not None and self.daemon.poll() is None, self.log.read_text(errors="replace")
            time.sleep(0.01)
        raise AssertionError(f"no {event} {match} within {DEADLINE} s: {self.log.read_text(errors='replace')[-2000:]}")

    def cut(self) -> Path:
        """Cut the power, kill the daemon and its agents, and put the durable model where the mount was."""
        self.fs.cmd(cmd="cut")
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait(DEADLINE)
        durable = self.tmp / "durable"
        try:
            self.fs.cmd(cmd="dump", dest=str(durable))
        finally:
            self.fs.unmount()
        for name in os.listdir(durable):
            os.rename(durable / name, self.mnt / name)
        return self.root

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dispatcher", "--config", str(self.config), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=self.tmp, env=self.env())

    def close(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait(DEADLINE)
        self.fs.unmount()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A fresh root on a strict lazyfs mount; the daemon killed and the mount gone at teardown."""
    r = Rig(tmp_path)
    yield r
    r.close()


def agent(**settings: Any) -> dict[str, Any]:
    return {"command": [sys.executable, str(FAKE_AGENT)], "timeout": 30, "writes": ["reports/**"], **settings}


def test_a_fresh_roots_folders_survive_a_cut_right_after_its_first_start(rig: Rig) -> None:
    """A power cut just after a fresh root's first `run` logged daemon.ready keeps every folder of its layout."""
    rig.start(agent())
    rig.wait_event("daemon.ready")
    root = rig.cut()
    layout = Layout(root)
    missing = [str(d.relative_to(root)) for d in layout.all_dirs() if not d.is_dir()]
    assert missing == [], f"lost after the cut: {missing}"
    for name in ("inbox", "active", "done", "failed", ".state"):
        assert (root / name).is_dir(), name


def test_a_done_jobs_output_and_receipt_survive_a_cut_just_after_job_done(rig: Rig) -> None:
    """A power cut just after `job.done` leaves the done job's accept.output and receipt as the checks read them."""
    rig.start(agent())
    rig.wait_event("daemon.ready")
    order = {
        "job_id": "J1",
        "from": "tester",
        "to": "worker",
        "task": "Assign each request to one team.",
        "items": [{"id": f"R{i}", "summary": f"request {i}"} for i in (1, 2, 3)],
        "accept": {"output": "reports/out.csv"},
    }
    inbox = rig.root / "inbox"
    tmp = inbox / ".J1.tmp"
    with tmp.open("wb") as f:  # dropped durably, as a careful user does: what is lost is the daemon's loss
        f.write(json.dumps(order).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, inbox / "J1.json")
    fsync_path(inbox)
    rig.wait_event("job.done", job_id="J1")
    root = rig.cut()
    recovered = rig.cli("run", "--once")
    assert recovered.returncode == 0, recovered.stderr
    job = root / "done" / "J1"
    result = json.loads((job / "result.json").read_bytes())
    checks = {c["name"]: c["ok"] for c in result["checks"]}
    assert result["state"] == "done" and checks["output_rows"] is True, result
    rows = list(csv.DictReader(io.StringIO((job / "work" / "reports" / "out.csv").read_text())))
    assert [r["id"] for r in rows] == ["R1", "R2", "R3"], rows
    receipt = json.loads((job / "work" / "receipt.json").read_bytes())
    assert receipt["job_id"] == "J1" and receipt["status"] == "done", receipt


def test_making_the_layout_of_an_existing_root_fsyncs_nothing(tmp_path: Path) -> None:
    """Layout.create on a root whose folders exist fsyncs nothing; on a fresh one, each new parent once."""
    fs = LazyMount(tmp_path / "backing", tmp_path / "mnt", "strict")
    fs.start()
    try:
        layout = Layout(fs.mountpoint / "dispatch")
        before = fs.cmd(cmd="status")["ops"].get("fsyncdir", 0)
        assert layout.create() is True
        made = fs.cmd(cmd="status")["ops"].get("fsyncdir", 0) - before
        assert made == 3, f"{made} folder fsyncs: the mount point, the root and .state/, each once"
        assert layout.create() is False
        assert fs.cmd(cmd="status")["ops"].get("fsyncdir", 0) - before == made
    finally:
        fs.unmount()


def test_a_hold_survives_a_cut_right_after_the_command(rig: Rig) -> None:
    """`hold` of a queued order, then a power cut: the order is in held/ and not back in inbox/, so it never runs."""
    rig.start(agent())
    rig.wait_event("daemon.ready")
    assert rig.daemon is not None
    rig.daemon.send_signal(signal.SIGTERM)
    assert rig.daemon.wait(DEADLINE) == 0
    order = {"job_id": "H1", "from": "tester", "to": "worker", "task": "Wait for a person.", "items": [{"id": "R1"}]}
    inbox = rig.root / "inbox"
    with (inbox / ".H1.tmp").open("wb") as f:  # dropped durably: what is lost is the command's loss
        f.write(json.dumps(order).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(inbox / ".H1.tmp", inbox / "H1.json")
    fsync_path(inbox)
    held = rig.cli("hold", "H1")
    assert held.returncode == 0, held.stderr
    root = rig.cut()
    assert (root / "held" / "H1.json").is_file() and not (root / "inbox" / "H1.json").exists()
    listed = rig.cli("list", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["job_id"], r["state"]) for r in rows] == [("H1", "held")], listed.stdout


REFUSED = [("junk.txt", b"not an order\n"), ("bad.json", b'{"job_id": "BAD1", "from": "x"}')]


@pytest.mark.parametrize(("name", "data"), REFUSED)
def test_a_refusal_survives_a_cut_right_after_it_was_logged(rig: Rig, name: str, data: bytes) -> None:
    """A refused file, then a power cut just after `job.refused`: after recovery it is refused exactly once, its
    folder holding the original bytes and a whole result.json with the reason; it is not back in inbox/."""
    rig.start(agent())
    rig.wait_event("daemon.ready")
    inbox = rig.root / "inbox"
    with (inbox / f".{name}.tmp").open("wb") as f:  # dropped durably: what is lost is the daemon's loss
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(inbox / f".{name}.tmp", inbox / name)
    fsync_path(inbox)
    rig.wait_event("job.refused", file=name)
    root = rig.cut()
    recovered = rig.cli("run", "--once")
    assert recovered.returncode in (0, 1), recovered.stderr
    stem = name.rsplit(".", 1)[0]
    folders = [p for p in (root / "failed").iterdir() if p.name.startswith(f"{stem}@")]
    assert len(folders) == 1, [p.name for p in (root / "failed").iterdir()]
    kept = [p for p in folders[0].iterdir() if p.name.startswith("order")]
    assert [p.read_bytes() for p in kept] == [data]
    result = json.loads((folders[0] / "result.json").read_bytes())
    assert result["state"] == "failed" and result["reason"], result
    assert not (inbox / name).exists()


def drop_durably(rig: Rig, order: dict[str, Any]) -> None:
    """Drop an order as a careful user does (fsynced, renamed, inbox/ fsynced): what is lost is the daemon's loss."""
    inbox = rig.root / "inbox"
    tmp = inbox / f".{order['job_id']}.tmp"
    with tmp.open("wb") as f:
        f.write(json.dumps(order).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, inbox / f"{order['job_id']}.json")
    fsync_path(inbox)


def test_a_revision_survives_a_cut_right_after_job_revised(rig: Rig) -> None:
    """A power cut just after the daemon carried out a `revise`: the job's given feedback.json is durable with its
    name, so its next attempt is not failed by writes_scope ("feedback.json was given and is deleted")."""
    rig.start(agent(review=True, retry_safe=True, max_attempts=3))  # an attempt the cut interrupts runs again
    rig.wait_event("daemon.ready")
    drop_durably(rig, {"job_id": "V1", "from": "tester", "to": "worker", "task": "Do it.", "items": [{"id": "R1"}]})
    rig.wait_event("job.review", job_id="V1")
    revised = rig.cli("revise", "V1", "--note", "once more")
    assert revised.returncode == 0, revised.stderr
    rig.wait_event("job.revised", job_id="V1")
    root = rig.cut()
    rig.cli("run", "--once")
    failed = root / "failed" / "V1" / "result.json"
    assert not failed.exists(), failed.read_text()
    result = json.loads((root / "review" / "V1" / "result.json").read_bytes())
    checks = {c["name"]: (c["ok"], c["detail"]) for c in result["checks"]}
    assert result["state"] == "review" and checks["writes_scope"][0] is True, result
    assert result["attempts"][0]["n"] == 2, result["attempts"]  # the revision's attempts, from the second
    feedback = json.loads((root / "review" / "V1" / "work" / "feedback.json").read_bytes())
    assert feedback["note"] == "once more", feedback


def test_a_join_survives_a_cut_right_after_job_joined(rig: Rig) -> None:
    """A power cut just after a join moved into active/: its parents.json is durable with its name, so the join
    runs and is done, not failed by writes_scope ("parents.json was given and is deleted")."""
    rig.start(agent(retry_safe=True, max_attempts=3))  # an attempt the cut interrupts runs again
    rig.wait_event("daemon.ready")
    drop_durably(rig, {"job_id": "JN", "from": "t", "to": "worker", "task": "Join.", "items": [{"id": "R1"}],
                       "after": ["P1"]})  # fmt: skip
    rig.wait_event("job.waiting", job_id="JN")
    drop_durably(rig, {"job_id": "P1", "from": "t", "to": "worker", "task": "Parent.", "items": [{"id": "R1"}]})
    rig.wait_event("job.joined", job_id="JN")
    root = rig.cut()
    rig.cli("run", "--once")
    failed = root / "failed" / "JN" / "result.json"
    assert not failed.exists(), failed.read_text()
    result = json.loads((root / "done" / "JN" / "result.json").read_bytes())
    assert result["state"] == "done", result
    parents = json.loads((root / "done" / "JN" / "work" / "parents.json").read_bytes())
    assert [p["job_id"] for p in parents] == ["P1"], parents
