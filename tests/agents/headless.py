#!/usr/bin/env python3
"""A stand-in for a headless agent CLI (`claude -p`, `codex exec`) at work, for section 14's tests.

It does the job right (``out.csv`` with one row per item, ``receipt.json``) and
prints the CLI's final JSON (``"type": "result"`` with ``session_id`` and
``total_cost_usd``), unless a *plan* file says otherwise. The plan (``--plan
FILE``, outside the dispatch root) is a JSON object read and updated under a
lock, so that jobs running at once share it:

- ``"limit": {"times": N, "stdout": TEXT, "stderr": TEXT, "exit": 1, "hang_s": S}``: the next N
  starts print exactly what the real CLI prints at a usage limit, and exit (after S seconds);
- ``"limit_on_start": {"n": N, "after_s": S}``: the N-th start of all (counted in
  ``--count``) prints Claude's ``Claude AI usage limit reached|<now + S>`` and exits 1;
- ``"work_s"``: take this long over the job (quietly);
- ``"silent_s"``: sleep this long first, printing nothing (an idle agent);
- ``"busy_s"``: work this long, printing a line every 0.5 s (a busy one);
- ``"quiet_work_s"``: work this long printing nothing, writing a file every 0.5 s;
- ``"cost_usd"``: the cost each run reports (default 0.01); with ``--resume SID``
  the CLI reports the session's running total: the previous total plus this.

Every start is appended to ``--count FILE`` (``job_id attempt pid``) and the
argv to ``--argv-log FILE`` when given.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any


def update_plan(path: Path, fn: Any) -> Any:
    """Read the plan, let fn change it, write it back; all under an exclusive lock; return fn's answer."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        plan = json.loads(path.read_text()) if path.exists() else {}
        answer = fn(plan)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        os.rename(tmp, path)
        return answer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count")
    p.add_argument("--plan")
    p.add_argument("--argv-log")
    p.add_argument("--resume", help="the session to go on with (as `claude -p --resume SID`)")
    args = p.parse_args()
    job_id = os.environ["DISPATCH_JOB_ID"]
    attempt = os.environ["DISPATCH_ATTEMPT"]
    if args.count:
        with open(args.count, "a") as f:
            f.write(f"{job_id} {attempt} {os.getpid()}\n")
    if args.argv_log:
        with open(args.argv_log, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    plan_path = Path(args.plan) if args.plan else None
    plan = update_plan(plan_path, dict) if plan_path is not None else {}

    if plan_path is not None:

        def take_limit(plan: dict[str, Any]) -> dict[str, Any] | None:
            limit = plan.get("limit")
            if limit and limit.get("times", 0) > 0:
                limit["times"] -= 1
                return dict(limit)
            return None

        limit = update_plan(plan_path, take_limit)
        if limit is not None:
            if limit.get("stdout"):
                sys.stdout.write(limit["stdout"] + "\n")
            if limit.get("stderr"):
                sys.stderr.write(limit["stderr"] + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(float(limit.get("hang_s", 0)))  # a CLI that prints its limit, then hangs
            return int(limit.get("exit", 1))

    on_start = plan.get("limit_on_start")
    if on_start and args.count:
        starts = len(Path(args.count).read_text().splitlines())
        if starts == int(on_start["n"]):
            until = int(time.time() + float(on_start["after_s"]))
            text = f"Claude AI usage limit reached|{until}"
            result = {"type": "result", "subtype": "success", "is_error": True, "result": text,
                      "session_id": str(uuid.uuid4()), "total_cost_usd": 0}  # fmt: skip
            print(json.dumps(result), flush=True)
            return 1
    if plan.get("work_s"):
        time.sleep(float(plan["work_s"]))
    if plan.get("silent_s"):
        time.sleep(float(plan["silent_s"]))
    quiet = float(plan.get("quiet_work_s") or 0)  # silent, but changing files in its folder
    end = time.monotonic() + quiet
    k = 0
    while time.monotonic() < end:
        Path(f"notes-{k % 3}.txt").write_text(f"step {k}\n")
        k += 1
        time.sleep(0.5)
    busy = float(plan.get("busy_s") or 0)
    end = time.monotonic() + busy
    while time.monotonic() < end:
        print(f"working on {job_id}", flush=True)
        time.sleep(0.5)

    order = json.loads(Path(os.environ["DISPATCH_ORDER"]).read_text())
    ids = [i["id"] for i in order["items"]]
    output = (order.get("accept") or {}).get("output")
    if output:
        Path(output).write_text("id,team\n" + "".join(f"{i},core\n" for i in ids))
    receipt = {"job_id": job_id, "input_ids": ids, "output_ids": ids if output else [], "status": "done"}
    Path(".receipt.tmp").write_text(json.dumps(receipt))
    os.rename(".receipt.tmp", "receipt.json")

    cost = float(plan.get("cost_usd", 0.01))
    session = args.resume or str(uuid.uuid4())
    total = cost
    if args.resume and plan_path is not None:

        def running_total(plan: dict[str, Any]) -> float:
            totals = plan.setdefault("sessions", {})
            totals[session] = round(totals.get(session, 0.0) + cost, 10)
            return float(totals[session])

        total = update_plan(plan_path, running_total)
    elif plan_path is not None:
        update_plan(plan_path, lambda plan: plan.setdefault("sessions", {}).__setitem__(session, cost))
    result = {
        "type": "result",
        "subtype": "success",
        "is_error": False,
        "duration_ms": 12,
        "num_turns": 1,
        "result": "done",
        "session_id": session,
        "total_cost_usd": total,
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
