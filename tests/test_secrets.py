"""No credential in a log line, an output, an error or a process title: a ledger URL's password is `***`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import Env, order

from dispatcher.text import may_hold_secret, redact

pytest_plugins = ["pg_fixtures"]


def _password(url: str) -> str:
    found = re.match(r"postgresql://[^:]+:([^@]+)@", url)
    assert found, f"the test server's URL has no password: {url}"
    return found.group(1)


def test_the_ledger_password_is_never_logged_printed_or_in_a_process_title(env: Env, pg_db: str) -> None:
    """daemon.started shows the URL with `***` on stdout and in log_file; /proc cmdline and status hold no password."""
    secret = _password(pg_db)
    log_file = env.tmp / "d.log"
    env.configure(ledger=pg_db, log_file=str(log_file))
    d = env.daemon()
    d.wait_ready()
    started = d.wait_event("daemon.started")
    assert started["ledger"] == pg_db.replace(f":{secret}@", ":***@")
    cmdline = Path(f"/proc/{d.proc.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
    status = env.cli("status")
    assert status.returncode == 0, status.stderr
    assert d.stop() == 0
    for text in (d.out.read_text(), log_file.read_text(), cmdline.decode(), status.stdout + status.stderr):
        assert secret not in text
    assert any(json.loads(line).get("event") == "daemon.started" for line in log_file.read_text().splitlines())


def test_an_error_about_the_ledger_shows_no_password(env: Env) -> None:
    """A ledger URL that cannot be reached is named in the one-line error with its password as `***`."""
    env.configure(ledger="postgresql://disp:Hunter2Secret@127.0.0.1:1/ledger", lease=6)
    status = env.cli("status")
    assert status.returncode != 0 and status.stderr.count("\n") == 1
    assert "Hunter2Secret" not in status.stderr + status.stdout
    assert "postgresql://disp:***@127.0.0.1:1/ledger" in status.stderr, status.stderr


def test_a_password_in_an_agents_command_is_never_shown(env: Env) -> None:
    """An agent's argv with `https://bob:PASS@host` in it: result.json, attempt.json, `show` and `show --json`
    (the argv and the failed attempt's stderr lines) name the URL with the password as `***`; the agent itself
    gets it as written, and its stderr.log keeps what it wrote."""
    secret = "TopSecretArg"  # noqa: S105 - the test's own secret
    url = f"https://bob:{secret}@example.com/hook"
    env.configure(agents={"worker": env.agent() | {"command": ["sh", "-c", 'echo "got $1" >&2; exit 2', "sh", url]}})
    env.drop(order("SEC-1"))
    env.cli("run", "--once", timeout=60)
    folder = env.job_dir("SEC-1", "failed")
    assert (folder / "attempts" / "1" / "stderr.log").read_text().strip() == f"got {url}"  # run as written
    shown = env.cli("show", "SEC-1").stdout + env.cli("show", "SEC-1", "--json").stdout
    for text in (shown, (folder / "result.json").read_text(), (folder / "attempts" / "1" / "attempt.json").read_text()):
        assert secret not in text
    assert "https://bob:***@example.com/hook" in shown


def test_a_ledger_url_libpq_cannot_read_is_refused_without_quoting_its_password(env: Env) -> None:
    """A space or a bad % in the password: validate, status and run exit 2 in one line that does not quote it."""
    for url in (
        "postgresql://alice:my secretpw@db.example/dispatch",
        "postgresql://alice@db.example/dispatch?password=my secretpw",
        "postgresql://alice:my%zzsecretpw@db.example/dispatch",
        "postgresql://alice:my@secretpw@db.example/dispatch",  # an @ not percent-encoded
    ):
        env.configure(ledger=url)
        for args in (("validate",), ("status",), ("run", "--once")):
            proc = env.cli(*args, timeout=60)
            out = proc.stdout + proc.stderr
            assert proc.returncode == 2, (url, args, out)
            assert "secretpw" not in out and "\\n" not in out, (url, args, out)
            assert proc.stderr.count("\n") == 1 and "ledger URL cannot be read" in proc.stderr, (url, args, out)


def test_ledger_migrate_refuses_a_password_on_its_command_line(env: Env) -> None:
    """`ledger migrate URL-with-password` is refused in one line (ps shows argv); `-` reads the URL from stdin."""
    proc = env.cli("ledger", "migrate", "postgresql://disp:Hunter2Secret@127.0.0.1:1/ledger")
    assert proc.returncode == 2
    assert proc.stderr == (
        "ledger migrate: URL: a password on the command line shows in every process list;"
        " put it in ~/.pgpass or $PGPASSWORD, or give - and the URL on stdin\n"
    )


@pytest.mark.parametrize(("given", "got"), [("\n", "nothing on stdin"), ("", "nothing on stdin"), ("db\n", "no URL")])
def test_ledger_migrate_with_no_url_on_stdin_is_bad_usage(env: Env, given: str, got: str) -> None:
    """`ledger migrate -` with an empty line (or none, or no URL) on stdin exits 2 asking for the URL, as with no
    argument; an empty URL went to libpq's defaults (the local server) and exited 1 that it could not be reached."""
    proc = env.cli("ledger", "migrate", "-", input=given)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"ledger migrate: give the postgresql://... URL of an empty ledger ({got})\n"


def test_may_hold_secret_is_false_only_where_redact_changes_nothing() -> None:
    """Text may_hold_secret passes, and any part of it, comes out of redact unchanged; a credential never passes."""
    for text in ("", "job PROF-1 (bench)", "pässword=x p@ss:w0rd@db", "host=db passwd=abc"):
        assert not may_hold_secret(text)
        parts = {text[i:j] for i in range(len(text) + 1) for j in range(i, len(text) + 1)}
        assert all(redact(part) == part for part in parts)
    for text in ("postgresql://u:p@db/x", "host=db password=abc", "PASSWORD='a b'", "https://u:pw@h/x"):
        assert may_hold_secret(text) and redact(text) != text


def test_redact_hides_url_passwords_and_password_keywords() -> None:
    """URL passwords (even with an unescaped @) and libpq password= values become ***; other text stays."""
    assert redact("postgresql://u:p@ss@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert redact("host=db password='a b' user=u") == "host=db password=*** user=u"
    assert redact("postgresql://u@db/x and http://h/a:b@c") == "postgresql://u@db/x and http://h/a:b@c"
    # a raw `/` in the password (a base64 one): the whole of it is hidden, up to the host's `@`
    assert redact("postgresql://u:Sup3r/Se/cret@127.0.0.1:5/d: cannot") == "postgresql://u:***@127.0.0.1:5/d: cannot"
    assert redact("postgresql://u:a/b@c@h?x=1") == "postgresql://u:***@h?x=1"
    assert redact("postgresql://u:p@h/db?opt=x@y") == "postgresql://u:***@h/db?opt=x@y"
