"""Real git repositories for the workspace tests, and the coding agent's config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import HERE, Env

CODER = HERE / "agents" / "coder.py"


def need(tool: str, package: str) -> str:
    """Return the path of tool; fail (never skip) naming the package when it is missing."""
    found = shutil.which(tool)
    assert found is not None, f"{tool} is not installed: install the {package} package (.ci/run does)"
    return found


def git(repo: Path, *args: str) -> str:
    """Run git in repo and return its stdout, stripped."""
    need("git", "git")
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(path: Path) -> Path:
    """Make a repository with one commit on main: README.md and src/app.py."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Tester")
    git(path, "config", "user.email", "tester@example.invalid")
    (path / "README.md").write_text("a repository\n")
    (path / "src").mkdir()
    (path / "src" / "app.py").write_text("print('hello')\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "first")
    return path


def coder(e: Env, repo: Path, *flags: str, **settings: Any) -> dict[str, Any]:
    """Return an agent running the coding agent in a worktree of repo."""
    spec: dict[str, Any] = {
        "command": [sys.executable, str(CODER), "--count", str(e.count_file), *flags],
        "timeout": 30,
        "writes": ["src/**"],
        "workspace": {"git": str(repo), "base": "main"},
    }
    spec.update(settings)
    return spec


def code_order(job_id: str, to: str = "coder", **extra: Any) -> dict[str, Any]:
    """Return a work order for the coding agent (no output file: the change is the work)."""
    return {"job_id": job_id, "from": "tester", "to": to, "task": "Change the code.", "items": [{"id": "R1"}]} | extra


def starts(env: Env) -> list[tuple[str, int, str]]:
    """Return (job_id, attempt, working folder) per start of the coding agent."""
    where = Path(f"{env.count_file}.cwd")
    if not where.exists():
        return []
    out = []
    for line in where.read_text().splitlines():
        job, attempt, cwd = line.split(" ", 2)
        out.append((job, int(attempt), cwd))
    return out
