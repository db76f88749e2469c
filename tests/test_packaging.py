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


def test_readme_installs_it_from_the_clone_until_it_is_published() -> None:
    """The README installs with `pipx install ./` (not yet on PyPI) and names the distribution folder-dispatcher."""
    text = (ROOT / "README.md").read_text()
    assert "pipx install ./" in text and "not published on PyPI yet" in text
    assert "pipx install folder-dispatcher" in text
