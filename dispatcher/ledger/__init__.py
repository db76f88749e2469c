"""The durable job ledger: an interface (``base``) and its engines (SQLite; PostgreSQL for many hosts).

``dispatcher.store.ledgers.open_ledger`` picks the engine from the config.
"""
