"""The operator's actions from the web view: the very code the commands run, logged with ``via: web``.

Each action opens the ledger for writing through ``Operator`` (as `dispatcher
approve` does), acts on one job id and closes it again; so an action from a
page is exactly as crash-safe as the same command. Every log line written
meanwhile (``job.approved``, ``job.held`` ...) carries ``via: web``, and one
``web.action`` line records the outcome.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import structlog

from dispatcher import logs
from dispatcher.errors import ConfigError, DispatchError, NotFound, WrongState
from dispatcher.layout import JOB_ID, Layout
from dispatcher.ops.actions import Operator
from dispatcher.query.report import read_order_file
from dispatcher.spec.config import load_config
from dispatcher.spec.settings import Config
from dispatcher.store.queued import find_queued
from dispatcher.text import is_utf8_text

log = structlog.get_logger("dispatcher")

#: the actions of section 17, in the order the pages show them
ACTIONS = ("approve", "revise", "reject", "retry", "cancel", "hold", "release")
#: the actions this dispatcher cannot do yet (none left: `revise` came with section 14)
NOT_BUILT: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an action answered: an HTTP status and the line a person reads."""

    status: int
    message: str

    @property
    def ok(self) -> bool:
        """True when the action was done."""
        return self.status == 200


class Actions:
    """Runs actions one at a time (two clicks on one job never race each other inside this process)."""

    def __init__(self, config: Config, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self._lock = threading.Lock()

    def _config(self) -> Config:
        """Read the config again, as each command does (``max_revisions``, ``notify`` may have changed)."""
        if self.config.path is None:
            return self.config
        config = load_config(self.config.path, root=self.config.root)
        if config.root != self.config.root:
            raise ConfigError("root: changed since `dispatcher web` started; restart it", file=str(config.path))
        if config.log_file != logs.SINK.path:  # moved in the config: the action's lines go where `logs` reads
            with contextlib.suppress(OSError):  # as at the start: a file it may not open leaves the lines on stdout
                logs.SINK.open_file(config.log_file)
        return config

    def _agent(self, job_id: str) -> str | None:
        """Return the job's agent for a line about a refused request (None when nothing can say)."""
        try:
            op = Operator(self.config, self.layout)
        except (DispatchError, OSError):
            return None
        try:
            return _agent_of(op, job_id)
        finally:
            op.close()

    def run(self, action: str, job_id: str, *, note: str | None = None, who: str = "token") -> Outcome:
        """Run one action on one job and return its outcome (404 unknown, 409 wrong state, 501 not built)."""
        if action not in ACTIONS:
            return Outcome(404, f"{action}: no such action (one of {', '.join(ACTIONS)})")
        if action in NOT_BUILT:
            return Outcome(501, NOT_BUILT[action])
        bad = None
        if action == "revise" and not (note or "").strip():  # as `dispatcher revise ID --note TEXT`, which needs one
            bad = 'revise needs a note: what the next attempt should change (give {"note": TEXT})'
        elif note is not None and not is_utf8_text(note):  # a lone surrogate escaped in the JSON body
            bad = f"{action}: the note is not valid UTF-8 text"
        if bad is not None:
            outcome = Outcome(400, bad)
            log.info(  # nothing was done; the line says so, as for any other outcome, with the job's agent
                "web.action", action=action, job_id=job_id, agent=self._agent(job_id), status=400,
                message=outcome.message, by=who, via="web",
            )  # fmt: skip
            return outcome
        text = note or None  # cut and made one line by the commands' own code, as for `--note` and `--reason`
        with self._lock, structlog.contextvars.bound_contextvars(via="web"):
            try:
                config = self._config()
            except DispatchError as exc:  # the config is bad now: nothing is done, as a command would exit 2
                log.error("web.action", action=action, job_id=job_id, agent=None, status=503, message=str(exc), by=who)
                return Outcome(503, str(exc))
            op = Operator(config, self.layout)
            op.reason = text
            op.note = text
            try:
                message = getattr(op, action)(job_id)
                notes = [n.removeprefix(f"{job_id}: ") for n in op.notes]  # a retried join's note, as the CLI's
                outcome = Outcome(200, "; ".join([str(message), *notes]))
            except NotFound as exc:
                outcome = Outcome(404, str(exc))
            except WrongState as exc:
                outcome = Outcome(409, str(exc))
            except DispatchError as exc:  # an unreachable ledger and the like: nothing was done
                outcome = Outcome(503, str(exc))
            finally:
                agent = _agent_of(op, job_id)
                op.close()
            log.info(
                "web.action",
                action=action,
                job_id=job_id,
                agent=agent,
                status=outcome.status,
                message=outcome.message,
                by=who,
            )
        return outcome


def _agent_of(op: Operator, job_id: str) -> str | None:
    """Return the job's agent as the ledger knows it, else as its queued or held order names it, else None."""
    if not JOB_ID.fullmatch(job_id):
        return None
    try:
        entry = op.ledger.get(job_id)
    except (DispatchError, OSError):
        entry = None
    if entry is not None:
        return entry.agent
    for folder in (op.layout.held, op.layout.inbox):  # a queued order (held, released, cancel asked)
        name = find_queued(folder, [job_id]).get(job_id)
        if name is not None:
            return read_order_file(folder / name, op.config.max_order_bytes).agent
    return None
