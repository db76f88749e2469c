"""Check an attempt: gather the evidence from work/ off the loop, then run the pure checks.

The evidence (``evidence.gather``: the receipt, the output streamed into a
summary, a listing of work/, the outbox) is read in the io pool; which ids are
already known asks the ledger and the orders queued in inbox/ or held in held/; in the same trip
the receipt and the accepted output are fsynced (their bytes are what result.json
vouches for). The checks themselves (``checks.run_checks``) are pure functions.
"""

from __future__ import annotations

from typing import Any

import structlog

from dispatcher import faults
from dispatcher.checks.builtin import run_checks
from dispatcher.checks.evidence import gather
from dispatcher.checks.facts import Evidence, Exit
from dispatcher.layout import Layout
from dispatcher.ledger.base import Child, Ledger
from dispatcher.lifecycle import Row
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.order import Order
from dispatcher.spec.result import CheckResult
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import queued_ids

log = structlog.get_logger("dispatcher")


def collect(
    cfg: Config,
    ledger: Ledger,
    layout: Layout,
    spec: JobSpec,
    order: Order,
    folder: JobFolder,
    exit_: Exit,
    record: Attempt | None = None,
    changed: list[str] | str | None = None,
) -> tuple[Evidence, list[Child]]:
    """Write the attempt's record (if given), then gather its evidence (blocking: the io pool).

    One trip off the loop for all three: the record of an attempt that just ended, what
    its checks read, and the fsync of the files they vouch for (``vouched``).
    """
    if record is not None:
        folder.record_attempt(record)
        faults.point("attempt.recorded")
    me = spec.job_id

    def known(ids: list[str]) -> frozenset[str]:
        found = ledger.known(ids)
        mine = {i for i, e in found.items() if e.parent == me and e.state in (Row.RESERVED, Row.RELEASED, Row.HELD)}
        rest = [i for i in ids if i not in found]
        queued = queued_ids(layout.inbox, rest)
        held = queued_ids(layout.held, [i for i in rest if i not in queued])  # an operator's paused order
        return frozenset((set(found) - mine) | queued | held)

    ev, followups = gather(
        order=order,
        agent=spec.agent.name,
        writes=tuple(spec.writes),
        exit=exit_,
        work=folder.work_dir,  # the plain path: no Path made for it
        given=spec.given,
        agents=cfg.agent_names(),  # a follow-up to an agent a reload removed waits for it, as its orders do
        max_timeout_s=cfg.max_timeout_s,
        max_order_bytes=cfg.max_order_bytes,
        known=known,
        hops=spec.hops,
        max_hops=cfg.max_hops,
        max_followups=cfg.max_followups,
        changed=changed,
        left=spec.checks_left,
    )
    folder.sync_work(vouched(ev, [f.name for f, data in followups if data is not None]))
    return ev, [Child(f.order.job_id, f.order.to, f.name) for f, _ in followups if f.order is not None]


def vouched(ev: Evidence, outbox: list[str]) -> list[str]:
    """Return the files of work/ the checks read and could pass, the receipt last.

    The follow-ups read from outbox/, ``accept.output`` and the receipt are fsynced in the
    trip that read them, before any result names them (README, "Guarantees"). The receipt
    comes last and work/ (which names it) after every file: a cut in between must not
    leave a durable receipt beside lost follow-ups or a lost output, which a recovery
    would then pass without them.
    """
    rels = [f"outbox/{name}" for name in outbox]
    out = ev.order.accept.output
    if out is not None and ev.output is not None and not ev.output.missing and not ev.output.error:
        rels.append(out)
    if not ev.receipt.missing and not ev.receipt.error:
        rels.append("receipt.json")
    return rels


def check(ev: Evidence) -> list[CheckResult]:
    """Run the pure checks on gathered evidence and log the verdict."""
    results = run_checks(ev)
    log.info(
        "job.verified", passed=len([c for c in results if c.ok]), failed=[c.name for c in results if c.ok is False]
    )
    return results


def collect_checked(*args: Any) -> tuple[list[CheckResult], list[Child]]:
    """``collect``, then ``check``: the checks and the follow-ups of an attempt (blocking: the io pool)."""
    ev, followups = collect(*args)
    return check(ev), followups
