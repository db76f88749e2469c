"""Section `bigorder`: a large YAML order never holds up the pickup of small ones.

A ready, idle `run` gets small orders 20 ms apart twice: alone (the baseline), then right
after a YAML order of about 1 MB (under `max_order_bytes`, 1 MiB) that takes a few hundred
milliseconds to parse. The figure is how much later the small orders' agents start
(rename -> `agent.started` log line) while the big one is being read.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from harness import BenchError, job_ids, order_bytes, parse_ts, percentile, running_daemon, safe_drop, write_config
from report import Result, Row

SMALL = 40
GAP_S = 0.02
DELAY_MS = 10.0  # issue 15: no order, whatever its size, delays another's pickup by more than 10 ms
BIG_BYTES = 1_000_000


def big_yaml(job_id: str, size: int = BIG_BYTES) -> bytes:
    """Return a valid YAML order of about size bytes: one item, and a long list of lines in `meta`."""
    head = (
        f"job_id: {job_id}\nfrom: bench\nto: bench\ntask: Copy the one item id to out.csv.\n"
        "items:\n  - id: R1\naccept:\n  output: out.csv\nmeta:\n  lines:\n"
    )
    line = "    - a line of notes that the agent may read, one of many in a large order\n"
    return (head + line * ((size - len(head)) // len(line))).encode()


def drop_small(inbox: Path, ids: list[str]) -> dict[str, float]:
    """Safe-drop the small orders GAP_S apart; return the time just before each rename."""
    t0 = time.perf_counter()
    out = {}
    for i, job_id in enumerate(ids):
        while time.perf_counter() < t0 + i * GAP_S:
            time.sleep(0.001)
        out[job_id] = safe_drop(inbox, job_id, order_bytes(job_id))
    return out


def starts(events: list[dict[str, object]], drops: dict[str, float]) -> list[float]:
    """Return rename -> agent.started in ms for the dropped ids."""
    out = []
    for e in events:
        if e.get("event") == "agent.started" and e.get("job_id") in drops:
            ts = parse_ts(e.get("timestamp"))
            if ts is not None:
                out.append((ts - drops[str(e["job_id"])]) * 1000)
    return out


def section_bigorder(base: Path, opts: argparse.Namespace) -> Result:
    """Small orders' pickup alone, then while a 1 MB YAML order is read; the difference is the figure."""
    config, root = write_config(base, max_jobs=opts.max_jobs)
    inbox = root / "inbox"
    alone_ids, beside_ids = job_ids("ALONE", SMALL), job_ids("BESIDE", SMALL)
    big = big_yaml("BIG-0000001")
    with running_daemon(config, base, [], notify=True) as d:
        d.wait_ready()
        time.sleep(0.5)
        alone = drop_small(inbox, alone_ids)
        d.wait_finished(SMALL, 60)
        tmp = inbox / ".BIG-0000001.yaml.tmp"
        tmp.write_bytes(big)
        t_big = time.time()
        os.rename(tmp, inbox / "BIG-0000001.yaml")
        beside = drop_small(inbox, beside_ids)
        d.wait_finished(2 * SMALL + 1, 120)
        events = d.events()
    a, b = starts(events, alone), starts(events, beside)
    big_start = starts(events, {"BIG-0000001": t_big})
    if len(a) != SMALL or len(b) != SMALL or not big_start:
        raise BenchError(f"agent.started lines: {len(a)} + {len(b)} small, {len(big_start)} big\n{d.symptoms()}")
    worst, base_worst = max(b), max(a)
    res = Result()
    res.rows += [
        Row("bigorder_max", "small orders' pickup, worst, beside a 1 MB YAML order", worst, base_worst,
            "ms", f"< alone + {DELAY_MS:g} ms", worst < base_worst + DELAY_MS),
        Row("bigorder_p50", "small orders' pickup p50, beside a 1 MB YAML order", percentile(b, 50),
            percentile(a, 50), "ms", "-", None),
    ]  # fmt: skip
    res.notes += [
        f"{SMALL} small JSON orders safe-dropped {GAP_S * 1000:.0f} ms apart into a ready, idle `run` "
        f"(max_jobs {opts.max_jobs}), alone (the baseline), then right after a {len(big) / 1e6:.2f} MB YAML order "
        "(one item, a long list in `meta`); clock from just before each rename to its `agent.started` line",
        f"the big order's own pickup: {big_start[0]:.0f} ms (its parse, off the loop and the ledger lane)",
    ]
    res.data = {"alone_ms": a, "beside_ms": b, "big_ms": big_start[0], "big_bytes": len(big)}
    return res
