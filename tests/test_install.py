"""Installed from the built wheel, outside the checkout: the README's install and systemd steps work.

The wheel is built from the checkout (`pip wheel . --no-deps`) and installed into a fresh
virtualenv in a temporary folder; its dependencies come from pip's configured index (or
its find-links). Every command then runs from a folder that is not the checkout, with the
installed `dispatcher`, the way someone who never cloned the repository runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CHECKOUT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """Build the wheel, install it into a new virtualenv; return (its bin/, a work folder, the environment)."""
    base = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "NOTIFY_", "PYTHON", "VIRTUAL_ENV"))}
    env["HOME"] = str(base)
    wheels = base / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(CHECKOUT)], base, env)
    assert built.returncode == 0, f"pip wheel failed: {built.stderr[-2000:]}"
    wheel = next(wheels.glob("folder_dispatcher-*.whl"))
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], base, env)
    assert made.returncode == 0, made.stderr
    got = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], base, env)
    assert got.returncode == 0, f"installing the wheel failed (needs pip's index or find-links): {got.stderr[-2000:]}"
    work = base / "work"
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv / "bin", work, env


def _with_config(work: Path, env: dict[str, str]) -> dict[str, str]:
    """Return env naming a config file (every command but init needs one; `unit` only that it exists)."""
    config = work / "unit-config.yaml"
    config.write_text("root: /srv/dispatch\nagents: {}\n")
    return {**env, "DISPATCHER_CONFIG": str(config)}


def test_the_wheel_holds_the_units_and_the_notify_examples(installed: tuple[Path, Path, dict[str, str]]) -> None:
    """`dispatcher unit` (and --template, --logrotate, --notify) print the shipped files from the installed wheel."""
    bindir, work, env = installed
    env = _with_config(work, env)  # as the README's steps: the config is in place before the units
    command = str(bindir / "dispatcher")
    unit = _run([command, "unit"], work, env)
    assert unit.returncode == 0, unit.stderr
    assert f"ExecStart={command} --config /etc/dispatcher/dispatcher.yaml run" in unit.stdout
    assert f"ExecReload={command} --config /etc/dispatcher/dispatcher.yaml validate" in unit.stdout
    template = _run([command, "unit", "--template"], work, env)
    assert f"ExecStart={command} --config /etc/dispatcher/%i.yaml run" in template.stdout
    web = _run([command, "unit", "--web"], work, env)
    assert f"ExecStart={command} --config /etc/dispatcher/dispatcher.yaml web" in web.stdout
    rotate = _run([command, "unit", "--logrotate"], work, env)
    assert "/var/log/dispatcher/*.log" in rotate.stdout
    for name in ("append", "webhook"):
        script = _run([command, "unit", "--notify", name], work, env)
        assert script.returncode == 0 and script.stdout.startswith("#!/bin/sh"), script.stderr


def test_the_printed_units_verify(installed: tuple[Path, Path, dict[str, str]]) -> None:
    """`systemd-analyze verify` accepts both printed units as written (their ExecStart= exists)."""
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze not found: install Debian's systemd package (.ci/run does)"
    bindir, work, env = installed
    env = _with_config(work, env)
    units = work / "units"
    units.mkdir(exist_ok=True)
    for name, extra in (("dispatcher.service", []), ("dispatcher@.service", ["--template"])):
        text = _run([str(bindir / "dispatcher"), "unit", *extra], work, env).stdout
        (units / name).write_text(text)
    shutil.copy(units / "dispatcher@.service", units / "dispatcher@demo.service")
    for name in ("dispatcher.service", "dispatcher@demo.service"):
        proc = _run([tool, "verify", str(units / name)], units, env, timeout=120)
        noise = [line for line in proc.stderr.splitlines() if name.split("@")[0] in line]
        assert proc.returncode == 0 and not noise, proc.stderr


def test_quick_start_from_the_wheel(installed: tuple[Path, Path, dict[str, str]]) -> None:
    """`init` in an empty folder, then submit, `run --once` and status work with the installed command."""
    bindir, work, env = installed
    command = str(bindir / "dispatcher")
    first = work / "first"
    first.mkdir()
    init = _run([command, "init", "./dispatch"], first, env)
    assert init.returncode == 0, init.stderr
    assert (first / "config" / "dispatcher.yaml").is_file() and (first / "dispatch" / "inbox").is_dir()
    order = {"job_id": "HELLO-1", "from": "me", "to": "echo", "task": "Say hello.", "items": [{"id": "A"}]}
    (first / "hello.yaml").write_text(yaml.safe_dump(order))
    sub = _run([command, "submit", "hello.yaml"], first, env)
    assert sub.returncode == 0 and sub.stdout.strip() == "HELLO-1", sub.stderr
    run = _run([command, "run", "--once"], first, env, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (first / "dispatch" / "done" / "HELLO-1" / "result.json").is_file()
    status = _run([command, "status"], first, env)
    assert status.returncode == 0 and "done 1" in status.stdout.replace(":", ""), status.stdout
