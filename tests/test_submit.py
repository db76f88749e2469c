"""`dispatcher submit` under races, on a full disk and on a read-only one.

Each test drives the real CLI in subprocesses, the way two users (or two scripts) would,
and then looks at inbox/: exactly the files that should be there, and never a hidden
temporary file left behind.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, order

from dispatcher.layout import Layout
from dispatcher.store import queued


def inbox_names(env: Env) -> list[str]:
    """Return every name in inbox/, hidden ones included, sorted."""
    inbox = env.root / "inbox"
    return sorted(os.listdir(inbox)) if inbox.exists() else []


def one_line(stderr: str) -> str:
    """Assert stderr is exactly one non-empty line without a traceback; return it."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
    assert "Traceback" not in stderr
    return lines[0]


def test_two_submits_of_one_file_at_once_give_one_job_and_one_refusal(env: Env) -> None:
    """20 times, two concurrent submits of one file: one exits 0, the other 2 naming file and id; no temp left."""
    dropped: list[str] = []
    for n in range(20):
        job_id = f"RACE-{n}"
        path = env.tmp / f"race-{n}.json"
        path.write_text(json.dumps(order(job_id)))
        argv = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "submit", str(path)]
        procs = [
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=env.tmp, env=cli_env()
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        codes = [p.returncode for p in procs]
        assert sorted(codes) == [0, 2], (codes, outs)
        winner, loser = (outs[0], outs[1]) if codes[0] == 0 else (outs[1], outs[0])
        assert winner == (f"{job_id}\n", "")
        assert loser[0] == ""
        line = one_line(loser[1])
        assert line.startswith(f"{path}: job_id: {job_id} is already known"), line
        dropped.append(f"{job_id}.json")
        assert inbox_names(env) == sorted(dropped), f"round {n}"


@pytest.fixture
def small_disk(env: Env) -> Iterator[Path]:
    """Mount a 1 MiB tmpfs of this test's own; the dispatch root lives on it. Unmounted at the end."""
    disk = env.tmp / "disk"
    disk.mkdir()
    # 1 MiB rather than less: the SQLite ledger alone (file, WAL and shared memory) takes about 64 KiB.
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip() or proc.returncode}")
    try:
        env.root = disk / "dispatch"
        env.configure()
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write a file on disk until no space is left; return its path."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def submit_file(env: Env, name: str, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Write body to env.tmp/name (off the small disk) and `dispatcher submit` it."""
    (env.tmp / name).write_text(json.dumps(body))
    return env.cli("submit", name)


def test_submit_onto_a_full_disk_is_one_line_and_leaves_no_temp_file(env: Env, small_disk: Path) -> None:
    """On a full disk, submit exits 2 with `<file>: cannot submit: ...`, and inbox/ holds no temporary file."""
    first = submit_file(env, "first.json", order("DISK-1"))
    assert first.returncode == 0, first.stderr
    filler = fill(small_disk)

    full = submit_file(env, "full.json", order("DISK-2"))
    assert full.returncode == 2
    assert one_line(full.stderr).startswith("full.json: cannot submit: ")
    assert inbox_names(env) == ["DISK-1.json"]

    # Room for the ledger to open but not for this order: the write itself runs out of space.
    os.truncate(filler, filler.stat().st_size - 128 * 1024)
    big = submit_file(env, "big.json", order("DISK-3", meta={"pad": "x" * 400_000}))
    assert big.returncode == 2
    assert one_line(big.stderr) == "big.json: cannot submit: No space left on device"
    assert inbox_names(env) == ["DISK-1.json"]

    filler.unlink()
    again = submit_file(env, "big.json", order("DISK-3", meta={"pad": "x" * 400_000}))
    assert again.returncode == 0, again.stderr
    assert inbox_names(env) == ["DISK-1.json", "DISK-3.json"]


def test_submit_onto_a_read_only_root_is_one_line(env: Env, small_disk: Path) -> None:
    """On a read-only dispatch root, submit exits 2 with `<file>: cannot submit: Read-only file system`."""
    assert submit_file(env, "first.json", order("RO-1")).returncode == 0
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    if remount.returncode != 0:
        pytest.skip(f"remounting read-only is not permitted here: {remount.stderr.strip()}")
    proc = submit_file(env, "ro.json", order("RO-2"))
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "ro.json: cannot submit: Read-only file system"
    assert inbox_names(env) == ["RO-1.json"]


def test_submit_never_replaces_a_file_in_inbox(env: Env) -> None:
    """A file already named after the job id in inbox/ (another id inside) is kept; the order gets the next name."""
    inbox = env.root / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "NAME-1.json").write_text(json.dumps(order("OTHER-9")))
    proc = submit_file(env, "n.json", order("NAME-1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((inbox / "NAME-1.json").read_text())["job_id"] == "OTHER-9"
    assert json.loads((inbox / "NAME-1-2.json").read_text())["job_id"] == "NAME-1"
    assert inbox_names(env) == ["NAME-1-2.json", "NAME-1.json"]


def test_submit_refuses_an_id_whose_order_is_held(env: Env) -> None:
    """An order on hold in held/ is a submitted one: a second submit of its id exits 2, and nothing is dropped."""
    assert submit_file(env, "a.json", order("HELD-1")).returncode == 0
    assert env.cli("hold", "HELD-1").returncode == 0
    proc = submit_file(env, "b.json", order("HELD-1"))
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip() == "b.json: job_id: HELD-1 is already known (held in held/); a job id is never run twice"
    assert inbox_names(env) == []
    assert [p.name for p in (env.root / "held").iterdir()] == ["HELD-1.json"]


# -- finding queued ids without parsing every inbox file ------------------------------------------


def test_queued_ids_parse_only_files_that_can_hold_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only inbox files holding a wanted id literally, or a backslash, are parsed; an escaped id is still found."""
    layout = Layout(tmp_path)
    layout.inbox.mkdir()
    for i in range(50):
        (layout.inbox / f"other-{i}.json").write_text(json.dumps(order(f"OTHER-{i}")))
    (layout.inbox / "plain.yaml").write_text("job_id: WANT-1\nfrom: t\nto: worker\ntask: x\nitems: [{id: R1}]\n")
    escaped = json.dumps(order("WANT-2")).replace('"WANT-2"', '"\\u0057ANT-2"')
    (layout.inbox / "escaped.json").write_text(escaped)
    (layout.inbox / "mention.json").write_text(json.dumps(order("OTHER-X", task="not WANT-3, only its name")))
    (layout.inbox / ".hidden.json").write_text(json.dumps(order("WANT-4")))
    parsed: list[str] = []
    real = queued.parse_order

    def counting(data: bytes, name: str) -> Any:
        parsed.append(name)
        return real(data, name)

    monkeypatch.setattr(queued, "parse_order", counting)
    found = queued.queued_ids(layout.inbox, {"WANT-1", "WANT-2", "WANT-3", "WANT-4"})
    assert found == {"WANT-1", "WANT-2"}
    assert sorted(parsed) == ["escaped.json", "mention.json", "plain.yaml"]


def test_submit_and_validate_of_a_named_pipe_answer_at_once(env: Env) -> None:
    """`submit` or `validate` of a FIFO named like an order exits 2 at once with one line naming the file, instead
    of waiting for a writer that never comes; a link to a real order is followed (the user named it)."""
    env.configure()
    pipe = env.tmp / "pipe.json"
    os.mkfifo(pipe)
    for command in ("submit", "validate"):
        proc = env.cli(command, str(pipe), timeout=20)
        assert (proc.returncode, proc.stderr) == (2, f"{pipe}: a FIFO is not a work order\n"), proc
    real = env.tmp / "real.json"
    real.write_text(json.dumps(order("LINKED-1")))
    link = env.tmp / "link.json"
    link.symlink_to(real)
    assert env.cli("submit", str(link)).stdout == "LINKED-1\n"
