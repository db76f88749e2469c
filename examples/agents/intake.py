#!/usr/bin/env python3
"""Read Kopi & Crumb customer messages and hand them to the assigner as a follow-up order.

The intake agent of the bundled demo: deterministic, standard library only, no network.
The daemon runs it with the job's ``work/`` folder as its directory::

    python3 examples/agents/intake.py /path/to/work/order.json

Input
    The order is the validated order JSON: ``argv[1]``, else ``$DISPATCH_ORDER``, else
    ``./order.json``. Each item is one customer message: ``id``, ``customer``, ``text`` and
    an optional ``order`` number. An item that carries only an ``id`` is looked up by id in
    the messages file named by ``meta.messages``: a relative path inside the ``examples/``
    folder this script belongs to, such as ``kopi/messages.json``. Orders are untrusted
    input, so an absolute path or a ``..`` segment there is refused.

Output (in the work folder, ``$DISPATCH_WORKSPACE`` or the current directory)
    ``outbox/<job_id>.assign.json``: one follow-up order ``to: assigner``, ``from:`` this
    agent's own name (the order's ``to``), one item per message (``id``, ``customer``,
    ``summary``, ``order``), the accept rules for ``assignments.csv`` and ``writes``. It
    never sets ``parent`` or ``hops``: the daemon writes the lineage when it releases the
    follow-up. Then ``receipt.json`` (``$DISPATCH_RECEIPT``): ``status: done`` and
    ``output_ids`` = the ids handed on, or ``status: failed`` with a ``reason``.

    ``meta: {skip_handoff: true}`` writes the receipt but no follow-up. The demo uses it to
    play the seed's second failure: a sender that claims to be done without a handoff.

Stdout: one line for a person, then one JSON object (the shape headless agent CLIs print),
which the daemon records in ``result.json``.

Exit status: 0 when it ran to the end (the receipt says whether the work is done, so a
deterministic failure is not retried), 1 when there is no order to read (nothing is
written), 2 on bad usage.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent
NEXT_AGENT = "assigner"
TEAMS = ["orders", "payments", "bakery", "store-hours"]
TASK = "Assign each request to one team: orders, payments, bakery or store-hours."
OUTPUT = "assignments.csv"
SUFFIX = ".assign"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ORDER_NO = re.compile(r"\bKC-\d+\b")
SENTENCE_END = re.compile(r"(?<=[.?!])\s+")
MAX_SUMMARY = 160


class Refusal(Exception):
    """The order cannot be handled; the message goes into the receipt's reason."""


def followup_id(job_id: str) -> str:
    """Return the follow-up's job id: ``<job_id>.assign``, cut to stay a valid id."""
    new = job_id[: 128 - len(SUFFIX)] + SUFFIX
    if not JOB_ID.fullmatch(new):
        raise Refusal(f"cannot derive a follow-up job id from {job_id!r}")
    return new


def summarize(text: str) -> str:
    """Return the first sentence of a message, cut to MAX_SUMMARY characters."""
    first = SENTENCE_END.split(" ".join(text.split()), maxsplit=1)[0]
    return first if len(first) <= MAX_SUMMARY else first[: MAX_SUMMARY - 3].rstrip() + "..."


def load_messages(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return the messages file named by ``meta.messages``, by id (empty if none is named)."""
    name = meta.get("messages")
    if name is None:
        return {}
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
        raise Refusal(f"meta.messages must be a relative path inside examples/, got {name!r}")
    path = EXAMPLES / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Refusal(f"meta.messages: cannot read {name}: {exc}") from exc
    if not isinstance(data, list):
        raise Refusal(f"meta.messages: {name} is not a JSON list")
    return {m["id"]: m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


def handoff_items(order: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one follow-up item per message of the order."""
    meta = order.get("meta") or {}
    messages = load_messages(meta) if isinstance(meta, dict) else {}
    out = []
    for item in order["items"]:
        message = {**messages.get(item["id"], {}), **item}
        text = message.get("text")
        if not isinstance(text, str) or not text.strip():
            raise Refusal(f"{item['id']}: no message text (neither `text` nor meta.messages)")
        found = ORDER_NO.search(text)
        out.append(
            {
                "id": item["id"],
                "customer": message.get("customer") or "the customer",
                "summary": summarize(text),
                "order": message.get("order") or (found.group(0) if found else None),
            }
        )
    return out


def receipt(
    job_id: str, input_ids: list[str], output_ids: list[str], status: str, reason: str | None = None
) -> dict[str, Any]:
    """Return a receipt: the agent's claim, which the daemon's checks then test."""
    body: dict[str, Any] = {"job_id": job_id, "input_ids": input_ids, "output_ids": output_ids}
    body |= {"status": status, "outputs": []}
    return body | ({"reason": reason} if reason else {})


def write_json(path: Path, body: Any, indent: int | None = None) -> None:
    """Write JSON through a hidden temporary name and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(body, indent=indent, ensure_ascii=False) + "\n"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def run(order_path: Path, workspace: Path, receipt_path: Path) -> dict[str, Any]:
    """Do the intake's work for one order; return a summary (``ok``, ``message``, ids)."""
    order = json.loads(order_path.read_text(encoding="utf-8"))
    job_id = order["job_id"]
    ids = [item["id"] for item in order["items"]]
    meta = order.get("meta") or {}
    try:
        items = handoff_items(order)
        new_id = followup_id(job_id)
    except Refusal as exc:
        write_json(receipt_path, receipt(job_id, ids, [], "failed", str(exc)))
        return {"ok": False, "job_id": job_id, "message": f"failed: {exc}", "followup": None}
    followup: dict[str, Any] = {
        "job_id": new_id,
        "from": order["to"],
        "to": NEXT_AGENT,
        "task": TASK,
        "items": items,
        "accept": {
            "output": OUTPUT,
            "key": "id",
            "allowed": {"team": TEAMS},
            "required": ["team", "next_step"],
        },
        "writes": [OUTPUT],
    }
    if isinstance(order.get("for"), str):
        followup["for"] = order["for"]
    written: str | None = new_id
    if isinstance(meta, dict) and meta.get("skip_handoff") is True:
        message = f"{len(ids)} messages read; handoff skipped on purpose (meta.skip_handoff)"
        written = None
    else:
        write_json(workspace / "outbox" / f"{new_id}.json", followup, indent=2)
        message = f"{len(ids)} messages handed to {NEXT_AGENT} as {new_id}"
    # The receipt claims the ids were handed on; with skip_handoff that claim is false,
    # and only the daemon's followups_valid check can tell.
    write_json(receipt_path, receipt(job_id, ids, [i["id"] for i in items], "done"))
    return {"ok": True, "job_id": job_id, "message": message, "followup": written}


def main(argv: list[str]) -> int:
    """Run the agent as the daemon does and print its two stdout lines."""
    if len(argv) > 2:
        print("usage: intake.py [ORDER_JSON]", file=sys.stderr)
        return 2
    order_path = Path(argv[1] if len(argv) == 2 else os.environ.get("DISPATCH_ORDER", "order.json"))
    workspace = Path(os.environ.get("DISPATCH_WORKSPACE") or ".")
    receipt_path = Path(os.environ.get("DISPATCH_RECEIPT") or workspace / "receipt.json")
    job_id = os.environ.get("DISPATCH_JOB_ID", "")
    stop = not order_path.is_file()
    if stop:
        print(f"intake: STOP no order at {order_path}; nothing written")
        summary = {"type": "result", "is_error": True, "result": f"STOP no {order_path.name}."}
    else:
        outcome = run(order_path, workspace, receipt_path)
        job_id = outcome["job_id"] or job_id
        print(f"intake: {job_id}: {outcome['message']}")
        summary = {"type": "result", "is_error": not outcome["ok"], "result": outcome["message"]}
    summary |= {"num_turns": 1, "total_cost_usd": 0, "session_id": f"local-{job_id}" if job_id else "local"}
    print(json.dumps(summary, ensure_ascii=False))
    return 1 if stop else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
