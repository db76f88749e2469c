"""Contract section 15: a git worktree per job, diffs per attempt, writes_scope on changed paths, chains."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from conftest import Env, wait_until
from git_helpers import code_order, coder, git, make_repo, starts


def test_twenty_jobs_on_one_repository_two_at_once_each_get_their_own_branch_and_diff(env: Env, tmp_path: Path) -> None:
    """20 jobs, 2 at once, each changing its own file: every branch, diff and result names exactly that file."""
    repo = make_repo(tmp_path / "shop")
    base = git(repo, "rev-parse", "main")
    agent = coder(env, repo, "--write", "src/{job}.txt={job} was here", concurrency=2)
    env.configure(agents={"coder": agent}, max_jobs=2)
    ids = [f"J{i:02d}" for i in range(20)]
    for job_id in ids:
        env.drop(code_order(job_id))
    d = env.daemon()
    for job_id in ids:
        env.wait_job(job_id, "done")
    d.stop()
    for job_id in ids:
        result = env.result(job_id, "done")
        ws = result["workspace"]
        head = git(repo, "rev-parse", f"dispatch/{job_id}")
        want = {"repo": str(repo), "branch": f"dispatch/{job_id}", "base": base, "head": head}
        assert ws == want | {"changed": [f"src/{job_id}.txt"]}
        assert git(repo, "rev-parse", f"{head}^") == base  # one commit on top of base: the job's own change
        assert git(repo, "show", f"{head}:src/{job_id}.txt") == f"{job_id} was here"
        folder = env.job_dir(job_id, "done")
        assert (folder / "attempts" / "1" / "changed.txt").read_text() == f"src/{job_id}.txt\n"
        patch = (folder / "attempts" / "1" / "diff.patch").read_text()
        assert f"+++ b/src/{job_id}.txt" in patch and f"+{job_id} was here" in patch
        assert sorted(p.name for p in (folder / "work").iterdir()) == ["order.json", "receipt.json"]
    worktree = env.root / ".state" / "worktrees"
    assert [(job, cwd) for job, _n, cwd in starts(env)] == [(j, str(worktree / j)) for j, _n, _c in starts(env)]
    assert sorted(j for j, _n, _c in starts(env)) == ids  # each ran once
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1  # every worktree removed
    assert git(repo, "rev-parse", "main") == base  # the repository's own branch is untouched


def test_a_change_outside_writes_fails_writes_scope_naming_the_paths(env: Env, tmp_path: Path) -> None:
    """A job that changes files outside its writes globs fails writes_scope, and the reason names them."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, "--write", "src/ok.py=fine", "--write", "docs/notes.md=stray", "--write", "top.txt=stray")
    env.configure(agents={"coder": agent})
    env.drop(code_order("OUT-1"))
    d = env.daemon()
    result = env.wait_job("OUT-1", "failed")
    d.stop()
    assert result["reason"].startswith("writes_scope: changed outside writes (src/**): ")
    assert "docs/notes.md" in result["reason"] and "top.txt" in result["reason"]
    assert "src/ok.py" not in result["reason"]
    assert sorted(result["workspace"]["changed"]) == ["docs/notes.md", "src/ok.py", "top.txt"]
    changed = (env.job_dir("OUT-1", "failed") / "attempts" / "1" / "changed.txt").read_text().split()
    assert sorted(changed) == ["docs/notes.md", "src/ok.py", "top.txt"]
    shown = env.cli("show", "OUT-1", check=True).stdout.splitlines()
    head, base = result["workspace"]["head"][:12], result["workspace"]["base"][:12]
    assert f"  workspace: dispatch/OUT-1 at {head} (from {base}) in {repo}" in shown
    assert "    changed: docs/notes.md, src/ok.py, top.txt" in shown


def test_links_out_of_the_worktree_hard_links_and_fifos_fail_writes_scope(env: Env, tmp_path: Path) -> None:
    """The link, hard-link and FIFO rules of writes_scope hold in the worktree as they do in work/."""
    repo = make_repo(tmp_path / "shop")
    outside = tmp_path / "secret.txt"
    outside.write_text("not the job's\n")
    cases = {
        "L1": (["--symlink", f"src/link.txt={outside}"], "src/link.txt is a link that points outside the workspace"),
        "L2": (["--symlink", "src/up=../../../.."], "src/up is a link that points outside the workspace"),
        "L3": (["--hardlink", f"src/hard.txt={outside}"], "src/hard.txt has 2 hard links"),
        "L4": (["--fifo", "src/fifo"], "src/fifo is a FIFO"),
        "L5": (["--symlink", "src/ok.txt=../README.md"], None),  # a link that stays in the tree is fine
    }
    env.configure(agents={key: coder(env, repo, *flags) for key, (flags, _) in cases.items()})
    for key in cases:
        env.drop(code_order(key, to=key))
    d = env.daemon()
    results = {key: env.wait_job(key, "failed" if why else "done") for key, (_, why) in cases.items()}
    d.stop()
    for key, (_, why) in cases.items():
        if why is not None:
            assert results[key]["reason"] == f"writes_scope: {why}", key
    assert git(repo, "ls-tree", "--name-only", "-r", "dispatch/L5").split() == ["README.md", "src/app.py", "src/ok.txt"]


def test_a_chain_of_three_with_base_parent_ends_with_one_line_of_commits(env: Env, tmp_path: Path) -> None:
    """coder -> reviewer -> fixer, each from its parent's head: the last branch holds all three commits in a line."""
    repo = make_repo(tmp_path / "shop")
    line = ["--append", "src/chain.txt={job}"]
    env.configure(
        agents={
            "coder": coder(env, repo, *line, "--commit", "--handoff", "reviewer"),
            "reviewer": coder(env, repo, *line, "--handoff", "fixer"),  # leaves its change uncommitted
            "fixer": coder(env, repo, *line, "--commit"),
        }
    )
    env.drop(code_order("C1"))
    d = env.daemon()
    heads = [env.wait_job(j, "done")["workspace"]["head"] for j in ("C1", "C1-next", "C1-next-next")]
    d.stop()
    base = git(repo, "rev-parse", "main")
    commits = git(repo, "rev-list", "--first-parent", f"{base}..{heads[2]}").split()
    assert len(commits) == 3 and commits[::-1] == heads  # one line: base -> C1 -> C1-next -> C1-next-next
    assert git(repo, "rev-list", "--merges", f"{base}..{heads[2]}") == ""
    assert git(repo, "show", f"{heads[2]}:src/chain.txt").split() == ["C1", "C1-next", "C1-next-next"]
    last = env.result("C1-next-next", "done")["workspace"]
    assert last["base"] == heads[1] and last["changed"] == ["src/chain.txt"]


def test_base_parent_without_a_parent_fails_without_an_attempt(env: Env, tmp_path: Path) -> None:
    """An order from outside that says base: parent fails as a config error naming why: it has no parent."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo)})
    env.drop(code_order("ORPHAN", base="parent"))
    d = env.daemon()
    result = env.wait_job("ORPHAN", "failed")
    d.stop()
    assert result["reason"] == "config: agent coder cannot start: workspace: base: parent: the job has no parent"
    assert result["attempts"] == [] and starts(env) == []


def test_base_parent_of_an_order_that_waited_for_others_starts_from_the_head_it_waited_for(
    env: Env, tmp_path: Path
) -> None:
    """An order dropped from outside has no lineage parent; with `after`, `base: parent` names the job it waited
    for: it starts from that job's final head (with two, the first named that ended with a head)."""
    repo = make_repo(tmp_path / "shop")
    line = ["--append", "src/chain.txt={job}", "--commit"]
    env.configure(agents={"coder": coder(env, repo, *line)})
    env.drop(code_order("JA"))
    env.drop(code_order("JB", after=["JA"], base="parent"))
    env.drop(code_order("JC", after=["NOHEAD", "JB"], base="parent", after_rule="all_final"))
    env.drop({"job_id": "NOHEAD", "from": "tester", "to": "plain", "task": "No workspace.", "items": [{"id": "R1"}]})
    env.configure(agents={"coder": coder(env, repo, *line), "plain": env.agent()})
    d = env.daemon()
    heads = [env.wait_job(j, "done")["workspace"]["head"] for j in ("JA", "JB")]
    third = env.wait_job("JC", "done")["workspace"]
    d.stop()
    assert env.result("JB", "done")["workspace"]["base"] == heads[0]
    assert third["base"] == heads[1]
    assert git(repo, "show", f"{third['head']}:src/chain.txt").split() == ["JA", "JB", "JC"]


def test_an_agent_that_deletes_its_worktrees_git_file_still_has_its_work_committed(env: Env, tmp_path: Path) -> None:
    """The agent writes src/g.py and removes the worktree's .git file: the daemon, which finds the worktree from the
    repository, still commits what it left on the job's branch."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/g.py=left", "--remove", ".git")})
    env.drop(code_order("GONE-GIT"))
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:]
    result = env.result("GONE-GIT", "done")
    assert result["workspace"]["changed"] == ["src/g.py"], result["workspace"]
    assert git(repo, "show", "dispatch/GONE-GIT:src/g.py") == "left"
    assert result["workspace"]["head"] == git(repo, "rev-parse", "dispatch/GONE-GIT")


def test_a_folder_inside_a_repository_is_refused_without_an_attempt(env: Env, tmp_path: Path) -> None:
    """`workspace.git` naming a subfolder of a repository: the job fails as a config error, no worktree is left."""
    repo = make_repo(tmp_path / "shop")
    inner = repo / "src"
    inner.mkdir(exist_ok=True)
    env.configure(agents={"coder": coder(env, inner, "--write", "src/c.py=x")})
    env.drop(code_order("INNER"))
    env.cli("run", "--once", timeout=60)
    result = env.result("INNER", "failed")
    assert result["reason"] == (
        f"config: agent coder cannot start: workspace: {inner} is a folder inside the repository {repo}:"
        " name the repository itself"
    ), result["reason"]
    assert result["attempts"] == [] and starts(env) == []
    assert git(repo, "worktree", "list").count("\n") == 0  # the main worktree alone


def test_a_branch_that_exists_already_is_never_taken_over(env: Env, tmp_path: Path) -> None:
    """dispatch/<id> with a person's commit on it: the job fails without an attempt and the branch keeps its commit."""
    repo = make_repo(tmp_path / "shop")
    git(repo, "checkout", "-q", "-b", "dispatch/TAKEN")
    (repo / "user.txt").write_text("user work\n")
    git(repo, "add", "user.txt")
    git(repo, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "-m", "user work")
    tip = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "main")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/c.py=x")})
    env.drop(code_order("TAKEN"))
    env.cli("run", "--once", timeout=60)
    result = env.result("TAKEN", "failed")
    assert result["reason"].startswith("config: agent coder cannot start: workspace: branch dispatch/TAKEN already"), (
        result["reason"]
    )
    assert result["attempts"] == [] and starts(env) == []
    assert git(repo, "rev-parse", "dispatch/TAKEN") == tip


def test_ids_git_refuses_as_branch_names_run_on_a_branch_made_safe(env: Env, tmp_path: Path) -> None:
    """`A..B`, `X.lock` and `E.` are valid job ids but no branch names: each runs on its own branch, `+` put
    between two dots and after such an ending (never in a job id, so no two jobs share one); `Z_-.1` is as given."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/{job}.txt={job} was here")})
    want = {"A..B": "dispatch/A.+.B", "X.lock": "dispatch/X.lock+", "E.": "dispatch/E.+", "Z_-.1": "dispatch/Z_-.1"}
    for job_id in want:
        env.drop(code_order(job_id))
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    for job_id, branch in want.items():
        result = env.result(job_id, "done")
        assert result["workspace"]["branch"] == branch, result["workspace"]
        assert git(repo, "cat-file", "-p", f"{branch}:src/{job_id}.txt") == f"{job_id} was here"  # not read as a range
    assert sorted(j for j, _n, _c in starts(env)) == sorted(want)


def test_a_branch_template_that_makes_no_branch_name_is_a_config_error(env: Env, tmp_path: Path) -> None:
    """`branch: 'a b/{job_id}'` can never name a branch: `validate` exits 2 naming the field."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, "--write", "src/c.py=x")
    agent["workspace"] = {**agent["workspace"], "branch": "a b/{job_id}"}
    env.configure(agents={"coder": agent})
    proc = env.cli("validate")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("agents.coder.workspace.branch: makes no valid git branch name: holds ' '"), (
        proc.stderr
    )


def test_a_retry_starts_again_from_base(env: Env, tmp_path: Path) -> None:
    """After a failed attempt, the next one finds the worktree back at base: the first attempt's file is gone."""
    repo = make_repo(tmp_path / "shop")
    report = tmp_path / "report.json"
    agent = coder(env, repo, "--fail-first", "src/first.txt", "--report", str(report), max_attempts=2, retry_safe=True)
    env.configure(agents={"coder": agent})
    env.drop(code_order("AGAIN"))
    d = env.daemon()
    result = env.wait_job("AGAIN", "done")
    d.stop()
    assert json.loads(report.read_text()) == {"fail_first": "absent"}
    folder = env.job_dir("AGAIN", "done")
    assert (folder / "attempts" / "1" / "changed.txt").read_text() == "src/first.txt\n"
    assert (folder / "attempts" / "2" / "changed.txt").read_text() == ""
    assert result["workspace"]["changed"] == [] and result["workspace"]["head"] == result["workspace"]["base"]


# attempt 1 checks out a branch of someone's (or detaches HEAD) and fails; each attempt notes the branch it is on
LEAVES_ITS_BRANCH = """import json, os, subprocess, sys
n = int(os.environ["DISPATCH_ATTEMPT"])
on = subprocess.run(["git", "branch", "--show-current"], capture_output=True, text=True).stdout.strip()
with open(sys.argv[1], "a") as fh:
    fh.write(f"{n} {on}\\n")
if n == 1:
    subprocess.run(["git", "checkout", "-q", *sys.argv[2:]], check=True)
    sys.exit(1)
receipt = {"job_id": os.environ["DISPATCH_JOB_ID"], "input_ids": ["R1"], "output_ids": [], "status": "done"}
json.dump(receipt, open(os.environ["DISPATCH_RECEIPT"], "w"))
"""


def test_a_retry_never_moves_a_branch_the_agent_checked_out_only_its_own(env: Env, tmp_path: Path) -> None:
    """Attempt 1 checks out `feature` (someone's branch) or detaches HEAD, then fails: the retry resets the job's
    own branch to base and runs on it; `feature` keeps its commit, and no failed attempt's commit stays."""
    repo = make_repo(tmp_path / "shop")
    git(repo, "branch", "feature")
    git(repo, "checkout", "-q", "feature")
    (repo / "f.txt").write_text("someone's work\n")
    git(repo, "add", "f.txt")
    git(repo, "commit", "-q", "-m", "work on feature")
    git(repo, "checkout", "-q", "main")
    feature = git(repo, "rev-parse", "feature")
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_ITS_BRANCH)
    seen = tmp_path / "branches.txt"
    agents = {
        name: coder(env, repo, command=[sys.executable, str(script), str(seen), *how], max_attempts=2, retry_safe=True)
        for name, how in (("onto", ["feature"]), ("detach", ["--detach"]))
    }
    env.configure(agents=agents)
    env.drop(code_order("ONTO", to="onto"))
    d = env.daemon()
    onto = env.wait_job("ONTO", "done")
    env.drop(code_order("DETACH", to="detach"))
    detached = env.wait_job("DETACH", "done")
    d.stop()
    assert git(repo, "rev-parse", "feature") == feature, "the retry moved a branch that is not the job's"
    assert seen.read_text().splitlines() == [
        "1 dispatch/ONTO",
        "2 dispatch/ONTO",
        "1 dispatch/DETACH",
        "2 dispatch/DETACH",
    ]
    for result in (onto, detached):
        assert result["workspace"]["head"] == result["workspace"]["base"], result["workspace"]  # nothing left over


def test_a_seal_that_fails_keeps_what_the_checks_saw_and_the_worktree(env: Env, tmp_path: Path) -> None:
    """A stale lock on the job's branch ref makes the seal fail: result.json's `changed` still lists what the
    checks saw (it said []), `head` is empty, and the worktree, the change's only copy, is not removed."""
    repo = make_repo(tmp_path / "shop")
    script = tmp_path / "locks.sh"
    script.write_text(
        "echo x > src/x.txt\n"
        f"touch {repo}/.git/refs/heads/dispatch/$DISPATCH_JOB_ID.lock\n"
        'printf \'{"job_id": "%s", "input_ids": ["R1"], "output_ids": [], "status": "done"}\' "$DISPATCH_JOB_ID"'
        ' > "$DISPATCH_RECEIPT"\n'
    )
    env.configure(agents={"coder": coder(env, repo, command=["/bin/sh", str(script)])})
    env.drop(code_order("SEAL"))
    d = env.daemon()
    result = env.wait_job("SEAL", "done")
    d.wait_event("workspace.seal_failed", job_id="SEAL")
    d.stop()
    assert result["workspace"]["head"] is None and result["workspace"]["changed"] == ["src/x.txt"], result
    assert (env.root / ".state" / "worktrees" / "SEAL" / "src" / "x.txt").read_text() == "x\n"


def test_a_revision_of_a_reviewed_job_goes_on_from_the_reviewed_tree(env: Env, tmp_path: Path) -> None:
    """revise: the next attempt finds the work a person reviewed, not base; its branch keeps both attempts' lines."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, "--append", "src/log.txt=an attempt", review=True)
    env.configure(agents={"coder": agent})
    env.drop(code_order("REV"))
    d = env.daemon()
    wait_until(lambda: (env.root / "review" / "REV" / "result.json").exists(), what="REV in review/")
    env.cli("revise", "REV", "--note", "add one more line", check=True)
    revised = env.root / "review" / "REV" / "result.json"
    wait_until(lambda: len(env.starts()) == 2 and revised.exists(), what="the revision")
    env.cli("approve", "REV", check=True)
    result = env.wait_job("REV", "done")
    d.stop()
    assert git(repo, "show", f"{result['workspace']['head']}:src/log.txt") == "an attempt\nan attempt"
    assert (env.job_dir("REV", "done") / "attempts" / "2" / "changed.txt").read_text() == "src/log.txt\n"


def test_an_attempt_that_resumes_the_session_goes_on_from_the_last_tree(env: Env, tmp_path: Path) -> None:
    """With resume: a retry that resumes the agent's session keeps the tree that session made (not base)."""
    repo = make_repo(tmp_path / "shop")
    report = tmp_path / "report.json"
    flags = ["--fail-first", "src/first.txt", "--report", str(report), "--session", "S-1"]
    agent = coder(env, repo, *flags, max_attempts=2, retry_safe=True)
    agent["resume"] = [*agent["command"], "--resumed", "{session_id}"]
    env.configure(agents={"coder": agent})
    env.drop(code_order("RES"))
    d = env.daemon()
    env.wait_job("RES", "done")
    d.stop()
    assert json.loads(report.read_text()) == {"fail_first": "present"}


def test_a_binary_change_is_saved_whole_in_the_diff(env: Env, tmp_path: Path) -> None:
    """A binary file the agent writes is in diff.patch as a git binary patch that applies to base."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, "--binary", "src/blob.bin")
    env.configure(agents={"coder": agent})
    env.drop(code_order("BIN"))
    d = env.daemon()
    env.wait_job("BIN", "done")
    d.stop()
    patch = env.job_dir("BIN", "done") / "attempts" / "1" / "diff.patch"
    assert b"GIT binary patch" in patch.read_bytes()
    check = make_repo(tmp_path / "copy")
    git(check, "apply", str(patch))
    assert (check / "src" / "blob.bin").read_bytes() == bytes(range(256))


def test_workspace_placeholders_and_environment_point_at_the_worktree(env: Env, tmp_path: Path) -> None:
    """{workspace} and DISPATCH_WORKSPACE are the worktree; {order} and {receipt} stay in work/."""
    repo = make_repo(tmp_path / "shop")
    seen = tmp_path / "seen.txt"
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys, json\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(sys.argv[1:] + [os.environ['DISPATCH_WORKSPACE'], os.getcwd()]))\n"
        "o = json.load(open(sys.argv[2]))\n"
        "r = {'job_id': o['job_id'], 'input_ids': ['R1'], 'output_ids': [], 'status': 'done'}\n"
        "json.dump(r, open(sys.argv[3], 'w'))\n"
    )
    agent = coder(env, repo, command=["python3", str(script), "{workspace}", "{order}", "{receipt}"])
    env.configure(agents={"coder": agent})
    env.drop(code_order("PH"))
    d = env.daemon()
    env.wait_job("PH", "done")
    d.stop()
    tree = str(env.root / ".state" / "worktrees" / "PH")
    work = str(env.root / "active" / "PH" / "work")
    assert json.loads(seen.read_text()) == [tree, f"{work}/order.json", f"{work}/receipt.json", tree, tree]
    wait_until(lambda: not Path(tree).exists(), what="the worktree to be removed")


def test_dispatcher_retry_of_a_failed_job_starts_again_from_base(env: Env, tmp_path: Path) -> None:
    """A failed job retried after its agent is fixed gets a new worktree at base: only the fix counts."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=a", "--write", "stray.txt=x")})
    env.drop(code_order("RT"))
    d = env.daemon()
    first = env.wait_job("RT", "failed")
    assert first["reason"] == "writes_scope: changed outside writes (src/**): stray.txt"
    d.stop()
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=fixed")})
    env.cli("retry", "RT", check=True)
    d2 = env.daemon()
    wait_until(lambda: (env.job_dir("RT", "done") / "result.json").exists(), what="the retried job to be done")
    result = env.result("RT", "done")
    d2.stop()
    assert result["workspace"]["changed"] == ["src/a.txt"] and result["workspace"]["base"] == first["workspace"]["base"]
    assert git(repo, "show", f"{result['workspace']['head']}:src/a.txt") == "fixed"
    assert git(repo, "rev-parse", f"{result['workspace']['head']}^") == result["workspace"]["base"]
    assert (env.job_dir("RT", "done") / "attempts" / "2" / "changed.txt").read_text() == "src/a.txt\n"


def test_an_attempt_a_cancel_cut_keeps_its_diff_and_changed_files(env: Env, tmp_path: Path) -> None:
    """A running attempt that wrote a file, then a cancel: attempts/1/ keeps diff.patch and changed.txt (section 15)."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--write", "src/new.txt=x", "--sleep-after", "60")})
    d = env.daemon()
    env.drop(code_order("CUT-1"))
    written = env.root / ".state" / "worktrees" / "CUT-1" / "src" / "new.txt"
    wait_until(written.exists, 30, "the agent's file in its worktree")
    assert env.cli("cancel", "CUT-1").returncode == 0
    result = env.wait_job("CUT-1", "failed")
    assert result["reason"] == "cancelled"
    attempt = env.job_dir("CUT-1", "failed") / "attempts" / "1"
    assert (attempt / "changed.txt").read_text().split() == ["src/new.txt"]
    assert "src/new.txt" in (attempt / "diff.patch").read_text()
    d.stop()


# attempt 1 writes a file, then meets a usage limit that lifts a second later; attempt 2 writes its receipt
LIMITED_ONCE = """import json, os, sys, time
n = int(os.environ["DISPATCH_ATTEMPT"])
os.makedirs("src", exist_ok=True)
if n == 1:
    open("src/limited.txt", "w").write("half done\\n")
    print(f"rate limited until {int(time.time()) + 2}", flush=True)
    sys.exit(1)
receipt = {"job_id": os.environ["DISPATCH_JOB_ID"], "input_ids": ["R1"], "output_ids": [], "status": "done"}
json.dump(receipt, open(os.environ["DISPATCH_RECEIPT"], "w"))
"""


def test_an_attempt_that_met_a_usage_limit_keeps_its_diff_and_changed_files(env: Env, tmp_path: Path) -> None:
    """Section 15: "After each attempt: attempts/<n>/diff.patch and attempts/<n>/changed.txt", a limited one too."""
    repo = make_repo(tmp_path / "shop")
    script = tmp_path / "limited.py"
    script.write_text(LIMITED_ONCE)
    limits = [{"match": r"rate limited until (\d+)", "until": "epoch"}]
    env.configure(agents={"coder": coder(env, repo, command=[sys.executable, str(script)], limits=limits)})
    env.drop(code_order("LIM-1"))
    d = env.daemon()
    result = env.wait_job("LIM-1", "done")
    d.stop()
    assert [a.get("limited") is not None for a in result["attempts"]] == [True, False]
    attempt = env.job_dir("LIM-1", "done") / "attempts" / "1"
    assert (attempt / "changed.txt").read_text().split() == ["src/limited.txt"]
    assert "src/limited.txt" in (attempt / "diff.patch").read_text()


def test_a_worktree_path_named_like_the_orders_output_still_answers_to_writes(env: Env, tmp_path: Path) -> None:
    """accept.output names a file in work/: a repository file of that name, changed by the agent, is outside
    `writes` like any other (it passed writes_scope, and the change was committed on the job's branch)."""
    repo = make_repo(tmp_path / "shop")
    agent = coder(env, repo, "--write", "src/ok.py=fine", "--write", "config/prod.json={}")
    env.configure(agents={"coder": agent})
    env.drop(code_order("AO-1", accept={"output": "config/prod.json"}))
    d = env.daemon()
    result = env.wait_job("AO-1", "failed")
    d.stop()
    scope = next(c for c in result["checks"] if c["name"] == "writes_scope")
    assert (scope["ok"], scope["detail"]) == (False, "changed outside writes (src/**): config/prod.json"), scope
    assert sorted(result["workspace"]["changed"]) == ["config/prod.json", "src/ok.py"]


def test_a_retried_job_whose_repository_went_away_fails_in_plain_words(env: Env, tmp_path: Path) -> None:
    """Attempt 1 fails; the repository is moved away; `dispatcher retry`: the job fails as a config error that names
    the repository as a fresh job's does, with no Python exception text ([Errno 2], quotes) in the reason."""
    repo = make_repo(tmp_path / "shop")
    env.configure(agents={"coder": coder(env, repo, "--exit", "1")})
    env.drop(code_order("GONE-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 1
    repo.rename(tmp_path / "shop.moved")
    assert env.cli("retry", "GONE-1").returncode == 0
    assert env.cli("run", "--once", timeout=120).returncode == 1
    result = env.result("GONE-1", "failed")
    assert result["reason"] == f"config: agent coder cannot start: workspace: repository {repo} does not exist"


def _slow_checkout(repo: Path, seconds: int = 6) -> None:
    """Make the worktree's checkout of repo take seconds: a smudge filter (hooks are off for the daemon's git)."""
    (repo / ".gitattributes").write_text("src/slow.txt filter=slow\n")
    (repo / "src" / "slow.txt").write_text("slow\n")
    git(repo, "config", "filter.slow.clean", "cat")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "slow")
    git(repo, "config", "filter.slow.smudge", f"sleep {seconds}; cat")


def test_a_stop_while_the_worktree_is_made_starts_no_agent_and_the_next_start_runs_the_job(
    env: Env, tmp_path: Path
) -> None:
    """SIGTERM while a job's worktree is made (a slow checkout): its agent never starts (it started once the
    worktree was there, past stop_timeout, and the cut attempt failed the job for good); the next start runs it."""
    repo = make_repo(tmp_path / "shop")
    _slow_checkout(repo)
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x")}, stop_timeout=2, kill_grace=1)
    d = env.daemon()
    env.drop(code_order("WS1"))
    wait_until(lambda: (env.root / ".state" / "worktrees" / "WS1").exists(), 30, "the worktree's checkout")
    d.signal(signal.SIGTERM)
    assert d.wait(60) == 0
    assert starts(env) == []
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert env.result("WS1", "done")["state"] == "done"
    assert [(job, n) for job, n, _ in starts(env)] == [("WS1", 1)]


def test_a_cancel_while_the_worktree_is_made_fails_the_job_cancelled_and_starts_no_agent(
    env: Env, tmp_path: Path
) -> None:
    """`cancel` while a job's worktree is made: the job fails `cancelled` and its agent never starts (it ran)."""
    repo = make_repo(tmp_path / "shop")
    _slow_checkout(repo)
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x")})
    d = env.daemon()
    env.drop(code_order("WS2"))
    wait_until(lambda: (env.root / ".state" / "worktrees" / "WS2").exists(), 30, "the worktree's checkout")
    assert env.cli("cancel", "WS2").returncode == 0
    assert env.wait_job("WS2", "failed")["reason"] == "cancelled"
    assert starts(env) == []
    assert d.stop() == 0


def test_base_parent_of_a_follow_up_that_waited_for_others_starts_from_the_job_it_waited_for(
    env: Env, tmp_path: Path
) -> None:
    """A planner (no workspace) releases FA and FB (after FA, base: parent) to a coder: FB's lineage parent, the
    planner, has no head on the repository, so FB starts from FA's final head, the job it waited for. It failed
    with "job PL has no workspace head": the fan-out-and-join shape could not build on its parts."""
    repo = make_repo(tmp_path / "shop")
    line = ["--append", "src/chain.txt={job}", "--commit"]
    fa = code_order("FA") | {"from": "planner"}
    fb = code_order("FB", after=["FA"], base="parent") | {"from": "planner"}
    planner = env.agent("--followup", json.dumps(fa), "--followup", json.dumps(fb))
    env.configure(agents={"coder": coder(env, repo, *line), "planner": planner})
    env.drop({"job_id": "PL", "from": "tester", "to": "planner", "task": "Plan.", "items": [{"id": "R1"}]})
    d = env.daemon()
    head = env.wait_job("FA", "done")["workspace"]["head"]
    second = env.wait_job("FB", "done")["workspace"]
    d.stop()
    assert second["base"] == head
    assert git(repo, "show", f"{second['head']}:src/chain.txt").split() == ["FA", "FB"]


def test_a_stop_ends_a_long_checkout_at_stop_timeout_and_the_next_start_makes_the_worktree_again(
    env: Env, tmp_path: Path
) -> None:
    """SIGTERM while a job's worktree is checked out for 60 s: the stop ends the checkout at stop_timeout (plus
    kill_grace), as it ends agents, and exits 0; the job started no agent, and the next start makes its worktree
    again and runs it. The stop waited for the whole checkout."""
    repo = make_repo(tmp_path / "shop")
    _slow_checkout(repo, 60)
    env.configure(agents={"coder": coder(env, repo, "--write", "src/a.txt=x")}, stop_timeout=2, kill_grace=1)
    d = env.daemon()
    env.drop(code_order("WS3"))
    wait_until(lambda: (env.root / ".state" / "worktrees" / "WS3").exists(), 30, "the worktree's checkout")
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(90) == 0
    took = time.monotonic() - sent
    assert took < 2 + 1 + 10, f"the stop took {took:.1f} s with stop_timeout 2"
    assert starts(env) == []
    git(repo, "config", "filter.slow.smudge", "cat")
    assert env.cli("run", "--once", timeout=120).returncode == 0
    assert env.result("WS3", "done")["state"] == "done"
    assert [(job, n) for job, n, _ in starts(env)] == [("WS3", 1)]
