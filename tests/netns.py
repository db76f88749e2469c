"""Simulated hosts for the many-hosts tests: one network namespace per host.

Each host is a network namespace joined to the root namespace by a veth pair with its own
/30 subnet ``10.77.N.0/30``: the root side is ``10.77.N.1`` (the host's way to the
PostgreSQL server, :attr:`Host.gateway`), the host side ``10.77.N.2``. The files are
shared (only the network is separate), so a daemon started in a host sees the same
dispatch root.

Faults:

- :meth:`Host.partition` cuts the host off. ``how="drop"`` (the default) silently drops
  every frame both ways while links and routes stay up, like a cable cut between two
  switches: a connect times out and an open connection hears nothing. ``how="down"``
  takes the host's own interface down: the host gets "network is unreachable" at once,
  the server still hears silence. :meth:`Host.heal` undoes either.
- :meth:`Host.kill_all`, :meth:`Host.pause` and :meth:`Host.resume` signal every process
  of the host.

Needs root and ``ip`` (iproute2); without them :class:`Hosts` raises
:class:`NetnsUnavailable` with the reason, and the ``hosts`` fixture of ``pg_fixtures.py``
fails the test (it never skips it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from runlock import OwnerLock, lock_dir, owner_is_dead

# Every name this module creates starts with PREFIX, then the run id, so that leftovers
# of a crashed run are found by name and a parallel run's live hosts are left alone.
PREFIX = "dspt"
RUN_ID_LEN = 5
SUBNETS = range(1, 255)
MAX_PASSES = 50
NETNS_DIR = Path("/run/netns")
_NAME_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{{RUN_ID_LEN}}})[-rh]\d+$")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ``ip``)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` and raise with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _mac(subnet: int, last: int) -> str:
    """Return a locally administered MAC address for one end of subnet ``subnet``."""
    return f"02:77:00:{subnet:02x}:00:{last:02x}"


# ---------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int, int] | None:
    """Return (state, ppid, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name is in parentheses and may itself hold spaces or parentheses
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _all_pids() -> list[int]:
    """Return the pids of every process on the machine."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _net_ns_link(pid: int) -> str | None:
    """Return the ``net:[inode]`` identity of the network namespace of ``pid``, or None."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _pids_in_netns(ns_path: Path) -> set[int]:
    """Return the live (not zombie) processes whose network namespace is ``ns_path``."""
    try:
        ident = f"net:[{os.stat(ns_path).st_ino}]"
    except FileNotFoundError:
        return set()
    found: set[int] = set()
    for pid in _all_pids():
        if _net_ns_link(pid) == ident:
            stat = _stat(pid)
            if stat is not None and stat[0] != "Z":
                found.add(pid)
    return found


def _descendants(roots: set[int]) -> set[int]:
    """Return ``roots`` and every live descendant of them (zombies left out)."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is None:
            continue
        states[pid] = stat[0]
        children.setdefault(stat[1], []).append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in states]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return {pid for pid in found if states.get(pid, "Z") != "Z"}


def _kill_netns_processes(ns_path: Path, timeout: float = 10.0) -> None:
    """SIGKILL every process in the namespace at ``ns_path`` until none is left."""
    end = time.monotonic() + timeout
    while pids := _pids_in_netns(ns_path):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > end:
            raise RuntimeError(f"processes {sorted(pids)} in {ns_path.name} survive SIGKILL")
        time.sleep(0.02)


# ---------------------------------------------------------------------------- hosts


class Host:
    """One simulated host: a network namespace with a veth link to the root namespace."""

    def __init__(self, name: str, subnet: int, veth_root: str, veth_host: str) -> None:
        """Describe a host whose namespace and link :class:`Hosts` has already made."""
        self.name = name
        self.subnet = subnet
        self.veth_root = veth_root
        self.veth_host = veth_host
        self.gateway = f"10.77.{subnet}.1"
        self.address = f"10.77.{subnet}.2"
        self.ns_path = NETNS_DIR / name
        self.partitioned: str | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        """Show the name and addresses."""
        return f"Host({self.name!r}, address={self.address}, gateway={self.gateway})"

    # -- processes

    def run(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace and return its Popen (same pid as argv's)."""
        # `ip netns exec` setns()es and then execs argv in the same process (no fork)
        proc: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def pids(self) -> set[int]:
        """Return every live process of this host.

        That is every process in its network namespace (a daemon that double-forked away
        from its parent is still there) and every descendant of a process started by
        :meth:`run`. Zombies are left out: they are dead, only not yet reaped.
        """
        roots = {proc.pid for proc in self._procs if proc.poll() is None}
        found = _pids_in_netns(self.ns_path) | _descendants(roots)
        found.discard(os.getpid())
        return found

    def signal_all(self, sig: int) -> set[int]:
        """Send ``sig`` to every process of this host; return the pids signalled.

        Scans again after each pass and signals the newcomers, so that a child forked
        while the pass ran is not missed. A host that never stops forking (SIGCONT to a
        busy daemon) ends the rescans after MAX_PASSES.
        """
        sent: set[int] = set()
        for _ in range(MAX_PASSES):
            fresh = self.pids() - sent
            if not fresh:
                break
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            sent |= fresh
        return sent

    def kill_all(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> set[int]:
        """Send ``sig`` to every process of this host; for SIGKILL, wait until all are gone.

        Returns the pids signalled. Processes started by :meth:`run` are reaped.
        """
        sent = self.signal_all(sig)
        if sig != signal.SIGKILL:
            return sent
        end = time.monotonic() + timeout
        while left := self.pids():
            # a stopped or just-forked process: kill again until the host is empty
            sent |= self.signal_all(sig)
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: processes {sorted(left)} survive SIGKILL")
            time.sleep(0.02)
        # a process in the middle of its exit has left its namespaces (so pids() no longer sees it) before it
        # is a zombie: wait until each one signalled is gone or a zombie, as a caller reading /proc expects
        while dying := {pid for pid in sent if (_stat(pid) or ("Z",))[0] != "Z"}:
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: processes {sorted(dying)} do not end after SIGKILL")
            time.sleep(0.02)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))
        return sent

    def pause(self, timeout: float = 10.0) -> set[int]:
        """SIGSTOP every process of this host and wait until all of them are stopped."""
        sent = self.signal_all(signal.SIGSTOP)
        end = time.monotonic() + timeout
        while True:
            running = {pid for pid in self.pids() if (_stat(pid) or ("T",))[0] not in ("T", "t")}
            if not running:
                return sent
            sent |= self.signal_all(signal.SIGSTOP)
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: processes {sorted(running)} do not stop")
            time.sleep(0.02)

    def resume(self) -> set[int]:
        """SIGCONT every process of this host."""
        return self.signal_all(signal.SIGCONT)

    # -- network

    def partition(self, how: str = "drop") -> None:
        """Cut this host off the network (``how``: "drop" silent loss, "down" interface down)."""
        if how == "drop":
            # a permanent neighbour entry naming a MAC no one has: frames still leave, and
            # the other end drops them as not addressed to it, in both directions
            _ip(
                "neigh",
                "replace",
                self.address,
                "lladdr",
                _mac(self.subnet, 0xFE),
                "dev",
                self.veth_root,
                "nud",
                "permanent",
            )
            self._ip(
                "neigh",
                "replace",
                self.gateway,
                "lladdr",
                _mac(self.subnet, 0xFF),
                "dev",
                self.veth_host,
                "nud",
                "permanent",
            )
        elif how == "down":
            self._ip("link", "set", "dev", self.veth_host, "down")
        else:
            raise ValueError(f"partition how={how!r}: use 'drop' or 'down'")
        self.partitioned = how

    def heal(self) -> None:
        """Undo :meth:`partition`: link up and the true neighbour entries back."""
        self._ip("link", "set", "dev", self.veth_host, "up")
        self._set_neighbours()
        self.partitioned = None

    def _set_neighbours(self) -> None:
        """Pin each end's neighbour to the other end's MAC.

        Permanent entries: no ARP, so a partition is silence rather than an ARP failure
        that the kernel reports as "no route to host" after about 3 s.
        """
        _ip("neigh", "replace", self.address, "lladdr", _mac(self.subnet, 2), "dev", self.veth_root, "nud", "permanent")
        self._ip(
            "neigh", "replace", self.gateway, "lladdr", _mac(self.subnet, 1), "dev", self.veth_host, "nud", "permanent"
        )

    def _ip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``ip ARGS`` inside this host's namespace."""
        return _ip("-n", self.name, *args)

    def _destroy(self) -> None:
        """Kill every process of the host, then delete its link and namespace."""
        try:
            self.kill_all(signal.SIGKILL)
        finally:
            # deleting one end of a veth deletes both; done first so the address is free
            # at once (a namespace is freed asynchronously)
            _ip("link", "del", "dev", self.veth_root, check=False)
            _kill_netns_processes(self.ns_path)
            _ip("netns", "del", self.name, check=False)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                # pipes a test left open would otherwise warn (and fail under -W error)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()


class Hosts:
    """A factory of :class:`Host` objects for one test (or one benchmark), and their cleanup."""

    def __init__(self) -> None:
        """Check that hosts can be made here, and clear leftovers of dead runs."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("simulated hosts need root (ip netns add, veth pairs)")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("simulated hosts need `ip` (install iproute2; bash .ci/run does on Debian)")
        self._locks = lock_dir()
        self.run_id = secrets.token_hex(4)[:RUN_ID_LEN]
        self._owner = OwnerLock(self._locks / f"netns-{self.run_id}.lock")
        self.hosts: list[Host] = []
        self._count = 0
        with self._alloc_lock():
            clean_leftovers()

    @contextlib.contextmanager
    def _alloc_lock(self) -> Iterator[None]:
        """Hold the machine-wide lock under which subnets are chosen and leftovers cleared."""
        fd = os.open(self._locks / "netns-alloc.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def add(self) -> Host:
        """Make one more host and return it, reachable from the root namespace and back."""
        self._count += 1
        n = self._count
        name = f"{PREFIX}{self.run_id}-{n}"
        veth_root = f"{PREFIX}{self.run_id}r{n}"
        veth_host = f"{PREFIX}{self.run_id}h{n}"
        with self._alloc_lock():
            subnet = _free_subnet()
            _ip("netns", "add", name)
            host = Host(name, subnet, veth_root, veth_host)
            self.hosts.append(host)
            _ip(
                "link",
                "add",
                "name",
                veth_root,
                "address",
                _mac(subnet, 1),
                "type",
                "veth",
                "peer",
                "name",
                veth_host,
                "address",
                _mac(subnet, 2),
                "netns",
                name,
            )
            _ip("addr", "add", f"{host.gateway}/30", "dev", veth_root)
        _ip("link", "set", "dev", veth_root, "up")
        host._ip("addr", "add", f"{host.address}/30", "dev", veth_host)
        host._ip("link", "set", "dev", veth_host, "up")
        # a daemon in the host may talk to itself over localhost
        host._ip("link", "set", "dev", "lo", "up")
        host._set_neighbours()
        return host

    def close(self) -> None:
        """Destroy every host (processes, link, namespace), even after a failed test."""
        errors: list[str] = []
        for host in self.hosts:
            try:
                host._destroy()
            except Exception as exc:  # noqa: BLE001 - every host is destroyed, errors reported together
                errors.append(f"{host.name}: {exc}")
        self.hosts.clear()
        self._owner.release()
        if errors:
            raise RuntimeError("cleanup of simulated hosts failed: " + "; ".join(errors))

    def __enter__(self) -> Hosts:
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Destroy every host."""
        self.close()


def _free_subnet() -> int:
    """Return an N with no 10.77.N.1 in the root namespace (call under the allocation lock)."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.1/", _ip("-o", "-4", "addr", "show").stdout))
    for n in SUBNETS:
        if str(n) not in used:
            return n
    raise RuntimeError("all 254 subnets 10.77.N.0/30 are in use")


def clean_leftovers() -> list[str]:
    """Delete namespaces and links of PREFIX whose run is dead; return what was deleted.

    A run is dead when no process holds its owner lock; a parallel run's hosts are kept.
    """
    folder = lock_dir()
    deleted: list[str] = []
    try:
        names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    except (OSError, RuntimeError):
        names = []
    links = re.findall(rf"^\d+: ({PREFIX}[^:@\s]+)", _ip("-o", "link", "show").stdout, flags=re.M)
    dead: dict[str, bool] = {}
    for name in names + links:
        match = _NAME_RE.match(name)
        if not match:
            continue
        run_id = match.group(1)
        if run_id not in dead:
            dead[run_id] = owner_is_dead(folder / f"netns-{run_id}.lock")
        if not dead[run_id]:
            continue
        if name in names:
            _kill_netns_processes(NETNS_DIR / name)
            _ip("netns", "del", name, check=False)
        else:
            _ip("link", "del", "dev", name, check=False)
        deleted.append(name)
    for run_id, is_dead in dead.items():
        if is_dead:
            (folder / f"netns-{run_id}.lock").unlink(missing_ok=True)
    return deleted


@contextlib.contextmanager
def host_network() -> Iterator[Hosts]:
    """Yield a :class:`Hosts` factory outside pytest (benchmarks); destroys every host at exit."""
    hosts = Hosts()
    try:
        yield hosts
    finally:
        hosts.close()
