#!/usr/bin/env python3
"""Measure the CPU of one JSON log line: structlog's processor chain as it was, and dispatcher.logs now.

    .venv/bin/python benchmarks/log_line.py [--lines 20000] [--rounds 7]

Both write through the real `dispatcher.logs.SINK` to /dev/null (stdout and the
log file), with `job_id` and `agent` bound as a job's thread binds them, logging
the six lines a job writes (order.received ... job.done) with their usual
fields. Rounds alternate between the two so that a busy machine slows both
alike; the figures are CPU microseconds per line (process time), the best and
the median round. First it checks that both write the same bytes for the same
events, timestamps aside.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from dispatcher import logs
from dispatcher.logview import format_line
from dispatcher.text import redact

# -- the chain as it was (dispatcher/logs.py before the one-pass renderer) ----------------------


def _old_cut_fields(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if isinstance(value, str) and len(value) > logs.FIELD_MAX:
            event[key] = f"{value[: logs.FIELD_MAX]}... (cut, {len(value) - logs.FIELD_MAX} more characters)"
    return event


def _old_scrub(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _old_scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_old_scrub(v) for v in value]
    return value


_old_dicts = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


class _OldRenderer:
    def __init__(self, console: bool, journal: bool) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._console = console
        self._journal = journal

    def __call__(self, logger: Any, name: str, event: Any) -> str:
        event.pop("_record", None)
        event.pop("_from_structlog", None)
        event = _old_scrub(_old_dicts(logger, name, event))
        as_json = str(self._json(logger, name, event))
        if self._console:
            line = format_line(event)
        elif self._journal:
            line = f"<{logs.PRIORITY.get(str(event.get('level')), 6)}>{as_json}"
        else:
            line = as_json
        logs.SINK.write(line, as_json)
        raise structlog.DropEvent


def configure_old() -> None:
    """Configure structlog with the processor chain the daemon used before."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _old_cut_fields,
            _OldRenderer(console=False, journal=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )


def configure_new() -> None:
    """Configure logging as the daemon does now (JSON on stdout, a log file)."""
    logs.configure(log_file=Path("/dev/null"), console=False)


# -- one job's lines ----------------------------------------------------------------------------


def one_job(log: Any) -> None:
    """Write the six lines of one job, with the fields the daemon gives them."""
    log.info("order.received", agent="worker", file="JOB-1.yaml", job_id="JOB-1")
    log.info("job.claimed", job_id="JOB-1", agent="worker", file="JOB-1.yaml", attempt=1, budget=None)
    with structlog.contextvars.bound_contextvars(job_id="JOB-1", agent="worker"):
        log.info("agent.started", attempt=1, pid=12345)
        log.info(
            "agent.exited",
            attempt=1,
            exit_code=0,
            timed_out=False,
            duration_ms=412,
            cost_usd=0.0123,
            usage={"input_tokens": 1200, "output_tokens": 310},
        )
        log.info("job.verified", passed=3, failed=[])
        log.info("job.done", children=None, duration_s=0.52, cost_usd=0.0123, chain_cost_usd=0.0123, attempts=1)


def lines_of(configure: Callable[[], None]) -> list[str]:
    """Return the lines one job writes under a configuration, timestamps replaced by TS."""
    out = io.StringIO()
    logs.SINK.console = out
    configure()
    one_job(structlog.get_logger("dispatcher"))
    return [re.sub(r'"timestamp": "[^"]*"', '"timestamp": "TS"', line) for line in out.getvalue().splitlines()]


def round_us(configure: Callable[[], None], jobs: int) -> float:
    """Return CPU microseconds per line for jobs jobs' lines under a configuration."""
    configure()
    log = structlog.get_logger("dispatcher")
    one_job(log)  # the proxy binds and caches on first use
    start = time.process_time()
    for _ in range(jobs):
        one_job(log)
    return (time.process_time() - start) / (jobs * 6) * 1e6


def main() -> int:
    """Check both write the same bytes, then time them in alternating rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=20000, help="lines per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each (default 7)")
    args = parser.parse_args()
    old, new = lines_of(configure_old), lines_of(configure_new)
    if old != new:
        print("the two write different lines:", *old, *new, sep="\n", file=sys.stderr)
        return 1
    devnull = Path("/dev/null").open("w", encoding="utf-8")  # noqa: SIM115 - the console for every round
    logs.SINK.console = devnull
    logs.SINK.open_file(Path("/dev/null"))
    jobs = max(1, args.lines // 6)
    times: dict[str, list[float]] = {"old chain": [], "one pass": []}
    for _ in range(args.rounds):
        times["old chain"].append(round_us(configure_old, jobs))
        times["one pass"].append(round_us(configure_new, jobs))
    print(f"same bytes: yes ({len(new)} lines of one job compared)")
    print(f"{'':10} {'best':>8} {'median':>8}  us CPU per line, {jobs * 6} lines x {args.rounds} rounds")
    for name, got in times.items():
        print(f"{name:10} {min(got):8.1f} {statistics.median(got):8.1f}")
    ratio = statistics.median(times["old chain"]) / statistics.median(times["one pass"])
    print(f"one pass: {ratio:.1f}x fewer CPU microseconds per line (medians)")
    logs.SINK.open_file(None)
    devnull.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
