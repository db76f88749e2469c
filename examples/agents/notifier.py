#!/usr/bin/env python3
"""Tell each Kopi & Crumb team which requests are theirs: the demo's third hop.

The assigner (with ``--handoff notifier``) hands it one order whose items are teams,
each with the ids of its ``requests``. It writes ``notices.md``, one short section per
team, and a receipt. Standard library only; nothing is sent anywhere.

    python3 examples/agents/notifier.py /path/to/work/order.json

Exit status: 0 when it ran (the receipt says done), 1 when there is no order ("STOP").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """Write notices.md and the receipt for the order in argv[1] (or $DISPATCH_ORDER)."""
    order_path = Path(argv[1] if len(argv) > 1 else os.environ.get("DISPATCH_ORDER", "order.json"))
    workspace = Path(os.environ.get("DISPATCH_WORKSPACE") or ".")
    if not order_path.is_file():
        print(f"notifier: STOP no order at {order_path}; nothing written")
        return 1
    order = json.loads(order_path.read_text(encoding="utf-8"))
    lines = [f"# Requests by team ({order['job_id']})", ""]
    for item in order["items"]:
        lines += [f"## {item['id']}", *[f"- {r}" for r in item.get("requests", [])], ""]
    (workspace / "notices.md").write_text("\n".join(lines), encoding="utf-8")
    ids = [item["id"] for item in order["items"]]
    receipt = {"job_id": order["job_id"], "input_ids": ids, "output_ids": [], "status": "done"}
    receipt["outputs"] = ["notices.md"]
    tmp = workspace / ".receipt.json.tmp"
    tmp.write_text(json.dumps(receipt) + "\n", encoding="utf-8")
    os.replace(tmp, workspace / "receipt.json")
    print(f"notifier: {order['job_id']}: {len(ids)} teams told")
    print(json.dumps({"type": "result", "is_error": False, "result": f"{len(ids)} teams", "total_cost_usd": 0}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
