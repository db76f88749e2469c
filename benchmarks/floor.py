#!/usr/bin/env python3
"""The floor: a plain single-threaded Python loop that does a job's durable work and nothing more.

    python benchmarks/floor.py ROOT MAX_JOBS AGENT_ARGV...

For each order in ROOT/inbox/ (oldest first, by modification time then name) it keeps
the contract's folder layout, an SQLite ledger and every fsync, with at most MAX_JOBS
agents running at once:

- claim: read and parse the JSON order; one `INSERT` into the ledger (WAL,
  `synchronous=NORMAL`, one transaction); make active/<id>/ with `order.json` (a hard
  link of the dropped file, which then leaves inbox/), `work/order.json`, `job.json`,
  `attempts/1/stdout.log`, `attempts/1/stderr.log` and `attempts/1/attempt.json`;
  fsync the job folder and active/;
- start: `subprocess.Popen` of the agent (its program resolved once), in work/, with
  `DISPATCH_JOB_ID` and `DISPATCH_WORKSPACE`, stdout and stderr into the attempt's logs;
- finish (on `os.waitpid(-1)`): read and parse work/receipt.json, check its job id,
  status and outputs; write `result.json` staged (`.result.json.tmp`, fsync, rename);
  one `UPDATE` of the ledger; rename active/<id> into done/<id>; fsync done/.

No validation beyond that, no checks of the outputs, no log lines, no watcher: the least
a daemon with the same guarantees can do per job. At exit it prints one JSON line:
jobs, wall seconds, its own CPU and its agents' (user+sys seconds), and both's context
switches (voluntary+involuntary).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import time

ENV_KEYS = ("PATH", "HOME", "LANG")


def fsync_dir(path: str) -> None:
    """fsync a folder, so that the entries made or moved in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str, data: bytes) -> None:
    """Create path with data (no fsync)."""
    with open(path, "xb") as fh:
        fh.write(data)


def backlog(inbox: str) -> list[str]:
    """Return the order names in inbox/, oldest first (modification time, then name)."""
    entries = [e for e in os.scandir(inbox) if e.name.endswith(".json") and not e.name.startswith(".")]
    entries.sort(key=lambda e: (e.stat().st_mtime_ns, e.name))
    return [e.name for e in entries]


class Floor:
    """The loop's state: folders, the ledger, the agent's argv and the running agents."""

    def __init__(self, root: str, max_jobs: int, argv: list[str]) -> None:
        self.root = root
        self.inbox, self.active, self.done = (os.path.join(root, d) for d in ("inbox", "active", "done"))
        for d in (self.active, self.done, os.path.join(root, "state")):
            os.makedirs(d, exist_ok=True)
        self.max_jobs = max_jobs
        self.argv = [shutil.which(argv[0]) or argv[0], *argv[1:]]
        self.env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
        self.db = sqlite3.connect(os.path.join(root, "state", "ledger.sqlite3"), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, state TEXT NOT NULL, agent TEXT,"
            " claimed REAL, finished REAL, reason TEXT)"
        )
        self.running: dict[int, tuple[str, str, subprocess.Popen[bytes]]] = {}
        self.finished = 0

    def claim_and_start(self, name: str) -> None:
        """Claim one order and start its agent."""
        src = os.path.join(self.inbox, name)
        with open(src, "rb") as fh:
            raw = fh.read()
        order = json.loads(raw)
        job_id = order["job_id"]
        now = time.time()
        self.db.execute(
            "INSERT INTO jobs (job_id, state, agent, claimed) VALUES (?, 'active', ?, ?)", (job_id, order["to"], now)
        )
        job = os.path.join(self.active, job_id)
        work = os.path.join(job, "work")
        attempt = os.path.join(job, "attempts", "1")
        os.mkdir(job)
        os.link(src, os.path.join(job, "order.json"))
        os.unlink(src)
        os.mkdir(work)
        write(os.path.join(work, "order.json"), json.dumps(order).encode())
        write(
            os.path.join(job, "job.json"), json.dumps({"job_id": job_id, "agent": order["to"], "claimed": now}).encode()
        )
        os.makedirs(attempt)
        out = open(os.path.join(attempt, "stdout.log"), "xb")  # noqa: SIM115 - closed below
        err = open(os.path.join(attempt, "stderr.log"), "xb")  # noqa: SIM115 - closed below
        write(os.path.join(attempt, "attempt.json"), json.dumps({"attempt": 1, "started": now}).encode())
        fsync_dir(job)
        fsync_dir(self.active)
        env = {**self.env, "DISPATCH_JOB_ID": job_id, "DISPATCH_WORKSPACE": work}
        try:
            proc = subprocess.Popen(self.argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        finally:
            out.close()
            err.close()
        self.running[proc.pid] = (job_id, job, proc)

    def reap_one(self) -> None:
        """Wait for any agent to exit and finish its job."""
        pid, status = os.waitpid(-1, 0)
        job_id, job, proc = self.running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        work = os.path.join(job, "work")
        state, reason = "done", None
        try:
            with open(os.path.join(work, "receipt.json"), "rb") as fh:
                receipt = json.loads(fh.read())
            if proc.returncode != 0 or receipt.get("job_id") != job_id or receipt.get("status") != "done":
                state, reason = "failed", "bad receipt"
            for out in receipt.get("outputs", []):
                os.stat(os.path.join(work, out))
        except (OSError, ValueError) as exc:
            state, reason = "failed", str(exc)
        result = {"job_id": job_id, "state": state, "reason": reason, "exit_code": proc.returncode}
        staged = os.path.join(job, ".result.json.tmp")
        with open(staged, "xb") as fh:
            fh.write(json.dumps(result).encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(staged, os.path.join(job, "result.json"))
        self.db.execute(
            "UPDATE jobs SET state = ?, finished = ?, reason = ? WHERE job_id = ?", (state, time.time(), reason, job_id)
        )
        os.rename(job, os.path.join(self.done, job_id))
        fsync_dir(self.done)
        self.finished += 1

    def run(self) -> None:
        """Run every order in inbox/ (listed again until it is empty), at most max_jobs at once."""
        while names := backlog(self.inbox):
            for name in names:
                while len(self.running) >= self.max_jobs:
                    self.reap_one()
                self.claim_and_start(name)
        while self.running:
            self.reap_one()


def main() -> int:
    """Run the floor over ROOT/inbox/; print one JSON line of figures."""
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    floor = Floor(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    floor.run()
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "jobs": floor.finished,
                "wall_s": time.perf_counter() - t0,
                "cpu_s": me.ru_utime + me.ru_stime,
                "agents_cpu_s": kids.ru_utime + kids.ru_stime,
                "ctx": me.ru_nvcsw + me.ru_nivcsw,
                "agents_ctx": kids.ru_nvcsw + kids.ru_nivcsw,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
