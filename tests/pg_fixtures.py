"""Pytest fixtures for the many-hosts tests: a PostgreSQL server and simulated hosts.

A test module that needs them names this plugin (and imports ``pgserver`` / ``netns``
freely for types and helpers)::

    pytest_plugins = ["pg_fixtures"]

A plugin module rather than fixtures inside ``pgserver.py`` and ``netns.py``: pytest
registers a plugin once, so the session server is one server for every module, and those
two modules stay importable without pytest (benchmarks use them too). The fixtures fail
the test, never skip it, when the machine lacks what they need.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netns import Hosts, NetnsUnavailable
from pgserver import PgServer, PgUnavailable


def running_pg_server() -> Iterator[PgServer]:
    """Start a PostgreSQL server of its own, yield it, stop it; fail (never skip) without binaries.

    A generator for fixtures: the session's shared server and a test's own (one it stops on purpose).
    """
    server: PgServer | None = None
    problem = ""
    try:
        server = PgServer()
        server.start()
    except PgUnavailable as exc:
        problem = str(exc)
    if problem:
        # failed outside the except block, so the report is the message, not a chained traceback
        if server is not None:
            server.close()
        pytest.fail(f"PostgreSQL test server unavailable: {problem}", pytrace=False)
    assert server is not None
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """Yield one running :class:`PgServer` for the whole session; fails (never skips) without binaries."""
    yield from running_pg_server()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> str:
    """The session server's DSN from the root namespace: ``postgresql://user:pw@127.0.0.1:port/db``."""
    return pg_server.dsn


@pytest.fixture
def pg_db(pg_server: PgServer) -> Iterator[str]:
    """Yield the DSN of a fresh empty database for one test; dropped afterwards."""
    dsn = pg_server.create_database()
    try:
        yield dsn
    finally:
        pg_server.drop_database(dsn.rsplit("/", 1)[1])


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Yield a :class:`Hosts` factory (``hosts.add()`` makes a host); fails loudly where impossible."""
    problem = ""
    try:
        factory = Hosts()
    except NetnsUnavailable as exc:
        problem = str(exc)
    if problem:
        pytest.fail(f"simulated hosts unavailable: {problem}", pytrace=False)
    try:
        yield factory
    finally:
        factory.close()
