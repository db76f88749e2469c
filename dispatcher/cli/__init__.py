"""The command line: argv in, exit code out (``dispatcher.cli.main``)."""

import sys

from dispatcher import early, lean

if lean.runs_daemon(sys.argv):
    early.catch()  # a stop while it starts is a graceful one (section 9)
lean.without_openssl(sys.argv)  # `dispatcher run`: before anything imports hashlib or asyncio

from dispatcher.cli.main import main  # noqa: E402 - after the line above, on purpose

__all__ = ["main"]
