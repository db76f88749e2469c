"""The command line: argv in, exit code out (``dispatcher.cli.main``)."""

import sys

from dispatcher import lean

lean.without_openssl(sys.argv)  # `dispatcher run`: before anything imports hashlib or asyncio

from dispatcher.cli.main import main  # noqa: E402 - after the line above, on purpose

__all__ = ["main"]
