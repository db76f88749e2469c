"""Run the CLI or the daemon as another user (`nobody`), the way a service user or a group member does."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
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


def as_user(python: str, *args: str) -> list[str]:
    """Return the argv that runs `python -m dispatcher ARGS` as USER with this checkout and its packages."""
    site = sysconfig.get_paths()["purelib"]
    return ["runuser", "-u", USER, "--", "env", f"PYTHONPATH={CHECKOUT}:{site}", "HOME=/tmp", python, "-m",
            "dispatcher", *args]  # fmt: skip
