"""What `validate` checks beyond the schema that a reload would otherwise refuse: the log file, the running daemon.

``systemctl reload`` runs `validate` before it sends SIGHUP, so a config the daemon would
reject on reload must fail here, where the operator sees it: a ``log_file`` it cannot open
(a folder, a path it may not write, a named pipe no one reads), and, when systemd names the
daemon being reloaded (``$MAINPID`` in the environment of ``ExecReload=``), a ``root`` or a
``ledger`` (or, shared, a ``lease``) other than the ones that daemon runs with, as noted on its lock.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile

from dispatcher.ledger.flocks import ledger_digest, noted_ledger
from dispatcher.spec.programs import Finding
from dispatcher.spec.settings import Config
from dispatcher.text import is_count, number

_LOCK = re.compile(r"^(?P<root>/.*)/\.state/daemons/[^/]+\.lock$")
_SQLITE_FILE = "/.state/ledger.sqlite3"


def check_log_file(cfg: Config) -> list[Finding]:
    """Return an error when the config's log_file could not be opened for appending; nothing is left behind."""
    path = cfg.log_file
    if path is None:
        return []
    try:
        st = os.stat(path)
    except FileNotFoundError:
        folder = path.parent
        while not folder.exists() and folder != folder.parent:  # the daemon makes the missing folders
            folder = folder.parent
        if not os.access(folder, os.W_OK | os.X_OK):
            return [Finding("log_file", f"cannot create {path}: {folder} is not writable", error=True)]
        try:  # access() says yes to root wherever the mount is writable, /proc included: make something, and remove it
            os.rmdir(tempfile.mkdtemp(prefix=".dispatcher-validate-", dir=folder))
        except OSError as exc:
            return [Finding("log_file", f"cannot create {path}: {exc.strerror}", error=True)]
        return []
    except OSError as exc:
        return [Finding("log_file", f"cannot open {path}: {exc.strerror}", error=True)]
    if stat.S_ISDIR(st.st_mode):
        return [Finding("log_file", f"cannot open {path}: it is a folder", error=True)]
    if not os.access(path, os.W_OK):
        return [Finding("log_file", f"cannot open {path}: not writable", error=True)]
    if stat.S_ISFIFO(st.st_mode):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:
            why = "a named pipe no process reads" if exc.errno == errno.ENXIO else exc.strerror
            return [Finding("log_file", f"cannot open {path}: {why}", error=True)]
    return []


def _same_file(a: str, b: str) -> bool:
    """Return True if a and b name one file (its device and inode: under a bind mount the paths differ)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_running(cfg: Config, environ: dict[str, str] | None = None) -> list[Finding]:
    """Return errors for what the daemon named by ``$MAINPID`` would refuse on reload: another root or ledger kind.

    Its root is read from the daemon's own open files (its liveness lock in
    ``<root>/.state/daemons/``); its ledger is SQLite when it has the root's ledger file open.
    Nothing is said when ``$MAINPID`` is unset or names no dispatcher daemon this user can see.
    """
    env = os.environ if environ is None else environ
    pid = env.get("MAINPID", "")
    if not is_count(pid):
        return []
    try:
        fds = {f"/proc/{pid}/fd/{fd}": os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return []
    locks = [(fd, m.group("root")) for fd, t in fds.items() if (m := _LOCK.match(t))]
    if not locks:
        return []
    lock_fd, running = locks[0]
    targets = list(fds.values())
    out = []
    if not _same_file(lock_fd, os.path.join(cfg.root, fds[lock_fd][len(running) + 1 :])):
        why = f"cannot change while the daemon (pid {pid}) runs with root {running}: restart it instead"
        out.append(Finding("root", why, error=True))
    on_sqlite = any(t == running + _SQLITE_FILE for t in targets)
    noted = next((noted_ledger(t) for t in targets if _LOCK.match(t)), None)  # None: not noted (no xattrs there)
    if on_sqlite != (cfg.ledger == "sqlite"):
        running_kind = "sqlite" if on_sqlite else "postgresql"
        why = f"cannot change while the daemon (pid {pid}) runs with the {running_kind} ledger: restart it instead"
        out.append(Finding("ledger", why, error=True))
    elif noted is not None and noted[0] != ledger_digest(cfg.ledger):  # the same kind, another URL
        why = f"cannot change while the daemon (pid {pid}) runs with another ledger: restart it instead"
        out.append(Finding("ledger", why, error=True))
    elif noted is not None and not on_sqlite and noted[1] != cfg.lease_s:  # the daemons sharing it judge it by it
        why = f"cannot change while the daemon (pid {pid}) runs with lease {number(noted[1])}: restart it instead"
        out.append(Finding("lease", why, error=True))
    return out
