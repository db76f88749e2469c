"""The command line: argv in, exit code out. The only module that calls sys.exit."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dispatcher import __version__
from dispatcher.config import STARTER_CONFIG, Config, default_config, find_config, load_config
from dispatcher.errors import DispatchError, NotFound, OrderError, UsageError, WrongState
from dispatcher.layout import UMASK, Layout, State
from dispatcher.orders import parse_order


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own exit code is 2 as well; keep one line
        self.exit(2, f"dispatcher: {message}\n")


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    default = None if top else argparse.SUPPRESS
    p.add_argument(
        "--config",
        default=default,
        metavar="FILE",
        help="config file (default config/dispatcher.yaml)",
    )
    p.add_argument("--root", default=default, metavar="DIR", help="dispatch root (overrides the config)")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of `dispatcher`."""
    p = _Parser(prog="dispatcher", description="Hand work orders to agents and verify their receipts.")
    p.add_argument("--version", action="version", version=f"dispatcher {__version__}")
    _common(p, True)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("init", help="make the dispatch root and a starter config")
    c.add_argument("dir", nargs="?", help="the dispatch root (default: the configured root)")
    c = sub.add_parser("run", help="run the daemon")
    c.add_argument("--once", action="store_true", help="drain inbox/, wait for every job, then exit")
    c = sub.add_parser("submit", help="validate orders and drop them into inbox/ atomically")
    c.add_argument("files", nargs="+", metavar="FILE")
    c = sub.add_parser("validate", help="check orders (or the config) without submitting")
    c.add_argument("files", nargs="*", metavar="FILE")
    c = sub.add_parser("status", help="counts per state and the active jobs")
    c.add_argument("--json", action="store_true")
    c = sub.add_parser("show", help="one job: state, checks, attempts, its chain")
    c.add_argument("job_id")
    c.add_argument("--json", action="store_true")
    c.add_argument("--tree", action="store_true", help="draw the chain of follow-ups")
    c = sub.add_parser("retry", help="run a failed job again")
    c.add_argument("job_id")
    c = sub.add_parser("cancel", help="stop a queued or running job")
    c.add_argument("job_id")
    c = sub.add_parser("logs", help="read the JSON log file, readable for a person")
    c.add_argument("-f", "--follow", action="store_true")
    c.add_argument("--job", metavar="ID")
    for name, sp in sub.choices.items():
        _common(sp, False)
        sp.prog = f"dispatcher {name}"
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dispatcher` command."""
    args = build_parser().parse_args(argv)
    os.umask(UMASK)  # nothing the daemon or the CLI creates is world-readable
    try:
        code = COMMANDS[args.command](args)
    except DispatchError as exc:
        print(exc, file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `dispatcher show X --json | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


def _config(args: argparse.Namespace, *, required: bool) -> Config:
    path = find_config(args.config)
    root = Path(args.root) if args.root else None
    if not path.exists() and not required and not args.config:
        return default_config(root)
    return load_config(path, root=root)


def cmd_init(args: argparse.Namespace) -> int:
    os.umask(UMASK)
    path = find_config(args.config)
    root = Path(args.dir or args.root) if (args.dir or args.root) else None
    cfg = load_config(path, root=root) if path.exists() else default_config(root)
    layout = Layout(cfg.root)
    created = [d for d in layout.all_dirs() if not d.exists()]
    layout.create()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(cfg.root, path.resolve().parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        with os.fdopen(fd, "w") as f:
            f.write(STARTER_CONFIG.format(root=rel))
        print(f"wrote {path}")
    for d in created:
        print(f"created {d}")
    if not created:
        print(f"{cfg.root} is ready")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from dispatcher import logs
    from dispatcher.daemon import Daemon

    os.umask(UMASK)
    path = find_config(args.config)
    cfg = load_config(path, root=Path(args.root) if args.root else None)
    logs.configure(log_file=cfg.log_file)
    return Daemon(cfg, config_path=path, root_override=Path(args.root) if args.root else None, once=args.once).serve()


def cmd_validate(args: argparse.Namespace) -> int:
    path = find_config(args.config)
    cfg = None
    if args.config or path.exists() or not args.files:
        cfg = _config(args, required=True)
        if not args.files:
            print(f"{path}: ok ({len(cfg.agents)} agents)")
            return 0
    bad = 0
    for name in args.files:
        try:
            order = _parse_file(name, cfg)
            print(f"{name}: ok ({order.job_id})")
        except OrderError as exc:
            print(exc, file=sys.stderr)
            bad += 1
    return 2 if bad else 0


def _parse_file(name: str, cfg: Config | None) -> Any:
    try:
        data = Path(name).read_bytes()
    except OSError as exc:
        raise OrderError(f"cannot read: {exc.strerror}", file=name) from None
    return parse_order(
        data,
        name,
        agents=cfg.agents if cfg is not None else None,
        max_timeout_s=cfg.max_timeout_s if cfg is not None else None,
        max_bytes=cfg.max_order_bytes if cfg is not None else 1_048_576,
    )


def cmd_submit(args: argparse.Namespace) -> int:
    from dispatcher.submit import read_order, submit

    os.umask(UMASK)
    cfg = _config(args, required=True)
    orders = [read_order(name, cfg) for name in args.files]
    for job_id in submit(cfg, orders):
        print(job_id, flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dispatcher.report import status

    cfg = _config(args, required=False)
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
                f"{row['job_id']:<28} {row['agent'] or '-':<14} {row['pid'] or '-':>7} {row['host'] or '-':<16} {age}"
            )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from dispatcher.report import chain, render_show, render_tree, tree_root

    cfg = _config(args, required=False)
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


def cmd_retry(args: argparse.Namespace) -> int:
    from dispatcher.ledger import Request, open_ledger

    cfg = _config(args, required=False)
    layout = Layout(cfg.root)
    found = layout.find(args.job_id)
    if found is None:
        raise NotFound(f"{args.job_id}: no such job")
    if found[0] is not State.FAILED:
        raise WrongState(f"{args.job_id}: is {found[0].value}, only a failed job can be retried")
    ledger = open_ledger(cfg, layout, patience_s=30)
    try:
        ledger.request(args.job_id, Request.RETRY)
    finally:
        ledger.close()
    _poke(layout, "retry", args.job_id)
    print(f"{args.job_id}: retry requested")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from dispatcher.ledger import Request, open_ledger
    from dispatcher.queued import queued_ids

    cfg = _config(args, required=False)
    layout = Layout(cfg.root)
    ledger = open_ledger(cfg, layout, patience_s=30)
    try:
        entry = ledger.get(args.job_id)
        if entry is not None and entry.state in ("done", "failed"):
            raise WrongState(f"{args.job_id}: is {entry.state}, only a queued or running job can be cancelled")
        if entry is None and not queued_ids(layout.inbox, [args.job_id]):
            raise NotFound(f"{args.job_id}: no such job")
        ledger.request(args.job_id, Request.CANCEL)
    finally:
        ledger.close()
    _poke(layout, "cancel", args.job_id)
    print(f"{args.job_id}: cancel requested")
    return 0


def _poke(layout: Layout, kind: str, job_id: str) -> None:
    """Drop a hint file so that a running daemon acts at once (the ledger is the truth)."""
    layout.control.mkdir(parents=True, exist_ok=True)
    path = layout.control / f"{kind}-{job_id}-{time.time_ns()}"
    path.write_bytes(b"")


def cmd_logs(args: argparse.Namespace) -> int:
    from dispatcher.logview import follow

    cfg = _config(args, required=True)
    if cfg.log_file is None:
        raise UsageError(f"{cfg.path}: log_file: not set, so there is no log file to read")
    return follow(cfg.log_file, job=args.job, forever=args.follow)


COMMANDS = {
    "init": cmd_init,
    "run": cmd_run,
    "submit": cmd_submit,
    "validate": cmd_validate,
    "status": cmd_status,
    "show": cmd_show,
    "retry": cmd_retry,
    "cancel": cmd_cancel,
    "logs": cmd_logs,
}
