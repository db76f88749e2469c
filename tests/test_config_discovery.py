"""Where the config comes from and what `init` and a missing root do (contract sections 3 and 7).

Every command runs as a real `python -m dispatcher` process in a fresh folder,
with no `$DISPATCHER_CONFIG` inherited, the way a user would meet it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import FAKE_AGENT, cli_env, order

SYSTEM_CONFIG = Path("/etc/dispatcher/dispatcher.yaml")
needs_no_system_config = pytest.mark.skipif(
    SYSTEM_CONFIG.exists(), reason="this machine has /etc/dispatcher/dispatcher.yaml, so a config is always found"
)


def dispatcher(cwd: Path, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher ARGS` in cwd and return the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env() | (extra_env or {}),
        timeout=90,
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """Assert the command wrote exactly one non-empty line on stderr, and return it."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def write_config(path: Path, root: str, **top: Any) -> Path:
    """Write a config with the fake agent as `worker` and this root."""
    path.parent.mkdir(parents=True, exist_ok=True)
    agent = {"command": [sys.executable, str(FAKE_AGENT)], "writes": ["out.csv"], "timeout": 30}
    path.write_text(yaml.safe_dump({"root": root, "settle": 0.2, "agents": {"worker": agent}, **top}))
    return path


def tree(top: Path) -> dict[str, Any]:
    """Return every path under top with its mode, mtime and bytes: what a second `init` must not change."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_mtime_ns, p.read_bytes() if p.is_file() else None)
    return out


# -- no config found --------------------------------------------------------------------------------

COMMANDS = [
    ("status",),
    ("status", "--json"),
    ("show", "JOB-1"),
    ("validate",),
    ("validate", "order.json"),
    ("submit", "order.json"),
    ("run", "--once"),
    ("retry", "JOB-1"),
    ("cancel", "JOB-1"),
    ("logs",),
    ("logs", "-"),
    ("logs", "order.json"),
    ("unit",),
]


@needs_no_system_config
@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_without_any_config_every_command_exits_2_naming_the_places_tried(tmp_path: Path, args: tuple[str]) -> None:
    """With no --config, no $DISPATCHER_CONFIG and no config file, a command exits 2 and names where it looked."""
    (tmp_path / "order.json").write_text(json.dumps(order("JOB-1", to="nobody")))
    proc = dispatcher(tmp_path, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = one_line(proc)
    assert line.startswith("no config found (looked in: "), line
    assert "./config/dispatcher.yaml" in line and "/etc/dispatcher/dispatcher.yaml" in line, line
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["order.json"], "a command made files without a config"


def test_a_missing_config_named_by_option_or_environment_is_not_passed_over(tmp_path: Path) -> None:
    """A missing --config or $DISPATCHER_CONFIG file exits 2 naming it, even with ./config/dispatcher.yaml there."""
    (tmp_path / "dispatch").mkdir()
    write_config(tmp_path / "config" / "dispatcher.yaml", "../dispatch")
    proc = dispatcher(tmp_path, "--config", "typo.yaml", "status")
    assert proc.returncode == 2
    assert one_line(proc) == "no config found (looked in: typo.yaml (--config))"
    proc = dispatcher(tmp_path, "status", extra_env={"DISPATCHER_CONFIG": str(tmp_path / "gone.yaml")})
    assert proc.returncode == 2
    assert one_line(proc) == f"no config found (looked in: {tmp_path / 'gone.yaml'} ($DISPATCHER_CONFIG))"


@pytest.mark.parametrize("args", [("unit",), ("unit", "--template"), ("unit", "--logrotate")], ids=" ".join)
def test_unit_with_a_config_that_does_not_load_exits_2_naming_the_file(tmp_path: Path, args: tuple[str]) -> None:
    """`unit` with a --config that is not valid YAML, or lacks `agents`, exits 2 with one line naming the file and
    prints no unit (section 7: a bad config is exit 2); it printed the unit and exited 0."""
    (tmp_path / "broken.yaml").write_text("root: [\n")
    (tmp_path / "empty.yaml").write_text(f"root: {tmp_path / 'dispatch'}\n")
    for name, field in (("broken.yaml", "not valid YAML"), ("empty.yaml", "agents")):
        proc = dispatcher(tmp_path, "--config", name, *args)
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        line = one_line(proc)
        assert line.startswith(f"{name}: ") and field in line, line
        assert proc.stdout == ""


@pytest.mark.parametrize("command", ["status", "validate", "init", "run"])
def test_an_empty_config_option_is_an_error_not_the_next_place(tmp_path: Path, command: str) -> None:
    """`--config ""` (as `--config "$CFG"` with CFG unset gives) exits 2 saying so; it used ./config/dispatcher.yaml,
    which the README says a named file is never passed over for. Nothing is made."""
    (tmp_path / "dispatch").mkdir()
    write_config(tmp_path / "config" / "dispatcher.yaml", "../dispatch")
    before = tree(tmp_path)
    proc = dispatcher(tmp_path, "--config", "", command)
    assert (proc.returncode, one_line(proc)) == (2, "--config: the file name is empty")
    assert tree(tmp_path) == before


def test_config_is_the_first_of_option_environment_and_cwd_file(tmp_path: Path) -> None:
    """--config beats $DISPATCHER_CONFIG, which beats ./config/dispatcher.yaml; the one used is named."""
    (tmp_path / "dispatch").mkdir()
    write_config(tmp_path / "config" / "dispatcher.yaml", "../dispatch")
    env_cfg = write_config(tmp_path / "env.yaml", "dispatch")
    opt_cfg = write_config(tmp_path / "opt.yaml", "dispatch")
    assert dispatcher(tmp_path, "validate").stdout == "config/dispatcher.yaml: ok (1 agent)\n"
    by_env = {"DISPATCHER_CONFIG": str(env_cfg)}
    assert dispatcher(tmp_path, "validate", extra_env=by_env).stdout == f"{env_cfg}: ok (1 agent)\n"
    proc = dispatcher(tmp_path, "--config", "opt.yaml", "validate", extra_env=by_env)
    assert proc.stdout == "opt.yaml: ok (1 agent)\n", proc.stderr
    assert opt_cfg.exists()


def test_validate_of_an_order_for_an_unknown_agent_fails_against_the_found_config(tmp_path: Path) -> None:
    """`validate FILE` uses the discovered config: an order for an agent it lacks is an error naming `to`."""
    (tmp_path / "dispatch").mkdir()
    write_config(tmp_path / "config" / "dispatcher.yaml", "../dispatch")
    (tmp_path / "order.json").write_text(json.dumps(order("JOB-1", to="nobody")))
    proc = dispatcher(tmp_path, "validate", "order.json")
    assert proc.returncode == 2
    assert one_line(proc).startswith("order.json: to: ")


# -- the root must exist ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [("run", "--once"), ("status",), ("show", "JOB-1"), ("retry", "JOB-1"), ("cancel", "JOB-1")]
)
def test_a_root_that_does_not_exist_is_an_error_naming_it(tmp_path: Path, args: tuple[str, ...]) -> None:
    """`--root` with a typo exits 2 naming that root, and nothing is created there."""
    (tmp_path / "dispatch").mkdir()
    cfg = write_config(tmp_path / "dispatcher.yaml", "dispatch")
    typo = tmp_path / "dispatc"
    proc = dispatcher(tmp_path, "--config", str(cfg), "--root", str(typo), *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert str(typo) in one_line(proc)
    assert not typo.exists()


def test_a_configured_root_that_does_not_exist_stops_run(tmp_path: Path) -> None:
    """A config whose root: names a missing folder makes `run` exit 2 naming the folder, before any log line."""
    cfg = write_config(tmp_path / "etc" / "dispatcher.yaml", "../spool")
    proc = dispatcher(tmp_path, "--config", str(cfg), "run")
    assert proc.returncode == 2
    assert str(tmp_path / "spool") in one_line(proc)
    assert proc.stdout == ""
    assert not (tmp_path / "spool").exists()


def test_run_makes_the_missing_folders_inside_an_existing_root(tmp_path: Path) -> None:
    """`run --once` on an empty existing root makes inbox/, active/, done/ and failed/ and exits 0."""
    (tmp_path / "dispatch").mkdir()
    cfg = write_config(tmp_path / "dispatcher.yaml", "dispatch")
    proc = dispatcher(tmp_path, "--config", str(cfg), "run", "--once")
    assert proc.returncode == 0, proc.stderr
    for name in ("inbox", "active", "done", "failed"):
        assert (tmp_path / "dispatch" / name).is_dir(), name


# -- init -------------------------------------------------------------------------------------------


@needs_no_system_config
def test_init_writes_a_starter_config_and_explains_where_and_relative_to_what(tmp_path: Path) -> None:
    """`init DIR` in a folder without a config writes ./config/dispatcher.yaml, says where, and how root: reads."""
    proc = dispatcher(tmp_path, "init", "spool")
    assert proc.returncode == 0, proc.stderr
    cfg = tmp_path / "config" / "dispatcher.yaml"
    assert yaml.safe_load(cfg.read_text())["root"] == "../spool"
    assert f"wrote {cfg}" in proc.stdout
    assert f"relative to {cfg.parent}" in proc.stdout, proc.stdout
    assert str(tmp_path / "spool") in proc.stdout
    status = dispatcher(tmp_path, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counts"]["inbox"] == 0


@needs_no_system_config
def test_a_second_init_changes_nothing_and_exits_0(tmp_path: Path) -> None:
    """Running `init DIR` twice leaves every file and folder as the first run made it."""
    assert dispatcher(tmp_path, "init", "spool").returncode == 0
    before = tree(tmp_path)
    again = dispatcher(tmp_path, "init", "spool")
    assert again.returncode == 0, again.stderr
    assert tree(tmp_path) == before
    assert "wrote" not in again.stdout and "created" not in again.stdout


def test_init_of_a_root_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    """`init DIR` where DIR is a file: exit 2 with one line naming it; the file and the folder stay as they were."""
    (tmp_path / "spool").write_text("a file\n")
    proc = dispatcher(tmp_path, "init", "spool")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"{tmp_path / 'spool'}: is not a folder; init makes the dispatch root there\n"
    assert (tmp_path / "spool").read_text() == "a file\n" and sorted(p.name for p in tmp_path.iterdir()) == ["spool"]


def test_init_never_overwrites_a_config_and_says_when_its_root_differs(tmp_path: Path) -> None:
    """`init OTHER` with an existing config makes OTHER, leaves the config byte for byte, and says its root differs."""
    cfg = write_config(tmp_path / "etc" / "dispatcher.yaml", "../spool")
    before = cfg.read_bytes()
    proc = dispatcher(tmp_path, "--config", str(cfg), "init", "other")
    assert proc.returncode == 0, proc.stderr
    assert cfg.read_bytes() == before
    assert (tmp_path / "other" / "inbox").is_dir()
    assert str(tmp_path / "spool") in proc.stdout, "the note names the root the config really uses"


@pytest.mark.parametrize("name", ["my root #1", "a: b", "yes", "1234", "[x]", "it's"])
def test_init_of_a_root_with_a_yaml_minded_name_writes_a_config_that_reads_it_back(tmp_path: Path, name: str) -> None:
    """A root named `my root #1`, `a: b` or `yes`: the starter config says that very folder (quoted where YAML
    would read it otherwise), and the next command finds the root."""
    proc = dispatcher(tmp_path, "init", name)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((tmp_path / "config" / "dispatcher.yaml").read_text())["root"] == f"../{name}"
    status = dispatcher(tmp_path, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert (tmp_path / name / "inbox").is_dir()


@needs_no_system_config
def test_init_with_a_json_config_path_writes_a_json_starter(tmp_path: Path) -> None:
    """`init --config X.json` writes a config X.json reads as (JSON, by its name), with the starter's values."""
    proc = dispatcher(tmp_path, "--config", "cfg/dispatcher.json", "init", "spool")
    assert proc.returncode == 0, proc.stderr
    body = json.loads((tmp_path / "cfg" / "dispatcher.json").read_text())
    assert body["root"] == "../spool" and body["max_jobs"] == 2 and body["agents"]
    status = dispatcher(tmp_path, "--config", "cfg/dispatcher.json", "status", "--json")
    assert status.returncode == 0, status.stderr


def test_an_error_naming_a_path_stays_one_escaped_line(tmp_path: Path) -> None:
    """A root whose name holds a line break, an escape and a byte that is no UTF-8: the error is one line, with
    them escaped, and no Python notation (`\\udcff`)."""
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\nx\x1b\xff")
    (tmp_path / "c.yaml").write_text(f"root: dispatch\nagents: {{a: {{command: [{sys.executable}]}}}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(tmp_path / "c.yaml"), "--root", odd, "status"],
        capture_output=True,
        cwd=tmp_path,
        env=cli_env(),
        timeout=60,
    )
    assert proc.returncode == 2
    err = proc.stderr.decode("utf-8")
    assert err.count("\n") == 1 and "\x1b" not in err and "udcff" not in err, err
    assert "r\\nx\\x1b\\xff" in err, err


def test_init_of_a_folder_whose_name_is_no_utf8_is_refused(tmp_path: Path) -> None:
    """`init` of a root no config can name (its path is no UTF-8 text): exit 2, one line, nothing made."""
    odd = os.fsdecode(b"r\xff")
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "init", odd],
        capture_output=True,
        cwd=tmp_path,
        env=cli_env(),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_validate_config_as_the_contract_writes_it_checks_the_config_found(tmp_path: Path) -> None:
    """`dispatcher validate --config` (the contract's form, no FILE) checks the config found as usual, as a bare
    `validate` does; `--config FILE` after validate still names the file. It was a usage error ("expected one
    argument")."""
    (tmp_path / "dispatch").mkdir()
    found = write_config(tmp_path / "config" / "dispatcher.yaml", "../dispatch")
    proc = dispatcher(tmp_path, "validate", "--config")
    assert (proc.returncode, proc.stdout) == (0, "config/dispatcher.yaml: ok (1 agent)\n"), proc.stderr
    other = write_config(tmp_path / "other.yaml", "dispatch", max_jobs=3)
    proc = dispatcher(tmp_path, "--config", str(other), "validate", "--config")
    assert (proc.returncode, proc.stdout) == (0, f"{other}: ok (1 agent)\n"), proc.stderr
    proc = dispatcher(tmp_path, "validate", "--config", str(found))
    assert (proc.returncode, proc.stdout) == (0, f"{found}: ok (1 agent)\n"), proc.stderr
    (tmp_path / "config" / "dispatcher.yaml").write_text("agents: {w: {command: [/no/such/program]}}\n")
    proc = dispatcher(tmp_path, "validate", "--config")
    assert proc.returncode == 2 and "agents.w.command" in one_line(proc)


def test_a_root_too_deep_for_sqlite_is_said_by_every_command(tmp_path: Path) -> None:
    """A root whose ledger's path passes what SQLite opens (about 500 bytes): `init`, `status`, `list`, `submit` and
    `run` exit 2 with one line saying so (README, limits: "submit, run and the rest exit 2 saying so"); `init`
    made the root and `status` and `list` called it empty and healthy."""
    root = tmp_path / ("a" * 200) / ("b" * 200)
    root = root / ("c" * max(1, 484 - len(os.fsencode(str(root)))))  # its ledger's path: 506 bytes
    cfg = write_config(tmp_path / "cfg.yaml", str(root))
    order_file = tmp_path / "o.json"
    order_file.write_text(json.dumps(order("DEEP-1")))
    said = f"{root / '.state' / 'ledger.sqlite3'}: the ledger cannot be opened (its path is "
    proc = dispatcher(tmp_path, "--config", str(cfg), "init")
    assert proc.returncode == 2 and said in one_line(proc), proc.stdout + proc.stderr
    assert not root.exists()
    root.mkdir(parents=True)  # made by hand: the other commands say the same
    for args in (("status",), ("list",), ("submit", str(order_file)), ("run", "--once")):
        proc = dispatcher(tmp_path, "--config", str(cfg), *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert said in one_line(proc) and "SQLite takes at most about 500; use a shorter root" in proc.stderr, args
