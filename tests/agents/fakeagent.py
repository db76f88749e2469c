#!/usr/bin/env python3
"""A test agent driven by flags: does the job right, or misbehaves on purpose.

It reads the order from $DISPATCH_ORDER, writes the output named by
``accept.output`` (csv, json or jsonl) with one row per item, and writes
``receipt.json``. Each flag bends one part of that to make one check fail.
Every start is appended to the file given by ``--count`` (one line per start:
``job_id attempt pid``), which lives outside the dispatch root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--count", help="append one line per start to this file")
    p.add_argument("--exit", type=int, default=0, help="exit code")
    p.add_argument("--sleep", type=float, default=0.0, help="sleep before working")
    p.add_argument("--sleep-after", type=float, default=0.0, help="sleep after the receipt")
    p.add_argument("--no-receipt", action="store_true")
    p.add_argument("--no-output", action="store_true")
    p.add_argument("--invalid-receipt", action="store_true", help="receipt is not JSON")
    p.add_argument("--receipt-list", action="store_true", help="receipt is a JSON list")
    p.add_argument("--wrong-id", action="store_true", help="receipt job_id is wrong")
    p.add_argument("--status", default="done", help="receipt status")
    p.add_argument("--drop-input", action="store_true", help="receipt input_ids miss one")
    p.add_argument("--repeat-input", action="store_true", help="receipt input_ids repeat one")
    p.add_argument("--missing-row", action="store_true", help="output misses the last item")
    p.add_argument("--extra-row", action="store_true", help="output has an unknown id")
    p.add_argument("--duplicate-row", action="store_true", help="output repeats an item")
    p.add_argument("--output-ids-wrong", action="store_true", help="receipt output_ids differ")
    p.add_argument("--bad-value", action="store_true", help="an allowed field gets a bad value")
    p.add_argument("--empty-required", action="store_true", help="a required field is empty")
    p.add_argument("--write-outside", action="store_true", help="write a file not in writes")
    p.add_argument("--modify-given", action="store_true", help="change work/order.json")
    p.add_argument("--symlink-out", action="store_true", help="leave a link to /etc/passwd")
    p.add_argument("--hardlink", action="store_true", help="leave a file with two links")
    p.add_argument("--fifo", action="store_true", help="leave a FIFO in work/")
    p.add_argument("--delete-work", action="store_true", help="remove its own work folder")
    p.add_argument("--fork-child", type=float, default=0.0, help="leave a child sleeping N s")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM")
    p.add_argument("--flood", type=int, default=0, help="print this many bytes to stdout")
    p.add_argument("--json-result", help="print this JSON object last on stdout")
    p.add_argument("--fail-attempts", type=int, default=0, help="exit 1 on the first N attempts")
    p.add_argument(
        "--fail-checks-attempts",
        type=int,
        default=0,
        help="write a bad output on the first N attempts, unless feedback.json exists",
    )
    p.add_argument("--followup", action="append", default=[], help="write this JSON object (an order) into outbox/")
    p.add_argument("--outbox-file", action="append", default=[], help="NAME=TEXT: write TEXT as outbox/NAME, as is")
    p.add_argument("--parents", help="a joined job: read this parents.json (exit 3 if it cannot be read)")
    p.add_argument("--parents-log", help="append 'job_id <parents.json as one line>' to this file")
    p.add_argument("--field", action="append", default=[], help="NAME=VALUE: put this column in every output row")
    return p.parse_args()


def write_output(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        cols: list[str] = []
        for row in rows:
            cols += [c for c in row if c not in cols]
        lines = [",".join(cols)] + [",".join(row.get(c, "") for c in cols) for row in rows]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))


def main() -> int:
    a = parse()
    job_id = os.environ["DISPATCH_JOB_ID"]
    attempt = int(os.environ["DISPATCH_ATTEMPT"])
    if a.count:
        with open(a.count, "a") as f:
            f.write(f"{job_id} {attempt} {os.getpid()}\n")
    if a.parents:
        try:
            parents = json.loads(Path(a.parents).read_text())
        except (OSError, ValueError):
            return 3
        if a.parents_log:
            with open(a.parents_log, "a") as f:
                f.write(f"{job_id} {json.dumps(parents)}\n")
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.fork_child:
        subprocess.Popen(
            [sys.executable, "-c", f"import time; time.sleep({a.fork_child})"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    if a.sleep:
        time.sleep(a.sleep)
    if a.flood:
        chunk = b"x" * 65535 + b"\n"
        left = a.flood
        while left > 0:
            sys.stdout.buffer.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        sys.stdout.flush()
    order = json.loads(Path(os.environ["DISPATCH_ORDER"]).read_text())
    work = Path(os.environ["DISPATCH_WORKSPACE"])
    accept = order.get("accept") or {}
    key = accept.get("key", "id")
    ids = [item["id"] for item in order["items"]]
    repairing = (work / "feedback.json").exists()
    bad_checks = attempt <= a.fail_checks_attempts and not repairing

    rows = [{key: i} for i in ids]
    for spec in a.field:
        name, _, value = spec.partition("=")
        for row in rows:
            row[name] = value
    if a.missing_row or bad_checks:
        rows = rows[:-1]
    if a.extra_row:
        rows.append({key: "UNKNOWN-ID"})
    if a.duplicate_row:
        rows.append(dict(rows[0]))
    if a.bad_value and rows:
        field = next(iter(accept.get("allowed") or {"team": []}))
        rows[0][field] = "not-an-allowed-value"
    if a.empty_required and rows:
        rows[0][(accept.get("required") or ["team"])[0]] = ""
    if accept.get("output") and not a.no_output:
        write_output(work / accept["output"], rows)

    if a.write_outside:
        (work / "not-allowed.txt").write_text("outside the writes list\n")
    if a.modify_given:
        (work / "order.json").write_text("{}")
    if a.symlink_out:
        os.symlink("/etc/passwd", work / "outbox-link")
    if a.hardlink:
        (work / "hard.txt").write_text("x")
        os.link(work / "hard.txt", work / "hard2.txt")
    if a.fifo:
        os.mkfifo(work / "pipe")
    for spec in a.followup:
        (work / "outbox").mkdir(exist_ok=True)
        follow = json.loads(spec)
        (work / "outbox" / f"{follow['job_id']}.json").write_text(json.dumps(follow))
    for spec in a.outbox_file:
        (work / "outbox").mkdir(exist_ok=True)
        name, _, text = spec.partition("=")
        (work / "outbox" / name).write_text(text)

    if not a.no_receipt:
        input_ids = list(ids)
        if a.drop_input:
            input_ids = input_ids[:-1]
        if a.repeat_input:
            input_ids.append(input_ids[0])
        output_ids = [r[key] for r in rows]
        if a.output_ids_wrong:
            output_ids = output_ids[:-1]
        receipt = {
            "job_id": "WRONG-ID" if a.wrong_id else job_id,
            "input_ids": input_ids,
            "output_ids": output_ids,
            "status": a.status,
            "outputs": [accept["output"]] if accept.get("output") else [],
        }
        text = "{not json" if a.invalid_receipt else json.dumps(receipt)
        if a.receipt_list:
            text = "[]"
        (work / "receipt.json").write_text(text)
    if a.delete_work:
        import shutil

        shutil.rmtree(work)
    if a.sleep_after:
        time.sleep(a.sleep_after)
    if a.json_result:
        print("some progress text")
        print(a.json_result)
    if attempt <= a.fail_attempts:
        return 1
    return a.exit


if __name__ == "__main__":
    sys.exit(main())
