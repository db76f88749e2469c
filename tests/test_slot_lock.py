"""Slot locks: a real flock per slot file, exclusive across processes, kept file, gone with its holder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import cli_env

from dispatcher.ledger.flocks import FlockSlots, SlotLock

HOLD = """
import sys, time
from dispatcher.ledger.flocks import SlotLock
lock = SlotLock(sys.argv[1])
print("took" if lock.acquire() else "busy", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_slot_lock_excludes_a_second_holder_in_this_process_and_keeps_its_file(tmp_path: Path) -> None:
    """Two SlotLocks on one file: the second fails while the first holds it, then takes it; the file stays."""
    path = tmp_path / "worker.0.lock"
    first, second = SlotLock(path), SlotLock(path)
    assert first.acquire()
    assert not second.acquire()
    first.release()
    assert second.acquire()
    second.release()
    assert path.exists()


def test_a_slot_held_by_another_process_is_busy_until_that_process_dies(tmp_path: Path) -> None:
    """A slot another process holds cannot be taken; once that process is killed the kernel frees it."""
    path = tmp_path / "worker.0.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "took"
        assert not SlotLock(path).acquire()
        slots = FlockSlots(tmp_path)
        assert slots.take("worker", 1) is None  # the only slot of a concurrency-1 agent is busy
        assert slots.take("worker", 2) == 1  # a second slot is free
        slots.release_all()
    finally:
        holder.kill()
        holder.communicate()
    mine = SlotLock(path)
    assert mine.acquire()
    mine.release()


def test_flock_slots_remake_a_removed_slots_folder(tmp_path: Path) -> None:
    """Taking a slot after .state/slots/ was removed by hand makes the folder again instead of failing."""
    folder = tmp_path / "slots"
    slots = FlockSlots(folder)
    assert slots.take("worker", 1) == 0
    slots.free("worker", 0)
    os.unlink(folder / "worker.0.lock")
    os.rmdir(folder)
    assert slots.take("worker", 1) == 0
    assert (folder / "worker.0.lock").exists()
    slots.release_all()


def test_a_daemon_info_file_that_cannot_be_written_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A write of a daemon's info file that fails part way (a full disk; here a file size limit) raises, and leaves
    neither a half-written info file nor its temporary file in .state/daemons/ (nothing ever removed it)."""
    script = f"""
import resource, signal, time
from pathlib import Path
from dispatcher.ledger.base import DaemonInfo
from dispatcher.ledger.flocks import write_info
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
try:
    write_info(Path({str(tmp_path)!r}), DaemonInfo("host-1-ab", 1, "host", time.time()))
except OSError as exc:
    print("raised", exc.errno)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.stdout.startswith("raised"), proc.stdout + proc.stderr
    assert os.listdir(tmp_path) == []
