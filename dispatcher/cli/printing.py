"""The commands that print text for a person or a tool: logs (read), unit (systemd's files), completion.

Each takes the parsed arguments and returns an exit code; errors are raised
as `DispatchError`s for `cli.main` to print as one line.
"""

from __future__ import annotations

import argparse
import shlex
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

from dispatcher.cli.commands import config_of
from dispatcher.errors import ConfigError, UsageError, printable
from dispatcher.layout import JOB_ID
from dispatcher.spec.config import SYSTEM_CONFIG, require_config


def cmd_logs(args: argparse.Namespace) -> int:
    """Print log lines from stdin (-), FILE or the config's log_file, for a person or as JSON."""
    from dispatcher import logview

    def show(lines: Iterable[str]) -> int:
        return logview.show(lines, job=args.job, as_json=args.json, flush=args.follow)

    require_config(args.config)  # every command but init needs one, also to read a FILE or stdin
    if args.job is not None and not JOB_ID.fullmatch(args.job):
        raise UsageError(f"--job: {printable(args.job)}: not a job id (letters, digits, '.', '_', '-'; at most 128)")
    if args.source == "-":
        return show(logview.read_stream(sys.stdin.buffer))
    if args.source is not None:
        source = Path(args.source)
        try:
            mode = source.stat().st_mode
        except FileNotFoundError:
            if not args.follow:  # -f waits for it, as `tail -F` does
                raise UsageError(f"{printable(args.source)}: no such log file") from None
            return show(logview.read_file(source, follow=True))
        except OSError as e:
            raise UsageError(f"{printable(args.source)}: cannot read ({e.strerror})") from None
        if stat.S_ISDIR(mode):
            raise UsageError(f"{printable(args.source)}: a folder, not a log file")
        if not stat.S_ISREG(mode):  # a pipe, a FIFO, /dev/stdin, <(...): read to its end, -f or not
            try:
                stream = source.open("rb")
            except OSError as e:
                raise UsageError(f"{printable(args.source)}: cannot read ({e.strerror})") from None
            with stream:
                return show(logview.read_stream(stream))
        return show(logview.read_file(source, follow=args.follow))
    cfg = config_of(args)
    if cfg.log_file is None:
        unit = journal_unit(cfg.path)
        # `logs -` needs the config too: named when it was given, or is a templated unit's own file
        named = cfg.path is not None and (args.config or unit != "dispatcher")
        reader = f"dispatcher --config {shlex.quote(str(cfg.path))} logs -" if named else "dispatcher logs -"
        raise ConfigError(
            f"not set, so the log is on stdout (the journal under systemd): journalctl -o cat -u {unit} | {reader}",
            file=str(cfg.path),
            field="log_file",
        )
    return show(logview.read_file(cfg.log_file, follow=args.follow))


def journal_unit(config: Path | None) -> str:
    """Return the systemd unit that runs this config: dispatcher@NAME for /etc/dispatcher/NAME.yaml."""
    if config is not None and config.parent == SYSTEM_CONFIG.parent and config.name != SYSTEM_CONFIG.name:
        return f"dispatcher@{config.stem}"
    return "dispatcher"


def cmd_unit(args: argparse.Namespace) -> int:
    """Print the systemd unit (or the template, the logrotate file, a notify example) of the installed package."""
    from dispatcher.cli import unit

    config_of(args)  # every command but init needs one, and a bad one is exit 2 (the unit runs it: install it first)
    if args.logrotate:
        text = unit.logrotate_text()
    elif args.notify:
        text = unit.notify_text(args.notify)
    else:
        text = unit.unit_text(template=args.template, web=args.web)
    sys.stdout.write(text)
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script for a shell; sourcing it completes commands and options."""
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["dispatcher"], shell=args.shell))
    return 0
