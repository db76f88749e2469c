"""The metrics file (contract section 10): written atomically, in the text format node_exporter reads."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.metrics import Metrics, metrics_path, stale_files


def samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse a metrics file back: {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_written_file_parses_back_with_every_metric_of_the_contract(tmp_path: Path) -> None:
    """A written file parses as Prometheus text and holds each contract metric with its labels and values."""
    m = Metrics(str(tmp_path / "d-{host}-{pid}.prom"), "box", 42, agents=["assigner"])
    m.job_finished("done", "assigner", 12.5, 0.25)
    m.job_finished("done", "assigner", 30.0, 0.5)
    m.job_finished("failed", "assigner", 2.0, None)
    m.job_finished("refused", None, None, None)
    m.set_running({"assigner": 2})
    m.set_queue({"inbox": 3, "held": 1, "active": 2, "review": 0})
    m.loop_turn(1_800_000_000.5)
    m.write()
    path = tmp_path / "d-box-42.prom"
    assert m.path == path
    got = samples(path)
    assert got[("dispatcher_jobs_finished_total", (("agent", "assigner"), ("state", "done")))] == 2
    assert got[("dispatcher_jobs_finished_total", (("agent", "assigner"), ("state", "failed")))] == 1
    assert got[("dispatcher_jobs_finished_total", (("agent", ""), ("state", "refused")))] == 1
    assert got[("dispatcher_queue", (("state", "inbox"),))] == 3
    assert got[("dispatcher_queue", (("state", "held"),))] == 1
    assert got[("dispatcher_queue", (("state", "active"),))] == 2
    assert got[("dispatcher_queue", (("state", "review"),))] == 0
    assert got[("dispatcher_agents_running", (("agent", "assigner"),))] == 2
    assert got[("dispatcher_job_duration_seconds_count", (("agent", "assigner"),))] == 3
    assert got[("dispatcher_job_duration_seconds_sum", (("agent", "assigner"),))] == pytest.approx(44.5)
    assert got[("dispatcher_job_duration_seconds_bucket", (("agent", "assigner"), ("le", "15.0")))] == 2
    assert got[("dispatcher_cost_usd_total", (("agent", "assigner"),))] == pytest.approx(0.75)
    assert got[("dispatcher_last_loop_timestamp_seconds", ())] == 1_800_000_000.5
    types = {f.name: f.type for f in text_string_to_metric_families(path.read_text())}
    assert types == {
        "dispatcher_jobs_finished": "counter",
        "dispatcher_queue": "gauge",
        "dispatcher_agents_running": "gauge",
        "dispatcher_job_duration_seconds": "histogram",
        "dispatcher_cost_usd": "counter",
        "dispatcher_last_loop_timestamp_seconds": "gauge",
        "dispatcher_agent_gated": "gauge",
    }
    assert "_created" not in path.read_text()


def test_configured_agents_start_at_zero_and_a_stopped_agent_drops_to_zero(tmp_path: Path) -> None:
    """Every configured agent has its series at 0 before its first job, and an agent no longer running reads 0."""
    m = Metrics(tmp_path / "m.prom", "h", 1, agents=["a", "b"])
    m.set_running({"a": 1})
    m.set_running({})
    m.write()
    got = samples(tmp_path / "m.prom")
    assert got[("dispatcher_agents_running", (("agent", "a"),))] == 0
    assert got[("dispatcher_jobs_finished_total", (("agent", "b"), ("state", "done")))] == 0
    assert got[("dispatcher_cost_usd_total", (("agent", "b"),))] == 0


def test_write_replaces_the_file_by_rename_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    """Each write renames a new file into place (a reader of the old one reads it whole); no temporary file stays."""
    path = tmp_path / "m.prom"
    m = Metrics(path, "h", 1)
    m.write()
    before = os.stat(path).st_ino
    with path.open() as reader:
        m.loop_turn(5.0)
        m.write()
        assert "dispatcher_last_loop_timestamp_seconds 0.0" in reader.read()
    assert os.stat(path).st_ino != before
    assert "dispatcher_last_loop_timestamp_seconds 5.0" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.prom"]


def test_updates_from_many_threads_are_all_counted(tmp_path: Path) -> None:
    """Jobs finished from several threads at once are each counted once."""
    m = Metrics(tmp_path / "m.prom", "h", 1)

    def finish() -> None:
        for _ in range(500):
            m.job_finished("done", "w", 1.0, 0.01)

    threads = [threading.Thread(target=finish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.write()
    got = samples(tmp_path / "m.prom")
    assert got[("dispatcher_jobs_finished_total", (("agent", "w"), ("state", "done")))] == 2000
    assert got[("dispatcher_cost_usd_total", (("agent", "w"),))] == pytest.approx(20.0)


def test_path_template_replaces_host_and_pid() -> None:
    """`{host}` and `{pid}` in metrics_file become this daemon's host name and pid; other text stays."""
    assert metrics_path("/var/lib/node_exporter/{host}-{pid}.prom", "web-1", 4711) == Path(
        "/var/lib/node_exporter/web-1-4711.prom"
    )
    assert metrics_path("/m/{other}.prom", "h", 1) == Path("/m/{other}.prom")


def test_metrics_labels_are_added_to_every_series_so_two_daemons_files_never_repeat_one(tmp_path: Path) -> None:
    """Two daemons' files under one {pid} pattern, each with metrics_labels {daemon: "{host}-{pid}"}: no series
    of one file is repeated in the other (node_exporter refuses a repeated one), and each keeps its own labels."""
    files = []
    for pid in (41, 42):
        m = Metrics(str(tmp_path / "d-{pid}.prom"), "box", pid, agents=["a"], labels={"daemon": "{host}-{pid}"})
        m.job_finished("done", "a", 1.0, None)
        m.loop_turn(1_800_000_000.0)
        m.write()
        files.append(samples(tmp_path / f"d-{pid}.prom"))
    assert not set(files[0]) & set(files[1])
    for pid, got in zip((41, 42), files, strict=True):
        assert all(("daemon", f"box-{pid}") in labels for _, labels in got), got
        assert got[("dispatcher_last_loop_timestamp_seconds", (("daemon", f"box-{pid}"),))] == 1_800_000_000.0
        key = ("dispatcher_jobs_finished_total", (("agent", "a"), ("daemon", f"box-{pid}"), ("state", "done")))
        assert got[key] == 1


def test_a_stopped_daemons_file_is_found_under_a_path_holding_glob_characters(tmp_path: Path) -> None:
    """metrics_file `met[1]/m-{pid}.prom`: the file a stopped daemon left there is found for removal (the `[` is part
    of the path, not a pattern), the live daemon's own file is not, nor a name the pattern does not give."""
    folder = tmp_path / "met[1]"
    folder.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that ran and ended: no daemon has it now
    for name in (f"m-{gone.pid}.prom", f"m-{os.getpid()}.prom", "m-abc.prom"):
        (folder / name).write_text("")
    assert stale_files(str(folder / "m-{pid}.prom"), "box", os.getpid()) == [folder / f"m-{gone.pid}.prom"]
