"""The command line: argv in, exit code out. The only sys.exit of a command (child processes have their own)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn, TextIO, cast

from dispatcher import __version__
from dispatcher.cli import commands, printing, usage
from dispatcher.errors import ConfigError, DispatchError, OrderError, UsageError, printable
from dispatcher.layout import UMASK
from dispatcher.spec.config import load_config, require_config, require_root
from dispatcher.spec.orders import parse_order
from dispatcher.spec.settings import Config
from dispatcher.store.counts import LIST_STATES
from dispatcher.text import BidiSafe, plural, redact


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own exit code is 2 as well; keep one line
        self.exit(2, f"dispatcher: {message}\n")


class _ConfigOrFlag(argparse.Action):
    """`validate --config` with no FILE checks the config found as usual (the contract's form); with FILE, that one."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        if values is not None:
            setattr(namespace, self.dest, values)


def _common(p: argparse.ArgumentParser, top: bool, *, bare_config: bool = False) -> None:
    default = None if top else argparse.SUPPRESS
    where = "config file (default: $DISPATCHER_CONFIG, ./config/dispatcher.yaml, /etc/dispatcher/dispatcher.yaml)"
    if bare_config:
        p.add_argument("--config", default=default, metavar="FILE", help=where, nargs="?", action=_ConfigOrFlag)
    else:
        p.add_argument("--config", default=default, metavar="FILE", help=where)
    p.add_argument("--root", default=default, metavar="DIR", help="dispatch root (overrides the config)")


def _command(sub: Any, name: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=usage.summary(name),
        description=usage.summary(name),
        epilog=usage.epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of `dispatcher`."""
    p = _Parser(
        prog="dispatcher",
        description="Hand work orders to agents and verify their receipts.",
        epilog=usage.epilog(None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"dispatcher {__version__}")
    _common(p, True)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = _command(sub, "init")
    c.add_argument("dir", nargs="?", help="the dispatch root (default: the configured root)")
    c = _command(sub, "run")
    c.add_argument("--once", action="store_true", help="drain inbox/, wait for every job, then exit")
    c = _command(sub, "submit")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--at", metavar="TIME", help="not before this ISO 8601 time (sets not_before)")
    c.add_argument("--in", dest="within", metavar="DURATION", help="not before this long from now: 90s, 15m, 2h, 1d")
    c = _command(sub, "validate")
    c.add_argument("files", nargs="*", metavar="FILE")
    c = _command(sub, "status")
    c.add_argument("--json", action="store_true")
    c = _command(sub, "list")
    c.add_argument("--state", choices=LIST_STATES, help="only jobs (or refused files) in this state")
    c.add_argument("--agent", metavar="A", help="only the jobs of this agent")
    c.add_argument("--json", action="store_true", help="one JSON object a line")
    c = _command(sub, "show")
    c.add_argument("job_id")
    c.add_argument("--json", action="store_true")
    c.add_argument("--tree", action="store_true", help="draw the chain of follow-ups with each job's cost")
    for name in ("retry", "cancel", "hold", "release", "approve", "reject", "land", "revise"):
        c = _command(sub, name)
        c.add_argument("ids", nargs="+", metavar="ID", help="job ids, or - to read them from stdin, one a line")
        if name == "cancel":
            c.add_argument(
                "--tree",
                action="store_true",
                help="also every descendant (follow-ups and the joins waiting for them, recursively)",
            )
        if name == "reject":
            c.add_argument("--reason", metavar="TEXT", help="why (the job's reason becomes `rejected: TEXT`)")
        if name == "revise":
            c.add_argument("--note", metavar="TEXT", required=True, help="what to change (in work/feedback.json)")
    for name in ("pause", "resume"):
        c = _command(sub, name)
        c.add_argument("ids", nargs="+", metavar="AGENT", help="agent names, or - to read them from stdin")
    c = _command(sub, "logs")
    c.add_argument("source", nargs="?", metavar="FILE", help="a log file, or - for stdin (default: log_file)")
    c.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended, across rotation")
    c.add_argument("--job", metavar="ID", help="only the lines about this job")
    c.add_argument("--json", action="store_true", help="print the matching JSON lines unchanged")
    c = _command(sub, "ledger")
    c.add_argument("action", choices=("rebuild", "migrate"))
    c.add_argument("url", nargs="?", metavar="URL", help="for migrate: the postgresql://... ledger to fill")
    c = _command(sub, "web")
    c.add_argument("--listen", metavar="ADDR:PORT", help="where to listen (default 127.0.0.1:8700)")
    c = _command(sub, "reload")
    c = _command(sub, "unit")
    what = c.add_mutually_exclusive_group()
    what.add_argument("--template", action="store_true", help="dispatcher@.service: one daemon per config NAME")
    what.add_argument("--web", action="store_true", help="dispatcher-web.service: the web view beside the daemon")
    what.add_argument("--logrotate", action="store_true", help="the file for /etc/logrotate.d/dispatcher")
    what.add_argument("--notify", choices=("append", "webhook"), help="an example notify script")
    c = _command(sub, "completion")
    c.add_argument("shell", choices=("bash", "zsh", "fish"))
    for name, sp in sub.choices.items():
        _common(sp, False, bare_config=name == "validate")
        sp.prog = f"dispatcher {name}"
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dispatcher` command."""
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`dispatcher completion SHELL`)
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(_dashed_values(sys.argv[1:] if argv is None else argv))
    del parser  # every command's parser, held for as long as the daemon runs otherwise
    os.umask(UMASK)  # the one place it is set: nothing the daemon or a command creates is world-readable
    if args.command not in ("run", "web") and not getattr(args, "json", False):  # output for a person
        sys.stdout = cast(TextIO, BidiSafe(sys.stdout))
        sys.stderr = cast(TextIO, BidiSafe(sys.stderr))
    if args.command not in ("run", "web"):  # a command logs (a ledger it waits for) in the one console format
        from dispatcher import logs

        logs.configure_for_command()
    try:
        code = COMMANDS[args.command](args)
    except DispatchError as exc:
        # one line, whatever a path in it holds (a line break, an escape, a byte that is no UTF-8)
        print(_err_prefix(args.command) + redact(printable(str(exc))), file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `dispatcher show X --json | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except OSError as exc:  # a file of the root this user may not read, say: one line, never a traceback
        if args.command in ("run", "web"):
            _crashed(args.command)  # a daemon's own: its traceback is what tells what went wrong
        where = f"{os.fsdecode(exc.filename)}: " if exc.filename else ""
        print(redact(printable(f"{where}{exc.strerror or exc}")), file=sys.stderr)
        code = 1
    except Exception:
        if args.command not in ("run", "web"):
            raise
        _crashed(args.command)
    if argv is None and args.command not in ("run", "web"):
        _leave(code)
    sys.exit(code)


#: options whose value may start with one dash (`--in -1h`, `--note "-fix the test"`)
_TEXT_OPTIONS = frozenset({"--in", "--at", "--reason", "--note"})


def _dashed_values(argv: list[str]) -> list[str]:
    """Join such an option with a next word that starts with one dash (`--in=-1h`).

    argparse takes `-1h` for an option and says only "expected one argument"; joined, the
    value gets its own check and message (`--in: '-1h' is not a duration ...`).
    """
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out.append(word)
            out.extend(words)
            break
        out.append(word)
        if word in _TEXT_OPTIONS:
            nxt = next(words, None)
            if nxt is None:
                break
            if nxt.startswith("-") and not nxt.startswith("--") and nxt != "-":
                out[-1] = f"{word}={nxt}"
            else:
                out.append(nxt)
    return out


def _crashed(command: str) -> NoReturn:
    """Print a daemon's crash as its traceback, each line an error for the journal (`journalctl -p err`); exit 1."""
    prefix = _err_prefix(command)
    for line in traceback.format_exc().rstrip("\n").splitlines():
        print(prefix + redact(line), file=sys.stderr)
    sys.stderr.flush()
    sys.exit(1)


def _err_prefix(command: str) -> str:
    """Return ``<3>`` when a daemon's error line goes to the journal (section 8: `journalctl -p err` finds it)."""
    if command not in ("run", "web"):
        return ""
    from dispatcher import logs

    return "<3>" if logs.is_journal(sys.stderr) else ""


def _leave(code: int) -> NoReturn:
    """End a command at once: its output flushed and exit handlers run, without the interpreter's teardown.

    Tearing down the ~150 modules a command imported costs about 0.1 s of CPU, over a second on a
    busy machine, and nothing is left to do by then: ledgers are closed, files written and synced.
    A connection attempt given up at its deadline (a PostgreSQL server that never answers) ends
    with the process instead of being waited on.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`dispatcher list | head`): nothing to say
            stream.flush()
    atexit._run_exitfuncs()  # logging's flush of a command's log_file lines, among others
    os._exit(code)


def _config(args: argparse.Namespace, *, required: bool = True, need_root: bool = False) -> Config:
    """Return the config the arguments select (every command but init needs one: `required` is kept for callers)."""
    return commands.config_of(args, need_root=need_root)


def cmd_validate(args: argparse.Namespace) -> int:
    """Check each FILE against the config, or with no FILE the config itself; 2 if anything is invalid."""
    path = require_config(args.config)
    cfg = _config(args)
    if not args.files:
        return commands.validate_config(path, cfg)
    bad = 0
    for name in args.files:
        try:
            order = _parse_file(name, cfg)
            print(f"{printable(name)}: ok ({order.job_id})")
        except OrderError as exc:
            print(exc, file=sys.stderr)
            bad += 1
    return 2 if bad else 0


def _parse_file(name: str, cfg: Config | None) -> Any:
    from dispatcher import fsutil

    try:
        data = fsutil.read_given(name)
    except OSError as exc:
        raise OrderError(f"cannot read: {exc.strerror}", file=name) from None
    except fsutil.NotRegular as exc:
        raise OrderError(f"a {exc.kind} is not a work order", file=name) from None
    return parse_order(
        data,
        name,
        agents=cfg.agents if cfg is not None else None,
        max_timeout_s=cfg.max_timeout_s if cfg is not None else None,
        max_bytes=cfg.max_order_bytes if cfg is not None else 1_048_576,
    )


def cmd_submit(args: argparse.Namespace) -> int:
    from dispatcher.ops.submit import parse_when, read_order, submit

    cfg = _config(args, need_root=True)
    not_before = parse_when(args.at, args.within, time.time())
    orders, errors = [], []
    for name in args.files:  # every file is checked, and every bad one named, before any is dropped
        try:
            orders.append(read_order(name, cfg, not_before=not_before))
        except OrderError as exc:
            errors.append(str(exc))
    if errors:
        if len(args.files) > 1:  # one line per bad file; the last says what became of the others
            errors[-1] += f"; nothing was submitted: {len(errors)} of {len(args.files)} files are invalid"
        print("\n".join(errors), file=sys.stderr)
        return 2
    dropped = 0
    try:
        for job_id in submit(cfg, orders):
            print(job_id, flush=True)
            dropped += 1
    except OrderError as exc:
        if len(orders) > 1:  # say on its line what happened to the others: none dropped, or those printed above
            what = "nothing was submitted" if dropped == 0 else f"only the {dropped} ids above were submitted"
            print(f"{exc}; {what} ({len(orders)} files given)", file=sys.stderr)
            return 2
        raise
    commands.note_config(cfg)
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """Rebuild the SQLite ledger from the folders, or copy it into an empty PostgreSQL ledger."""
    from dispatcher.layout import Layout

    cfg = _config(args, need_root=True)
    layout = Layout(cfg.root)
    if args.action == "rebuild":
        from dispatcher.ops.rebuild import rebuild
        from dispatcher.store.ledgers import refuse_network_root

        if args.url is not None:  # a slip (`ledger rebuild URL`) must not rebuild anything
            raise UsageError(f"ledger rebuild: takes no argument, got {args.url}; it rebuilds from the job folders")

        if cfg.ledger != "sqlite":  # its daemons may be alive on other hosts; the folders cannot stand in for it
            raise UsageError(
                f"{cfg.path}: ledger: `ledger rebuild` makes the SQLite ledger again, and this config's ledger"
                " is PostgreSQL: restore its database, or rebuild with `ledger: sqlite` and copy that into an"
                " empty PostgreSQL ledger with `dispatcher ledger migrate URL`"
            )

        refuse_network_root(layout)  # no SQLite ledger is made where `run` would refuse it
        counts = rebuild(layout)
        total = sum(counts.values())
        detail = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
        print(f"{layout.ledger}: rebuilt with {total} job id{'' if total == 1 else 's'} ({detail})")
        return 0
    if not args.url:
        raise UsageError("ledger migrate: give the postgresql://... URL of an empty ledger")
    url = sys.stdin.readline().strip() if args.url == "-" else args.url
    if not url.startswith(("postgresql://", "postgres://")):  # an empty line would reach the default local server
        got = "nothing on stdin" if not url else "another kind of URL" if "://" in url else "no URL"
        raise UsageError(f"ledger migrate: give the postgresql://... URL of an empty ledger ({got})")
    if args.url != "-" and redact(url) != url:
        raise UsageError(
            "ledger migrate: URL: a password on the command line shows in every process list;"
            " put it in ~/.pgpass or $PGPASSWORD, or give - and the URL on stdin"
        )
    if cfg.ledger != "sqlite":
        raise UsageError(f"{cfg.path}: ledger: migrate copies the SQLite ledger; this config already names another")
    from dispatcher.ledger.migrate import migrate
    from dispatcher.ledger.postgres import PostgresLedger
    from dispatcher.ops.rebuild import live_daemons
    from dispatcher.store.ledgers import CONNECT_S, REACH_S, answer_by, open_ledger

    source = open_ledger(cfg, layout, create=False, patience_s=30.0)
    try:
        live = [d for d in source.daemons() if d.alive]
        seen = {d.owner for d in live}  # and daemons on another ledger (PostgreSQL) whose flock the root holds
        others = [owner for owner in live_daemons(layout) if owner not in seen]
        if live or others:
            names = ", ".join([f"{d.pid} on {d.host}" for d in live] + others)
            raise UsageError(
                f"{layout.root}: ledger migrate: a daemon is running on this root ({names});"
                " stop every daemon first, or ids it claims meanwhile are not copied"
            )
        target = PostgresLedger(
            url,
            layout,
            lease_s=cfg.lease_s,
            patience_s=REACH_S,
            connect_timeout_s=CONNECT_S,
            answer_by=answer_by(),
            cut_silent=False,  # one long transaction copies every row: never cut for its length
        )
        if cfg.log_file is not None:
            commands.log_to_file(cfg)  # the `ledger.migrated` line, with its counts
        try:
            moved = migrate(source, target)
            where = target.where
        finally:
            target.close()
    finally:
        source.close()
    rest = moved.extras
    also = ", ".join(
        f"{rest[key]} {name}{'' if rest[key] == 1 else 's'}"
        for key, name in (
            ("waits", "join wait"),
            ("gates", "gate"),
            ("gate_waits", "gate wait"),
            ("requests", "request"),
        )
    )
    print(f"{where}: {plural(moved.rows, 'job id')} copied from {layout.ledger}, with {also}")
    print("now set `ledger:` in the config to this URL on every host, then start the daemons")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon on an existing root (its missing folders are made; main() set the umask).

    The daemon is imported only here, so the other commands start without its modules.
    """
    from dispatcher import logs
    from dispatcher.core.daemon import Daemon

    path = require_config(args.config)
    root = Path(args.root) if args.root else None
    cfg = load_config(path, root=root)
    require_root(cfg)
    try:
        logs.configure(log_file=cfg.log_file)
    except OSError as exc:
        raise ConfigError(f"cannot open {cfg.log_file}: {exc.strerror}", file=str(path), field="log_file") from None
    logs.settle()  # configured once: its modules' loggers are looked up now, not at every line
    daemon = Daemon(cfg, config_path=path, root_override=root, once=args.once)
    code = daemon.serve()
    if daemon.exit_note is not None and _stderr_apart():
        print(daemon.exit_note, file=sys.stderr, flush=True)  # exit 1 comes with one line on stderr (section 7)
    return code


def _stderr_apart() -> bool:
    """Return True when a plain line on stderr stays out of the JSON log stream.

    Not when stderr is the journal, or the same file or pipe as a stdout that is not a
    terminal (``2>&1``): there every line is one JSON object (section 8), and the last
    one, ``daemon.stopped``, already carries the counts.
    """
    from dispatcher import logs

    if sys.stderr is None or logs.is_journal(sys.stderr):  # None: started with stderr closed (`2>&-`)
        return False
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return True
    return (out.st_dev, out.st_ino) != (err.st_dev, err.st_ino) or sys.stdout.isatty()


def cmd_web(args: argparse.Namespace) -> int:
    """Serve the web view of the root (section 17) until SIGTERM or SIGINT.

    Imported here, not in ``commands``: the web view is a layer of its own beside the CLI.
    """
    from dispatcher import logs

    cfg = commands.config_of(args, need_root=True)
    try:
        from dispatcher.web.routes import serve
    except ImportError as exc:
        extra = "pip install 'folder-dispatcher[web]'"
        raise UsageError(f"web: needs the web extra ({exc.name} is missing): {extra}") from None
    try:
        logs.configure(log_file=cfg.log_file)
    except PermissionError as exc:  # a reader of the group (section 17: the view reads): its lines go to stdout
        import structlog

        logs.configure(log_file=None)
        structlog.get_logger("dispatcher").warning("web.log_file", reason=f"cannot open {cfg.log_file}: {exc.strerror}")
    except OSError as exc:
        raise ConfigError(f"cannot open {cfg.log_file}: {exc.strerror}", file=str(cfg.path), field="log_file") from None
    commands.relay_to_daemon(cfg)  # its approve and reject count in the daemon's metrics, as the commands' do
    return serve(cfg, args.listen)


COMMANDS = {
    "init": commands.cmd_init,
    "run": lambda args: _cmd_run(args),
    "submit": cmd_submit,
    "validate": cmd_validate,
    "status": commands.cmd_status,
    "list": commands.cmd_list,
    "show": commands.cmd_show,
    "retry": lambda args: commands.for_each_id(args, "retry"),
    "cancel": lambda args: commands.for_each_id(args, "cancel"),
    "hold": lambda args: commands.for_each_id(args, "hold"),
    "release": lambda args: commands.for_each_id(args, "release"),
    "approve": lambda args: commands.for_each_id(args, "approve"),
    "reject": lambda args: commands.for_each_id(args, "reject"),
    "land": commands.cmd_land,
    "revise": lambda args: commands.for_each_id(args, "revise"),
    "pause": lambda args: commands.for_each_id(args, "pause"),
    "resume": lambda args: commands.for_each_id(args, "resume"),
    "logs": printing.cmd_logs,
    "ledger": cmd_ledger,
    "reload": commands.cmd_reload,
    "unit": printing.cmd_unit,
    "completion": printing.cmd_completion,
    "web": cmd_web,
}
