"""A throwaway PostgreSQL server for tests and benchmarks, from the machine's own binaries.

:class:`PgServer` runs ``initdb`` in a fresh temp folder, starts the server with
``pg_ctl`` on a free TCP port of every IPv4 address (so that simulated hosts reach it over
their veth links, see ``netns.py``), and creates one role with a password and one
database it owns. ``pg_hba.conf`` lets in only 127.0.0.1 and ``10.77.0.0/16`` (the
simulated hosts), with password (SCRAM) authentication.

Settings chosen for ledger tests (PITFALLS: PostgreSQL as a ledger): ``fsync``,
``synchronous_commit`` and ``full_page_writes`` on, so that a crash test means what it
says; ``idle_in_transaction_session_timeout`` of 2 s and TCP keepalives (1 s idle, 1 s
interval, 3 probes) plus a 3 s ``tcp_user_timeout``, so that a cut-off host's locks are
released within seconds instead of the kernel's two hours.

In tests, use the fixtures of ``pg_fixtures.py``; outside pytest (benchmarks)::

    with running_server() as server:
        print(server.dsn)

When running as root, ``initdb`` and the server run as the ``postgres`` user, since
``initdb`` refuses root.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from runlock import OwnerLock, owner_is_dead

BASE_PREFIX = "dispatcher-pg-"
NEEDED = ("initdb", "pg_ctl", "postgres", "psql")
# networks allowed to log in with a password: the loopback and every simulated host
DEFAULT_ALLOW = ("127.0.0.1/32", "10.77.0.0/16")
START_TIMEOUT = 60

DEFAULT_SETTINGS: dict[str, str] = {
    # durability as in production: the crash tests must not pass only because of a shortcut
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # a host cut off mid-transaction must not hold row locks for long (PITFALLS)
    "idle_in_transaction_session_timeout": "'2s'",
    "tcp_keepalives_idle": "1",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "3",
    # keepalives only run on an idle connection; this bounds unacknowledged sends too
    "tcp_user_timeout": "3000",
    # a backend running a query for a vanished client notices within a second
    "client_connection_check_interval": "'1s'",
    "max_connections": "100",
    # small, because the machine is shared and the data are tiny
    "shared_buffers": "'32MB'",
    # dynamic shared memory in the data folder, removed with it: a server a test kills would
    # otherwise leave a /dev/shm/PostgreSQL.* segment behind for good
    "dynamic_shared_memory_type": "mmap",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %r %u@%d '",
}
# settings that older servers reject, with the first major version that knows them
_SINCE = {"tcp_user_timeout": 12, "client_connection_check_interval": 14}


class PgUnavailable(RuntimeError):
    """The PostgreSQL server cannot be started here; the message says why and what to install."""


def find_bindir() -> Path:
    """Return the folder holding initdb, pg_ctl, postgres and psql.

    Looks at ``$DISPATCHER_PG_BINDIR``, ``pg_config --bindir``,
    ``/usr/lib/postgresql/*/bin`` (newest first), then PATH.
    """
    candidates: list[Path] = []
    if os.environ.get("DISPATCHER_PG_BINDIR"):
        candidates.append(Path(os.environ["DISPATCHER_PG_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))

    def version(path: str) -> tuple[int, ...]:
        digits = re.findall(r"\d+", Path(path).parent.name)
        return tuple(int(d) for d in digits)

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)]
    initdb = shutil.which("initdb")
    if initdb:
        # a wrapper or symlink on PATH: the real folder has pg_ctl and postgres next to it
        candidates.append(Path(initdb).resolve().parent)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in NEEDED):
            return folder
    looked = ", ".join(str(c) for c in candidates) or "nowhere (no pg_config, no /usr/lib/postgresql, none on PATH)"
    raise PgUnavailable(
        f"PostgreSQL server binaries ({', '.join(NEEDED)}) not found; looked in {looked}. "
        "Install them (Debian: apt-get install postgresql; `bash .ci/run` does it) "
        "or set DISPATCHER_PG_BINDIR."
    )


def _free_port() -> int:
    """Return a TCP port that is free on every IPv4 address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))  # noqa: S104 - the server listens on every address too
        port: int = sock.getsockname()[1]
        return port


def _stat(pid: int) -> tuple[str, int, int] | None:
    """Return (state, ppid, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _alive(pid: int, start: int) -> bool:
    """True when ``pid`` is still the process that started at ``start`` and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[0] != "Z"


def _wait_gone(procs: Mapping[int, int], timeout: float) -> bool:
    """Wait until none of ``procs`` ({pid: start time}) is alive; False on timeout."""
    end = time.monotonic() + timeout
    while any(_alive(pid, start) for pid, start in procs.items()):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


class PgServer:
    """One throwaway PostgreSQL server: start, restart, stop, and DSNs to reach it."""

    def __init__(
        self,
        *,
        user: str = "dispatcher",
        database: str = "dispatcher",
        settings: Mapping[str, str] | None = None,
        allow: Sequence[str] = DEFAULT_ALLOW,
        listen: str = "0.0.0.0",  # noqa: S104 - simulated hosts reach it through their veth
        os_user: str | None = None,
    ) -> None:
        """Prepare (not start) a server; ``settings`` add to or override DEFAULT_SETTINGS.

        ``os_user`` is the system user that owns the data and runs the server when this
        process is root (default ``postgres``, else ``nobody``); ignored otherwise.
        """
        self.user = user
        self.database = database
        self.password = secrets.token_hex(12)
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.allow = tuple(allow)
        self.listen = listen
        self.port = 0
        # the address for clients in the root namespace
        self.host = "127.0.0.1" if listen in ("0.0.0.0", "*", "127.0.0.1") else listen.split(",")[0].strip()  # noqa: S104
        self.bindir = find_bindir()
        self.major = self._major_version()
        self.os_user = self._pick_os_user(os_user)
        self.base: Path | None = None
        self.data: Path | None = None
        self.log_path: Path | None = None
        self.start_seconds = 0.0
        self._owner: OwnerLock | None = None

    # -- set-up

    def _major_version(self) -> int:
        """Return the server's major version (15 for "postgres (PostgreSQL) 15.8")."""
        out = subprocess.run(
            [str(self.bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        match = re.search(r"(\d+)(?:\.\d+)?", out)
        if not match:
            raise PgUnavailable(f"cannot read the server version from {out!r}")
        return int(match.group(1))

    @staticmethod
    def _pick_os_user(wanted: str | None) -> str | None:
        """Return the system user to run as when root, or None when not root."""
        if os.geteuid() != 0:
            return None
        for name in [wanted] if wanted else ["postgres", "nobody"]:
            try:
                pwd.getpwnam(name)
            except KeyError:
                continue
            if shutil.which("runuser") is None:
                raise PgUnavailable("running as root needs `runuser` (util-linux) to run initdb as another user")
            return name
        raise PgUnavailable(f"no system user {wanted or 'postgres'!r} to run initdb as (initdb refuses root)")

    def _as_owner(self, argv: list[str]) -> list[str]:
        """Prefix ``argv`` so that it runs as the data folder's owner."""
        if self.os_user is None:
            return argv
        return ["runuser", "-u", self.os_user, "--", *argv]

    def _run(self, argv: list[str], what: str, timeout: float = START_TIMEOUT) -> str:
        """Run a PostgreSQL tool as the data owner; raise with its output when it fails."""
        proc = subprocess.run(
            self._as_owner(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            # the owner may not be allowed into the caller's folder (initdb warns, psql fails)
            cwd=self.base,
        )
        if proc.returncode != 0:
            raise PgUnavailable(f"{what} failed ({proc.returncode}): {proc.stdout}{proc.stderr}{self.log_tail()}")
        return proc.stdout

    def log_tail(self, lines: int = 30) -> str:
        """Return the end of the server log, for error messages."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\nserver log:\n" + "\n".join(tail)

    def _init(self) -> None:
        """Make the temp folder, owned by the data owner, and run initdb in it."""
        clean_leftovers()
        self.base = Path(tempfile.mkdtemp(prefix=BASE_PREFIX))
        self._owner = OwnerLock(self.base / "owner.lock")
        self.data = self.base / "data"
        self.log_path = self.base / "server.log"
        sockets = self.base / "sockets"
        sockets.mkdir()
        if self.os_user is not None:
            entry = pwd.getpwnam(self.os_user)
            for path in (self.base, sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        pwfile = self.base / "superuser.pw"
        pwfile.write_text(secrets.token_hex(12) + "\n")
        if self.os_user is not None:
            os.chown(pwfile, pwd.getpwnam(self.os_user).pw_uid, -1)
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                f"--pwfile={pwfile}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "-E",
                "UTF8",
                "--locale=C",
                # only initdb's own final sync of the template files is skipped: the server
                # itself runs with fsync on
                "--no-sync",
            ],
            "initdb",
        )
        pwfile.unlink()
        hba = ["# written by tests/pgserver.py", "local all all trust"]
        hba += [f"host all all {net} scram-sha-256" for net in self.allow]
        (self.data / "pg_hba.conf").write_text("\n".join(hba) + "\n")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude_if_exists = 'dispatcher_test.conf'\n")

    def _write_settings(self) -> None:
        """Write the settings file (port included), read by the server at each start."""
        assert self.data is not None and self.base is not None
        lines = {
            **{k: v for k, v in self.settings.items() if self.major >= _SINCE.get(k, 0)},
            "listen_addresses": f"'{self.listen}'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.base / 'sockets'}'",
        }
        path = self.data / "dispatcher_test.conf"
        path.write_text("".join(f"{key} = {value}\n" for key, value in lines.items()))
        if self.os_user is not None:
            os.chown(path, pwd.getpwnam(self.os_user).pw_uid, -1)

    def _sql(self, *statements: str) -> None:
        """Run statements one by one as the superuser over the unix socket."""
        assert self.base is not None
        argv = [str(self.bindir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1"]
        argv += ["-h", str(self.base / "sockets"), "-p", str(self.port), "-U", "postgres", "-d", "postgres"]
        for statement in statements:
            argv += ["-c", statement]
        self._run(argv, "psql " + "; ".join(s.split(" PASSWORD ")[0] for s in statements))

    # -- life cycle

    def start(self) -> PgServer:
        """Create the cluster on first use, start the server and wait until it accepts logins."""
        t0 = time.monotonic()
        first = self.data is None
        if first:
            self._init()
        attempts = 5 if first else 1
        for attempt in range(attempts):
            if first:
                self.port = _free_port()
            self._write_settings()
            try:
                self._pg_ctl_start()
                break
            except PgUnavailable:
                # another process took the port between the probe and the server's bind
                if attempt + 1 < attempts and "already in use" in self.log_tail():
                    continue
                raise
        if first:
            self._sql(
                f"CREATE ROLE {self.user} LOGIN PASSWORD '{self.password}'",
                f"CREATE DATABASE {self.database} OWNER {self.user}",
            )
        self.start_seconds = time.monotonic() - t0
        return self

    def _pg_ctl_start(self) -> None:
        """Run ``pg_ctl start -w``: it returns once the server accepts connections."""
        assert self.data is not None and self.log_path is not None
        self._run(
            [
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log_path),
                "-w",
                "-t",
                str(START_TIMEOUT),
                "start",
            ],
            "pg_ctl start",
            timeout=START_TIMEOUT + 10,
        )

    def _processes(self) -> dict[int, int]:
        """Return {pid: start time} of the postmaster and its children, from postmaster.pid."""
        assert self.data is not None
        try:
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
            # a stale pid file (the server was killed) may name a reused pid
            if str(self.data).encode() not in Path(f"/proc/{postmaster}/cmdline").read_bytes():
                return {}
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return {}
        found: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            stat = _stat(pid)
            if stat is not None and (pid == postmaster or stat[1] == postmaster):
                found[pid] = stat[2]
        return found

    def stop(self, mode: str = "fast", timeout: float = 60.0) -> None:
        """Stop the server (``mode``: smart, fast or immediate) and make sure no process is left."""
        if self.data is None:
            return
        procs = self._processes()
        if not procs:
            # never started, or already stopped: nothing to stop and nothing left over
            return
        proc = subprocess.run(
            self._as_owner(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", str(int(timeout)), "stop"]
            ),
            capture_output=True,
            text=True,
            timeout=timeout + 10,
            check=False,
            cwd=self.base,
        )
        problem = "" if proc.returncode == 0 else f"pg_ctl stop -m {mode} failed: {proc.stdout}{proc.stderr}"
        if not _wait_gone(procs, timeout if proc.returncode == 0 else 5.0):
            # pg_ctl gave up, or returned before the children ended: no postgres process
            # may outlive the test
            for pid, start in procs.items():
                if _alive(pid, start):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if not _wait_gone(procs, 10.0):
                problem += f" processes {sorted(procs)} survive SIGKILL"
        if problem:
            raise RuntimeError(problem + self.log_tail())

    def restart(self, mode: str = "immediate") -> None:
        """Stop with ``mode`` (immediate: like a crash, every connection dropped), then start.

        The server comes back on the same port with the same data (after crash recovery
        for an immediate stop).
        """
        self.stop(mode)
        self.start()

    def close(self) -> None:
        """Stop the server and remove the temp folder with its data."""
        try:
            self.stop("fast")
        finally:
            if self.base is not None:
                shutil.rmtree(self.base, ignore_errors=True)
            if self._owner is not None:
                self._owner.release()
                self._owner = None

    def __enter__(self) -> PgServer:
        """Start the server."""
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        """Stop the server and remove its data."""
        self.close()

    # -- reaching it

    def dsn_for(self, host: str = "127.0.0.1", database: str | None = None) -> str:
        """Return the DSN that reaches this server at address ``host`` (a Host's ``gateway``)."""
        return f"postgresql://{self.user}:{self.password}@{host}:{self.port}/{database or self.database}"

    @property
    def dsn(self) -> str:
        """The DSN from the root namespace: ``postgresql://user:pw@127.0.0.1:port/db``."""
        return self.dsn_for(self.host)

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database owned by the role; return its DSN from the root namespace."""
        name = name or f"t_{secrets.token_hex(6)}"
        # the name goes into SQL unquoted
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}: use lower-case letters, digits and _")
        self._sql(f"CREATE DATABASE {name} OWNER {self.user}")
        return self.dsn_for(self.host, name)

    def drop_database(self, name: str) -> None:
        """Drop a database, ending its sessions first."""
        self._sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def clean_leftovers() -> list[Path]:
    """Stop the servers and remove the folders of dead runs; return the folders removed."""
    removed: list[Path] = []
    for owner in Path(tempfile.gettempdir()).glob(f"{BASE_PREFIX}*/owner.lock"):
        base = owner.parent
        if not owner_is_dead(owner):
            continue
        pidfile = base / "data" / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError, ProcessLookupError):
            # the postmaster's children end by themselves when it dies
            postmaster = int(pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{postmaster}/cmdline").read_bytes()
            if str(base).encode() in cmdline:
                os.kill(postmaster, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
        removed.append(base)
    return removed


@contextlib.contextmanager
def running_server(**options: Any) -> Iterator[PgServer]:
    """Start a :class:`PgServer` (keyword options as its constructor), yield it, then remove it."""
    with PgServer(**options) as server:
        yield server
