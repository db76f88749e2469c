"""Claims of the PostgreSQL ledger: claim, unclaim, adopt, take_retry, reconcile (SQLite's rules).

A claim batch is one transaction:

1. ``INSERT ... ON CONFLICT (job_id) DO NOTHING`` of every id (its first request),
   in id order so that two daemons' batches lock in the same order: the primary
   key is the duplicate refusal, also against a concurrent transaction (the
   insert waits for it, then does nothing).
2. The rows of every other request, ``FOR UPDATE``, with their owner's liveness
   (lease and ``ended``, on the database's clock) and the parent's chain cost;
   each request is answered in order by the rules of ``Ledger.claim`` (a later
   request of the same id sees what an earlier one did).
3. One conditional UPDATE (``token = planned - 1``) for the take-overs and the
   released follow-ups: each row's fencing token moves on by one.

Every step that takes a row for this daemon needs its lease to be running (in
the database's eyes); ``unclaim`` and ``reconcile`` only need it not to have
been declared lost. Each write carries this daemon's owner and the token it
planned, so that its rows can be read back after an unknown commit (``pg_conn``
settles it by the server's record of the transaction; the rows are checked
against that, and decide alone should the server have forgotten it).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence

from dispatcher import procs
from dispatcher.ledger.pg_conn import Cur, Fence
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.pg_settle import Again, Found, Resolve
from dispatcher.ledger.records import (
    Busy,
    ClaimAnswer,
    Claimed,
    ClaimRequest,
    Entry,
    Known,
    Request,
    folder_may_be_lost,
    takes_release,
)
from dispatcher.lifecycle import Row

_ROWS = (
    "SELECT j.job_id, j.state, j.agent, j.owner, j.token, j.source, j.digest, j.parent, j.hops, j.cost_usd,"
    " j.chain_cost_usd, j.updated,"
    " EXISTS (SELECT 1 FROM daemons d WHERE d.owner = j.owner AND d.ended IS NULL AND d.lease_until > now()),"
    " (SELECT p.chain_cost_usd FROM jobs p WHERE p.job_id = j.parent),"
    " (SELECT d.host FROM daemons d WHERE d.owner = j.owner), (SELECT d.started FROM daemons d WHERE d.owner = j.owner)"
    " FROM jobs j WHERE j.job_id = ANY(%s) ORDER BY j.job_id FOR UPDATE OF j"
)
_INSERT = (
    "INSERT INTO jobs (job_id, state, agent, owner, source, digest, hops, updated, token)"
    " SELECT u.job_id, 'claimed', u.agent, %s, u.source, u.digest, 0, extract(epoch from now())::float8, 1"
    " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS u(job_id, agent, source, digest)"
    " ORDER BY u.job_id ON CONFLICT (job_id) DO NOTHING RETURNING job_id"
)
_TAKE = (
    "UPDATE jobs j SET state = 'claimed', agent = u.agent, owner = %s, source = u.source,"
    " updated = extract(epoch from now())::float8, token = u.token"
    " FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[]) AS u(job_id, agent, source, token)"
    " WHERE j.job_id = u.job_id AND j.token = u.token - 1"
)
_RECONCILE = (
    "INSERT INTO jobs (job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd,"
    " updated) VALUES (%s, 'claimed', %s, NULL, %s, NULL, NULL, %s, %s, NULL, NULL, extract(epoch from now())::float8)"
    " ON CONFLICT (job_id) DO UPDATE SET state = 'claimed', agent = EXCLUDED.agent, owner = NULL,"
    " token = EXCLUDED.token, source = NULL, digest = NULL, parent = EXCLUDED.parent, hops = EXCLUDED.hops,"
    " cost_usd = NULL, chain_cost_usd = NULL, updated = EXCLUDED.updated"
)


def claim_body(cur: Cur, owner: str, reqs: Sequence[ClaimRequest], plan: dict[str, int]) -> list[ClaimAnswer]:
    """Run the claim statements in ``cur``'s transaction; fill ``plan`` with {id: token written}."""
    first: dict[str, int] = {}
    for i, req in enumerate(reqs):
        first.setdefault(req.job_id, i)
    new = sorted(first)
    picked = [reqs[first[j]] for j in new]
    cur.execute(
        _INSERT, (owner, new, [r.agent for r in picked], [r.source for r in picked], [r.digest for r in picked])
    )
    answers: list[ClaimAnswer | None] = [None] * len(reqs)
    for (job_id,) in cur.fetchall():
        answers[first[job_id]] = Claimed(job_id, 1)
        plan[job_id] = 1
    rest = sorted({r.job_id for i, r in enumerate(reqs) if answers[i] is None})
    if not rest:
        return _mark_cancelled(cur, [a for a in answers if a is not None])
    rows: dict[str, tuple[Entry, bool, float | None, tuple[str | None, float | None]]] = {
        r[0]: (Entry(*r[:12]), bool(r[12]), r[13], (r[14], r[15])) for r in cur.execute(_ROWS, (rest,))
    }
    if len(rows) < len(rest):
        raise Again  # a row the insert saw was deleted since (an unclaim): start over
    updates: list[tuple[str, str, str, int]] = []
    for i, req in enumerate(reqs):
        if answers[i] is not None:
            continue
        entry, owner_alive, parent_cost, (owner_host, owner_started) = rows[req.job_id]
        same_file = entry.source == req.source and entry.digest == req.digest
        released = takes_release(entry, req.source, req.digest)
        taken_over = False
        if entry.state == Row.CLAIMED and same_file and entry.owner is not None:
            if entry.owner == owner or owner_alive:
                answers[i] = Busy(entry)
                continue
            here, booted = socket.gethostname(), procs.boot_time()
            taken_over = req.may_take_over and folder_may_be_lost(owner_host, owner_started, here, booted)
        if not (released or taken_over):
            answers[i] = Known(entry)
            continue
        token = entry.token + 1
        updates.append((req.job_id, req.agent, req.source, token))
        plan[req.job_id] = token
        answers[i] = Claimed(
            req.job_id, token, entry.parent, entry.hops, entry.state, parent_cost, entry.owner if taken_over else None
        )
        taken = dataclasses.replace(
            entry, state="claimed", agent=req.agent, owner=owner, source=req.source, token=token
        )
        rows[req.job_id] = (taken, True, parent_cost, (None, None))  # what a later request of this id in the batch sees
    if updates:
        cur.execute(_TAKE, (owner, *(list(col) for col in zip(*updates, strict=True))))
        if cur.rowcount != len(updates):  # cannot happen under FOR UPDATE; never answer a guess
            raise RuntimeError(f"claim: {cur.rowcount} of {len(updates)} conditional updates matched")
    return _mark_cancelled(cur, [a for a in answers if a is not None])


def _mark_cancelled(cur: Cur, answers: list[ClaimAnswer]) -> list[ClaimAnswer]:
    """Answer "cancelled" for each claimed id with an open cancel request (the claim's transaction)."""
    ids = [a.job_id for a in answers if isinstance(a, Claimed)]
    if not ids:
        return answers
    asked = {
        r[0] for r in cur.execute("SELECT job_id FROM requests WHERE kind = 'cancel' AND job_id = ANY(%s)", (ids,))
    }
    if not asked:
        return answers
    return [
        dataclasses.replace(a, cancelled=True) if isinstance(a, Claimed) and a.job_id in asked else a for a in answers
    ]


class Claims:
    """The steps that give this daemon a job row (or give one back)."""

    def __init__(self, runner: Runner, leases: Fence) -> None:
        self.runner = runner
        self.leases = leases

    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimAnswer]:
        """Claim many ids in one transaction; raise LeaseLost when this daemon may not claim now."""
        reqs = list(requests)
        if not reqs:
            return []
        plan: dict[str, int] = {}  # id -> token this transaction writes
        last: list[list[ClaimAnswer]] = []

        def body(cur: Cur) -> list[ClaimAnswer]:
            plan.clear()
            last.clear()
            if not self.leases.check(cur, lease=True):
                raise self.leases.refusal()
            last.append(claim_body(cur, self.leases.owner, reqs, plan))
            return last[0]

        def resolve(cur: Cur) -> Found[list[ClaimAnswer]] | None:
            if not plan:
                return Found(last[0])  # nothing was written: the answers stand either way
            rows = cur.execute(
                "SELECT job_id, owner, token, state FROM jobs WHERE job_id = ANY(%s)", (list(plan),)
            ).fetchall()
            mine = {r[0] for r in rows if (r[1], r[2], r[3]) == (self.leases.owner, plan[r[0]], Row.CLAIMED)}
            return Found(last[0]) if mine == set(plan) else None

        return self.runner.run("claim", body, resolve)

    def unclaim(self, job_id: str, token: int, previous: str | None, previous_owner: str | None = None) -> None:
        """Undo a claim whose job folder could not be put in place (nothing ran); fenced by token."""
        owner = self.leases.owner

        def body(cur: Cur) -> None:
            if not self.leases.check(cur, lease=False):
                return
            if previous_owner is not None:  # a takeover: the claim goes back to the daemon it was taken from
                cur.execute(
                    "UPDATE jobs SET owner = %s, token = %s WHERE job_id = %s AND state = 'claimed'"
                    " AND owner = %s AND token = %s",
                    (previous_owner, token - 1, job_id, owner, token),
                )
            elif previous in (None, Row.CLAIMED):  # no job folder ever existed for it
                cur.execute(
                    "DELETE FROM jobs WHERE job_id = %s AND state = 'claimed' AND owner = %s AND token = %s",
                    (job_id, owner, token),
                )
            else:
                cur.execute(
                    "UPDATE jobs SET state = %s, owner = NULL WHERE job_id = %s AND state = 'claimed'"
                    " AND owner = %s AND token = %s",
                    (previous, job_id, owner, token),
                )

        self.runner.run("unclaim", body, write=True)

    def _owned(self, job_id: str, plan: list[int]) -> Resolve[int | None]:
        """A read-back: the step committed if job_id is claimed by this daemon with the planned token."""

        def resolve(cur: Cur) -> Found[int | None] | None:
            if not plan:
                return Found(None)
            row = cur.execute("SELECT owner, token, state FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(plan[0]) if row == (self.leases.owner, plan[0], Row.CLAIMED) else None

        return resolve

    def adopt(self, job_id: str, expected_owner: str | None, expected_token: int) -> int | None:
        """Take over a claimed job of a dead daemon; return the new token, or None if another won.

        An owner whose lease lapsed but that no one declared lost yet is declared lost here, in the
        same transaction (its row locked against its renewal): once its job is taken it can never
        renew and start that job's agent again. One that renewed meanwhile keeps its job (None).
        """
        plan: list[int] = []
        declared: list[tuple[str, int]] = []

        def body(cur: Cur) -> int | None:
            plan.clear()
            declared.clear()
            if not self.leases.check(cur, lease=True):
                return None
            if expected_owner is not None and expected_owner != self.leases.owner:
                found = cur.execute(
                    "SELECT ended IS NOT NULL, lease_until < now(), host, pid FROM daemons WHERE owner = %s FOR UPDATE",
                    (expected_owner,),
                ).fetchone()
                if found is not None and not found[0]:
                    if not found[1]:
                        return None  # it renewed: alive, its job stays its own
                    cur.execute(
                        "UPDATE daemons SET ended = 'lost', ended_at = now(), ended_by = %s WHERE owner = %s",
                        (self.leases.nonce(), expected_owner),
                    )
                    cur.execute(
                        "UPDATE slots SET owner = NULL, nonce = NULL, taken = NULL WHERE owner = %s", (expected_owner,)
                    )
                    declared.append((str(found[2]), int(found[3])))
            row = cur.execute(
                "UPDATE jobs SET owner = %s, token = token + 1, updated = extract(epoch from now())::float8,"
                " spent = CASE WHEN cost_usd IS NULL THEN NULL ELSE coalesce(spent, updated) END"  # its earlier cost
                " WHERE job_id = %s AND state = 'claimed' AND owner IS NOT DISTINCT FROM %s AND token = %s"
                " RETURNING token",
                (self.leases.owner, job_id, expected_owner, expected_token),
            ).fetchone()
            if row is None:
                return None
            plan.append(int(row[0]))
            return plan[0]

        token = self.runner.run("adopt", body, self._owned(job_id, plan))
        if token is not None and declared and expected_owner is not None:
            host, pid = declared[0]
            self.leases.declared_lost(expected_owner, host, pid)
        return token

    def take_retry(self, job_id: str, kind: Request = Request.RETRY) -> int | None:
        """Turn a failed (for a revise, also a reviewed) job with an open request into a claim; return the token."""
        plan: list[int] = []
        states = (Row.FAILED, Row.REVIEW) if kind is Request.REVISE else (Row.FAILED,)

        def body(cur: Cur) -> int | None:
            plan.clear()
            if not self.leases.check(cur, lease=True):
                return None
            row = cur.execute("SELECT token, state FROM jobs WHERE job_id = %s FOR UPDATE", (job_id,)).fetchone()
            if row is None or row[1] not in states:
                return None
            asked = cur.execute(
                "SELECT 1 FROM requests WHERE job_id = %s AND kind = %s", (job_id, str(kind))
            ).fetchone()
            if asked is None:  # carried out already: one request, one retry
                return None
            plan.append(int(row[0]) + 1)
            cur.execute(
                "UPDATE jobs SET state = 'claimed', owner = %s, token = %s, spent = NULL,"  # earlier cost: from now
                " updated = extract(epoch from now())::float8 WHERE job_id = %s",
                (self.leases.owner, plan[0], job_id),
            )
            # a join waits again, max_wait counted from now (its wait rows keep their first claim's time otherwise)
            cur.execute("UPDATE waits SET since = extract(epoch from now())::float8 WHERE job_id = %s", (job_id,))
            # the reviewed attempt's follow-ups stay reserved until the job has moved (``clear_request``): a
            # revision cut short before is put back whole, and an approve then releases them
            return plan[0]

        return self.runner.run("take_retry", body, self._owned(job_id, plan))

    def reconcile(self, job_id: str, agent: str | None, parent: str | None, hops: int) -> bool:
        """Put back the claim row (no owner) of a job folder found in active/ without one."""
        plan: list[int] = []

        def body(cur: Cur) -> bool:
            plan.clear()
            if not self.leases.check(cur, lease=False):
                return False
            row = cur.execute("SELECT token, state FROM jobs WHERE job_id = %s FOR UPDATE", (job_id,)).fetchone()
            if row is not None and row[1] not in (Row.RESERVED, Row.RELEASED):
                return False
            plan.append((int(row[0]) if row else 0) + 1)
            cur.execute(_RECONCILE, (job_id, agent, plan[0], parent, hops))
            return True

        def resolve(cur: Cur) -> Found[bool] | None:
            if not plan:
                return Found(False)
            row = cur.execute("SELECT owner, token, state FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(True) if row == (None, plan[0], Row.CLAIMED) else None

        return self.runner.run("reconcile", body, resolve)
