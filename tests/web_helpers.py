"""Helpers for the web view's tests: a root with jobs in every state, and a running `dispatcher web`.

The root is made the way a user makes one: a real daemon runs the fake agents
until a job is done, one failed, one waits in review (two), one runs, one is
queued, one held, one file refused, and a chain of three hops is done. The web
view is a real `dispatcher web` process on a free port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import Env, cli_env, order, wait_until

ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "web"


def hop(job_id: str, frm: str, to: str) -> str:
    """Return a follow-up order (JSON text) for the fake agent's --followup."""
    return json.dumps({"job_id": job_id, "from": frm, "to": to, "task": f"Hop to {to}.", "items": [{"id": "R1"}]})


def costing(usd: float) -> list[str]:
    """Return the fake agent's flags to report usd as a headless CLI's final JSON does."""
    return ["--json-result", json.dumps({"type": "result", "total_cost_usd": usd})]


def populate(env: Env, ledger: str = "sqlite") -> None:
    """Run a real daemon until the root holds jobs in every state (the daemon keeps running SLOW-1)."""
    agents = {
        "worker": env.agent(*costing(0.12)),
        "bad": env.agent("--exit", "3", *costing(0.05)),
        "slow": env.agent("--sleep", "600", concurrency=1, timeout=900),
        "reviewer": env.agent(*costing(0.4), review=True),
        "hop1": env.agent(*costing(0.3), "--followup", hop("CHAIN-2", "hop1", "hop2")),
        "hop2": env.agent(*costing(0.2), "--followup", hop("CHAIN-3", "hop2", "hop3")),
        "hop3": env.agent(*costing(0.1)),
    }
    env.configure(agents=agents, ledger=ledger, max_jobs=4, max_timeout=3600, rescan_interval=0.5)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("DONE-1"))
    env.drop(order("FAIL-1", to="bad"))
    env.drop(order("REV-A", to="reviewer"))
    env.drop(order("REV-B", to="reviewer"))
    env.drop(order("CHAIN-1", to="hop1"))
    env.drop(b'{"job_id": "BROKEN", "to": "worker"', name="broken.json")
    env.drop(order("SLOW-1", to="slow"))
    env.wait_job("DONE-1", "done")
    env.wait_job("FAIL-1", "failed")
    env.wait_job("CHAIN-3", "done")
    env.wait_refused("broken")
    for rev in ("REV-A", "REV-B"):
        wait_until((env.root / "review" / rev / "result.json").exists, 60, f"{rev} in review/")
    wait_until((env.root / "active" / "SLOW-1").exists, 60, "SLOW-1 running")
    # slow runs one at a time: these two stay queued in inbox/; one of them is then held
    env.drop(order("QUEUED-1", to="slow"))
    env.drop(order("HELD-1", to="slow"))
    time.sleep(1.0)  # a rescan turn: both stay queued while SLOW-1 holds the agent's one slot
    assert env.cli("hold", "HELD-1").returncode == 0
    assert (env.root / "inbox" / "QUEUED-1.json").exists()


@dataclass
class Web:
    """A running `dispatcher web` and how to reach it."""

    proc: subprocess.Popen[bytes]
    url: str
    token: str | None
    out: Path

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """GET path; return (status, body, headers) whatever the status."""
        return self.request("GET", path, None, headers)

    def post(
        self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """POST path with body; return (status, body, headers) whatever the status."""
        return self.request("POST", path, body or b"", headers)

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None
    ) -> tuple[int, bytes, dict[str, str]]:
        assert self.url.startswith("http://127.0.0.1:")
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})  # noqa: S310
        opener = urllib.request.build_opener(_NoRedirect())
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), dict(exc.headers)

    def json(self, path: str) -> Any:
        status, body, _ = self.get(path)
        assert status == 200, (path, status, body[:300])
        return json.loads(body)

    def act(self, job_id: str, action: str, token: str | None, **body: Any) -> tuple[int, dict[str, Any]]:
        """POST /api/jobs/ID/ACTION with the token (None: no Authorization header)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        status, data, _ = self.post(f"/api/jobs/{job_id}/{action}", json.dumps(body).encode(), headers)
        return status, json.loads(data)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(30)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def start_web(env: Env, *args: str) -> Web:
    """Start `dispatcher web --listen 127.0.0.1:0 ARGS` and wait until it says where it listens."""
    out = env.tmp / f"web-{time.monotonic_ns()}.log"
    fh = out.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "web", "--listen", "127.0.0.1:0", *args],
        stdout=fh,
        stderr=subprocess.STDOUT,
        cwd=env.tmp,
        env=cli_env() | {"DISPATCHER_LOG_FORMAT": "json"},
    )
    fh.close()

    def started() -> tuple[str, str | None] | None:
        text = out.read_text(errors="replace")
        if proc.poll() is not None:
            raise AssertionError(f"dispatcher web exited {proc.returncode}: {text}")
        url = token = None
        for line in text.splitlines():
            if line.startswith("dispatcher web: "):
                url = line.rsplit(" on ", 1)[1].rstrip("/")
            if line.startswith("action token"):
                token = line.rsplit(": ", 1)[1]
        if url and (token or "web_token_file" in env.settings):
            return url, token
        return None

    url, token = wait_until(started, 30, "dispatcher web to listen")
    return Web(proc, url, token, out)


def save(name: str, data: bytes) -> Path:
    """Keep a file the test run made (a screenshot) under tests/artifacts/web/, where a person can look."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    path.write_bytes(data)
    os.chmod(path, 0o644)
    return path


def big_root(root: Path, n: int, *, now: float | None = None) -> None:
    """Write a root of n finished jobs straight into folders and the SQLite ledger (no daemon, seconds not hours).

    Nine in ten are done, the rest failed, and up to 20 wait in review; each has
    a small result.json and a ledger row with its agent, cost and finish time.
    """
    from dispatcher.clock import iso
    from dispatcher.layout import Layout
    from dispatcher.ledger.base import Entry
    from dispatcher.ledger.sqlite import SqliteLedger

    layout = Layout(root)
    layout.create()
    now = time.time() if now is None else now
    rows = []
    for i in range(n):
        job_id = f"BULK-{i:06d}"
        state = "review" if i < 20 else "failed" if i % 10 == 0 else "done"
        agent = f"agent-{i % 5}"
        finished = now - (n - i) * 10.0
        folder = root / state / job_id
        folder.mkdir()
        result = {
            "job_id": job_id, "state": state, "agent": agent,
            "reason": "exit_ok: exit 1 in 0.1 s" if state == "failed" else None,
            "checks": [], "attempts": [], "received": iso(finished - 5), "finished": iso(finished),
            "parent": None, "children": [], "cost_usd": 0.01, "chain_cost_usd": 0.01,
        }  # fmt: skip
        (folder / "result.json").write_text(json.dumps(result))
        rows.append(Entry(job_id, state, agent, None, 1, None, None, None, 0, 0.01, 0.01, finished))
    ledger = SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)
    try:
        ledger.load_rows(rows)
    finally:
        ledger.close()
