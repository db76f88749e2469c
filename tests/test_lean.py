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


def test_leaving_out_and_bringing_back_in_a_child_process(tmp_path: Path) -> None:
    """In a fresh interpreter: ssl cannot be imported once left out, and can again after with_openssl."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from dispatcher import lean\n"
        "lean.without_openssl(['/usr/bin/dispatcher', 'run'])\n"
        "import hashlib\n"
        "assert hashlib.sha256(b'abc').hexdigest().startswith('ba7816bf')\n"
        "try:\n"
        "    import ssl\n"
        "    print('ssl imported')\n"
        "except ImportError:\n"
        "    print('ssl left out')\n"
        "lean.with_openssl()\n"
        "import ssl\n"
        "print('ssl back', ssl.OPENSSL_VERSION.split()[0])\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["ssl left out", "ssl back OpenSSL"]
