"""`dispatcher reload`, and the config digest each daemon records: a changed config is never invisible."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import Env, cli_env, namespaced_daemon, order, wait_until

from dispatcher.ledger.base import DaemonInfo
from dispatcher.ops.daemons import config_note, systemd_unit, unit_of_cgroup

pytest_plugins = ["pg_fixtures"]


def test_a_changed_config_is_noted_and_reload_makes_the_daemon_load_it(env: Env) -> None:
    """After an agent is added, status and submit say the daemon runs the old config; after reload its orders run."""
    d = env.daemon()
    d.wait_ready()
    status = env.cli("status", "--json", check=True)
    daemons = json.loads(status.stdout)["daemons"]
    assert status.stderr == ""
    info = json.loads(next((env.root / ".state" / "daemons").glob("*.json")).read_text())
    # the daemon's entry records the digest of the config it loaded, and the file it loaded it from
    digest, path = info["config_digest"].split(" ", 1)
    assert len(digest) == 16 and path == os.path.abspath(env.config_path)
    assert "has changed" not in env.cli("status", check=True).stdout

    agents = {"worker": env.agent(), "split": env.agent()}
    env.configure(agents)
    note = env.cli("status", check=True).stdout.splitlines()[-1]
    assert note.startswith(f"note: {env.config_path} has changed since the running daemon")
    assert "`dispatcher reload`" in note and str(d.proc.pid) in note  # type: ignore[union-attr]
    (env.tmp / "s.json").write_text(json.dumps(order("SPLIT-1", to="split")))
    sub = env.cli("submit", str(env.tmp / "s.json"))
    assert sub.returncode == 0 and sub.stdout == "SPLIT-1\n"
    assert sub.stderr.startswith("note: ") and sub.stderr.count("\n") == 1

    reload = env.cli("reload")
    assert reload.returncode == 0, reload.stderr
    assert reload.stdout == (
        f"daemon {d.proc.pid} on {daemons[0]['host']}: asked to reload its config (SIGHUP);"  # type: ignore[union-attr]
        " it logs config.reloaded or config.rejected\n"
    )
    d.wait_event("config.reloaded")
    wait_until(lambda: "has changed" not in env.cli("status", check=True).stdout, what="the new digest recorded")
    (env.tmp / "s2.json").write_text(json.dumps(order("SPLIT-2", to="split")))
    sub = env.cli("submit", str(env.tmp / "s2.json"))
    assert sub.returncode == 0 and sub.stderr == ""
    env.wait_job("SPLIT-2", "done")


def test_a_daemon_that_loaded_another_file_or_runs_on_another_host_is_never_said_to_run_a_changed_config(
    env: Env,
) -> None:
    """Two daemons on one root, each with its own config file (they differ in max_jobs): neither file changed, so
    `status` with either file prints no note (it named the other file's daemon). A daemon of another host (its
    entry's host) is left out too: its file is not this one, and `dispatcher reload` here cannot reach it."""
    d = env.daemon()
    d.wait_ready()
    other = env.tmp / "other.yaml"
    other.write_text(yaml.safe_dump({**env.settings, "max_jobs": 1}, sort_keys=False))
    assert other.read_bytes() != env.config_path.read_bytes()
    e2 = cli_env()
    e2["DISPATCHER_CONFIG"] = str(other)
    second = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "run"], env=e2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: len(list((env.root / ".state" / "daemons").glob("*.json"))) == 2, what="both daemons")
        wait_until(lambda: len(json.loads(env.cli("status", "--json", check=True).stdout)["daemons"]) == 2)
        assert "has changed" not in env.cli("status", check=True).stdout
        mine = subprocess.run(
            [sys.executable, "-m", "dispatcher", "status"], env=e2, capture_output=True, text=True, timeout=60
        )
        assert mine.returncode == 0 and "has changed" not in mine.stdout, mine.stdout
        other.write_text(other.read_text() + "# changed\n")  # now it has: the note names that daemon alone
        mine = subprocess.run(
            [sys.executable, "-m", "dispatcher", "status"], env=e2, capture_output=True, text=True, timeout=60
        )
        assert f"has changed since the running daemon ({second.pid} on " in mine.stdout, mine.stdout
        assert str(d.proc.pid) not in mine.stdout.splitlines()[-1]  # type: ignore[union-attr]
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
    infos = [DaemonInfo("o", 1, "elsewhere", 0.0, config_digest="0123456789abcdef " + str(env.config_path))]
    assert config_note("fedcba9876543210", env.config_path, infos, host="here") is None
    assert config_note("fedcba9876543210", env.config_path, infos, host="elsewhere") is not None


def test_a_config_symlink_pointed_at_another_file_is_noted_as_a_changed_config(env: Env) -> None:
    """The daemon runs `--config current.yaml`, a link to v1.yaml; the link is pointed at v2.yaml (another
    max_jobs): `status` with current.yaml notes it, since a reload would load v2.yaml. It said nothing: the
    daemon's record named v1.yaml, the link's target."""
    v1, v2, link = env.tmp / "v1.yaml", env.tmp / "v2.yaml", env.tmp / "current.yaml"
    v1.write_text(env.config_path.read_text())
    v2.write_text(yaml.safe_dump({**env.settings, "max_jobs": 1}, sort_keys=False))
    link.symlink_to(v1)
    e = cli_env()
    e["DISPATCHER_CONFIG"] = str(link)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "run"], env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: len(json.loads(env.cli("status", "--json", check=True).stdout)["daemons"]) == 1)

        def status() -> str:
            proc = subprocess.run([sys.executable, "-m", "dispatcher", "status"], env=e, capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
            return proc.stdout

        assert "has changed" not in status()
        link.unlink()
        link.symlink_to(v2)
        assert f"{link} has changed since the running daemon ({daemon.pid} on " in status()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)


def test_retry_says_the_daemon_runs_an_older_config(env: Env) -> None:
    """`retry` after fixing an agent's command prints one note line: the fix needs a reload first."""
    env.configure({"worker": env.agent("--exit", "3")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FIX-1"))
    env.wait_job("FIX-1", "failed")
    env.configure({"worker": env.agent()})
    retry = env.cli("retry", "FIX-1")
    assert retry.returncode == 0
    assert retry.stderr.startswith(f"note: {env.config_path} has changed") and retry.stderr.count("\n") == 1


def test_reload_with_no_daemon_and_with_a_bad_config(env: Env) -> None:
    """No live daemon: exit 1 saying so; an invalid config: exit 2 and nothing is signalled."""
    none = env.cli("reload")
    assert none.returncode == 1 and none.stderr == f"no daemon of {env.root} runs on this host: nothing to reload\n"
    env.configure({"worker": env.agent(command=["/no/such/program"])})
    bad = env.cli("reload")
    assert bad.returncode == 2 and "agents.worker.command" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("broken", ["max_jobs", "yaml", "unknown_key", "json"])
def test_reload_of_a_config_the_daemon_refuses_still_reaches_it_as_sighup(
    env: Env, tmp_path: Path, broken: str
) -> None:
    """A config the daemon itself refuses (a bad value, a key it does not know, YAML that does not parse): `reload`
    still sends SIGHUP as the contract says, so the daemon logs config.rejected, keeps its config and reopens
    log_file; the command answers with the config's error, one line, exit 2."""
    log = tmp_path / "d.log"
    if broken == "json":  # a config in JSON (init writes one for a .json name)
        env.config_path = env.config_path.with_suffix(".json")
    env.configure(log_file=str(log))
    if broken == "json":  # the agents first, one with an env variable named root: not the config's root
        agents = {name: {**spec, "env": {"root": "/tmp"}} for name, spec in env.settings["agents"].items()}
        body = {"agents": agents, **{k: v for k, v in env.settings.items() if k != "agents"}}
        env.config_path.write_text(json.dumps(body, indent=2))
    d = env.daemon()
    d.wait_ready()
    good = env.config_path.read_text()
    log.rename(tmp_path / "d.log.1")  # as logrotate does before its reload
    if broken == "max_jobs":
        env.config_path.write_text(good.replace("max_jobs: 2", "max_jobs: -1"))
    elif broken == "yaml":
        env.config_path.write_text(good + "max_jobs: [\n")
    elif broken == "json":
        env.config_path.write_text(good.rstrip().rstrip("}") + ",\n")  # cut short: not JSON
    else:
        env.config_path.write_text(good + "max_jobz: 3\n")
    answer = subprocess.run(  # from another folder: the default root (./dispatch) is not this root there
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "reload"],
        capture_output=True, text=True, timeout=60, cwd="/", env=cli_env(),
    )  # fmt: skip
    assert answer.returncode == 2 and answer.stderr.count("\n") == 1, answer.stderr
    assert answer.stderr.startswith(str(env.config_path)), answer.stderr
    d.wait_event("config.rejected")
    wait_until(lambda: log.exists() and "config.rejected" in log.read_text(), what="log_file opened again")
    env.config_path.write_text(good)
    env.drop(order("AFTER-1"))
    env.wait_job("AFTER-1", "done")  # the old config still runs


def test_a_daemon_under_systemd_is_named_with_its_unit() -> None:
    """The unit of a pid comes from /proc/PID/cgroup (v2, or v1 name=systemd); user managers are not units."""
    assert unit_of_cgroup("0::/system.slice/dispatcher@billing.service\n") == "dispatcher@billing.service"
    assert unit_of_cgroup("1:name=systemd:/system.slice/dispatcher.service\n4:memory:/x\n") == "dispatcher.service"
    assert unit_of_cgroup("0::/user.slice/user-1000.slice/user@1000.service/app.slice/x.scope\n") is None
    assert unit_of_cgroup("0::/\n") is None


@pytest.mark.parametrize(
    ("cgroup", "parent", "advice"),
    [
        ("0::/system.slice/dispatcher.service\n", "systemd", "systemctl reload dispatcher.service"),
        ("0::/system.slice/cron.service\n", "cron", None),  # started by cron: signalled, never `reload cron`
        ("1:name=systemd:/system.slice/ssh.service\n", "bash", None),  # an ssh session without pam_systemd
        ("0::/system.slice/jenkins.service\n", "java", None),  # a CI job
        (
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/dispatcher.service\n",
            "systemd",
            "systemctl --user reload dispatcher.service",
        ),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", "bash", None),
    ],
    ids=["system-unit", "cron", "ssh", "ci-job", "user-unit", "session"],
)
def test_only_a_daemon_systemd_started_is_sent_to_systemctl(
    tmp_path: Path, cgroup: str, parent: str, advice: str | None
) -> None:
    """A daemon in a service's cgroup is that unit's own only when a systemd is its parent: one started by cron, in
    an ssh session or by a CI job is signalled (section 7: reload asks the daemons, as SIGHUP); a user unit is
    named with `systemctl --user`. Read from a /proc laid out as the kernel lays it out."""
    (tmp_path / "4711").mkdir()
    (tmp_path / "4711" / "cgroup").write_text(cgroup)
    (tmp_path / "4711" / "stat").write_text("4711 (python3 -m dis) S 812 4711 4711 0 -1 4194560 0 0\n")
    (tmp_path / "812").mkdir()
    (tmp_path / "812" / "comm").write_text(parent + "\n")
    assert systemd_unit(4711, proc=tmp_path) == advice


def test_the_postgresql_ledger_records_the_digest_also_in_a_ledger_made_before_it(pg_db: str) -> None:
    """A daemons table without config_digest gets the column on open; register and record_config then keep it."""
    import os
    import time

    import psycopg

    from dispatcher.ledger.base import DaemonInfo
    from dispatcher.ledger.postgres import PostgresLedger

    PostgresLedger(pg_db).close()
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE daemons DROP COLUMN config_digest")  # as a ledger made by an older dispatcher
    ledger = PostgresLedger(pg_db)
    try:
        ledger.register(DaemonInfo("h-1-aa", os.getpid(), "h", time.time(), config_digest="0123456789abcdef"))
        assert [d.config_digest for d in ledger.daemons()] == ["0123456789abcdef"]
        ledger.record_config("fedcba9876543210")
        assert [d.config_digest for d in ledger.daemons()] == ["fedcba9876543210"]
    finally:
        ledger.close()


def validate_for(env: Env, pid: str) -> subprocess.CompletedProcess[str]:
    """Run `validate` as systemd's ExecReload= does: with the reloaded daemon's pid in $MAINPID."""
    argv = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "validate"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=cli_env() | {"MAINPID": pid})


def test_validate_refuses_what_a_reload_would_refuse(env: Env) -> None:
    """`validate` (what `systemctl reload` runs before its SIGHUP) exits 2 for a log_file that is a folder or a named
    pipe no one reads, and, given the reloaded daemon's $MAINPID, for another root or ledger kind."""
    d = env.daemon()
    d.wait_ready()
    pid = str(d.proc.pid)  # type: ignore[union-attr]
    folder = env.tmp / "logs"
    folder.mkdir()
    pipe = env.tmp / "log.fifo"
    os.mkfifo(pipe)
    for log_file, why in ((folder, "it is a folder"), (pipe, "a named pipe no process reads")):
        env.configure(log_file=str(log_file))
        proc = env.cli("validate")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"log_file: cannot open {log_file}: {why}" in proc.stderr
        reload = env.cli("reload")  # `reload` checks what validate checks, before any SIGHUP
        assert (reload.returncode, reload.stderr, reload.stdout) == (2, proc.stderr, "")
    assert not [e for e in d.events() if e["event"] in ("config.rejected", "config.reloaded")]
    other = env.tmp / "other-root"
    other.mkdir()
    env.configure(root=str(other))
    assert env.cli("validate").returncode == 0  # nothing names the running daemon: the file alone is fine
    proc = validate_for(env, pid)
    assert proc.returncode == 2 and f"root: cannot change while the daemon (pid {pid}) runs with root" in proc.stderr
    env.configure(ledger="postgresql://dispatcher@127.0.0.1:1/x")
    proc = validate_for(env, pid)
    assert proc.returncode == 2 and "ledger: cannot change while the daemon" in proc.stderr, proc.stderr
    env.configure()
    assert validate_for(env, pid).returncode == 0
    assert d.stop() == 0


def test_validate_refuses_another_postgresql_url_or_lease_as_the_daemon_does(env: Env, pg_db: str) -> None:
    """Given $MAINPID, `validate` exits 2 for a ledger URL of the same kind, or a lease, that differs from the running
    daemon's (the daemon refuses either on reload, with `config.rejected`), and passes the ones it runs with."""
    env.configure(ledger=pg_db)
    d = env.daemon()
    d.wait_ready()
    pid = str(d.proc.pid)  # type: ignore[union-attr]
    assert validate_for(env, pid).returncode == 0
    env.configure(ledger=pg_db + ("&" if "?" in pg_db else "?") + "application_name=other")
    proc = validate_for(env, pid)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"ledger: cannot change while the daemon (pid {pid}) runs with another ledger" in proc.stderr
    d.signal(signal.SIGHUP)  # what the daemon does with it: the same refusal
    assert "ledger: cannot change while running" in d.wait_event("config.rejected", timeout=20)["error"]
    env.configure(ledger=pg_db, lease=45)  # the daemons sharing the ledger judge this one by its lease
    proc = validate_for(env, pid)
    assert (
        proc.returncode == 2 and f"lease: cannot change while the daemon (pid {pid}) runs with lease 30" in proc.stderr
    )
    reload = env.cli("reload")  # `reload` judges the config against each daemon it signals, as validate does,
    assert (reload.returncode, reload.stderr) == (2, proc.stderr)  # and sends it all the same: the daemon refuses it
    wait_until(lambda: len([e for e in d.events() if e["event"] == "config.rejected"]) == 2, timeout=20)
    assert (
        "lease: cannot change while running" in [e for e in d.events() if e["event"] == "config.rejected"][1]["error"]
    )
    env.configure(ledger=pg_db)
    assert validate_for(env, pid).returncode == 0
    assert d.stop() == 0


def test_a_log_file_that_is_a_pipe_no_one_reads_never_hangs_the_daemon(env: Env) -> None:
    """log_file naming a FIFO without a reader: `run` exits 2 at once; set by a reload, it is rejected (naming the
    file and the field) and the daemon goes on and stops on SIGTERM (section 9)."""
    pipe = env.tmp / "log.fifo"
    os.mkfifo(pipe)
    env.configure(log_file=str(pipe))
    proc = env.cli("run", "--once", timeout=20)
    assert proc.returncode == 2 and "log_file" in proc.stderr, proc.stderr
    env.configure()
    d = env.daemon()
    d.wait_ready()
    env.configure(log_file=str(pipe))
    d.signal(signal.SIGHUP)
    rejected = d.wait_event("config.rejected", timeout=20)
    assert f"log_file: cannot open {pipe}" in rejected["error"], rejected
    env.drop(order("AFTER-FIFO"))
    env.wait_job("AFTER-FIFO", "done")
    assert d.stop(timeout=20) == 0


def test_reload_never_signals_the_pid_a_daemon_has_in_another_pid_namespace(env: Env) -> None:
    """A daemon in a pid namespace of its own under this host's name (a container sharing the host name) is
    pid 2 there; pid 2 here is another process. `reload` signals only the daemons it can reach, the one
    started here: its one line names that daemon, and the other's pid is never signalled."""
    other = namespaced_daemon(env.config_path, env.tmp / "other.log", env.tmp, pid1=False)  # sh is pid 1 there
    try:
        wait_until(
            lambda: any(
                d["pid"] == 2 and d["alive"] for d in json.loads(env.cli("status", "--json").stdout)["daemons"]
            ),
            30,
            "the other daemon's entry",
        )
        alone = env.cli("reload")
        assert alone.returncode == 1 and "nothing to reload" in alone.stderr, (alone.stdout, alone.stderr)
        assert "(pid 2 under this host's name runs in another pid namespace: reload it from inside)" in alone.stderr
        d = env.daemon()
        d.wait_ready()
        reload = env.cli("reload")
        assert reload.returncode == 0, reload.stderr
        assert reload.stdout.startswith(f"daemon {d.proc.pid} on ") and reload.stdout.count("\n") == 1  # type: ignore[union-attr]
        d.wait_event("config.reloaded")
        assert d.stop() == 0
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(30)


def test_reload_never_signals_a_daemon_here_for_another_whose_pid_in_its_namespace_is_the_same(env: Env) -> None:
    """A daemon in a pid namespace of its own under this host's name, whose pid there is the pid a daemon of this
    root has here: the daemon here holds a lock file under .state/daemons/, but not the other's. `reload` signals
    the daemon here once, for its own entry, never a second time for the other's."""

    d = env.daemon()
    d.wait_ready()
    pid = d.proc.pid  # type: ignore[union-attr]
    before = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "  # its next pid there is this daemon's here
    other = namespaced_daemon(env.config_path, env.tmp / "other.log", env.tmp, pid1=False, before=before)
    try:
        wait_until(
            lambda: (
                [e["pid"] for e in json.loads(env.cli("status", "--json").stdout)["daemons"] if e["alive"]]
                == [pid, pid]
            ),
            30,
            "the other daemon's entry with the same pid",
        )
        reload = env.cli("reload")
        assert reload.returncode == 0, reload.stderr
        assert reload.stdout.splitlines() == [
            f"daemon {pid} on {socket.gethostname()}: asked to reload its config (SIGHUP);"
            " it logs config.reloaded or config.rejected"
        ]
        d.wait_event("config.reloaded")
        other_lines = [json.loads(x) for x in (env.tmp / "other.log").read_text().splitlines() if x.startswith("{")]
        assert not [e for e in other_lines if e.get("event") == "config.reloaded"]
        assert d.stop() == 0
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(30)


def test_reload_signals_a_daemon_here_that_runs_on_the_root_through_a_bind_mount(env: Env) -> None:
    """A daemon in this pid namespace that was given the root under another path (a bind mount in a mount namespace
    of its own, as a container with `-v` has it) holds its lock file under that path: `reload` with the root's real
    path still finds it by the file's device and inode, signals it, and never calls it a daemon of another pid
    namespace."""
    import shutil

    env.configure()
    alias = env.tmp / "alias"
    alias.mkdir()
    alias_config = env.tmp / "alias.yaml"
    alias_config.write_text(yaml.safe_dump(env.settings | {"root": str(alias)}, sort_keys=False))
    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed"
    script = f'mount --bind "{env.root}" "{alias}" && exec "$0" -m dispatcher --config "$1" run'
    with open(env.tmp / "alias.log", "wb") as log:
        proc = subprocess.Popen(
            [unshare, "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, str(alias_config)],
            stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=env.tmp,
        )  # fmt: skip

    def alive() -> list[int]:
        status = env.cli("status", "--json")  # exit 2 while the starting daemon holds the new ledger locked
        return [e["pid"] for e in json.loads(status.stdout)["daemons"] if e["alive"]] if status.returncode == 0 else []

    try:
        wait_until(lambda: alive() == [proc.pid], 30, "the daemon's entry")
        reload = env.cli("reload")
        assert reload.returncode == 0, reload.stderr
        assert reload.stdout.startswith(f"daemon {proc.pid} on "), reload.stdout
        assert "another pid namespace" not in reload.stderr
        wait_until(lambda: '"config.reloaded"' in (env.tmp / "alias.log").read_text(), 30, "config.reloaded in its log")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_an_order_read_before_a_reload_is_checked_against_the_new_config_before_its_claim(env: Env) -> None:
    """An order queued behind a running job (read, waiting for the agent's one slot), then a reload lowers
    `max_timeout` below its `timeout`: it is refused as one dropped after the reload is (section 2), not run
    under the limits it was read with. It ran with `timeout: 500` against `max_timeout: 100`."""
    agents = {"worker": env.agent("--sleep", "2", concurrency=1)}
    env.configure(agents, max_jobs=2, max_timeout=1000)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("RUNNING"))
    d.wait_event("agent.started", job_id="RUNNING")
    env.drop(order("QUEUED") | {"timeout": 500})
    d.wait_event("order.received", job_id="QUEUED")  # read: it waits for the slot RUNNING holds
    env.configure(agents, max_jobs=2, max_timeout=100)
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.wait_job("RUNNING", "done")
    refused = env.wait_refused("QUEUED")
    assert "max_timeout" in refused["reason"], refused
    assert [j for j, _ in env.starts()] == ["RUNNING"]
    assert d.stop() == 0
