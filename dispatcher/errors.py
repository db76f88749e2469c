"""The exception hierarchy: one root, with the file and field a user must fix."""

from __future__ import annotations

import re

_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def oneline(text: str) -> str:
    """Return text with every control character and line break escaped (\\n, \\u2028, ...)."""
    if text.isascii() and text.isprintable():  # the usual case: nothing to escape
        return text
    return _BREAKS.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def cut(text: str, limit: int = 1000) -> str:
    """Return text, or its first ``limit`` characters and a note of how many more were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (cut, {len(text) - limit} more characters)"


def printable(name: str) -> str:
    """Return a file name that may hold undecodable bytes as displayable text."""
    if name.isascii() and name.isprintable():  # the usual case: nothing to decode or escape
        return name
    try:
        text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte (JSON's "\ud800"): show it escaped
        text = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return oneline(text)


class DispatchError(Exception):
    """The root of every error `dispatcher` reports to a user."""

    exit_code = 1


class UsageError(DispatchError):
    """Bad input from the user: an invalid order, config or argument (exit 2)."""

    exit_code = 2


class OrderError(UsageError):
    """A work order (or receipt, or follow-up) that breaks a rule of the contract.

    ``file`` is the name the user gave; ``field`` the dotted path of the field at
    fault, or None when no one field is.
    """

    def __init__(self, message: str, *, file: str = "", field: str | None = None) -> None:
        self.file = file
        self.field = field
        self.message = message
        super().__init__(self.render())

    @property
    def reason(self) -> str:
        """Return the error without the file name, as a refusal's `reason` says it (one line)."""
        text = f"{printable(self.field)}: {self.message}" if self.field else self.message
        return oneline(text)

    def render(self) -> str:
        """Return `<file>: <field>: <message>` (parts that are unknown are left out), one line."""
        return f"{printable(self.file)}: {self.reason}" if self.file else self.reason

    def with_file(self, file: str) -> OrderError:
        """Return the same error naming this file."""
        return type(self)(self.message, file=file, field=self.field)


class ConfigError(OrderError):
    """A config file that breaks a rule of the contract."""


class NotFound(DispatchError):
    """A job that does not exist (exit 1)."""


class WrongState(DispatchError):
    """A job that exists but is in the wrong state for the operation (exit 1)."""
