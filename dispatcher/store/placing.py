"""Make a claimed job's folder: staged beside the root, written, fsynced together, renamed into place.

``stage`` links the inbox file into a staging folder under ``.state/staging/``;
after the ledger's claim, ``write`` fills it (``work/order.json``, ``prompt.md``,
``job.json``) without syncing; the claim fsyncs every written folder of its batch
at once (``fsutil.fsync_many``) and ``place`` renames each into active/ (or
waiting/). Any error undoes that job's claim (``undo``): the order stays in inbox/.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dispatcher import faults, fsutil
from dispatcher.fsutil import digest
from dispatcher.layout import Layout
from dispatcher.ledger.base import Claimed, Ledger
from dispatcher.lifecycle import Row, State
from dispatcher.shortage import SHORT
from dispatcher.spec.jobspec import JobSpec, prompt_values, render
from dispatcher.spec.order import Order
from dispatcher.spec.orders import suffix_of, to_json
from dispatcher.spec.settings import Agent
from dispatcher.store.jobstore import JOB_FILE, JobFolder
from dispatcher.store.results import is_disk_full
from dispatcher.store.staging import new_stage, remove_stage

log = structlog.get_logger("dispatcher")
#: orders larger than this come with their body's JSON text made ahead (the YAML child writes it, the
#: scan lane encodes a JSON one): a 1 MB body took 10 to 20 ms to encode, twice per claim, in the ledger
#: lane with the interpreter lock held, while every other claim and finish waited
AHEAD_TEXT_BYTES = 64 * 1024
_LEFT_STAGES: list[str] = []  # claim staging folders a shortage kept from going (only the ledger lane uses it)


@dataclass(frozen=True, slots=True)
class Inspected:
    """A readable, valid order file waiting to be claimed."""

    name: str
    data: bytes
    order: Order
    digest: str
    received: float
    inode: tuple[int, int]  # (st_dev, st_ino) of the file that was read
    text: str | None = None  # a large order's ``body_text``, made off the ledger lane (see ``AHEAD_TEXT_BYTES``)
    path: str = ""  # inbox/<name> as it was read ("": joined from the layout when needed)
    stamp: tuple[int, int] | None = None  # (st_size, st_mtime_ns) of the file as it was read


def inbox_path(layout: Layout, item: Inspected) -> str:
    """Return the path of the inbox file an item was read from."""
    return item.path or f"{layout.inbox_str}/{item.name}"


@dataclass(frozen=True, slots=True)
class Pick:
    """An inspected order chosen for a claim, with the agent settings it will run with."""

    item: Inspected
    agent: Agent
    base_commit: str | None = None  # its workspace's base as a commit, resolved now (section 15: at claim time)


@dataclass(frozen=True, slots=True)
class Started:
    """A claimed job, in place in active/: ready for its agent."""

    folder: JobFolder
    spec: JobSpec
    order: Order
    token: int
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file left where it is: another daemon is claiming it, it changed, or the disk is full."""

    name: str
    retry_later: bool = False


def stage(layout: Layout, owner: str, item: Inspected) -> str | None:
    """Make the claim's staging folder holding a link to the inbox file; return its path, None if the file changed."""
    stage = new_stage(layout, owner, "claim", item.order.job_id)
    kept = f"{stage}/order{suffix_of(item.name)}"
    try:
        os.link(inbox_path(layout, item), kept, follow_symlinks=False)
    except FileNotFoundError:
        os.rmdir(stage)
        return None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES, errno.EMLINK):  # another user's file (fs.protected_hardlinks)
            try:
                copied = _copy_in(inbox_path(layout, item), kept, item)
            except OSError:
                remove_stage(stage)
                raise
            if not copied:
                remove_stage(stage)
            return stage if copied else None
        os.rmdir(stage)  # (an immutable file, a full disk): no empty staging folder left at each try
        raise
    st = os.lstat(kept)
    if (st.st_dev, st.st_ino) != item.inode:  # another file took the name since it was read
        remove_stage(stage)
        return None
    if item.stamp is not None and (st.st_size, st.st_mtime_ns) != item.stamp:
        # written to in place since it was read (an editor's save): the job would keep bytes it never read;
        # the write's own event brings the file back, read again
        remove_stage(stage)
        return None
    return stage


def _copy_in(src: str, kept: str, item: Inspected) -> bool:
    """Write the bytes read from src into kept, fsynced; False if src is no longer the file read.

    For an order the daemon may read but not link: a file another user owns and the daemon may
    not write, where ``fs.protected_hardlinks`` (the Debian and Ubuntu default) refuses the link.
    Its own file refused a link (immutable) raises PermissionError, as the link did.
    The inbox name still goes only once the job is in place (``announce``, by the inode read).
    """
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return False
    if st.st_uid == os.geteuid():  # the daemon's own file refused a link: immutable (chattr +i), not another's
        raise PermissionError(errno.EPERM, "cannot be linked", src)
    if (st.st_dev, st.st_ino) != item.inode or st.st_size != len(item.data):
        return False
    if item.stamp is not None and (st.st_size, st.st_mtime_ns) != item.stamp:
        return False
    fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
    try:
        view = memoryview(item.data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True, slots=True)
class Written:
    """A claimed job's folder written in its staging place: what to fsync before it moves into ``state``."""

    spec: JobSpec
    order: Order
    state: State
    sync: tuple[str, ...]


def write(layout: Layout, ledger: Ledger, pick: Pick, stage: str, claimed: Claimed) -> Written | Skipped:
    """Write the claimed job's folder in its staging place (not yet fsynced); undo the claim on error."""
    try:
        return _write_job(layout, stage, pick.item, pick.agent, claimed, pick.base_commit)
    except (OSError, MemoryError) as exc:
        return undo(ledger, pick.item, stage, claimed, _as_os_error(exc))


def place(
    layout: Layout, ledger: Ledger, pick: Pick, stage: str, claimed: Claimed, w: Written, error: OSError | None
) -> Started | Skipped:
    """Rename the synced staging folder into active/ (or waiting/); undo on error.

    Its inbox name goes once the state folder is fsynced (``announce``).
    """
    item = pick.item
    target = layout.job_str(w.state, item.order.job_id)
    try:
        if error is not None:
            raise error
        fsutil.rename_into(stage, target)
    except (OSError, MemoryError) as exc:
        return undo(ledger, item, stage, claimed, _as_os_error(exc))
    _PLACED[item.order.job_id] = None
    if len(_PLACED) > _PLACED_MAX:
        _PLACED.popitem(last=False)
    return Started(JobFolder(target, claimed=w.spec.claimed), w.spec, w.order, claimed.token, claimed.cancelled)


def announce(layout: Layout, pick: Pick, claimed: Claimed, placed: str) -> None:
    """Drop a placed job's inbox name and log ``job.claimed`` (after its state folder's fsync).

    Unlinked after the fsync, not before: the unlink wakes the loop (inotify), which then
    waits for the interpreter lock while this lane still fsyncs. A file written again in
    place since it was read (a second writer, an editor saving in place) is the job's own
    ``order.<ext>`` too, by its link: the job gets back the bytes it read, as a file of its
    own, and the inbox name stays, to be read again as the order it now is. With the inbox
    name gone already (another daemon judged the new text), the job's own link shows it
    (``_own_link_rewritten``).
    """
    item = pick.item
    faults.point("claim.placed")  # a crash here leaves the inbox name beside the job: its twin, dropped later
    path = inbox_path(layout, item)
    try:
        st: os.stat_result | None = os.lstat(path)
    except OSError:
        st = None  # gone already (another daemon saw the placed folder and dropped it)
    if st is not None and (st.st_dev, st.st_ino) == item.inode:  # else another file took the name: read as it is
        if item.stamp is not None and (st.st_size, st.st_mtime_ns) != item.stamp:
            _keep_read_bytes(placed, item)
            _log_rewritten(pick)
        else:
            with contextlib.suppress(FileNotFoundError):  # another daemon removed it first: as good
                os.unlink(path)  # the inode linked into the job's folder by stage(), as it was read
    elif _own_link_rewritten(placed, item, path):
        _log_rewritten(pick)
    if claimed.previous == Row.RESERVED:  # its releaser placed it and died before its mark: the line is owed here
        log.info(
            "followup.released",
            job_id=item.order.job_id,
            parent=claimed.parent,
            hops=claimed.hops,
            file=item.name,
            agent=pick.agent.name,
        )
    log.info(
        "job.claimed",
        job_id=item.order.job_id,
        agent=pick.agent.name,
        file=item.name,
        parent=claimed.parent,
        hops=claimed.hops,
    )


def _log_rewritten(pick: Pick) -> None:
    log.warning(
        "order.rewritten",
        file=pick.item.name,
        job_id=pick.item.order.job_id,
        agent=pick.agent.name,
        reason="written again in place after its claim: the job keeps the bytes it read; it is read again",
    )


def _own_link_rewritten(placed: str, item: Inspected, path: str) -> bool:
    """Give the job back the bytes it read if its linked ``order.<ext>`` was written again in place; True if so.

    For an inbox name gone or taken by another file before ``announce`` looked (another daemon
    judged the rewritten text, or a person moved the file): the job's link is then the only
    place left to see the rewrite. The bytes written since are linked back into inbox/ first,
    so that they always have a name, and that name goes again once the job has its own copy
    if another name holds them (the refusal or the job of the daemon that read them).
    """
    kept = f"{placed}/order{suffix_of(item.name)}"
    try:
        st = os.lstat(kept)
    except OSError:
        return False
    if item.stamp is None or (st.st_dev, st.st_ino) != item.inode or (st.st_size, st.st_mtime_ns) == item.stamp:
        return False  # a copy of its own (``_copy_in``), or the bytes read
    back = _link_back(kept, path)
    _keep_read_bytes(placed, item)
    if back is not None:
        with contextlib.suppress(OSError):
            now = os.lstat(back)
            if (now.st_dev, now.st_ino) == item.inode and now.st_nlink > 1:
                os.unlink(back)  # kept elsewhere: read once, where it is
    return True


def _link_back(kept: str, path: str) -> str | None:
    """Link kept into inbox/ under path's name, or ``<stem>.rewritten[-N]<ext>`` if taken; return the name."""
    stem, ext = os.path.splitext(path)
    for n in range(1, 100):
        name = path if n == 1 else f"{stem}.rewritten{'' if n == 2 else f'-{n - 1}'}{ext}"
        try:
            os.link(kept, name, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError:
            return None  # (inbox/ gone, a full disk): the job's folder keeps the bytes, as before
        return name
    return None


def _keep_read_bytes(placed: str, item: Inspected) -> None:
    """Make the placed job's ``order.<ext>`` a file of its own holding the bytes the claim read (fsynced)."""
    fsutil.write_atomic(Path(placed) / f"order{suffix_of(item.name)}", item.data)


_PLACED: collections.OrderedDict[str, None] = collections.OrderedDict()  # ids this process put in place
_PLACED_MAX = 100_000


def placed_here(job_id: str) -> bool:
    """Return True if this process put job_id's folder in place (of its last ``_PLACED_MAX`` claims)."""
    return job_id in _PLACED


def _as_os_error(exc: BaseException) -> OSError:
    """Return exc as an OSError: a MemoryError is ENOMEM, a shortage like any (section 13)."""
    return exc if isinstance(exc, OSError) else OSError(errno.ENOMEM, "Cannot allocate memory")


def undo(ledger: Ledger, item: Inspected, stage: str, claimed: Claimed, exc: OSError) -> Skipped:
    """Give a claim back after its folder could not be made: nothing ran, the order stays in inbox/."""
    # the id stays free (or goes back to the daemon it was taken over from)
    ledger.unclaim(item.order.job_id, claimed.token, claimed.previous, claimed.previous_owner)
    drop_stage(stage)
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another daemon put its folder in place first
        log.info(
            "order.skipped",
            file=item.name,
            job_id=item.order.job_id,
            agent=item.order.to,
            reason="placed by another daemon",
        )
        return Skipped(item.name)
    if SHORT.note(exc, "claim"):  # not now: the order stays in inbox/ and its id free
        return Skipped(item.name, retry_later=True)
    if not is_disk_full(exc):
        raise exc
    log.warning("order.waiting", file=item.name, job_id=item.order.job_id, agent=item.order.to, reason=exc.strerror)
    return Skipped(item.name, retry_later=True)


def _write_job(
    layout: Layout, folder: str, item: Inspected, agent: Agent, claimed: Claimed, base_commit: str | None = None
) -> Written:
    order = item.order
    work = f"{folder}/work"
    os.mkdir(work)
    os.mkdir(f"{folder}/attempts")
    body = dict(order.body)
    body["parent"] = claimed.parent
    body["hops"] = claimed.hops
    text = _with_lineage(item, claimed)
    order_json = to_json(body) if text is None else (text + "\n").encode()
    fsutil.write_new(f"{work}/order.json", order_json)
    sync = [f"{work}/order.json"]
    given = {"order.json": digest(order_json)}
    writes = tuple(order.writes if order.writes is not None else agent.writes)
    if agent.prompt is not None:
        final_work = layout.job(State.ACTIVE, order.job_id) / "work"
        tree = layout.worktree(order.job_id) if agent.repo.workspace is not None else None
        prompt = render(agent.prompt, prompt_values(body, writes, final_work, tree), prompt=True).encode()
        fsutil.write_new(f"{work}/prompt.md", prompt)
        sync.append(f"{work}/prompt.md")
        given["prompt.md"] = digest(prompt)
    max_attempts = order.max_attempts or agent.max_attempts
    spec = JobSpec(
        job_id=order.job_id,
        source=item.name,
        received=item.received,
        parent=claimed.parent,
        hops=claimed.hops,
        agent=agent,
        timeout_s=order.timeout_s or agent.timeout_s,
        max_attempts=max_attempts,
        budget=max_attempts,
        writes=writes,
        given=given,
        order=body,
        parent_chain_cost_usd=claimed.parent_chain_cost_usd,
        claimed=time.time(),
        base_commit=base_commit,
    )
    fsutil.write_new(
        f"{folder}/{JOB_FILE}", fsutil.dump_json(spec.to_json()) if text is None else _spec_json(spec, text)
    )
    sync += [f"{folder}/{JOB_FILE}", work, folder]
    state = State.WAITING if order.after else State.ACTIVE
    return Written(spec, order.with_body(body), state, tuple(sync))


def body_text(body: Mapping[str, Any]) -> str:
    """Return an order body's JSON text as ``to_json`` writes it, without the final newline."""
    return fsutil.json_text(body)


def _with_lineage(item: Inspected, claimed: Claimed) -> str | None:
    """Return the text of the body with the claim's parent and hops, from the text made ahead; None if not had.

    ``json.dumps`` of a dict is its items joined by ``", "``: the two keys added at its end
    are two more items, so the result is byte for byte ``to_json`` of the body the claim
    writes. An order that names ``parent`` or ``hops`` itself keeps them in place: encoded whole.
    """
    body = item.order.body
    if item.text is None or not body or "parent" in body or "hops" in body:
        return None
    parent = json.dumps(claimed.parent, ensure_ascii=False)
    return f'{item.text[:-1]}, "parent": {parent}, "hops": {json.dumps(claimed.hops)}}}'


def _spec_json(spec: JobSpec, text: str) -> bytes:
    """Return ``fsutil.dump_json(spec.to_json())`` with the order's text put in, not encoded again."""
    items = (
        f"{json.dumps(k)}: {text if k == 'order' else json.dumps(v, ensure_ascii=False)}"
        for k, v in spec.to_json().items()
    )
    return ("{" + ", ".join(items) + "}\n").encode("utf-8", "backslashreplace")


def drop_stage(stage: str) -> None:
    """Remove a claim's staging folder; one that cannot go now (a shortage) goes with a later claim."""
    try:
        remove_stage(stage)
    except OSError:  # only the daemon's own files and a second link to the order are in it
        _LEFT_STAGES.append(stage)


def drop_left_stages() -> None:
    """Remove the staging folders a shortage kept from going (ledger lane, at the next claim)."""
    left = list(_LEFT_STAGES)
    _LEFT_STAGES.clear()
    for stage in left:
        with contextlib.suppress(FileNotFoundError):
            drop_stage(stage)
