"""What a starting (or reloading) daemon tells the operator before any job runs.

- ``config.problem``: each finding of `validate --config` (a program or script the
  agent will not find is an error line, ``repair`` that can never act a warning),
  so the journal says at start what would otherwise surface as a failed job;
- ``daemon.shared``: other daemons already run on this root. That is allowed
  (they share the work) but should never be a surprise; and a ``config.problem``
  when their metrics file is this one's.
"""

from __future__ import annotations

import os
import socket

import structlog

from dispatcher.ledger.base import Ledger
from dispatcher.spec.programs import check_agents
from dispatcher.spec.settings import Config

log = structlog.get_logger("dispatcher")


def config_findings(config: Config) -> None:
    """Log each problem `validate --config` would report, one line each."""
    for f in check_agents(config):
        (log.error if f.error else log.warning)("config.problem", field=f.field, problem=f.message)


def other_daemons(ledger: Ledger, owner: str, metrics_file: str | None = None) -> None:
    """Log one line when other daemons are alive on this root (blocking: a ledger read).

    With ``metrics_file`` set, a live daemon whose file would be this one's (a path
    without ``{pid}`` or ``{host}`` where they would tell them apart) is a warning too:
    each would overwrite the other's figures every few seconds.
    """
    others = [d for d in ledger.daemons() if d.alive and d.owner != owner]
    if not others:
        return
    log.info(
        "daemon.shared",
        others=[f"{d.pid} on {d.host}" for d in others],
        note="other daemons run on this root; they share its work",
    )
    if metrics_file:
        from dispatcher.metrics import metrics_path  # loaded already with the daemon's metrics (prometheus_client)

        mine = metrics_path(metrics_file, socket.gethostname(), os.getpid())
        same = [d for d in others if metrics_path(metrics_file, d.host, d.pid) == mine]
        if same:
            log.warning(
                "config.problem",
                field="metrics_file",
                problem=f"{mine} is also the file of the daemons {', '.join(f'{d.pid} on {d.host}' for d in same)}"
                " on this root: each would overwrite the other's figures; put {pid} (and {host}, across hosts) in it",
            )
