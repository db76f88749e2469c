"""`--help` of every command, and shell completion for bash, zsh and fish."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

from dispatcher.cli.main import build_parser

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def dispatcher(*args: str, cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher ARGS` in cwd (no config there) and return the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env() | (extra_env or {}),
        timeout=60,
    )


def test_every_command_is_listed() -> None:
    """The parser has the contract's commands and `completion`."""
    assert {"init", "run", "submit", "validate", "status", "show", "retry", "cancel", "logs", "completion"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_exit_codes_and_an_example(tmp_path: Path, command: str | None) -> None:
    """`dispatcher [COMMAND] --help` works without a config and lists exit codes 0 and 2 and an example."""
    proc = dispatcher(*([command] if command else []), "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "exit codes:" in text and "\n  0 " in text and "\n  2 " in text, text
    example = text.split("example:\n", 1)[1]
    assert example.strip().startswith(("dispatcher ", "eval ", "journalctl ")), example
    if command is not None:
        assert f"dispatcher {command}" in example, "the example runs the command it documents"


def test_bash_completion_script_is_valid_bash(tmp_path: Path) -> None:
    """`dispatcher completion bash` prints a script that `bash -n` accepts and that registers `dispatcher`."""
    proc = dispatcher("completion", "bash", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "dispatcher.bash"
    script.write_text(proc.stdout)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    registered = subprocess.run(
        ["bash", "-c", f"source {script} && complete -p dispatcher"], capture_output=True, text=True, timeout=30
    )
    assert "dispatcher" in registered.stdout, registered.stderr


def test_bash_completion_completes_commands_and_options(tmp_path: Path) -> None:
    """Sourced in bash, the script completes `dispatcher logs --fo` to `--follow` through the real command."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "dispatcher"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m dispatcher "$@"\n')
    wrapper.chmod(0o755)
    script = tmp_path / "dispatcher.bash"
    script.write_text(dispatcher("completion", "bash", cwd=tmp_path).stdout)
    env = cli_env() | {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        code = (
            f"source {script}; COMP_LINE='{line}'; COMP_POINT={len(line)}; COMP_WORDS=({line}); "
            f"COMP_CWORD={len(words) - 1}; COMP_TYPE=9; _python_argcomplete dispatcher '{words[-1]}' '{words[-2]}'; "
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
        return [w.strip() for w in out.stdout.splitlines() if w.strip()]

    assert complete("dispatcher", "logs", "--fo") == ["--follow"]
    assert complete("dispatcher", "sta") == ["status"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_register_dispatcher(tmp_path: Path, shell: str) -> None:
    """`dispatcher completion zsh|fish` prints a script for that shell; where the shell is installed, it parses."""
    proc = dispatcher("completion", shell, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "dispatcher" in proc.stdout
    assert ("compdef" in proc.stdout) if shell == "zsh" else ("complete --command dispatcher" in proc.stdout)
    if shutil.which(shell):
        script = tmp_path / f"dispatcher.{shell}"
        script.write_text(proc.stdout)
        check = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr


def test_completion_of_an_unknown_shell_exits_2(tmp_path: Path) -> None:
    """`dispatcher completion tcsh` is bad usage: exit 2, one line."""
    proc = dispatcher("completion", "tcsh", cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1


def test_fish_completion_completes_commands(tmp_path: Path) -> None:
    """Sourced in fish, the script completes `dispatcher sta` to `status` through the real command."""
    if shutil.which("fish") is None:
        pytest.fail("fish is needed (Debian package fish; .ci/run installs it)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "dispatcher"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m dispatcher "$@"\n')
    wrapper.chmod(0o755)
    env = cli_env() | {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        ["fish", "-c", 'dispatcher completion fish | source; complete -C"dispatcher sta"'],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert [line.split("\t")[0] for line in out.stdout.splitlines()] == ["status"], out.stderr
