"""The PostgreSQL ledger's tables, created and versioned by the daemon itself.

``ensure`` runs in one transaction under a transaction-level advisory lock, so
daemons that start together on an empty database create the schema once and the
others wait for it, then find it. The version is one row of ``schema_version``;
a database whose version is newer than this code knows is refused with a
one-line error (an older dispatcher must never write to a newer ledger).
"""

from __future__ import annotations

from dispatcher.ledger.pg_conn import Cur, PostgresLedgerError

SCHEMA_VERSION = 3  # 2: joins (section 16); 3: gates and gate waits (section 14)
# pg_advisory_xact_lock key for schema changes: "disp" "ldgr" in ASCII
_LOCK_KEY = 0x6469737000000000 | 0x6C646772

# ids are compared and sorted byte by byte (COLLATE "C"), as SQLite does, whatever the
# database's locale: `rows()` and `children()` come in the same order on both engines
# version 2: the ids a waiting job waits for (`after`, contract section 16)
_WAITS = (
    """
    CREATE TABLE waits (
        job_id text COLLATE "C" NOT NULL,
        parent text COLLATE "C" NOT NULL,
        rule   text NOT NULL,
        since  double precision NOT NULL,
        PRIMARY KEY (job_id, parent)
    )""",
    "CREATE INDEX waits_parent ON waits (parent)",
)
#: the gates and their waits (section 14, ``pg_gates``): schema version 2 added them
GATE_TABLES = (
    """
    CREATE TABLE IF NOT EXISTS gates (
        agent   text COLLATE "C" NOT NULL,
        kind    text NOT NULL,
        until   double precision,
        reason  text,
        updated double precision NOT NULL,
        PRIMARY KEY (agent, kind)
    )""",
    """
    CREATE TABLE IF NOT EXISTS gate_waits (
        job_id text COLLATE "C" PRIMARY KEY,
        agent  text NOT NULL,
        until  double precision,
        since  double precision NOT NULL
    )""",
)

_TABLES = (
    """
    CREATE TABLE jobs (
        job_id         text COLLATE "C" PRIMARY KEY,
        state          text NOT NULL,
        agent          text,
        owner          text COLLATE "C",
        token          bigint NOT NULL DEFAULT 0,
        source         text,
        digest         text,
        parent         text COLLATE "C",
        hops           integer NOT NULL DEFAULT 0,
        cost_usd       double precision,
        chain_cost_usd double precision,
        updated        double precision NOT NULL,
        spent          double precision
    )""",
    "CREATE INDEX jobs_parent ON jobs (parent) WHERE parent IS NOT NULL",
    # a plain index: a partial one is not used by a generic plan of `state = ANY($1)`
    "CREATE INDEX jobs_state ON jobs (state)",
    "CREATE INDEX jobs_spent ON jobs (updated) WHERE cost_usd IS NOT NULL",
    """
    CREATE TABLE requests (
        job_id text COLLATE "C" NOT NULL,
        kind   text NOT NULL,
        at     double precision NOT NULL,
        PRIMARY KEY (job_id, kind)
    )""",
    # one row per daemon start; ``owner`` is never reused; ``ended`` is NULL while it
    # lives, 'stopped' after a clean stop, 'lost' once a reaper found its lease run out
    """
    CREATE TABLE daemons (
        owner       text COLLATE "C" PRIMARY KEY,
        pid         integer NOT NULL,
        host        text NOT NULL,
        started     double precision NOT NULL,
        lease_s     double precision NOT NULL,
        registered  timestamptz NOT NULL DEFAULT now(),
        renewed     timestamptz NOT NULL DEFAULT now(),
        lease_until timestamptz NOT NULL,
        ended       text CHECK (ended IN ('stopped', 'lost')),
        ended_at    timestamptz,
        ended_by    text COLLATE "C",
        config_digest text
    )""",
    "CREATE INDEX daemons_live ON daemons (lease_until) WHERE ended IS NULL",
    "CREATE INDEX daemons_ended_by ON daemons (ended_by) WHERE ended_by IS NOT NULL",
    # an agent's concurrency slots over every daemon: (agent, n) is free when owner is NULL
    # or its owner has ended
    """
    CREATE TABLE slots (
        agent text NOT NULL,
        n     integer NOT NULL,
        owner text COLLATE "C",
        nonce text,
        taken timestamptz,
        PRIMARY KEY (agent, n)
    )""",
    "CREATE INDEX slots_owner ON slots (owner) WHERE owner IS NOT NULL",
    *_WAITS,
)


class NoSchema(PostgresLedgerError):
    """The database holds no dispatcher ledger yet (a reader never creates one)."""


def check(cur: Cur, where: str) -> int:
    """Return the schema version of a ledger opened read-only; refuse a newer one; NoSchema when there is none."""
    exists = cur.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if not (exists and exists[0]):
        raise NoSchema(f"{where}: holds no dispatcher ledger yet (the first daemon to start creates it)")
    row = cur.execute("SELECT max(version) FROM schema_version").fetchone()
    version = int(row[0]) if row and row[0] is not None else 0
    if version > SCHEMA_VERSION:
        raise PostgresLedgerError(
            f"{where}: ledger schema version {version} is newer than this dispatcher knows"
            f" ({SCHEMA_VERSION}); upgrade dispatcher on this host"
        )
    if version < SCHEMA_VERSION:  # a reader may not change it: its tables are not yet those these reads expect
        raise PostgresLedgerError(
            f"{where}: ledger schema version {version} is older than this dispatcher's ({SCHEMA_VERSION}):"
            " start a daemon of this version once (it upgrades the schema), then read it again"
        )
    return version


def ensure(cur: Cur, where: str, *, patient: bool = True) -> int:
    """Create the schema if the database has none; refuse a newer one; return the version found.

    ``patient`` (a daemon): wait as long as it takes for another daemon setting the schema
    up. A command is not patient: its session's lock and statement timeouts stay, so that
    a table another session holds locked makes it answer within its time, not wait.
    """
    if patient:
        cur.execute("SET LOCAL lock_timeout = 0")  # several daemons starting at once wait for the first
        cur.execute("SET LOCAL statement_timeout = '5min'")
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
    exists = cur.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if exists and exists[0]:
        row = cur.execute("SELECT max(version) FROM schema_version").fetchone()
        version = int(row[0]) if row and row[0] is not None else 0
        if version > SCHEMA_VERSION:
            raise PostgresLedgerError(
                f"{where}: ledger schema version {version} is newer than this dispatcher knows"
                f" ({SCHEMA_VERSION}); upgrade dispatcher on this host"
            )
        if version == SCHEMA_VERSION:
            _add_columns(cur)
            return version
        if version in (1, 2):  # older ledgers: 1 has no joins (section 16), 2 no gates (section 14)
            if version == 1:
                for statement in _WAITS:
                    cur.execute(statement)  # fixed text only
            for statement in GATE_TABLES:
                cur.execute(statement)  # fixed text only
            _add_columns(cur)
            cur.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION,))
            return SCHEMA_VERSION
        raise PostgresLedgerError(f"{where}: ledger schema version {version} is unknown to this dispatcher")
    taken = cur.execute(
        "SELECT string_agg(c.relname, ', ' ORDER BY c.relname) FROM pg_class c"
        " WHERE c.relname IN ('jobs', 'requests', 'daemons', 'slots') AND c.relkind = 'r'"
        " AND pg_table_is_visible(c.oid)"
    ).fetchone()
    if taken and taken[0]:
        raise PostgresLedgerError(
            f"{where}: the database holds tables ({taken[0]}) but no dispatcher schema_version;"
            " use an empty database for the ledger"
        )
    for statement in (*_TABLES, *GATE_TABLES):
        cur.execute(statement)  # fixed text only
    cur.execute("CREATE TABLE schema_version (version integer NOT NULL)")
    cur.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
    return SCHEMA_VERSION


def _add_columns(cur: Cur) -> None:
    """Add the columns and indexes added since version 1 without a new version: older daemons never name them."""
    # the spend of the last 24 hours (daily caps, `status`, the web view) without a full scan; looked up
    # first: CREATE INDEX takes a lock on jobs even when the index is there, and waits behind its writers
    index = cur.execute("SELECT to_regclass('jobs_spent') IS NOT NULL").fetchone()
    if not (index and index[0]):
        cur.execute("CREATE INDEX IF NOT EXISTS jobs_spent ON jobs (updated) WHERE cost_usd IS NOT NULL")
    found = cur.execute(
        "SELECT 1 FROM information_schema.columns WHERE table_name = 'daemons' AND column_name = 'config_digest'"
        " AND table_schema = current_schema()"
    ).fetchone()
    if found is None:
        cur.execute("ALTER TABLE daemons ADD COLUMN IF NOT EXISTS config_digest text")
    spent = cur.execute(
        "SELECT 1 FROM information_schema.columns WHERE table_name = 'jobs' AND column_name = 'spent'"
        " AND table_schema = current_schema()"
    ).fetchone()
    if spent is None:  # when a job's cost was counted, if not its updated time (a review decided later)
        cur.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS spent double precision")
