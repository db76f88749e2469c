"""Read what a running process holds and spends from /proc (Linux): threads, memory, CPU."""

from __future__ import annotations

import contextlib
import os
import re
import threading


def proc_status(pid: int) -> dict[str, int]:
    """Return Threads, VmRSS and VmHWM (kB) from /proc/PID/status; {} once it is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("Threads", "VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def proc_cpu_ns(pid: int) -> int:
    """Return CPU time of pid's live threads in ns (sum of /proc/PID/task/*/schedstat)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{tid}/schedstat") as fh,
            ):
                total += int(fh.read().split()[0])
    return total


def proc_ticks(pid: int) -> int:
    """Return utime+stime of pid in clock ticks (/proc/PID/stat; dead threads included)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def proc_wakeups(pid: int) -> int:
    """Return voluntary+involuntary context switches over pid's live threads."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{tid}/status") as fh,
            ):
                for line in fh:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
    return total


class Sampler:
    """Read /proc/PID/status every `interval` s in a thread; keep peak Threads and VmRSS."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.samples = 0
        self.peak_threads = 0
        self.peak_rss_kb = 0
        self.hwm_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            st = proc_status(self.pid)
            if st:
                self.samples += 1
                self.peak_threads = max(self.peak_threads, st.get("Threads", 0))
                self.peak_rss_kb = max(self.peak_rss_kb, st.get("VmRSS", 0))
                self.hwm_kb = max(self.hwm_kb, st.get("VmHWM", 0))
            if self._stop.wait(self.interval):
                return


def thread_table(pid: int) -> list[dict[str, int | str]]:
    """Return pid's live threads: tid, name (comm), utime and stime (ticks), voluntary and involuntary switches.

    The main thread (tid == pid) is named `loop`; other names lose a trailing `_N`, so
    that `io_0` and `io_1` add up under `io`.
    """
    rows: list[dict[str, int | str]] = []
    with contextlib.suppress(FileNotFoundError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            task = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{task}/comm") as fh:
                    comm = fh.read().strip()
                with open(f"{task}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                vol = invol = 0
                with open(f"{task}/status") as fh:
                    for line in fh:
                        if line.startswith("voluntary_ctxt_switches"):
                            vol = int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            invol = int(line.split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
            name = "loop" if int(tid) == pid else re.sub(r"_\d+$", "", comm)
            rows.append(
                {"tid": int(tid), "name": name, "utime": int(fields[11]), "stime": int(fields[12]),
                 "vol": vol, "invol": invol}
            )  # fmt: skip
    return rows


def process_ticks(pid: int) -> dict[str, int]:
    """Return utime, stime (every thread, ended ones included) and cutime, cstime (reaped children) in ticks."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return {"utime": int(f[11]), "stime": int(f[12]), "cutime": int(f[13]), "cstime": int(f[14])}


TICK_S = 1 / os.sysconf("SC_CLK_TCK")
