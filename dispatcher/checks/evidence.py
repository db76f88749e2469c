"""Gather what the checks look at from a job's work/ folder, safely.

Every read goes through ``fsutil.open_beneath`` under work/ (opened once by ``gather``,
not through a link): an agent's symlink, FIFO or device can neither redirect nor block
the daemon.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path

from dispatcher import fsutil
from dispatcher.checks.facts import Doc, Entry, Evidence, Exit, Followup
from dispatcher.checks.leftovers import stamp_of
from dispatcher.checks.stream import summarise_fd
from dispatcher.errors import OrderError, printable
from dispatcher.fsutil import NotRegular, kind_of
from dispatcher.layout import is_ignored, name_is_utf8
from dispatcher.lean import sha256_for
from dispatcher.shortage import resource_of
from dispatcher.spec.loader import decode, load_json
from dispatcher.spec.order import Order
from dispatcher.spec.orders import order_format, parse_order

RECEIPT_MAX = 4 * 1024 * 1024  # ids of items and outputs: orders are at most a few MiB


def receipt_max(order: Order) -> int:
    """Return the largest receipt read for order: 4 MiB, or room for its item ids listed twice (input_ids and
    output_ids) when that is more (an order of many ids may be valid and need it).

    Each id is given room for every character written as a ``\\u`` escape (6 bytes) and for the quotes, comma,
    line break and indentation of a pretty-printed list (32 bytes), plus 1 MiB for the rest.
    """
    room = 2 * sum(6 * len(item) + 32 for item in order.item_ids) + 1024 * 1024
    return max(RECEIPT_MAX, room)


OUTPUT_MAX = 256 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # as fsutil.open_beneath opens a folder
_NOT_A_FOLDER = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # missing, not a folder, a link
_KINDS = {
    "folder": "dir",
    "symlink": "symlink",
    "FIFO": "fifo",
    "socket": "socket",
}


def _raise_if_short(exc: OSError) -> None:
    """Raise a shortage (EMFILE, ENOMEM ...): it says nothing of the agent's files, the caller waits."""
    if resource_of(exc) is not None:
        raise exc


def _is_folder(path: str) -> bool:
    """Return True if path is a folder, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _relative_inside(link: str, root: str) -> bool:
    """Return True if a link in work/ stays inside it: a relative text that stays below work/ and resolves inside.

    An absolute text names work/ by where the job is now (active/<id>/work): once the job
    moves to done/ or failed/ it points outside, at a folder that is gone. So does a
    relative one that climbs out of work/ and comes back through the job's folder.
    """
    try:
        text = os.readlink(link)
    except OSError:
        return False
    if os.path.isabs(text):
        return False
    # a text that climbs out of work/ and back in (../../../active/<id>/work/x) names where the job is
    # now, as an absolute one does: read without the links on the way, it must stay below work/
    rel = os.path.relpath(os.path.dirname(link), root)
    if os.path.normpath(os.path.join(rel, text)).split(os.sep)[0] == os.pardir:
        return False
    return fsutil.link_stays_inside(link, root)


def open_doc(work: str | Path, rel: str, limit: int, dir_fd: int | None = None) -> tuple[Doc, int | None]:
    """Open work/<rel> without following links or blocking; return (Doc saying why not, fd).

    The fd, when given, is a regular file of at most ``limit`` bytes; the caller closes it.
    ``dir_fd``: work/ opened already (``fsutil.open_beneath``).
    """
    try:
        fd = fsutil.open_beneath(work, rel, dir_fd)
    except FileNotFoundError:
        return Doc(missing=True), None
    except NotRegular as exc:  # a part of the path on the way that is not a folder says so; the file itself its kind
        what = "is under a path part that is not a folder" if exc.kind == "not a folder" else f"is a {exc.kind}"
        return Doc(error=f"{what}, not a regular file"), None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return Doc(missing=True), None
        _raise_if_short(exc)
        return Doc(error=f"cannot be read: {exc.strerror}"), None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"is a {kind_of(st.st_mode)}, not a regular file"
    elif st.st_size > limit:
        why = f"larger than {limit} bytes"
    if why is not None:
        os.close(fd)
        return Doc(error=why), None
    return Doc(), fd


def read_doc(work: str | Path, rel: str, limit: int, dir_fd: int | None = None) -> tuple[Doc, bytes | None]:
    """Read work/<rel> as bytes; return a Doc saying missing/error, and the bytes."""
    doc, fd = open_doc(work, rel, limit, dir_fd)
    if fd is None:
        return doc, None
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > limit:
                return Doc(error=f"larger than {limit} bytes"), None
            chunks.append(chunk)
    except OSError as exc:
        _raise_if_short(exc)
        return Doc(error=f"cannot be read: {exc.strerror}"), None
    finally:
        os.close(fd)
    return Doc(), b"".join(chunks)


def read_receipt(work: str | Path, dir_fd: int | None = None, limit: int = RECEIPT_MAX) -> Doc:
    """Read and parse work/receipt.json (at most ``limit`` bytes: ``receipt_max`` of the order)."""
    doc, data = read_doc(work, "receipt.json", limit, dir_fd)
    if data is None:
        return doc
    try:  # strictly, as an order: no NaN or Infinity, no key twice (which one would count?), UTF-8
        return Doc(value=load_json(decode(data)))
    except OrderError as exc:
        return Doc(error=f"is not valid JSON ({exc.reason.removeprefix('not valid JSON: ')})")


def read_output(work: str | Path, rel: str, order: Order, dir_fd: int | None = None) -> Doc:
    """Summarise accept.output (csv with header, json list, jsonl) for the checks, streamed.

    Returns ``Doc(value=OutputSummary)``; memory stays bounded whatever the file's size.
    """
    doc, fd = open_doc(work, rel, OUTPUT_MAX, dir_fd)
    if fd is None:
        return doc
    fmt = "csv" if rel.endswith(".csv") else "jsonl" if rel.endswith(".jsonl") else "json"
    return summarise_fd(fd, fmt, order, OUTPUT_MAX)


def list_entries(
    work: str | Path, given: Mapping[str, str], dir_fd: int | None = None, left: Mapping[str, str] | None = None
) -> list[Entry]:
    """Walk work/ without following links; describe every entry.

    The walk is iterative (no recursion limit for deep trees). A folder that
    cannot be listed, or an entry that cannot be looked at (below a path longer
    than the system can name), is reported as an ``unreadable`` entry, which
    writes_scope refuses. Given files are hashed in chunks, and only when their size could
    still match, so a huge file cannot exhaust the daemon's memory (opened under
    ``dir_fd``, work/ opened already, when given).
    """
    out: list[Entry] = []
    root = os.fspath(work)
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        try:
            it = os.scandir(folder)
        except OSError as exc:
            _raise_if_short(exc)
            if prefix:
                out.append(Entry(prefix.rstrip("/"), "unreadable"))
            continue
        with it:
            for de in it:
                rel = prefix + de.name
                try:
                    st = de.stat(follow_symlinks=False)
                except OSError as exc:
                    _raise_if_short(exc)
                    if exc.errno != errno.ENOENT:  # not gone: unseen (a path too long to name), so refused
                        out.append(Entry(rel, "unreadable"))
                    continue
                if stat.S_ISREG(st.st_mode):  # the usual entry
                    sha = _digest_file(root, rel, dir_fd) if rel in given else None
                    mark = stamp_of(st) if left and rel in left else None
                    out.append(Entry(rel, "file", nlink=st.st_nlink, digest=sha, stamp=mark))
                    continue
                kind = _KINDS.get(kind_of(st.st_mode), "device")
                if kind == "dir":
                    out.append(Entry(rel, "dir"))
                    stack.append((de.path, rel + "/"))
                elif kind == "symlink":
                    out.append(Entry(rel, "symlink", target_inside=_relative_inside(de.path, root)))
                else:
                    out.append(Entry(rel, kind))
    return out


def _digest_file(work: str | Path, rel: str, dir_fd: int | None = None) -> str | None:
    """Return the sha256 of work/<rel> read in chunks without following links, or None."""
    try:
        fd = fsutil.open_beneath(work, rel, dir_fd)
    except NotRegular:
        return None
    except OSError as exc:
        _raise_if_short(exc)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        h = sha256_for(st.st_size)()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    except OSError as exc:
        _raise_if_short(exc)
        return None
    finally:
        os.close(fd)
    return h.hexdigest()


def read_followups(
    work: str | Path,
    parse: Callable[[bytes, str], Order],
    max_bytes: int,
    max_followups: int = 100,
    dir_fd: int | None = None,
) -> tuple[bool, list[tuple[Followup, bytes | None]]]:
    """Parse the orders in work/outbox/; return (outbox exists, [(follow-up, bytes)]).

    Every entry that is not hidden or temporary is listed, but only the first
    ``max_followups + 1`` are read and parsed: one more than allowed already fails
    followups_valid, so 5,000 files cost 5,000 names, not 5,000 parses.
    """
    outbox = f"{work}/outbox"
    try:
        st = os.lstat(outbox)
    except OSError:
        return False, []
    if not stat.S_ISDIR(st.st_mode):
        return True, [(Followup("", error=f"outbox is a {kind_of(st.st_mode)}, not a folder"), None)]
    try:
        names = sorted(os.listdir(outbox))
    except OSError as exc:  # an agent left it unreadable: no follow-up can be read from it
        return True, [(Followup("", error=f"outbox cannot be listed: {exc.strerror}"), None)]
    found: list[tuple[Followup, bytes | None]] = []
    for name in names:
        if is_ignored(name):
            continue
        if len(found) > max_followups:
            found.append((Followup(name, error=f"not read: more than max_followups ({max_followups})"), None))
            continue
        if order_format(name) is None:
            found.append((Followup(printable(name), error="not a work order (.yaml, .yml or .json)"), None))
            continue
        if not name_is_utf8(name):  # no follow-up could keep this name (inbox/ refuses it too)
            found.append((Followup(printable(name), error="the file name is not valid UTF-8"), None))
            continue
        doc, data = read_doc(work, f"outbox/{name}", max_bytes, dir_fd)
        if data is None:
            why = "is missing" if doc.missing else doc.error
            found.append((Followup(name, error=f"{why}"), None))
            continue
        try:
            found.append((Followup(name, order=parse(data, name)), data))
        except OrderError as exc:
            found.append((Followup(name, error=exc.reason), None))
    return True, found


def gather(
    *,
    order: Order,
    agent: str,
    writes: tuple[str, ...],
    exit: Exit,
    work: str | os.PathLike[str],
    given: Mapping[str, str],
    agents: Container[str],
    max_timeout_s: float,
    max_order_bytes: int,
    known: Callable[[list[str]], frozenset[str]],
    hops: int,
    max_hops: int,
    max_followups: int = 100,
    changed: Sequence[str] | str | None = None,
    left: Mapping[str, str] | None = None,
) -> tuple[Evidence, list[tuple[Followup, bytes | None]]]:
    """Collect the Evidence for one attempt; also return the follow-ups with their bytes.

    work/ is opened once, as ``fsutil.open_beneath`` opens a folder, and every read opens under it.
    """
    root = os.fspath(work)  # every read joins this str, not a Path
    dir_fd: int | None = None
    try:  # a folder, not a link to one
        dir_fd = os.open(root, _DIR_FLAGS)
        work_exists = True
    except OSError as exc:  # not opened for another reason (EACCES ...): each read says why, as ever
        work_exists = exc.errno not in _NOT_A_FOLDER and _is_folder(root)
    try:
        accept_out = order.accept.output
        output = read_output(root, accept_out, order, dir_fd) if accept_out is not None and work_exists else None
        if accept_out is not None and output is None:
            output = Doc(missing=True)

        def parse(data: bytes, name: str) -> Order:
            found = parse_order(data, name, agents=agents, max_timeout_s=max_timeout_s, max_bytes=max_order_bytes)
            # released as JSON with `parent` and `hops` (job.followups): that file must not be refused for its size
            size = len(fsutil.dump_json({**found.body, "parent": order.job_id, "hops": hops + 1}))
            if size > max_order_bytes:
                raise OrderError(
                    f"larger than max_order_bytes once released as JSON with parent and hops"
                    f" ({size} > {max_order_bytes} bytes)"
                )
            return found

        outbox_exists = False
        followups: list[tuple[Followup, bytes | None]] = []
        if work_exists:
            outbox_exists, followups = read_followups(root, parse, max_order_bytes, max_followups, dir_fd)
        ids = [f.order.job_id for f, _ in followups if f.order is not None]
        scope = list(writes)
        if accept_out is not None and changed is None and accept_out not in scope:  # the output is work/'s; a
            scope.append(accept_out)  # workspace's paths answer to writes
        ev = Evidence(
            order=order,
            agent=agent,
            writes=tuple(scope),
            exit=exit,
            receipt=read_receipt(root, dir_fd, receipt_max(order)) if work_exists else Doc(missing=True),
            output=output,
            work_exists=work_exists,
            entries=tuple(list_entries(root, given, dir_fd, left)) if work_exists else (),
            given=given,
            outbox_exists=outbox_exists,
            followups=tuple(f for f, _ in followups),
            known_ids=known(ids) if ids else frozenset(),
            hops=hops,
            max_hops=max_hops,
            max_followups=max_followups,
            changed=tuple(changed) if changed is not None and not isinstance(changed, str) else None,
            changed_unknown=changed if isinstance(changed, str) else None,
            left=left or {},
        )
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return ev, followups
