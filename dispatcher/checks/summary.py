"""Summarise the records of an accept.output file into the little the checks need.

An output may hold millions of records; output_rows, receipt_outputs and
allowed_values need only: how many records carry each item id, the ids that are
not item ids, how many records have no id, the first record that breaks
``accept.required`` or ``accept.allowed``, and the record count. A Summariser
takes records one at a time (``output_stream`` feeds it while reading the file)
and ``result()`` returns a small immutable OutputSummary. Ids that are not item
ids are kept up to ``OTHERS_MAX`` distinct ones; the records of any further ones
are only counted, and the checks say so. Pure: no filesystem, no clock.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dispatcher.errors import cut
from dispatcher.spec.order import Accept, Order

OTHERS_MAX = 1000
_KEY_MAX = 256  # longer ids are compared by digest, so a kept id costs little memory
_SHOWN_MAX = 200  # characters of an id or value kept for a detail
LIST_CHARS = 300  # a list in a detail names ids up to about this many characters, then counts the rest


def id_key(value: Any) -> Any:
    """Return a hashable key for a JSON value that tells "1", 1 and true apart."""
    if isinstance(value, str):
        return value
    return (type(value).__name__, json.dumps(value, sort_keys=True))


def value_key(value: Any) -> Any:
    """Return a hashable key for a value of a record checked against accept.allowed.

    Like ``id_key``, but a number equals the same number written otherwise (``1`` and ``1.0``),
    never ``true`` or ``"1"``.
    """
    if value.__class__ is str:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("number", value)  # 1 == 1.0 and they hash alike
    return id_key(value)


def text_forms(values: Sequence[Any]) -> set[str]:
    """Return how a CSV cell writes each allowed value that is no string: ``2``, ``1.5``, ``true``, ``null``.

    A CSV file holds only text; an order's ``allowed: {level: [1, 2]}`` allows the cell ``2``.
    """
    return {v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values}


def stored_key(value: Any) -> Hashable:
    """Return ``id_key(value)``, or a digest of it when it is long; equal values give equal keys."""
    key = id_key(value)
    text = key if isinstance(key, str) else key[1]
    if len(text) <= _KEY_MAX:
        return key  # type: ignore[no-any-return]
    kind = "str" if isinstance(key, str) else key[0]
    return (kind, "sha256", hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())


def is_empty(value: Any) -> bool:
    """Return True for a value a required field may not have: missing, null, "", [] or {}."""
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def listed(texts: Sequence[str], unknown: int = 0) -> str:
    """Return texts joined by commas, the tail cut to a count so that a detail stays short.

    ``unknown`` is how many more records hold ids that were only counted, not kept.
    """
    names: list[str] = []
    size = 0
    for text in texts:
        if names and size + len(text) > LIST_CHARS:
            break
        names.append(text)
        size += len(text) + 2
    out = ", ".join(names)
    rest = len(texts) - len(names)
    notes = [f"cut, {rest} more"] if rest else []
    if unknown:
        notes.append(f"{'and ' if rest else ''}{unknown} more records with other ids")
    return f"{out} ({', '.join(notes)})" if notes else out


def shown(value: Any) -> str:
    """Return a value as a detail shows it, cut to fit: in JSON ("text", 12, true, null, [1, 2]), never Python's."""
    return _writable(cut(json.dumps(value, ensure_ascii=False, default=str), _SHOWN_MAX))


def id_shown(value: Any) -> str:
    """Return an id as a list in a detail names it: a string as it is (A, B), any other value as JSON (1, null).

    A string that would read as another value or as nothing ("1", "true", "", " R1") is quoted,
    so that the id 1 and the id "1" never look alike in one detail.
    """
    if not isinstance(value, str):
        return shown(value)
    return shown(value) if _AMBIGUOUS.fullmatch(value) or value != value.strip() else _writable(cut(value, _SHOWN_MAX))


#: strings an id list would show as a JSON number, a literal, or nothing
_AMBIGUOUS = re.compile(r"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def _writable(text: str) -> str:
    """Return text with each lone surrogate written as its escape (``\\ud800``): a detail is written as UTF-8."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True, slots=True)
class BadValue:
    """The first record that breaks accept.required (``required``) or accept.allowed."""

    record_id: str
    field: str
    value: str
    required: bool

    def describe(self) -> str:
        """Return the allowed_values detail for this record."""
        if self.required:
            return f"record {self.record_id}: required field {self.field} is empty"
        if self.value == "missing":
            return f"record {self.record_id}: {self.field} is missing"
        return f"record {self.record_id}: {self.field} {self.value} is not allowed"


@dataclass(frozen=True, slots=True)
class OutputSummary:
    """What the checks know about an output file, whatever its size.

    ``item_counts`` maps every item id of the order to the records carrying it;
    ``others`` maps the stored key of each other id (the first ``OTHERS_MAX``
    distinct ones) to its shown form and record count; ``uncounted`` is how many
    records carry an other id that was not kept; ``no_id`` how many lack the key
    field or hold null in it.
    """

    records: int
    item_counts: Mapping[str, int]
    others: Mapping[Hashable, tuple[str, int]]
    uncounted: int
    no_id: int
    first_bad: BadValue | None

    @property
    def complete(self) -> bool:
        """Return True when every id of the output is known (none was only counted)."""
        return self.uncounted == 0

    @property
    def one_per_item(self) -> bool:
        """Return True when every item id is in exactly one record and no record holds another id or none."""
        counts = self.item_counts
        plain = not self.others and not self.uncounted and not self.no_id  # every record holds an item id
        return plain and self.records == len(counts) and 0 not in counts.values()

    def id_counts(self) -> Counter[Hashable]:
        """Return the known ids of the output as a multiset of stored keys."""
        have: Counter[Hashable] = Counter({k: n for k, n in self.item_counts.items() if n})
        have.update({k: n for k, (_, n) in self.others.items()})
        if self.no_id:
            have[stored_key(None)] = self.no_id
        return have

    def shown_ids(self) -> dict[Hashable, str]:
        """Return the shown form of each known id, by stored key (a record without one: null)."""
        out: dict[Hashable, str] = {k: id_shown(k) for k, n in self.item_counts.items() if n}
        out.update({k: text for k, (text, _) in self.others.items()})
        if self.no_id:
            out[stored_key(None)] = "null"
        return out

    def problems(self, want: Sequence[str]) -> list[str]:
        """Return what is wrong against the item ids: missing, extra and repeated ids, records without one."""
        missing = [i for i in want if not self.item_counts.get(i)]
        extra = sorted(text for text, _ in self.others.values())
        repeated = sorted(
            [id_shown(i) for i, n in self.item_counts.items() if n > 1]
            + [text for text, n in self.others.values() if n > 1]
        )
        out = []
        if missing:
            out.append("missing " + listed([id_shown(i) for i in missing]))
        if extra or self.uncounted:
            out.append("extra " + listed(extra, self.uncounted))
        if repeated:
            out.append("repeated " + listed(repeated))
        if self.no_id:
            out.append(f"none in {self.no_id} record{'s' if self.no_id != 1 else ''}")
        return out


class Summariser:
    """Take an output's records one at a time; ``result()`` gives the OutputSummary."""

    def __init__(self, item_ids: Sequence[str], accept: Accept, *, text: bool = False) -> None:
        """``text``: the records are CSV rows, every value text (an allowed ``2`` allows the cell ``2``)."""
        self._key = accept.key
        self._items = dict.fromkeys(item_ids, 0)
        self._required = accept.required
        self._allowed = {
            name: frozenset(text_forms(values) if text else map(value_key, values))
            for name, values in (accept.allowed or {}).items()
        }
        self._others: dict[Hashable, tuple[str, int]] = {}
        self._records = 0
        self._uncounted = 0
        self._no_id = 0
        self._bad: BadValue | None = None
        self._checking = bool(self._required or self._allowed)

    def add(self, record: Mapping[Any, Any]) -> None:
        """Count one record (a mapping of field to value)."""
        # Called once per record of files with millions of them: kept lean on purpose.
        self._records += 1
        rid = record.get(self._key)
        if rid.__class__ is str and rid in self._items:
            self._items[rid] += 1
        elif rid is None:
            self._no_id += 1
        else:
            self._other(rid)
        if self._checking:
            self._bad = self._check(rid, record)
            self._checking = self._bad is None

    def _other(self, rid: Any) -> None:
        key = rid if rid.__class__ is str and len(rid) <= _KEY_MAX else stored_key(rid)
        seen = self._others.get(key)
        if seen is not None:
            self._others[key] = (seen[0], seen[1] + 1)
        elif len(self._others) < OTHERS_MAX:
            self._others[key] = (id_shown(rid), 1)
        else:
            self._uncounted += 1

    def _check(self, rid: Any, record: Mapping[Any, Any]) -> BadValue | None:
        for name in self._required:
            if is_empty(record.get(name)):
                return BadValue(id_shown(rid), name, "", required=True)
        for name, allowed in self._allowed.items():
            value = record.get(name)
            if (value if value.__class__ is str else value_key(value)) not in allowed:
                seen = "missing" if name not in record else shown(value)
                return BadValue(id_shown(rid), name, seen, required=False)
        return None

    def result(self) -> OutputSummary:
        """Return the summary of every record added so far."""
        return OutputSummary(
            records=self._records,
            item_counts=dict(self._items),
            others=dict(self._others),
            uncounted=self._uncounted,
            no_id=self._no_id,
            first_bad=self._bad,
        )


def summarise(order: Order, records: Iterable[Mapping[Any, Any]]) -> OutputSummary:
    """Return the summary of records (already parsed) against the order's items and accept."""
    summariser = Summariser(order.item_ids, order.accept)
    for record in records:
        summariser.add(record)
    return summariser.result()
