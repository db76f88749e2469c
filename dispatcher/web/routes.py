"""`dispatcher web`: requests to answers, and the view's lifecycle (``serve``).

Which path shows which page, which API call answers what, who may act.

``App.handle`` takes a method, the raw path and the few headers it needs and
returns a ``Reply``; it never touches the socket (``web.server`` does), so each
route is a plain function of the request. Ids are taken from the path one
segment at a time after percent-decoding; anything that is not a job id is an
unknown job (404), never a path to open.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from importlib import resources
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import structlog

from dispatcher import logs
from dispatcher.errors import DispatchError, UsageError, printable
from dispatcher.layout import Layout
from dispatcher.spec.settings import Config
from dispatcher.text import is_count
from dispatcher.web import pages
from dispatcher.web.actions import ACTIONS, Actions
from dispatcher.web.auth import COOKIE, SESSION_S, Auth, load_token, names_loopback, parse_listen
from dispatcher.web.reads import Reader, attempt_files
from dispatcher.web.server import DEFAULT_LISTEN, Reply, Request, open_server

log = structlog.get_logger("dispatcher")
_STATIC = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}
_HTML = "text/html; charset=utf-8"
_JSON = "application/json"
#: a wrong token at the login form costs this long, so guessing a short token by hand is slow
_LOGIN_PAUSE_S = 0.3
_MAX_FLASH = 1000


def _json(status: int, value: Any) -> Reply:
    return Reply(status, (json.dumps(value, indent=2) + "\n").encode(), _JSON)


def _error(status: int, message: str) -> Reply:
    return _json(status, {"error": message})


def _redirect(where: str, *headers: tuple[str, str]) -> Reply:
    return Reply(303, b"", _HTML, [("Location", where), *headers])


class App:
    """The web view's routes over one dispatch root."""

    def __init__(self, config: Config, layout: Layout, auth: Auth) -> None:
        self.config = config
        self.reader = Reader(config, layout)
        self.actions = Actions(config, layout)
        self.auth = auth
        self._flash: dict[str, str] = {}

    def close(self) -> None:
        """Release the ledger."""
        self.reader.close()

    def handle(self, req: Request) -> Reply:
        """Answer one request; a ledger that cannot be read is a 503 with its one-line reason."""
        split = urlsplit(req.target)
        parts = [unquote(p, errors="replace") for p in split.path.split("/")[1:]]
        if len(parts) > 1 and parts[-1] == "":  # /api/jobs/ is /api/jobs, /jobs/ID/ is /jobs/ID (not / itself)
            parts.pop()
        query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        api = parts[:1] == ["api"]
        allowed = _allowed(parts)
        if not allowed:  # no such path, whatever the method
            message = "no such API path (GET /api/status, /api/jobs, /api/jobs/ID; POST /api/jobs/ID/ACTION)"
            message = message if api else "no such page"
            return _error(404, message) if api else self._page_error(404, message, req)
        if req.method == "OPTIONS":
            return Reply(204, b"", _JSON, [("Allow", allowed)])
        if req.method not in allowed.split(", "):
            message = f"{req.method}: not allowed here (allowed: {allowed})"
            reply = _error(405, message) if api else self._page_error(405, message, req)
            return Reply(reply.status, reply.body, reply.content_type, [("Allow", allowed)])
        try:
            if req.method in ("GET", "HEAD"):
                return self._api_get(parts[1:], query) if api else self._page(parts, query, req)
            return self._api_post(parts[1:], req) if api else self._form(parts, req)
        except DispatchError as exc:
            message = f"the root cannot be read right now: {exc}"
            return _error(503, message) if api else self._page_error(503, message, req)

    # -- the JSON API ---------------------------------------------------------------------
    def _api_get(self, parts: list[str], query: dict[str, str]) -> Reply:
        if parts == ["status"]:
            return _json(200, self.reader.status())
        if parts == ["jobs"]:
            state = query.get("state") or None
            if state is not None and state not in pages.STATES:
                return _error(400, f"state: {printable(state)}: not one of {', '.join(pages.STATES)}")
            return _json(200, self.reader.jobs(state, query.get("agent") or None))
        if len(parts) == 2 and parts[0] == "jobs":
            job = self.reader.show(parts[1], refused=True)  # as `show --json`: a refused file's id answers too
            return _json(200, job) if job is not None else _error(404, f"{printable(parts[1])}: no such job")
        return _error(404, "no such API path (GET /api/status, /api/jobs, /api/jobs/ID)")

    def _api_post(self, parts: list[str], req: Request) -> Reply:
        if len(parts) != 3 or parts[0] != "jobs":
            return _error(404, "no such API path (POST /api/jobs/ID/ACTION)")
        denied = self.auth.bearer(req.headers.get("authorization"))
        if denied == 401:
            return Reply(
                401, _error(401, "an action needs the token: Authorization: Bearer TOKEN").body, _JSON,
                [("WWW-Authenticate", 'Bearer realm="dispatcher"')],
            )  # fmt: skip
        if denied:
            return _error(403, "wrong token")
        try:
            body = json.loads(req.body or b"{}")
        except (ValueError, UnicodeDecodeError):
            return _error(400, 'the body is not JSON (give {} or {"note": TEXT})')
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        note = body.get("note")
        if note is None:  # `reason` is taken too (a reject's word), also beside "note": null
            note = body.get("reason")
        if note is not None and not isinstance(note, str):
            return _error(400, "note: not a string")
        outcome = self.actions.run(parts[2], parts[1], note=note, who="token")
        self.reader.forget()
        return _json(outcome.status, {"ok": outcome.ok, "message": outcome.message})

    # -- pages ----------------------------------------------------------------------------
    def _session(self, req: Request) -> str | None:
        return self.auth.session(req.headers.get("cookie"))

    def _page_error(self, status: int, message: str, req: Request) -> Reply:
        return Reply(status, pages.error_page(status, message, session=self._session(req)).encode())

    def _page(self, parts: list[str], query: dict[str, str], req: Request) -> Reply:
        sid = self._session(req)
        csrf = self.auth.csrf(sid) if sid else None
        partial = query.get("partial") == "1"
        if parts in ([""], []):
            return Reply(200, pages.overview(self.reader.status(), partial=partial, session=sid).encode())
        if parts[0] in ("jobs", "review") and len(parts) == 1:
            review = parts[0] == "review"
            state = "review" if review else (query.get("state") or None)
            if state is not None and state not in pages.STATES:
                return self._page_error(400, f"state: {printable(state)}: not one of {', '.join(pages.STATES)}", req)
            agent = None if review else (query.get("agent") or None)
            page = int(query["page"]) if is_count(query.get("page", "")) else 1
            rows = self.reader.jobs(state, agent)
            html = pages.job_list(
                rows, state=state, agent=agent, page=page, partial=partial, session=sid, csrf=csrf, review=review
            )
            return Reply(200, html.encode())
        if parts[0] == "jobs" and len(parts) in (2, 3) and parts[2:] in ([], ["chain"]):
            chain = parts[2:] == ["chain"]
            job = self.reader.show(parts[1], whole_tree=chain, refused=not chain)  # a refused file's too, as `show`
            if job is None:
                return self._page_error(404, f"{printable(parts[1])}: no such job", req)
            if chain:
                return Reply(200, pages.chain_page(job, partial=partial, session=sid).encode())
            message = self._flash.pop(sid, None) if sid and not partial else None
            html = pages.job_page(job, attempt_files(job), message=message, partial=partial, session=sid, csrf=csrf)
            return Reply(200, html.encode())
        if parts == ["login"]:
            return Reply(200, pages.login_page(failed=False, session=sid, csrf=csrf, partial=partial).encode())
        if len(parts) == 2 and parts[0] == "static" and parts[1] in _STATIC:
            data = resources.files("dispatcher.web").joinpath("static", parts[1]).read_bytes()
            return Reply(200, data, _STATIC[parts[1]], [("Cache-Control", "max-age=300")])
        return self._page_error(404, "no such page", req)

    def _form(self, parts: list[str], req: Request) -> Reply:
        fields = {k: v[0] for k, v in parse_qs(req.body.decode("utf-8", "replace"), keep_blank_values=True).items()}
        sid = self._session(req)
        if parts == ["login"]:
            new = self.auth.login(fields.get("token", "").strip())
            if new is None:
                time.sleep(_LOGIN_PAUSE_S)
                return Reply(403, pages.login_page(failed=True, session=None, csrf=None).encode())
            cookie = f"{COOKIE}={new}; Path=/; HttpOnly; SameSite=Strict; Max-Age={int(SESSION_S)}"
            return _redirect("/", ("Set-Cookie", cookie))
        if sid is None:
            return self._page_error(401, "log in with the action token first", req)
        if not self.auth.csrf_ok(sid, fields.get("csrf")):
            return self._page_error(403, "this form did not come from this page (its CSRF token is wrong)", req)
        if parts == ["logout"]:
            self.auth.logout(sid)
            return _redirect("/login", ("Set-Cookie", f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"))
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] in ACTIONS:
            outcome = self.actions.run(parts[2], parts[1], note=fields.get("note") or None, who="session")
            self.reader.forget()
            if len(self._flash) > _MAX_FLASH:  # messages never read (a closed tab): forget them
                self._flash.clear()
            self._flash[sid] = outcome.message
            if self.reader.show(parts[1]) is None:
                return self._page_error(outcome.status, outcome.message, req)
            return _redirect(f"/jobs/{quote(parts[1], safe='')}")
        return self._page_error(404, "no such action", req)


def _allowed(parts: list[str]) -> str:
    """Return the methods a path answers to, as its ``Allow`` header says them ("" for no such path)."""
    n = len(parts)
    if parts[:1] == ["api"]:
        if n == 4 and parts[1] == "jobs":
            return "POST"
        known = parts[1:] in (["status"], ["jobs"]) or (n == 3 and parts[1] == "jobs")
        return "GET, HEAD" if known else ""
    if parts == ["login"]:
        return "GET, HEAD, POST"
    if parts == ["logout"] or (n == 3 and parts[0] == "jobs" and parts[2] != "chain"):
        return "POST"
    if parts in ([], [""], ["jobs"], ["review"]) or (parts[:1] in (["jobs"], ["static"]) and n == 2):
        return "GET, HEAD"
    return "GET, HEAD" if n == 3 and parts[0] == "jobs" else ""


def serve(config: Config, listen: str | None) -> int:
    """Serve the web view of config's root on listen (ADDR:PORT) until SIGTERM or SIGINT; return 0.

    A non-loopback address without ``web_token_file`` is refused (UsageError,
    exit 2) before anything is bound, and so is a ledger lost beside job folders (LedgerLost).
    """
    address = listen or DEFAULT_LISTEN
    host, port = parse_listen(address)
    loopback = names_loopback(host)
    if not loopback and config.web_token_file is None:
        raise UsageError(
            f"web: --listen {address} is not a loopback address: set web_token_file in the config to serve it"
        )
    token = load_token(config)
    app = App(config, Layout(config.root), Auth(token.value))
    app.reader.check()  # a ledger lost beside job folders: exit 2 naming `ledger rebuild`, as every command
    try:
        server = open_server(host, port, app, loopback_only=loopback, name=host)
    except OSError as exc:
        raise UsageError(f"web: cannot listen on {address}: {exc.strerror or exc}") from None
    bound = server.server_address
    bound_host, bound_port = str(bound[0]), int(bound[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"dispatcher web: {config.root} on http://{shown}:{bound_port}/", flush=True)
    if token.made:
        print(f"action token (printed once; set web_token_file to keep one): {token.value}", flush=True)
    log.info("web.started", root=str(config.root), listen=f"{shown}:{bound_port}", token_made=token.made)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a rotation's SIGHUP: log_file is followed (below), not a stop
    logs.SINK.follow = True  # no one signals this process at a log rotation: its lines follow log_file's path
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="web", daemon=True)
    thread.start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()
        app.close()
        log.info("web.stopped", root=str(config.root))
    return 0
