"""The web view's JSON API and actions (contract section 17) against a real `dispatcher web` process.

The root holds jobs in every state, made by a real daemon running the fake
agents (web_helpers.populate); each test runs on the SQLite and on the
PostgreSQL ledger. Answers are compared with the commands' own --json output.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Env, cli_env, order, wait_until
from test_metrics import samples
from web_helpers import Web, costing, populate, start_web

pytest_plugins = ["pg_fixtures"]


@pytest.fixture(params=["sqlite", "postgresql"])
def site(request: pytest.FixtureRequest, env: Env) -> Iterator[tuple[Env, Web]]:
    """A populated root on the given ledger, with `dispatcher web` serving it."""
    ledger = "sqlite"
    if request.param == "postgresql":
        ledger = request.getfixturevalue("pg_db")
    populate(env, ledger)
    web = start_web(env)
    yield env, web
    web.stop()


def cli_json(env: Env, *args: str) -> Any:
    out = env.cli(*args, "--json", check=True).stdout
    return json.loads(out) if args[0] != "list" else [json.loads(line) for line in out.splitlines()]


def without_ages(value: Any) -> Any:
    """Return a status or list answer with its clock-dependent fields left out."""
    if isinstance(value, list):
        return [without_ages(v) for v in value]
    if isinstance(value, dict):
        return {k: without_ages(v) for k, v in value.items() if k not in ("age_s",)}
    return value


def test_api_answers_have_the_shapes_of_status_list_and_show(site: tuple[Env, Web]) -> None:
    """/api/status, /api/jobs and /api/jobs/ID answer what status, list and show --json print."""
    env, web = site
    status = web.json("/api/status")
    assert status["counts"] == {
        "inbox": 1, "held": 1, "active": 1, "waiting": 0, "review": 2, "done": 4, "failed": 1, "refused": 1,
    }  # fmt: skip
    assert without_ages(status) == without_ages(cli_json(env, "status"))
    assert [a["job_id"] for a in status["active"]] == ["SLOW-1"] and status["daemons"][0]["alive"] is True
    assert status["spend_24h"]["reviewer"] == pytest.approx(0.8)
    jobs = web.json("/api/jobs")
    assert sorted(without_ages(jobs), key=str) == sorted(without_ages(cli_json(env, "list")), key=str)
    assert {r["job_id"]: r["state"] for r in jobs if r["job_id"]}.items() >= {
        "DONE-1": "done", "FAIL-1": "failed", "REV-A": "review", "SLOW-1": "active",
        "QUEUED-1": "inbox", "HELD-1": "held", "CHAIN-3": "done",
    }.items()  # fmt: skip
    for job_id in ("CHAIN-2", "FAIL-1", "REV-A", "QUEUED-1", "HELD-1", "SLOW-1"):
        assert web.json(f"/api/jobs/{job_id}") == cli_json(env, "show", job_id), job_id
    (refused,) = [r for r in jobs if r["state"] == "refused"]
    folder = Path(refused["path"]).name  # stem@time: `show` answers by the stem and by the folder's name
    for name in (folder.rpartition("@")[0], folder):
        assert without_ages(web.json(f"/api/jobs/{name}")) == without_ages(cli_json(env, "show", name)), name


def test_api_list_takes_the_filters_of_list(site: tuple[Env, Web]) -> None:
    """/api/jobs?state=S&agent=A lists what `list --state S --agent A --json` lists; a bad state is a 400."""
    env, web = site
    review = web.json("/api/jobs?state=review")
    assert sorted(r["job_id"] for r in review) == ["REV-A", "REV-B"]
    assert without_ages(review) == without_ages(cli_json(env, "list", "--state", "review"))
    hops = web.json("/api/jobs?agent=hop2")
    assert [r["job_id"] for r in hops] == ["CHAIN-2"]
    assert [r["job_id"] for r in web.json("/api/jobs?state=refused")] == [None]
    status, body, _ = web.get("/api/jobs?state=bogus")
    assert status == 400 and "bogus" in json.loads(body)["error"]
    assert without_ages(web.json("/api/jobs/?state=review")) == without_ages(review)  # a trailing slash: the same
    assert without_ages(web.json("/api/jobs/REV-A/")) == without_ages(web.json("/api/jobs/REV-A"))


ODD_IDS = [
    "NOPE-1", "..%2F..%2Fetc%2Fpasswd", "%2E%2E", "a%00b", "%FF%FE", "caf%C3%A9", "x" * 300, "%3Cscript%3E", "a%20b",
]  # fmt: skip


def test_unknown_and_odd_ids_are_404(site: tuple[Env, Web]) -> None:
    """An unknown id, or one with characters no job id has, is a 404 with a JSON error, on the API and the pages."""
    _, web = site
    for path in ODD_IDS:
        status, body, headers = web.get(f"/api/jobs/{path}")
        assert status == 404 and headers["Content-Type"] == "application/json", (path, body[:200])
        assert "no such job" in json.loads(body)["error"]
        status, body, _ = web.get(f"/jobs/{path}")
        assert status == 404 and b"no such job" in body and b"<script>" not in body, path
        assert web.get(f"/jobs/{path}/chain")[0] == 404
        assert web.act(path, "approve", web.token)[0] == 404


def test_actions_need_the_token(site: tuple[Env, Web]) -> None:
    """Without Authorization an action is 401, with a wrong token 403; nothing moves; the right token approves."""
    env, web = site
    assert web.act("REV-A", "approve", None)[0] == 401
    assert web.act("REV-A", "approve", "not-the-token")[0] == 403
    status, _, _ = web.post("/api/jobs/REV-A/approve", b"{}", {"Authorization": "Basic abc"})
    assert status == 401
    assert (env.root / "review" / "REV-A").is_dir()
    status, answer = web.act("REV-A", "approve", web.token)
    assert (status, answer) == (200, {"ok": True, "message": "REV-A: approved; done"})
    assert json.loads((env.root / "done" / "REV-A" / "result.json").read_text())["state"] == "done"
    approved = wait_until(lambda: [e for e in web.events() if e.get("event") == "job.approved"], 10, "job.approved")
    assert approved[0]["job_id"] == "REV-A" and approved[0]["via"] == "web"
    again = web.act("REV-A", "approve", web.token)
    assert again == (409, {"ok": False, "message": "REV-A: is done, not waiting for review"})


def revision_note(env: Env, job_id: str) -> str | None:
    """Return a revision's note: from review/ID/revise.json, or once carried out, attempts/*/revision.json."""
    places = [env.root / "review" / job_id / "revise.json", *env.root.glob(f"*/{job_id}/attempts/*/revision.json")]
    for place in places:
        try:
            return str(json.loads(place.read_text())["note"])
        except FileNotFoundError:  # moved on by the daemon meanwhile: the next look finds it
            continue
    return None


def test_every_action_runs_the_commands_code(site: tuple[Env, Web]) -> None:
    """reject (with its reason), hold, release, cancel, retry and revise (with its note) act as the commands do."""
    env, web = site
    tok = web.token
    status, answer = web.act("REV-B", "reject", tok, note="wrong team")
    assert status == 200, answer
    assert json.loads((env.root / "failed" / "REV-B" / "result.json").read_text())["reason"] == "rejected: wrong team"
    assert web.act("QUEUED-1", "hold", tok)[0] == 200 and (env.root / "held" / "QUEUED-1.json").exists()
    assert web.act("QUEUED-1", "release", tok)[0] == 200 and (env.root / "inbox" / "QUEUED-1.json").exists()
    assert web.act("QUEUED-1", "cancel", tok)[0] == 200
    assert env.wait_job("QUEUED-1", "failed")["reason"] == "cancelled"
    assert web.act("FAIL-1", "retry", tok)[0] == 200

    def retried() -> bool:
        try:  # the folder leaves failed/ while the retry runs: read only a result.json that is there
            return len(env.result("FAIL-1", "failed")["attempts"]) == 2
        except (FileNotFoundError, AssertionError):
            return False

    wait_until(retried, 60, "FAIL-1 retried")
    for nothing in ({}, {"note": None}):  # as `dispatcher revise` without --note: refused, nothing recorded
        status, answer = web.act("REV-A", "revise", tok, **nothing)
        assert (status, answer["ok"]) == (400, False) and "needs a note" in answer["message"], answer
    assert not (env.root / "review" / "REV-A" / "revise.json").exists()
    status, answer = web.act("REV-A", "revise", tok, note="again, with team B")
    assert (status, answer["message"]) == (200, "REV-A: revision requested")
    # the note, in review/ until the running daemon carries the revision out, then kept in the attempt it reopened
    assert wait_until(lambda: revision_note(env, "REV-A"), 30, "REV-A's note") == "again, with team B"
    assert web.act("DONE-1", "hold", tok)[0] == 409
    assert web.act("NOPE-9", "cancel", tok)[0] == 404
    assert web.act("DONE-1", "explode", tok)[0] == 404
    status, _, _ = web.post("/api/jobs/REV-A/approve", b"{not json", {"Authorization": f"Bearer {tok}"})
    assert status == 400
    via = {e["event"] for e in web.events() if e.get("via") == "web"}
    assert {"job.rejected", "job.held", "job.released", "web.action"} <= via
    actions = [e for e in web.events() if e.get("event") == "web.action"]
    assert all("job_id" in e and "agent" in e for e in actions), actions  # lines about a job name both
    assert any(e["job_id"] == "REV-A" and e["agent"] for e in actions), actions
    queued = [e for e in actions if e["job_id"] == "QUEUED-1" and e["action"] in ("hold", "release")]
    assert len(queued) == 2 and all(e["agent"] for e in queued), queued  # a queued order's agent is its `to`


def test_api_status_right_after_an_action_or_a_command_agrees_with_status(sqlite_site: tuple[Env, Web]) -> None:
    """/api/status asked again at once after the view's own action, or a command, counts as `status --json` does."""
    env, web = sqlite_site
    for _ in range(3):
        assert web.json("/api/status")["counts"]["held"] == 1  # the overview asked for, so kept for a moment
        assert web.act("HELD-1", "release", web.token)[0] == 200
        assert web.json("/api/status")["counts"] == cli_json(env, "status")["counts"]
        assert web.json("/api/status")["counts"]["held"] == 0
        env.cli("hold", "HELD-1", check=True)
        assert web.json("/api/status")["counts"] == cli_json(env, "status")["counts"]
        assert web.json("/api/status")["counts"]["held"] == 1
    before = web.json("/api/status")["counts"]["inbox"]
    env.drop(order("LATE-1", to="slow"))  # slow runs one at a time: it stays queued
    assert web.json("/api/status")["counts"]["inbox"] == before + 1


def test_an_empty_revise_note_is_refused_by_the_view_and_the_command(site: tuple[Env, Web]) -> None:
    """A note that is empty or blank is no note (README: without a note revise is refused): 400 from the view, with
    its web.action line, and exit 2 from `dispatcher revise`; nothing is recorded."""
    env, web = site
    for note in ("", "   "):
        status, answer = web.act("REV-A", "revise", web.token, note=note)
        assert (status, answer["ok"]) == (400, False) and "needs a note" in answer["message"], answer
        proc = env.cli("revise", "REV-A", "--note", note)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--note" in proc.stderr, proc.stderr
    assert not (env.root / "review" / "REV-A" / "revise.json").exists()
    refused = [e for e in web.events() if e.get("event") == "web.action" and e.get("status") == 400]
    assert len(refused) == 2 and all(e["job_id"] == "REV-A" and e["via"] == "web" for e in refused), refused
    agent = json.loads((env.root / "review" / "REV-A" / "result.json").read_text())["agent"]
    assert [e["agent"] for e in refused] == [agent, agent], refused  # the job's agent, as every other outcome's line


def test_a_long_revise_note_is_taken_and_cut_as_the_command_cuts_it(site: tuple[Env, Web]) -> None:
    """A revise note of 70,000 characters through the API is recorded as `dispatcher revise --note` records it (the
    first 10,000 characters), not refused as a body too large."""
    env, web = site
    status, answer = web.act("REV-A", "revise", web.token, note="y" * 70_000)
    assert (status, answer["message"]) == (200, "REV-A: revision requested"), answer
    assert wait_until(lambda: revision_note(env, "REV-A"), 30, "REV-A's note") == "y" * 10_000


def test_a_note_with_a_lone_surrogate_is_refused_by_the_view(site: tuple[Env, Web]) -> None:
    """A JSON body may escape a lone surrogate (`"\\udcff"`), which no UTF-8 file holds: a revise note or a reject
    reason so made is a 400 naming it, as `--note` of such bytes exits 2; nothing is recorded."""
    env, web = site
    for action in ("revise", "reject"):
        status, answer = web.act("REV-A", action, web.token, note="bad \udcff byte")
        assert (status, answer["ok"]) == (400, False), answer
        assert answer["message"] == f"{action}: the note is not valid UTF-8 text", answer
    assert (env.root / "review" / "REV-A").is_dir() and not (env.root / "review" / "REV-A" / "revise.json").exists()


def test_forms_need_a_login_and_their_csrf_token(site: tuple[Env, Web]) -> None:
    """A form post without a session is 401, a forged one (no or wrong CSRF token) 403; a real one approves."""
    env, web = site
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert web.post("/jobs/REV-A/approve", b"csrf=x", form)[0] == 401
    status, _, _ = web.post("/login", b"token=wrong", form)
    assert status == 403
    status, _, headers = web.post("/login", f"token={web.token}".encode(), form)
    assert status == 303
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    logged = form | {"Cookie": cookie}
    assert web.post("/jobs/REV-A/approve", b"", logged)[0] == 403
    assert web.post("/jobs/REV-A/approve", b"csrf=forged", logged)[0] == 403
    assert web.post("/jobs/REV-A/approve", "csrf=é".encode(), logged)[0] == 403  # not a 500
    assert (env.root / "review" / "REV-A").is_dir()
    # other apps on this host set cookies a strict parser rejects; browsers send them along with ours (any port)
    crowded = {"Cookie": f'prefs={{"a":1}}; {cookie}; x=a b'}
    _, page, _ = web.get("/jobs/REV-A", crowded)
    csrf = page.split(b'name="csrf" value="', 1)[1].split(b'"', 1)[0].decode()
    status, _, headers = web.post("/jobs/REV-A/approve", f"csrf={csrf}".encode(), form | crowded)
    assert status == 303 and headers["Location"] == "/jobs/REV-A"
    _, page, _ = web.get("/jobs/REV-A", {"Cookie": cookie})
    assert b"REV-A: approved; done" in page and (env.root / "done" / "REV-A").is_dir()


def test_pages_are_self_contained_and_escaped(site: tuple[Env, Web]) -> None:
    """Every page answers 200 and loads nothing from outside (a strict CSP); a workspace diff shows escaped."""
    env, web = site
    pages = ("/", "/jobs", "/jobs?state=failed&agent=bad", "/review", "/jobs/CHAIN-1/chain", "/jobs/FAIL-1", "/login")
    for path in pages:
        status, body, headers = web.get(path)
        assert status == 200, path
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        assert b"http://" not in body.replace(web.url.encode(), b"") and b"https://" not in body, path
    assert web.get("/static/app.js")[0] == 200 and web.get("/static/../pyproject.toml")[0] == 404
    (env.root / "done" / "DONE-1" / "attempts" / "1" / "diff.patch").write_text("+++ b/a.py\n+print('<b>hi</b>')\n")
    _, page, _ = web.get("/jobs/DONE-1")
    assert b"workspace diff" in page and b"+print(&#39;&lt;b&gt;hi&lt;/b&gt;&#39;)" in page
    status, _, _ = web.get("/", {"Host": "evil.example:80"})
    assert status == 421


def test_a_non_loopback_listen_without_a_token_file_is_refused(env: Env) -> None:
    """`web --listen 0.0.0.0:PORT` without web_token_file exits 2 with one line, before binding anything."""
    proc = env.cli("web", "--listen", "0.0.0.0:8799", timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not a loopback address" in proc.stderr and "web_token_file" in proc.stderr


def _web_with_hosts(env: Env, hosts: str, listen: str) -> subprocess.Popen[str]:
    """Start `dispatcher web --listen LISTEN` in a mount namespace of its own whose /etc/hosts is hosts."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) (util-linux), as bash .ci/run has them")
    (env.tmp / "hosts").write_text(hosts)
    web = [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "web", "--listen", listen]
    script = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(env.tmp / "hosts"), *web]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=env.tmp, env=cli_env())


def test_a_listen_name_that_names_only_loopback_addresses_is_served_without_a_token(env: Env) -> None:
    """`--listen NAME:PORT` where NAME resolves to loopback addresses alone (the machine's own name in /etc/hosts) is
    loopback: served without web_token_file, and a Host header naming NAME is answered; a name that resolves to
    another address is refused as 0.0.0.0 is."""
    hosts = "127.0.0.1 localhost\n127.0.1.1 own-name.test\n10.1.2.3 lan-name.test\n"
    refused = _web_with_hosts(env, hosts, "lan-name.test:0")
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and err.count("\n") == 1 and "not a loopback address" in err, err
    proc = _web_with_hosts(env, hosts, "own-name.test:0")
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("dispatcher web: ") and "http://127.0.1.1:" in first, first
        port = int(first.rstrip().rstrip("/").rsplit(":", 1)[1])
        for host, want in ((f"own-name.test:{port}", 200), ("127.0.1.1", 200), ("evil.example", 421)):
            conn = http.client.HTTPConnection("127.0.1.1", port, timeout=30)
            conn.request("GET", "/api/status", headers={"Host": host})
            assert conn.getresponse().status == want, host
            conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_the_token_comes_from_web_token_file(env: Env) -> None:
    """With web_token_file the token is read from it and never printed; an empty file exits 2 naming the key."""
    token_file = env.tmp / "web.token"
    token_file.write_text("")
    env.configure(web_token_file=str(token_file))
    bad = env.cli("web", "--listen", "127.0.0.1:0", timeout=30)
    assert bad.returncode == 2 and "web_token_file" in bad.stderr and bad.stderr.count("\n") == 1
    token_file.write_text("s3cret-token-123\n")
    web = start_web(env)
    try:
        assert web.token is None and "s3cret" not in web.out.read_text()
        assert web.act("NOPE-1", "approve", "s3cret-token-123")[0] == 404
        assert web.act("NOPE-1", "approve", "other")[0] == 403
        assert web.json("/api/status")["counts"]["done"] == 0
    finally:
        assert web.stop() == 0


def test_web_works_without_a_daemon_and_without_the_extra_says_so(env: Env) -> None:
    """On a root no daemon ever ran the view answers; a Python without Jinja2 gets a one-line hint at the extra."""
    web = start_web(env)
    try:
        status = web.json("/api/status")
        assert status["daemons"] == [] and status["counts"]["done"] == 0
        _, page, _ = web.get("/")
        assert b"No daemon is running" in page
    finally:
        web.stop()
    code = "import sys; sys.modules['jinja2'] = None; from dispatcher.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--config", str(env.config_path), "web"],
        capture_output=True, text=True, timeout=60, env=cli_env(),
    )  # fmt: skip
    assert proc.returncode == 2 and "folder-dispatcher[web]" in proc.stderr


LIMITED = "import sys, time\nprint(f'rate limited until {int(time.time()) + 600}', flush=True)\nsys.exit(1)\n"


def test_a_job_waiting_at_a_usage_limit_is_listed_waiting_by_the_api_as_by_list(env: Env) -> None:
    """A job held by a usage limit is `waiting` (with `until`) in `list --state waiting --json`, not active:
    /api/jobs?state=waiting and ?state=active answer the same as the command, and the overview does not list it
    among the running agents."""
    script = env.tmp / "limited.py"
    script.write_text(LIMITED)
    limits = [{"match": r"rate limited until (\d+)", "until": "epoch"}]
    env.configure(agents={"worker": {"command": [sys.executable, str(script)], "limits": limits}})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("GATED-1"))
    d.wait_event("job.waiting", job_id="GATED-1")
    web = start_web(env)
    try:
        for state in ("waiting", "active"):
            cli = without_ages(cli_json(env, "list", "--state", state))
            assert without_ages(web.json(f"/api/jobs?state={state}")) == cli, state
        assert [r["job_id"] for r in web.json("/api/jobs?state=waiting")] == ["GATED-1"]
        assert web.json("/api/jobs?state=active") == []
        # the overview lists no agent running, and shows the job apart with when its gate lifts, as `status` does
        until = web.json("/api/status")["waiting"][0]["until"]
        _, page, _ = web.get("/")
        assert b'id="running"' not in page and b"No agent is running." in page
        held = page.split(b'<table id="gate-waits">', 1)[1].split(b"</table>", 1)[0]
        assert b'href="/jobs/GATED-1"' in held and until.encode() in held
        # paused by hand as well: no time ends the wait, and the pages say `resumed` as `status` and `show` do
        env.cli("pause", "worker", check=True)
        wait_until(lambda: b'<dd id="job-until">resumed</dd>' in web.get("/jobs/GATED-1")[1], 15, "until resumed")
        wait_until(lambda: b"<td>resumed</td>" in web.get("/")[1], 15, "the overview's until resumed")
        assert "waiting until resumed" in env.cli("show", "GATED-1", check=True).stdout
    finally:
        web.stop()
        assert d.stop() == 0


def test_the_overview_shows_a_gated_agent_until_it_is_resumed(env: Env) -> None:
    """`pause AGENT` shows the agent under "Gated agents" on the overview and in /api/status; `resume` clears it."""
    env.configure(agents={"worker": env.agent()})
    web = start_web(env)
    try:
        _, page, _ = web.get("/")
        assert b'id="no-gates"' in page
        env.cli("pause", "worker", check=True)
        wait_until(lambda: web.json("/api/status")["gates"], 15, "the gate in /api/status")
        gate = web.json("/api/status")["gates"][0]
        assert gate["agent"] == "worker"
        wait_until(lambda: b'<table id="gates">' in web.get("/")[1], 15, "the gated agent on the overview")
        _, page, _ = web.get("/")
        assert b"<td>worker</td>" in page
        env.cli("resume", "worker", check=True)
        wait_until(lambda: not web.json("/api/status")["gates"], 15, "the gate lifted")
        wait_until(lambda: b'id="no-gates"' in web.get("/")[1], 15, "no gated agent on the overview")
    finally:
        assert web.stop() == 0


@pytest.fixture
def sqlite_site(env: Env) -> Iterator[tuple[Env, Web]]:
    """A populated root on the SQLite ledger, with `dispatcher web` serving it."""
    populate(env)
    web = start_web(env)
    yield env, web
    web.stop()


def test_actions_read_the_config_as_it_is_now_and_keep_the_commands_note_lengths(sqlite_site: tuple[Env, Web]) -> None:
    """An action reads the config again, as a command does; a note is cut where the command cuts it, not before."""
    env, web = sqlite_site
    tok = web.token
    long_note = "n" * 5000  # `revise --note` keeps up to 10,000 characters
    assert web.act("REV-B", "revise", tok, note=long_note)[0] == 200
    assert wait_until(lambda: revision_note(env, "REV-B"), 30, "REV-B's note") == long_note
    cfg = yaml.safe_load(env.config_path.read_text())
    cfg["agents"]["reviewer"]["max_revisions"] = 0  # changed after `dispatcher web` started
    env.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    command = env.cli("revise", "REV-A", "--note", "from the command")
    status, answer = web.act("REV-A", "revise", tok, note="from the web")
    assert command.returncode == 1 and "max_revisions 0" in command.stderr, command
    assert (status, answer["message"]) == (409, command.stderr.strip()), answer
    env.config_path.write_text("agents: [")  # broken: nothing is done, as a command would exit 2
    status, answer = web.act("REV-A", "reject", tok, note="no")
    assert status == 503 and "dispatcher.yaml" in answer["message"], answer
    assert (env.root / "review" / "REV-A").is_dir()


def test_a_reject_with_a_null_note_takes_its_reason(sqlite_site: tuple[Env, Web]) -> None:
    """`{"note": null, "reason": TEXT}`: the reason is taken (README: `reason` is taken too); it was dropped for
    "no reason given"."""
    env, web = sqlite_site
    headers = {"Authorization": f"Bearer {web.token}", "Content-Type": "application/json"}
    status, _, _ = web.post("/api/jobs/REV-B/reject", b'{"note": null, "reason": "bad work"}', headers)
    assert status == 200
    assert json.loads((env.root / "failed" / "REV-B" / "result.json").read_text())["reason"] == "rejected: bad work"


def test_a_chunked_body_is_read_and_an_ipv6_loopback_host_is_answered(sqlite_site: tuple[Env, Web]) -> None:
    """A JSON body sent with Transfer-Encoding: chunked counts; `Host: [::1]` is a loopback host name."""
    env, web = sqlite_site
    host, port = web.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Authorization": f"Bearer {web.token}", "Content-Type": "application/json"}
    conn.request("POST", "/api/jobs/REV-B/reject", body=iter([b'{"reason": ', b'"chunky"}']), headers=headers,
                 encode_chunked=True)  # fmt: skip
    reply = conn.getresponse()
    assert reply.status == 200, reply.read()
    reply.read()
    result = json.loads((env.root / "failed" / "REV-B" / "result.json").read_text())
    assert result["reason"] == "rejected: chunky"
    for name in ("[::1]", f"[::1]:{port}", "localhost", "LOCALHOST", f"LocalHost.:{port}", f"127.0.0.1:{port}"):
        conn.request("GET", "/api/status", headers={"Host": name})
        reply = conn.getresponse()
        assert reply.status == 200, (name, reply.read())
        reply.read()
    conn.request("GET", "/api/status", headers={"Host": "evil.example:80"})
    reply = conn.getresponse()
    assert reply.status == 421
    reply.read()
    conn.close()


def test_numbers_int_cannot_read_are_bad_input_never_a_500_a_dropped_connection_or_a_traceback(
    sqlite_site: tuple[Env, Web],
) -> None:
    """`?page=²` (a digit to str.isdigit, not to int) and a page of 5,000 digits read as page 1, as `page=abc` does;
    a `Content-Length: ²` is answered (4xx), and `--listen 127.0.0.1:²` is the one-line usage error, exit 2.
    They gave a 500 and a `web.error` line, a closed connection and a traceback, and a traceback with exit 1."""
    env, web = sqlite_site
    for page in ("%C2%B2", "9" * 5000, "abc"):
        for path in ("/jobs", "/review"):
            status, body, _ = web.get(f"{path}?page={page}")
            assert status == 200, (path, page[:10], status, body[:200])
    host, port = web.url.removeprefix("http://").split(":")
    for length in (b"\xb2", b"9" * 5000):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + length + b"\r\n\r\n")
            answer = sock.recv(100)
        assert answer.startswith(b"HTTP/1.") and answer.split()[1][:1] == b"4", answer
    assert b"Traceback" not in web.out.read_bytes() and b"web.error" not in web.out.read_bytes()
    listen = env.cli("web", "--listen", "127.0.0.1:\u00b2")
    assert listen.returncode == 2 and listen.stderr.count("\n") == 1 and "--listen" in listen.stderr, listen.stderr


def test_methods_a_path_does_not_take_are_405_with_allow_and_a_refused_file_has_a_page(
    sqlite_site: tuple[Env, Web],
) -> None:
    """GET on an action, POST on a read, PUT anywhere: 405 naming what is allowed; OPTIONS says it too."""
    _, web = sqlite_site
    for method, path, allowed in (
        ("GET", "/api/jobs/REV-A/approve", "POST"),
        ("POST", "/api/status", "GET, HEAD"),
        ("PUT", "/api/jobs/REV-A", "GET, HEAD"),
        ("DELETE", "/jobs/REV-A", "GET, HEAD"),
        ("GET", "/logout", "POST"),
    ):
        status, body, headers = web.request(method, path, b"" if method != "GET" else None, None)
        assert (status, headers.get("Allow")) == (405, allowed), (method, path, status, body[:200])
    status, _, headers = web.request("OPTIONS", "/api/jobs/REV-A/approve", None, None)
    assert (status, headers.get("Allow")) == (204, "POST")
    for method, path in (("POST", "/api/nope"), ("POST", "/nope"), ("PUT", "/jobs/REV-A/chain/x"), ("GET", "/api")):
        status, body, headers = web.request(method, path, b"" if method != "GET" else None, None)
        assert status == 404 and "Allow" not in headers, (method, path, status, body[:200])  # no such path at all
    assert headers.get("X-Content-Type-Options") == "nosniff"  # the security headers of every answer
    refused = web.json("/api/jobs/broken")  # a file that never became a job: its refusal, as `show`
    status, page, _ = web.get("/jobs/broken")
    assert status == 200 and refused["reason"].split(":")[0].encode() in page, page[:300]


def test_approve_and_reject_in_the_web_view_count_in_the_daemons_metrics(env: Env) -> None:
    """Approve and reject through the web API: the running daemon counts them (done, failed, cost) and logs them."""
    prom = env.tmp / "m.prom"
    cost = json.dumps({"total_cost_usd": 0.25})
    env.configure(agents={"rev": env.agent("--json-result", cost, review=True)}, metrics_file=str(prom))
    d = env.daemon()
    d.wait_ready()
    for job_id in ("WR1", "WR2"):
        env.drop(order(job_id, to="rev"))
    wait_until(lambda: all((env.root / "review" / j / "result.json").exists() for j in ("WR1", "WR2")), 30, "review")
    web = start_web(env)
    try:
        assert web.act("WR1", "approve", web.token)[0] == 200
        assert web.act("WR2", "reject", web.token, reason="no")[0] == 200
    finally:
        web.stop()

    def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        s = samples(prom) if prom.exists() else {}
        failed = s.get(("dispatcher_jobs_finished_total", (("agent", "rev"), ("state", "failed"))))
        return s if failed == 1 else None

    s = wait_until(counted, 30, "the web's decisions in the metrics")
    assert s[("dispatcher_jobs_finished_total", (("agent", "rev"), ("state", "done")))] == 1
    assert s[("dispatcher_cost_usd_total", (("agent", "rev"),))] == 0.5
    assert d.wait_event("job.approved", job_id="WR1")["via"] == "web"
    assert d.stop() == 0


def test_a_deleted_or_rebuilt_ledger_is_read_again_not_the_file_the_view_held(env: Env) -> None:
    """After the ledger is deleted the view answers 503 as `status` exits 2; after a rebuild it agrees with `status`."""
    env.configure(agents={"worker": env.agent(*costing(0.12))})
    env.drop(order("LED-1"))
    assert env.cli("run", "--once").returncode == 0
    web = start_web(env)
    try:
        assert web.json("/api/status")["spend_24h"] == {"worker": 0.12}
        for f in env.root.glob(".state/ledger.sqlite3*"):
            f.unlink()
        assert env.cli("status", "--json").returncode == 2
        wait_until(lambda: web.get("/api/status")[0] == 503, 15, "a 503 once the overview's cache is out of date")
        _, body, _ = web.get("/api/status")
        assert "ledger rebuild" in json.loads(body)["error"], body[:300]
        env.cli("ledger", "rebuild", check=True)
        env.drop(order("LED-2"))
        assert env.cli("run", "--once").returncode == 0
        env.cli("pause", "worker", check=True)
        cli = json.loads(env.cli("status", "--json", check=True).stdout)
        assert cli["spend_24h"] == {"worker": 0.24}
        wait_until(lambda: web.json("/api/status")["spend_24h"] == cli["spend_24h"], 15, "the rebuilt ledger's spend")
        assert [g["agent"] for g in web.json("/api/status")["gates"]] == ["worker"]
        assert web.json("/api/jobs/LED-2")["state"] == "done"
    finally:
        assert web.stop() == 0


def test_a_job_page_shows_bidirectional_controls_escaped(env: Env) -> None:
    """A refused order whose reason quotes a U+202E: its page shows the control escaped; the API keeps it as is."""
    env.drop(json.dumps({**order("RTL-2"), "to": "gh\u202etso"}), name="RTL-2.json")
    assert env.cli("run", "--once").returncode == 1
    web = start_web(env)
    try:
        reason = web.json("/api/jobs/RTL-2")["reason"]
        assert "gh\u202etso" in reason, reason
        status, page, _ = web.get("/jobs/RTL-2")
        assert status == 200 and "\u202e".encode() not in page and b"gh\\u202etso" in page, page[:300]
    finally:
        assert web.stop() == 0


def test_web_lines_follow_log_file_through_a_rotation_and_sighup(env: Env) -> None:
    """log_file moved aside (logrotate's rename and create): the web view's next action lines land in the new file,
    as `dispatcher logs` reads it (section 8); a SIGHUP, as a rotation may send, does not end it."""
    log_file = env.tmp / "log" / "d.log"
    env.configure(log_file=str(log_file))
    env.drop(order("ROT-1"))  # no daemon: it stays queued in inbox/
    web = start_web(env)
    try:
        assert web.act("ROT-1", "hold", web.token)[0] == 200
        wait_until(lambda: "job.held" in log_file.read_text(), 10, "job.held in log_file")
        log_file.rename(log_file.with_suffix(".log.1"))
        log_file.touch()
        web.proc.send_signal(signal.SIGHUP)
        assert web.act("ROT-1", "release", web.token)[0] == 200
        wait_until(lambda: "job.released" in log_file.read_text(), 10, "job.released in the new log_file")
        assert web.proc.poll() is None
        assert "job.released" not in log_file.with_suffix(".log.1").read_text()
    finally:
        assert web.stop() == 0


def test_web_lines_go_to_the_log_file_the_config_names_now(env: Env) -> None:
    """log_file changed in the config after `dispatcher web` started (as a reload moves the daemon's): the view's next
    action lines (`job.held`, `web.action`) land in the new file, where `dispatcher logs` reads them, not the old."""
    old, new = env.tmp / "a.log", env.tmp / "b.log"
    env.configure(log_file=str(old))
    env.drop(order("MOVE-1"))  # no daemon: it stays queued in inbox/
    web = start_web(env)
    try:
        env.configure(log_file=str(new))
        assert web.act("MOVE-1", "hold", web.token)[0] == 200
        wait_until(lambda: new.exists() and "job.held" in new.read_text(), 10, "job.held in the new log_file")
        assert '"web.action"' in new.read_text()
        assert "job.held" not in (old.read_text() if old.exists() else "")
        shown = env.cli("logs", "--job", "MOVE-1", check=True).stdout
        assert "job.held" in shown, shown
    finally:
        assert web.stop() == 0


def test_actions_on_a_queued_or_held_order_are_the_wrong_state_not_an_unknown_job(sqlite_site: tuple[Env, Web]) -> None:
    """approve, reject, retry and revise of an order still in inbox/ or held/: the job is known (`show` shows it),
    only in the wrong state: 409 as the command's exit 1 says, never 404 "no such job"."""
    env, web = sqlite_site
    for job_id, state in (("QUEUED-1", "queued"), ("HELD-1", "held")):
        for action, only in (
            ("approve", "not waiting for review"),
            ("reject", "not waiting for review"),
            ("retry", "only a failed job can be retried"),
            ("revise", "only a job in review or failed can be revised"),
        ):
            status, answer = web.act(job_id, action, web.token, note="x")
            assert (status, answer["message"]) == (409, f"{job_id}: is {state}, {only}"), (action, answer)
            args = ("--note", "x") if action == "revise" else ()
            command = env.cli(action, job_id, *args)
            assert (command.returncode, command.stderr) == (1, f"{job_id}: is {state}, {only}\n"), command


def test_a_refused_file_named_like_no_job_id_is_found_by_its_stem_as_show_finds_it(env: Env) -> None:
    """`my order.json` refused: `/api/jobs/my%20order` answers what `show "my order" --json` prints."""
    env.configure()
    env.drop(b"job_id: [", "my order.json")
    env.cli("run", "--once", timeout=60)
    web = start_web(env)
    try:
        shown = json.loads(env.cli("show", "my order", "--json", check=True).stdout)
        got = web.json("/api/jobs/my%20order")
        assert without_ages(got) == without_ages(shown) and got["state"] == "refused", got
        assert web.get("/jobs/my%20order")[0] == 200
        assert web.get("/api/jobs/your%20order")[0] == 404
    finally:
        assert web.stop() == 0


def test_web_over_a_lost_ledger_exits_2_naming_ledger_rebuild_as_every_command(env: Env) -> None:
    """Job folders with no ledger: `dispatcher web` exits 2 with the one line `status` gives, before it listens."""
    env.configure()
    env.drop(order("LOST-1"))
    env.cli("run", "--once", timeout=60)
    (env.root / ".state" / "ledger.sqlite3").unlink()
    status = env.cli("status")
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "web", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=env.tmp, env=cli_env(), timeout=60,
    )  # fmt: skip
    assert status.returncode == 2 and "dispatcher ledger rebuild" in status.stderr
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", status.stderr), proc


def test_fifty_requests_at_once_are_all_answered(sqlite_site: tuple[Env, Web]) -> None:
    """50 clients at the same moment, 25 reading the overview and 25 acting on a job in the wrong state: every one
    gets its answer (200 and 409), none a reset connection (a listen backlog of 5 reset most of them)."""
    import threading
    import urllib.error
    import urllib.request

    _, web = sqlite_site
    start = threading.Barrier(50)
    answers: list[object] = []

    def one(i: int) -> None:
        if i % 2:
            req = urllib.request.Request(web.url + "/api/status")  # noqa: S310 - the test's own server
        else:
            req = urllib.request.Request(  # noqa: S310 - the test's own server
                web.url + "/api/jobs/DONE-1/approve", data=b"{}", method="POST",
                headers={"Authorization": f"Bearer {web.token}", "Content-Type": "application/json"},
            )  # fmt: skip
        start.wait()
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - the test's own server
                answers.append(r.status)
        except urllib.error.HTTPError as exc:
            answers.append(exc.code)
        except OSError as exc:
            answers.append(type(exc).__name__)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(answers, key=str) == [200] * 25 + [409] * 25, answers


def test_a_view_started_on_a_ledger_of_the_release_before_follows_the_daemons_writes(env: Env) -> None:
    """The view started on a ledger no daemon of this version opened yet (no `spent` column: the release before)
    reads it through an upgraded copy; once a daemon has upgraded the file and runs jobs, and a pause is set, the
    view shows them as `status --json` does. It kept showing the copy made at its start until restarted."""
    import contextlib
    import sqlite3

    env.configure(agents={"worker": env.agent(*costing(1.0))})
    env.drop(order("OLD-1"))
    assert env.cli("run", "--once", timeout=60).returncode == 0
    ledger = env.root / ".state" / "ledger.sqlite3"
    with contextlib.closing(sqlite3.connect(ledger, isolation_level=None)) as db:
        db.execute("DROP INDEX IF EXISTS jobs_spent")
        db.execute("ALTER TABLE jobs DROP COLUMN spent")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    web = start_web(env)
    try:
        assert web.json("/api/status")["spend_24h"] == {"worker": 1.0}
        env.drop(order("NEW-1"))
        assert env.cli("run", "--once", timeout=60).returncode == 0  # this version's daemon upgrades the file
        env.cli("pause", "worker", check=True)
        want = cli_json(env, "status")
        assert want["spend_24h"] == {"worker": 2.0} and [g["agent"] for g in want["gates"]] == ["worker"], want

        def followed() -> bool:
            seen = web.json("/api/status")
            return bool(seen["spend_24h"] == want["spend_24h"] and seen["gates"] == want["gates"])

        wait_until(followed, 15, "the view to show the new job's spend and the pause")
        assert {j["job_id"] for j in web.json("/api/jobs")} == {"OLD-1", "NEW-1"}
    finally:
        assert web.stop() == 0
