"""`dispatcher unit`: print the files a systemd install needs, from the installed package.

The units ship inside the package (``dispatcher/data/systemd``), so an install from
the wheel has them without a clone. ``ExecStart=`` and ``ExecReload=`` name the
`dispatcher` command that printed them, so the unit runs the copy you installed.
"""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from pathlib import Path

#: the command path the shipped units name; replaced by the installed one
PLACEHOLDER = "/usr/local/bin/dispatcher"
NOTIFY_EXAMPLES = ("append", "webhook")


def data_text(*parts: str) -> str:
    """Return the text of a file shipped in dispatcher/data."""
    return resources.files("dispatcher").joinpath("data", *parts).read_text(encoding="utf-8")


def installed_command(argv0: str | None = None) -> str:
    """Return the absolute path of the `dispatcher` command that runs now (symlinks kept, as pipx makes them).

    ``python -m dispatcher`` has no such command: then the one beside the
    interpreter, then the one on PATH; failing all, the interpreter with ``-m dispatcher``.
    """
    argv0 = sys.argv[0] if argv0 is None else argv0
    candidates = [Path(argv0)] if Path(argv0).name == "dispatcher" else []
    candidates.append(Path(sys.executable).parent / "dispatcher")
    found = shutil.which("dispatcher")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return os.path.abspath(path)
    return f"{os.path.abspath(sys.executable)} -m dispatcher"


def unit_text(*, template: bool = False, web: bool = False, command: str | None = None) -> str:
    """Return dispatcher.service (dispatcher@.service, dispatcher-web.service) naming the installed command."""
    name = "dispatcher-web.service" if web else "dispatcher@.service" if template else "dispatcher.service"
    text = data_text("systemd", name)
    command = (command or installed_command()).replace("%", "%%")  # systemd reads %x as a specifier
    program, module = command, ""
    if command.endswith(" -m dispatcher"):  # an interpreter with -m: only its path may need quotes
        program, module = command[: -len(" -m dispatcher")], " -m dispatcher"
    if " " in program:
        program = f'"{program}"'
    return text.replace(PLACEHOLDER, program + module)


def logrotate_text() -> str:
    """Return the logrotate file for /etc/logrotate.d/dispatcher."""
    return data_text("systemd", "dispatcher.logrotate")


def notify_text(name: str) -> str:
    """Return the example notify script `name` (append or webhook)."""
    return data_text("notify", f"{name}.sh")
