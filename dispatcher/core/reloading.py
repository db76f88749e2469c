"""The daemon's config reload (SIGHUP) and its metrics file, which a reload may set, move or unset.

A reload keeps the old config when the new one is bad, or when it would move the
root or the ledger; the log file is reopened whatever it says (logrotate).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from dispatcher import lean
from dispatcher.core import announce
from dispatcher.core.claiming import Claims
from dispatcher.core.gatekeeper import GateKeeper
from dispatcher.core.housekeeping import Housekeeping
from dispatcher.core.running import RunningJobs
from dispatcher.core.watcher import Inbox
from dispatcher.errors import ConfigError
from dispatcher.lanes import Lanes
from dispatcher.ledger.base import Ledger
from dispatcher.spec.config import config_mark, load_config
from dispatcher.spec.settings import Config

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics

log = structlog.get_logger("dispatcher")


class _Scheduling(Protocol):
    """What a reload needs of ``core.scheduler.Scheduler``: its running jobs (``dispatcher_agents_running``)."""

    slots: RunningJobs[Any]


class Reloading:
    """``core.daemon.Daemon``'s part that reads its config again and keeps its metrics file."""

    config: Config
    config_path: Path | None
    root_override: Path | None
    metrics: Metrics | None
    house: Housekeeping
    claims: Claims  # the scheduler's: which agents a reload removed
    inbox: Inbox
    lanes: Lanes
    ledger: Ledger
    gatekeeper: GateKeeper
    sched: _Scheduling

    def reload(self) -> None:
        """Reload the config (SIGHUP); keep the old one if the new one is bad or moves the root."""
        from dispatcher import logs

        try:
            logs.SINK.open_file(self.config.log_file)  # reopen for logrotate, whatever the new config says
        except OSError as exc:
            where = exc.filename if exc.filename is not None else self.config.log_file  # the file or its folder
            log.error("log_file.reopen_failed", file=str(where), error=exc.strerror or str(exc))
        try:
            if self.config_path is None:
                raise ConfigError("no config file to reload")
            new = load_config(self.config_path, root=self.root_override)
            if new.root != self.config.root:
                if not _same_folder(new.root, self.config.root):
                    raise ConfigError("root: cannot change while running", file=str(self.config_path))
                new = dataclasses.replace(new, root=self.config.root)  # one folder, named as at the start
            if new.ledger != self.config.ledger:
                raise ConfigError("ledger: cannot change while running", file=str(self.config_path))
            if self.ledger.leases is not None and new.lease_s != self.config.lease_s:  # the others judge it by it
                raise ConfigError("lease: cannot change while running: restart the daemon", file=str(self.config_path))
            if new.log_file != self.config.log_file:
                try:
                    logs.SINK.open_file(new.log_file)
                except OSError as exc:
                    why = f"cannot open {new.log_file}: {exc.strerror or exc}"
                    raise ConfigError(why, file=str(self.config_path), field="log_file") from None
        except (ConfigError, OSError) as exc:
            log.error("config.rejected", error=str(exc))
            return
        except Exception as exc:  # a fault in reading it must not end a running daemon: the old config stays
            log.exception("config.rejected", error=f"{type(exc).__name__}: {exc}")
            return
        if new.metrics_file != self.config.metrics_file:  # set, moved or unset: takes effect now
            if self.metrics is not None and new.metrics_file:
                self.metrics.move_to(new.metrics_file)  # the counters carry on, since this daemon started
            else:
                if self.metrics is not None:
                    self.metrics.remove_file()
                self.metrics = self.house.ctx.metrics = self.house.ctx.finisher.metrics = self._metrics(new)
                self.gatekeeper.metrics = self.metrics  # dispatcher_agent_gated follows the gates' snapshot
                self.gatekeeper.publish()  # from its first write, not from the next refresh
                self.sched.slots.set_metrics(self.metrics)  # dispatcher_agents_running: the agents running now
                if self.metrics is not None:  # counted since this daemon started, not since the reload
                    self.metrics.seed_finished(self.house.ctx.finisher.finished.snapshot())
            self.house.metrics_now()
        if self.metrics is not None:
            self.metrics.set_labels(new.metrics_labels)
            self.metrics.add_agents(new.agents)  # an agent a reload adds has its series (at 0) at once
        gone = frozenset({*self.config.agents, *self.config.retired} - set(new.agents))
        back = bool(set(new.agents) - set(self.config.agents))
        self.config = new = dataclasses.replace(new, retired=gone)  # follow-ups to them wait, as their orders do
        self.claims.note_config(new)  # its agents: if a later reload removes one, its orders wait
        self.inbox.settle_s = new.settle_s
        self.house.start(
            self.lanes.ledger(self.ledger.record_config, config_mark(new)), "record_config"
        )  # for `status`
        log.info("config.reloaded", agents=sorted(new.agents), max_jobs=new.max_jobs)
        self.gatekeeper.kick()  # gates read again: a daily cap removed or raised lifts its gate, metrics follow
        announce.config_findings(new)
        if back:  # a retry or revise that waited for an agent this reload brings (back) runs now, not at a rescan
            self.house.start(self.house.requests(), "requests")

    def _metrics(self, config: Config) -> Metrics | None:
        """Return the metrics of metrics_file (None when unset); its first write is due at once."""
        if not config.metrics_file:
            return None
        lean.with_openssl()  # prometheus_client imports ssl
        from dispatcher.metrics import Metrics  # prometheus_client only when it is used

        return Metrics(
            config.metrics_file, socket.gethostname(), os.getpid(), agents=config.agents, labels=config.metrics_labels
        )


def _same_folder(a: Path, b: Path) -> bool:
    """Return True if two paths name one folder (through a symlink, say): the root did not change."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
