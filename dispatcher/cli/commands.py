"""The commands an operator runs around the daemon: init, run, status, list, show, the id actions (logs: ``printing``).

Each takes the parsed arguments and returns an exit code; errors are raised
as `DispatchError`s for `cli.main` to print as one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import IO

import yaml

from dispatcher.errors import ConfigError, DispatchError, NotFound, UsageError, WrongState, printable
from dispatcher.layout import Layout, check_id
from dispatcher.ledger.base import DaemonInfo
from dispatcher.ledger.sqlite_db import path_too_long
from dispatcher.ops import preflight
from dispatcher.ops.daemons import config_note
from dispatcher.spec.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG,
    STARTER_CONFIG,
    SYSTEM_CONFIG,
    default_config,
    load_config,
    require_config,
    require_root,
    salvage_target,
)
from dispatcher.spec.programs import Finding, check_agents
from dispatcher.spec.settings import Config
from dispatcher.text import is_utf8_text, plain, plural, redact


def config_of(args: argparse.Namespace, *, need_root: bool = False) -> Config:
    """Load the config the arguments select; with need_root, insist that its root exists.

    Every command but `init` needs a config: none found is an error naming the
    places tried (contract 3).
    """
    path = require_config(args.config)
    cfg = load_config(path, root=Path(args.root) if args.root else None)
    if need_root:
        require_root(cfg)
    return cfg


def cmd_init(args: argparse.Namespace) -> int:
    """Make the dispatch root's folders and, when there is none, a starter config; change nothing else."""
    # never the system-wide config: `init` in an empty folder makes a local one (pass --config for another)
    if args.config == "":
        raise UsageError("--config: the file name is empty")
    path = Path(args.config) if args.config else Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)
    given = args.dir or args.root
    root = Path(given) if given else None
    cfg = load_config(path, root=root) if path.exists() else default_config(root)
    if cfg.root.exists() and not cfg.root.is_dir():  # bad input, not a failed operation: exit 2
        raise UsageError(f"{cfg.root}: is not a folder; init makes the dispatch root there")
    if not is_utf8_text(str(cfg.root.absolute())):  # a config's root: is UTF-8 text; none could name this folder
        raise UsageError(f"{cfg.root}: the root's path is not valid UTF-8; choose a folder whose name is")
    layout = Layout(cfg.root)
    if cfg.ledger == "sqlite" and (too_long := path_too_long(layout.ledger)) is not None:  # no root to be ready
        raise UsageError(f"{layout.ledger}: the ledger cannot be opened ({too_long})")
    if cfg.ledger == "sqlite" and cfg.root.is_dir():
        from dispatcher.store.ledgers import open_reader

        # a root in use whose ledger is lost beside its job folders is no ready root: exit 2 naming
        # `ledger rebuild`, as for every command
        ledger = open_reader(cfg, layout)
        if ledger is not None:
            ledger.close()
    # the daemon's own .state/ folders are made too, but are no news to the user
    created = [d for d in layout.all_dirs() if not d.exists() and d.parent == cfg.root and not d.name.startswith(".")]
    try:
        layout.create()
        wrote = None if path.exists() else _write_starter(path, cfg.root)
    except OSError as exc:
        raise DispatchError(f"{exc.filename}: cannot write: {exc.strerror}") from None
    folder = path.resolve().parent
    if wrote is None:
        print(f"config {path.resolve()} exists: left as it is")
        configured = load_config(path).root
        if root is not None and configured != cfg.root:
            print(f"note: its root: is {configured}; pass --root {cfg.root} to every command, or edit root:")
    else:
        print(f"wrote {path.resolve()}")
        print(f"  root: {wrote}   (relative to {folder}, the config's folder: {cfg.root})")
        if path == DEFAULT_CONFIG:
            print(f"  `dispatcher` finds it when run from {Path.cwd()}; elsewhere pass --config {path.resolve()}")
            if SYSTEM_CONFIG.exists():
                print(f"  (it comes before {SYSTEM_CONFIG}, which commands run elsewhere still use)")
    for d in created:
        print(f"created {printable(str(d))}")
    if not created:
        print(f"root {printable(str(cfg.root))} is ready")
    return 0


def _write_starter(path: Path, root: Path) -> str:
    """Write the starter config at path (never over a file) and return the `root:` it holds."""
    folder = path.resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(root, folder)
    text = STARTER_CONFIG.format(root=_yaml_scalar(rel))
    if path.suffix == ".json":  # read as JSON by its name: the same config without the comments
        text = json.dumps(yaml.safe_load(text), indent=2) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return rel


def _yaml_scalar(text: str) -> str:
    """Return text as a YAML value that reads back as this very string: plain where it can be, else quoted."""
    try:
        plain_ok = yaml.safe_load(f"k: {text}   # c") == {"k": text}
    except yaml.YAMLError:
        plain_ok = False
    return text if plain_ok else json.dumps(text)


def validate_config(path: Path, cfg: Config) -> int:
    """Report what the loaded config gets wrong beyond its schema; return 2 on an error, else 0.

    Errors and warnings are one line each on stderr; `ok (N agents)` goes to stdout
    when there is no error.
    """
    findings = check_agents(cfg) + _check_ledger_url(cfg) + preflight.check_log_file(cfg) + preflight.check_running(cfg)
    for f in findings:
        print(redact(str(ConfigError(f.message, file=str(path), field=f.field))), file=sys.stderr)
    if any(f.error for f in findings):
        return 2
    print(f"{path}: ok ({plural(len(cfg.agents), 'agent')})")
    return 0


def _check_ledger_url(cfg: Config) -> list[Finding]:
    """Return an error when the PostgreSQL ledger's URL cannot be read (as `run` would say it, never quoting it)."""
    if not cfg.ledger.startswith(("postgresql://", "postgres://")):
        return []
    try:
        from dispatcher.ledger.pg_conn import read_url
    except ImportError:  # without the postgres extra `run` says so itself
        return []
    try:
        read_url(cfg.ledger)
    except DispatchError as exc:
        return [Finding("ledger", str(exc), error=True)]
    return []


def cmd_status(args: argparse.Namespace) -> int:
    """Print counts per state, the daemons, the active jobs and the spend of 24 h (or all of it as JSON)."""
    from dispatcher.cli.render import render_status
    from dispatcher.query.report import status_with
    from dispatcher.store.ledgers import open_reader

    cfg = config_of(args, need_root=True)
    now = time.time()
    layout = Layout(cfg.root)
    ledger = open_reader(cfg, layout)
    try:
        info = status_with(layout, ledger, now)
    finally:
        if ledger is not None:
            ledger.close()
    note = stale_config(cfg)
    if args.json:
        print(json.dumps(info, indent=2))
        if note:
            print(note, file=sys.stderr)
    else:
        print(render_status(str(cfg.root), info, now))
        if note:
            print(note)
    return 0


def daemons_of(cfg: Config) -> list[DaemonInfo]:
    """Return the daemons of the root (a fresh root without a ledger has none)."""
    from dispatcher.store.ledgers import open_reader

    ledger = open_reader(cfg, Layout(cfg.root))
    if ledger is None:
        return []
    try:
        return ledger.daemons()
    finally:
        ledger.close()


def stale_config(cfg: Config) -> str | None:
    """Return one line when a running daemon loaded another config than the file now holds, else None."""
    try:
        return config_note(cfg.digest, Path(cfg.given) if cfg.given else cfg.path, daemons_of(cfg))
    except DispatchError:  # a note is a courtesy: the command itself has already answered
        return None


def note_config(cfg: Config) -> None:
    """Print the stale-config line (if any) on stderr."""
    note = stale_config(cfg)
    if note:
        print(note, file=sys.stderr)


def cmd_reload(args: argparse.Namespace) -> int:
    """Check the config, then SIGHUP this root's live daemons on this host (systemd's: name `systemctl reload`)."""
    from dispatcher.ops.daemons import live_here, reload

    path = require_config(args.config)
    try:
        cfg = load_config(path, root=Path(args.root) if args.root else None)
    except ConfigError:
        _hup_refusing(salvage_target(path, root=Path(args.root) if args.root else None))
        raise
    require_root(cfg)
    known = daemons_of(cfg)
    here = live_here(known, locks=Layout(cfg.root).daemons)
    # what the daemons would refuse, as `validate` says it: an agent, the ledger's URL, the log file, and what a
    # running daemon cannot change (root, ledger, lease), judged against each daemon here
    refused = [f for d in here for f in preflight.check_running(cfg, {"MAINPID": str(d.pid)}) if f.error]
    if refused:  # the daemons refuse it too: signalled all the same, each logs config.rejected
        _hup_refusing(cfg)
        raise ConfigError(refused[0].message, file=str(cfg.path), field=refused[0].field)
    findings = check_agents(cfg) + _check_ledger_url(cfg) + preflight.check_log_file(cfg)
    errors = [f for f in findings if f.error]
    if errors:  # a config the daemons would take with an agent or a log file that cannot work: not sent
        raise ConfigError(errors[0].message, file=str(cfg.path), field=errors[0].field)
    if not here:
        apart = ", ".join(f"pid {d.pid}" for d in live_here(known))  # this host's name, not this host's pids
        why = f" ({apart} under this host's name runs in another pid namespace: reload it from inside)" if apart else ""
        print(f"no daemon of {printable(str(cfg.root))} runs on this host: nothing to reload{why}", file=sys.stderr)
        return 1
    done = reload(here)
    for r in done:
        print(r.line(), file=sys.stdout if r.signalled else sys.stderr, flush=True)
    return 0 if all(r.signalled for r in done) else 1


def _hup_refusing(target: Config | None) -> None:
    """SIGHUP this root's live daemons here for a config they will refuse (each logs config.rejected).

    `reload` is the contract's SIGHUP: a daemon sent a config it refuses keeps its own,
    says so in its log and reopens its log file (logrotate's turn). The command's own
    answer stays the config's error, one line, exit 2; a root it cannot read is left.
    """
    from dispatcher.ops.daemons import live_here, reload

    if target is None or not target.root.is_dir():
        return
    try:
        reload(live_here(daemons_of(target), locks=Layout(target.root).daemons))
    except DispatchError:
        return


def cmd_list(args: argparse.Namespace) -> int:
    """Print one line per job or refused file, newest first (or JSON lines)."""
    from dispatcher.cli.render import render_list
    from dispatcher.query.listing import list_jobs
    from dispatcher.store.ledgers import open_reader

    cfg = config_of(args, need_root=True)
    layout = Layout(cfg.root)
    ledger = open_reader(cfg, layout)  # for every state: a lost ledger stops `list` as every command (exit 2)
    try:
        rows = list_jobs(cfg, layout, ledger, state=args.state, agent=args.agent)
    finally:
        if ledger is not None:
            ledger.close()
    lines = (json.dumps(r) for r in rows) if args.json else render_list(rows)
    for line in lines:
        print(line)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print one job: state, checks, attempts, cost and its chain (or JSON, or the tree)."""
    from dispatcher.cli.render import render_show, render_tree
    from dispatcher.query.jobinfo import show_json
    from dispatcher.store.ledgers import open_reader

    cfg = config_of(args, need_root=True)
    layout = Layout(cfg.root)
    ledger = open_reader(cfg, layout)
    try:
        found = show_json(layout, ledger, args.job_id, cfg.max_order_bytes, whole_tree=args.tree, agents=cfg.agents)
    finally:
        if ledger is not None:
            ledger.close()
    if found is None:
        return _show_refused(cfg, layout, args.job_id, as_json=args.json)
    out, info = found
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.tree:
        print(render_tree(out["tree"], args.job_id))
    else:
        print(render_show(info))
    return 0


def _show_refused(cfg: Config, layout: Layout, name: str, *, as_json: bool) -> int:
    """Print the refusals of a file (by job id, file stem or folder name) that never became a job.

    Raises NotFound when none: for what is not a job id either, the line every id command gives.
    """
    from dispatcher.query.jobinfo import refusal_json
    from dispatcher.query.listing import refusals_of
    from dispatcher.text import ago

    rows = refusals_of(cfg, layout, name)
    if not rows:
        check_id(name)
        raise NotFound(f"{name}: no such job or refused file")
    r = rows[0]
    if as_json:
        print(json.dumps(refusal_json(r), indent=2))
        return 0
    print(f"{printable(name)}  refused  agent {plain(r['agent'])}  {ago(r['age_s'])} ago: the file never became a job")
    print(f"  reason: {printable(plain(r['reason']))}")
    print(f"  folder: {printable(r['path'])}")
    if len(rows) > 1:
        print(f"  ({len(rows) - 1} earlier refusal{'s' if len(rows) > 2 else ''}: `dispatcher list --state refused`)")
    return 0


def read_ids(given: list[str], stdin: IO[str]) -> list[str]:
    """Return the job ids of the arguments, `-` standing for those on stdin, one a line."""
    out: list[str] = []
    for arg in given:
        if arg == "-":
            out.extend(line.strip() for line in stdin if line.strip())
        else:
            out.append(arg)
    return out


def for_each_id(args: argparse.Namespace, action: str) -> int:
    """Run one operator action (retry, cancel, hold, release, approve, reject, revise, pause, resume) per id.

    Returns 1 if any failed.

    Each id is handled on its own: a failure is one line on stderr and the
    others are still handled; a retry or revise takes a join's parents named with it
    first (``Operator.parents_first``). Hold and release write `job.held` and
    `job.released` into the config's `log_file` when one is set.
    """
    from dispatcher.ops.actions import Operator

    cfg = config_of(args, need_root=True)
    if action == "revise" and not (args.note or "").strip():
        raise UsageError("revise: --note: say what the next attempt should change (the note is empty)")
    for option, text in (("--note", getattr(args, "note", None)), ("--reason", getattr(args, "reason", None))):
        if text is not None and not is_utf8_text(text):  # bytes from argv that are no UTF-8 (section 2)
            raise UsageError(f"{action}: {option}: is not valid UTF-8 text")
    ids = read_ids(args.ids, sys.stdin)
    if not ids:
        raise UsageError(f"{action}: no job id given")
    if action in ("hold", "release", "approve", "reject", "revise", "pause", "resume"):
        log_to_file(cfg)
    elif action in ("retry", "cancel"):  # lines only of a job a dead daemon left recorded but not moved: they
        log_to_file(cfg, required=False)  # never stop the request (a cancel of a runaway job above all)
    op = Operator(cfg, Layout(cfg.root))
    op.reason = getattr(args, "reason", None)
    op.note = getattr(args, "note", None)
    run = op.cancel_tree if action == "cancel" and getattr(args, "tree", False) else getattr(op, action)
    failed = 0
    try:
        _ = op.ledger  # opened first: a lost ledger stops the command (exit 2) whatever the folders say
        if action in ("retry", "revise"):  # a join's failed parent named too is run again first
            ids = op.parents_first(ids)
        for job_id in ids:
            try:
                print(run(job_id), flush=True)
            except (NotFound, WrongState) as exc:
                print(exc, file=sys.stderr, flush=True)
                failed += 1
            except OSError as exc:  # a folder moved or a file refused meanwhile: this id fails, the others go on
                where = f": {printable(os.fsdecode(exc.filename))}" if exc.filename is not None else ""
                print(f"{job_id}: {action} failed: {exc.strerror or exc}{where}", file=sys.stderr, flush=True)
                failed += 1
            while op.notes:  # a warning that goes with an action done (a join that fails again at once)
                print(op.notes.pop(0), file=sys.stderr, flush=True)
    finally:
        op.close()
    if action == "retry" and failed < len(ids):
        note_config(cfg)
    return 1 if failed else 0


def cmd_land(args: argparse.Namespace) -> int:
    """`land ID...`: run each done job's land hook again; 1 if any failed."""
    from dispatcher.job.recovery import land_recorded_end
    from dispatcher.layout import JOB_ID
    from dispatcher.ops.actions import tell_landed
    from dispatcher.ops.land import land_again
    from dispatcher.store.ledgers import open_reader

    cfg = config_of(args, need_root=True)
    ids = read_ids(args.ids, sys.stdin)
    if not ids:
        raise UsageError("land: no job id given")
    ledger = open_reader(cfg, Layout(cfg.root))  # a lost ledger stops this command as every other (exit 2)
    log_to_file(cfg)
    failed = 0
    try:
        if ledger is not None:  # a done job a dead daemon left in active/ (its end recorded, not its move): into done/
            for job_id in ids:
                if JOB_ID.fullmatch(job_id):  # before it names a folder (land_again says what is wrong with it)
                    landed = land_recorded_end(Layout(cfg.root), ledger, job_id)
                    if landed is not None:  # a failed one too: `land` refuses it below, once it is told
                        tell_landed(cfg, Layout(cfg.root), landed)
        for job_id in ids:
            try:
                print(land_again(cfg, Layout(cfg.root), job_id, ledger), flush=True)
            except (NotFound, WrongState) as exc:
                print(exc, file=sys.stderr, flush=True)
                failed += 1
    finally:
        if ledger is not None:
            ledger.close()
    return 1 if failed else 0


def log_to_file(cfg: Config, *, required: bool = True) -> None:
    """Send log lines to the config's log_file, and to a running daemon's stdout: not to the terminal.

    The daemon's stdout is the journal under systemd, which has no other record of an
    operator's hold, release, approve or reject (``Relay``). A log_file that cannot be
    opened is a config error, or with ``required`` False a warning on stderr, the lines
    then going to the daemon alone.
    """
    from dispatcher import logs

    logs.SINK.console = open(os.devnull, "w")  # noqa: SIM115 - the sink keeps it for the process's life
    try:
        logs.configure(log_file=cfg.log_file, console=False)
    except OSError as exc:
        error = ConfigError(f"cannot open {cfg.log_file}: {exc.strerror}", file=str(cfg.path), field="log_file")
        if required:
            raise error from None
        print(f"warning: {error}; its lines go to a running daemon only", file=sys.stderr, flush=True)
        logs.configure(log_file=None, console=False)
    relay_to_daemon(cfg)


def relay_to_daemon(cfg: Config) -> None:
    """Hand this process's log lines to a running daemon too (``Relay``): an operator's, from a command or the web view.

    The daemon writes them on its stdout (the journal under systemd) and counts an
    approve's or a reject's ``job.approved``/``job.rejected`` in its metrics.
    """
    from dispatcher import logs
    from dispatcher.store.relay import Relay

    logs.SINK.relay = Relay(Layout(cfg.root)).send
