"""The distribution: a name of its own on PyPI, the `dispatcher` command and import package kept."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_distribution_name_is_not_the_taken_dispatcher() -> None:
    """`dispatcher` on PyPI is an unrelated project: the distribution is published as folder-dispatcher."""
    assert PROJECT["project"]["name"] == "folder-dispatcher"


def test_the_command_and_import_package_stay_dispatcher() -> None:
    """Installing it gives the `dispatcher` command (dispatcher.cli:main) and the `dispatcher` package."""
    assert PROJECT["project"]["scripts"] == {"dispatcher": "dispatcher.cli:main"}
    assert PROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["dispatcher"]


def test_readme_installs_it_by_that_name() -> None:
    """The README tells you to `pipx install folder-dispatcher`."""
    assert "pipx install folder-dispatcher" in (ROOT / "README.md").read_text()
