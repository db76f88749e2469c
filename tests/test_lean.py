"""The daemon's process carries no OpenSSL unless a part that needs it is loaded (``dispatcher.lean``)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import sys
from pathlib import Path

import pytest
from conftest import Env, order, wait_until

from dispatcher import lean


def openssl_mapped(pid: int) -> list[str]:
    """Return the OpenSSL libraries and Python's ssl extension mapped into a process."""
    names = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return sorted(
        n for n in names if any(k in os.path.basename(n) for k in ("libssl", "libcrypto", "_ssl.", "_hashlib."))
    )


def test_a_running_daemon_maps_no_openssl_and_still_digests_orders(env: Env) -> None:
    """`run` with the SQLite ledger: no libssl or libcrypto in the process; digests as before; jobs end done."""
    d = env.daemon()
    d.wait_ready()
    assert openssl_mapped(d.proc.pid) == []
    env.drop(order("LEAN-1"))
    env.wait_job("LEAN-1", "done")
    dropped = (env.root / "done" / "LEAN-1" / "order.json").read_bytes()  # the file as it was dropped
    with sqlite3.connect(env.root / ".state" / "ledger.sqlite3") as db:
        (recorded,) = db.execute("SELECT digest FROM jobs WHERE job_id = 'LEAN-1'").fetchone()
    assert recorded == hashlib.sha256(dropped).hexdigest()


def test_the_metrics_file_brings_openssl_back_for_its_library(env: Env) -> None:
    """prometheus_client imports ssl: with metrics_file set the daemon loads it and writes the file."""
    metrics = env.tmp / "dispatcher.prom"
    env.configure(metrics_file=str(metrics))
    d = env.daemon()
    d.wait_ready()
    wait_until(metrics.exists, 30, "the metrics file")
    assert any("libssl" in n or "_ssl." in n for n in openssl_mapped(d.proc.pid))


@pytest.mark.parametrize(
    ("argv", "daemon"),
    [
        (["/usr/bin/dispatcher", "run"], True),
        (["/usr/bin/dispatcher", "--config", "x.yaml", "run", "--once"], True),
        (["/usr/bin/dispatcher", "--config", "run", "status"], False),  # "run" is the config file's name
        (["/usr/bin/dispatcher", "status"], False),
        ([f"{os.sep}src{os.sep}dispatcher{os.sep}__main__.py", "--root", "/r", "run"], True),
        (["/usr/bin/pytest", "-k", "run"], False),
        ([f"{os.sep}x{os.sep}pytest{os.sep}__main__.py", "run"], False),
        ([], False),
    ],
)
def test_only_the_dispatchers_own_run_command_leaves_openssl_out(argv: list[str], daemon: bool) -> None:
    assert lean.runs_daemon(argv) is daemon


PROBE_START = (
    "import sys\nfrom dispatcher import lean\nlean.without_openssl(['/usr/bin/dispatcher', 'run'])\nimport hashlib\n"
)


def probe(tmp_path: Path, source: str) -> list[str]:
    """Run source in a fresh interpreter that left OpenSSL out as the daemon does; return the lines it printed."""
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text(PROBE_START + source)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_leaving_out_and_bringing_back_in_a_child_process(tmp_path: Path) -> None:
    """In a fresh interpreter: ssl cannot be imported once left out, and can again after with_openssl."""
    lines = probe(
        tmp_path,
        "assert hashlib.sha256(b'abc').hexdigest().startswith('ba7816bf')\n"
        "try:\n"
        "    import ssl\n"
        "    print('ssl imported')\n"
        "except ImportError:\n"
        "    print('ssl left out')\n"
        "lean.with_openssl()\n"
        "import ssl\n"
        "print('ssl back', ssl.OPENSSL_VERSION.split()[0])\n",
    )
    assert lines == ["ssl left out", "ssl back OpenSSL"]


def test_large_data_is_hashed_by_openssl_loaded_then_small_data_by_pythons_own(tmp_path: Path) -> None:
    """In a process that left OpenSSL out: a small digest keeps it out, a large one loads it; digests agree."""
    lines = probe(
        tmp_path,
        "from dispatcher import fsutil\n"
        "small, large = b'x' * 100, b'y' * (lean.BIG_HASH_BYTES + 1)\n"
        "assert fsutil.digest(small) == hashlib.sha256(small).hexdigest()\n"
        "print('after small', sys.modules.get('_hashlib') is not None)\n"
        "h = lean.sha256_for(len(large))()\n"
        "h.update(large)\n"
        "assert h.hexdigest() == fsutil.digest(large)\n"
        "print('after large', type(sys.modules.get('_hashlib')).__name__, lean.sha256_for(len(large)).__name__)\n",
    )
    assert lines == ["after small False", "after large module openssl_sha256"]
    # and the digest is SHA-256 itself, not only self-consistent
    from dispatcher import fsutil

    large = b"y" * (lean.BIG_HASH_BYTES + 1)
    assert fsutil.digest(large) == hashlib.sha256(large).hexdigest()


def test_a_daemon_given_a_large_order_loads_openssl_for_it_and_records_the_same_digests(env: Env) -> None:
    """A 200 KB order: hashed by OpenSSL in the daemon; the ledger's and job.json's digests are SHA-256's."""
    d = env.daemon()
    d.wait_ready()
    big = order("LEAN-BIG", meta={"lines": ["a line of notes the agent may read"] * 6000})
    env.drop(big)
    env.wait_job("LEAN-BIG", "done")
    folder = env.root / "done" / "LEAN-BIG"
    dropped = (folder / "order.json").read_bytes()
    assert len(dropped) > lean.BIG_HASH_BYTES
    with sqlite3.connect(env.root / ".state" / "ledger.sqlite3") as db:
        (recorded,) = db.execute("SELECT digest FROM jobs WHERE job_id = 'LEAN-BIG'").fetchone()
    assert recorded == hashlib.sha256(dropped).hexdigest()
    import json

    given = json.loads((folder / "job.json").read_text())["given"]
    assert given["order.json"] == hashlib.sha256((folder / "work" / "order.json").read_bytes()).hexdigest()
    assert any("_hashlib." in n or "libcrypto" in n for n in openssl_mapped(d.proc.pid))
