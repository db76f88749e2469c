"""What one fsync costs the process that asks for it, on the folder's filesystem.

A job's durable steps are fsyncs of files and folders (README, "The states, and what is
written at each step"). On a journalling filesystem the first fsync after a change commits
the journal, and the fsyncs right after it, with nothing new to commit, cost little; so
what a job pays is about one commit per group of fsyncs, not one per fsync. This prints,
per operation, the CPU of this process and the wall time, in a fresh folder under
``--tmp``, beside the create alone as the baseline::

    .venv/bin/python benchmarks/fsync_cost.py [--tmp /tmp] [--n 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable


def timed(n: int, step: Callable[[int], None]) -> tuple[float, float]:
    """Return (CPU us, wall us) per call of step(i), i in range(n)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(n):
        step(i)
    return (time.process_time() - cpu0) / n * 1e6, (time.perf_counter() - wall0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tmp", default="/tmp", help="make the fresh folder under this one (default /tmp)")
    ap.add_argument("--n", type=int, default=300, help="calls of each operation (default 300)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dispatcher-fsync-", dir=args.tmp)
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    data = b"x" * 200

    def make(prefix: str, i: int, sync: bool) -> None:
        fd = os.open(f"{root}/{prefix}{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        if sync:
            os.fsync(fd)
        os.close(fd)

    def file_then_folder(i: int) -> None:
        make("c", i, True)
        os.fsync(folder)

    def mkdir_then_folder(i: int) -> None:
        os.mkdir(f"{root}/m{i}")
        os.fsync(folder)

    rows = [
        ("create + write 200 B (baseline)", lambda i: make("a", i, False)),
        ("the same + fsync of the file", lambda i: make("b", i, True)),
        ("the same + fsync of its folder right after", file_then_folder),
        ("fsync of a folder with nothing new", lambda i: os.fsync(folder)),
        ("mkdir + fsync of its folder", mkdir_then_folder),
    ]
    try:
        base = None
        print(f"fresh folder {root}, {args.n} calls each; CPU of this process and wall, per call")
        for label, step in rows:
            cpu, wall = timed(args.n, step)
            base = base or cpu
            print(f"  {label:46} {cpu:9.1f} us CPU {wall:9.1f} us wall  {cpu / base:6.2f} x")
    finally:
        os.close(folder)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
