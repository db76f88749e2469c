"""`dispatcher run`: load the config, set up the logs, and serve the daemon until it stops."""

from __future__ import annotations

import argparse
from pathlib import Path

from dispatcher import logs
from dispatcher.core.daemon import Daemon
from dispatcher.errors import ConfigError
from dispatcher.spec.config import load_config, require_config, require_root


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon on an existing root (its missing folders are made; main() set the umask)."""
    path = require_config(args.config)
    cfg = load_config(path, root=Path(args.root) if args.root else None)
    require_root(cfg)
    try:
        logs.configure(log_file=cfg.log_file)
    except OSError as exc:
        raise ConfigError(f"cannot open {cfg.log_file}: {exc.strerror}", file=str(path), field="log_file") from None
    return Daemon(cfg, config_path=path, root_override=Path(args.root) if args.root else None, once=args.once).serve()
