"""What a git worktree and the bubblewrap sandbox cost per job (contract section 15).

Usage: python benchmarks/workspace_cost.py [--jobs 20] [--files 200]

Worktree: the daemon's own steps for one job on a repository of --files small files
(resolve base and make the worktree, save one attempt's diff, commit what is left and
remove the worktree), run in this process as the daemon runs them in its io pool.
Sandbox: spawning `true` bare and under bwrap with the daemon's arguments. Wall time
and the CPU of the child processes (rusage) are shown per job; CPU is steadier on a
shared machine.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatcher.job import sandbox, worktree
from dispatcher.spec.settings import RepoSettings


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _measure(label: str, n: int, step: object) -> None:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    for i in range(n):
        step(i)  # type: ignore[operator]
    wall, cpu = (time.perf_counter() - t0) / n, (_children_cpu() - cpu0) / n
    print(f"{label:<44} {wall * 1000:8.1f} ms wall {cpu * 1000:8.1f} ms CPU per job")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--files", type=int, default=200)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dispatcher-bench-", dir="/var/tmp") as tmp:
        base = Path(tmp)
        repo = base / "repo"
        repo.mkdir()
        git = ["git", "-c", "user.name=b", "-c", "user.email=b@b"]
        subprocess.run([*git, "init", "-q", "-b", "main"], cwd=repo, check=True)
        for i in range(a.files):
            (repo / f"f{i:04d}.py").write_text(f"x = {i}\n" * 20)
        subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "-m", "init"], cwd=repo, check=True)
        print(f"repository: {a.files} files; {a.jobs} jobs per row")

        def one_job(i: int) -> None:
            folder = base / "jobs" / str(i)
            folder.mkdir(parents=True)
            path = base / "worktrees" / f"J{i}"
            ws = worktree.plan(folder, str(repo), "main", f"dispatch/J{i}", path)
            worktree.create(ws, from_branch=False)
            (path / f"new{i}.py").write_text("y = 1\n")
            worktree.snapshot(ws, folder)
            worktree.seal(ws, f"J{i}")
            worktree.clear(ws)

        _measure("worktree: make, diff, commit, remove", a.jobs, one_job)
        argv = ["true"]
        env = {"PATH": "/usr/bin:/bin"}
        wrapped = sandbox.wrap(
            argv,
            cwd=base,
            writable=sandbox.writable_paths(RepoSettings(sandbox=True), base, None, (), "/root"),
            network=True,
            env=env,
        )
        cut = sandbox.wrap(argv, cwd=base, writable=[str(base)], network=False, env=env)
        runs = a.jobs * 5
        _measure("spawn `true` bare", runs, lambda _i: subprocess.run(argv, check=True))
        _measure("spawn `true` under bwrap", runs, lambda _i: subprocess.run(wrapped, check=True))
        _measure("spawn `true` under bwrap --unshare-net", runs, lambda _i: subprocess.run(cut, check=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
