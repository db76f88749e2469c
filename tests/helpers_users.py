"""Run the CLI or the daemon as another user (`nobody`), the way a service user or a group member does."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent
USER = "nobody"
GROUP = "nogroup"


def interpreter() -> str:
    """Return a Python of this version that USER may execute (this one may sit in root's home)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, os.path.realpath(sys.executable), f"/usr/bin/python{version}"):
        probe = subprocess.run(
            ["runuser", "-u", USER, "--", candidate, "-c", f"import sys; assert sys.version.startswith('{version}')"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return candidate
    pytest.fail(f"no python{version} that the user {USER} may run (install Debian's python{version})")


def _user_reads(path: Path) -> bool:
    return subprocess.run(["runuser", "-u", USER, "--", "test", "-r", str(path)], capture_output=True).returncode == 0


@functools.cache
def readable() -> tuple[Path, Path]:
    """Return (checkout, site-packages) as USER can read them: these, or a world-readable copy made once.

    A checkout in a private folder (`mktemp -d` makes one 0700) is out of USER's reach; the
    package, the fake agents and the installed dependencies are then copied for this run.
    """
    site = Path(sysconfig.get_paths()["purelib"])
    if _user_reads(CHECKOUT / "dispatcher" / "__init__.py") and _user_reads(site / "structlog" / "__init__.py"):
        return CHECKOUT, site
    copy = Path(tempfile.mkdtemp(prefix="dispatcher-as-user-"))
    atexit.register(shutil.rmtree, copy, True)
    skip = shutil.ignore_patterns("__pycache__", "mypy*", "*mypyc*", "selenium*", "pip", "pip-*", "ruff*", "pygments*")
    shutil.copytree(CHECKOUT / "dispatcher", copy / "checkout" / "dispatcher", ignore=skip)
    shutil.copytree(CHECKOUT / "tests" / "agents", copy / "checkout" / "tests" / "agents", ignore=skip)
    shutil.copytree(site, copy / "site", ignore=skip, symlinks=True)
    for folder, dirs, files in os.walk(copy):
        for name in (*dirs, *files):
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o444 | (0o111 if name in dirs else 0))
    os.chmod(copy, 0o755)  # noqa: S103 - USER must reach the copy
    return copy / "checkout", copy / "site"


def user_path(path: Path) -> Path:
    """Return path (a file of the checkout) where USER reads it (see ``readable``)."""
    return readable()[0] / path.relative_to(CHECKOUT)


def as_user(python: str, *args: str) -> list[str]:
    """Return the argv that runs `python -m dispatcher ARGS` as USER with this checkout and its packages."""
    checkout, site = readable()
    return ["runuser", "-u", USER, "--", "env", f"PYTHONPATH={checkout}:{site}", "HOME=/tmp", python, "-m",
            "dispatcher", *args]  # fmt: skip
