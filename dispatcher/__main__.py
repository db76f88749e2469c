"""Run `python -m dispatcher`."""

from dispatcher.cli import main

main()
