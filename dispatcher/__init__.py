"""dispatcher: a folder-watching daemon that hands work orders to agents and verifies their receipts."""

__version__ = "0.1.0"
