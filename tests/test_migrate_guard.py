"""`ledger migrate` never copies a ledger a daemon is still writing: it refuses, naming the live daemon."""

from __future__ import annotations

from conftest import Env, order


def test_ledger_migrate_refuses_while_a_daemon_runs_and_names_it(env: Env) -> None:
    """With a daemon alive on the SQLite root, migrate exits 2 with one line naming its pid; nothing is touched."""
    d = env.daemon()
    d.wait_ready()
    env.drop(order("MIG-1"))
    env.wait_job("MIG-1", "done")
    proc = env.cli("ledger", "migrate", "-", input="postgresql://disp@127.0.0.1:1/ledger\n")
    assert proc.returncode == 2 and proc.stdout == ""
    pid = d.proc.pid  # type: ignore[union-attr]
    assert proc.stderr.startswith(f"{env.root}: ledger migrate: a daemon is running on this root ({pid} on ")
    assert proc.stderr.endswith("stop every daemon first, or ids it claims meanwhile are not copied\n")
    assert d.stop() == 0
