"""A command whose PostgreSQL ledger cannot be reached answers in one line within 5 seconds."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import Env, cli_env, order

LIMIT_S = 5.0


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung server or a cut-off path)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused
    return port


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_status_with_the_ledger_down_answers_in_one_line_within_5_s(env: Env, silent_server: int, kind: str) -> None:
    """status, list, submit, cancel and ledger migrate: exit non-zero, one line on stderr, nothing else, < 5 s."""
    port = _closed_port() if kind == "refused" else silent_server
    url = f"postgresql://disp@127.0.0.1:{port}/ledger"
    (env.tmp / "o.json").write_text(json.dumps(order("X-1")))
    migrate = ("ledger", "migrate", "-")
    env.configure(ledger=url)
    for args in (("status",), ("list",), ("submit", str(env.tmp / "o.json")), ("cancel", "X-1"), migrate):
        if args == migrate:
            env.configure()  # migrate reads the SQLite ledger and cannot reach the target
            env.cli("run", "--once", check=True)  # a SQLite ledger to copy
        started = time.monotonic()
        proc = env.cli(*args, input=url + "\n")
        took = time.monotonic() - started
        assert took < LIMIT_S, f"{args} took {took:.1f} s"
        assert proc.returncode != 0 and proc.stdout == "", (args, proc.stdout)
        assert proc.stderr.count("\n") == 1 and "cannot be reached" in proc.stderr, (args, proc.stderr)
        assert not proc.stderr.startswith("{") and "ledger.reconnecting" not in proc.stderr


@pytest.mark.parametrize("args", [("status",), ("ledger", "migrate", "-")])
def test_a_command_whose_own_start_was_slow_still_answers_within_5_s(
    env: Env, silent_server: int, args: tuple[str, ...]
) -> None:
    """A busy machine: 2.5 s pass before the command's code runs (as a slow interpreter start), then a silent server.

    libpq's shortest connect timeout (2 s) on top would end past 5 s; the command gives up in time instead.
    """
    url = f"postgresql://disp@127.0.0.1:{silent_server}/ledger"
    if args[0] == "ledger":
        env.configure()
        env.cli("run", "--once", check=True)  # a SQLite ledger to copy
    else:
        env.configure(ledger=url)
    argv = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), *args]
    started = time.monotonic()
    # the same process sleeps, then becomes the command: its age counts from the sleep's start
    proc = subprocess.run(
        ["sh", "-c", 'sleep 2.5; exec "$@"', "sh", *argv],
        input=url + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.tmp,
        env=cli_env(),
    )
    took = time.monotonic() - started
    assert took < LIMIT_S, f"{args} took {took:.1f} s"
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and "cannot be reached" in proc.stderr, proc.stderr
