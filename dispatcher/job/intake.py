"""Decide what becomes of a file in inbox/: claimed, refused or skipped; and carry it out.

``inspect`` reads and validates one file (on the loop: orders are small and
bounded by ``max_order_bytes``). ``claim`` takes a batch of valid orders in the
ledger lane, each claim committing together with its job folder or not at all:

1. a staging folder ``.state/staging/<owner>.claim-<id>-<rand>/`` is made (``store.placing``) and
   the inbox file is hard-linked into it (the inbox name stays);
2. one ledger transaction claims every id of the batch;
3. for each claimed id: ``work/`` and ``job.json`` are written; then every file and
   folder of the batch is fsynced at once (``fsutil.fsync_many``); then each staging
   folder is renamed to ``active/<id>``; an error on the way undoes the claim, leaving
   the file in inbox/ as it was;
4. ``active/`` is fsynced once for the batch, before any agent starts; then the inbox
   names are unlinked.

A daemon that dies at any point leaves either a staging folder without a claim
(removed by recovery; the file is still in inbox/), or a claim with its staging
folder (put in place by recovery), or a placed job.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from dispatcher import fsutil
from dispatcher.errors import OrderError, oneline
from dispatcher.fsutil import digest
from dispatcher.job import worktree
from dispatcher.job.finish import Finisher
from dispatcher.layout import JOB_ID, Layout, name_is_utf8
from dispatcher.ledger.base import Busy, Claimed, ClaimRequest, Entry, Finish, Known, Ledger
from dispatcher.ledger.cycles import find_cycle
from dispatcher.lifecycle import Row, State, Stop, state_to_row
from dispatcher.shortage import SHORT, resource_of
from dispatcher.spec.loader import load_document, lone_surrogate, read_names
from dispatcher.spec.orderchild import APART_YAML_BYTES, load_apart_text
from dispatcher.spec.orders import order_format, parse_order
from dispatcher.spec.settings import Config
from dispatcher.store import placing
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.placing import AHEAD_TEXT_BYTES, Inspected, Pick, Skipped, Started, body_text
from dispatcher.store.queued import held_ids
from dispatcher.store.refusals import Refusal, refuse
from dispatcher.store.results import build_result, is_disk_full
from dispatcher.store.staging import claim_stages, drop_inbox_inode, drop_inbox_twin

log = structlog.get_logger("dispatcher")


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A claimed job whose cancel was asked before its claim: it went to failed/ with no attempt."""

    name: str
    job_id: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A claimed job placed in waiting/ (its order names ``after``): the claim is to be turned into a wait."""

    name: str
    job_id: str
    token: int


@dataclass(frozen=True, slots=True)
class Refused:
    """A file that went to failed/<stem>@<time>/ (or vanished before it could)."""

    name: str
    job_id: str | None


Claimed_ = Started | Waiting | Cancelled | Refused | Skipped


def inspect(
    layout: Layout, name: str, config: Config, *, seen: os.stat_result | None = None, path: str | None = None
) -> Inspected | Refusal | None:
    """Read and validate inbox/<name>; None if it is gone (taken or removed) or changed while read.

    ``seen``: the file's lstat the caller just took (it is not taken again); a change after it
    still makes the read count as changed; ``path``: inbox/<name> as the caller joined it. A
    shortage (``shortage.resource_of``) is raised, never turned into a refusal: the file waits.
    """
    path = path or f"{layout.inbox_str}/{name}"
    try:
        st = seen if seen is not None else os.lstat(path)
    except FileNotFoundError:
        return None
    found = _read(name, config, st, path)
    if isinstance(found, Refusal):  # a refusal takes this entry only, never one renamed over it since
        return replace(found, inode=(st.st_dev, st.st_ino))
    return found


def _read(name: str, config: Config, st: os.stat_result, path: str) -> Inspected | Refusal | None:
    """Read and validate the entry inbox/<name> whose lstat is ``st`` (``inspect``)."""
    if not stat.S_ISREG(st.st_mode):
        kind = fsutil.kind_of(st.st_mode)
        return Refusal(name, f"a {kind} is not a work order; it was not opened", entry_kind=kind)
    fmt = order_format(name)
    if fmt is None:
        return Refusal(name, "not a work order (the name must end in .yaml, .yml or .json)")
    if not name_is_utf8(name):  # the ledger records a job's file name as text
        why = "the file name is not valid UTF-8; rename it, or drop it with `dispatcher submit`"
        job_id, to = _names_inside(path, fmt, config.max_order_bytes)
        return Refusal(name, why, job_id=job_id, agent=to if to in config.agents else None)
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
        if resource_of(exc) is not None:
            raise
        return Refusal(name, f"cannot be read: {exc.strerror}")
    if (again.st_ino, again.st_size, again.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
        return None  # replaced or written to while being read: its own event brings it back
    apart = fmt == "yaml" and len(data) > APART_YAML_BYTES  # a long parse: in a child process
    loaded: list[Any] = []  # the document, once parsed: an invalid order's job_id is read from it, not parsed again
    texts: list[str | None] = [None]  # its JSON text, when the child wrote it

    def load(data: bytes, fmt: str) -> Any:
        if apart:
            doc, texts[0] = load_apart_text(data, fmt)
        else:
            doc = load_document(data, fmt)
        loaded.append(doc)
        return doc

    try:
        order = parse_order(
            data,
            name,
            agents=config.agents,
            max_timeout_s=config.max_timeout_s,
            max_bytes=config.max_order_bytes,
            load=load,
            fmt=fmt,
        )
    except OrderError as exc:  # refused by the strict rules: a plain parse may still read its job_id
        if loaded:
            return Refusal(name, exc.reason, job_id=job_id_of(loaded[0]), agent=agent_of(loaded[0], config))
        # a large YAML file is not parsed a second time, here on the claim's way
        job_id, to = (None, None) if apart else read_names(data, fmt)
        return Refusal(name, exc.reason, job_id=job_id, agent=to if to in config.agents else None)
    except (OSError, MemoryError):
        raise  # a shortage: the file waits
    except Exception as exc:  # noqa: BLE001 - a value no rule foresaw: refused, never holding up the orders behind it
        return Refusal(name, oneline(f"cannot be read as a work order: {exc}"))
    text = texts[0]
    if text is None and len(data) > AHEAD_TEXT_BYTES:  # a large JSON order: encoded here, not in the claim
        text = body_text(order.body)
    stamp = (again.st_size, again.st_mtime_ns)
    return Inspected(name, data, order, digest(data), time.time(), (st.st_dev, st.st_ino), text, path, stamp)


def _job_id_inside(path: str, fmt: str, max_bytes: int) -> str | None:
    """Return the job_id a refused file's order names, if it can be read (for its result.json), else None."""
    return _names_inside(path, fmt, max_bytes)[0]


def _names_inside(path: str, fmt: str, max_bytes: int) -> tuple[str | None, str | None]:
    """Return the job_id and ``to`` a refused file's order names, where they can be read, else None."""
    try:
        return read_names(fsutil.read_regular(path, max_bytes), fmt)
    except (OSError, ValueError, fsutil.NotRegular):
        return None, None


def job_id_in_file(path: str, name: str) -> str | None:
    """Return the job_id the order file at path names, read whatever the rules now say of its size (64 MiB at most).

    Only for a refused file with a second name, which may be a claim's own file left in inbox/ (``drop_twin_of``).
    """
    fmt = order_format(name)
    return _job_id_inside(path, fmt, 1 << 26) if fmt is not None else None


def job_id_of(body: Any) -> str | None:
    """Return the job_id of a parsed (perhaps invalid) order if it has a string one, for the refusal's result.

    A string that is not text (a lone surrogate, from a JSON escape) is none: result.json stays valid UTF-8.
    """
    job_id = body.get("job_id") if isinstance(body, dict) else None
    return job_id if isinstance(job_id, str) and lone_surrogate(job_id) is None else None


def agent_of(body: Any, config: Config) -> str | None:
    """Return the agent a parsed (perhaps invalid) order names in ``to``, if the config has it, else None.

    For the refusal's log line and metrics: only configured names, so that a label never
    takes whatever text a dropped file holds.
    """
    to = body.get("to") if isinstance(body, dict) else None
    return to if isinstance(to, str) and to in config.agents else None


def known_reason(job_id: str, state: str, where: str | None = None) -> str:
    """Return the refusal reason of a job id seen before (``where`` instead of its state: ``held in held/``)."""
    return f"job_id: {job_id} is already known ({where or f'state {state}'}); a job id is never run twice"


def claim(
    layout: Layout,
    ledger: Ledger,
    picks: Sequence[Pick],
    *,
    on_refused: Callable[[Path, Refusal], None],
    finisher: Finisher,
) -> list[Claimed_]:
    """Claim a batch of orders (in the ledger lane); one answer per pick, in order.

    The ledger decides in the claim's transaction: a new id is ours, a known one is
    refused, and one with an open cancel request is ours only to fail it at once
    (``Cancelled``: its folder lands in failed/ with reason ``cancelled``, no attempt).
    """
    owner = ledger.owner
    placing.drop_left_stages()
    out: list[Claimed_ | None] = [None] * len(picks)
    staged: list[tuple[int, Pick, str, bool]] = []  # the bool: no job folder of the id was found
    pending: dict[str, Sequence[str]] = {}  # the waits of this batch's joins, recorded only once claimed
    for i, pick in enumerate(picks):
        item = pick.item
        found = layout.find(item.order.job_id)  # once per order: the claim below reuses the answer
        if found is not None and _drop_twin(layout, item, found[1]):
            out[i] = Skipped(item.name)
            continue
        if found is not None and ledger.get(item.order.job_id) is None:
            # a job folder the ledger does not know (a lost ledger): put its row back, never run it again
            _repair_row(ledger, item.order.job_id, *found)
            out[i] = _refuse(layout, owner, item, found[0].value, on_refused)
            continue
        held = held_ids(layout.held).get(item.order.job_id)
        if held is not None and item.inode in held:  # the held file itself: a hold (or release) cut short
            drop_inbox_inode(placing.inbox_path(layout, item), item.inode)  # as held: the name the command made
            log.info("order.twin_dropped", file=item.name, job_id=item.order.job_id, agent=item.order.to, held=True)
            out[i] = Skipped(item.name)
            continue
        if held is not None:  # an operator paused it: this copy may not run in its place
            out[i] = _refuse(layout, owner, item, "held", on_refused, where="held in held/")
            continue
        after = item.order.after
        cycle = find_cycle(ledger, item.order.job_id, after, pending) if after else None
        if cycle is not None:
            reason = "after: would make a cycle (" + " -> ".join(cycle) + ")"
            refusal = Refusal(item.name, reason, item.order.job_id, agent=item.order.to, inode=item.inode)
            refuse(layout, refusal, owner, on_refused)
            out[i] = Refused(item.name, item.order.job_id)
            continue
        try:
            stage = placing.stage(layout, owner, item)
        except OSError as exc:
            if SHORT.note(exc, "claim"):
                out[i] = Skipped(item.name, retry_later=True)
                continue
            if not is_disk_full(exc):  # this one file (made immutable, say): the others of the batch go on
                out[i] = cannot_take(item.name, "claim", exc)
                continue
            log.warning(
                "order.waiting", file=item.name, job_id=item.order.job_id, agent=item.order.to, reason=exc.strerror
            )
            out[i] = Skipped(item.name, retry_later=True)
            continue
        if stage is None:  # gone, replaced or written to since it was read: read again in a moment
            out[i] = Skipped(item.name, retry_later=True)
            continue
        if _FAILED:
            _FAILED.pop(item.name, None)  # taken now: a later error of this name counts from 1 again
        staged.append((i, pick, stage, found is None))
        if after:
            pending[item.order.job_id] = after
    answers = ledger.claim(
        [
            # a claim is only taken over from a dead daemon while no job folder of the id exists
            ClaimRequest(
                p.item.order.job_id,
                p.agent.name,
                p.item.name,
                p.item.digest,
                may_take_over=no_folder,
            )
            for _, p, _, no_folder in staged
        ]
    )
    written: list[tuple[int, Pick, str, Claimed, placing.Written]] = []
    bases: dict[tuple[str, str], str | None] = {}  # (repository, base) -> its commit now: one git call a batch
    for (i, pick, stage, no_folder), answer in zip(staged, answers, strict=True):
        match answer:
            case Claimed():
                pick = _with_base(pick, bases)
                made = placing.write(layout, ledger, pick, stage, answer)
                if isinstance(made, Skipped):
                    out[i] = made
                else:
                    written.append((i, pick, stage, answer, made))
            case Known(entry=entry):
                placing.drop_stage(stage)
                if _drop_twin(layout, pick.item):  # the claimed job's own file (a claim cut short)
                    out[i] = Skipped(pick.item.name)
                elif entry.state == Row.CLAIMED and claim_stages(layout, entry.job_id):
                    # a dead daemon's claim whose folder recovery has yet to put in place: then its twin goes
                    out[i] = Skipped(pick.item.name, retry_later=True)
                else:
                    out[i] = _refuse(layout, owner, pick.item, entry.state, on_refused)
            case Busy(entry=entry) if not no_folder:
                # claimed under this very name with these very bytes, but its job folder is in place and this
                # file is not the one it holds (``_drop_twin`` said so): the same order dropped again, refused
                placing.drop_stage(stage)
                out[i] = _refuse(layout, owner, pick.item, entry.state, on_refused)
            case Busy(entry=entry) if entry.owner == owner and placing.placed_here(entry.job_id):
                # this daemon put its folder in place, which was removed by hand since: the id stays claimed
                placing.drop_stage(stage)
                out[i] = _refuse(layout, owner, pick.item, entry.state, on_refused)
            case Busy(entry=entry):
                placing.drop_stage(stage)
                orphan = entry.owner == owner and _give_back_orphan(layout, ledger, pick.item, entry)
                out[i] = Skipped(pick.item.name, retry_later=orphan)  # given back: claimed again in a moment
    # every claimed folder is whole on disk before any is renamed into active/ (whose fsync is
    # once per batch): a power cut must not leave active/<id> without its job.json, work/ or order
    errors = fsutil.fsync_many([path for *_, w in written for path in w.sync])
    placed: set[State] = set()
    later: list[tuple[int, Started]] = []  # placed under a cancel, or a join: carried on once all are durable
    moved: list[tuple[Pick, Claimed, str]] = []  # placed: their inbox names go once their state folder is fsynced
    end = 0
    for i, pick, stage, claimed, w in written:
        start, end = end, end + len(w.sync)
        failed = None
        for error in errors[start:end]:  # this job's own
            if error is not None:
                failed = error
                break
        done = out[i] = placing.place(layout, ledger, pick, stage, claimed, w, failed)
        if isinstance(done, Started):
            placed.add(w.state)
            moved.append((pick, claimed, done.folder.path_str))
            if done.cancelled or done.order.after:
                later.append((i, done))
    for state in sorted(placed):
        _fsync_dir(layout.folder_str(state))  # the claim's durable point: before any agent starts
    for pick, claimed, path in moved:
        placing.announce(layout, pick, claimed, path)
    for i, done in later:
        if done.cancelled:
            out[i] = _cancel(finisher, done, picks[i].item.name)
        else:
            out[i] = Waiting(picks[i].item.name, done.spec.job_id, done.token)
    return [o if o is not None else Skipped("") for o in out]


def _with_base(pick: Pick, bases: dict[tuple[str, str], str | None]) -> Pick:
    """Resolve a workspace's base to a commit now, at the claim (section 15); not ``base: parent`` (not known yet)."""
    conf = pick.agent.repo.workspace
    if conf is None or pick.item.order.body.get("base") == "parent":
        return pick
    key = (conf.git, conf.base)
    if key not in bases:
        bases[key] = worktree.base_at_claim(conf.git, conf.base)
    return replace(pick, base_commit=bases[key])


def _cancel(finisher: Finisher, started: Started, name: str) -> Cancelled:
    """Fail a job claimed under an open cancel request: no Job, no slot, no attempt."""
    spec = started.spec
    result = build_result(
        job_id=spec.job_id,
        state=str(Row.FAILED),
        agent=spec.agent.name,
        reason=str(Stop.CANCELLED),
        received=spec.received,
        parent=spec.parent,
        chain_cost_usd=spec.parent_chain_cost_usd,
        user_checks=[c.name for c in spec.agent.checks],
    )
    finish = Finish(spec.job_id, started.token, Row.FAILED, None, spec.parent_chain_cost_usd)
    finisher.finish_now(started.folder, finish, result, spec)  # spec: its after hook is owed too
    return Cancelled(name, spec.job_id)


def _fsync_dir(folder: str) -> None:
    """Fsync a folder of placed jobs; short of file descriptors, try again for a while (they are claimed)."""
    delay = 0.01
    while True:
        try:
            fsutil.fsync_dir(folder)
            return
        except OSError as exc:
            if not SHORT.note(exc, "claim") or delay > 2.0:
                raise
        time.sleep(delay)  # in the ledger lane, never on the loop
        delay *= 2


def _repair_row(ledger: Ledger, job_id: str, state: State, folder: Path) -> None:
    row = state_to_row(state)
    try:  # the agent of the job that ran, for the row and the line (a torn job.json: none)
        agent: str | None = JobFolder(folder).spec().agent.name
    except (ValueError, OSError):
        agent = None
    ledger.load_rows([Entry(job_id, row, agent, None, 1, None, None, None, 0, None, None, time.time())])
    log.warning(
        "ledger.repaired", job_id=job_id, agent=agent, state=row.value, reason="a job folder without a ledger row"
    )


def _refuse(
    layout: Layout,
    owner: str,
    item: Inspected,
    state: str,
    on_refused: Callable[[Path, Refusal], None],
    *,
    where: str | None = None,
) -> Refused | Skipped:
    why = known_reason(item.order.job_id, state, where)
    refusal = Refusal(item.name, why, item.order.job_id, agent=item.order.to, inode=item.inode)
    try:
        refuse(layout, refusal, owner, on_refused)
    except OSError as exc:
        if not SHORT.note(exc, "refuse"):
            return cannot_take(item.name, "refuse", exc)
        return Skipped(item.name, retry_later=True)  # refused once the shortage is over
    return Refused(item.name, item.order.job_id)


_FAILED: dict[str, int] = {}  # inbox name -> tries that met an error (logged at 1, 2, 4, 8 ...)
_FAILED_MAX = 1000
GIVE_UP_TRIES = 4  # `run --once` leaves a file that met an error of its own this often (about 3 s of tries)


def stuck_names() -> dict[str, int]:
    """Return the inbox names that met an error of their own at least ``GIVE_UP_TRIES`` times, with the count.

    `run --once` ends without them (exit 1): a file it can never take (made immutable: it can be
    neither linked nor moved) would keep it running for ever.
    """
    return {name: n for name, n in _FAILED.copy().items() if n >= GIVE_UP_TRIES}  # copied whole: lanes write it


def cannot_take(name: str, step: str, exc: OSError) -> Skipped:
    """Answer an inbox file that met an error of its own (not a shortage): tried again later, alone.

    One file the daemon cannot link, move or read (made immutable, a name too long for a
    refusal's folder) never stops the other orders of its batch. Its error is logged at
    the 1st, 2nd, 4th, 8th ... try of that name, with the count, not once a second.
    """
    if len(_FAILED) >= _FAILED_MAX and name not in _FAILED:
        _FAILED.clear()
    n = _FAILED[name] = _FAILED.get(name, 0) + 1
    if n & (n - 1) == 0:
        log.error("daemon.error", step=step, file=name, error=oneline(str(exc)), tries=n)
    return Skipped(name, retry_later=True)


def _give_back_orphan(layout: Layout, ledger: Ledger, item: Inspected, entry: Entry) -> bool:
    """Give back this daemon's own claim of this very file if nothing of it is on disk; return True if given back.

    Claims run one after another in the ledger lane, so when a claim meets a claim of this
    same daemon for the same file, that earlier claim's trip has ended: with no job folder
    and no staging folder of the id, it ended before the folder was made and the claim was
    never undone (its trip cut short). Left alone, the file would wait in inbox/ for as
    long as this daemon runs and be refused as known by the next one. The row goes back
    to what it was (a follow-up's row, with its lineage, to ``released``; a new id's is
    removed) and the file is claimed again.
    """
    job_id = item.order.job_id
    if layout.find(job_id) is not None or claim_stages(layout, job_id) or placing.placed_here(job_id):
        return False  # placed: its folder was removed by hand since (the file is refused as known)
    ledger.unclaim(job_id, entry.token, Row.RELEASED if entry.parent is not None else None)
    log.warning(
        "job.claim_returned",
        job_id=job_id,
        agent=entry.agent,
        file=item.name,
        token=entry.token,
        reason="this daemon's own claim of the file, with no job folder: given back and claimed again",
    )
    return True


def _drop_twin(layout: Layout, item: Inspected, folder: Path | None = None) -> bool:
    """Unlink inbox/<name> if it is the order file of the job folder of its id; return True if so.

    A daemon that died after putting a claimed job in place, before unlinking the
    inbox name, leaves that name behind: it is the job's own file, not a duplicate.
    Only under the name the job was claimed from: the job's order linked into inbox/
    under another name (`ln done/J/order.json inbox/again.json`) is a new drop of a
    known id, refused as any other. ``folder``: the job's folder when the caller just found it.
    """
    return drop_twin_of(layout, item.order.job_id, item.name, item.inode, item.order.to, folder)


def drop_twin_of(
    layout: Layout,
    job_id: str | None,
    name: str,
    inode: tuple[int, int] | None,
    agent: str | None,
    folder: Path | None = None,
) -> bool:
    """``_drop_twin`` for a file about to be refused for another reason (expired by now, a rule changed since): the
    job's own file left in inbox/ by a claim cut short is dropped, never refused beside its job (section 1)."""
    if job_id is None or inode is None or not JOB_ID.fullmatch(job_id):  # no job's id (a NUL in it): no job's file
        return False
    if folder is None:
        found = layout.find(job_id)
        if found is None:
            return False
        folder = found[1]
    kept = folder / f"order{Path(name).suffix}"
    try:
        st = os.lstat(kept)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != inode:
        return False
    try:
        source: str | None = JobFolder(folder).spec().source
    except (OSError, ValueError):  # job.json damaged: recovery fails the job; its twin goes as before
        source = None
    if source not in (None, "", name) or not drop_inbox_twin(layout, name, kept):
        return False
    log.info("order.twin_dropped", file=name, job_id=job_id, agent=agent)
    return True
