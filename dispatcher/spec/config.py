"""Load the config (contract section 3) into frozen dataclasses.

One loader: it parses with the strict loader, checks ``schemas/config.schema.json``,
resolves relative paths against the config file's folder, and names the key in
every error. Internal names carry units (``timeout_s``) where the file says
``timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dispatcher.errors import ConfigError, OrderError, UsageError
from dispatcher.fsutil import plain_rel
from dispatcher.spec import schema
from dispatcher.spec.agent_rules import build_checks, build_limits
from dispatcher.spec.loader import load_document
from dispatcher.spec.repo import build_repo_settings
from dispatcher.spec.settings import Agent, Config, resolve_argv
from dispatcher.text import describe, number

DEFAULT_CONFIG = Path("config/dispatcher.yaml")
SYSTEM_CONFIG = Path("/etc/dispatcher/dispatcher.yaml")
CONFIG_ENV = "DISPATCHER_CONFIG"


def file_digest(data: bytes) -> str:
    """Return the short digest of a config file's bytes that daemons record and commands compare."""
    return hashlib.sha256(data).hexdigest()[:16]


def config_mark(cfg: Config) -> str | None:
    """Return what a daemon records of the config it loaded: its file's digest, then the file's path as given
    (absolute; a symlink is kept: a reload reads the path again, wherever it points then).

    A command compares its own file with the daemons of this host that loaded that same file
    (``ops.daemons.config_note``): another file, or another host's, never "has changed".
    """
    if cfg.digest is None:
        return None
    where = cfg.given or (str(cfg.path) if cfg.path is not None else None)
    return cfg.digest if where is None else f"{cfg.digest} {where}"


_TOP = {
    "max_jobs": ("max_jobs", int),
    "max_timeout": ("max_timeout_s", float),
    "max_hops": ("max_hops", int),
    "max_followups": ("max_followups", int),
    "max_order_bytes": ("max_order_bytes", int),
    "stop_timeout": ("stop_timeout_s", float),
    "retry_delay": ("retry_delay_s", float),
    "rescan_interval": ("rescan_interval_s", float),
    "settle": ("settle_s", float),
    "kill_grace": ("kill_grace_s", float),
    "max_log_bytes": ("max_log_bytes", int),
    "notify_max_running": ("notify_max_running", int),
    "lease": ("lease_s", float),
    "poll_interval": ("poll_interval_s", float),
    "max_limit_wait": ("max_limit_wait_s", float),
    "max_wait": ("max_wait_s", float),
}


def find_config(explicit: str | None) -> Path:
    """Return the config path a command uses, whether or not the file exists.

    ``--config`` (explicit), else ``$DISPATCHER_CONFIG``, else the first of
    ``./config/dispatcher.yaml`` and ``/etc/dispatcher/dispatcher.yaml`` that exists,
    else ``./config/dispatcher.yaml`` (where ``init`` writes a starter config).
    A named file is never passed over for another: a typo is not guessed around.
    """
    if explicit is not None:
        if not explicit:  # as `--config "$CFG"` with CFG unset gives: an error, not the next place
            raise UsageError("--config: the file name is empty")
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return next((p for p in (DEFAULT_CONFIG, SYSTEM_CONFIG) if _may_exist(p)), DEFAULT_CONFIG)


def _may_exist(path: Path) -> bool:
    """Return True if path exists, or lies in a folder this user may not search (reading it then says why)."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def config_places(explicit: str | None) -> list[str]:
    """Return the places `find_config` looks in, as a user would read them in an error."""
    if explicit is not None:
        return [f"{explicit} (--config)"]
    env = os.environ.get(CONFIG_ENV)
    if env:
        return [f"{env} (${CONFIG_ENV})"]
    return [f"./{DEFAULT_CONFIG}", str(SYSTEM_CONFIG)]


def require_config(explicit: str | None) -> Path:
    """Return the config path to use; raise UsageError naming every place tried when none exists."""
    path = find_config(explicit)
    if not _may_exist(path):
        raise UsageError(f"no config found (looked in: {', '.join(config_places(explicit))})")
    return path


def require_root(cfg: Config) -> Path:
    """Return the config's dispatch root; raise UsageError naming it when it is not an existing folder.

    Only ``init`` makes a root: a typo in ``root:`` or ``--root`` must not start a new one.
    """
    try:
        st = os.stat(cfg.root)
    except PermissionError as exc:
        raise UsageError(f"root {cfg.root} cannot be reached: {exc.strerror}") from None
    except OSError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        what = "is not a folder" if st is not None else "does not exist"
        where = f"root: in {cfg.path} or --root" if cfg.path is not None else "--root"
        raise UsageError(f"root {cfg.root} {what} (check {where}; `dispatcher init DIR` makes one)")
    return cfg.root


def load_config(path: Path, *, root: Path | None = None) -> Config:
    """Load and validate a config file; raise ConfigError naming the file and key.

    ``root`` (from ``--root``) overrides the file's ``root``.
    """
    name = str(path)
    try:
        data = path.read_bytes()  # a pipe too: `--config <(envsubst < tmpl.yaml)`
    except FileNotFoundError:
        raise ConfigError("config file not found", file=name) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=name) from None
    try:
        body = load_document(data, "json" if path.suffix == ".json" else "yaml", aliases=True)
        built = build_config(body, path, root=root)
        return dataclasses.replace(built, digest=file_digest(data), given=os.path.abspath(path))
    except OrderError as exc:
        raise ConfigError(exc.message, file=name, field=exc.field) from None


def build_config(body: Any, path: Path | None, *, root: Path | None = None) -> Config:
    """Validate a parsed config body and build the Config."""
    if not isinstance(body, dict):
        raise ConfigError(f"the top level must be a mapping, not {describe(body)}")
    schema.validate(body, "config")
    base = path.resolve().parent if path is not None else Path.cwd()
    values: dict[str, Any] = {}
    for key, (attr, kind) in _TOP.items():
        if key in body:
            values[attr] = kind(body[key])
    max_timeout = values.get("max_timeout_s", 3600.0)
    if root is None:
        root = base / body["root"] if "root" in body else Path("dispatch")
    log_file = body.get("log_file")
    agents = {}
    for agent_name, spec in body.get("agents", {}).items():
        agent = _build_agent(agent_name, spec, base)
        if "timeout" not in spec:  # the default, 600 s, is at most max_timeout: never an error of its own
            agent = replace(agent, timeout_s=min(agent.timeout_s, max_timeout))
        elif agent.timeout_s > max_timeout:
            raise ConfigError(
                f"{number(agent.timeout_s)} is above max_timeout ({number(max_timeout)})",
                field=f"agents.{agent_name}.timeout",
            )
        agents[agent_name] = agent
    metrics = body.get("metrics_file")
    notify = body.get("notify")
    token_file = body.get("web_token_file")
    return Config(
        path=path.resolve() if path is not None else None,
        root=Path(os.path.abspath(root)),
        log_file=Path(os.path.abspath(base / log_file)) if log_file else None,
        metrics_file=os.path.abspath(base / metrics) if metrics else None,
        metrics_labels=dict(body.get("metrics_labels") or {}),
        notify=resolve_argv(notify, base) if notify else None,
        max_chain_cost_usd=body.get("max_chain_cost_usd"),
        max_daily_cost_usd=body.get("max_daily_cost_usd"),
        web_token_file=Path(os.path.abspath(base / token_file)) if token_file else None,
        ledger=body.get("ledger", "sqlite"),
        watch=body.get("watch", "inotify"),
        agents=agents,
        **values,
    )


def _build_agent(name: str, spec: Mapping[str, Any], base: Path) -> Agent:
    probe = spec.get("probe")
    return Agent(
        name=name,
        command=resolve_argv(spec["command"], base),
        prompt=spec.get("prompt"),
        timeout_s=float(spec.get("timeout", 600)),
        concurrency=int(spec.get("concurrency", 1)),
        max_attempts=int(spec.get("max_attempts", 1)),
        retry_safe=bool(spec.get("retry_safe", False)),
        probe=resolve_argv(probe, base) if probe is not None else None,
        repair=bool(spec.get("repair", False)),
        writes=tuple(plain_rel(w) for w in spec.get("writes", ())),  # ./x.txt is x.txt
        env=_env(name, spec.get("env", {})),
        pass_env=_pass_env(name, spec.get("pass_env", ())),
        max_cost_usd=spec.get("max_cost_usd"),
        review=bool(spec.get("review", False)),
        idle_timeout_s=float(spec["idle_timeout"]) if spec.get("idle_timeout") is not None else None,
        limits=build_limits(name, spec.get("limits") or []),
        checks=build_checks(name, spec.get("checks") or [], base, resolve_argv),
        resume=resolve_argv(spec["resume"], base) if spec.get("resume") is not None else None,
        max_revisions=int(spec.get("max_revisions", 5)),
        max_daily_cost_usd=spec.get("max_daily_cost_usd"),
        repo=build_repo_settings(name, spec, base),
    )


# Set by the daemon for each attempt, or the daemon's own line to systemd (contract 3 and 9):
# an agent never gets the daemon's values of these, so naming them in pass_env is a mistake.
def _pass_env(agent: str, names: list[str]) -> tuple[str, ...]:
    for i, name in enumerate(names):
        if _daemons_own(name):
            raise ConfigError(f"{name} is never passed to agents", field=f"agents.{agent}.pass_env[{i}]")
    return tuple(names)


def _env(agent: str, values: Mapping[str, str]) -> dict[str, str]:
    """Return an agent's ``env``; a name the daemon sets itself, or never passes, is an error naming it."""
    for name in values:
        if name in SET_PER_ATTEMPT:
            raise ConfigError(
                "set by the daemon for each attempt, never by the config", field=f"agents.{agent}.env.{name}"
            )
        if name == "NOTIFY_SOCKET" or name.startswith("WATCHDOG_"):
            raise ConfigError(
                "never passed to agents (the daemon's own line to systemd)", field=f"agents.{agent}.env.{name}"
            )
    return dict(values)


#: what the daemon puts in an agent's (or a hook's, or a notify command's) environment itself
SET_PER_ATTEMPT = frozenset(f"DISPATCH_{n}" for n in ("JOB_ID", "ORDER", "WORKSPACE", "RECEIPT", "ATTEMPT", "EVENT"))


def _daemons_own(name: str) -> bool:
    return name == "NOTIFY_SOCKET" or name.startswith(("DISPATCH_", "WATCHDOG_"))


def salvage_target(path: Path, *, root: Path | None = None) -> Config | None:
    """Return the root and ledger a config that does not load still names, or None when it names none.

    For `reload` of a config the daemon itself would refuse: its live daemons are still
    found and sent SIGHUP, as the contract has it, so that each says ``config.rejected``
    and reopens its log file. Only ``root`` (or ``--root``) and ``ledger`` are read, as
    the loader would resolve them; a file that is no mapping of YAML names neither.
    """
    try:
        data = path.read_bytes()
    except OSError:
        return None if root is None else default_config(root)
    try:
        body = load_document(data, "json" if path.suffix == ".json" else "yaml", aliases=True)
    except OrderError:  # a file that does not parse: its plain `root:` and `ledger:` lines (or JSON members)
        body = _json_scalars(data) if path.suffix == ".json" else _top_scalars(data)
    if not isinstance(body, dict):
        return None if root is None else default_config(root)
    named = body.get("root")
    if root is None and named is not None and not isinstance(named, str):
        return None
    base = path.resolve().parent
    ledger = body.get("ledger", "sqlite")
    if not isinstance(ledger, str) or not ledger:
        return None
    where = root if root is not None else (base / named if named else Path("dispatch"))
    return replace(default_config(where), path=path.resolve(), ledger=ledger)


_TOP_SCALAR = re.compile(r"(root|ledger):[ \t]*(?:\"([^\"]*)\"|'([^']*)'|([^\s#'\"][^#]*?))?[ \t]*(?:#.*)?")


def _top_scalars(data: bytes) -> dict[str, str] | None:
    """Return the `root:` and `ledger:` a config names on plain top-level lines (for YAML that does not parse)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _TOP_SCALAR.fullmatch(line.rstrip())
        if m is not None and m.group(1) not in out:
            value = next((g for g in m.groups()[1:] if g is not None), None)
            if value:
                out[m.group(1)] = value
    return out


_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_JSON_VALUE = re.compile(r'\s*:\s*"((?:[^"\\]|\\.)*)"')


def _json_scalars(data: bytes) -> dict[str, str] | None:
    """Return the top-level `"root": "..."` and `"ledger": "..."` string members of a JSON config that does not parse.

    One pass that skips strings and counts brackets, so that a member of the same name inside
    an agent (an `env` variable called `root`) is not taken for the config's own.
    """
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    out: dict[str, str] = {}
    depth = i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            key = _JSON_STRING.match(text, i)
            if key is None:
                break  # a string never closed: the file ends in it
            i = key.end()
            value = _JSON_VALUE.match(text, i) if depth == 1 and key.group(1) in ("root", "ledger") else None
            if value is not None:
                i = value.end()
                with contextlib.suppress(ValueError):  # an escape JSON does not know: that member is left out
                    out.setdefault(key.group(1), json.loads(f'"{value.group(1)}"'))
            continue
        depth += 1 if c in "{[" else -1 if c in "}]" else 0
        i += 1
    return out


def default_config(root: Path | None) -> Config:
    """Return the built-in defaults (no agents), for commands that need no config file."""
    return Config(path=None, root=Path(os.path.abspath(root or "dispatch")))


STARTER_CONFIG = """\
# dispatcher config: every key of the contract, with its default.
# Relative paths resolve against the folder that holds this file.
root: {root}
max_jobs: 2                # agents running at once in this daemon process
max_timeout: 3600          # ceiling for an agent's timeout and an order's, in seconds
max_hops: 5                # longest chain of follow-ups
max_followups: 100         # most follow-ups one job may hand off (more fails followups_valid; 0: none)
max_order_bytes: 1048576   # larger orders are refused
stop_timeout: 60           # seconds a stop waits for running agents
retry_delay: 2             # seconds before a retry; doubles each time, at most 300
rescan_interval: 30        # seconds between safety rescans of inbox/
settle: 2                  # seconds a file must stay unchanged when no close was seen
kill_grace: 5              # seconds between SIGTERM and SIGKILL for an agent's group
max_log_bytes: 10485760    # per stream and attempt
log_file: null             # also write JSON log lines here (for `dispatcher logs`)
metrics_file: null         # Prometheus text file, rewritten atomically; may hold {{host}} and {{pid}}
metrics_labels: {{}}         # labels on every series (values may hold {{host}} and {{pid}}): several daemons' files
notify: null               # argv run on job.failed, job.review, budget.held; placeholders {{event}}
                           # {{job_id}} {{agent}} {{reason}} {{result}}
notify_max_running: 4      # notifications at once; more wait in order (over 100 waiting: one notify.dropped)
web_token_file: null       # the web view's action token (`dispatcher web`); null: one is made and printed at start
max_chain_cost_usd: null   # a follow-up whose chain already cost more is held
max_daily_cost_usd: null   # the whole root: once the last 24 h's finished cost reaches it, new attempts wait
max_limit_wait: 86400      # seconds a job waits for usage limits in all; then it fails
ledger: sqlite             # or postgresql://... shared by daemons on many hosts
lease: 30                  # seconds (PostgreSQL ledger): a host silent this long is dead
watch: inotify             # or poll: find new files by listing inbox/ every poll_interval
poll_interval: 1
max_wait: 604800           # seconds a job waits for an `after` id no one knows yet, then it fails
agents:
  echo:
    # argv, never run through a shell. Placeholders: {{job_id}} {{order}} {{workspace}}
    # {{receipt}} {{prompt}} {{prompt_file}}
    command: [python3, -c, "import json,os; o=json.load(open(os.environ['DISPATCH_ORDER'])); ids=[i['id'] for i in o['items']]; json.dump(dict(job_id=o['job_id'], input_ids=ids, output_ids=[], status='done', outputs=[]), open('receipt.json','w'))"]
    timeout: 600
    concurrency: 1
    max_attempts: 1
    retry_safe: false
    probe: null            # argv whose exit 0 says the work already happened (decides a retry)
    repair: false          # on a retry after failed checks, give the agent work/feedback.json
    prompt: null           # template text rendered to work/prompt.md ({{prompt}} in command)
    writes: []
    env: {{}}                # extra environment variables for the agent
    pass_env: []           # names of the daemon's environment variables it also gets (API keys)
    max_cost_usd: null     # no further attempt once the job's attempts cost more
    review: false          # a job that passes its checks waits in review/ for a person
    idle_timeout: null     # seconds with no output and no change in work/: ended as timed out ("idle")
    limits: []             # usage limits: [{{preset: claude}}, {{preset: codex}}, {{preset: http429}}] or
                           # {{match: 'rate limited until (\\d+)', until: epoch}} (epoch | clock | seconds)
    checks: []             # your own checks, run in work/ after exit 0 with a receipt:
                           # [{{name: tests, command: [pytest, -q], timeout: 600}}]
    resume: null           # argv used once an attempt reported a session_id; placeholder {{session_id}}
    max_revisions: 5       # `dispatcher revise` at most this often per job
    max_daily_cost_usd: null  # this agent: once its last 24 h's finished cost reaches it, new attempts wait
    workspace: null        # {{git: REPO, base: main, branch: "dispatch/{{job_id}}"}}: a git worktree per job
    sandbox: false         # true: run under bubblewrap, read-only but the workspace, work/, /tmp, sandbox_writable
    sandbox_writable: []   # more writable paths under the sandbox, e.g. ["~/.claude"]
    sandbox_network: true  # false: no network under the sandbox
    before: null           # argv run in the workspace before each attempt; a failure fails the attempt
    after: null            # argv run once the job is final; recorded, never changes its state
    land: null             # argv run exactly once after the job is done (and approved); `dispatcher land ID` reruns it
"""  # noqa: E501 - a starter agent on one line reads best in the file
