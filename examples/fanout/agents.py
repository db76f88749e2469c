#!/usr/bin/env python3
"""Three deterministic agents for the fan-out and join example: plan, research, merge.

    agents.py plan      hands one `research` order per topic, and one `merge` order that waits
                        for all of them (`after`), to the daemon through work/outbox/
    agents.py research  writes notes.json: one note per item of its order
    agents.py merge PARENTS_JSON
                        reads each parent's notes.json through parents.json, writes summary.json

Each writes work/receipt.json. No network, no API key: the point is the flow.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def receipt(order: dict, outputs: list[str], output_ids: list[str]) -> None:
    ids = [item["id"] for item in order["items"]]
    body = {"job_id": order["job_id"], "input_ids": ids, "output_ids": output_ids, "status": "done", "outputs": outputs}
    Path("receipt.json").write_text(json.dumps(body))


def plan(order: dict) -> None:
    topics = [item["id"] for item in order["items"]]
    outbox = Path("outbox")
    outbox.mkdir(exist_ok=True)
    parts = []
    for topic in topics:
        job_id = f"{order['job_id']}.{topic}"
        parts.append(job_id)
        body = {
            "job_id": job_id,
            "from": "planner",
            "to": "researcher",
            "task": f"Research {topic}.",
            "items": [{"id": topic}],
            "accept": {"output": "notes.json", "required": ["note"]},
        }
        (outbox / f"{job_id}.json").write_text(json.dumps(body))
    merge = {
        "job_id": f"{order['job_id']}.merge",
        "from": "planner",
        "to": "merger",
        "task": "Merge the notes of every topic.",
        "items": [{"id": t} for t in topics],
        "after": parts,
        "accept": {"output": "summary.json"},
    }
    (outbox / f"{merge['job_id']}.json").write_text(json.dumps(merge))
    receipt(order, [], [])


def research(order: dict) -> None:
    notes = [{"id": i["id"], "note": f"{i['id']}: three facts found"} for i in order["items"]]
    Path("notes.json").write_text(json.dumps(notes))
    receipt(order, ["notes.json"], [n["id"] for n in notes])


def merge(order: dict, parents_path: str) -> None:
    summary = []
    for parent in json.loads(Path(parents_path).read_text()):
        notes = json.loads((Path(parent["path"]) / "work" / "notes.json").read_text())
        summary += [
            {"id": n["id"], "from": parent["job_id"], "state": parent["state"], "note": n["note"]} for n in notes
        ]
    Path("summary.json").write_text(json.dumps(summary, indent=2))
    receipt(order, ["summary.json"], [s["id"] for s in summary])


def main() -> int:
    order = json.loads(Path(os.environ["DISPATCH_ORDER"]).read_text())
    role = sys.argv[1]
    if role == "plan":
        plan(order)
    elif role == "research":
        research(order)
    else:
        merge(order, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
