#!/usr/bin/env python3
"""A FUSE passthrough that remembers only what was fsynced, to test what survives a power cut.

Every operation goes straight through to a backing folder, so programs on the mount see
a normal filesystem. Beside it the filesystem keeps a *durable model*, what a disk would
still hold after a power cut:

- a file's data is copied into the model when that file is fsynced (fsync or fdatasync);
- a folder's entries (name -> file identity, type and mode) are copied into the model when
  that folder is fsynced (``mode=strict``), or, in ``mode=gentle``, every folder's entries
  are copied on any fsync, as a journaling filesystem tends to commit all pending
  namespace changes together; file data still needs the file's own fsync.

A "cut" freezes the model (every later operation fails with EIO) and ``dump`` writes it
out as a plain folder tree: a durable name whose data was never fsynced comes back empty,
and two durable names of one file come back hard-linked.

Run it as ``lazyfs.py BACKING MOUNTPOINT --control SOCKET [--mode strict|gentle]``; it
serves one JSON command per line on the unix socket:

- ``{"cmd": "ping"}``: answers ``{"ok": true}`` once the mount is up;
- ``{"cmd": "arm", "after": N, "kind": "any|fsync|rename|write"}``: cut just before the
  (N+1)th later operation of that kind (so ``after: 0`` cuts before the next one);
- ``{"cmd": "cut"}``: cut now;
- ``{"cmd": "sync"}``: make everything durable now, as sync(1) does;
- ``{"cmd": "status"}``: ``{"frozen": bool, "ops": {...}, "cut_op": "..."}``;
- ``{"cmd": "dump", "dest": PATH}``: write the durable model into PATH (a new folder).

It needs libfuse 3 (Debian's ``fuse3``) and ``mfusepy`` from PyPI.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import socket
import stat
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# libfuse 3, even where libfuse 2 is installed too (bindfs brings it): mfusepy would take
# libfuse 2 first, which has no config for use_ino and no flags for rename
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)

#: operations that change something; "any" counts these
MUTATING = {
    "create",
    "mknod",
    "mkdir",
    "symlink",
    "link",
    "unlink",
    "rmdir",
    "rename",
    "write",
    "truncate",
    "chmod",
    "utimens",
    "fsync",
    "fsyncdir",
}


@dataclass(frozen=True)
class Entry:
    """One durable folder entry: what the name points at."""

    kind: str  # "f" file, "d" folder, "l" symlink, "p" FIFO
    ident: int  # the model's identity of the file (shared by hard links)
    mode: int
    target: str = ""  # a symlink's text


class Model:
    """The durable state: file data by identity, folder entries by identity."""

    def __init__(self, backing: Path, mode: str) -> None:
        self.backing = backing
        self.mode = mode
        self.lock = threading.RLock()
        self.frozen = False
        self.cut_op = ""
        self.ops: Counter[str] = Counter()
        self.armed: tuple[str, int] | None = None  # (kind, operations of that kind still allowed)
        self._ids: dict[tuple[int, int], int] = {}  # backing (st_dev, st_ino) -> identity
        self._next = 1
        self.data: dict[int, bytes] = {}  # identity -> bytes at its last fsync
        self.dirs: dict[int, dict[str, Entry]] = {}  # folder identity -> entries at its last fsync
        self.dirty: set[str] = set()  # folders (paths relative to backing) changed since their last copy
        self.root_id = self.ident(os.lstat(backing))
        self.copy_all()  # what is there at mount time is on disk already

    # -- identity -----------------------------------------------------------
    def ident(self, st: os.stat_result) -> int:
        """Return the identity of a backing file, giving a new one to an inode seen first."""
        key = (st.st_dev, st.st_ino)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = self._next
            self._next += 1
        return found

    def forget(self, st: os.stat_result) -> None:
        """Drop the identity of an inode that is gone, so a reused inode number is a new file."""
        self._ids.pop((st.st_dev, st.st_ino), None)

    # -- gate ---------------------------------------------------------------
    def enter(self, op: str) -> None:
        """Count an operation; fail it with EIO once frozen, and freeze when the armed count runs out."""
        if self.frozen:
            raise mfusepy.FuseOSError(errno.EIO)
        if op not in MUTATING:
            return
        with self.lock:
            self._count(op)

    def _count(self, op: str) -> None:
        if self.frozen:
            raise mfusepy.FuseOSError(errno.EIO)
        self.ops[op] += 1
        self.ops["any"] += 1
        if self.armed is not None:
            kind, left = self.armed
            if kind == "any" or kind == op or (kind == "fsync" and op == "fsyncdir"):
                if left <= 0:
                    self.freeze(op)
                    raise mfusepy.FuseOSError(errno.EIO)
                self.armed = (kind, left - 1)

    def freeze(self, op: str = "cut") -> None:
        self.frozen = True
        self.cut_op = op

    # -- durability ---------------------------------------------------------
    def _entries(self, rel: str) -> dict[str, Entry]:
        """Read the live entries of a backing folder."""
        out: dict[str, Entry] = {}
        base = self.backing / rel
        for name in os.listdir(base):
            try:
                st = os.lstat(base / name)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                kind = "d"
            elif stat.S_ISLNK(st.st_mode):
                kind = "l"
            elif stat.S_ISFIFO(st.st_mode):
                kind = "p"
            elif stat.S_ISREG(st.st_mode):
                kind = "f"
            else:
                continue
            target = os.readlink(base / name) if kind == "l" else ""
            out[name] = Entry(kind, self.ident(st), stat.S_IMODE(st.st_mode), target)
        return out

    def copy_dir(self, rel: str) -> None:
        """Make one folder's current entries durable."""
        try:
            st = os.lstat(self.backing / rel)
        except FileNotFoundError:
            return
        self.dirs[self.ident(st)] = self._entries(rel)
        self.dirty.discard(rel)

    def copy_all(self) -> None:
        for here, _dirs, files in os.walk(self.backing):
            rel = os.path.relpath(here, self.backing)
            self.copy_dir("" if rel == "." else rel)
            for name in files:
                path = Path(here) / name
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    self.data[self.ident(st)] = path.read_bytes()

    def synced_file(self, fd: int, ident: int) -> None:
        """The file behind fd was fsynced: its data is durable (and, gently, every folder)."""
        rd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # fd itself may be write-only
        try:
            size = os.fstat(rd).st_size
            self.data[ident] = os.pread(rd, size, 0) if size else b""
        finally:
            os.close(rd)
        if self.mode == "gentle":
            self.synced_all()

    def synced_dir(self, rel: str) -> None:
        """A folder was fsynced: its entries are durable (gently, every folder's)."""
        if self.mode == "gentle":
            self.synced_all()
        else:
            self.copy_dir(rel)

    def synced_all(self) -> None:
        for rel in sorted(self.dirty):
            self.copy_dir(rel)

    def touched(self, *rels: str) -> None:
        """Note that these folders' entries changed."""
        self.dirty.update(rels)

    def moved_dir(self, old: str, new: str) -> None:
        """Keep the dirty set's paths right after a folder moved."""
        prefix = old + "/"
        for rel in [r for r in self.dirty if r == old or r.startswith(prefix)]:
            self.dirty.discard(rel)
            self.dirty.add(new + rel[len(old) :])

    # -- the picture after a power cut ----------------------------------------
    def dump(self, dest: Path) -> dict[str, int]:
        """Write the durable tree into dest (created); return counts of what was written."""
        dest.mkdir(parents=True)
        counts: Counter[str] = Counter()
        placed: dict[int, Path] = {}
        seen_dirs = {self.root_id}

        def fill(folder: Path, ident: int) -> None:
            for name, entry in sorted(self.dirs.get(ident, {}).items()):
                path = folder / name
                if entry.kind == "d":
                    if entry.ident in seen_dirs:  # a folder with two durable names keeps its first
                        counts["dir_twice"] += 1
                        continue
                    seen_dirs.add(entry.ident)
                    path.mkdir()
                    fill(path, entry.ident)
                    os.chmod(path, entry.mode)
                    counts["dirs"] += 1
                elif entry.kind == "l":
                    os.symlink(entry.target, path)
                elif entry.kind == "p":
                    os.mkfifo(path, entry.mode)
                elif entry.ident in placed:
                    os.link(placed[entry.ident], path)
                    counts["links"] += 1
                else:
                    data = self.data.get(entry.ident)
                    if data is None:
                        counts["emptied"] += 1
                    path.write_bytes(data or b"")
                    os.chmod(path, entry.mode)
                    placed[entry.ident] = path
                    counts["files"] += 1

        fill(dest, self.root_id)
        return dict(counts)


def _rel(path: str) -> str:
    return path.lstrip("/")


def _parent(path: str) -> str:
    return os.path.dirname(_rel(path))


class LazyFS(mfusepy.Operations):
    """The passthrough: each call goes to the backing folder, then tells the model."""

    use_ns = True

    def __init__(self, model: Model) -> None:
        self.m = model
        self.root = str(model.backing)
        self.fhs: dict[int, int] = {}  # open file -> identity

    def _p(self, path: str) -> str:
        return os.path.join(self.root, _rel(path))

    def init_with_config(self, conn_info: Any, config: Any) -> None:
        if config is not None:
            config.use_ino = 1  # hard links show one inode number, as the daemon checks
            config.hard_remove = 1  # no .fuse_hidden files: an unlink is an unlink
            config.entry_timeout = 0
            config.attr_timeout = 0
            config.negative_timeout = 0
            config.direct_io = 0  # the page cache stays, so SQLite's shared mmap of -shm works

    # -- reading ------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        self.m.enter("getattr")
        st = os.lstat(self._p(path))
        keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")
        out: dict[str, Any] = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def access(self, path: str, amode: int) -> int:
        self.m.enter("access")
        if not os.access(self._p(path), amode, follow_symlinks=False):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path: str) -> str:
        self.m.enter("readlink")
        return os.readlink(self._p(path))

    def opendir(self, path: str) -> int:
        self.m.enter("opendir")
        if not os.path.isdir(self._p(path)):
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return 0

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        self.m.enter("readdir")
        out = []
        with os.scandir(self._p(path)) as it:
            for e in it:  # a zero inode number would hide the name (readdir skips d_ino 0)
                out.append((e.name, {"st_ino": e.inode(), "st_mode": e.stat(follow_symlinks=False).st_mode}, 0))
        here = os.lstat(self._p(path))
        dots = {"st_ino": here.st_ino, "st_mode": here.st_mode}
        return [(".", dots, 0), ("..", dots, 0), *out]

    def releasedir(self, path: str, fh: int) -> int:
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self.m.enter("statfs")
        sv = os.statvfs(self._p(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {k: getattr(sv, k) for k in keys} | {"f_namemax": sv.f_namemax}

    def open(self, path: str, flags: int) -> int:
        self.m.enter("open")
        fd = os.open(self._p(path), flags)
        with self.m.lock:
            self.fhs[fd] = self.m.ident(os.fstat(fd))
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self.m.enter("read")
        return os.pread(fh, size, offset)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        with self.m.lock:
            self.fhs.pop(fh, None)
        os.close(fh)
        return 0

    # -- data -----------------------------------------------------------------
    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self.m.enter("write")
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self.m.enter("truncate")
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._p(path), length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self.m.lock:
            self.m.enter("fsync")
            self.m.synced_file(fh, self.fhs.get(fh) or self.m.ident(os.fstat(fh)))
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self.m.lock:
            self.m.enter("fsyncdir")
            self.m.synced_dir(_rel(path))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self.m.enter("chmod")
        if not os.path.islink(self._p(path)):
            os.chmod(self._p(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self.m.enter("chown")
        os.chown(self._p(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self.m.enter("utimens")
        os.utime(self._p(path), ns=times, follow_symlinks=False) if times else os.utime(self._p(path))
        return 0

    # -- names ----------------------------------------------------------------
    def create(self, path: str, mode: int, flags: int = os.O_RDWR) -> int:
        with self.m.lock:
            self.m.enter("create")
            fd = os.open(self._p(path), flags | os.O_CREAT, mode)
            self.fhs[fd] = self.m.ident(os.fstat(fd))
            self.m.touched(_parent(path))
        return fd

    def mknod(self, path: str, mode: int, dev: int) -> int:
        with self.m.lock:
            self.m.enter("mknod")
            os.mknod(self._p(path), mode, dev)
            self.m.touched(_parent(path))
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        with self.m.lock:
            self.m.enter("mkdir")
            os.mkdir(self._p(path), mode)
            self.m.touched(_parent(path), _rel(path))
        return 0

    def symlink(self, target: str, source: str) -> int:
        with self.m.lock:
            self.m.enter("symlink")
            os.symlink(source, self._p(target))
            self.m.touched(_parent(target))
        return 0

    def link(self, target: str, source: str) -> int:
        with self.m.lock:
            self.m.enter("link")
            os.link(self._p(source), self._p(target), follow_symlinks=False)
            self.m.touched(_parent(target))
        return 0

    def unlink(self, path: str) -> int:
        with self.m.lock:
            self.m.enter("unlink")
            st = os.lstat(self._p(path))
            os.unlink(self._p(path))
            if st.st_nlink <= 1:
                self.m.forget(st)
            self.m.touched(_parent(path))
        return 0

    def rmdir(self, path: str) -> int:
        with self.m.lock:
            self.m.enter("rmdir")
            st = os.lstat(self._p(path))
            os.rmdir(self._p(path))
            self.m.forget(st)
            self.m.touched(_parent(path))
            self.m.dirty.discard(_rel(path))
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        with self.m.lock:
            self.m.enter("rename")
            if flags & RENAME_EXCHANGE:
                raise mfusepy.FuseOSError(errno.EINVAL)
            src, dst = self._p(old), self._p(new)
            try:
                replaced: os.stat_result | None = os.lstat(dst)
            except FileNotFoundError:
                replaced = None
            if flags & RENAME_NOREPLACE:
                if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) != 0:
                    raise mfusepy.FuseOSError(ctypes.get_errno())
            else:
                os.rename(src, dst)
            if replaced is not None and (stat.S_ISDIR(replaced.st_mode) or replaced.st_nlink <= 1):
                same = os.lstat(dst)
                if (same.st_dev, same.st_ino) != (replaced.st_dev, replaced.st_ino):
                    self.m.forget(replaced)
            if os.path.isdir(dst) and not os.path.islink(dst):
                self.m.moved_dir(_rel(old), _rel(new))
            self.m.touched(_parent(old), _parent(new))
        return 0


class LazyFUSE(mfusepy.FUSE):
    """mfusepy's FUSE, but passing rename's flags (RENAME_NOREPLACE) on instead of dropping them."""

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return int(self.operations.rename(old.decode(), new.decode(), flags) or 0)


def serve_control(model: Model, sock_path: str) -> None:
    """Answer JSON commands on a unix socket, one per line, until the process ends."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)

    def answer(req: dict[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        with model.lock:
            if cmd == "ping":
                return {"ok": True}
            if cmd == "arm":
                model.armed = (str(req.get("kind", "any")), int(req["after"]))
                return {"ok": True}
            if cmd == "cut":
                if not model.frozen:
                    model.freeze("cut")
                return {"ok": True}
            if cmd == "sync":
                model.copy_all()
                return {"ok": True}
            if cmd == "status":
                return {"ok": True, "frozen": model.frozen, "cut_op": model.cut_op, "ops": dict(model.ops)}
            if cmd == "dump":
                if not model.frozen:
                    model.freeze("dump")
                return {"ok": True, "counts": model.dump(Path(req["dest"]))}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def client(conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            for line in f:
                try:
                    reply = answer(json.loads(line))
                except Exception as exc:  # noqa: BLE001 - the harness reads the error
                    reply = {"ok": False, "error": repr(exc)}
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=client, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("backing")
    p.add_argument("mountpoint")
    p.add_argument("--control", required=True, help="unix socket for the harness's commands")
    p.add_argument("--mode", choices=["strict", "gentle"], default="strict")
    a = p.parse_args(argv)
    if mfusepy.fuse_version_major != 3:
        p.error(f"needs libfuse 3 (Debian package fuse3), found {mfusepy.fuse_version_major}")
    model = Model(Path(a.backing).resolve(), a.mode)
    threading.Thread(target=serve_control, args=(model, a.control), daemon=True).start()
    LazyFUSE(LazyFS(model), a.mountpoint, foreground=True, fsname="lazyfs", subtype="lazyfs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
