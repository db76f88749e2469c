"""Small crash-safe file operations: atomic writes, directory fsyncs, safe opens.

The rule of a mail spool: write under a temporary name, fsync the file, rename
it into place, fsync the directory. Files an agent left behind are opened one
path part at a time with O_NOFOLLOW and O_NONBLOCK, and checked to be regular
files before they are read, so a symlink or FIFO can neither redirect nor block
the daemon.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from dispatcher.lean import sha256_for

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def file_id(path: str | Path, *, follow_symlinks: bool = True) -> tuple[int, int] | None:
    """Return (st_dev, st_ino) of the file at path (of a link itself without ``follow_symlinks``), or None."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename or create in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_one(path: str | Path) -> OSError | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return exc
    try:
        os.fsync(fd)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    return None


SYNC_SIDE_BY_SIDE = 16  # a batch of at least this many fsyncs is issued from SYNC_THREADS threads at once
SYNC_THREADS = 4


def fsync_many(paths: Sequence[str | Path]) -> list[OSError | None]:
    """Fsync files and folders; return each one's error (None: synced), in order, once all are done.

    A caller that writes a whole batch first and then syncs it keeps every fsync of
    the batch before any of its renames. A small batch (one job's folder, a few) is
    synced in the caller, one after another: side by side they gained nothing in the
    daemon's throughput and cost CPU per job. A large one (a burst of claims: 32 jobs'
    folders are 128 fsyncs) is issued from a few threads started for it, which lets the
    filesystem's journal commit many of them together: on ext4, 13 ms instead of 27
    to 32 ms for 32 jobs' folders.
    """
    if len(paths) < SYNC_SIDE_BY_SIDE:
        return [_fsync_one(p) for p in paths]
    errors: list[OSError | None] = [None] * len(paths)
    todo = iter(range(len(paths)))  # next() on one iterator from several threads: each index once
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, -1)
            if i < 0:
                return
            errors[i] = _fsync_one(paths[i])

    # threads of this batch only (a few dozen us to start, against 0.3 ms or more per fsync): none is
    # left behind, so a daemon's threads do not grow with what it did once
    threads = []
    for _ in range(SYNC_THREADS - 1):
        thread = threading.Thread(target=work, name="fsync", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread now (a shortage of processes or memory): fewer hands, same work
            break
        threads.append(thread)
    work()  # the caller syncs too
    for thread in threads:
        thread.join()
    return errors


def make_dir(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` in one system call when the parent exists (the usual case)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def make_dirs(*paths: Path) -> bool:
    """Create the missing folders among paths (and their missing parents), durably; return True if any was made.

    Each folder that got a new entry is fsynced once, after every creation: without it a
    power cut can take back a folder made just before (a fresh root's inbox/, say). A
    folder that exists costs one stat and no fsync.
    """
    grown: dict[Path, None] = {}  # folders that got a new entry, in order of creation
    for path in paths:
        missing: list[Path] = []
        here = path
        while not here.is_dir():
            missing.append(here)
            if here.parent == here:
                break
            here = here.parent
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
            except FileExistsError:
                if not folder.is_dir():
                    raise
            grown[folder.parent] = None  # made by someone else meanwhile: its entry may not be durable yet
    for folder in reversed(grown):  # the deepest first: a child's entry before its parent's
        fsync_dir(folder)
    return bool(grown)


def _write(path: str | Path, data: bytes, flags: int, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o640)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True) -> None:
    """Write data to path through a temporary file and a rename; fsync the file (and folder) when sync."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write(tmp, data, os.O_TRUNC, sync)
    os.rename(tmp, path)
    if sync and sync_dir:
        fsync_dir(path.parent)


def write_in_place(path: str | Path, data: bytes, *, sync: bool = False) -> None:
    """Write path over whatever file it names, never through a link (a torn write reads as damaged)."""
    _write(path, data, os.O_TRUNC | os.O_NOFOLLOW, sync)


def write_new(path: str | Path, data: bytes, *, sync: bool = False) -> None:
    """Create path with data (fsynced when sync); fail if it exists."""
    _write(path, data, os.O_EXCL, sync)


def dump_json(value: Any) -> bytes:
    """Return value as one line of JSON with a final newline (the C encoder: indent= is pure Python).

    Undecodable bytes of file names (surrogate escapes) become JSON \\u escapes.
    """
    if _MAKE is None:
        return (json_text(value) + "\n").encode("utf-8", "backslashreplace")
    text = "".join(_MAKE({}, _DEFAULT, _STR, None, ": ", ", ", False, False, True)(value, 0))  # json_text, inline
    return (text + "\n").encode("utf-8", "backslashreplace")


def json_text(value: Any) -> str:
    """Return ``json.dumps(value, ensure_ascii=False)``: the same text and errors, without its wrappers.

    ``JSONEncoder.encode`` builds this C encoder (with a fresh circular-reference memo)
    for each call after four calls of its own; this builds it directly.
    """
    if _MAKE is None:  # no C accelerator: the pure-Python encoder, as json.dumps would use
        return json.JSONEncoder(ensure_ascii=False).encode(value)
    return "".join(_MAKE({}, _DEFAULT, _STR, None, ": ", ", ", False, False, True)(value, 0))


_MAKE: Any = vars(json.encoder).get("c_make_encoder")  # not in typeshed; None without the C accelerator
_DEFAULT = json.JSONEncoder().default  # raises TypeError for a value JSON cannot hold, as json.dumps does
_STR = json.encoder.encode_basestring  # what JSONEncoder uses with ensure_ascii=False


def _renameat2() -> Any:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _renameat2()
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def rename_into(src: str | Path, dst: str | Path) -> None:
    """``rename_noreplace`` into a folder of the layout that a person may have removed by hand: made again then.

    FileNotFoundError stays for a src that is gone (moved already) or a folder that exists.
    """
    try:
        rename_noreplace(src, dst)
    except FileNotFoundError:
        folder = os.path.dirname(dst)
        if not os.path.lexists(src) or os.path.isdir(folder):
            raise
        make_dirs(Path(folder))
        rename_noreplace(src, dst)


def rename_noreplace(src: str | Path, dst: str | Path) -> None:
    """Rename src to dst, raising FileExistsError if dst exists.

    Uses renameat2(RENAME_NOREPLACE) where the C library has it (a real rename:
    a watcher sees a move). Otherwise: folders are only ever created non-empty
    at their final names, so rename(2) refuses an existing target itself
    (ENOTEMPTY); for files, link + unlink gives the same guarantee.
    """
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        import ctypes

        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "exists", str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS):  # unsupported by this filesystem: fall back
            raise OSError(err, os.strerror(err), str(src))
    if os.path.isdir(src) and not os.path.islink(src):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "exists", str(dst))
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
            raise
        return
    os.link(src, dst, follow_symlinks=False)
    os.unlink(src)


def link_out(src: Path, dst: Path) -> bool:
    """Give an entry of a watched folder a second name, to be unlinked from there later (rename for folders).

    Returns True when linked (the caller unlinks ``src`` once ``dst`` is durable), False
    when moved. A rename out of a watched folder is an unpaired IN_MOVED_FROM, which
    watchdog holds for half a second while it looks for the matching half, and every
    later event of that folder waits behind it. A link + unlink is an IN_DELETE,
    delivered at once. A crash between the two leaves the same inode under both names;
    recovery removes the inbox name (``same_file``).
    """
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.EACCES):
            raise
        os.rename(src, dst)  # a folder, or hard links refused (fs.protected_hardlinks)
        return False
    return True


def same_file(a: str | Path, b: str | Path) -> bool:
    """Return True if a and b are one inode (without following links)."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class NotRegular(Exception):
    """The path is not a regular file; ``kind`` says what it is."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def link_stays_inside(link: str, root: str) -> bool:
    """Return True if the symlink at ``link`` resolves inside ``root``, every link on the way followed.

    The link's text alone is not enough: ``d/../x`` climbs out of root when ``d`` is
    itself a link to ``.``. A link that resolves nowhere (dangling, a loop) is judged by
    how far it resolves.
    """
    real_root = os.path.realpath(root)
    resolved = os.path.realpath(link)
    return resolved == real_root or resolved.startswith(real_root.rstrip(os.sep) + os.sep)


def walk(root: str, skip: str | None = None, unseen: list[str] | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """Yield every entry below root as (POSIX relative path, its lstat), links never followed.

    Iterative (no recursion limit); a folder that cannot be listed, or an entry that
    cannot be looked at, is passed over (and added to ``unseen`` unless it vanished: a
    path longer than the system can name, say). ``skip``: a top-level name neither
    yielded nor entered.
    """
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        try:
            it = os.scandir(folder)
        except OSError as exc:
            if unseen is not None and prefix and exc.errno != errno.ENOENT:
                unseen.append(prefix.rstrip("/"))
            continue
        with it:
            for de in it:
                rel = prefix + de.name
                if rel == skip:
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except OSError as exc:
                    if unseen is not None and exc.errno != errno.ENOENT:
                        unseen.append(rel)
                    continue
                yield rel, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append((de.path, rel + "/"))


def kind_of(mode: int) -> str:
    """Return a word for the file type in a stat mode."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def read_tail(path: str | Path, limit: int, *, start: int = 0) -> bytes:
    """Return the last ``limit`` bytes of a regular file (a log), none before byte ``start``.

    b"" when it is missing, a link or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        at = max(start, st.st_size - limit)
        return os.pread(fd, st.st_size - at, at) if stat.S_ISREG(st.st_mode) and at < st.st_size else b""
    except OSError:
        return b""
    finally:
        os.close(fd)


_READ_CHUNK = 1 << 20  # read_regular's largest read


def read_given(path: str | Path) -> bytes:
    """Read a file a user named on the command line (a link to it followed); NotRegular for a FIFO, a folder...

    Opened without blocking, so a named pipe no one writes is an error, not a hang.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(kind_of(st.st_mode))
        chunks = []
        while chunk := os.read(fd, _READ_CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular(
    path: str | Path, limit: int | None = None, *, base: str | Path | None = None, dir_fd: int | None = None
) -> bytes:
    """Read a regular file without following links or blocking on FIFOs.

    With ``base``, every part of ``path`` below ``base`` is opened with
    O_NOFOLLOW, so no symlinked folder on the way is followed either; with
    ``dir_fd``, ``path`` is a name in the folder open as that descriptor. Raises
    NotRegular for anything that is not a regular file, FileNotFoundError if
    it is missing, and ValueError when it is larger than ``limit``.
    """
    if base is not None:
        # two str paths: the part below base is what relative_to gives, without making two Paths
        rest = path[len(base) + 1 :] if isinstance(path, str) and isinstance(base, str) else "/"
        plain = path == f"{base}/{rest}" and not rest.startswith("/")
        rel: str | PurePath = rest if plain else Path(path).relative_to(base)
        fd = open_beneath(base, rel)
    else:
        try:
            fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegular("symlink") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(kind_of(st.st_mode))
        if limit is not None and st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        size, total = st.st_size, 0
        chunks: list[bytes] = []
        while True:
            # a byte more than fstat's size is asked for: a short read that reaches that size is the end,
            # without one more read to see it empty; a file that grew since goes on to its real end
            want = size - total + 1 if total <= size else _READ_CHUNK
            if want > _READ_CHUNK:
                want = _READ_CHUNK
            chunk = os.read(fd, want)
            got = len(chunk)
            if not got:
                break
            total += got
            if limit is not None and total > limit:
                raise ValueError(f"larger than {limit} bytes")
            if got < want and total >= size:
                if not chunks:
                    return chunk  # the whole file in one read (the usual case)
                chunks.append(chunk)
                break
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def rel_parts(rel: str | PurePath) -> tuple[str, ...]:
    """Return the parts of a relative path as pathlib splits them (empty and ``.`` parts dropped), without a Path."""
    if type(rel) is not str and isinstance(rel, PurePath):  # a plain str, the usual case: no isinstance
        return rel.parts
    if "/" not in rel:  # one name, the usual case (``receipt.json``)
        return (rel,) if rel and rel != "." else ()
    if rel.startswith("/"):
        return PurePosixPath(rel).parts
    return tuple(p for p in rel.split("/") if p and p != ".")


def plain_rel(rel: str) -> str:
    """Return a relative path or pattern without empty and ``.`` parts (``./out/*.csv`` -> ``out/*.csv``)."""
    return "/".join(rel_parts(rel)) if "." in rel or "//" in rel else rel


def open_beneath(base: str | Path, rel: str | PurePath, dir_fd: int | None = None) -> int:
    """Open base/rel one part at a time, refusing symlinks at every step.

    ``dir_fd``: base opened already, as this opens it (a folder, not through a link); rel is
    opened under it, and it stays open (the caller's). The fd returned is always a new one.
    """
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) if dir_fd is None else dir_fd
    parts = rel_parts(rel)
    try:
        if not parts and fd == dir_fd:
            return os.dup(fd)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = _OPEN_FLAGS if last else os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotRegular("symlink" if exc.errno == errno.ELOOP else "not a folder") from None
                raise
            if fd != dir_fd:
                os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        if fd != dir_fd:
            os.close(fd)
        raise


def digest(data: bytes) -> str:
    """Return the sha256 hex digest of data (large data by OpenSSL's, the interpreter lock given up)."""
    return sha256_for(len(data))(data).hexdigest()
