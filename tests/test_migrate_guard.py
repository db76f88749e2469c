"""`ledger migrate` never copies a ledger a daemon is still writing: it refuses, naming the live daemon."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import yaml
from conftest import Env, cli_env, order, wait_until

pytest_plugins = ["pg_fixtures"]


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


@pytest.mark.postgres
def test_ledger_migrate_refuses_while_a_daemon_on_postgresql_runs_on_the_root(env: Env, pg_db: str) -> None:
    """Migrated, the root runs a daemon on PostgreSQL: a second migrate of the SQLite ledger (and a rebuild) exits 2,
    naming it, as for a daemon on SQLite."""
    first = env.daemon()
    first.wait_ready()
    env.drop(order("MIG-2"))
    env.wait_job("MIG-2", "done")
    assert first.stop() == 0
    env.cli("ledger", "migrate", "-", input=f"{pg_db}\n", check=True)  # its SQLite ledger stays on the root
    pg_config = env.tmp / "pg.yaml"
    pg_config.write_text(yaml.safe_dump({**env.settings, "ledger": pg_db}))
    out = env.tmp / "pg-daemon.log"
    with out.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(pg_config), "run"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=env.tmp,
            env=cli_env(),
        )
    try:
        wait_until(lambda: "daemon.ready" in out.read_text(), 60, "the PostgreSQL daemon ready")
        migrate = env.cli("ledger", "migrate", "-", input="postgresql://disp@127.0.0.1:1/ledger\n")
        assert migrate.returncode == 2 and migrate.stdout == "", migrate.stdout
        assert migrate.stderr.startswith(f"{env.root}: ledger migrate: a daemon is running on this root (")
        assert f"-{proc.pid}-" in migrate.stderr.splitlines()[0], migrate.stderr
        rebuild = env.cli("ledger", "rebuild")
        assert rebuild.returncode == 2 and f"-{proc.pid}-" in rebuild.stderr, rebuild.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
