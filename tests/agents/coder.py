#!/usr/bin/env python3
"""A coding agent for the workspace tests: edits files in its folder (the worktree), maybe commits.

Every start is appended to ``--count`` (``job_id attempt pid``), its folder to ``<count>.cwd``. ``--write PATH=TEXT``
writes a file (relative to the working folder, or absolute); ``--append PATH=TEXT``
appends a line; ``--try-write PATH`` tries to write and records in ``--report`` whether
it could (a sandbox test); ``--connect PORT`` tries 127.0.0.1:PORT and records the
outcome; ``--symlink PATH=TARGET``, ``--hardlink PATH=TARGET`` and ``--fifo PATH`` make
a link or a FIFO; ``--commit`` commits its changes; ``--git ARGS`` then runs ``git ARGS`` in
its folder and records in ``--report`` whether git succeeded; ``--sleep S`` sleeps first,
``--sleep-after S`` after the report. It then writes its receipt to $DISPATCH_RECEIPT.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count")
    p.add_argument("--write", action="append", default=[])
    p.add_argument("--append", action="append", default=[])
    p.add_argument("--binary", action="append", default=[], help="write 256 bytes 0..255 to this path")
    p.add_argument("--try-write", action="append", default=[])
    p.add_argument("--symlink", action="append", default=[])
    p.add_argument("--hardlink", action="append", default=[])
    p.add_argument("--fifo", action="append", default=[])
    p.add_argument("--remove", action="append", default=[], help="unlink this path last (its worktree's .git, say)")
    p.add_argument("--connect", type=int)
    p.add_argument("--report")
    p.add_argument("--commit", action="store_true")
    p.add_argument("--git", action="append", default=[], help="git arguments to run after the commit")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--sleep-after", type=float, default=0.0)
    p.add_argument("--sleep-first", type=float, default=0.0, help="sleep this long in attempt 1 only")
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--fail-first", metavar="PATH", help="attempt 1 writes PATH and exits 1; later ones report it")
    p.add_argument("--handoff", metavar="AGENT", help="hand off <job_id>-next to AGENT with base: parent")
    p.add_argument("--session", help="end with the final JSON line of a headless CLI naming this session_id")
    p.add_argument("--resumed", help="the session resumed (the agent's resume argv passes it)")
    a = p.parse_args()
    job = os.environ["DISPATCH_JOB_ID"]
    if a.count:
        with open(a.count, "a") as f:
            f.write(f"{job} {os.environ['DISPATCH_ATTEMPT']} {os.getpid()}\n")
        with open(a.count + ".cwd", "a") as f:
            f.write(f"{job} {os.environ['DISPATCH_ATTEMPT']} {os.getcwd()}\n")
    time.sleep(a.sleep + (a.sleep_first if os.environ["DISPATCH_ATTEMPT"] == "1" else 0))
    report: dict[str, str] = {}
    for spec in a.write + a.append:
        path, _, text = spec.partition("=")
        path = path.replace("{job}", job)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a" if spec in a.append else "w") as f:
            f.write(text.replace("{job}", job) + "\n")
    for spec in a.symlink + a.hardlink:
        path, _, target = spec.partition("=")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        (os.symlink if spec in a.symlink else os.link)(target, path)
    for path in a.fifo:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    for path in a.binary:
        Path(path).write_bytes(bytes(range(256)))
    for path in a.try_write:
        try:
            Path(path).write_text("stray\n")
            report[path] = "written"
        except OSError as exc:
            report[path] = exc.strerror or str(exc)
    if a.connect:
        try:
            socket.create_connection(("127.0.0.1", a.connect), timeout=2).close()
            report["connect"] = "connected"
        except OSError as exc:
            report["connect"] = exc.strerror or str(exc)
    if a.fail_first:
        if os.environ["DISPATCH_ATTEMPT"] == "1":
            Path(a.fail_first).write_text("first attempt\n")
            return _said(a, 1)
        report["fail_first"] = "present" if os.path.exists(a.fail_first) else "absent"
    if a.commit:
        subprocess.run(["git", "add", "-A"], check=True)
        subprocess.run(["git", "commit", "-q", "-m", f"{job}: work"], check=True)
    for args in a.git:
        done = subprocess.run(["git", *shlex.split(args)], capture_output=True, check=False)
        report[f"git {args}"] = "ok" if done.returncode == 0 else "failed"
    if a.report:
        Path(a.report).write_text(json.dumps(report))
    time.sleep(a.sleep_after)
    order = json.loads(Path(os.environ["DISPATCH_ORDER"]).read_text())
    if a.handoff:
        outbox = Path(os.environ["DISPATCH_ORDER"]).parent / "outbox"
        outbox.mkdir(exist_ok=True)
        nxt = {"job_id": f"{job}-next", "from": order["to"], "to": a.handoff, "task": "Go on.", "items": order["items"]}
        (outbox / f"{job}-next.json").write_text(json.dumps(nxt | {"base": "parent"}))
    ids = [i["id"] for i in order["items"]]
    receipt = {"job_id": job, "input_ids": ids, "output_ids": [], "status": "done", "outputs": []}
    for path in a.remove:
        os.unlink(path)
    Path(os.environ["DISPATCH_RECEIPT"]).write_text(json.dumps(receipt))
    return _said(a, a.exit)


def _said(a: argparse.Namespace, code: int) -> int:
    """Print the final JSON line a headless CLI prints (with --session), then return code."""
    if a.session:
        print(json.dumps({"type": "result", "session_id": a.session, "total_cost_usd": 0.01}))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
