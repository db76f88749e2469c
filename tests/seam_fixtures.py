"""In-process pieces of one daemon on tmp_path, for the tests of its seams (test_seam_*.py).

A ``Seam`` is what ``Daemon.startup`` builds, without the daemon: a real layout on
disk, a real SQLite ledger registered as one owner, the two lanes, the finisher, an
``Inbox`` and a ``JobContext``. Agents are tiny ``sh -c`` programs (a start costs
milliseconds); timings are shrunk through the config, never by patching time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dispatcher.core.watcher import Inbox
from dispatcher.job import intake
from dispatcher.job.context import JobContext
from dispatcher.job.finish import Finisher
from dispatcher.lanes import Lanes
from dispatcher.layout import Layout
from dispatcher.ledger.base import DaemonInfo
from dispatcher.ledger.sqlite import SqliteLedger
from dispatcher.spec.config import build_config
from dispatcher.spec.settings import Config
from dispatcher.store import placing
from dispatcher.store.placing import Pick, Started
from dispatcher.store.refusals import Refusal

T = TypeVar("T")
DEADLINE = 10.0

# An agent that does its job right: a receipt naming the order's one item (R1).
RECEIPT = '{"job_id": "%s", "input_ids": ["R1"], "status": "done"}'
GOOD = f'printf \'{RECEIPT}\' "$DISPATCH_JOB_ID" > "$DISPATCH_WORKSPACE/receipt.json"'


def sh(script: str, **settings: Any) -> dict[str, Any]:
    """Return an agent definition running ``sh -c script``."""
    return {"command": ["sh", "-c", script], "timeout": 20, **settings}


def order(job_id: str, to: str = "worker", **extra: Any) -> dict[str, Any]:
    """Return a valid order with one item, R1."""
    return {"job_id": job_id, "from": "tester", "to": to, "task": "Do it.", "items": [{"id": "R1"}], **extra}


@dataclass
class Seam:
    """One daemon's parts, in-process, on a dispatch root under tmp_path."""

    tmp: Path
    layout: Layout
    ledger: SqliteLedger
    config: Config
    lanes: Lanes
    inbox: Inbox
    finisher: Finisher
    ctx: JobContext
    stopping: bool = False
    refused: list[Refusal] = field(default_factory=list)

    def drop(self, body: dict[str, Any] | bytes, name: str | None = None, *, mtime: float | None = None) -> str:
        """Put an order into inbox/ the safe way (a temp name, then a rename); return its name."""
        if isinstance(body, dict):
            name = name or f"{body['job_id']}.json"
            data = json.dumps(body).encode()
        else:
            assert name, "a name is needed for raw bytes"
            data = body
        tmp = self.layout.inbox / f".{name}.tmp"
        tmp.write_bytes(data)
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
        os.rename(tmp, self.layout.inbox / name)
        return name

    def inspected(self, name: str) -> placing.Inspected:
        """Return inbox/<name> read and validated (it must be a valid order)."""
        found = intake.inspect(self.layout, name, self.config)
        assert isinstance(found, placing.Inspected), f"{name} was not a valid order: {found}"
        return found

    def claim(self, *names: str) -> list[intake.Claimed_]:
        """Claim these inbox files in one batch, as the ledger lane does (on this thread)."""
        picks = [Pick(item, self.config.agents[item.order.to]) for item in map(self.inspected, names)]
        return intake.claim(self.layout, self.ledger, picks, on_refused=self._refused, finisher=self.finisher)

    def started(self, job_id: str, to: str = "worker", **extra: Any) -> Started:
        """Drop and claim one order; return the claimed job in active/."""
        [answer] = self.claim(self.drop(order(job_id, to, **extra)))
        assert isinstance(answer, Started), f"{job_id} was not claimed: {answer}"
        return answer

    def result(self, state: str, job_id: str) -> dict[str, Any]:
        """Return result.json of a finished job."""
        data: dict[str, Any] = json.loads((self.layout.root / state / job_id / "result.json").read_text())
        return data

    def _refused(self, folder: Path, refusal: Refusal) -> None:
        self.refused.append(refusal)


def make_seam(tmp: Path, agents: dict[str, dict[str, Any]] | None = None, **top: Any) -> Seam:
    """Build the parts on tmp/root: the `worker` agent does its job right unless agents are given."""
    root = tmp / "root"
    body: dict[str, Any] = {
        "max_jobs": 2,
        "settle": 0.2,
        "retry_delay": 0.01,
        "kill_grace": 1,
        "agents": agents if agents is not None else {"worker": sh(GOOD)},
        **top,
    }
    config = build_config(body, None, root=root)
    layout = Layout(config.root)
    layout.create()
    ledger = SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)
    ledger.register(DaemonInfo(f"seam-{os.getpid()}", os.getpid(), "localhost", time.time()))
    lanes = Lanes()
    inbox = Inbox(layout.inbox, config.settle_s)
    finisher = Finisher(layout, ledger, lanes, lambda: config, hints=inbox)
    holder: list[Seam] = []
    ctx = JobContext(
        layout=layout,
        ledger=ledger,
        lanes=lanes,
        finisher=finisher,
        config=lambda: config,
        stopping=lambda: holder[0].stopping,
    )
    seam = Seam(tmp, layout, ledger, config, lanes, inbox, finisher, ctx)
    holder.append(seam)
    return seam


@contextlib.contextmanager
def open_seam(tmp: Path, agents: dict[str, dict[str, Any]] | None = None, **top: Any) -> Iterator[Seam]:
    """Build a Seam on tmp; its lanes and ledger are closed on the way out."""
    s = make_seam(tmp, agents, **top)
    try:
        yield s
    finally:
        s.lanes.shutdown(wait=True)
        s.ledger.close()


def run(coro_fn: Callable[[], Awaitable[T]], timeout: float = DEADLINE) -> T:
    """Run an async test body on a fresh event loop, failing after timeout seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(bounded())


async def until(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Yield to the loop until predicate returns something truthy; fail after timeout."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)
