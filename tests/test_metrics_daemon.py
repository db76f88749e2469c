"""The metrics file of a running daemon: rewritten while idle, started by a reload, no stale {pid} files left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from conftest import Env, order, wait_until
from test_metrics import samples

from dispatcher.core.housekeeping import METRICS_EVERY_S


def _loop_ts(path: Path) -> float:
    for line in path.read_text().splitlines():
        if line.startswith("dispatcher_last_loop_timestamp_seconds "):
            return float(line.split()[1])
    raise AssertionError(f"no dispatcher_last_loop_timestamp_seconds in {path}")


def test_an_idle_daemon_rewrites_the_file_at_least_every_10_seconds(env: Env) -> None:
    """With nothing to do (and rescans 60 s apart) the file is replaced and its loop time moves within 10 s."""
    prom = env.tmp / "m.prom"
    env.configure(metrics_file=str(prom), rescan_interval=60)
    d = env.daemon()
    d.wait_ready()
    wait_until(prom.exists, what="the first metrics file")
    for _ in range(2):
        ino, ts = prom.stat().st_ino, _loop_ts(prom)
        wait_until(lambda: prom.stat().st_ino != ino, timeout=10.5, what="a rewrite within 10 s")  # noqa: B023
        assert _loop_ts(prom) > ts
    assert d.stop() == 0


def test_a_missing_folder_of_metrics_file_is_made(env: Env) -> None:
    """metrics_file: prom/m.prom (relative, no prom/ yet): the daemon makes the folder and writes the file."""
    env.configure(metrics_file="prom/m.prom")
    d = env.daemon()
    d.wait_ready()
    prom = env.config_path.parent / "prom" / "m.prom"
    wait_until(prom.exists, timeout=15, what="the metrics file in its new folder")
    assert _loop_ts(prom) > 0
    assert not [e for e in d.events() if e.get("event") == "metrics.failed"]
    assert d.stop() == 0


def metrics_by_reload(env: Env, prom: Path) -> dict[str, Any]:
    """Set metrics_file in the running daemon's config, reload, wait for the file; return the config written."""
    body: dict[str, Any] = yaml.safe_load(env.config_path.read_text()) | {"metrics_file": str(prom)}
    env.config_path.write_text(yaml.safe_dump(body))
    assert env.cli("reload").returncode == 0
    wait_until(prom.exists, timeout=10, what="the metrics file after the reload")
    return body


def test_a_reload_that_sets_metrics_file_starts_it(env: Env) -> None:
    """metrics_file added to the config and reloaded (SIGHUP): the file appears without a restart."""
    prom = env.tmp / "late.prom"
    d = env.daemon()
    d.wait_ready()
    metrics_by_reload(env, prom)
    d.wait_event("config.reloaded")
    assert "dispatcher_queue" in prom.read_text()


def test_a_reload_that_sets_metrics_file_counts_since_the_start_and_the_agents_running_now(env: Env) -> None:
    """R1 done before metrics_file is set, R2 running when it is: the file counts R1 (since this daemon
    started) and shows the agent running, then counts R2 too."""
    prom = env.tmp / "started.prom"
    env.configure({"worker": env.agent("--sleep", "3")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("R1"))
    env.wait_job("R1", "done")
    env.drop(order("R2"))
    wait_until(lambda: ("R2", 1) in env.starts(), what="R2 running")
    metrics_by_reload(env, prom)
    done = ("dispatcher_jobs_finished_total", (("agent", "worker"), ("state", "done")))
    running = ("dispatcher_agents_running", (("agent", "worker"),))
    assert samples(prom)[done] == 1
    assert samples(prom)[running] == 1
    env.wait_job("R2", "done")
    wait_until(lambda: samples(prom)[done] == 2 and samples(prom)[running] == 0, 15, "R2 counted")
    assert d.stop() == 0


def test_an_agent_added_after_metrics_started_by_a_reload_has_its_series_and_its_gate(env: Env) -> None:
    """metrics_file set by one reload, agent `late` (then paused) added by another: its gauges are in the file."""
    prom = env.tmp / "later.prom"
    d = env.daemon()
    d.wait_ready()
    body = metrics_by_reload(env, prom)
    body["agents"]["late"] = body["agents"]["worker"]
    env.config_path.write_text(yaml.safe_dump(body))
    assert env.cli("reload").returncode == 0
    wait_until(lambda: len([e for e in d.events() if e.get("event") == "config.reloaded"]) == 2)
    assert env.cli("pause", "late").returncode == 0
    late = (("agent", "late"),)

    def gated() -> bool:
        got = samples(prom)
        return got.get(("dispatcher_agent_gated", late)) == 1 and ("dispatcher_agents_running", late) in got

    wait_until(gated, timeout=15, what="dispatcher_agent_gated{agent=late} 1 and its running series")
    assert samples(prom)[("dispatcher_agent_gated", (("agent", "worker"),))] == 0


def test_a_reload_that_moves_or_unsets_metrics_file_leaves_no_frozen_file(env: Env) -> None:
    """Moved: the counters go on in the new file and the old one goes; unset: the file goes."""
    first, second = env.tmp / "a.prom", env.tmp / "b.prom"
    env.configure(metrics_file=str(first))
    d = env.daemon()
    d.wait_ready()
    env.drop(order("M1"))
    env.wait_job("M1", "done")
    done = ("dispatcher_jobs_finished_total", (("agent", "worker"), ("state", "done")))
    wait_until(lambda: first.exists() and samples(first).get(done) == 1, 15, "M1 counted")
    env.configure(metrics_file=str(second))
    assert env.cli("reload").returncode == 0
    wait_until(lambda: second.exists() and not first.exists(), 15, "the move")
    assert samples(second)[done] == 1  # since this daemon started, not since the reload
    env.configure()
    assert env.cli("reload").returncode == 0
    wait_until(lambda: not second.exists(), 15, "the file gone with metrics_file unset")
    assert d.stop() == 0 and not first.exists() and not second.exists()


def test_a_daemon_removes_the_files_stopped_daemons_of_its_host_left(env: Env) -> None:
    """Under {pid}, files of stopped daemons (and of pids reused by other programs) go; live daemons' files stay."""
    host = socket.gethostname()
    folder = env.tmp / "prom"
    folder.mkdir()
    env.configure(metrics_file=str(folder / "dispatcher-{host}-{pid}.prom"), rescan_interval=60)
    other = subprocess.Popen(["sleep", "120"])  # a live pid that is not a daemon
    log = env.tmp / "dispatcher.log"
    log.touch()
    tail = subprocess.Popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL)  # names dispatcher, is no daemon
    try:
        gone = folder / f"dispatcher-{host}-{other.pid}.prom"
        gone.write_text("dispatcher_queue 1\n")
        reused = folder / f"dispatcher-{host}-{tail.pid}.prom"  # left by a daemon whose pid tail got later
        reused.write_text("dispatcher_queue 1\n")
        hour_ago = time.time() - 3600
        os.utime(reused, (hour_ago, hour_ago))
        first = env.daemon()
        first.wait_ready()
        first_file = folder / f"dispatcher-{host}-{first.proc.pid}.prom"  # type: ignore[union-attr]
        wait_until(lambda: first_file.exists() and not gone.exists(), timeout=10, what="the stale file removed")
        assert not reused.exists()
        second = env.daemon()
        second.wait_ready()
        second_file = folder / f"dispatcher-{host}-{second.proc.pid}.prom"  # type: ignore[union-attr]
        wait_until(second_file.exists, timeout=10, what="the second daemon's file")
        assert first_file.exists()  # a live daemon's file is never taken
        assert first.stop() == 0
        assert first_file.exists()  # rewritten at stop, with its last values
        wait_until(lambda: not first_file.exists(), timeout=11, what="the stopped daemon's file removed")
        assert sorted(p.name for p in folder.iterdir()) == [second_file.name]
        unrelated = folder / "other.prom"
        unrelated.write_text("x 1\n")
        assert second.stop() == 0
        assert unrelated.exists()
    finally:
        for proc in (other, tail):
            proc.kill()
            proc.wait()


def test_review_decisions_and_retries_are_counted_once_each(env: Env) -> None:
    """approve/reject count as done/failed with their cost; a retried job's earlier cost and wait count once."""
    prom = env.tmp / "m.prom"
    cost = json.dumps({"total_cost_usd": 0.25})
    env.configure(
        agents={
            "rev": env.agent("--json-result", cost, review=True),
            "costly": env.agent("--exit", "1", "--json-result", json.dumps({"total_cost_usd": 1.0})),
        },
        metrics_file=str(prom),
        rescan_interval=0.5,
    )
    d = env.daemon()
    d.wait_ready()
    for job_id in ("R1", "R2"):
        env.drop(order(job_id, to="rev"))
    env.drop(order("F1", to="costly"))
    wait_until(lambda: (env.root / "review" / "R1").is_dir() and (env.root / "review" / "R2").is_dir(), 30, "review")
    env.wait_job("F1", "failed")
    time.sleep(3)  # F1 sits in failed/: no work, not counted as its duration
    assert env.cli("approve", "R1").returncode == 0 and env.cli("reject", "R2", "--reason", "no").returncode == 0
    assert env.cli("retry", "F1").returncode == 0
    again = env.root / "failed" / "F1" / "result.json"

    def retried() -> bool:
        try:  # the first result.json is there until the retry moves the folder into active/: looked at, then gone
            return len(json.loads(again.read_text())["attempts"]) == 2
        except FileNotFoundError:
            return False

    wait_until(retried, 60, "F1 again")

    def counted() -> bool:
        s = samples(prom) if prom.exists() else {}
        return (
            s.get(("dispatcher_jobs_finished_total", (("agent", "costly"), ("state", "failed")))) == 2
            and s.get(("dispatcher_jobs_finished_total", (("agent", "rev"), ("state", "failed")))) == 1
        )

    wait_until(counted, 30, "the decisions and the retry in the metrics")
    s = samples(prom)
    assert s[("dispatcher_jobs_finished_total", (("agent", "rev"), ("state", "done")))] == 1
    assert s[("dispatcher_cost_usd_total", (("agent", "rev"),))] == 0.5
    assert s[("dispatcher_job_duration_seconds_count", (("agent", "rev"),))] == 2
    assert s[("dispatcher_cost_usd_total", (("agent", "costly"),))] == 2.0  # 1 USD per attempt, each once
    assert s[("dispatcher_job_duration_seconds_sum", (("agent", "costly"),))] < 3, "the wait in failed/ was counted"
    assert d.stop() == 0


def test_job_duration_counts_from_the_claim_not_the_wait_in_inbox(env: Env) -> None:
    """Three orders for an agent of concurrency 1 wait their turn in inbox/; each job counts only its own run."""
    prom = env.tmp / "m.prom"
    env.configure(agents={"slow": env.agent("--sleep", "1.5", concurrency=1)}, metrics_file=str(prom), max_jobs=2)
    d = env.daemon()
    d.wait_ready()
    for job_id in ("W1", "W2", "W3"):
        env.drop(order(job_id, to="slow"))
    for job_id in ("W1", "W2", "W3"):
        env.wait_job(job_id, "done", timeout=60)
    count = ("dispatcher_job_duration_seconds_count", (("agent", "slow"),))
    wait_until(lambda: prom.exists() and samples(prom).get(count) == 3, 30, "three durations in the metrics")
    total = samples(prom)[("dispatcher_job_duration_seconds_sum", (("agent", "slow"),))]
    # each job runs about 1.5 s; counted from inbox/ the last two would add their 1.5 s and 3 s of waiting
    assert 3 * 1.5 <= total < 3 * 1.5 + 2.5, f"durations sum to {total} s"
    assert d.stop() == 0


def test_a_retried_job_that_never_ran_counts_its_duration_from_its_new_attempt(env: Env) -> None:
    """A job cancelled before any attempt (its agent paused), then retried 6 s later: the histogram counts its
    retry from its first new attempt, not from its first claim (README, metrics), so the 6 s in failed/ are no work."""
    prom = env.tmp / "m.prom"
    env.configure(agents={"worker": env.agent()}, metrics_file=str(prom))
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "worker", check=True)
    env.drop(order("C-1"))
    time.sleep(1)  # the daemon sees it and sets it aside for the gate
    assert env.cli("cancel", "C-1").returncode == 0
    env.wait_job("C-1", "failed")
    time.sleep(6)
    env.cli("resume", "worker", check=True)
    assert env.cli("retry", "C-1").returncode == 0
    wait_until((env.root / "done" / "C-1" / "result.json").exists, 30, "the retried job done")
    count = ("dispatcher_job_duration_seconds_count", (("agent", "worker"),))
    wait_until(lambda: prom.exists() and samples(prom).get(count) == 2, 30, "two durations in the metrics")
    total = samples(prom)[("dispatcher_job_duration_seconds_sum", (("agent", "worker"),))]
    assert total < 3, f"durations sum to {total} s: the wait in failed/ was counted"
    assert d.stop() == 0


def test_metrics_labels_from_the_config_are_on_every_series_and_follow_a_reload(env: Env) -> None:
    """metrics_labels {daemon: "{host}-{pid}"} labels each series with this daemon; a reload can change it."""
    prom = env.tmp / "m-{pid}.prom"
    env.configure(metrics_file=str(prom), metrics_labels={"daemon": "{host}-{pid}"})
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    path = env.tmp / f"m-{d.proc.pid}.prom"
    mine = ("daemon", f"{socket.gethostname()}-{d.proc.pid}")
    wait_until(path.exists, 30, "the metrics file")
    assert all(mine in labels for _, labels in samples(path)), samples(path)
    body: dict[str, Any] = yaml.safe_load(env.config_path.read_text()) | {"metrics_labels": {"site": "north"}}
    env.config_path.write_text(yaml.safe_dump(body))
    assert env.cli("reload").returncode == 0

    def relabelled() -> bool:
        got = samples(path)
        return bool(got) and all(("site", "north") in labels and mine not in labels for _, labels in got)

    wait_until(relabelled, 30, "the new labels after the reload")
    assert d.stop() == 0


def test_a_second_daemon_with_the_same_metrics_file_says_so_at_start(env: Env) -> None:
    """Two daemons on one root, `metrics_file` without {pid}: the second says at start that the file is the first's
    too (they would overwrite each other's figures); with {pid} in it, nothing is said."""
    for template, shared in (("m.prom", True), ("m-{pid}.prom", False)):
        env.configure(metrics_file=str(env.tmp / template))
        first = env.daemon()
        first.wait_ready()
        second = env.daemon()
        second.wait_ready()
        problems = [e for e in second.events() if e["event"] == "config.problem" and e["field"] == "metrics_file"]
        if shared:
            (line,) = problems
            assert line["level"] == "warning" and f"{first.proc.pid} on {socket.gethostname()}" in line["problem"]
            assert "{pid}" in line["problem"]
        else:
            assert problems == []
        assert second.stop() == 0 and first.stop() == 0


def test_a_metrics_file_that_cannot_be_written_is_logged_once_not_at_every_write(env: Env) -> None:
    """metrics_file under a path that is a file: metrics.failed once for the failing spell, not every few seconds
    (about 17,000 lines a day); once the path is fixed the file is written."""
    blocker = env.config_path.parent / "blocker"
    blocker.write_text("not a folder\n")
    env.configure(metrics_file="blocker/m.prom")
    d = env.daemon()
    d.wait_ready()
    time.sleep(3 * METRICS_EVERY_S + 1)
    failed = [e for e in d.events() if e.get("event") == "metrics.failed"]
    assert len(failed) == 1 and failed[0]["error"], failed
    blocker.unlink()
    wait_until((env.config_path.parent / "blocker" / "m.prom").exists, timeout=30, what="the file once it can be")
    assert d.stop() == 0
