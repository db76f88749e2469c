#!/usr/bin/env python3
"""Assign each Kopi & Crumb request to one team and draft a next step for a person.

The assigner agent of the bundled demo: deterministic keyword rules, standard library
only, no network. The daemon runs it with the job's ``work/`` folder as its directory::

    python3 examples/agents/assigner.py /path/to/work/order.json

Input
    The order is the validated order JSON: ``argv[1]``, else ``$DISPATCH_ORDER``, else
    ``./order.json``. Each item needs a ``summary`` (or a ``text``); ``customer`` and
    ``order`` make the drafted next step more precise. The output file is the order's
    ``accept.output`` (default ``assignments.csv``), its id column ``accept.key`` (default
    ``id``), and a team must be in ``accept.allowed.team`` when the order lists teams.

Output (in the work folder, ``$DISPATCH_WORKSPACE`` or the current directory)
    ``assignments.csv`` with the header ``id,team,next_step`` and one row per item, then
    ``receipt.json`` (``$DISPATCH_RECEIPT``) with ``status: done``. The rules never guess:
    when any item matches no rule, it writes no csv and a receipt with ``status: failed``
    and a ``reason`` naming those items. The next step is a draft for a person; nothing is
    sent to a customer.

With ``--handoff AGENT`` it also hands the result on: one follow-up order in
``outbox/<job_id>.notify.json`` for AGENT, with one item per team listing that team's
requests (the demo's notifier tells each team what is theirs).

Stdout: one line for a person, then one JSON object (the shape headless agent CLIs print),
which the daemon records in ``result.json``.

Exit status: 0 when it ran to the end (the receipt says whether the work is done, so a
deterministic failure is not retried), 1 when there is no order to read ("STOP", nothing
is written), 2 on bad usage.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# First match wins, so the specific rules come before the broad ones. `{order}` becomes
# "order KC-1042" (or "the order"), `{customer}` the customer's name.
RULES: list[tuple[str, str, str]] = [
    (
        "payments",
        r"charged (?:me )?(?:twice|two times)|double[- ]charg|duplicate charge",
        "Review the duplicate card charge against the customer's receipt and start a refund "
        "for the extra charge; draft a reply to {customer}",
    ),
    (
        "payments",
        r"\brefund|\bcard\b|\bpayment|\bcharg|\bovercharg",
        "Check the payment record and draft a reply to {customer} explaining what happened",
    ),
    (
        "bakery",
        r"gluten[- ]free",
        "Check gluten-free cake options and lead time for the date asked; draft a reply to {customer} with options",
    ),
    (
        "bakery",
        r"\bcakes?\b|\bpastr|\bcroissant|\bbak(?:e|ed|ery)\b|\bbread\b",
        "Check what the bakery can make and its lead time; draft a reply to {customer} with options",
    ),
    (
        "store-hours",
        r"\bopen(?:ed|s|ing)?\b.*\blate\b|\bclosed\b.*\bearly\b"
        r"|\bopening (?:hours|times?)\b|\bhours\b",
        "Verify the posted opening hours against the actual opening time and correct the "
        "website if needed; draft an apology to {customer}",
    ),
    (
        "orders",
        r"\bpick ?-?up\b|\bcollection\b|\breschedul",
        "Check {order} and whether the new pickup time fits availability; "
        "draft a confirmation of the time change to {customer}",
    ),
    (
        "orders",
        r"\bwithout\b|\bmissing\b|\bforgot|\bleft out\b|\bwrong item",
        "Check {order} contents and confirm what was left out; offer {customer} to add it or refund the item",
    ),
    (
        "orders",
        r"\border\b|\bKC-\d+\b|\bdeliver",
        "Check {order} and draft a reply to {customer}",
    ),
]
COMPILED = [(team, re.compile(pattern, re.IGNORECASE), step) for team, pattern, step in RULES]
DEFAULT_OUTPUT = "assignments.csv"


def assign(item: dict[str, Any], allowed: list[str] | None) -> tuple[str, str] | None:
    """Return (team, next_step) for one item, or None when no rule may handle it."""
    text = item.get("summary") or item.get("text")
    if not isinstance(text, str) or not text.strip():
        return None
    number = item.get("order")
    words = {
        "customer": item.get("customer") or "the customer",
        "order": f"order {number}" if number else "the order",
    }
    for team, pattern, step in COMPILED:
        if pattern.search(text) and (allowed is None or team in allowed):
            return team, step.format(**words)
    return None


def write_atomic(path: Path, text: str) -> None:
    """Write text through a hidden temporary name and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def hand_off(workspace: Path, job_id: str, to: str, rows: list[dict[str, str]], key: str) -> None:
    """Write one follow-up order for `to`: an item per team with the ids of its requests."""
    teams: dict[str, list[str]] = {}
    for row in rows:
        teams.setdefault(row["team"], []).append(row[key])
    followup = {
        "job_id": f"{job_id}.notify"[-128:].lstrip("._-") or "notify",
        "from": "assigner",
        "to": to,
        "task": "Tell each team which requests are theirs.",
        "items": [{"id": team, "requests": ids} for team, ids in sorted(teams.items())],
    }
    write_atomic(workspace / "outbox" / f"{job_id}.notify.json", json.dumps(followup, indent=2) + "\n")


def run(order_path: Path, workspace: Path, receipt_path: Path, handoff: str | None = None) -> dict[str, Any]:
    """Do the assigner's work for one order; return a summary (``ok``, ``message``, rows)."""
    order = json.loads(order_path.read_text(encoding="utf-8"))
    job_id = order["job_id"]
    ids = [item["id"] for item in order["items"]]
    accept = order.get("accept") or {}
    output = accept.get("output") or DEFAULT_OUTPUT
    key = accept.get("key") or "id"
    allowed = (accept.get("allowed") or {}).get("team")
    receipt: dict[str, Any] = {"job_id": job_id, "input_ids": ids, "output_ids": []}

    rows, unhandled = [], []
    for item in order["items"]:
        found = assign(item, allowed)
        if found is None:
            unhandled.append(item["id"])
        else:
            rows.append({key: item["id"], "team": found[0], "next_step": found[1]})
    reason = None
    if unhandled:
        reason = f"no rule assigns {', '.join(unhandled)} to an allowed team; wrote no rows"
    elif not output.endswith(".csv"):
        reason = f"accept.output must be a .csv file, got {output}"
    if reason:
        receipt |= {"status": "failed", "outputs": [], "reason": reason}
        write_atomic(receipt_path, json.dumps(receipt) + "\n")
        return {"ok": False, "job_id": job_id, "message": f"failed: {reason}", "rows": []}

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[key, "team", "next_step"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(workspace / output, buf.getvalue())
    if handoff:
        hand_off(workspace, job_id, handoff, rows, key)
    receipt |= {"output_ids": [r[key] for r in rows], "status": "done", "outputs": [output]}
    write_atomic(receipt_path, json.dumps(receipt) + "\n")
    counts = Counter(r["team"] for r in rows)
    message = f"{len(rows)} requests assigned: " + ", ".join(f"{n} {t}" for t, n in counts.items())
    return {"ok": True, "job_id": job_id, "message": message, "rows": rows}


def main(argv: list[str]) -> int:
    """Run the agent as the daemon does and print its two stdout lines."""
    handoff = None
    if len(argv) >= 3 and argv[-2] == "--handoff":
        handoff, argv = argv[-1], argv[:-2]
    if len(argv) > 2:
        print("usage: assigner.py [ORDER_JSON] [--handoff AGENT]", file=sys.stderr)
        return 2
    order_path = Path(argv[1] if len(argv) == 2 else os.environ.get("DISPATCH_ORDER", "order.json"))
    workspace = Path(os.environ.get("DISPATCH_WORKSPACE") or ".")
    receipt_path = Path(os.environ.get("DISPATCH_RECEIPT") or workspace / "receipt.json")
    job_id = os.environ.get("DISPATCH_JOB_ID", "")
    stop = not order_path.is_file()
    if stop:
        # The seed's receiver: no handoff, no guessing. Write nothing and say STOP.
        print(f"assigner: STOP no order at {order_path}; nothing written")
        summary = {"type": "result", "is_error": True, "result": f"STOP no {order_path.name}."}
    else:
        outcome = run(order_path, workspace, receipt_path, handoff)
        job_id = outcome["job_id"] or job_id
        print(f"assigner: {job_id}: {outcome['message']}")
        summary = {"type": "result", "is_error": not outcome["ok"], "result": outcome["message"]}
    summary |= {"num_turns": 1, "total_cost_usd": 0, "session_id": f"local-{job_id}" if job_id else "local"}
    print(json.dumps(summary, ensure_ascii=False))
    return 1 if stop else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
