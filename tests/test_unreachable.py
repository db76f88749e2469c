"""A command whose PostgreSQL ledger cannot be reached answers in one line within 5 seconds."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import Env, cli_env, order

from dispatcher.ledger.base import LedgerUnavailable
from dispatcher.ledger.postgres import PostgresLedger
from dispatcher.store.ledgers import ANSWER_S, CONNECT_S, REACH_S

LIMIT_S = 5.0
pytestmark = pytest.mark.timing  # .ci/run: alone, after the parallel run
pytest_plugins = ["pg_fixtures"]


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


def test_commands_answer_within_5_s_while_another_session_holds_the_ledger_locked(env: Env, pg_db: str) -> None:
    """A server that answers but a jobs table someone holds locked (a long migration, a `LOCK TABLE` by hand):
    status, list, submit and cancel still answer in one line within 5 s, and work again once it is let go."""
    env.configure(ledger=pg_db)
    env.drop(order("L-1"))
    env.cli("run", "--once", check=True)  # the schema, and one job
    (env.tmp / "o.json").write_text(json.dumps(order("L-2")))
    with psycopg.connect(pg_db) as locker:
        locker.execute("SET idle_in_transaction_session_timeout = 0")  # the server may end an idle holder
        locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")  # held until the rollback below
        for args in (("status",), ("list",), ("submit", str(env.tmp / "o.json")), ("cancel", "L-1")):
            started = time.monotonic()
            proc = env.cli(*args)
            took = time.monotonic() - started
            assert took < LIMIT_S, f"{args} took {took:.1f} s"
            assert proc.returncode != 0 and proc.stdout == "", (args, proc.stdout)
            assert proc.stderr.count("\n") == 1 and "cannot be reached" in proc.stderr, (args, proc.stderr)
        locker.rollback()
    submitted = env.cli("submit", str(env.tmp / "o.json"))
    assert (submitted.returncode, submitted.stdout) == (0, "L-2\n"), submitted.stderr


def test_a_command_that_started_late_leaves_its_connection_less_time(tmp_path: Path) -> None:
    """`answer_by`: 3.5 s after the process started, however long the start took; at least 0.25 s is left.

    The process sleeps 2 s and then becomes Python (the same process, so its age counts from the sleep).
    """
    code = "import time; from dispatcher.store.ledgers import answer_by; print(answer_by() - time.monotonic())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    late = subprocess.run(
        ["sh", "-c", 'sleep 2; exec "$@"', "sh", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=cli_env(),
        check=True,
    )
    left_fresh, left_late = float(fresh.stdout), float(late.stdout)
    # fresh: ANSWER_S less its short start; late: 2 s less again, or the 0.25 s floor (read a moment after it was set)
    assert left_fresh <= ANSWER_S and 0.2 <= left_late <= max(0.25, left_fresh - 1.5), (left_fresh, left_late)


def test_a_connection_given_up_at_its_deadline_ends_the_wait_at_once(silent_server: int) -> None:
    """A silent server: libpq waits 2 s at least; the command's deadline (0.5 s) ends it, and no retry follows."""
    url = f"postgresql://disp@127.0.0.1:{silent_server}/ledger"
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable, match=r"cannot be reached .*: connection timeout expired"):
        PostgresLedger(url, patience_s=REACH_S, connect_timeout_s=CONNECT_S, answer_by=started + 0.5)
    took = time.monotonic() - started
    assert 0.5 <= took < 1.5, took  # not the 2 s attempt, nor REACH_S of retries after it


READY_FOR_QUERY = b"Z\x00\x00\x00\x05I"  # the server's ReadyForQuery (idle): the login is complete


class HangsAfterLogin:
    """Forward to a server until its login completes, then pass nothing more either way: a server that stopped
    (SIGSTOP, a hung host) after a command reached it. Its kernel still answers TCP, as this proxy does."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            hung = threading.Event()
            threading.Thread(target=self._pipe, args=(client, upstream, hung, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, hung, True), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, hung: threading.Event, from_server: bool) -> None:
        seen = b""
        try:
            while data := src.recv(65536):
                if hung.is_set():
                    continue  # swallowed
                if from_server:
                    seen += data
                    if READY_FOR_QUERY in seen:  # pass the login's last message, then nothing
                        end = len(data) - (len(seen) - seen.index(READY_FOR_QUERY) - len(READY_FOR_QUERY))
                        dst.sendall(data[:end])
                        hung.set()
                        continue
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize(
    "args", [("status",), ("list",), ("show", "X-1"), ("cancel", "X-1"), ("hold", "X-1"), ("pause", "worker")]
)
def test_a_command_answers_within_5_s_when_the_server_hangs_after_the_login(
    env: Env, pg_db: str, args: tuple[str, ...]
) -> None:
    """The server stops answering once a command has logged in: no keepalive or libpq timeout ends that read,
    so the command cuts a step silent for 2 s and answers in one line (section 12), never hangs."""
    env.configure(ledger=pg_db)
    (env.tmp / "o.json").write_text(json.dumps(order("X-1")))
    env.cli("submit", str(env.tmp / "o.json"), check=True)  # the schema, and a queued order
    port = int(pg_db.rsplit(":", 1)[1].split("/")[0])
    proxy = HangsAfterLogin(port)
    try:
        env.configure(ledger=pg_db.replace(f":{port}/", f":{proxy.port}/"))
        started = time.monotonic()
        proc = env.cli(*args, timeout=30)
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert took < LIMIT_S, f"{args} took {took:.1f} s"
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "cannot be reached" in proc.stderr, proc
