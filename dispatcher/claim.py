"""Inspect inbox files, refuse bad ones, and claim good ones into active/.

A claim is two steps, each safe to interrupt:

1. the ledger row (``BEGIN IMMEDIATE``; one winner over all daemons), then
2. the job folder, built under ``.state/staging/<owner>.claim-<id>`` and put in
   place by one rename into ``active/<job_id>``; the inbox file is renamed into
   it just before, so it is always in exactly one place.

A daemon that dies between the two leaves a ledger row owned by a dead daemon
and the file still in inbox/ (or a staging folder holding it): the next daemon
takes the claim over (``takeover``) or finishes the staging rename.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dispatcher import fsutil
from dispatcher.config import Agent, Config
from dispatcher.errors import OrderError, oneline, printable
from dispatcher.evidence import digest
from dispatcher.layout import Layout, State, iso, utc_stamp
from dispatcher.ledger import Claim, Entry, Ledger
from dispatcher.loader import load_document
from dispatcher.orders import Order, order_format, parse_order, to_json
from dispatcher.runner import render

JOB_FILE = "job.json"


@dataclass(frozen=True, slots=True)
class Inspected:
    """A readable, valid order file waiting to be claimed."""

    name: str
    data: bytes
    order: Order
    digest: str
    mtime_ns: int
    received: float
    inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file that was read


@dataclass(frozen=True, slots=True)
class Refusal:
    """A file that never becomes a job, and why."""

    name: str
    reason: str
    job_id: str | None = None
    entry_kind: str | None = None  # set for symlinks, FIFOs, devices, folders
    agent: str | None = None


def inspect(layout: Layout, name: str, config: Config) -> Inspected | Refusal | None:
    """Read and validate inbox/<name>; None if it is gone (taken or removed)."""
    path = layout.inbox / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = fsutil.kind_of(st.st_mode)
        return Refusal(name, f"a {kind} is not a work order; it was not opened", entry_kind=kind)
    if order_format(name) is None:
        return Refusal(name, "not a work order (the name must end in .yaml, .yml or .json)")
    try:
        data = fsutil.read_regular(path, config.max_order_bytes)
        again = os.lstat(path)
    except FileNotFoundError:
        return None
    except fsutil.NotRegular as exc:
        return Refusal(name, f"a {exc.kind} is not a work order; it was not opened", entry_kind=exc.kind)
    except ValueError:
        return Refusal(name, f"larger than max_order_bytes ({st.st_size} > {config.max_order_bytes} bytes)")
    except OSError as exc:
        return Refusal(name, f"cannot be read: {exc.strerror}")
    if (again.st_dev, again.st_ino, again.st_size, again.st_mtime_ns) != (
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    ):
        return None  # replaced or written to while being read: its own event brings it back
    received = time.time()
    try:
        order = parse_order(
            data,
            name,
            agents=config.agents,
            max_timeout_s=config.max_timeout_s,
            max_bytes=config.max_order_bytes,
        )
    except OrderError as exc:
        return Refusal(name, exc.reason, job_id=_best_job_id(data, name))
    return Inspected(name, data, order, digest(data), st.st_mtime_ns, received, (st.st_dev, st.st_ino))


def _best_job_id(data: bytes, name: str) -> str | None:
    """Return the job_id of an invalid order if one can be read, for the refusal's result."""
    try:
        body = load_document(data, order_format(name) or "yaml")
    except (OrderError, RecursionError, ValueError):
        return None
    job_id = body.get("job_id") if isinstance(body, dict) else None
    return job_id if isinstance(job_id, str) else None


def refuse(
    layout: Layout, refusal: Refusal, owner: str, on_placed: Callable[[Path], None] | None = None
) -> Path | None:
    """Move a refused file into failed/<stem>@<UTC timestamp>/ with a result.json.

    ``on_placed`` is called with the folder right after the rename (to log it
    before the folder fsync). Returns the folder, or None if the file vanished first.
    """
    src = layout.inbox / refusal.name
    stem = Path(refusal.name).stem or "entry"
    stage = layout.staging / f"{owner}.refuse-{secrets.token_hex(6)}"
    stage.mkdir()
    base = f"{_cut(stem, 180)}@{utc_stamp()}"
    (stage / ".target").write_bytes(os.fsencode(base))
    (stage / ".source").write_bytes(os.fsencode(refusal.name))
    inner = "entry" if refusal.entry_kind is not None else f"order{Path(refusal.name).suffix}"
    result: dict[str, Any] = {
        "job_id": refusal.job_id,
        "state": "failed",
        "agent": None,
        "reason": oneline(refusal.reason),
        "file": printable(refusal.name),
        "checks": [],
        "attempts": [],
        "received": iso(time.time()),
        "finished": iso(time.time()),
        "parent": None,
        "children": [],
    }
    (stage / "result.json").write_bytes(fsutil.dump_json(result))
    try:
        fsutil.move_out(src, stage / inner)
    except FileNotFoundError:
        _remove_stage(stage)
        return None
    return place_refusal(layout, stage, base, on_placed)


def _cut(text: str, limit: int) -> str:
    """Return text cut to at most limit bytes of its file-system encoding."""
    raw = os.fsencode(text)
    return text if len(raw) <= limit else os.fsdecode(raw[:limit].decode("utf-8", "ignore").encode())


def place_refusal(layout: Layout, stage: Path, base: str, on_placed: Callable[[Path], None] | None = None) -> Path:
    """Rename a built refusal folder into failed/, adding -2, -3, ... if the name is taken."""
    n = 1
    while True:
        target = layout.folder(State.FAILED) / (base if n == 1 else f"{base}-{n}")
        try:
            fsutil.rename_noreplace(stage, target)
        except FileExistsError:
            n += 1
            continue
        (target / ".target").unlink(missing_ok=True)
        (target / ".source").unlink(missing_ok=True)
        if on_placed is not None:
            on_placed(target)
        fsutil.fsync_dir(layout.folder(State.FAILED))
        return target


def _remove_stage(stage: Path) -> None:
    for child in stage.iterdir():
        child.unlink()
    stage.rmdir()


def drop_inbox_twin(layout: Layout, name: str, kept: Path) -> None:
    """Remove inbox/<name> if it is the same inode as kept (a crash between link and unlink)."""
    if name and fsutil.same_file(layout.inbox / name, kept):
        (layout.inbox / name).unlink()


def take_claim(ledger: Ledger, layout: Layout, item: Inspected, owner: str, owner_alive: Any) -> Claim:
    """Claim the order's job id in the ledger (step 1)."""

    def may_take_over(entry: Entry) -> bool:
        return (
            entry.source == item.name
            and entry.owner is not None
            and not owner_alive(entry.owner)
            and layout.find(entry.job_id) is None
        )

    return ledger.claim(
        item.order.job_id,
        agent=item.order.to,
        owner=owner,
        source=item.name,
        digest=item.digest,
        may_take_over=may_take_over,
    )


def build_job(
    layout: Layout, item: Inspected, agent: Agent, claim: Claim, owner: str
) -> tuple[Path, dict[str, Any], Order] | None:
    """Build the job folder in staging and rename it into active/ (step 2).

    Returns the job folder with its spec (job.json) and the order as the agent
    sees it, or None if the inbox file vanished before it moved. The rename is
    made durable (active/ fsynced) before any agent can start; the inbox
    unlink is not: if a power loss brings the name back, it is the same inode
    as the job's order file and is dropped, not refused (``drop_inbox_twin``).
    """
    order = item.order
    stage = layout.staging / f"{owner}.claim-{order.job_id}-{secrets.token_hex(4)}"
    work = stage / "work"
    os.mkdir(stage)
    os.mkdir(work)
    os.mkdir(stage / "attempts")
    body = dict(order.body)
    body["parent"] = claim.parent
    body["hops"] = claim.hops
    order_json = to_json(body)
    (work / "order.json").write_bytes(order_json)
    given = {"order.json": digest(order_json)}
    spec = job_spec(item, agent, claim)
    if agent.prompt is not None:
        values = prompt_values(body, agent, layout.job(State.ACTIVE, order.job_id))
        prompt = render(agent.prompt, values, prompt=True).encode()
        (work / "prompt.md").write_bytes(prompt)
        given["prompt.md"] = digest(prompt)
    spec["given"] = given
    (stage / JOB_FILE).write_bytes(fsutil.dump_json(spec))
    ext = Path(item.name).suffix
    kept = stage / f"order{ext}"
    try:
        fsutil.move_out(layout.inbox / item.name, kept)
        st = os.lstat(kept)
        if (st.st_dev, st.st_ino) != item.inode:
            # another file took the name since it was read: put it back, untouched
            try:
                fsutil.move_out(kept, layout.inbox / item.name)
            except FileExistsError:
                fsutil.move_out(kept, layout.inbox / f"{Path(item.name).stem}-{secrets.token_hex(3)}{ext}")
            raise FileNotFoundError(item.name)
    except FileNotFoundError:
        for p in (work / "order.json", work / "prompt.md", stage / JOB_FILE, kept):
            p.unlink(missing_ok=True)
        for d in (work, stage / "attempts", stage):
            d.rmdir()
        return None
    final = layout.job(State.ACTIVE, order.job_id)
    fsutil.rename_noreplace(stage, final)
    fsutil.fsync_dir(layout.folder(State.ACTIVE))
    return final, spec, replace(order, body=body)


def job_spec(item: Inspected, agent: Agent, claim: Claim) -> dict[str, Any]:
    """Return what a job keeps about itself in job.json: its agent settings are frozen here."""
    order = item.order
    max_attempts = order.max_attempts or agent.max_attempts
    return {
        "job_id": order.job_id,
        "source": item.name,
        "received": item.received,
        "parent": claim.parent,
        "hops": claim.hops,
        "agent": agent.to_json(),
        "timeout": order.timeout_s or agent.timeout_s,
        "max_attempts": max_attempts,
        "budget": max_attempts,
        "writes": list(order.writes if order.writes is not None else agent.writes),
    }


def prompt_values(body: dict[str, Any], agent: Agent, job_dir: Path) -> dict[str, str]:
    """Return the prompt template's placeholder values for one order."""
    work = job_dir / "work"
    writes = body.get("writes", list(agent.writes))
    return {
        "job_id": body["job_id"],
        "from": body["from"],
        "to": body["to"],
        "task": body["task"],
        "items_json": json.dumps(body["items"], ensure_ascii=False),
        "writes": ", ".join(writes),
        "accept_json": json.dumps(body.get("accept") or {}, ensure_ascii=False),
        "order": str(work / "order.json"),
        "workspace": str(work),
        "receipt": str(work / "receipt.json"),
    }
