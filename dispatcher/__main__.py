"""Run `python -m dispatcher`."""

from dispatcher.cli.main import main

main()
