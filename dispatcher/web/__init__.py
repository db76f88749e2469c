"""The web view of a dispatch root (contract section 17): pages, a JSON API, actions behind a token.

The top layer beside ``cli``: it reads through ``query`` and acts through
``ops`` and ``job.review``, exactly as the commands do; only the ``web``
command imports it.
"""
