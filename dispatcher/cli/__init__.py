"""The command line: argv in, exit code out (``dispatcher.cli.main``)."""

from dispatcher.cli.main import main

__all__ = ["main"]
