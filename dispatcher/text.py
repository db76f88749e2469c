"""Values as a person reads them: no Python notation (contract section 7).

`None` is `-`, a list is `a, b`, a whole float such as `3600.0` is `3600`, a
boolean is `true`/`false` as in the config file.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

# user:password@ in a URL (postgresql://u:secret@host/db), and password=... in a libpq keyword string
# the password runs to the `@` that starts the host: a raw `/` or `@` in it is still hidden
_URL_SECRET = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)\S*?(?=@[^\s@]*(?:[\s/?#]|$))")
_KEY_SECRET = re.compile(r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s'&]+)", re.IGNORECASE)


def is_utf8_text(text: str) -> bool:
    """Return True if text can be written as UTF-8: no lone surrogate (argv bytes that were no UTF-8, ``"\\udcff"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def number(value: float) -> str:
    """Return a number without a needless `.0` and without float noise (`0.1 + 0.2` is `0.3`)."""
    if isinstance(value, bool):
        return plain(value)
    if isinstance(value, int):
        return str(value)
    if value != value or value in (float("inf"), float("-inf")):  # NaN and infinities: no digits to show
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    text = f"{value:.15g}"
    return f"{Decimal(text):f}" if "e" in text else text  # 1.234e-05 is 0.00001234 for a person


def gate_lifts(until: Any) -> str:
    """Return when a gate lifts, for a person: its time, or `resumed` for a pause by hand (no time)."""
    return "resumed" if until is None else plain(until)


def plain(value: Any) -> str:
    """Return any JSON value as plain text for a person."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return number(value)
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={plain(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(plain(v) for v in value) or "-"
    return str(value)


def plural(n: int, word: str) -> str:
    """Return `1 agent`, `2 agents`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe(value: Any) -> str:
    """Return a short word for the JSON type of value, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def ago(seconds: float | None) -> str:
    """Return an age such as `38 s`, `12 min`, `5 h` or `3 d`; `-` when unknown."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 120 * 60:
        return f"{s // 60} min"
    if s < 48 * 3600:
        return f"{s // 3600} h"
    return f"{s // 86400} d"


def usd(value: float | None) -> str:
    """Return a cost such as `0.1235 USD` (4 decimals, or all a cost below that has); `-` when none was reported."""
    if value is None:
        return "-"
    return f"{number(value if 0 < abs(value) < 0.00005 else round(value, 4))} USD"  # never 0 USD for a cost


def redact(text: str) -> str:
    """Return text with every credential shown as ``***``: a URL's password, a ``password=`` value.

    ``postgresql://dispatcher:s3cret@db/dispatcher`` becomes
    ``postgresql://dispatcher:***@db/dispatcher``. Cheap when there is nothing to hide.
    """
    if "://" in text:  # the tests of may_hold_secret, one for each pattern
        text = _URL_SECRET.sub(r"\g<head>***", text)
    if "assword" in text or "ASSWORD" in text:
        text = _KEY_SECRET.sub(r"\g<head>***", text)
    return text


def may_hold_secret(text: str) -> bool:
    """Return False when redact leaves text as it is and would leave any part of it so.

    The test is for ASCII words alone, which JSON writes as they are: when a line of JSON
    gives False, none of its strings has anything to hide.
    """
    return "://" in text or "assword" in text or "ASSWORD" in text


def exit_text(code: Any) -> str:
    """Return how a process ended: `exit 3`, or `killed by SIGTERM` for a negative (signal) code."""
    if isinstance(code, int) and not isinstance(code, bool) and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {plain(code)}"


#: bidirectional controls: printed as they are, they make the text around them read in another order
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_bidi(text: str) -> str:
    """Return text with each bidirectional control written as its escape (``\\u202e``)."""
    return text if text.isascii() else _BIDI.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)


class BidiSafe:
    """A text stream that writes bidirectional controls escaped, for output meant for a person.

    Stored text keeps them (a reason in Hebrew or Arabic may need them); only what a command
    shows is escaped, so that a task or reason holding U+202E cannot make a line read otherwise.
    Everything but writing is the wrapped stream's.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write text, its bidirectional controls escaped."""
        return int(self._stream.write(escape_bidi(text)))

    def writelines(self, lines: Any) -> None:
        """Write each line, as ``write`` does."""
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def is_count(text: str) -> bool:
    """Return True for 1 to 20 ASCII digits (an inode number has up to 20): a count ``int`` reads, never raising.

    ``str.isdigit`` is true for ``²`` and for 5,000 digits, which ``int`` refuses; a
    header, a query, a file name or a variable read with ``int`` is tested with this.
    """
    return 0 < len(text) <= 20 and text.isascii() and text.isdigit()
