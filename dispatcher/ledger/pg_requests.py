"""The PostgreSQL ledger's requests: a cancel, a retry, a revision, asked by a command and carried out by a daemon.

One row per job and kind; asking again refreshes its time; a daemon clears it once done.
"""

from __future__ import annotations

from dispatcher.ledger.pg_conn import Cur
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.records import Request


class Requests:
    """Requests over the engine's ``Runner``."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def request(self, job_id: str, kind: Request) -> None:
        """Record a request for a daemon to carry out."""
        self.runner.run(
            "request",
            lambda cur: cur.execute(
                "INSERT INTO requests (job_id, kind, at) VALUES (%s, %s, extract(epoch from now())::float8)"
                " ON CONFLICT (job_id, kind) DO UPDATE SET at = EXCLUDED.at",
                (job_id, str(kind)),
            ),
            write=True,
        )

    def requests(self, kind: Request) -> list[str]:
        """Return the job ids with an open request of this kind, oldest first."""
        rows = self.runner.run(
            "requests",
            lambda cur: cur.execute(
                "SELECT job_id FROM requests WHERE kind = %s ORDER BY at, job_id", (str(kind),)
            ).fetchall(),
        )
        return [r[0] for r in rows]

    def clear_request(self, job_id: str, kind: Request, *, drop_reserved: bool = False) -> None:
        """Mark a request as carried out (``Ledger.clear_request``)."""

        def body(cur: Cur) -> None:
            cur.execute("DELETE FROM requests WHERE job_id = %s AND kind = %s", (job_id, str(kind)))
            if drop_reserved:
                cur.execute("DELETE FROM jobs WHERE parent = %s AND state = 'reserved'", (job_id,))

        self.runner.run("clear_request", body, write=True)
