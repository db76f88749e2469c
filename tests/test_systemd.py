"""The systemd units: they verify, score at most 2.0 exposed, and keep what agents need.

`systemd-analyze` (Debian's systemd package; .ci/run installs it when missing, or name one
with $DISPATCHER_SYSTEMD_ANALYZE) checks copies of the units whose ExecStart= and
ExecReload= point at an executable that exists here, since verify insists on that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dispatcher.cli.unit import unit_text

SYSTEMD = Path(__file__).resolve().parent.parent / "dispatcher" / "data" / "systemd"
UNITS = {"dispatcher.service": "dispatcher.service", "dispatcher@.service": "dispatcher@test.service"}
#: the web view's unit (section 17): verified and scored like the others, checked on its own below
WEB_UNIT = {"dispatcher-web.service": "dispatcher-web.service"}
ALL_UNITS = UNITS | WEB_UNIT
MAX_EXPOSURE = 2.0


def analyze() -> str:
    """Return the systemd-analyze to run, or fail naming how to get one."""
    tool = os.environ.get("DISPATCHER_SYSTEMD_ANALYZE") or shutil.which("systemd-analyze")
    if not tool:
        pytest.fail(
            "systemd-analyze not found: install Debian's systemd package (.ci/run does) "
            "or set DISPATCHER_SYSTEMD_ANALYZE"
        )
    return tool


def settings(text: str) -> list[tuple[str, str]]:
    """Return the unit's (key, value) lines in order, comments left out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.append((key.strip(), value.strip()))
    return out


def comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))


@pytest.fixture
def units(tmp_path: Path) -> Path:
    """Copy both units into a folder with /usr/local/bin/dispatcher replaced by an existing executable."""
    true = shutil.which("true")
    assert true, "no `true` on PATH"
    for name in ALL_UNITS:
        text = (SYSTEMD / name).read_text()
        assert "/usr/local/bin/dispatcher " in text
        (tmp_path / name).write_text(text.replace("/usr/local/bin/dispatcher ", f"{true} "))
    return tmp_path


@pytest.mark.parametrize("name", ALL_UNITS)
def test_unit_verifies_without_a_warning(units: Path, name: str) -> None:
    """`systemd-analyze verify` accepts the unit and prints nothing about it (an unknown key or bad value would)."""
    proc = subprocess.run(
        [analyze(), "verify", str(units / ALL_UNITS[name])], capture_output=True, text=True, timeout=120, cwd=units
    )
    about = [line for line in (proc.stdout + proc.stderr).splitlines() if "dispatcher" in line]
    assert proc.returncode == 0 and about == [], proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ALL_UNITS)
def test_exposure_is_at_most_2_and_every_remaining_item_is_explained(units: Path, name: str) -> None:
    """`systemd-analyze security --offline=true` rates the unit <= 2.0; each item still open is named in a comment."""
    proc = subprocess.run(
        [analyze(), "security", "--offline=true", "--no-pager", str(units / ALL_UNITS[name])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=units,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, proc.stdout
    notes = comments((SYSTEMD / name).read_text())
    for line in proc.stdout.splitlines():
        if not line.startswith("✗"):
            continue
        item = line[1:].split()[0]  # e.g. SystemCallFilter=~@resources, RootDirectory=/RootImage=
        key, _, rest = item.partition("=")
        word = rest.lstrip("~").replace("(", "").replace(")", "").split("|")[0] if rest.startswith("~") else key
        assert word in notes, f"{item} is counted against the unit but no comment explains it"


@pytest.mark.parametrize("name", UNITS)
def test_unit_keeps_what_agents_and_operators_need(name: str) -> None:
    """Network families for model APIs, no MemoryDenyWriteExecute, notify + watchdog, the three directories."""
    text = (SYSTEMD / name).read_text()
    keys = dict(settings(text))
    assert keys["Type"] == "notify" and keys["WatchdogSec"] == "30"
    assert keys["KillMode"] == "mixed" and keys["OOMPolicy"] == "continue"
    assert {"AF_INET", "AF_INET6"} <= set(keys["RestrictAddressFamilies"].split())
    assert keys.get("MemoryDenyWriteExecute", "no") == "no"
    assert keys.get("PrivateNetwork", "no") == "no"
    assert "IPAddressDeny" not in keys
    assert keys["LogsDirectory"] == "dispatcher"
    assert keys["StateDirectory"].split()[0].startswith("dispatcher")
    assert keys["ConfigurationDirectory"] == "dispatcher"
    assert keys["ProtectSystem"] == "strict"
    assert re.search(r"^#\s*MemoryMax=", text, re.M) and re.search(r"^#\s*TasksMax=", text, re.M)
    assert re.search(r"^#\s*LoadCredential=", text, re.M) and re.search(r"^#\s*EnvironmentFile=", text, re.M)
    assert "MemoryDenyWriteExecute" in comments(text) and "JIT" in comments(text)


@pytest.mark.parametrize("name", UNITS)
def test_reload_validates_the_config_before_the_sighup(name: str) -> None:
    """ExecReload= runs `dispatcher ... validate` first and `kill -HUP $MAINPID` second, both without `-`."""
    reloads = [value for key, value in settings((SYSTEMD / name).read_text()) if key == "ExecReload"]
    assert len(reloads) == 2, reloads
    config = "/etc/dispatcher/dispatcher.yaml" if name == "dispatcher.service" else "/etc/dispatcher/%i.yaml"
    assert reloads[0].endswith(f"dispatcher --config {config} validate") and not reloads[0].startswith("-")
    assert reloads[1] == "/bin/kill -HUP $MAINPID"
    starts = [value for key, value in settings((SYSTEMD / name).read_text()) if key == "ExecStart"]
    assert starts == [f"/usr/local/bin/dispatcher --config {config} run"]


def test_logrotate_signals_the_daemons_directly() -> None:
    """postrotate sends SIGHUP to the main process of every dispatcher unit, bypassing the validating reload."""
    text = (SYSTEMD / "dispatcher.logrotate").read_text()
    assert "/var/log/dispatcher/*.log" in text
    post = text.split("postrotate", 1)[1].split("endscript", 1)[0]
    assert "--signal=HUP" in post and "--kill-who=main" in post
    assert "dispatcher.service" in post and "'dispatcher@*.service'" in post
    assert "su dispatcher dispatcher" in text and "create 0640 dispatcher dispatcher" in text


def test_web_unit_serves_the_view_on_loopback_with_write_access_to_the_root() -> None:
    """dispatcher-web.service runs `dispatcher ... web` on 127.0.0.1:8700 as the daemon's user, with its root."""
    text = (SYSTEMD / "dispatcher-web.service").read_text()
    keys = dict(settings(text))
    assert (
        keys["ExecStart"]
        == "/usr/local/bin/dispatcher --config /etc/dispatcher/dispatcher.yaml web --listen 127.0.0.1:8700"
    )
    assert keys["User"] == "dispatcher" and keys["StateDirectory"] == "dispatcher dispatcher/dispatch"
    assert keys["RestartPreventExitStatus"] == "2" and keys["MemoryDenyWriteExecute"] == "yes"
    assert "web_token_file" in comments(text)


@pytest.mark.parametrize(
    ("command", "exec_start"),
    [
        ("/opt/dispatcher/bin/dispatcher", "/opt/dispatcher/bin/dispatcher"),
        ("/opt/my tools/bin/dispatcher", '"/opt/my tools/bin/dispatcher"'),
        ("/opt/50%i/bin/dispatcher", "/opt/50%%i/bin/dispatcher"),
        ("/opt/my env/bin/python3 -m dispatcher", '"/opt/my env/bin/python3" -m dispatcher'),
    ],
    ids=["plain", "space", "percent", "interpreter-with-space"],
)
def test_the_printed_unit_names_any_installed_path_as_systemd_reads_it(command: str, exec_start: str) -> None:
    """`dispatcher unit` writes the command so that systemd runs that very path: a space is quoted (for `-m`, the
    interpreter's path only), and `%` is doubled, since systemd reads `%i` and the like as specifiers."""
    text = unit_text(command=command)
    assert f"ExecStart={exec_start} " in text, text
