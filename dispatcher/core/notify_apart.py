"""A command's own notification, run apart from the command (contract section 11).

``approve`` raises ``budget.held`` itself when it holds a follow-up over the chain budget,
and returns at once. This process, started detached by ``job.notice.start_detached``,
runs the notify command as the daemon does (``core.notify``: never through a shell, its
own process group, an agent's environment rules, a timeout of 30 s) and logs
``notify.failed`` when it fails, hangs or cannot start: into ``log_file`` and, for the
journal, to a running daemon's stdout (``store.relay``; the next daemon to start writes
it when none runs).

    python -m dispatcher.core.notify_apart JSON

JSON holds ``notify``, ``kill_grace_s``, ``log_file``, ``root``, ``event``, ``job_id``, ``result``,
``agent`` and ``reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher import logs
from dispatcher.core.notify import Notifications
from dispatcher.layout import Layout
from dispatcher.store.relay import Relay


@dataclass(frozen=True, slots=True)
class _Settings:
    notify: tuple[str, ...]
    kill_grace_s: float
    notify_max_running: int = 1


def run(spec: dict[str, Any]) -> None:
    """Run one notification as the daemon would, and wait for it (its timeout bounds the wait)."""
    root = Path(spec["root"])
    settings = _Settings(tuple(spec["notify"]), float(spec["kill_grace_s"]))
    logs.SINK.console = open(os.devnull, "w")  # noqa: SIM115 - the sink keeps it for the process's life
    log_file = spec.get("log_file")
    try:
        logs.configure(log_file=Path(log_file) if log_file else None, console=False)
    except OSError:  # its lines still reach the daemon's stdout
        logs.configure(log_file=None, console=False)
    logs.SINK.relay = Relay(Layout(root)).send

    async def notify() -> None:
        notifications = Notifications(lambda: settings, root)
        result = Path(spec["result"]) if isinstance(spec.get("result"), str) else None
        notifications.fire(spec["event"], spec.get("job_id"), spec.get("agent"), spec.get("reason"), result)
        await notifications.close(drain=True)

    asyncio.run(notify())


def main(argv: list[str]) -> int:
    """Read the notification from argv[1] (JSON) and run it; exit 0, or 2 on a malformed argument."""
    try:
        spec = json.loads(argv[1])
    except (IndexError, ValueError):
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
