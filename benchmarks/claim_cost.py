#!/usr/bin/env python3
"""Time the claim path (inspect, ledger claim, job folder) hot and after an idle gap.

    .venv/bin/python benchmarks/claim_cost.py [--n 60] [--gap 0.02] [--tmp DIR]

Runs the daemon's own functions in one thread, with no agent and no watcher, on a
fresh dispatch root: first back to back (hot), then with ``--gap`` seconds of idle
time before each order, as an idle daemon sees single drops. The difference is what
the machine charges for waking up (CPU idle states, caches, a virtual CPU being
rescheduled), not work the code does. Prints p50 and p90 per step, in ms.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dispatcher import claim
from dispatcher.config import build_config
from dispatcher.layout import Layout
from dispatcher.ledger import Ledger

STEPS = ("inspect", "ledger claim", "job folder")


def run(root: Path, n: int, gap_s: float) -> list[tuple[float, float, float]]:
    """Claim n orders, sleeping gap_s before each; return per-step seconds."""
    cfg = build_config({"agents": {"bench": {"command": ["true"], "writes": ["out.csv"]}}}, None, root=root)
    layout = Layout(cfg.root)
    layout.create()
    ledger = Ledger(layout.ledger)
    out = []
    for i in range(n):
        name = f"C{i:05d}.json"
        body = {"job_id": f"C{i:05d}", "from": "b", "to": "bench", "task": "t", "items": [{"id": "R1"}]}
        (layout.inbox / name).write_text(json.dumps(body))
        time.sleep(gap_s)
        t0 = time.perf_counter()
        item = claim.inspect(layout, name, cfg)
        t1 = time.perf_counter()
        assert isinstance(item, claim.Inspected)
        got = claim.take_claim(ledger, layout, item, "bench", lambda owner: True)
        t2 = time.perf_counter()
        claim.build_job(layout, item, cfg.agents["bench"], got, "bench")
        t3 = time.perf_counter()
        out.append((t1 - t0, t2 - t1, t3 - t2))
    ledger.close()
    return out[n // 6 :]  # drop the warm-up


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--n", type=int, default=60, help="orders per run (default 60)")
    ap.add_argument("--gap", type=float, default=0.02, help="idle seconds before each order (default 0.02)")
    ap.add_argument("--tmp", help="where to make the dispatch roots (default $TMPDIR)")
    args = ap.parse_args()
    print(f"{'step':<14}{'hot p50':>10}{'hot p90':>10}{'idle p50':>11}{'idle p90':>11}   (ms)")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        hot = run(Path(tmp) / "hot", args.n, 0.0)
        idle = run(Path(tmp) / "idle", args.n, args.gap)
    for k, step in enumerate(STEPS):
        h = sorted(r[k] * 1000 for r in hot)
        c = sorted(r[k] * 1000 for r in idle)
        row = (h[len(h) // 2], h[len(h) * 9 // 10], c[len(c) // 2], c[len(c) * 9 // 10])
        print(f"{step:<14}" + "".join(f"{v:>10.2f} " for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
