"""The daemons of a root as an operator meets them: reload them, and see whether they run the config on disk.

``reload`` signals (SIGHUP) the live daemons of this root on this host, after the
config has passed the checks the daemon itself applies; a daemon that systemd
runs is named with the `systemctl reload` to use instead, since that reload
validates the config and reports a failure where you look for it.
``config_note`` compares the digest each live daemon recorded with the config
file a command reads, for the one-line notes of `submit`, `retry` and `status`.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from dispatcher import procs
from dispatcher.errors import printable
from dispatcher.ledger.base import DaemonInfo


def this_host() -> str:
    """Return the host name daemons record in their entries."""
    return socket.gethostname()


def systemd_unit(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Return how to reload the systemd service whose main process pid is, or None if systemd does not run it.

    A daemon is a unit's own process when systemd started it: its parent is a systemd
    (the system's, or a user's service manager). A daemon started by hand, by cron, from
    an ssh session or a CI job sits in that service's cgroup too, but its parent is another
    program: it is signalled like any other. Read from /proc, readable by anyone.
    """
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    unit = unit_of_cgroup(text)
    if unit is None or not _started_by_systemd(pid, proc):
        return None
    return f"systemctl --user reload {unit}" if _under_user_manager(text) else f"systemctl reload {unit}"


def _started_by_systemd(pid: int, proc: Path) -> bool:
    """Return True if pid's parent is a systemd (PID 1's, or a user's service manager)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        ppid = int(stat.rpartition(")")[2].split()[1])
        return (proc / str(ppid) / "comm").read_text().strip() == "systemd"
    except (OSError, ValueError, IndexError):
        return False


def _under_user_manager(text: str) -> bool:
    """Return True if a /proc/PID/cgroup text puts the process under a user's service manager (user@UID.service)."""
    return any("/user@" in line for line in text.splitlines())


def unit_of_cgroup(text: str) -> str | None:
    """Return the innermost ``*.service`` of a /proc/PID/cgroup text (cgroup v2 or v1's name=systemd), or None.

    ``user@UID.service`` is a user's service manager, not a unit that runs the daemon.
    """
    for line in text.splitlines():
        hierarchy, _, path = line.partition(":")[2].partition(":")
        if hierarchy not in ("", "name=systemd"):
            continue
        units = [p for p in path.split("/") if p.endswith(".service") and not p.startswith("user@")]
        if units:
            return units[-1]
    return None


@dataclass(frozen=True, slots=True)
class Reloaded:
    """What `reload` did for one live daemon: signalled, or why not (``advice``)."""

    daemon: DaemonInfo
    signalled: bool
    advice: str | None = None

    def line(self) -> str:
        """Return the line that tells the operator."""
        who = f"daemon {self.daemon.pid} on {self.daemon.host}"
        if self.signalled:
            return f"{who}: asked to reload its config (SIGHUP); it logs config.reloaded or config.rejected"
        return f"{who}: {self.advice}"


def live_here(
    daemons: list[DaemonInfo], host: str | None = None, locks: str | os.PathLike[str] | None = None
) -> list[DaemonInfo]:
    """Return the live daemons of this host, oldest first.

    ``locks``: the root's ``.state/daemons/`` folder: then only a daemon whose pid, as this
    process sees pids, holds its own lock file there (``<owner>.lock``) is one of them. A daemon
    in another pid namespace under the same host name (a container) has a pid that means another
    process here (pid 1, 2, or another daemon of this root), which must never be signalled.
    """
    host = this_host() if host is None else host
    here = [d for d in daemons if d.alive and d.host == host]
    if locks is not None:
        folder = os.path.realpath(locks)
        # another user's daemon cannot be looked at: signalled, the kernel's answer says why it cannot be
        here = [d for d in here if procs.holds_open(d.pid, os.path.join(folder, f"{d.owner}.lock"), unreadable=True)]
    return sorted(here, key=lambda d: d.started)


def reload(daemons: list[DaemonInfo]) -> list[Reloaded]:
    """Send SIGHUP to each live daemon given, except those systemd runs; return what happened to each."""
    out = []
    for d in daemons:
        command = systemd_unit(d.pid)
        if command is not None:
            unit = command.rpartition(" ")[2]
            out.append(Reloaded(d, False, f"runs under systemd as {unit}: use `{command}`"))
            continue
        try:
            os.kill(d.pid, signal.SIGHUP)
        except ProcessLookupError:
            out.append(Reloaded(d, False, "stopped meanwhile"))
        except PermissionError:
            out.append(Reloaded(d, False, "cannot be signalled by you (run `dispatcher reload` as its user or root)"))
        else:
            out.append(Reloaded(d, True))
    return out


def config_note(
    digest: str | None, path: Path | None, daemons: list[DaemonInfo], host: str | None = None
) -> str | None:
    """Return one line when a live daemon of this host loaded this same file, and it holds another config now.

    A daemon records its file's digest and path (``spec.config.config_mark``); one that
    loaded another file, or runs on another host (whose file this command cannot see, and which
    `dispatcher reload` here cannot reach), is left out. A record without a path (an older
    daemon's) counts as this file's.
    """
    if digest is None or path is None:
        return None
    here, real, host = os.path.abspath(path), os.path.realpath(path), socket.gethostname() if host is None else host
    stale = []
    for d in daemons:
        if not d.alive or d.config_digest is None or d.host != host:
            continue
        loaded, _, loaded_from = d.config_digest.partition(" ")
        same = loaded_from in ("", here) or os.path.realpath(loaded_from) == real  # one file, however named
        if loaded != digest and same:
            stale.append(d)
    if not stale:
        return None
    who = ", ".join(f"{d.pid} on {d.host}" for d in stale)
    many = "daemons" if len(stale) > 1 else "daemon"
    return (
        f"note: {printable(str(path))} has changed since the running {many} ({who}) loaded it;"
        " `dispatcher reload` (or `systemctl reload`) makes them load it"
    )
