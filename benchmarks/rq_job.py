"""The job RQ's workers run in the `rq` section: one `subprocess.run` of the agent."""

from __future__ import annotations

import subprocess


def run_agent(argv: list[str], env: dict[str, str]) -> int:
    """Run the agent to its exit; fail the job when it exits non-zero."""
    subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, check=True)
    return 0
