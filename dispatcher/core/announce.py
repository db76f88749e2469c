"""What a starting (or reloading) daemon tells the operator before any job runs.

- ``config.problem``: each finding of `validate --config` (a program or script the
  agent will not find is an error line, ``repair`` that can never act a warning),
  so the journal says at start what would otherwise surface as a failed job;
- ``daemon.shared``: other daemons already run on this root. That is allowed
  (they share the work) but should never be a surprise.
"""

from __future__ import annotations

import structlog

from dispatcher.ledger.base import Ledger
from dispatcher.spec.programs import check_agents
from dispatcher.spec.settings import Config

log = structlog.get_logger("dispatcher")


def config_findings(config: Config) -> None:
    """Log each problem `validate --config` would report, one line each."""
    for f in check_agents(config):
        (log.error if f.error else log.warning)("config.problem", field=f.field, problem=f.message)


def other_daemons(ledger: Ledger, owner: str) -> None:
    """Log one line when other daemons are alive on this root (blocking: a ledger read)."""
    others = [d for d in ledger.daemons() if d.alive and d.owner != owner]
    if others:
        log.info(
            "daemon.shared",
            others=[f"{d.pid} on {d.host}" for d in others],
            note="other daemons run on this root; they share its work",
        )
