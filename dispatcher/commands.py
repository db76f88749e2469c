"""The commands an operator runs around the daemon: init, run, status, show, logs, completion.

Each takes the parsed arguments and returns an exit code; errors are raised
as `DispatchError`s for `cli.main` to print as one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from dispatcher.config import (
    DEFAULT_CONFIG,
    STARTER_CONFIG,
    SYSTEM_CONFIG,
    Config,
    check_agents,
    default_config,
    find_config,
    load_config,
    require_config,
    require_root,
)
from dispatcher.errors import ConfigError, DispatchError, NotFound, UsageError
from dispatcher.layout import UMASK, Layout
from dispatcher.text import plain, plural


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
    path = find_config(args.config)
    given = args.dir or args.root
    root = Path(given) if given else None
    cfg = load_config(path, root=root) if path.exists() else default_config(root)
    layout = Layout(cfg.root)
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
            print(f"note: its root: is {configured}; pass --root {cfg.root} or edit root: to use this one")
    else:
        print(f"wrote {path.resolve()}")
        print(f"  root: {wrote}   (relative to {folder}, the config's folder: {cfg.root})")
        if path == DEFAULT_CONFIG:
            print(f"  `dispatcher` finds it when run from {Path.cwd()}; elsewhere pass --config {path.resolve()}")
    for d in created:
        print(f"created {d}")
    if not created:
        print(f"root {cfg.root} is ready")
    return 0


def _write_starter(path: Path, root: Path) -> str:
    """Write the starter config at path (never over a file) and return the `root:` it holds."""
    folder = path.resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(root, folder)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(STARTER_CONFIG.format(root=rel))
    return rel


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon on an existing root (its missing folders are made)."""
    from dispatcher import logs
    from dispatcher.daemon import Daemon

    os.umask(UMASK)
    path = require_config(args.config)
    cfg = load_config(path, root=Path(args.root) if args.root else None)
    require_root(cfg)
    try:
        logs.configure(log_file=cfg.log_file)
    except OSError as exc:
        raise ConfigError(f"cannot open {cfg.log_file}: {exc.strerror}", file=str(path), field="log_file") from None
    return Daemon(cfg, config_path=path, root_override=Path(args.root) if args.root else None, once=args.once).serve()


def validate_config(path: Path, cfg: Config) -> int:
    """Report what the loaded config gets wrong beyond its schema; return 2 on an error, else 0.

    Errors and warnings are one line each on stderr; `ok (N agents)` goes to stdout
    when there is no error.
    """
    findings = check_agents(cfg)
    for f in findings:
        print(ConfigError(f.message, file=str(path), field=f.field), file=sys.stderr)
    if any(f.error for f in findings):
        return 2
    print(f"{path}: ok ({plural(len(cfg.agents), 'agent')})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print counts per state and the active jobs (or all of it as JSON)."""
    from dispatcher.report import status

    cfg = config_of(args, need_root=True)
    info = status(Layout(cfg.root))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    c = info["counts"]
    print(f"root {cfg.root}")
    print("  ".join(f"{k} {v}" for k, v in c.items()))
    if info["active"]:
        print(f"{'JOB':<28} {'AGENT':<14} {'PID':>7} {'HOST':<16} AGE")
        for row in info["active"]:
            age = f"{row['age_s']:.0f} s" if row["age_s"] is not None else "-"
            print(
                f"{row['job_id']:<28} {plain(row['agent']):<14} {plain(row['pid']):>7} {plain(row['host']):<16} {age}"
            )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print one job: state, checks, attempts and its chain (or JSON, or the tree)."""
    from dispatcher.report import chain, render_show, render_tree, tree_root

    cfg = config_of(args, need_root=True)
    layout = Layout(cfg.root)
    info = chain(layout, args.job_id)
    if info is None:
        raise NotFound(f"{args.job_id}: no such job")
    if args.json:
        out = dict(info["job"])
        out["ancestors"] = info["ancestors"]
        out["tree"] = info["tree"]
        print(json.dumps(out, indent=2))
    elif args.tree:
        root = chain(layout, tree_root(info)) or info
        print(render_tree(root["tree"], args.job_id))
    else:
        print(render_show(info))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print log lines from stdin (-), FILE or the config's log_file, for a person or as JSON."""
    from dispatcher import logview

    def show(lines: Iterable[str]) -> int:
        return logview.show(lines, job=args.job, as_json=args.json, flush=args.follow)

    if args.source == "-":
        return show(logview.read_stream(sys.stdin.buffer))
    if args.source is not None:
        source = Path(args.source)
        if not args.follow and not source.is_file():
            raise UsageError(f"{args.source}: no such log file")
        return show(logview.read_file(source, follow=args.follow))
    cfg = config_of(args)
    if cfg.log_file is None:
        unit = journal_unit(cfg.path)
        raise ConfigError(
            f"not set, so the log is on stdout (the journal under systemd): "
            f"journalctl -o cat -u {unit} | dispatcher logs -",
            file=str(cfg.path),
            field="log_file",
        )
    return show(logview.read_file(cfg.log_file, follow=args.follow))


def journal_unit(config: Path | None) -> str:
    """Return the systemd unit that runs this config: dispatcher@NAME for /etc/dispatcher/NAME.yaml."""
    if config is not None and config.parent == SYSTEM_CONFIG.parent and config.name != SYSTEM_CONFIG.name:
        return f"dispatcher@{config.stem}"
    return "dispatcher"


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script for a shell; sourcing it completes commands and options."""
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["dispatcher"], shell=args.shell))
    return 0
