"""Refused files: anything in inbox/ that never becomes a job goes to failed/<stem>@<UTC time>/.

The folder holds the file's original bytes as ``order.<ext>`` (or, for a symlink,
FIFO, device or folder, the entry itself as ``entry``, never opened) and a
``result.json`` saying why. It is built in staging and put in place by one
rename, so a crash leaves either the file in inbox/ or a whole refusal; its files and
folder are fsynced before the inbox name goes, and inbox/ before the rename, so a power
cut does too. Only the entry that was judged is refused, and only its own name is
removed: a new drop renamed over it meanwhile stays in inbox/, judged on its own, and of
two daemons refusing one file, the one that removes its name places the refusal.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from dispatcher import fsutil
from dispatcher.clock import utc_stamp
from dispatcher.errors import printable
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.results import build_result
from dispatcher.store.staging import new_stage, remove_stage

log = structlog.get_logger("dispatcher")


#: the bytes of a refused file's stem its folder keeps (`<stem>@<time>`); result.json keeps the whole name
STEM_BYTES = 180


@dataclass(frozen=True, slots=True)
class Refusal:
    """A file that never becomes a job, and why."""

    name: str
    reason: str
    job_id: str | None = None
    entry_kind: str | None = None  # set for symlinks, FIFOs, devices, folders
    agent: str | None = None
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the entry that was judged, when known


def refuse(
    layout: Layout, refusal: Refusal, owner: str, on_placed: Callable[[Path, Refusal], None] | None = None
) -> Path | None:
    """Move a refused file into failed/<stem>@<UTC timestamp>/ with a result.json.

    ``on_placed`` is called with the folder right after the rename (to log it
    before the folder's fsync). Returns the folder, or None if the file vanished.
    """
    src = layout.inbox / refusal.name
    stem = Path(refusal.name).stem or "entry"
    stage = Path(new_stage(layout, owner, "refuse", "x"))
    base = f"{cut_name(stem, STEM_BYTES)}@{utc_stamp()}"
    (stage / ".target").write_bytes(os.fsencode(base))
    (stage / ".source").write_bytes(os.fsencode(refusal.name))
    # a file name may be 255 bytes: its extension alone may not fit beside `order` (cut, as the stem is)
    suffix = Path(refusal.name).suffix  # `.ext`: the extension's first 200 bytes are kept, after its dot
    inner = "entry" if refusal.entry_kind is not None else f"order{suffix[:1]}{cut_name(suffix[1:], 200)}"
    result = build_result(
        job_id=refusal.job_id,
        state="failed",
        agent=refusal.agent,  # the agent its `to` names, as job.refused says, so that `list --agent` finds it
        reason=refusal.reason,
        received=time.time(),
        extra={"file": printable(refusal.name)},
    )
    (stage / "result.json").write_bytes(fsutil.dump_json(result.to_json()))
    kept = stage / inner
    try:
        linked = fsutil.link_out(src, kept)
    except FileNotFoundError:
        remove_stage(stage)
        return None
    except OSError:
        remove_stage(stage)  # the file stays in inbox/ as it was, and no staging folder is left behind
        raise
    if refusal.inode is not None and fsutil.file_id(kept, follow_symlinks=False) != refusal.inode:
        # the name holds another entry now (a new drop renamed over the judged one): judged on its own event
        if not linked:
            with contextlib.suppress(OSError):
                fsutil.rename_noreplace(kept, src)
        remove_stage(stage)
        return None
    # the folder whole on disk before the inbox name goes, that gone before the folder is placed: after a power
    # cut the file is in inbox/, or in a staging folder that recovery places (``finish_stage``), or refused once
    synced = [stage / "result.json", stage / ".target", stage / ".source", stage, layout.staging]
    for error in fsutil.fsync_many(synced):
        if error is not None:
            raise error  # the staging folder stays: recovery places it (its file is inside, or still in inbox/)
    if linked and not _take_name(src, kept):
        remove_stage(stage)  # another daemon on this root refuses the same file: its folder keeps the bytes
        return None
    fsutil.fsync_dir(layout.inbox)
    return place(layout, stage, base, lambda folder: on_placed(folder, refusal) if on_placed else None)


def _take_name(src: Path, kept: Path) -> bool:
    """Remove the inbox name of the file kept in the refusal; return False when the refusal is not this one's.

    Only the same file's name goes: a name that holds another file now (a new drop renamed
    over it) is left alone. A name gone already was taken by another daemon refusing the same
    file (the file then has a second link, in that daemon's folder), or removed by a person
    (it has none: this refusal keeps its bytes).
    """
    if fsutil.same_file(src, kept):
        try:
            os.unlink(src)
            return True
        except FileNotFoundError:
            pass
    try:
        return os.lstat(kept).st_nlink <= 1
    except OSError:
        return False


def place(layout: Layout, stage: Path, base: str, on_placed: Callable[[Path], None] | None = None) -> Path:
    """Rename a built refusal folder into failed/, adding -2, -3, ... if the name is taken."""
    n = 1
    while True:
        target = layout.folder(State.FAILED) / (base if n == 1 else f"{base}-{n}")
        try:
            fsutil.rename_into(stage, target)
        except FileExistsError:
            n += 1
            continue
        for name in (".target", ".source"):
            (target / name).unlink(missing_ok=True)
        if on_placed is not None:
            on_placed(target)
        fsutil.fsync_dir(layout.folder(State.FAILED))
        return target


def finish_stage(layout: Layout, stage: Path) -> None:
    """Put in place a refusal a dead daemon built but did not rename (its file is inside), and log it.

    Its ``job.refused`` line was never written: the dead daemon logs it as the folder lands.
    A refusal whose file another daemon refused meanwhile (its inbox name gone, the file
    linked there too) is dropped instead: that refusal holds the bytes.
    """
    target, source = stage / ".target", stage / ".source"
    base = os.fsdecode(target.read_bytes()) if target.exists() else stage.name
    kept = next((p for p in stage.iterdir() if p.name.startswith("order") or p.name == "entry"), None)
    if kept is None:  # another live daemon placed or removed this folder meanwhile
        return
    name = os.fsdecode(source.read_bytes()) if source.exists() else ""
    if name and not _take_name(layout.inbox / name, kept):
        remove_stage(stage)
        return
    placed = place(layout, stage, base)
    said = JobFolder(placed).result()
    log.warning(
        "job.refused",
        agent=said.agent if said else None,
        file=said.extra.get("file", name) if said else name,
        job_id=said.job_id if said else None,
        reason=said.reason if said else None,
        folder=placed.name,
        step="recovered",
    )


def cut_name(text: str, limit: int) -> str:
    """Return text cut to at most limit bytes of its file-system encoding.

    Every byte before the cut is kept, also those of a name that is not UTF-8; only a UTF-8
    character the cut would split is left out whole.
    """
    raw = os.fsencode(text)
    if len(raw) <= limit:
        return text
    end = limit
    while end > max(0, limit - 3) and raw[end] & 0xC0 == 0x80 and raw[end - 1] >= 0x80:  # inside a character
        end -= 1
    if end < limit and raw[end] < 0xC0:  # no lead byte there: no character was split, the bytes were no UTF-8
        end = limit
    return os.fsdecode(raw[:end])
