"""An overnight-style run, shortened: 50 jobs of one headless agent that meets a usage limit at job 20.

    .venv/bin/python benchmarks/overnight.py [--jobs 50] [--limit-at 20] [--reset-s 30]

The agent is ``tests/agents/headless.py`` (a stand-in for `claude -p --output-format
json`): it does each job, reports 0.01 USD, and on the 20th start of all prints exactly
what Claude Code prints at a usage limit, ``Claude AI usage limit reached|<epoch>``
with a reset 30 s later, and exits 1. The agent has ``limits: [{preset: claude}]``, a
check of its own (``rows``: the output has one row per item), ``max_attempts: 1`` and
is not retry-safe: any attempt that counted would fail its job. The real daemon runs
``dispatcher run --once`` on a fresh root; the script prints what a person would check
the next morning, and exits 1 unless every job is done and no attempt was spent on the
limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
HEADLESS = REPO / "tests" / "agents" / "headless.py"
ROWS_CHECK = (
    "import csv, json; o = json.load(open('order.json')); rows = list(csv.DictReader(open('out.csv')));"
    " ok = sorted(r['id'] for r in rows) == sorted(i['id'] for i in o['items']);"
    " print(f'{len(rows)} rows'); raise SystemExit(0 if ok else 1)"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--limit-at", type=int, default=20, help="the start that meets the usage limit")
    p.add_argument("--reset-s", type=float, default=30.0, help="seconds from the limit to its reset")
    p.add_argument("--work-s", type=float, default=0.2, help="seconds each job takes")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="overnight-") as tmp:
        return run(Path(tmp), args)


def run(tmp: Path, args: argparse.Namespace) -> int:
    root, starts, plan = tmp / "dispatch", tmp / "starts.txt", tmp / "plan.json"
    root.mkdir()
    plan.write_text(
        json.dumps({"limit_on_start": {"n": args.limit_at, "after_s": args.reset_s}, "work_s": args.work_s})
    )
    config = {
        "root": str(root),
        "max_jobs": 2,
        "settle": 0.2,
        "log_file": str(tmp / "dispatcher.log"),
        "agents": {
            "claude": {
                "command": [sys.executable, str(HEADLESS), "--count", str(starts), "--plan", str(plan)],
                "timeout": 120,
                "concurrency": 2,
                "max_attempts": 1,
                "writes": ["out.csv"],
                "limits": [{"preset": "claude"}],
                "checks": [{"name": "rows", "command": [sys.executable, "-c", ROWS_CHECK], "timeout": 30}],
            }
        },
    }
    cfg = tmp / "dispatcher.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DISPATCHER_CONFIG", None)
    (root / "inbox").mkdir()
    for i in range(1, args.jobs + 1):
        order = {
            "job_id": f"NIGHT-{i:03d}",
            "from": "planner",
            "to": "claude",
            "task": "Assign each request to a team.",
            "items": [{"id": f"R{k}"} for k in range(1, 4)],
            "accept": {"output": "out.csv"},
        }
        (root / "inbox" / f".NIGHT-{i:03d}.tmp").write_text(json.dumps(order))
        os.rename(root / "inbox" / f".NIGHT-{i:03d}.tmp", root / "inbox" / f"NIGHT-{i:03d}.json")
    began = time.monotonic()
    daemon = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(cfg), "run", "--once"],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=args.reset_s + 600,
    )  # fmt: skip
    wall = time.monotonic() - began
    events = [json.loads(line) for line in (tmp / "dispatcher.log").read_text().splitlines() if line.startswith("{")]
    report = summarise(root, events, starts, wall, daemon.returncode)
    print(json.dumps(report, indent=2))
    listed = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(cfg), "logs", "--job", report["limited_job"] or "-"],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    print("\n$ dispatcher logs --job", report["limited_job"])
    print(listed.stdout.rstrip())
    ok = report["done"] == args.jobs and report["failed"] == 0 and report["attempts_counted"] == args.jobs
    return 0 if ok and report["daemon_exit"] == 0 else 1


def summarise(root: Path, events: list[dict[str, Any]], starts: Path, wall: float, code: int) -> dict[str, Any]:
    """Return the figures a person checks in the morning."""
    results = [json.loads(p.read_text()) for p in sorted(root.glob("*/*/result.json"))]
    attempts = [a for r in results for a in r["attempts"]]
    limited = [a for a in attempts if "limited" in a]
    limited_job = next((r["job_id"] for r in results for a in r["attempts"] if "limited" in a), None)
    gated = [e for e in events if e["event"] == "agent.gated"]
    resumed = [e for e in events if e["event"] == "agent.resumed"]
    started = [e for e in events if e["event"] == "agent.started"]
    gate_from = _t(gated[0]["timestamp"]) if gated else None
    gate_to = _t(limited[0]["limited"]["until"]) if limited else None
    during = [e for e in started if gate_from and gate_to and gate_from < _t(e["timestamp"]) < gate_to]
    return {
        "jobs": len(results),
        "done": sum(r["state"] == "done" for r in results),
        "failed": sum(r["state"] == "failed" for r in results),
        "attempts_run": len(attempts),
        "attempts_limited": len(limited),
        "attempts_counted": len(attempts) - len(limited),
        "limited_job": limited_job,
        "limit_text": limited[0]["limited"]["text"] if limited else None,
        "wait_s": limited[0]["limited"]["wait_s"] if limited else None,
        "agent_gated": len(gated),
        "agent_resumed": len(resumed),
        "job_waiting": sum(e["event"] == "job.waiting" for e in events),
        "attempts_started_while_gated": len(during),  # between agent.gated and the reset time
        "user_checks_passed": sum(1 for r in results for c in r["checks"] if c["name"] == "rows" and c["ok"] is True),
        "cost_usd": round(sum(r.get("cost_usd") or 0 for r in results), 6),
        "agent_starts": len(starts.read_text().splitlines()),
        "wall_s": round(wall, 1),
        "daemon_exit": code,
    }


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":
    sys.exit(main())
