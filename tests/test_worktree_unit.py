"""Section 15 close to the units: writes_scope over a workspace's changed paths, the diff's bound, locked worktrees."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Env, wait_until
from git_helpers import code_order, coder, git, make_repo, starts
from test_checks_unit import evidence, files

from dispatcher.checks.builtin import writes_scope
from dispatcher.job import gitview, worktree
from dispatcher.spec.repo import branch_for


def test_writes_scope_checks_the_changed_paths_against_writes_globs() -> None:
    """With a workspace, writes globs apply to the changed paths; every path outside is named."""
    ok = writes_scope(evidence(writes=("src/**",), changed=("src/a.py", "src/b/c.py"), entries=files("receipt.json")))
    assert (ok.ok, ok.detail) == (True, "every changed path (2) is inside writes")
    bad = writes_scope(evidence(writes=("src/**",), changed=("src/a.py", "README.md", "docs/x"), entries=files()))
    assert (bad.ok, bad.detail) == (False, "changed outside writes (src/**): README.md, docs/x")


def test_with_a_workspace_work_takes_only_the_receipt_outbox_and_output() -> None:
    """A file the agent leaves in work/ beside its receipt, outbox and output fails writes_scope."""
    res = writes_scope(evidence(writes=("src/**",), changed=(), entries=files("out.csv", "receipt.json", "notes.txt")))
    assert (res.ok, res.detail) == (False, "work/notes.txt is outside the receipt, outbox/ and the output")


def _worktree(tmp_path: Path, job_id: str) -> tuple[Path, Path, worktree.Workspace]:
    """Return a repository, a job folder and the job's worktree on dispatch/<job_id>, made from main."""
    repo = make_repo(tmp_path / "shop")
    job = tmp_path / "job"
    job.mkdir()
    ws = worktree.plan(job, str(repo), "main", f"dispatch/{job_id}", tmp_path / "trees" / job_id)
    worktree.create(ws, from_branch=False)
    return repo, job, ws


def test_a_large_diff_is_cut_with_a_note_and_the_paths_are_all_listed(tmp_path: Path) -> None:
    """diff.patch stops at its bound and ends with a line saying so; changed.txt still lists every path."""
    repo, job, ws = _worktree(tmp_path, "BIG")
    Path(ws.path, "src", "big.txt").write_text("line\n" * 10_000)
    Path(ws.path, "z.txt").write_text("z\n")
    names, _ = worktree.snapshot(ws, job, max_bytes=2000)
    patch = (job / "diff.patch").read_bytes()
    assert patch.endswith(b"\n[dispatcher: diff cut at 2000 bytes]\n") and len(patch) < 2100
    assert names == ["src/big.txt", "z.txt"] and (job / "changed.txt").read_text() == "src/big.txt\nz.txt\n"
    assert json.loads((job / "workspace.json").read_text())["base"] == git(repo, "rev-parse", "main")
    worktree.clear(ws)
    assert not Path(ws.path).exists() and git(repo, "rev-parse", "dispatch/BIG") == ws.base


def test_changed_txt_holds_one_path_a_line_even_for_a_name_with_a_newline(tmp_path: Path) -> None:
    """A path holding a newline or a tab, or starting with a quote, is one line of changed.txt, quoted as JSON."""
    _, job, ws = _worktree(tmp_path, "ODD")
    odd = ["src/two\nlines.txt", "src/tab\there.txt", '"quoted".txt', "src/plain é.txt", "src/sep\u2028.txt"]
    for name in odd:
        Path(ws.path, name).write_text("x\n")
    names, _ = worktree.snapshot(ws, job)
    assert sorted(names) == sorted(odd)
    lines = (job / "changed.txt").read_text().splitlines()
    assert len(lines) == len(odd)
    back = [json.loads(line) if line.startswith('"') else line for line in lines]
    assert sorted(back) == sorted(odd)
    assert "src/plain é.txt" in lines  # an ordinary name stays as it is
    assert '"src/sep\\u2028.txt"' in lines  # a line separator for some readers is escaped


def test_a_locked_worktree_is_named_in_one_line_at_start_and_left_alone(env: Env, tmp_path: Path) -> None:
    """At start the daemon prunes stale worktrees and names a locked one (workspace.locked); jobs still run. git's
    own lock of an add cut short (initializing) is not named: no one is asked to lift it (the README names only
    worktrees locked on purpose)."""
    repo = make_repo(tmp_path / "shop")
    git(repo, "worktree", "add", "-q", str(tmp_path / "mine"), "-b", "mine")
    git(repo, "worktree", "lock", "--reason", "kept by hand", str(tmp_path / "mine"))
    git(repo, "worktree", "add", "-q", str(tmp_path / "gone"), "-b", "gone")
    (tmp_path / "gone" / ".git").unlink()  # its folder half-deleted: prunable
    git(repo, "worktree", "add", "-q", str(tmp_path / "cut"), "-b", "cut")
    git(repo, "worktree", "lock", "--reason", "initializing", str(tmp_path / "cut"))  # git's own, of an add cut short
    env.configure(agents={"coder": coder(env, repo, "--write", "src/{job}.txt=x")})
    env.drop(code_order("U1"))
    d = env.daemon()
    event = d.wait_event("workspace.locked")
    env.wait_job("U1", "done")
    d.stop()
    assert event["worktrees"] == [f"{tmp_path / 'mine'} (kept by hand)"]
    listed = git(repo, "worktree", "list", "--porcelain")
    assert str(tmp_path / "mine") in listed and str(tmp_path / "gone") not in listed


def test_a_finished_jobs_worktree_locked_by_hand_is_named_and_kept_not_removed(env: Env, tmp_path: Path) -> None:
    """A worktree under the root's worktrees folder, of a job that finished, locked on purpose (`git worktree lock`):
    the next start names it in `workspace.locked` and leaves it, files and all, for the person who locked it; once
    unlocked, the start after removes it. It was named and then removed in the same pass."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/{job}.txt=x")})
    env.drop(code_order("LK"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    path = env.root / ".state" / "worktrees" / "LK"
    git(repo, "worktree", "add", "-q", str(path), "dispatch/LK")
    git(repo, "worktree", "lock", "--reason", "reviewing, keep", str(path))
    (path / "my-notes.txt").write_text("note\n")
    proc = env.cli("run", "--once", timeout=120)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["worktrees"] for e in events if e["event"] == "workspace.locked"] == [[f"{path} (reviewing, keep)"]]
    assert not [e for e in events if e["event"] == "workspace.removed"], events
    assert (path / "my-notes.txt").read_text() == "note\n"
    git(repo, "worktree", "unlock", str(path))
    proc = env.cli("run", "--once", timeout=120)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["jobs"] for e in events if e["event"] == "workspace.removed"] == [["LK"]]
    assert not path.exists()


@pytest.mark.parametrize("who", ["agent", "person"])
def test_a_worktree_locked_while_its_job_runs_keeps_the_work_and_stays(env: Env, tmp_path: Path, who: str) -> None:
    """`git worktree lock` while the job runs (by the agent in its folder, or by a person): once done, what the agent
    left uncommitted is committed on its branch all the same, result.json and the land hook name that head, and the
    locked worktree stays, named in `workspace.locked` with its unlock hint. A lock was taken for git's own lock of
    an add cut short: the work was on no branch, head was the base and the worktree was removed."""
    repo = make_repo(tmp_path / "shop")
    log = tmp_path / "land.txt"
    lock = ["--git", "worktree lock --reason inspecting ."] if who == "agent" else ["--sleep", "4"]
    land = ["sh", "-c", 'echo "{head}" > "$0"', str(log)]
    env.configure(agents={"coder": coder(env, repo, "--write", "src/{job}.txt=x", *lock, land=land)})
    env.drop(code_order("L1"))
    path = env.root / ".state" / "worktrees" / "L1"
    d = env.daemon()
    if who == "person":
        wait_until(lambda: starts(env), what="the agent to start")
        git(repo, "worktree", "lock", "--reason", "inspecting", str(path))
    result = env.wait_job("L1", "done")
    d.wait_event("job.landed", job_id="L1")
    d.stop()
    locked = [(e["worktrees"], e["hint"]) for e in d.events() if e["event"] == "workspace.locked"]
    head = git(repo, "rev-parse", "dispatch/L1")
    assert result["workspace"]["head"] == head != result["workspace"]["base"]
    assert result["workspace"]["changed"] == ["src/L1.txt"]
    assert git(repo, "show", "dispatch/L1:src/L1.txt") == "x"
    assert log.read_text().strip() == head
    assert locked == [([f"{path} (inspecting)"], "git worktree unlock PATH")]
    assert (path / "src" / "L1.txt").is_file() and f"worktree {path}\n" in git(repo, "worktree", "list", "--porcelain")


def test_validate_names_a_missing_repository_and_hook_program(env: Env, tmp_path: Path) -> None:
    """`validate` with no file: a workspace repository that does not exist and a missing hook program are errors."""
    agent = coder(env, tmp_path / "nowhere", land=["no-such-pusher", "{branch}"])
    env.configure(agents={"coder": agent})
    proc = env.cli("validate")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{env.config_path}: agents.coder.land: program 'no-such-pusher' not found",
        f"{env.config_path}: agents.coder.workspace.git: repository {tmp_path / 'nowhere'} not found",
    ]


def test_a_workspace_whose_change_cannot_be_read_fails_writes_scope() -> None:
    """When the worktree is gone (or git failed), writes_scope fails with why instead of passing blind."""
    res = writes_scope(evidence(writes=("src/**",), changed_unknown="the workspace is gone", entries=files()))
    assert (res.ok, res.detail) == (False, "the workspace is gone")


def test_an_add_killed_before_git_wrote_gitdir_is_cleared_and_the_next_add_takes_its_name(tmp_path: Path) -> None:
    """git killed between creating gitdir and writing it: the locked entry with an empty gitdir goes."""
    repo = make_repo(tmp_path / "shop")
    job = tmp_path / "job"
    job.mkdir()
    ws = worktree.plan(job, str(repo), "main", "dispatch/W1", tmp_path / "trees" / "W1")
    admin = repo / ".git" / "worktrees" / "W1"
    admin.mkdir(parents=True)
    (admin / "locked").write_text("initializing")
    (admin / "gitdir").write_text("")
    worktree.create(ws, from_branch=False)
    assert worktree.is_ready(ws) and not list((repo / ".git" / "worktrees").glob("*/locked"))
    assert [p.name for p in (repo / ".git" / "worktrees").iterdir()] == ["W1"]
    worktree.clear(ws)
    assert "locked" not in git(repo, "worktree", "list", "--porcelain")


def test_an_add_over_a_folder_a_dead_daemons_git_still_fills_is_tried_again(tmp_path: Path) -> None:
    """A daemon killed during `git worktree add` of a big repository leaves that git running, writing the job's
    worktree folder: the next daemon's add finds the folder made again after it cleared it ("already exists").
    It tries again until the old writer is done, instead of failing the job as a config error with no attempt."""
    import threading

    repo = make_repo(tmp_path / "shop")
    job = tmp_path / "job"
    job.mkdir()
    ws = worktree.plan(job, str(repo), "main", "dispatch/W2", tmp_path / "trees" / "W2")
    stop_at = time.monotonic() + 1.0

    def old_git() -> None:  # what the orphaned add does: fill the folder, over and over, for a second
        while time.monotonic() < stop_at:
            with contextlib.suppress(OSError):  # (cleared under it meanwhile)
                os.makedirs(os.path.join(ws.path, "src"), exist_ok=True)
            time.sleep(0.001)

    writer = threading.Thread(target=old_git)
    writer.start()
    try:
        time.sleep(0.05)
        worktree.create(ws, from_branch=False)
    finally:
        writer.join()
    assert worktree.is_ready(ws)
    assert "W2" in git(repo, "worktree", "list", "--porcelain")


def test_leftovers_are_committed_on_the_jobs_branch_even_when_its_agent_moved_head(tmp_path: Path) -> None:
    """An agent that points its worktree's HEAD at main: the daemon's commit still goes on dispatch/<id>."""
    repo = make_repo(tmp_path / "shop")
    main_before = git(repo, "rev-parse", "main")
    job = tmp_path / "job"
    job.mkdir()
    ws = worktree.plan(job, str(repo), "main", "dispatch/Y1", tmp_path / "trees" / "Y1")
    worktree.create(ws, from_branch=False)
    git(Path(ws.path), "symbolic-ref", "HEAD", "refs/heads/main")
    Path(ws.path, "src", "left.txt").write_text("left over\n")
    head, changed = worktree.seal(ws, "Y1")
    assert git(repo, "rev-parse", "main") == main_before, "the daemon committed onto main"
    assert head == git(repo, "rev-parse", "dispatch/Y1") != ws.base
    assert changed == ["src/left.txt"]
    worktree.clear(ws)


def _commit_on(repo: Path, parent: str, text: str) -> str:
    """Return a new commit object on parent (no ref moves), as an agent's commit in its view would be."""
    tree = git(repo, "rev-parse", f"{parent}^{{tree}}")
    return git(repo, "commit-tree", tree, "-p", parent, "-m", text)


def test_a_view_is_taken_back_by_compare_and_swap_of_the_jobs_branch_only(tmp_path: Path) -> None:
    """absorb moves the branch from the view's commit; one moved meanwhile fails and keeps the view; once is enough."""
    repo, _, ws = _worktree(tmp_path, "V1")
    view = gitview.make(ws)
    assert Path(view.path, "refs", "heads", "dispatch", "V1").read_text().strip() == ws.base
    assert Path(view.path, "objects", "info", "alternates").read_text().splitlines() == [gitview.OBJECTS_MOUNT]
    mine, theirs = _commit_on(repo, ws.base, "agent"), _commit_on(repo, ws.base, "someone else")
    Path(view.path, "refs", "heads", "main").write_text(mine + "\n")  # the agent moved main in its view
    Path(view.path, "refs", "heads", "dispatch", "V1").write_text(mine + "\n")
    git(repo, "update-ref", "refs/heads/dispatch/V1", theirs)  # and someone moved the branch outside
    try:
        gitview.absorb(ws)
    except worktree.GitError as exc:
        assert "moved outside the sandbox" in str(exc)
    else:
        raise AssertionError("a branch moved meanwhile was overwritten")
    assert Path(view.path).is_dir() and git(repo, "rev-parse", "dispatch/V1") == theirs
    git(repo, "update-ref", "refs/heads/dispatch/V1", ws.base)
    gitview.absorb(ws)
    assert git(repo, "rev-parse", "dispatch/V1") == mine and git(repo, "rev-parse", "main") == ws.base
    assert not Path(view.path).exists()
    gitview.absorb(ws)  # nothing left to take: a no-op
    assert git(repo, "rev-parse", "dispatch/V1") == mine


def test_absorb_makes_the_worktrees_folder_safe_and_copies_no_file_of_the_view(tmp_path: Path) -> None:
    """HEAD pointed at main, a reflog linked to a file outside, a forged pack in the view: none of it survives."""
    repo, _, ws = _worktree(tmp_path, "V2")
    git(repo, "commit", "-q", "--allow-empty", "-m", "main moves on")
    main = git(repo, "rev-parse", "main")
    view = gitview.make(ws)
    admin = Path(view.admin)
    victim = tmp_path / "victim.yaml"
    victim.write_text("root: /srv\n")
    (admin / "HEAD").write_text("ref: refs/heads/main\n")  # what `git symbolic-ref HEAD refs/heads/main` leaves
    (admin / "logs").mkdir(exist_ok=True)
    (admin / "logs" / "HEAD").unlink(missing_ok=True)
    (admin / "logs" / "HEAD").symlink_to(victim)
    forged = Path(view.path, "objects", "pack")
    forged.mkdir(parents=True)
    (forged / "pack-forged.idx").write_bytes(b"not an index")
    mine = _commit_on(repo, ws.base, "agent")
    Path(view.path, "refs", "heads", "dispatch", "V2").write_text(mine + "\n")
    gitview.absorb(ws)
    assert (admin / "HEAD").read_text() == "ref: refs/heads/dispatch/V2\n" and not (admin / "logs").exists()
    assert not list((repo / ".git" / "objects" / "pack").glob("pack-forged*"))
    worktree.reset_to_base(ws)  # the daemon's own git, through the worktree's folder
    assert victim.read_text() == "root: /srv\n"
    assert git(repo, "rev-parse", "main") == main != ws.base and git(repo, "rev-parse", "dispatch/V2") == ws.base


def test_the_start_up_sweep_keeps_an_active_jobs_view_being_made_or_removed(tmp_path: Path) -> None:
    """sweep(keep=[J1]): J1's worktree and every form of its view stay; a finished job's go, also the worktree of
    a job named J1.gitview (a valid job id, not J1's view) and a name that only starts like J1's view."""
    folder = tmp_path / "worktrees"
    kept = ["J1", ".J1.gitview", ".J1.gitview.new", ".J1.gitview.old"]
    gone = ["J2", ".J2.gitview.new", ".J2.gitview.old", "J1.gitview", "J1.gitviewfoo"]
    for name in kept + gone:
        (folder / name).mkdir(parents=True)
        (folder / name / "f").write_text("x")
    removed = worktree.sweep(folder, keep=["J1"])
    assert sorted(removed) == sorted(gone)
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)


@pytest.mark.parametrize(
    ("template", "job_id", "branch"),
    [
        ("dispatch/{job_id}", "Z_-.1", "dispatch/Z_-.1"),
        ("dispatch/{job_id}", "A..B", "dispatch/A.+.B"),
        ("dispatch/{job_id}", "A...B", "dispatch/A.+.+.B"),
        ("dispatch/{job_id}", "X.lock", "dispatch/X.lock+"),
        ("dispatch/{job_id}", "E.", "dispatch/E.+"),
        ("{job_id}", "HEAD", "HEAD+"),
        ("dispatch/{job_id}k", "A.loc", "dispatch/A.lock+"),
        ("dispatch/{job_id}k", "A.lock", "dispatch/A.lock+k"),
    ],
)
def test_every_job_id_gets_a_branch_git_takes(template: str, job_id: str, branch: str, tmp_path: Path) -> None:
    """The branch a job id gets is one `git check-ref-format --branch` accepts, and no other id gets it."""
    assert branch_for(template, job_id) == branch
    assert subprocess.run(["git", "check-ref-format", "--branch", branch], capture_output=True).returncode == 0


@pytest.mark.parametrize("bound", [2000, 65536 + 10, 65536 * 2])
def test_a_cut_diff_with_its_note_is_exactly_its_bound(tmp_path: Path, bound: int) -> None:
    """A cut diff.patch, its closing note included, is exactly max_bytes long: at most 16 MiB means at most."""
    _repo, job, ws = _worktree(tmp_path, "EDGE")
    Path(ws.path, "src", "big.txt").write_text("line of text\n" * 40_000)
    worktree.snapshot(ws, job, max_bytes=bound)
    patch = (job / "diff.patch").read_bytes()
    assert len(patch) == bound and patch.endswith(f"\n[dispatcher: diff cut at {bound} bytes]\n".encode())
